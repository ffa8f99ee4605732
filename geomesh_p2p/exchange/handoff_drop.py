"""Accountable grouped rounds, level 1: *drop* proofs against a slice owner (issue 26). Pure, no I/O.

A group member pushes its contribution to each group part a slice owner owns and keeps the owner's signed
receipt. The owner's level-1 output is its signed cross contribution ``X``, whose signed level-1 commitment
(:mod:`.group_commitment`: one input list per group part ``X``'s cross part overlaps) must list every push it
receipted, exactly as a one-level owner's signed result must (:func:`entries_problem`, the rule
:func:`.accountable.inclusion_problem` applies). A receipt and a commitment of one owner that contradict each
other are a *handoff-drop proof* (``AccountabilityProof`` kind ``"handoff-drop"``: the receipt, the signed
commitment, the group and cross specs), checked by :func:`verify_handoff_drop` in O(list).

What an honest owner does is never proven: its commitment lists every contribution it accepted (receipts are
signed only on acceptance, before the part closes; a push after the close is refused without one; a push the
agreement filter dropped is listed with its flag; a part below the quorum still lists its inputs). A group part
the owner had no result for in time is committed as an empty list (it hands on zeros there): like a one-level
owner that signed no result, nothing is proven from it (:class:`.handoff.HandoffError`).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.commitment import DIGEST_BYTES, InputEntry, InputsError, decode_inputs, participant_order
from geomesh_p2p.exchange.group_commitment import GroupCommitment, open_commitment
from geomesh_p2p.exchange.handoff import HandoffError, overlapping_parts
from geomesh_p2p.exchange.partition import CollectiveSpec
from geomesh_p2p.exchange.witness import Receipt, open_receipt
from geomesh_p2p.net.identity import EnvelopeError, Verifier
from geomesh_p2p.wire import collective_pb2

__all__ = ["HANDOFF_DROP", "entries_problem", "drop_problem", "handoff_drop_proof", "verify_handoff_drop"]

HANDOFF_DROP = "handoff-drop"  # the proof kind


def entries_problem(spec: CollectiveSpec, entries: Sequence[InputEntry], receipt: Receipt) -> Optional[str]:
    """Why the input list ``entries`` (of ``spec``, signed by the receipt's owner) contradicts ``receipt``: the
    receipted contribution is missing, another one of its sender is listed, or its tokens are not
    ``min(claimed, cap)``; None when it is in as receipted (or the receipt's sender is no participant)."""
    if receipt.sender not in spec.participants:
        return None  # not this round's participant: the owner should not have receipted it, nothing to prove
    me = participant_order(spec.participants).index(receipt.sender)
    mine = [e for e in entries if e.index == me]
    if not mine:
        return "the receipted contribution is not in the result's inputs"
    e = mine[0]
    if e.digest != receipt.sha256[:DIGEST_BYTES]:
        return "the result lists another contribution than the receipted one"
    want = spec.counted_tokens(receipt.sender, receipt.tokens)
    if e.tokens != want:
        return f"the result lists {e.tokens} tokens, the receipt's claim capped by the plan is {want}"
    return None


def drop_problem(gspec: CollectiveSpec, xspec: CollectiveSpec, c: GroupCommitment, receipt: Receipt) -> Optional[str]:
    """Why slice owner's signed level-1 commitment ``c`` (for cross spec ``xspec``) contradicts its ``receipt`` of a
    push to group spec ``gspec``, or None when the receipted push is listed as receipted.

    Raises HandoffError when nothing can be concluded: the two are not one owner's for these specs and round, the
    receipt's group part is not one the commitment's cross part overlaps, the commitment carries another number of
    lists than its parts (a handoff proof's matter), or it commits to no result for that part (an empty list)."""
    if (gspec.run_id, gspec.round, gspec.mode) != (
        xspec.run_id,
        xspec.round,
        "accountable",
    ) or xspec.mode != gspec.mode:
        raise HandoffError("the group and cross specs are not one accountable round's")
    if receipt.owner != c.owner:
        raise HandoffError("the receipt and the commitment are signed by different peers")
    if (receipt.round, receipt.spec_id) != (gspec.round, gspec.spec_id):
        raise HandoffError("the receipt is not for the proof's group spec")
    if (c.round, c.spec_id, c.group_spec_id) != (xspec.round, xspec.spec_id, gspec.spec_id):
        raise HandoffError("the commitment is not for the proof's cross and group specs")
    parts = overlapping_parts(gspec, c.owner, xspec, c.part)
    if receipt.part not in parts:
        raise HandoffError(f"the receipt's group part {receipt.part} is not one cross part {c.part} overlaps")
    if len(c.group_inputs) != len(parts):
        raise HandoffError(f"the commitment carries {len(c.group_inputs)} list(s) for {len(parts)} part(s)")
    listed = c.group_inputs[parts.index(receipt.part)]
    if not listed:
        raise HandoffError(f"the commitment holds no result of group part {receipt.part}: no list to drop from")
    try:
        entries = decode_inputs(listed, len(gspec.participants))
    except InputsError as e:
        raise HandoffError(f"the commitment's list of group part {receipt.part} is malformed: {e}") from None
    return entries_problem(gspec, entries, receipt)


def handoff_drop_proof(gspec: CollectiveSpec, xspec: CollectiveSpec, receipt: bytes, commitment: wire.Buffer) -> bytes:
    """A handoff-drop proof's bytes (AccountabilityProof): the owner's signed receipt, its signed level-1 commitment
    that omits the receipted push (or lists it otherwise), the group spec and the cross spec."""
    return collective_pb2.AccountabilityProof(
        kind=HANDOFF_DROP,
        receipt=bytes(receipt),
        commitment=bytes(commitment),
        spec_json=json.dumps(gspec.to_dict(), sort_keys=True),
        cross_spec_json=json.dumps(xspec.to_dict(), sort_keys=True),
    ).SerializeToString()


def verify_handoff_drop(
    verifier: Verifier, gspec: CollectiveSpec, xspec: CollectiveSpec, receipt: bytes, commitment: bytes
) -> tuple[str, int, str]:
    """Check a handoff-drop proof's parts: ``(accused, group part, reason)``. Both signatures are the accused's
    (:func:`drop_problem`). Raises HandoffError when a signature fails or it proves nothing."""
    try:
        rc = open_receipt(verifier, receipt)
    except EnvelopeError as e:
        raise HandoffError(f"the receipt does not open: {e.reason}") from None
    try:
        c = open_commitment(verifier, commitment)
    except EnvelopeError as e:
        raise HandoffError(f"the commitment does not open: {e.reason}") from None
    why = drop_problem(gspec, xspec, c, rc)
    if why is None:
        raise HandoffError("the receipted contribution is in the commitment as receipted: no drop")
    return c.owner, rc.part, why
