"""An accountable grouped round's level-1 commitment, signed on its own (issue 26). Pure, no I/O.

A slice owner's cross contribution ``X`` carries the input lists of its level-1 (group) results
(``PartContribution.group_inputs``). ``X``'s signature covers the SHA-256 of its whole payload, packet included,
so checking those lists through ``X`` costs the packet (about a 1/8 of the slice per member). ``X`` therefore
also carries a second, small signature by the same key: an Envelope of kind :data:`GROUP_COMMITMENT_KIND` over a
:class:`~geomesh_p2p.wire.collective_pb2.GroupCommitment` rebuilt from ``X``'s own round, spec_id, part,
group_spec_id and group_inputs (so the two can never disagree). A leader serves it alone
(``PullInputsRequest.commitments_only``); a group member checks its receipted pushes in it, and the
commitment plus the owner's receipt is a level-1 drop proof (:mod:`.handoff_drop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import grpc
from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.net.identity import EnvelopeError, Identity, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = [
    "GROUP_COMMITMENT_KIND",
    "GroupCommitment",
    "commitment_payload",
    "sign_commitment",
    "signed_commitment_of",
    "open_commitment",
    "commitment_of_contribution",
]

Code = grpc.StatusCode

GROUP_COMMITMENT_KIND = "geomesh.collective/GroupCommitment"  # inner envelope kind of a level-1 commitment


@dataclass(frozen=True)
class GroupCommitment:
    """A slice owner's signed level-1 commitment, signature checked.

    Attributes:
        owner: base58 PeerID of the signer (the slice owner).
        round: the round.
        spec_id: the cross spec's spec_id (32 bytes).
        part: the cross part its contribution is for.
        group_spec_id: the group spec's spec_id (32 bytes).
        group_inputs: one :mod:`.commitment` input list per group part the cross part overlaps, in part order.
        signed: the SignedMessage bytes (what a handoff-drop proof carries).
    """

    owner: str
    round: int
    spec_id: bytes
    part: int
    group_spec_id: bytes
    group_inputs: tuple[bytes, ...]
    signed: bytes


def commitment_payload(round: int, spec_id: bytes, part: int, group_spec_id: bytes, lists: Sequence[bytes]) -> bytes:
    """The GroupCommitment payload bytes of a cross contribution with these fields (deterministic)."""
    return collective_pb2.GroupCommitment(
        round=round, spec_id=spec_id, part=part, group_spec_id=group_spec_id, group_inputs=[bytes(b) for b in lists]
    ).SerializeToString(deterministic=True)


def sign_commitment(
    identity: Identity, run_id: str, round: int, spec_id: bytes, part: int, group_spec_id: bytes, lists: Sequence[bytes]
) -> bytes:
    """The Envelope bytes (kind :data:`GROUP_COMMITMENT_KIND`) a cross contribution carries in ``group_commitment``."""
    payload = commitment_payload(round, spec_id, part, group_spec_id, lists)
    msg = identity.sign_message(run_id=run_id, round=round, kind=GROUP_COMMITMENT_KIND, payload=payload)
    return msg.envelope.SerializeToString()


def signed_commitment_of(head: Any) -> bytes:
    """The SignedMessage bytes of the commitment a PartContribution's small fields (``head``) carry: its
    ``group_commitment`` Envelope with the payload rebuilt from its fields; b"" when it carries none."""
    if not head.group_commitment:
        return b""
    payload = commitment_payload(
        int(head.round), bytes(head.spec_id), int(head.part), bytes(head.group_spec_id), list(head.group_inputs)
    )
    try:
        env = envelope_pb2.Envelope.FromString(head.group_commitment)
    except DecodeError:
        return b""
    return envelope_pb2.SignedMessage(envelope=env, payload=payload).SerializeToString()


def open_commitment(verifier: Verifier, signed: wire.Buffer) -> GroupCommitment:
    """Verify a signed GroupCommitment and read it. Raises EnvelopeError (status + reason) when it is not a
    SignedMessage, not a commitment, forged or tampered, or malformed."""
    try:
        msg = wire.SignedView(signed)
    except wire.WireError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "group commitment is not a SignedMessage") from None
    v = verifier.verify(cast(envelope_pb2.SignedMessage, msg), kind=GROUP_COMMITMENT_KIND, check_replay=False)
    try:
        c = collective_pb2.GroupCommitment.FromString(v.payload)
    except DecodeError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "group commitment payload is malformed") from None
    if c.round != v.round or len(c.spec_id) != 32 or len(c.group_spec_id) != 32:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "group commitment's round or spec ids are malformed")
    return GroupCommitment(
        v.sender.to_string(), int(c.round), bytes(c.spec_id), int(c.part), bytes(c.group_spec_id),
        tuple(bytes(b) for b in c.group_inputs), bytes(signed),
    )  # fmt: skip


def commitment_of_contribution(signed: wire.Buffer) -> bytes:
    """The SignedMessage bytes of the level-1 commitment a signed cross contribution carries (its signature is not
    checked here: a leader serves what it accepted); b"" when it carries none or is malformed. Reads the small
    fields only (the packet is skipped, not copied)."""
    try:
        payload = wire.SignedView(signed).payload
        head = collective_pb2.PartContribution.FromString(wire.small_fields(payload, wire.scan(payload), (8,)))
    except (wire.WireError, DecodeError):
        return b""
    return signed_commitment_of(head)
