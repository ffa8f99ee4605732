"""Accountable grouped rounds: validation after the round at both levels (issue 26).

* **Level 2** (a leader's result over the slice owners' cross contributions) is an ordinary accountable part of
  the slice's cross spec: :func:`.audit.validate_round` on the cross service (validators drawn in the cross set).
* **Level-1 drops**: every member of a group that holds a slice owner's receipt of its push checks the push is in
  the owner's signed level-1 commitment (:mod:`.group_commitment`, fetched alone from the leader that counted the
  owner's ``X``: ``PullInputs`` with ``commitments_only``); a receipted push left out is a handoff-drop proof
  (:mod:`.handoff_drop`), verified here before it is returned (:func:`check_handoff_drops`). The same fetches
  cover a group part twice where two cross parts (two leaders) overlap it: two lists of the owner for it that
  differ are a handoff-equivocation proof (:mod:`.handoff_equivocation`), at no extra fetch.
* **Level 1** (a slice owner's group aggregate, handed on as its signed cross contribution ``X``): the members of
  its group drawn by :func:`.handoff.handoff_validators` fetch ``X`` (one input of the leader's result: from the
  leader, ``PullInputs`` with ``first``/``count``, its hash checked against the leader's signed list) and the group
  contributions ``X`` commits to (from the slice owner's ``PullInputs`` on the group service, else each from its
  sender, the owner's own from its witness), then re-run the group rule and the encoding in a worker thread
  (:func:`.handoff.recheck_handoff`). A mismatch is a handoff proof, verified here before it is returned.

Never raises for what a peer does: a refusal or a timeout is a ``withheld`` / ``unvalidatable`` finding.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any, Optional

from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import accountable, audit, handoff, handoff_drop, handoff_equivocation
from geomesh_p2p.exchange.audit import Finding
from geomesh_p2p.exchange.commitment import (
    DIGEST_BYTES,
    InputsError,
    contribution_digest,
    decode_inputs,
    participant_order,
)
from geomesh_p2p.exchange.group_commitment import commitment_of_contribution, open_commitment
from geomesh_p2p.exchange.partition import CollectiveSpec
from geomesh_p2p.net.identity import EnvelopeError, Verifier
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.wire import collective_pb2

if TYPE_CHECKING:
    from geomesh_p2p.exchange.groups import GroupedCollective

__all__ = ["validate_grouped", "validate_handoffs", "check_handoff_drops"]

log = logging.getLogger(__name__)


async def validate_grouped(
    gc: "GroupedCollective", round: int, *, timeout_s: float = 10.0, parts: Optional[list[int]] = None
) -> list[Finding]:
    """Every validation of accountable ``round`` this node is drawn for: the flat service's (a one-group round),
    the cross level's (level 2) and the hand-offs of its group's slice owners (level 1, skipped when ``parts`` is
    given). ``timeout_s``: the deadline of each part's pulls. Returns the findings (proofs verified here)."""
    out = list(await gc.flat.validate_round(round, timeout_s=timeout_s, parts=parts))
    out += await gc.cross.validate_round(round, timeout_s=timeout_s, parts=parts)
    if parts is None:
        out += await validate_handoffs(gc, round, timeout_s=timeout_s)
        out += await check_handoff_drops(gc, round, timeout_s=timeout_s)
    return out


def _cross_results(gc: "GroupedCollective", cross_specs: list[CollectiveSpec], round: int) -> dict:
    """(slice, part) -> the leader-signed cross result this node holds (its own slice's from the cross service)."""
    got = gc.gathered.get(round, {})
    state = gc.cross._rounds.get(round)
    out: dict[tuple[int, int], bytes] = {}
    for c, xs in enumerate(cross_specs):
        for k in range(len(xs.owners)):
            signed = got.get((xs.spec_id, k))
            if signed is None and state is not None and state.spec.spec_id == xs.spec_id:
                signed = gc.cross.signed_result(round, k)
            if signed is not None:
                out[(c, k)] = bytes(signed)
    return out


async def validate_handoffs(gc: "GroupedCollective", round: int, *, timeout_s: float = 10.0) -> list[Finding]:
    """Level 1: the hand-offs of this node's group's slice owners it is drawn to check
    (:func:`.handoff.handoff_validators`, a seed over every cross result's hash), one cross part at a time.
    Returns the findings: ``forgery`` with a handoff proof, or ``withheld`` / ``unvalidatable`` suspicions."""
    levels = gc.levels.get(round)
    if levels is None:
        return []
    spec, layout, group_specs, cross_specs = levels
    me = gc.peer_id
    g = layout.group_of(me)
    gspec = group_specs[g]
    results = _cross_results(gc, cross_specs, round)
    hashes: list[Optional[bytes]] = []
    opened: dict[tuple[int, int], Any] = {}
    for c, xs in enumerate(cross_specs):
        for k in range(len(xs.owners)):
            signed = results.get((c, k))
            try:
                o = None if signed is None else accountable.open_result(gc.cross._inner, signed, len(xs.participants))
            except EnvelopeError:
                o = None
            hashes.append(None if o is None else o.payload_sha256)
            if o is not None:
                opened[(c, k)] = o
    findings: list[Finding] = []
    for c, owner in enumerate(layout.slice_owners[g]):
        xs = cross_specs[c]
        for k in range(len(xs.owners)):
            if owner == me or me not in handoff.handoff_validators(gspec, owner, hashes, k):
                continue
            if (c, k) not in opened:
                continue  # no leader result here: nothing the owner handed on was applied
            findings += await _validate_handoff(gc, gspec, xs, k, owner, opened[(c, k)], swarm_time() + timeout_s)
    for f in findings:
        audit._report(gc.group, f)
    return findings


async def _validate_handoff(
    gc: "GroupedCollective", gspec: CollectiveSpec, xs: CollectiveSpec, k: int, owner: str, leader_result, deadline
) -> list[Finding]:
    x, why = await _fetch_x(gc, xs, k, owner, leader_result, deadline)
    if x is None:
        return [Finding("unvalidatable", owner, gspec.round, k, f"its cross contribution was not served: {why}")]
    try:
        _, c = await asyncio.to_thread(handoff.open_handoff, gc.cross._inner, xs, x)
        parts = handoff.overlapping_parts(gspec, owner, xs, k)
    except handoff.HandoffError as e:
        return [Finding("unvalidatable", owner, gspec.round, k, str(e))]
    if len(c.group_inputs) != len(parts):
        parts_inputs: list[list[bytes]] = [[] for _ in parts]  # the count mismatch is proven by X alone
    else:
        parts_inputs = []
        for j, listed in zip(parts, c.group_inputs):
            got, why = await _group_inputs(gc, gspec, j, listed, deadline)
            if got is None:
                return [Finding("unvalidatable", owner, gspec.round, k, f"group part {j}: {why}")]
            parts_inputs.append(got)
    try:
        forged = await asyncio.to_thread(handoff.recheck_handoff, gc.group._inner, gspec, xs, x, parts_inputs)
    except handoff.HandoffError as e:
        return [Finding("unvalidatable", owner, gspec.round, k, str(e))]
    if forged is None:
        return []
    proof = handoff.handoff_proof(gspec, xs, x, parts_inputs)
    verdict = await asyncio.to_thread(accountable.verify_proof, gspec.run_id, proof)
    return [Finding("forgery", verdict.accused, gspec.round, k, verdict.reason, proof)]


async def _fetch_x(
    gc: "GroupedCollective", xs: CollectiveSpec, k: int, owner: str, leader_result, deadline: float
) -> tuple[Optional[bytes], str]:
    """The slice owner's signed contribution to cross part ``k``, the one the leader's signed result commits to:
    from the leader (``PullInputs`` of that one input), its hash checked here."""
    order = participant_order(xs.participants)
    pos = next((n for n, e in enumerate(leader_result.entries) if order[e.index] == owner), None)
    if pos is None:
        return None, "the leader's result does not list the slice owner"
    want = leader_result.entries[pos].digest
    leader = xs.owners[k]
    left = deadline - swarm_time()
    if left <= 0:
        return None, "no time left"
    req = collective_pb2.PullInputsRequest(round=xs.round, part=k, spec_id=xs.spec_id, first=pos, count=1)
    try:
        reply = await gc.cross.transport.call(
            leader.address, gc.cross.methods.inputs, req.SerializeToString(), round=xs.round, timeout=left
        )
        resp = await asyncio.to_thread(collective_pb2.PullInputsResponse.FromString, reply.payload)
    except RpcError as e:
        return None, f"the leader refused: {e.code.name}: {e.reason}"
    except DecodeError:
        return None, "the leader's reply is malformed"
    if not resp.contributions or contribution_digest(resp.contributions[0])[:DIGEST_BYTES] != want:
        return None, "the leader served another contribution than the one its result commits to"
    return bytes(resp.contributions[0]), ""


async def _group_inputs(
    gc: "GroupedCollective", gspec: CollectiveSpec, j: int, listed: bytes, deadline: float
) -> tuple[Optional[list[bytes]], str]:
    """Group part ``j``'s contributions that ``listed`` (an input list of ``X``) commits to, in its order: from the
    part's owner (half the time left), else from their holders (:func:`.audit._fetch_held`)."""
    svc = gc.group
    state = svc._rounds.get(gspec.round)
    if state is None or state.spec.spec_id != gspec.spec_id:
        return None, "this node holds no state of the group spec"
    try:
        entries = decode_inputs(listed, len(gspec.participants))
    except InputsError as e:
        return None, f"its input list is malformed: {e}"
    want = [e.digest for e in entries]
    own = bytes(audit.messages.push_request_contribution(state.pushed[j])) if j in state.pushed else None
    mid = swarm_time() + (deadline - swarm_time()) / 2
    got, why = await audit._pull_inputs(svc, gspec, j, mid, own)
    if got is not None and [contribution_digest(c)[:DIGEST_BYTES] for c in got] == want:
        return [bytes(c) for c in got], ""
    order = participant_order(gspec.participants)
    owner = gspec.owners[j].peer_id
    witness = accountable.witness_of(gspec, j)
    addresses = {o.peer_id: o.address for o in gspec.owners}
    out: dict[int, bytes] = {}
    for n, entry in enumerate(entries):
        sender = order[entry.index]
        holder = witness.peer_id if sender == owner and witness is not None else sender
        held, why_h = await audit._fetch_held(svc, state, j, holder, addresses.get(holder), deadline)
        match = [c for c in held or [] if contribution_digest(c)[:DIGEST_BYTES] == entry.digest]
        if not match:
            return None, f"input {n} not served by the owner ({why or 'other bytes'}) nor its holder ({why_h})"
        out[n] = bytes(match[0])
    return [out[n] for n in range(len(entries))], ""


async def check_handoff_drops(gc: "GroupedCollective", round: int, *, timeout_s: float = 10.0) -> list[Finding]:
    """Level-1 drops: for each slice owner of this node's group that receipted this node's group push (its
    receipts, ``state.receipts``) and whose cross contribution ``X`` a leader counted (listed, not filtered out, in
    the leader-signed cross result read in the all-gather: else the drop changed nothing), fetch ``X``'s signed
    commitment from that leader (one ``PullInputs`` with ``commitments_only`` per cross part; ``timeout_s``: the
    deadline of them all) and check each receipted push of the parts it covers is listed as receipted
    (:func:`.handoff_drop.drop_problem`), and that the owner's commitments fetched here list the same inputs for each
    receipted group part several cross parts overlap (:func:`_check_equivocation`). Returns ``drop`` findings with a
    handoff-drop proof and ``equivocation`` findings with a handoff-equivocation proof (verified here), and an
    ``unvalidatable`` finding against the leader for a commitment it counted and did not serve (a suspicion, never
    acted on: nothing is proven from it). Counts the fetches and bytes
    received in ``gc.drop_checks[round]``."""
    levels = gc.levels.get(round)
    state = gc.group._rounds.get(round)
    if levels is None or state is None or not state.receipts:
        return []
    spec, layout, group_specs, cross_specs = levels
    me = gc.peer_id
    g = layout.group_of(me)
    gspec = group_specs[g]
    if state.spec.spec_id != gspec.spec_id:
        return []
    results = _cross_results(gc, cross_specs, round)
    verifier = Verifier(gspec.run_id, max_skew_s=math.inf)  # checked after the round: the signing time is past
    deadline = swarm_time() + timeout_s
    findings: list[Finding] = []
    calls = received = 0
    for c, owner in enumerate(layout.slice_owners[g]):
        mine = {j: rc for j, rc in state.receipts.items() if gspec.owners[j].peer_id == owner}
        seen: dict[int, tuple[Any, bytes]] = {}  # group part -> (its list, the commitment) first seen here
        if owner == me or not mine:
            continue
        xs = cross_specs[c]
        order = participant_order(xs.participants)
        for k in range(len(xs.owners)):
            try:
                parts = [j for j in handoff.overlapping_parts(gspec, owner, xs, k) if j in mine]
                res = (
                    None
                    if (c, k) not in results
                    else accountable.open_result(gc.cross._inner, results[(c, k)], len(order))
                )
            except (handoff.HandoffError, EnvelopeError):
                continue
            pos = (
                None
                if res is None
                else next((n for n, e in enumerate(res.entries) if order[e.index] == owner and not e.dropped), None)
            )
            if not parts or pos is None:
                continue  # no receipt of this node here, or the leader did not count X: the drop changed nothing
            signed, n_bytes = await _fetch_commitment(gc, xs, k, pos, deadline)
            calls, received = calls + 1, received + n_bytes
            try:
                cm = open_commitment(verifier, signed)
            except EnvelopeError as e:  # a suspicion of the leader that counted X and did not serve its commitment
                log.debug("round %d: cross part %d: no commitment of %s checked: %s", round, k, owner[:10], e.reason)
                unserved = f"the level-1 commitment of {owner[:10]} it counted was not served: {e.reason}"
                findings.append(Finding("unvalidatable", xs.owners[k].peer_id, round, k, unserved))
                continue
            findings += await _check_equivocation(gspec, xs, cm, signed, parts, seen)
            for j in parts:
                try:
                    why = handoff_drop.drop_problem(gspec, xs, cm, mine[j])
                except handoff.HandoffError as e:
                    log.debug("round %d: group part %d: drop check of %s: %s", round, j, owner[:10], e)
                    continue
                if why is not None:
                    proof = handoff_drop.handoff_drop_proof(gspec, xs, mine[j].signed, signed)
                    verdict = await asyncio.to_thread(accountable.verify_proof, gspec.run_id, proof)
                    findings.append(Finding("drop", verdict.accused, round, j, verdict.reason, proof))
    gc.drop_checks[round] = (calls, received)
    for f in findings:
        if f.proof is not None:  # a leader gone at the run's end is no news: the suspicion is counted, not logged
            audit._report(gc.group, f)
    return findings


async def _check_equivocation(
    gspec: CollectiveSpec, xs: CollectiveSpec, cm: Any, signed: bytes, parts: list[int], seen: dict
) -> list[Finding]:
    """Level-1 equivocation: compare the lists slice owner's commitment ``cm`` (``signed``: its bytes) carries for
    the receipted group ``parts`` with those of the first commitment of the same owner seen for each (``seen``,
    updated); a difference is a handoff-equivocation proof (verified here), one per group part. Costs no fetch:
    every commitment covering a receipted part is fetched for the drop check anyway."""
    out: list[Finding] = []
    try:
        lists = handoff_equivocation.lists_by_part(gspec, xs, cm)
    except handoff.HandoffError as e:  # a count or format matter of X itself: the hand-off check's
        log.debug("round %d: equivocation check of %s: %s", gspec.round, cm.owner[:10], e)
        return out
    for j in parts:
        if j not in seen:
            seen[j] = (lists.get(j), signed)
            continue
        first, first_signed = seen[j]
        if first is None or lists.get(j) == first:
            continue
        seen[j] = (None, b"")  # one proof per group part is enough
        proof = handoff_equivocation.handoff_equivocation_proof(gspec, xs, first_signed, signed)
        try:
            verdict = await asyncio.to_thread(accountable.verify_proof, gspec.run_id, proof)
        except accountable.ProofError as e:  # the other commitment covers no common part: nothing to prove
            log.debug("round %d: group part %d: equivocation of %s not proven: %s", gspec.round, j, cm.owner[:10], e)
            continue
        out.append(Finding("equivocation", verdict.accused, gspec.round, verdict.part, verdict.reason, proof))
    return out


async def _fetch_commitment(
    gc: "GroupedCollective", xs: CollectiveSpec, k: int, pos: int, deadline: float
) -> tuple[bytes, int]:
    """(the signed level-1 commitment of input ``pos`` of cross part ``k``, the reply's bytes): from the part's leader
    (this node's own copy when it leads the part); b"" when it is not served in time."""
    leader = xs.owners[k]
    if leader.peer_id == gc.peer_id:
        state = gc.cross._rounds.get(xs.round)
        part = None if state is None else state.parts.get(k)
        held = None if part is None or pos >= len(part.inputs) else part.inputs[pos]
        return (b"", 0) if held is None else (commitment_of_contribution(held), 0)
    left = deadline - swarm_time()
    if left <= 0:
        return b"", 0
    req = collective_pb2.PullInputsRequest(
        round=xs.round, part=k, spec_id=xs.spec_id, first=pos, count=1, commitments_only=True
    )
    try:
        reply = await gc.cross.transport.call(
            leader.address, gc.cross.methods.inputs, req.SerializeToString(), round=xs.round, timeout=left
        )
        resp = collective_pb2.PullInputsResponse.FromString(reply.payload)  # small: a few hundred bytes
    except (RpcError, DecodeError):
        return b"", 0
    return (bytes(resp.contributions[0]) if resp.contributions else b""), len(reply.payload)
