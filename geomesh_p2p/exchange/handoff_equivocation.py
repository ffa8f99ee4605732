"""Accountable grouped rounds, level 1: *equivocation* proofs against a slice owner (issue 26). Pure, no I/O.

A slice owner hands its group aggregate on as one signed cross contribution ``X`` per cross part of its slice, each
carrying a signed level-1 commitment (:mod:`.group_commitment`: one input list per group part that cross part
overlaps). A group part that straddles two cross parts (two leaders of the slice, or one leader's part cut in two)
is therefore committed to twice. An honest owner builds every list of a group part from its one signed group result
(``groups._handoff_lists``), so the two lists are the same bytes. Two commitments of one owner for one round, cross
spec and group spec whose lists for a group part both cover differ are a *handoff-equivocation proof*
(``AccountabilityProof`` kind ``"handoff-equivocation"``: both signed commitments, the group and cross specs),
checked by :func:`verify_handoff_equivocation` in O(list). Which list is the "true" one does not matter: the owner
signed two different level-1 results for one group part (e.g. a mate's push counted towards one leader and not
the other, or a colluder's push listed to one leader only: no receipt-holder's drop check sees that).
"""

from __future__ import annotations

import json

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.commitment import InputEntry, InputsError, decode_inputs
from geomesh_p2p.exchange.group_commitment import GroupCommitment, open_commitment
from geomesh_p2p.exchange.handoff import HandoffError, overlapping_parts
from geomesh_p2p.exchange.partition import CollectiveSpec
from geomesh_p2p.net.identity import EnvelopeError, Verifier
from geomesh_p2p.wire import collective_pb2

__all__ = [
    "HANDOFF_EQUIVOCATION",
    "lists_by_part",
    "equivocation_problem",
    "handoff_equivocation_proof",
    "verify_handoff_equivocation",
]

HANDOFF_EQUIVOCATION = "handoff-equivocation"  # the proof kind


def lists_by_part(gspec: CollectiveSpec, xspec: CollectiveSpec, c: GroupCommitment) -> dict[int, list[InputEntry]]:
    """Group part -> the decoded input list commitment ``c`` (a slice owner's, for ``xspec``) carries for it, for
    every group part its cross part overlaps (:func:`.handoff.overlapping_parts`). Raises HandoffError when the
    commitment is not for these specs, carries another number of lists than its parts, or a list is malformed."""
    same_round = (gspec.run_id, gspec.round) == (xspec.run_id, xspec.round)
    if not same_round or gspec.mode != "accountable" or xspec.mode != "accountable":
        raise HandoffError("the group and cross specs are not one accountable round's")
    if (c.round, c.spec_id, c.group_spec_id) != (xspec.round, xspec.spec_id, gspec.spec_id):
        raise HandoffError("a commitment is not for the proof's cross and group specs")
    parts = overlapping_parts(gspec, c.owner, xspec, c.part)
    if len(c.group_inputs) != len(parts):
        raise HandoffError(f"a commitment carries {len(c.group_inputs)} list(s) for {len(parts)} part(s)")
    out: dict[int, list[InputEntry]] = {}
    for j, listed in zip(parts, c.group_inputs):
        try:
            out[j] = decode_inputs(listed, len(gspec.participants))
        except InputsError as e:
            raise HandoffError(f"the list of group part {j} of cross part {c.part} is malformed: {e}") from None
    return out


def equivocation_problem(
    gspec: CollectiveSpec, xspec: CollectiveSpec, a: GroupCommitment, b: GroupCommitment
) -> tuple[int, str]:
    """``(group part, reason)``: the first group part (in part order) both commitments cover whose input lists
    differ. Raises HandoffError when nothing is proven: another signer, another round or spec, no group part in
    common, or the same lists for every shared part (:func:`lists_by_part` for the rest)."""
    if a.owner != b.owner:
        raise HandoffError("the two commitments are signed by different peers")
    la, lb = lists_by_part(gspec, xspec, a), lists_by_part(gspec, xspec, b)
    common = [j for j in la if j in lb]
    if not common:
        raise HandoffError(f"cross parts {a.part} and {b.part} overlap no common group part")
    for j in common:
        if la[j] != lb[j]:
            only_a = len({(e.index, e.digest) for e in la[j]} - {(e.index, e.digest) for e in lb[j]})
            only_b = len({(e.index, e.digest) for e in lb[j]} - {(e.index, e.digest) for e in la[j]})
            return j, (
                f"two signed level-1 commitments list different inputs for group part {j} (cross parts {a.part} and "
                f"{b.part}: {len(la[j])} and {len(lb[j])} entries, {only_a} and {only_b} contribution(s) in one only)"
            )
    raise HandoffError("the two commitments list the same inputs for every group part they share: no equivocation")


def handoff_equivocation_proof(gspec: CollectiveSpec, xspec: CollectiveSpec, a: wire.Buffer, b: wire.Buffer) -> bytes:
    """A handoff-equivocation proof's bytes (AccountabilityProof): the slice owner's two signed GroupCommitments
    (SignedMessage bytes) with different lists for a shared group part, the group spec and the cross spec."""
    return collective_pb2.AccountabilityProof(
        kind=HANDOFF_EQUIVOCATION,
        commitment=bytes(a),
        other_commitment=bytes(b),
        spec_json=json.dumps(gspec.to_dict(), sort_keys=True),
        cross_spec_json=json.dumps(xspec.to_dict(), sort_keys=True),
    ).SerializeToString()


def verify_handoff_equivocation(
    verifier: Verifier, gspec: CollectiveSpec, xspec: CollectiveSpec, a: bytes, b: bytes
) -> tuple[str, int, str]:
    """Check a handoff-equivocation proof's parts: ``(accused, group part, reason)``. Both signatures are the
    accused's (:func:`equivocation_problem`). Raises HandoffError when a signature fails or it proves nothing."""
    opened = []
    for which, signed in (("first", a), ("second", b)):
        try:
            opened.append(open_commitment(verifier, signed))
        except EnvelopeError as e:
            raise HandoffError(f"the {which} commitment does not open: {e.reason}") from None
    j, why = equivocation_problem(gspec, xspec, opened[0], opened[1])
    return opened[0].owner, j, why
