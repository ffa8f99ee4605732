"""Accountable mode's receipts and part witnesses (pure, no I/O; split from :mod:`.accountable` so that
:mod:`.messages` can check a result's witness receipt while reading it).

* A **receipt** is an owner's signed acknowledgement of one accepted push (:data:`RECEIPT_KIND`: run, round,
  part, spec, sender, tokens claimed, SHA-256 of the contribution's signed bytes); a sender keeps it to prove
  a drop (:mod:`.accountable`).
* The **witness** of a part (:func:`witness_of`) is the owner of the next part that is another peer. The
  part's owner hands it its own contribution (a witness push) and lists that contribution in its result only
  with the witness's receipt (:func:`witness_problem`, checked by every reader). Why: a validator whose owner
  withholds its inputs fetches each input from its sender; the owner's own contribution has no other sender,
  so without a witness an owner that forges and withholds could never be checked (issue 26, red team of
  session 15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, cast

import grpc
from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.commitment import DIGEST_BYTES, InputEntry, participant_order
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import EnvelopeError, PeerID, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = ["RECEIPT_KIND", "Receipt", "open_receipt", "receipt_problem", "witness_of", "witness_problem"]

Code = grpc.StatusCode

RECEIPT_KIND = "geomesh.collective/Receipt"  # inner envelope kind of an owner's receipt of a push


@dataclass(frozen=True)
class Receipt:
    """An owner's signed receipt of one accepted push (accountable mode).

    Attributes:
        owner: base58 PeerID of the signer (the part's owner).
        round / part / spec_id: what it was pushed for.
        sender: base58 PeerID of the contributor.
        tokens: tokens the contribution claims (before the plan's cap).
        sha256: SHA-256 (32 bytes) of the contribution's SignedMessage bytes.
        signed: the receipt's SignedMessage bytes (what a drop proof carries).
    """

    owner: str
    round: int
    part: int
    spec_id: bytes
    sender: str
    tokens: int
    sha256: bytes
    signed: bytes


def _verify(verifier: Verifier, signed: wire.Buffer, kind: str, what: str):
    try:
        msg = wire.SignedView(signed)
    except wire.WireError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"{what} is not a SignedMessage") from None
    return verifier.verify(cast(envelope_pb2.SignedMessage, msg), kind=kind, check_replay=False)


def open_receipt(verifier: Verifier, signed: wire.Buffer) -> Receipt:
    """Verify a receipt's signature and read it. Raises EnvelopeError (status + reason) when it is not a
    SignedMessage, not a receipt, forged or tampered, or its fields are malformed."""
    v = _verify(verifier, signed, RECEIPT_KIND, "receipt")
    try:
        r = collective_pb2.Receipt.FromString(v.payload)
        sender = PeerID(bytes(r.sender)).to_string()
    except (DecodeError, ValueError):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "receipt payload is malformed") from None
    if r.round != v.round:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"receipt is for round {r.round} (envelope {v.round})")
    if len(r.contribution_sha256) != 32 or len(r.spec_id) != 32:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "receipt's hashes have the wrong length")
    return Receipt(
        v.sender.to_string(), int(r.round), int(r.part), bytes(r.spec_id), sender, int(r.tokens),
        bytes(r.contribution_sha256), bytes(signed),
    )  # fmt: skip


def witness_of(spec: CollectiveSpec, part: int) -> Optional[PartOwner]:
    """The *witness* of ``part``: the owner of the next part (cyclic, in the spec's order) that is another peer,
    or None when one peer owns every part. The part's owner hands its own contribution to the witness
    (``PushPartRequest.witness``) and its result carries the witness's receipt of it, so that a validator whose
    owner withholds its inputs can fetch every input from someone else: each other input from its sender, the
    owner's own from the witness (issue 26: a forger that withholds is no longer safe)."""
    me = spec.owners[part].peer_id
    n = len(spec.owners)
    for k in range(1, n):
        o = spec.owners[(part + k) % n]
        if o.peer_id != me:
            return o
    return None


def witness_problem(
    verifier: Verifier, spec: CollectiveSpec, part: int, receipt: bytes, entries: Sequence[InputEntry]
) -> Optional[str]:
    """Why an accountable result of ``part`` listing ``entries`` must be refused for its witness receipt
    (``PartResult.witness_receipt``), or None: when the owner's own contribution is listed, the receipt must
    be signed by :func:`witness_of` the part, for this round, part, spec and the owner as sender, and name the
    listed contribution's hash. Every reader decides from the same signed bytes: no fork."""
    owner = spec.owners[part].peer_id
    if owner not in spec.participants:
        return None
    me = participant_order(spec.participants).index(owner)
    own = [e for e in entries if e.index == me]
    w = witness_of(spec, part)
    if not own or w is None:
        return None
    if not receipt:
        return "the owner lists its own contribution without its witness's receipt"
    try:
        rc = open_receipt(verifier, receipt)
    except EnvelopeError as e:
        return f"the witness receipt does not open: {e.reason}"
    return receipt_problem(spec, part, rc, own[0].digest)


def receipt_problem(spec: CollectiveSpec, part: int, rc: Receipt, digest: bytes) -> Optional[str]:
    """Why ``rc`` (opened) is not the witness receipt of part ``part``'s owner's own contribution whose digest
    is ``digest`` (its first :data:`~.commitment.DIGEST_BYTES` bytes compared), or None. The one rule of the
    owner (before it lists its contribution, :meth:`~.client.CollectiveService._hand_to_witness`) and of every
    reader (:func:`witness_problem`): an owner that kept a receipt its readers refuse lost its whole part on
    every peer to a hostile witness (red team, session 16)."""
    w = witness_of(spec, part)
    if w is None or rc.owner != w.peer_id:
        return "the witness receipt is not signed by the part's witness"
    if (rc.round, rc.part, rc.spec_id, rc.sender) != (spec.round, part, spec.spec_id, spec.owners[part].peer_id):
        return "the witness receipt is for another round, part, spec or sender"
    if rc.sha256[:DIGEST_BYTES] != digest[:DIGEST_BYTES]:
        return "the witness receipt names another contribution than the one listed"
    return None
