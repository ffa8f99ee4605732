"""Accountable grouped rounds, level 1: a slice owner's *hand-off* (issue 26). Pure and synchronous (no I/O): the
services run these in worker threads (the recomputation touches a slice).

In a grouped round (:mod:`.groups`) a slice owner aggregates its group's contributions to its slice (level 1,
the group spec) and pushes the result, sign-compressed, as its contribution to the slice's cross spec (level 2).
Nobody else reads the level-1 result, so the level-1 output that counts is that signed cross contribution
``X``. In accountable mode ``X`` carries the owner's level-1 commitment: one input list (:mod:`.commitment`) per
part of its group spec that ``X``'s range overlaps (``PartContribution.group_inputs``). The leader's accountable
result commits to ``X``'s hash, as to any input.

A validator (a member of the owner's group, drawn after the round: :func:`handoff_validators`) fetches ``X`` (from
the leader, which serves its inputs) and the group contributions ``X`` commits to (from the owner, or each from
its sender, the owner's own from its witness), recomputes the group rule and the sign encoding of ``X``'s range
bit for bit (:func:`recheck_handoff`) and compares with ``X``'s packet, tokens and member list. A mismatch is a
*handoff proof* (``X`` + the signed group inputs + both specs), checked by any peer from its bytes alone
(:func:`verify_handoff`, called by :func:`.accountable.verify_proof` for ``kind == "handoff"``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange import messages
from geomesh_p2p.exchange.commitment import (
    DIGEST_BYTES,
    InputEntry,
    InputsError,
    contribution_digest,
    decode_inputs,
    participant_order,
    rank_by_seed,
)
from geomesh_p2p.exchange.messages import Contribution
from geomesh_p2p.exchange.partition import CollectiveSpec, _pid_bytes
from geomesh_p2p.net.identity import EnvelopeError, Verifier
from geomesh_p2p.wire import collective_pb2

__all__ = [
    "HandoffError",
    "slice_start",
    "overlapping_parts",
    "recheck_handoff",
    "handoff_proof",
    "handoff_validators",
    "open_handoff",
]


class HandoffError(ValueError):
    """Nothing can be concluded against the slice owner (one-line reason): the bytes are malformed, not the owner's,
    or the inputs served are not the ones it committed to."""


def slice_start(gspec: CollectiveSpec, owner: str) -> tuple[int, int]:
    """``[start, end)`` (elements of the round's vector) of the slice ``owner`` aggregates in group spec ``gspec``:
    the union of its parts there. Raises HandoffError when it owns no part or its parts are not contiguous."""
    mine = [o for o in gspec.owners if o.peer_id == owner]
    if not mine:
        raise HandoffError("the sender owns no part of the group spec")
    a, b = mine[0].start, mine[-1].end
    if sum(o.size for o in mine) != b - a:
        raise HandoffError("the sender's group parts are not one slice")
    return a, b


def overlapping_parts(gspec: CollectiveSpec, owner: str, xspec: CollectiveSpec, k: int) -> list[int]:
    """The indices (in part order) of ``owner``'s parts of group spec ``gspec`` that cross part ``k`` of ``xspec``
    (its range relative to the slice) overlaps: the level-1 input lists ``X`` must carry. Raises HandoffError."""
    a, b = slice_start(gspec, owner)
    if xspec.numel != b - a or not 0 <= k < len(xspec.owners):
        raise HandoffError("the cross spec is not the one of the sender's slice, or has no such part")
    s, e = a + xspec.owners[k].start, a + xspec.owners[k].end
    return [j for j, o in enumerate(gspec.owners) if o.peer_id == owner and o.start < e and s < o.end]


def open_handoff(verifier: Verifier, xspec: CollectiveSpec, signed: wire.Buffer) -> tuple[int, Contribution]:
    """``(cross part, Contribution)`` of a slice owner's signed cross contribution ``X``
    (:func:`.messages.check_contribution`). Raises HandoffError when it does not verify for ``xspec``."""
    try:
        return messages.check_contribution(verifier, xspec, None, signed, None)
    except EnvelopeError as e:
        raise HandoffError(f"the cross contribution does not verify: {e.reason}") from None


def recheck_handoff(
    verifier: Verifier,
    gspec: CollectiveSpec,
    xspec: CollectiveSpec,
    signed_x: wire.Buffer,
    inputs: Sequence[Sequence[wire.Buffer]],
) -> Optional[str]:
    """A validator's check of slice owner's cross contribution ``signed_x`` (signed SignedMessage bytes for
    ``xspec``) against the signed group contributions it commits to: ``inputs[i]`` for the ``i``-th of
    :func:`overlapping_parts`, in the order of ``X``'s ``group_inputs[i]``.

    Returns the reason the owner is proven to have forged -- an input it committed to that fails verification
    for ``gspec`` or names another sender, tokens that are not the plan's cap, filter flags, a packet (sign of
    the group rule's fp32 mean over ``X``'s range, ``X``'s tokens; zeros for a part whose kept inputs miss the
    spec's quorum, as its owner's own read refuses it) or a member list other than the rule's over its inputs --
    or None when ``X`` is exactly that. Raises HandoffError when nothing can be concluded (the
    bytes are not the owner's for these specs, the inputs served are not those committed to). Worker thread:
    verifies and aggregates ``X``'s range (fp32, ``len(inputs)`` x group size contributions)."""
    if (gspec.run_id, gspec.round) != (xspec.run_id, xspec.round) or xspec.mode != "accountable":
        raise HandoffError("the group and cross specs are not one accountable round's")
    k, x = open_handoff(verifier, xspec, signed_x)
    if x.group_spec_id != gspec.spec_id:
        raise HandoffError("the contribution commits to another group spec than the proof's")
    parts = overlapping_parts(gspec, x.sender, xspec, k)
    if len(x.group_inputs) != len(parts) or len(inputs) != len(parts):
        # the owner committed to another number of lists than its parts: its own signed bytes say so
        if len(x.group_inputs) != len(parts):
            return (
                f"the contribution carries {len(x.group_inputs)} group input list(s), its range overlaps {len(parts)}"
            )
        raise HandoffError(f"{len(inputs)} input list(s) served, the contribution commits to {len(parts)}")
    order = participant_order(gspec.participants)
    a, _ = slice_start(gspec, x.sender)
    pieces: list[torch.Tensor] = []
    counted: Optional[list[tuple[str, int]]] = None
    for j, listed, served in zip(parts, x.group_inputs, inputs):
        o = gspec.owners[j]
        try:
            entries: list[InputEntry] = decode_inputs(listed, len(order))
        except InputsError as e:
            return f"the group input list of part {j} is malformed: {e}"
        if len(served) != len(entries):
            raise HandoffError(
                f"{len(served)} inputs served for group part {j}, the contribution commits to {len(entries)}"
            )
        checked: list[Contribution] = []
        for n, (entry, signed) in enumerate(zip(entries, served)):
            if contribution_digest(signed)[:DIGEST_BYTES] != entry.digest:
                raise HandoffError(f"served input {n} of group part {j} is not the contribution committed to")
            try:
                _, c = messages.check_contribution(verifier, gspec, j, signed, None)
            except EnvelopeError as err:
                return f"input {n} of group part {j} the owner committed to fails verification: {err.reason}"
            if c.sender != order[entry.index]:
                return f"input {n} of group part {j} is signed by {c.sender[:10]}, the list names another participant"
            if entry.tokens != gspec.counted_tokens(c.sender, c.tokens):
                return f"input {n} of group part {j} lists {entry.tokens} tokens, not the claim capped by the plan"
            checked.append(c)
        used = [e.tokens for e in entries]
        dropped: list[int] = []
        mean = gspec.aggregate([(t, c.packet) for t, c in zip(used, checked)], o.size, dropped)
        if [e.dropped for e in entries] != [n in set(dropped) for n in range(len(entries))]:
            return f"the agreement filter's drops of group part {j} differ from the list's flags"
        kept = [(c.sender, t) for n, (c, t) in enumerate(zip(checked, used)) if n not in set(dropped)]
        if not gspec.quorum_met(p for p, _ in kept):
            # the reader's rule (messages._read_accountable): a result below the quorum counts for nobody, its owner
            # included, which hands on zeros for that range and counts no member there. Without this an honest owner
            # whose part closed short of the quorum (pushes past its deadline, under load) was "proven" to forge
            # (16 peer processes on 2 cores, session 26: excluded by every peer)
            mean, kept = torch.zeros_like(mean), []
        counted = kept if counted is None else [(p, t) for p, t in counted if (p, t) in set(kept)]
        lo, hi = max(o.start, a + xspec.owners[k].start), min(o.end, a + xspec.owners[k].end)
        pieces.append(mean[lo - o.start : hi - o.start])
    v = torch.cat(pieces) if pieces else torch.zeros(0)
    if v.numel() != xspec.owners[k].size:
        return "the group parts the contribution commits to do not cover its range"
    want = compression.encode(v.contiguous(), block_size=xspec.block_size, tokens=x.tokens).to_bytes()
    if not isinstance(x.packet, compression.SignPacket) or want != x.packet.to_bytes():
        return "the contribution's packet differs from the group rule recomputed over the committed inputs"
    if len(parts) == len([o for o in gspec.owners if o.peer_id == x.sender]):
        # every part of the slice is here: the members are exactly those every part counted (groups.py's rule)
        if list(x.members) != (counted or []):
            return "the contribution's members differ from the group inputs every part counted"
    elif any(m not in set(counted or []) for m in x.members):
        return "the contribution lists a member the group inputs did not count"
    return None


def handoff_proof(
    gspec: CollectiveSpec, xspec: CollectiveSpec, signed_x: wire.Buffer, inputs: Sequence[Sequence[wire.Buffer]]
) -> bytes:
    """A handoff proof's bytes (AccountabilityProof, kind ``"handoff"``): the slice owner's signed cross contribution,
    its committed group inputs (``inputs[i]`` for the ``i``-th overlapping group part, flattened with their
    counts), the group spec and the cross spec."""
    return collective_pb2.AccountabilityProof(
        kind="handoff",
        contribution=bytes(signed_x),
        contributions=[bytes(c) for part in inputs for c in part],
        input_counts=[len(part) for part in inputs],
        spec_json=json.dumps(gspec.to_dict(), sort_keys=True),
        cross_spec_json=json.dumps(xspec.to_dict(), sort_keys=True),
    ).SerializeToString()


def split_inputs(p: collective_pb2.AccountabilityProof) -> list[list[bytes]]:
    """A handoff proof's ``contributions`` cut by its ``input_counts``. Raises HandoffError when they disagree."""
    if sum(p.input_counts) != len(p.contributions):
        raise HandoffError("the proof's input counts do not add up to its inputs")
    out, at = [], 0
    for n in p.input_counts:
        out.append(list(p.contributions[at : at + n]))
        at += n
    return out


def handoff_validators(gspec: CollectiveSpec, owner: str, cross_hashes: Sequence[Optional[bytes]], k: int) -> list[str]:
    """The ``gspec.validators_per_part`` members of ``owner``'s group (``gspec``'s participants but ``owner``) drawn to
    check its hand-off, ranked by SHA-256(seed || raw PeerID). The seed: the run, round, the owner and the
    payload hashes of every leader-signed cross result of the round (``cross_hashes``, every slice's parts in
    order, 32 zero bytes for a missing one), which every peer of the round holds after the all-gather and the owner
    cannot foresee when it pushes."""
    h = hashlib.sha256(b"geomesh.grouped/handoff\0" + gspec.run_id.encode() + b"\0")
    h.update(gspec.round.to_bytes(8, "little") + _pid_bytes(owner) + int(k).to_bytes(4, "little"))
    for rh in cross_hashes:
        h.update(rh if rh is not None and len(rh) == 32 else bytes(32))
    return rank_by_seed(h.digest(), (p for p in gspec.participants if p != owner), gspec.validators_per_part)
