"""Accountable mode's validation after the round (BTARD's validators, Gorbunov et al., ICML 2022, section
3.2): this node re-checks the parts it is drawn for (:func:`~.accountable.draw_validators`), off the round's
critical path. For each such part it pulls the signed inputs from the owner (``PullInputs``, with a
deadline), recomputes the robust rule and the encoding bit for bit in a worker thread
(:func:`~.accountable.recheck_part`), and compares its copy of the owner's result with one other serving
peer's cached copy (an equivocation check: one result more).

When the owner withholds (refuses, stalls past half the deadline, or serves other bytes), the inputs are
fetched from the others that hold them (``PullInputs(from_sender)``): each sender keeps its signed push for
the kept rounds, and the part's *witness* (:func:`~.accountable.witness_of`) keeps the owner's own
contribution, whose receipt every reader requires in the result. The inputs authenticate themselves (signed
by their senders, their hashes in the owner's signed list), so the forgery proof is the same as from the owner:
a forger that withholds is caught as often as one that serves (issue 26, red team of session 15).

Outcomes (:class:`Finding`): ``forgery`` / ``equivocation`` carry a self-contained proof (already re-checked
here with :func:`~.accountable.verify_proof`, the check every peer makes before acting on it); ``withheld``
(the owner did not serve its inputs, the senders did: the part was checked) and ``unvalidatable`` (an input
nobody served with the committed hash: an owner colluding with a sender or its witness, or a client-only
sender) are suspicions without proof: logged, counted (:class:`ValidationStats`), never an exclusion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import accountable, messages
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.commitment import DIGEST_BYTES, contribution_digest, participant_order
from geomesh_p2p.exchange.owner import _RoundState
from geomesh_p2p.exchange.partition import VALIDATION_BYTES, _pid_bytes, _short
from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.telemetry import events
from geomesh_p2p.wire import collective_pb2

if TYPE_CHECKING:
    from geomesh_p2p.exchange.client import CollectiveService

__all__ = ["Finding", "ValidationStats", "validate_round"]

log = logging.getLogger(__name__)

#: Envelope and header bytes of one signed contribution beyond its packet (generous: signatures, keys, fields).
INPUT_OVERHEAD_BYTES = 4096
#: Parts validated at once by one peer (each holds its inputs while the rule is re-run: see VALIDATION_BYTES).
CONCURRENT_PARTS = 2
#: At most this many PullInputs pages per part (a hostile owner must not keep a validator paging forever).
MAX_PAGES = 4096
#: Holders asked at once for their copies of one part's inputs when its owner withholds.
SENDER_FETCHES = 8
#: Rounds whose validation figures a service keeps (``CollectiveService.validation_stats``).
STATS_KEPT = 8


@dataclass
class ValidationStats:
    """What this peer's validation of one round did (the round's row shows it: ``extra["validation"]``).

    Attributes:
        round: the validated round.
        parts: parts validated (drawn for this peer and applied here).
        from_owner: inputs fetched from the parts' owners (PullInputs).
        from_senders: inputs fetched from their senders or the part's witness (the owner withheld).
        proofs: proofs found (forgery, equivocation), each verified here.
        suspicions: parts whose owner withheld its inputs but the senders' copies were complete.
        unvalidatable: parts with an input nobody served (or not matching): a suspicion, never acted on.
        bytes: signed input bytes fetched or read for the validation.
    """

    round: int
    parts: int = 0
    from_owner: int = 0
    from_senders: int = 0
    proofs: int = 0
    suspicions: int = 0
    unvalidatable: int = 0
    bytes: int = 0

    def as_dict(self) -> dict:
        """The figures as a plain dict (a row's ``extra``)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Finding:
    """What validating one part found against its owner.

    Attributes:
        kind: ``"forgery"``, ``"equivocation"``, ``"drop"`` (with ``proof``), ``"withheld"`` or ``"unvalidatable"``
            (suspicions, no proof).
        owner: base58 PeerID of the part's owner.
        round / part: the part.
        reason: one line.
        proof: AccountabilityProof bytes (verified here), or None for a suspicion.
    """

    kind: str
    owner: str
    round: int
    part: int
    reason: str
    proof: Optional[bytes] = None


async def validate_round(
    service: "CollectiveService", round: int, *, timeout_s: float = 10.0, parts: Optional[Iterable[int]] = None
) -> list[Finding]:
    """Validate the parts of accountable ``round`` this node is drawn for (or only those in ``parts``),
    :data:`CONCURRENT_PARTS` at a time; returns the findings (none when every drawn part's result is the rule over its inputs).

    ``timeout_s``: the deadline of each part's pulls (inputs and the equivocation check), from its start.
    Never raises for what an owner does (a refusal or a timeout is a ``withheld`` finding); a round not held
    here, or not accountable, gives ``[]``."""
    state = service._rounds.get(round)
    if state is None or state.spec.mode != "accountable":
        return []
    spec = state.spec
    hashes = [state.result_hashes.get(j) for j in range(len(spec.owners))]
    wanted = None if parts is None else set(parts)
    checked: list[int] = []
    for j in range(len(spec.owners)):
        if wanted is not None and j not in wanted:
            continue
        if spec.owners[j].peer_id == service.peer_id or j not in state.result_hashes or j not in state.cache:
            continue  # own part, or a part this node did not apply
        if service.peer_id in accountable.draw_validators(spec, hashes, j, spec.validators_per_part):
            checked.append(j)
    slots = asyncio.Semaphore(CONCURRENT_PARTS)
    stats = ValidationStats(round)

    async def one(j: int) -> list[Finding]:
        async with slots:
            return await _validate_part(service, state, j, state.cache[j], hashes, timeout_s, stats)

    findings = [f for fs in await asyncio.gather(*(one(j) for j in checked)) for f in fs]
    service.validation_stats[round] = stats
    while len(service.validation_stats) > STATS_KEPT:
        del service.validation_stats[min(service.validation_stats)]
    for f in findings:
        _report(service, f)
    if checked:
        events.emit(
            log,
            logging.DEBUG,
            "parts_validated",
            "round %d: validated parts %s: %d finding(s)",
            round,
            checked,
            len(findings),
            peer=service.peer_id,
            round=round,
            parts=checked,
            findings=len(findings),
        )
    return findings


async def _validate_part(
    service: "CollectiveService",
    state: _RoundState,
    j: int,
    signed: wire.Buffer,
    hashes: list[Optional[bytes]],
    timeout_s: float,
    stats: "ValidationStats",
) -> list[Finding]:
    spec, owner = state.spec, state.spec.owners[j]
    start = swarm_time()
    deadline = start + timeout_s
    out: list[Finding] = []
    forged: Optional[str] = None
    stats.parts += 1
    # the owner gets half the budget: one that stalls must leave the time to ask the senders
    own = bytes(messages.push_request_contribution(state.pushed[j])) if j in state.pushed else None
    inputs, why = await _pull_inputs(service, spec, j, start + timeout_s / 2, own)
    if inputs is not None:
        stats.from_owner += len(inputs)
        stats.bytes += sum(len(c) for c in inputs)
        try:
            forged = await asyncio.to_thread(accountable.recheck_part, service._inner, spec, j, signed, inputs)
        except accountable.ProofError as e:
            inputs, why = None, f"inputs served do not match: {e}"
    if inputs is None:
        # The inputs authenticate themselves (each signed by its sender, its hash in the owner's signed list):
        # fetched from their senders (the owner's own from the part's witness), the proof is the same.
        inputs, missing = await _inputs_from_senders(service, state, j, signed, deadline, stats)
        if inputs is None:
            stats.unvalidatable += 1
            out.append(Finding("unvalidatable", owner.peer_id, spec.round, j, f"{why}; {missing}"))
        else:
            stats.suspicions += 1
            out.append(Finding("withheld", owner.peer_id, spec.round, j, f"{why} (checked from the senders' copies)"))
            try:
                forged = await asyncio.to_thread(accountable.recheck_part, service._inner, spec, j, signed, inputs)
            except accountable.ProofError as e:
                stats.unvalidatable += 1
                out.append(Finding("unvalidatable", owner.peer_id, spec.round, j, str(e)))
    if forged is not None and inputs is not None:
        proof = accountable.forgery_proof(spec, signed, inputs)
        verdict = await asyncio.to_thread(accountable.verify_proof, spec.run_id, proof)
        out.append(Finding("forgery", verdict.accused, spec.round, j, verdict.reason, proof))
    other = await _cached_copy(service, spec, j, hashes, deadline)
    if other is not None:
        try:
            proof = accountable.equivocation_proof(signed, other)
            verdict = await asyncio.to_thread(accountable.verify_proof, spec.run_id, proof)
            out.append(Finding("equivocation", verdict.accused, spec.round, j, verdict.reason, proof))
        except accountable.ProofError:
            pass  # the same result (or an unreadable copy): nothing against the owner
    stats.proofs += sum(1 for f in out if f.proof is not None)
    return out


async def _inputs_from_senders(
    service: "CollectiveService", state: _RoundState, j: int, signed: wire.Buffer, deadline: float, stats
) -> tuple[Optional[list], str]:
    """(part ``j``'s signed inputs in the result's order, "") fetched from their holders -- each sender for its
    own push, the part's witness for the owner's own contribution (:func:`~.accountable.witness_of`), this
    node's copies locally -- with ``PullInputs(from_sender)``, at most :data:`SENDER_FETCHES` at once, by
    ``deadline``; or (None, why not): an input nobody served with the committed hash (a holder gone, refusing,
    client-only, serving other bytes), or over :data:`~.partition.VALIDATION_BYTES` in all."""
    spec = state.spec
    try:
        opened = await asyncio.to_thread(accountable.open_result, service._inner, signed, len(spec.participants))
    except EnvelopeError as e:
        return None, f"the result does not open: {e.reason}"
    order = participant_order(spec.participants)
    owner = spec.owners[j].peer_id
    witness = accountable.witness_of(spec, j)
    addresses: dict[str, str] = {}
    for o in spec.owners:
        addresses.setdefault(o.peer_id, o.address)
    holders: dict[str, list[int]] = {}  # holder -> the entries it should serve
    for k, entry in enumerate(opened.entries):
        sender = order[entry.index]
        holder = witness.peer_id if sender == owner and witness is not None else sender
        holders.setdefault(holder, []).append(k)
    got: dict[int, bytes] = {}
    size = [0]
    problems: list[str] = []
    slots = asyncio.Semaphore(SENDER_FETCHES)

    async def one(holder: str, wanted: list[int]) -> None:
        async with slots:
            held, why = await _fetch_held(service, state, j, holder, addresses.get(holder), deadline)
        if held is None:
            problems.append(f"{_short(holder)}: {why}")
            return
        if holder != service.peer_id:
            stats.from_senders += len(wanted)
        size[0] += sum(len(c) for c in held)
        digests = await asyncio.to_thread(lambda: [contribution_digest(c)[:DIGEST_BYTES] for c in held])
        for k in wanted:
            match = [c for c, d in zip(held, digests) if d == opened.entries[k].digest]
            if match:
                got[k] = match[0]
            else:
                problems.append(f"{_short(holder)} served other bytes than input {k} the result commits to")

    await asyncio.gather(*(one(h, ks) for h, ks in holders.items()))
    stats.bytes += size[0]
    if size[0] > VALIDATION_BYTES + INPUT_OVERHEAD_BYTES * len(opened.entries):
        return None, f"the senders' inputs are over {VALIDATION_BYTES} bytes"
    if len(got) < len(opened.entries):
        missing = len(opened.entries) - len(got)
        return (
            None,
            f"{missing} of {len(opened.entries)} input(s) not served by their senders ({'; '.join(sorted(problems))})",
        )
    return [got[k] for k in range(len(opened.entries))], ""


async def _fetch_held(
    service: "CollectiveService", state: _RoundState, j: int, holder: str, address: Optional[str], deadline: float
) -> tuple[Optional[list], str]:
    """(what ``holder`` holds of part ``j``'s inputs: at most 2 signed contributions, its push and a witnessed
    one, "") or (None, why not). This node's own copies are read locally."""
    spec = state.spec
    if holder == service.peer_id:
        try:
            return [bytes(c) for c in service._own_inputs(state, j)], ""
        except EnvelopeError as e:
            return None, e.reason
    if address is None:
        return None, "no address (a client-only sender serves nothing)"
    req = collective_pb2.PullInputsRequest(round=spec.round, part=j, spec_id=spec.spec_id, from_sender=True)
    while True:
        left = deadline - swarm_time()
        if left <= 0:
            return None, "not served by the deadline"
        try:
            reply = await service.transport.call(
                address, service.methods.inputs, req.SerializeToString(), round=spec.round, timeout=left
            )
            resp = await asyncio.to_thread(collective_pb2.PullInputsResponse.FromString, reply.payload)
        except RpcError as e:
            if e.code.name in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and deadline - swarm_time() > 0.1:
                await asyncio.sleep(0.1)
                continue
            return None, f"refused: {e.code.name}: {e.reason}"
        except DecodeError:
            return None, "a malformed reply"
        if reply.sender.to_string() != holder:
            return None, "another peer answered"
        if len(resp.contributions) > 2 or resp.total != len(resp.contributions):
            return None, f"{len(resp.contributions)} contributions served (at most 2: its push and a witnessed one)"
        return [bytes(c) for c in resp.contributions], ""


async def _pull_inputs(
    service: "CollectiveService", spec, j: int, deadline: float, own: Optional[bytes] = None
) -> tuple[Optional[list], str]:
    """(the signed inputs of part ``j`` from its owner, "") or (None, why not) by ``deadline``.

    ``own``: this node's signed contribution to part ``j`` (its push), if it made one. Then the owner is asked to
    leave it out (``omit_caller``: an empty entry in its place, 1/N of the part's inputs not sent) and it is put
    back here; an owner that empties any other entry serves inputs that do not match its result's commitments
    (:func:`~.accountable.recheck_part` raises, and the senders are asked), or more than one empty entry (refused
    here)."""
    owner = spec.owners[j]
    got: list[bytes] = []
    total: Optional[int] = None
    size = 0
    for _ in range(MAX_PAGES):
        left = deadline - swarm_time()
        if left <= 0:
            return None, "the owner did not serve its inputs by the deadline"
        req = collective_pb2.PullInputsRequest(
            round=spec.round, part=j, spec_id=spec.spec_id, first=len(got), omit_caller=own is not None
        )
        try:
            reply = await service.transport.call(
                owner.address, service.methods.inputs, req.SerializeToString(), round=spec.round, timeout=left
            )
            resp = await asyncio.to_thread(collective_pb2.PullInputsResponse.FromString, reply.payload)
        except RpcError as e:
            if e.code.name in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and deadline - swarm_time() > 0.1:
                await asyncio.sleep(0.1)
                continue
            return None, f"the owner refused its inputs: {e.code.name}: {e.reason}"
        except DecodeError:
            return None, "the owner's inputs reply is malformed"
        if reply.sender.to_string() != owner.peer_id:
            return None, "another peer answered for the owner"
        total = int(resp.total) if total is None else total
        if resp.total != total or (not resp.contributions and len(got) < total):
            return None, "the owner's input pages are inconsistent"
        # bounded by what an honest owner can hold: one contribution per participant, the part sized so that
        # they fit VALIDATION_BYTES (red team: total = 2^32 - 1 and 64 MiB pages held 320 MiB in 5 s)
        if total > len(spec.participants):
            return None, f"the owner claims {total} inputs for {len(spec.participants)} participants"
        got.extend(resp.contributions)
        size += sum(len(c) for c in resp.contributions)
        if size > VALIDATION_BYTES + INPUT_OVERHEAD_BYTES * len(got):
            return None, f"the owner's inputs are over {VALIDATION_BYTES} bytes"
        if len(got) >= total:
            got = got[:total]
            empty = [k for k, c in enumerate(got) if not c]
            if len(empty) > (1 if own is not None else 0):
                return None, f"the owner served {len(empty)} empty input(s)"
            if empty and own is not None:
                got[empty[0]] = own
            return got, ""
    return None, "the owner's inputs took too many pages"


async def _cached_copy(service: "CollectiveService", spec, j: int, hashes, deadline: float) -> Optional[bytes]:
    """Another serving peer's cached copy of part ``j``'s result when it differs from the one applied here
    (its payload hash), else None. The peer is drawn from the validators' seed among the other owners."""
    seed = accountable.validator_seed(spec, hashes, j)
    helpers = {o.peer_id: o.address for o in spec.owners if o.peer_id not in (spec.owners[j].peer_id, service.peer_id)}
    if not helpers:
        return None
    pick = min(helpers, key=lambda p: hashlib.sha256(seed + b"copy" + _pid_bytes(p)).digest())
    left = deadline - swarm_time()
    if left <= 0:
        return None
    # the helper answers "same" for a copy of the applied hash (no bytes); only a differing copy is sent, for the proof
    req = collective_pb2.PullPartRequest(
        round=spec.round, part=j, wait_s=0.0, spec_id=spec.spec_id, unless_sha256=hashes[j] or b""
    )
    try:
        reply = await service.transport.call(
            helpers[pick], service.methods.pull, req.SerializeToString(), round=spec.round, timeout=min(left, 5.0)
        )
        resp = collective_pb2.PullPartResponse.FromString(reply.payload)
    except (RpcError, DecodeError):
        return None
    if not resp.ready or resp.same or not resp.signed_result:
        return None
    other = bytes(resp.signed_result)
    try:
        opened = await asyncio.to_thread(accountable.open_result, service._inner, other, len(spec.participants))
    except EnvelopeError:
        return None
    return other if opened.payload_sha256 != hashes[j] else None


def _report(service: "CollectiveService", f: Finding) -> None:
    events.emit(
        log,
        logging.WARNING,
        "owner_" + ("forged" if f.kind == "forgery" else f.kind),
        "round %d: part %d: owner %s %s: %s",
        f.round,
        f.part,
        _short(f.owner),
        {
            "forgery": "forged its result (proof held)",
            "equivocation": "signed two results (proof held)",
            "drop": "left a receipted push out of its signed inputs (proof held)",
            "unvalidatable": "committed to inputs nobody served (a suspicion, no proof)",
        }.get(f.kind, "withheld its inputs (a suspicion, no proof)"),
        f.reason,
        peer=service.peer_id,
        round=f.round,
        part=f.part,
        owner=f.owner,
        finding=f.kind,
        reason=f.reason,
    )
