"""Accountable mode: one committed input of a part, fetched for verified work (issue 28 in accountable mode,
:mod:`geomesh_p2p.trust.verify_commit`), and what this node holds to draw the checks.

A verified-work check needs the accused's signed contribution to the parts it checks. In accountable mode only the
part's owner received it; every participant holds the owner-signed result, which commits to the SHA-256 of each
input (:mod:`.commitment`). So the checker asks, in this order, by one deadline (the owner by :data:`OWNER_SHARE` of it):

1. **the part's owner** (``PullInputs(first = the input's index, count = 1)``): one input of its committed list,
   within :data:`OWNER_SHARE` of the deadline (a stalling owner leaves the next holder the rest);
2. **the accused itself** (``PullInputs(from_sender)``, the RPC validators use when an owner withholds): it keeps
   its signed push of every part for the kept rounds and serves it, at most 2 contributions (its push, and the
   owner's own one when it is the part's witness): exactly the bytes wanted;
3. **the part's witness**, when the accused owns the part (its own contribution has no other sender).

Only bytes whose SHA-256 matches the commitment are returned (the caller then checks the signature, sender, round
and part: :func:`~geomesh_p2p.trust.verify_commit.verified_packet`); a refusal, a timeout or other bytes is a
reason, never trusted. Bytes: one signed contribution to the part (``~P/(8N)`` for N equal parts, sign packets)
per holder asked, the first that serves it ends the fetch. Each holder serves one caller a part's inputs at most
``INPUT_SERVES_PER_CALLER`` times their bytes a round (:mod:`.owner`), so a check and a validation of the same part
by the same peer fit that budget.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import accountable, messages
from geomesh_p2p.exchange.audit import _fetch_held
from geomesh_p2p.exchange.commitment import DIGEST_BYTES, participant_order
from geomesh_p2p.exchange.partition import CollectiveSpec, _short
from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.wire import collective_pb2

if TYPE_CHECKING:
    from geomesh_p2p.exchange.client import CollectiveService

__all__ = ["CommittedRound", "committed_round", "fetch_input", "OWNER_SHARE"]

#: Share of a fetch's time the part's owner gets before the sender (or the witness) is asked. Why (red team,
#: session 31): by one deadline for all, an owner that never answered left the others no time: an accused that owns
#: a part kept its own contribution to it from every screener (its witness, which holds it, was asked too late),
#: and the contributions of every other sender to that part with it (their screens "not run").
OWNER_SHARE = 0.5


@dataclass
class CommittedRound:
    """What this node holds of an accountable round for verified work.

    Attributes:
        spec: the round's spec.
        inputs: sender (base58) -> part -> ``(tokens used, dropped by the filter, SHA-256[:16])``, every input of
            every part result this node applied (its own parts' included).
        own: part -> this node's own signed contribution (SignedMessage bytes) to that part.
    """

    spec: CollectiveSpec
    inputs: dict[str, dict[int, tuple[int, bool, bytes]]]
    own: dict[int, bytes]


def committed_round(service: "CollectiveService", round: int) -> Optional[CommittedRound]:
    """The committed inputs of accountable ``round`` as this node applied them, and its own contributions, or
    None (not held here any more, or not accountable). Blocking (opens every part result): a worker thread."""
    state = service._rounds.get(round)
    if state is None or state.spec.mode != "accountable":
        return None
    spec = state.spec
    order = participant_order(spec.participants)
    inputs: dict[str, dict[int, tuple[int, bool, bytes]]] = {}
    own: dict[int, bytes] = {}
    for j, o in enumerate(spec.owners):
        if j not in state.result_hashes:
            continue  # a part this node did not apply: the same for every reader that missed it
        mine = o.peer_id == service.peer_id
        signed = state.parts[j].signed_result if mine and j in state.parts else state.cache.get(j)
        if not signed:
            continue
        try:
            opened = accountable.open_result(service._inner, signed, len(spec.participants))
        except EnvelopeError:
            continue  # read_result accepted it: cannot happen for an applied result
        for e in opened.entries:
            inputs.setdefault(order[e.index], {})[j] = (int(e.tokens), bool(e.dropped), bytes(e.digest))
        if mine and service.peer_id in state.parts[j].contributions:
            own[j] = bytes(state.parts[j].contributions[service.peer_id].signed)
    for j, payload in state.pushed.items():
        own[j] = bytes(messages.push_request_contribution(payload))
    return CommittedRound(spec, inputs, own)


async def fetch_input(
    service: "CollectiveService",
    round: int,
    part: int,
    sender: str,
    digest: bytes,
    *,
    timeout_s: float = 10.0,
) -> tuple[Optional[bytes], list[str], int]:
    """``sender``'s signed contribution to ``part`` of accountable ``round`` whose SHA-256 starts with ``digest``
    (its result's commitment), from the part's owner, else the sender, else (when the sender owns the part) its
    witness, all by one deadline ``timeout_s`` seconds from now; the owner by :data:`OWNER_SHARE` of it (a stalling
    owner leaves the other holder the rest).

    Returns ``(bytes or None, the reasons of each holder that did not serve it, bytes received)``. Never raises
    for what a holder does: a refusal, a timeout, a malformed reply or bytes that do not match are reasons."""
    state = service._rounds.get(round)
    if state is None or state.spec.mode != "accountable":
        return None, [f"round {round} is not an accountable round held here"], 0
    spec = state.spec
    deadline = swarm_time() + float(timeout_s)
    owner_deadline = swarm_time() + OWNER_SHARE * float(timeout_s)  # the rest is the fallback holder's
    owner = spec.owners[part]
    addresses: dict[str, str] = {}
    for o in spec.owners:
        addresses.setdefault(o.peer_id, o.address)
    why: list[str] = []
    received = 0
    digest = bytes(digest[:DIGEST_BYTES])

    def match(held: list) -> Optional[bytes]:
        for c in held:
            if hashlib.sha256(c).digest()[:DIGEST_BYTES] == digest:
                return bytes(c)
        return None

    async def from_holder(holder: str, label: str) -> Optional[bytes]:
        nonlocal received
        if holder == service.peer_id:
            return None
        held, reason = await _fetch_held(service, state, part, holder, addresses.get(holder), deadline)
        if held is None:
            why.append(f"{label} {_short(holder)}: {reason}")
            return None
        received += sum(len(c) for c in held)
        got = await asyncio.to_thread(match, held)
        if got is None:
            why.append(f"{label} {_short(holder)} served other bytes than the committed contribution")
        return got

    got: Optional[bytes] = None
    if owner.peer_id == service.peer_id and part in state.parts:  # this node owns the part: it holds the inputs
        got = await asyncio.to_thread(match, list(state.parts[part].inputs))
    elif owner.peer_id != service.peer_id:
        got, reason, n = await _one_from_owner(service, spec, part, sender, owner_deadline, match)
        received += n
        if got is None:
            why.append(f"the owner {_short(owner.peer_id)}: {reason}")
    if got is None and sender != owner.peer_id:
        got = await from_holder(sender, "the sender")
    if got is None and sender == owner.peer_id:
        witness = accountable.witness_of(spec, part)
        if witness is not None:
            got = await from_holder(witness.peer_id, "the witness")
    return got, why, received


async def _one_from_owner(service: "CollectiveService", spec, part: int, sender: str, deadline: float, match):
    """(the committed input of ``sender`` from part ``part``'s owner, "", bytes) or (None, why not, bytes):
    ``PullInputs(first = its index in the owner's list, count = 1)``. The index is the sender's position among the
    result's inputs, which this node reads from its own copy of the result."""
    state = service._rounds[spec.round]
    signed = state.cache.get(part)
    if not signed:
        return None, "this node holds no copy of the part's result", 0
    try:
        opened = accountable.open_result(service._inner, signed, len(spec.participants))
    except EnvelopeError as e:
        return None, f"the result does not open: {e.reason}", 0
    order = participant_order(spec.participants)
    index = next((k for k, e in enumerate(opened.entries) if order[e.index] == sender), None)
    if index is None:
        return None, "the sender is not in the part's committed inputs", 0
    req = collective_pb2.PullInputsRequest(round=spec.round, part=part, spec_id=spec.spec_id, first=index, count=1)
    owner = spec.owners[part]
    while True:
        left = deadline - swarm_time()
        if left <= 0:
            return None, "not served by the deadline", 0
        try:
            reply = await service.transport.call(
                owner.address, service.methods.inputs, req.SerializeToString(), round=spec.round, timeout=left
            )
            resp = await asyncio.to_thread(collective_pb2.PullInputsResponse.FromString, reply.payload)
        except RpcError as e:
            if e.code.name in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and deadline - swarm_time() > 0.1:
                await asyncio.sleep(0.1)
                continue
            return None, f"refused: {e.code.name}: {e.reason}", 0
        except DecodeError:
            return None, "a malformed reply", 0
        if reply.sender.to_string() != owner.peer_id:
            return None, "another peer answered for the owner", 0
        page = [bytes(c) for c in resp.contributions[:1]]
        n = sum(len(c) for c in resp.contributions)
        got = await asyncio.to_thread(match, page)
        return (got, "", n) if got is not None else (None, "served other bytes than the committed contribution", n)
