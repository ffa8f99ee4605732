"""The collective's signed messages: build and check a sender's contribution to a part, build and
read an owner's part result. Pure and synchronous (no I/O, no event loop): the service runs them in
worker threads (each may touch a whole part: hashing, parsing, decoding).

Every check raises :class:`~geomesh_p2p.net.identity.EnvelopeError` (a gRPC status + reason), and the
same bytes give the same decision on every peer.

Memory: protobuf's upb returns a fresh copy on every read of a bytes field, so each field is read
once; an fp32 packet is a read-only view *into the signed bytes* kept anyway (:func:`_fp32_in`),
not a second copy; a part result's aggregate is decoded straight into the caller's buffer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union, cast

import grpc
import torch
from google.protobuf.message import DecodeError

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.aggregate import ScaleBoundError, aggregate_buffer, decode_aggregate, fp32_buffer, fp32_view
from geomesh_p2p.exchange.commitment import (
    RECORD_BYTES,
    InputEntry,
    InputsError,
    contribution_digest,
    decode_inputs,
    encode_inputs,
    participant_order,
)
from geomesh_p2p.exchange.group_commitment import open_commitment, sign_commitment, signed_commitment_of
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner, _pid_bytes, _short
from geomesh_p2p.exchange.witness import witness_problem
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = [
    "OverBoundError",
    "CONTRIBUTION_KIND",
    "RESULT_KIND",
    "Contribution",
    "contribution_parts",
    "contribution_bytes",
    "push_request_bytes",
    "push_request_contribution",
    "check_contribution",
    "build_result",
    "read_result",
    "PullReply",
    "parse_pull",
]

log = logging.getLogger(__name__)

CONTRIBUTION_KIND = "geomesh.collective/Contribution"  # inner envelope kind of a sender's part
RESULT_KIND = "geomesh.collective/PartResult"  # inner envelope kind of an owner's part result

Code = grpc.StatusCode


@dataclass
class Contribution:
    """A verified contribution to one part.

    Attributes:
        sender: base58 PeerID of the signer.
        tokens: tokens it claims (not yet capped by the plan).
        packet: a :class:`compression.SignPacket` [part size], or a read-only fp32 tensor [part size]
            viewing ``signed`` (fp32 pushes).
        signed: the SignedMessage bytes of the PartContribution (what relay forwards, verify re-checks).
        compute_end: unix seconds the sender says its inner steps ended (clamped to now).
        digest: accountable mode: SHA-256 of ``signed`` (what the owner's receipt and result commit to);
            empty in the other modes.
        members: a grouped round's cross level (:mod:`.groups`): the sender's group members its group aggregate
            counted, with their tokens (they sum to ``tokens``); empty in every other spec.
        group_inputs: an accountable grouped round's cross level (:mod:`.handoff`): the sender's level-1 input
            lists (:mod:`.commitment` bytes), one per group part its range overlaps; empty in every other spec.
        group_spec_id: with ``group_inputs``: the SHA-256 spec_id of the group spec they are of.
    """

    sender: str
    tokens: int  # claimed
    packet: Any  # SignPacket or fp32 tensor
    signed: wire.Buffer  # SignedMessage bytes of the PartContribution (a view of the received buffer for fp32)
    compute_end: float = 0.0  # unix seconds the sender says its inner steps ended
    digest: bytes = b""  # accountable mode: SHA-256 of ``signed``
    members: tuple[tuple[str, int], ...] = ()  # a grouped round's cross level: (member, tokens) of its group
    group_inputs: tuple[bytes, ...] = ()  # an accountable grouped round's cross level: the level-1 input lists
    group_spec_id: bytes = b""  # ... and the spec_id of the group spec they are of


def contribution_parts(
    identity: Identity,
    spec: CollectiveSpec,
    j: int,
    delta: torch.Tensor,
    tokens: int,
    compute_end: float = 0.0,
    members: Sequence[tuple[str, int]] = (),
    group_inputs: Sequence[bytes] = (),
    group_spec_id: bytes = b"",
) -> list[wire.Buffer]:
    """Part ``j`` of ``delta`` (fp32 [numel], CPU, contiguous) encoded as ``spec.push_encoding`` and
    signed: the SignedMessage of a PartContribution as a list of buffers (:func:`.wire.signed_parts`).
    An fp32 part is not copied: its buffer is a view of ``delta`` (which must not change until the
    list is joined). ``members``: a grouped round's cross level only, ``(member, tokens)`` of the sender's group
    (:class:`Contribution`); ``group_inputs``: an accountable grouped round's cross level only, the level-1 input
    lists and ``group_spec_id`` the group spec's id (:mod:`.handoff`). Raises compression.CodecError on NaN / Inf (sign encoding)."""
    o = spec.owners[j]
    v = delta[o.start : o.end]
    packet: wire.Buffer
    if spec.push_encoding == "fp32":
        packet = fp32_buffer(v)
    else:
        packet = compression.encode(v, block_size=spec.block_size, tokens=tokens).to_bytes()
    head = collective_pb2.PartContribution(
        round=spec.round,
        part=j,
        start=o.start,
        end=o.end,
        tokens=tokens,
        spec_id=spec.spec_id,
        encoding=spec.push_encoding,
        compute_end=compute_end,
        members=[_pid_bytes(p) for p, _ in members],
        member_tokens=[int(n) for _, n in members],
        group_inputs=[bytes(b) for b in group_inputs],
        group_spec_id=bytes(group_spec_id),
        # the same lists signed on their own: a group member checks them without the packet (a level-1 drop)
        group_commitment=sign_commitment(
            identity, spec.run_id, spec.round, spec.spec_id, j, group_spec_id, group_inputs
        )
        if group_spec_id
        else b"",
    ).SerializeToString()
    return wire.signed_parts(
        identity,
        run_id=spec.run_id,
        round=spec.round,
        kind=CONTRIBUTION_KIND,
        payload=[head, *wire.bytes_field(8, [packet])],
    )


def contribution_bytes(
    identity: Identity, spec: CollectiveSpec, j: int, delta: torch.Tensor, tokens: int, compute_end: float = 0.0
) -> bytes:
    """:func:`contribution_parts` joined: the SignedMessage bytes of a PartContribution (one copy of
    the packet). Raises compression.CodecError on NaN / Inf."""
    return b"".join(contribution_parts(identity, spec, j, delta, tokens, compute_end))


def push_request_bytes(signed: Union[wire.Buffer, list[wire.Buffer]], witness: bool = False) -> bytes:
    """The PushPartRequest bytes carrying a signed contribution (bytes, or the buffer list of
    :func:`contribution_parts`: then the packet is copied once, here); ``witness``: the owner's own
    contribution handed to its part's witness (accountable mode)."""
    parts = list(signed) if isinstance(signed, list) else [signed]
    return b"".join([*wire.bytes_field(1, parts), b"\x10\x01" if witness else b""])


def push_request_witness(payload: wire.Buffer) -> bool:
    """Whether a PushPartRequest is a witness push (field 2). Scans the fields (no copy of the contribution).
    Raises EnvelopeError(INVALID_ARGUMENT) when malformed."""
    try:
        small = wire.small_fields(payload, wire.scan(payload), (1,))
        return bool(collective_pb2.PushPartRequest.FromString(small).witness)
    except (wire.WireError, DecodeError):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "PushPartRequest is malformed") from None


def push_request_contribution(payload: wire.Buffer) -> memoryview:
    """The signed contribution a PushPartRequest carries, as a view of ``payload`` (no copy).
    Raises EnvelopeError(INVALID_ARGUMENT) when malformed."""
    try:
        return wire.one_bytes_field(payload, wire.scan(payload), 1, "PushPartRequest")
    except wire.WireError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "PushPartRequest is malformed") from None


def _contribution_fields(payload: wire.Buffer) -> tuple[Any, memoryview]:
    """A PartContribution's small fields (protobuf message, ``packet`` left empty) and its packet as a
    view of ``payload``. Raises WireError / DecodeError when malformed."""
    spans = wire.scan(payload)
    packet = wire.one_bytes_field(payload, spans, 8, "PartContribution")
    return collective_pb2.PartContribution.FromString(wire.small_fields(payload, spans, (8,))), packet


def check_contribution(
    verifier: Verifier, spec: CollectiveSpec, part: Optional[int], signed: wire.Buffer, caller: Optional[str]
) -> tuple[int, Contribution]:
    """Verify a sender-signed contribution; returns ``(part index, Contribution)``.

    ``part``: the part it must be for (a relay reader, the own part), or None: the part it names
    (an owner on push; a part index beyond the spec is refused before the signature is checked).
    ``caller``: the peer that pushed it (must be the signer), or None (forwarded).

    Raises EnvelopeError: malformed (INVALID_ARGUMENT), forged or tampered (UNAUTHENTICATED /
    DATA_LOSS), not the caller's or not a participant's (PERMISSION_DENIED), another round's or
    spec's (INVALID_ARGUMENT / FAILED_PRECONDITION), wrong part, range, encoding, length, block
    size, malformed packet or NaN / Inf (INVALID_ARGUMENT).
    """
    try:
        msg = wire.SignedView(signed)  # the payload stays a view of ``signed``: no copy
    except wire.WireError:
        raise EnvelopeError(
            Code.INVALID_ARGUMENT,
            "contribution is malformed" if part is None else "contribution is not a SignedMessage",
        ) from None
    c = packet_view = None
    if part is None:
        try:
            c, packet_view = _contribution_fields(msg.payload)
        except (DecodeError, wire.WireError):
            raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution is malformed") from None
        part = int(c.part)
        if part >= len(spec.owners):
            raise EnvelopeError(Code.INVALID_ARGUMENT, f"part {part} does not exist in round {spec.round}")
    # A SignedView offers what verify reads (HasField, envelope, payload); v.payload is then a view too.
    v = verifier.verify(
        cast(envelope_pb2.SignedMessage, msg), kind=CONTRIBUTION_KIND, check_replay=False
    )  # hashes the payload view once
    sender = v.sender.to_string()
    if caller is not None and sender != caller:
        raise EnvelopeError(
            Code.PERMISSION_DENIED, f"contribution signed by {_short(sender)} but pushed by {_short(caller)}"
        )
    if c is None:
        try:
            c, packet_view = _contribution_fields(v.payload)
        except (DecodeError, wire.WireError):
            raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution payload is malformed") from None
    if packet_view is None:  # parsed together with c, in one branch or the other
        raise RuntimeError("contribution packet not parsed")
    # (peek: c was parsed from the very payload the verifier hashed, so it is the signed content)
    if c.round != v.round or c.round != spec.round:
        raise EnvelopeError(
            Code.INVALID_ARGUMENT, f"contribution is for round {c.round} (envelope {v.round}), expected {spec.round}"
        )
    del v, msg
    if c.spec_id != spec.spec_id:
        raise EnvelopeError(Code.FAILED_PRECONDITION, f"contribution was made for another spec of round {spec.round}")
    if sender not in spec.participants:
        raise EnvelopeError(
            Code.PERMISSION_DENIED, f"sender {_short(sender)} is not a participant of round {spec.round}"
        )
    if c.part != part:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"contribution is for part {c.part}, expected {part}")
    o = spec.owners[part]
    if (c.start, c.end) != (o.start, o.end):
        raise EnvelopeError(
            Code.INVALID_ARGUMENT, f"wrong range [{c.start}, {c.end}) for part {part}, expected [{o.start}, {o.end})"
        )
    if c.encoding != spec.push_encoding:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"encoding {c.encoding!r}, the round uses {spec.push_encoding!r}")
    packet: Any
    try:
        if c.encoding == "fp32":
            packet = fp32_view(packet_view, o.size)  # a read-only view into ``signed``
        else:
            packet = compression.packet_from_bytes(bytes(packet_view))  # 1/32 of the part: copied
            signed = bytes(signed)  # small: kept as bytes (verified work and evidence read it)
            if not isinstance(packet, compression.SignPacket):
                raise compression.CodecError(f"packet is a {type(packet).__name__}, expected a sign packet")
            if packet.numel != o.size:
                raise compression.CodecError(f"wrong length: {packet.numel} elements, part {part} has {o.size}")
            if packet.block_size != spec.block_size:
                raise compression.CodecError(f"block size {packet.block_size}, the round uses {spec.block_size}")
    except compression.CodecError as e:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"bad packet: {e}") from None
    # A claimed compute end in the future is clamped: it only feeds idle accounting.
    return part, Contribution(
        sender,
        int(c.tokens),
        packet,
        signed,
        min(float(c.compute_end), swarm_time()) if math.isfinite(c.compute_end) else 0.0,
        contribution_digest(signed) if spec.mode == "accountable" else b"",
        _members(spec, c),
        _group_inputs(verifier, spec, c, sender),
        bytes(c.group_spec_id),
    )


def _group_inputs(verifier: Verifier, spec: CollectiveSpec, c: Any, sender: str) -> tuple[bytes, ...]:
    """A contribution's level-1 input lists (:mod:`.handoff`): taken on an accountable cross spec only, each a whole
    number of :data:`~.commitment.RECORD_BYTES` records, with the sender's own signature over them
    (:mod:`.group_commitment`: without it a member could not prove a drop from them without the packet).
    Raises EnvelopeError (INVALID_ARGUMENT) otherwise."""
    if not c.group_inputs and not c.group_spec_id and not c.group_commitment:
        return ()
    if not spec.readers or spec.mode != "accountable":
        raise EnvelopeError(
            Code.INVALID_ARGUMENT, "contribution carries group inputs outside an accountable grouped round"
        )
    if len(c.group_spec_id) != 32 or any(len(b) % RECORD_BYTES for b in c.group_inputs):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution's group input lists are malformed")
    try:
        if open_commitment(verifier, signed_commitment_of(c)).owner != sender:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "signed by another peer")
    except EnvelopeError as e:
        raise EnvelopeError(
            Code.INVALID_ARGUMENT, f"contribution's group commitment is not its own: {e.reason}"
        ) from None
    return tuple(bytes(b) for b in c.group_inputs)


def _members(spec: CollectiveSpec, c: Any) -> tuple[tuple[str, int], ...]:
    """A contribution's group members (a grouped round's cross level, :mod:`.groups`), checked: only a spec with
    readers (the cross level) takes them; each a participant or reader of the round, once, and their tokens sum
    to the contribution's. Raises EnvelopeError (INVALID_ARGUMENT) otherwise."""
    if not c.members and not c.member_tokens:
        return ()
    if not spec.readers:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution lists group members outside a grouped round")
    if len(c.members) != len(c.member_tokens):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution's members and member tokens differ in length")
    try:
        out = tuple((PeerID(bytes(m)).to_string(), int(n)) for m, n in zip(c.members, c.member_tokens))
    except Exception:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution lists a malformed member") from None
    names = [p for p, _ in out]
    if len(set(names)) != len(names) or not all(spec.may_read(p) for p in names):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution lists a member twice or one not in the round")
    if sum(n for _, n in out) != int(c.tokens):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution's member tokens do not sum to its tokens")
    return out


def build_result(
    identity: Identity,
    spec: CollectiveSpec,
    index: int,
    owner: PartOwner,
    closed_by: str,
    contributions: list[Contribution],
    witness_receipt: bytes = b"",
) -> bytes:
    """The owner-signed PartResult (SignedMessage bytes) of part ``index`` from ``contributions``
    (sorted by raw PeerID): relay forwards them; reencode aggregates them (``spec.aggregate``) and
    encodes the mean as ``spec.aggregate_encoding``; contributions the agreement filter dropped
    are not listed. Accountable: as reencode, and the result commits to *every* accepted contribution
    (dropped ones flagged) in its ``inputs`` list (:mod:`.commitment`); the contributor list is left
    empty (readers derive it from the inputs), and ``witness_receipt`` (the witness's receipt of the owner's
    own contribution, :func:`.accountable.witness_of`) is carried when given. A grouped round's cross level
    (``spec.readers``) lists each counted contribution's group members, accountable results included (one member
    list per input the filter kept, in the inputs' order)."""
    used = [spec.counted_tokens(c.sender, c.tokens) for c in contributions]
    aggregate: list[wire.Buffer] = []
    listed = list(range(len(contributions)))
    counted: Optional[list[int]] = None
    inputs = b""
    if spec.mode in ("reencode", "accountable"):
        dropped: list[int] = []
        mean = spec.aggregate([(n, c.packet) for n, c in zip(used, contributions)], owner.size, dropped)
        listed = [i for i in listed if i not in set(dropped)]  # the filter's drops delivered nothing here
        if spec.mode == "accountable":
            rank = {p: k for k, p in enumerate(participant_order(spec.participants))}
            inputs = encode_inputs(
                [
                    InputEntry(rank[c.sender], n, i in set(dropped), c.digest or contribution_digest(c.signed))
                    for i, (c, n) in enumerate(zip(contributions, used))
                ]
            )
            counted = listed  # a grouped round's cross level: the member lists of the inputs the aggregate counts
            listed = []
        # fp32: a view of ``mean`` (kept alive by the view), copied once when the result is joined
        aggregate = wire.bytes_field(10, [aggregate_buffer(spec.aggregate_encoding, mean, spec.block_size, sum(used))])
        del mean
    with_members = listed if counted is None else counted
    head = collective_pb2.PartResult(
        round=spec.round,
        part=index,
        start=owner.start,
        end=owner.end,
        spec_id=spec.spec_id,
        mode=spec.mode,
        contributors=[_pid_bytes(contributions[i].sender) for i in listed],
        tokens=[used[i] for i in listed],
        member_counts=[len(contributions[i].members) for i in with_members] if spec.readers else [],
        members=[_pid_bytes(p) for i in with_members for p, _ in contributions[i].members] if spec.readers else [],
        member_tokens=[n for i in with_members for _, n in contributions[i].members] if spec.readers else [],
        aggregate_encoding=spec.aggregate_encoding if spec.mode != "relay" else "",
        closed_by=closed_by or "",
        last_compute_end=max((c.compute_end for c in contributions), default=0.0),
        inputs=inputs,
        witness_receipt=witness_receipt if spec.mode == "accountable" else b"",
    ).SerializeToString()
    payload: list[wire.Buffer] = [head, *aggregate]
    if spec.mode == "relay":
        for c in contributions:
            payload.extend(wire.bytes_field(9, wire.bytes_field(1, [c.signed])))
    return b"".join(
        wire.signed_parts(identity, run_id=spec.run_id, round=spec.round, kind=RESULT_KIND, payload=payload)
    )


def _result_fields(payload: wire.Buffer) -> tuple[Any, memoryview, list[memoryview]]:
    """A PartResult's small fields (protobuf message without ``aggregate`` and ``contributions``), its
    aggregate and its relayed signed contributions, as views of ``payload``. Raises WireError /
    DecodeError when malformed."""
    spans = wire.scan(payload)
    aggregate = wire.one_bytes_field(payload, spans, 10, "PartResult")
    relayed = []
    for span in spans:
        if span[0] == 9:
            item = wire.value(payload, span)
            relayed.append(wire.one_bytes_field(item, wire.scan(item), 1, "Contribution"))
    res = collective_pb2.PartResult.FromString(wire.small_fields(payload, spans, (9, 10)))
    return res, aggregate, relayed


_PROOF_OF_TAMPERING = frozenset({Code.UNAUTHENTICATED, Code.DATA_LOSS, Code.INVALID_ARGUMENT, Code.PERMISSION_DENIED})
"""Refusal codes of a relayed contribution that depend on its bytes alone (not on the reader's clock)."""


def _votes(c: Contribution, tokens_used: int) -> bool:
    """True when contribution ``c`` votes in its part: tokens after the plan's cap > 0 and, for a sign
    packet, at least one block scale > 0 (a zero-scale block abstains in the robust rules)."""
    if tokens_used <= 0:
        return False
    packet = c.packet
    if isinstance(packet, compression.SignPacket):
        return bool((packet.scales > 0).any())
    return True


def read_result(
    verifier: Verifier,
    spec: CollectiveSpec,
    j: int,
    signed: wire.Buffer,
    out: Optional[torch.Tensor] = None,
    on_bad_relay: Optional[Callable[[str], None]] = None,
) -> tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]:
    """Verify the owner-signed PartResult of part ``j``; returns (fp32 [part size] -- ``out`` when
    given, e.g. the part's slice of the round's aggregate --, contributors ``[(peer, tokens used)]``,
    last compute end (unix s), relayed sign packets by sender).

    Relay: every forwarded contribution is re-verified; invalid ones (``on_bad_relay(reason)`` is
    called) and repeated senders are dropped (the same bytes give the same choice on every peer),
    the rest are sorted by raw PeerID, capped and aggregated by ``spec.aggregate``. fp32 relayed
    contributions are not returned (verified work checks sign packets only; keeping them would pin
    every sender's whole part).

    Relay results are held to two more rules (an adversarial review: one flipping owner of three, with
    an honest peer that trained 0 steps, moved the model by its own flipped update every round):

    * an owner that relays a contribution failing a check that depends on the bytes alone (forged or
      tampered: UNAUTHENTICATED, DATA_LOSS; malformed or misattributed: INVALID_ARGUMENT,
      PERMISSION_DENIED) forfeits the part: an honest owner verified every contribution it took,
      so the signed result is proof of tampering; every reader refuses the same bytes;
    * the quorum counts *voting* contributions (tokens > 0 after the plan's cap, and for sign
      packets a block scale > 0): a 0-token or all-zero contribution is valid but abstains. A result
      whose valid contributions reach the quorum but whose votes do not aggregates to zero, and
      lists its contributors with 0 tokens (an idle range: the outer step does not move it).

    Raises EnvelopeError when the result is malformed, not the owner's, not this round's spec, relays
    a forged or tampered contribution, or is below the quorum (``out`` may then hold partial values:
    the caller zeroes a refused part).
    """
    o = spec.owners[j]
    try:
        msg = wire.SignedView(signed)  # the payload stays a view of ``signed``: no copy
    except wire.WireError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result is not a SignedMessage") from None
    v = verifier.verify(cast(envelope_pb2.SignedMessage, msg), kind=RESULT_KIND, check_replay=False)  # as above
    if v.sender.to_string() != o.peer_id:
        raise EnvelopeError(Code.PERMISSION_DENIED, f"part result signed by {v.sender.short()}, not its owner")
    try:
        res, aggregate, relayed = _result_fields(v.payload)
    except (DecodeError, wire.WireError):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result payload is malformed") from None
    del v, msg
    if (res.round, res.part, res.start, res.end, res.spec_id, res.mode) != (
        spec.round,
        j,
        o.start,
        o.end,
        spec.spec_id,
        spec.mode,
    ):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result does not match the round's spec")
    if max(len(res.contributors), len(relayed)) > len(spec.participants):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result lists more contributors than participants")
    if spec.mode == "accountable":
        return _read_accountable(verifier, spec, j, res, aggregate, out)
    if spec.mode == "reencode":
        if len(res.contributors) != len(res.tokens):
            raise EnvelopeError(Code.INVALID_ARGUMENT, "part result lists contributors and tokens of different lengths")
        agg = _decode(spec, aggregate, o.size, out)
        if not spec.quorum_met(PeerID(bytes(p)).to_string() for p in res.contributors):
            raise EnvelopeError(
                Code.FAILED_PRECONDITION,
                f"part result aggregates {len(res.contributors)} contribution(s), the quorum is "
                f"{spec.quorum_count()} of {len(spec.established())} established participant(s)",
            )
        return (
            agg,
            [(PeerID(bytes(p)).to_string(), int(n)) for p, n in zip(res.contributors, res.tokens)],
            float(res.last_compute_end) if math.isfinite(res.last_compute_end) else 0.0,
            {},
        )
    taken: dict[str, Contribution] = {}
    del res, aggregate
    forged: list[str] = []
    for item in relayed:
        try:
            _, c = check_contribution(verifier, spec, j, item, None)
        except EnvelopeError as err:
            if on_bad_relay is not None:
                on_bad_relay(err.reason)
            if err.code in _PROOF_OF_TAMPERING:
                forged.append(err.reason)
            continue
        taken.setdefault(c.sender, c)
    del relayed
    if forged:
        raise EnvelopeError(
            Code.DATA_LOSS,
            f"the owner relayed {len(forged)} forged or tampered contribution(s) "
            f"({forged[0]}): its part result is refused",
        )
    if not spec.quorum_met(taken):
        raise EnvelopeError(
            Code.FAILED_PRECONDITION,
            f"part result holds {len(taken)} valid contribution(s), the quorum is "
            f"{spec.quorum_count()} of {len(spec.established())} established participant(s)",
        )
    ordered = sorted(taken.values(), key=lambda c: _pid_bytes(c.sender))
    used = [spec.counted_tokens(c.sender, c.tokens) for c in ordered]
    if not spec.quorum_met(c.sender for c, n in zip(ordered, used) if _votes(c, n)):
        # Enough valid contributions, too few votes: nothing trustworthy to aggregate here.
        if out is None:
            out = torch.zeros(o.size, dtype=torch.float32)
        else:
            out.zero_()
        return out, [(c.sender, 0) for c in ordered], max((c.compute_end for c in ordered), default=0.0), {}
    dropped: list[int] = []
    agg = spec.aggregate([(n, c.packet) for n, c in zip(used, ordered)], o.size, dropped, out=out)
    # A contribution the agreement filter dropped delivered nothing to this part: it is not listed as a
    # contributor (every reader drops the same ones), so one dropped everywhere counts as a no-show.
    listed = [(c.sender, n) for i, (c, n) in enumerate(zip(ordered, used)) if i not in set(dropped)]
    if dropped:  # every reader drops the same ones: the same line at every peer
        log.info(
            "round %d: part %d: the aggregation's agreement/support filter dropped %s of %d contribution(s)",
            spec.round,
            j,
            ", ".join(str(ordered[i].sender)[:10] for i in sorted(set(dropped))),
            len(ordered),
        )
    packets = {c.sender: c.packet for c in ordered if isinstance(c.packet, compression.SignPacket)}
    return agg, listed, max((c.compute_end for c in ordered), default=0.0), packets


class OverBoundError(EnvelopeError):
    """A result every reader refuses because its aggregate is above the round's scale bound
    (:class:`~geomesh_p2p.exchange.aggregate.ScaleBoundError`): a forgery in form, so an accountable result is still
    validated (its hash seeds the validator draw) and its owner proven."""


def _decode(spec: CollectiveSpec, aggregate: memoryview, size: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    """A re-encoded result's aggregate, fp32 [size] (into ``out`` when given), held to ``spec.max_scale``.
    Raises :class:`OverBoundError` above the bound, EnvelopeError (INVALID_ARGUMENT) when it does not decode."""
    try:
        return decode_aggregate(spec.aggregate_encoding, aggregate, size, out=out, max_scale=spec.max_scale)
    except ScaleBoundError as e:
        raise OverBoundError(Code.INVALID_ARGUMENT, f"bad aggregate: {e}") from None
    except compression.CodecError as e:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"bad aggregate: {e}") from None


def _read_accountable(
    verifier: Verifier, spec: CollectiveSpec, j: int, res: Any, aggregate: memoryview, out: Optional[torch.Tensor]
) -> tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]:
    """:func:`read_result` of an accountable result (signature and spec already checked): the aggregate
    decoded into ``out``, the contributors from its input list (entries the filter dropped left out)."""
    o = spec.owners[j]
    order = participant_order(spec.participants)
    try:
        entries = decode_inputs(res.inputs, len(order))
    except InputsError as e:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"part result's input list is malformed: {e}") from None
    if res.contributors or res.tokens:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "accountable part result lists contributors outside its inputs")
    why = witness_problem(verifier, spec, j, bytes(res.witness_receipt), entries)
    if why is not None:  # an input only its owner could serve: validators could be kept from checking the part
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"accountable part result refused: {why}")
    agg = _decode(spec, aggregate, o.size, out)
    listed = [(order[e.index], int(e.tokens)) for e in entries if not e.dropped]
    if not spec.quorum_met(p for p, _ in listed):
        raise EnvelopeError(
            Code.FAILED_PRECONDITION,
            f"part result aggregates {len(listed)} contribution(s), the quorum is "
            f"{spec.quorum_count()} of {len(spec.established())} established participant(s)",
        )
    end = float(res.last_compute_end) if math.isfinite(res.last_compute_end) else 0.0
    return agg, listed, end, {}


class PullReply:
    """A PullPartResponse read without copying its result: the small fields parsed by protobuf,
    ``signed_result`` a memoryview of the reply's payload."""

    __slots__ = ("ready", "held_s", "signed_result")

    def __init__(self, payload) -> None:
        spans = wire.scan(payload)
        small = collective_pb2.PullPartResponse.FromString(wire.small_fields(payload, spans, (4,)))
        self.ready, self.held_s = small.ready, small.held_s
        self.signed_result = wire.one_bytes_field(payload, spans, 4, "PullPartResponse")


async def parse_pull(payload) -> PullReply:
    """A PullPartResponse (:class:`PullReply`). Raises DecodeError when malformed."""
    try:
        return PullReply(payload)
    except wire.WireError as e:
        raise DecodeError(str(e)) from None


def result_members(
    signed: wire.Buffer,
    groups: Optional[Mapping[str, Collection[str]]] = None,
    participants: Optional[Collection[str]] = None,
) -> Optional[list[tuple[str, int]]]:
    """The group members a grouped round's cross-level result counted (:mod:`.groups`): every listed contributor's
    members with their tokens, in the result's order, from a PartResult whose owner signature the caller already
    checked (:func:`read_result`). ``groups``: contributor -> the peers it may list (its group); the members it
    lists outside it are left out (a slice owner vouches for its own group only). None when the result lists no
    members, or its member lists do not add up (a malformed result: the caller keeps the contributors as listed).
    An accountable result lists its contributors as inputs (:mod:`.commitment`): ``participants`` (the cross spec's)
    names them; without it such a result gives None."""
    try:
        res, _, _ = _result_fields(wire.SignedView(signed).payload)
    except (DecodeError, wire.WireError):
        return None
    counts, members, tokens = list(res.member_counts), list(res.members), list(res.member_tokens)
    contributors = list(res.contributors)
    if res.mode == "accountable":
        if participants is None:
            return None
        order = participant_order(participants)
        try:
            entries = decode_inputs(res.inputs, len(order))
        except InputsError:
            return None
        contributors = [_pid_bytes(order[e.index]) for e in entries if not e.dropped]
    if not members or len(counts) != len(contributors) or sum(counts) != len(members) or len(members) != len(tokens):
        return None
    try:
        listed = [(PeerID(bytes(m)).to_string(), int(n)) for m, n in zip(members, tokens)]
        senders = [PeerID(bytes(c)).to_string() for c in contributors]
    except Exception:
        return None
    if groups is None:
        return listed
    out: list[tuple[str, int]] = []
    at = 0
    for sender, k in zip(senders, counts):
        mates = groups.get(sender, ())
        out.extend((p, n) for p, n in listed[at : at + k] if p in mates)
        at += k
    return out
