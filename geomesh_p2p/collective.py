"""Compressed sign synchronization (CSS) over gRPC: a reduce-scatter / all-gather of signed parts.

Source: GeoMesh (arXiv 2609.18388), "Compressed sign synchronization"; the partition and the
push-to-owner / pull-from-owner pattern follow hivemind's butterfly all-reduce
(``hivemind.averaging.allreduce``) and its ``load_balance_peers`` (``hivemind.averaging.load_balancing``).
DESIGN.md, "Round r" step 4 (Exchange) and step 6 (Failures), "Identity and trust".

One round, one group (see docs/collective.md for the whole protocol and its rules):

* The flat fp32 pseudo-gradient of ``numel`` elements is split into contiguous parts, one per
  *owner* (:class:`PartOwner`, sizes from :func:`make_partition`). Client-only peers own nothing.
* Every participant signs and **pushes** part ``j`` (sign-encoded, with its token count) to owner
  ``j`` (``PushPart``; the owner's own part is accepted locally, no RPC).
* The owner **closes** part ``j`` when every participant has pushed it or at ``spec.deadline``;
  later pushes are refused (``FAILED_PRECONDITION``) and those senders are left out of that part.
* Every participant **pulls** part ``j`` from its owner (``PullPart``, long poll, re-polled until
  ``spec.pull_deadline``). The owner answers with a :class:`PartResult` *signed by the owner*:
  ``relay`` -> the senders' own signed contributions and whom it took; ``reencode`` -> the
  token-weighted mean it computed, encoded as sign / int8 / fp16 (or fp32 for the baseline).
* Every RPC is started by the side that needs the other (senders push, readers pull), so a
  client-only peer only ever makes outbound calls.

Determinism. The mean of a part is :func:`token_weighted_mean` over the contributions sorted by raw
PeerID bytes, with one fixed sequence of fp32 operations (each one IEEE rounding, no fused
kernels), so relay-mode peers and a reencode-mode owner compute bit-identical vectors, and every
peer ends with the same aggregate bitwise. Robustness rules (same everywhere): token counts are
``min(claimed, cap)``; per block, each contributor's scale is clipped to ``clip_k x`` the median of
that block's scales over the part's contributors.

Failures. A sender that does not deliver part ``j`` before the deadline is absent from part ``j``
(every peer uses the owner's list). A part whose owner is gone -- no result by ``pull_deadline``,
from the owner or from any other serving peer that cached the owner's signed result -- is a zero
update for that range, logged, and listed in :attr:`AllReduceResult.missing_parts`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from geomesh_p2p import aggregation, compression
from geomesh_p2p.aio import wait_event
from geomesh_p2p.aggregation import token_weighted_mean  # noqa: F401  (re-exported: the simulator and tests use it)
from geomesh_p2p.identity import EnvelopeError, PeerID, Verified, Verifier
from geomesh_p2p.links import LinkSample, link_sample
from geomesh_p2p.transport import COLLECTIVE_PULL, COLLECTIVE_PUSH, RpcError, TaskOwner, Transport
from geomesh_p2p.wire import collective_pb2, envelope_pb2

log = logging.getLogger(__name__)

MODES = ("relay", "reencode")
PUSH_ENCODINGS = ("sign", "fp32")
AGGREGATE_ENCODINGS = ("sign", "int8", "fp16", "fp32")
CONTRIBUTION_KIND = "geomesh.collective/Contribution"  # inner envelope kind of a sender's part
RESULT_KIND = "geomesh.collective/PartResult"  # inner envelope kind of an owner's part result

Code = grpc.StatusCode
# OUT_OF_RANGE: the envelope's timestamp aged past the skew window between signing and
# verification (a large message on a slow or congested link): re-signing and resending can succeed.
# RESOURCE_EXHAUSTED: the owner's transport is busy (per-caller / per-class call caps): try again.
_RETRY_PUSH = {Code.UNAVAILABLE, Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED}
_RETRY_PULL = {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.UNKNOWN, Code.INTERNAL,
               Code.OUT_OF_RANGE}


def _pid_str(p: Union[PeerID, str, bytes]) -> str:
    if isinstance(p, PeerID):
        return p.to_string()
    if isinstance(p, bytes):
        return PeerID(p).to_string()
    if isinstance(p, str):
        PeerID.from_string(p)  # validates
        return p
    raise TypeError(f"expected a PeerID or its base58 string, got {type(p).__name__}")


def _pid_bytes(p: str) -> bytes:
    return bytes(PeerID.from_string(p))


def _held(stated: float, call_s: float) -> float:
    """A server's stated hold (seconds), clamped to [0, call_s]; a bogus value counts as 0."""
    return min(max(0.0, float(stated)), call_s) if math.isfinite(stated) else 0.0


def _short(p: str) -> str:
    return p[:10]


# ------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class PartOwner:
    """Owner of the part ``[start, end)`` (elements) of the flat vector; ``address`` = ``host:port``."""

    peer_id: str
    address: str
    start: int
    end: int

    def __post_init__(self):
        object.__setattr__(self, "peer_id", _pid_str(self.peer_id))
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "end", int(self.end))
        if not (0 <= self.start < self.end):
            raise ValueError(f"part range [{self.start}, {self.end}) is empty or negative")
        if not self.address:
            raise ValueError(f"owner {_short(self.peer_id)} has no address (client-only peers own no part)")

    @property
    def size(self) -> int:
        return self.end - self.start


def make_partition(
    numel: int,
    owners: Sequence[tuple[Union[PeerID, str], str, Optional[float]]],
    *,
    block_size: int = 2048,
    min_size: int = 0,
) -> list[PartOwner]:
    """Split ``[0, numel)`` into contiguous parts sized by bandwidth (hivemind ``load_balance_peers``).

    Args:
        numel: elements of the flat vector (> 0).
        owners: ``(peer_id, address, bandwidth)`` of the peers that accept connections, in the
            order the parts should follow (the caller leaves client-only peers out). ``bandwidth``
            in bytes/s (any common unit; only ratios matter); ``None`` = unknown (the mean of the others).
        block_size: part boundaries fall on multiples of this many elements (the codec's block
            size), so a part's blocks are the blocks of the whole vector; only the last part ends at ``numel``.
        min_size: an owner that would get fewer elements than this gets none (load_balance_peers' rule).

    Returns:
        The non-empty parts in ``owners`` order (an owner given 0 elements by the optimizer is dropped).

    Raises:
        ValueError: ``numel`` < 1, no owners, a negative bandwidth, or duplicate peer ids.
    """
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if not owners:
        raise ValueError("no owners to partition among")
    ids = [_pid_str(o[0]) for o in owners]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate peer id among owners")
    bws = [None if o[2] is None else float(o[2]) for o in owners]
    if any(b is not None and (b < 0 or not math.isfinite(b)) for b in bws):
        raise ValueError(f"bandwidths must be finite and >= 0, got {bws}")
    if all(b is not None and b == 0 for b in bws):
        bws = [None] * len(bws)
    with warnings.catch_warnings():  # hivemind/scipy deprecation chatter, not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        from hivemind.averaging.load_balancing import load_balance_peers  # slow import: only when needed

        units = -(-numel // block_size)
        sizes = load_balance_peers(units, bws, -(-min_size // block_size) if min_size else 0)
    parts, start = [], 0
    for (pid, addr, _), n_units in zip(owners, sizes):
        if n_units <= 0:
            continue
        end = min(numel, start + int(n_units) * block_size)
        parts.append(PartOwner(_pid_str(pid), addr, start, end))
        start = end
    assert start == numel, (start, numel, sizes)
    return parts


def _bytes_per_element(encoding: str, block_size: int) -> float:
    """Upper bound of the encoded bytes per element (headers aside) of a packet in ``encoding``."""
    scales = 4.0 / block_size
    return {"fp32": 4.0, "fp16": 2.0 + scales, "int8": 1.0 + scales, "sign": 0.125 + scales}[encoding]


def max_part_elements(*, push_encoding: str, mode: str, aggregate_encoding: str, n_participants: int,
                      block_size: int, max_message_bytes: int) -> int:
    """The most elements one part may hold so that every message about it fits ``max_message_bytes``.

    The largest messages of a part are a contribution (``push_encoding``) and its result: the
    re-encoded aggregate (reencode) or all ``n_participants`` contributions (relay). A tenth of the
    limit plus 64 KiB are left for envelopes and protobuf framing. Returns a positive multiple of
    ``block_size``. Raises ValueError when not even one block fits.
    """
    push = _bytes_per_element(push_encoding, block_size)
    result = push * max(1, n_participants) if mode == "relay" else _bytes_per_element(aggregate_encoding, block_size)
    room = 0.9 * max_message_bytes - (64 << 10)
    n = int(room // max(push, result)) // block_size * block_size
    if n < block_size:
        raise ValueError(f"a part of one block ({block_size} elements) does not fit {max_message_bytes} bytes")
    return n


def split_owners(owners: Sequence[PartOwner], max_elements: int) -> list[PartOwner]:
    """Cut every part longer than ``max_elements`` into consecutive parts of that size (the last one
    shorter), same owner and address: a peer then owns several parts, each small enough for one gRPC
    message. Deterministic, so every peer derives the same spec from the same plan."""
    if max_elements < 1:
        raise ValueError(f"max_elements={max_elements} must be >= 1")
    out = []
    for o in owners:
        for a in range(o.start, o.end, max_elements):
            out.append(PartOwner(o.peer_id, o.address, a, min(o.end, a + max_elements)))
    return out


@dataclass(frozen=True)
class CollectiveSpec:
    """Everything one all-reduce needs to agree on; built by the round protocol from the RoundPlan.

    Attributes:
        run_id: the run (must equal the transport's run id).
        round: round number; envelopes carry it and old rounds are refused.
        participants: base58 PeerID -> token cap: who may contribute, and the most tokens each may
            claim (a claim above it is cut to it; a cap of 0 makes the peer's weight 0).
        owners: contiguous :class:`PartOwner` list covering ``[0, numel)``.
        numel: elements of the flat fp32 vector.
        deadline: unix seconds by which pushes must arrive; the owner closes open parts then.
        pull_deadline: unix seconds after which a part with no result counts as missing.
        mode: ``"relay"`` or ``"reencode"``.
        aggregate_encoding: reencode mode: ``"sign"``, ``"int8"``, ``"fp16"`` (or ``"fp32"``, baseline).
        block_size: codec block size B (elements per scale).
        clip_k: scale clipping factor (None = off); see :func:`token_weighted_mean`.
        push_encoding: ``"sign"`` (CSS) or ``"fp32"`` (uncompressed baseline: an fp32 butterfly
            all-reduce when combined with reencode/fp32; no scale clipping).
        rule: aggregation rule of every part (:data:`geomesh_p2p.aggregation.RULES`): ``"mean"`` (the
            token-weighted mean) or a robust rule (``"meanmed"``, ``"vote"``); see docs/security.md.
        weight_cap: each contributor's weight is at most this multiple of the median weight (None = off).
        min_agreement: robust rules drop a contribution whose signs agree with the first-pass consensus
            on fewer than this share of elements (None = off).
        quorum: a part result counts only when it aggregates at least ``ceil(quorum x participants)``
            contributions (0 = any); below it every reader treats the part as missing (the same bytes
            give the same decision everywhere), so an owner cannot replace the group's update with its own.
            Participants on ``probation`` count in neither side: the basis is the established
            participants and so are the contributions counted (see :meth:`quorum_count`).
        probation: participants on probation (new identities, :mod:`geomesh_p2p.probation`): they
            may contribute, but the quorum is counted without them, and an owner closes a part
            ``grace_s`` seconds after every *established* participant pushed it, without waiting for
            them until the deadline. At least one participant must be established.
        grace_s: see ``probation`` (unused when nobody is on probation).

    ``spec_id`` (SHA-256 of the canonical JSON of all fields) travels in every push and pull;
    a peer with a different spec for the same round is refused with ``FAILED_PRECONDITION``.
    """

    run_id: str
    round: int
    participants: Mapping[str, int]
    owners: tuple[PartOwner, ...]
    numel: int
    deadline: float
    pull_deadline: float
    mode: str = "reencode"
    aggregate_encoding: str = "sign"
    block_size: int = 2048
    clip_k: Optional[float] = 4.0
    push_encoding: str = "sign"
    rule: str = "mean"
    weight_cap: Optional[float] = None
    min_agreement: Optional[float] = None
    quorum: float = 0.0
    probation: Sequence[str] = ()
    grace_s: float = 1.0
    spec_id: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self):
        parts = {}
        for p, cap in dict(self.participants).items():
            cap = int(cap)
            if cap < 0:
                raise ValueError(f"token cap of {p} is negative")
            parts[_pid_str(p)] = cap
        if not parts:
            raise ValueError("a round needs at least one participant")
        object.__setattr__(self, "participants", parts)
        owners = tuple(o if isinstance(o, PartOwner) else PartOwner(**o) for o in self.owners)
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "round", int(self.round))
        object.__setattr__(self, "numel", int(self.numel))
        object.__setattr__(self, "block_size", int(self.block_size))
        object.__setattr__(self, "deadline", float(self.deadline))
        object.__setattr__(self, "pull_deadline", float(self.pull_deadline))
        if self.clip_k is not None:
            object.__setattr__(self, "clip_k", float(self.clip_k))
            if not (self.clip_k > 0 and math.isfinite(self.clip_k)):
                raise ValueError(f"clip_k must be > 0 or None, got {self.clip_k}")
        if self.numel < 1 or self.block_size < 1 or self.round < 0:
            raise ValueError("numel and block_size must be >= 1, round >= 0")
        if not owners:
            raise ValueError("a round needs at least one part owner")
        pos = 0
        for o in owners:
            if o.start != pos:
                raise ValueError(f"owner parts are not contiguous at element {pos} (next starts at {o.start})")
            pos = o.end
        if pos != self.numel:
            raise ValueError(f"owner parts cover [0, {pos}), expected [0, {self.numel})")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.aggregate_encoding not in AGGREGATE_ENCODINGS:
            raise ValueError(f"aggregate_encoding must be one of {AGGREGATE_ENCODINGS}, got {self.aggregate_encoding!r}")
        if self.push_encoding not in PUSH_ENCODINGS:
            raise ValueError(f"push_encoding must be one of {PUSH_ENCODINGS}, got {self.push_encoding!r}")
        if self.pull_deadline < self.deadline:
            raise ValueError("pull_deadline must not be before deadline")
        if self.rule not in aggregation.RULES:
            raise ValueError(f"rule must be one of {aggregation.RULES}, got {self.rule!r}")
        for name in ("weight_cap", "min_agreement"):
            x = getattr(self, name)
            if x is not None:
                object.__setattr__(self, name, float(x))
                if not (math.isfinite(x) and x > 0):
                    raise ValueError(f"{name} must be > 0 or None, got {x}")
        object.__setattr__(self, "quorum", float(self.quorum))
        if not 0.0 <= self.quorum <= 1.0:
            raise ValueError(f"quorum must be in [0, 1], got {self.quorum}")
        probation = tuple(sorted({_pid_str(p) for p in self.probation}))
        if any(p not in parts for p in probation):
            raise ValueError("every peer on probation must be a participant")
        if len(probation) >= len(parts):
            raise ValueError("at least one participant must be established (not on probation)")
        object.__setattr__(self, "probation", probation)
        object.__setattr__(self, "grace_s", float(self.grace_s))
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ValueError(f"grace_s must be finite and >= 0, got {self.grace_s}")
        object.__setattr__(self, "spec_id", hashlib.sha256(self._canonical_json().encode()).digest())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the inverse of :meth:`from_dict`)."""
        return {
            "run_id": self.run_id, "round": self.round, "numel": self.numel,
            "participants": dict(sorted(self.participants.items())),
            "owners": [[o.peer_id, o.address, o.start, o.end] for o in self.owners],
            "deadline": self.deadline, "pull_deadline": self.pull_deadline, "mode": self.mode,
            "aggregate_encoding": self.aggregate_encoding, "block_size": self.block_size,
            "clip_k": self.clip_k, "push_encoding": self.push_encoding, "rule": self.rule,
            "weight_cap": self.weight_cap, "min_agreement": self.min_agreement, "quorum": self.quorum,
            "probation": list(self.probation), "grace_s": self.grace_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CollectiveSpec":
        d = dict(d)
        d["owners"] = tuple(PartOwner(*o) if isinstance(o, (list, tuple)) else PartOwner(**o) for o in d["owners"])
        return cls(**d)

    def _canonical_json(self) -> str:
        d = self.to_dict()
        d["deadline"], d["pull_deadline"] = repr(self.deadline), repr(self.pull_deadline)
        for k in ("clip_k", "weight_cap", "min_agreement", "quorum"):
            d[k] = None if d[k] is None else repr(d[k])
        if self.probation:
            d["grace_s"] = repr(self.grace_s)
        else:  # specs without probation keep the spec_id they had before the field existed
            del d["probation"], d["grace_s"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def part_index_of(self, peer_id: str) -> list[int]:
        return [j for j, o in enumerate(self.owners) if o.peer_id == peer_id]

    def established(self) -> list[str]:
        """Participants not on probation (the quorum's basis)."""
        return [p for p in self.participants if p not in self.probation]

    def quorum_count(self) -> int:
        """Fewest contributions *of established participants* a part result must aggregate to count:
        ``ceil(quorum x established participants)`` (every participant when nobody is on probation)."""
        return math.ceil(self.quorum * len(self.established()) - 1e-9)

    def quorum_met(self, senders) -> bool:
        """True when ``senders`` (the contributors of a part result) reach :meth:`quorum_count`."""
        probation = set(self.probation)
        return sum(1 for p in set(senders) if p not in probation) >= self.quorum_count()

    def aggregate(self, items: Sequence[tuple[int, Any]], numel: int, dropped: Optional[list] = None) -> torch.Tensor:
        """This round's rule over ``(tokens capped by the plan, packet)`` in PeerID order -> fp32 [numel];
        the indices of items the agreement filter dropped are appended to ``dropped`` if given."""
        return aggregation.aggregate_part(items, numel, rule=self.rule, encoding=self.push_encoding,
                                          clip_k=self.clip_k, weight_cap=self.weight_cap,
                                          min_agreement=self.min_agreement, dropped=dropped)


# ------------------------------------------------------------------------------- the arithmetic


def _fp32_to_bytes(v: torch.Tensor) -> bytes:
    return v.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def _fp32_from_bytes(data: bytes, numel: int) -> torch.Tensor:
    """Raw little-endian fp32 -> tensor [numel]; CodecError on a wrong length or NaN/Inf."""
    if len(data) != 4 * numel:
        raise compression.CodecError(f"wrong fp32 length: {len(data)} bytes, expected {4 * numel}")
    t = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32, copy=True))
    if not bool(torch.isfinite(t).all()):
        raise compression.CodecError("fp32 values contain NaN or Inf")
    return t


def _encode_aggregate(kind: str, v: torch.Tensor, block_size: int, tokens: int) -> bytes:
    if kind == "fp32":
        return _fp32_to_bytes(v)
    return compression.encode_as(kind, v, block_size=block_size, tokens=tokens).to_bytes()


def _decode_aggregate(kind: str, data: bytes, numel: int) -> torch.Tensor:
    """Owner's encoded mean -> fp32 [numel]; CodecError on a wrong kind, length or non-finite values."""
    if kind == "fp32":
        return _fp32_from_bytes(data, numel)
    packet = compression.packet_from_bytes(data)
    if compression.packet_kind(packet) != kind:
        raise compression.CodecError(f"aggregate is a {compression.packet_kind(packet)} packet, the round asks for {kind}")
    if packet.numel != numel:
        raise compression.CodecError(f"aggregate has {packet.numel} elements, the part has {numel}")
    out = compression.decode_any(packet)
    if not bool(torch.isfinite(out).all()):
        raise compression.CodecError("aggregate decodes to NaN or Inf")
    return out


# ------------------------------------------------------------------------------------ results


@dataclass
class AllReduceResult:
    """What one peer got from one round's all-reduce.

    Attributes:
        aggregate: fp32 CPU tensor [numel], the token-weighted mean (zeros in missing parts).
        contributors: part index -> ``[(peer_id base58, tokens used)]`` in the fixed order
            (ascending raw PeerID), as the owner took them; absent for missing parts.
        missing_parts: indices of parts with no result by ``pull_deadline`` (owner gone or refused).
        pushed: part index -> True when the owner accepted this peer's contribution.
        bytes_sent / bytes_received: serialized SignedMessage bytes of this node's PushPart and
            PullPart traffic (client and server side) while the call ran.
        wall_s: seconds the call took.
        last_compute_end: unix seconds when the last contributor (of any part) finished its inner
            steps, as the senders stated it: the barrier for straggler-idle accounting (0 if unknown).
        contributions: relay mode: sender (base58 PeerID) -> part index -> its verified packet for that
            part (a :class:`compression.SignPacket`, or an fp32 tensor for fp32 pushes), as relayed by the
            owners; what verified work (:mod:`geomesh_p2p.verify`) re-checks. Empty in reencode mode.
        part_ranges: ``[start, end)`` of every part, in part order (the spec's owners).
        upload / download: this node's pushes to other owners and its pulls of ready results as
            :class:`~geomesh_p2p.links.LinkSample` (payload bytes over the busy time of the link,
            the owners' stated hold taken out), or None when nothing crossed the network.
    """

    aggregate: torch.Tensor
    contributors: dict[int, list[tuple[str, int]]]
    missing_parts: list[int]
    pushed: dict[int, bool]
    bytes_sent: int
    bytes_received: int
    wall_s: float
    last_compute_end: float = 0.0
    upload: Optional[LinkSample] = None
    download: Optional[LinkSample] = None
    contributions: dict[str, dict[int, Any]] = field(default_factory=dict)
    part_ranges: list[tuple[int, int]] = field(default_factory=list)

    def idle_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` element ranges of the parts that aggregated no token this round (missing, or
        every contribution had 0 tokens): nobody trained there, so the outer step must not move them."""
        return [rg for j, rg in enumerate(self.part_ranges) if j in self.missing_parts or self.tokens(j) == 0]

    def tokens(self, part: int) -> int:
        """Total tokens aggregated in ``part`` (0 if missing)."""
        return sum(n for _, n in self.contributors.get(part, []))


@dataclass
class _Contribution:
    sender: str
    tokens: int  # claimed
    packet: Any  # SignPacket or fp32 tensor
    signed: bytes  # SignedMessage bytes of the PartContribution
    compute_end: float = 0.0  # unix seconds the sender says its inner steps ended


@dataclass
class _OwnedPart:
    index: int
    owner: PartOwner
    contributions: dict[str, _Contribution] = field(default_factory=dict)
    closed_by: Optional[str] = None
    closing_early: bool = False  # every established participant pushed: the close is scheduled
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    signed_result: Optional[bytes] = None


@dataclass
class _RoundState:
    spec: CollectiveSpec
    parts: dict[int, _OwnedPart]
    cache: dict[int, bytes] = field(default_factory=dict)  # owner-signed results pulled from others
    contributing: bool = False
    compute_end: float = 0.0  # this node's, carried in its contributions
    # (direction "up"/"down", payload bytes, start, end) in monotonic seconds, server hold taken out
    transfers: list[tuple[str, int, float, float]] = field(default_factory=list)


# ------------------------------------------------------------------------------------ service


class CollectiveService:
    """One per node: serves ``PushPart`` / ``PullPart`` for the parts it owns and runs all-reduces.

    Create it before ``await transport.start()`` (it registers its handlers). Per-round state
    (accepted contributions, signed results, cached results of others' parts) is kept for the
    ``max_rounds_kept`` newest rounds, so slow peers can still pull after this node has finished.

    Unknown rounds: a push or pull for a round whose spec this node has not registered yet is
    *held* up to ``hold_unknown_round_s`` seconds (the spec usually arrives within milliseconds,
    when this node's own round starts); after that the push is refused with ``UNAVAILABLE`` and the
    sender retries until its deadline (pulls simply answer "not ready"). At most
    ``max_held_requests`` requests are held at once (more: ``UNAVAILABLE`` right away). Rounds older
    than the kept window are refused with ``FAILED_PRECONDITION``.

    Refusals (status: reason), each logged once per (round, sender, status): sender not a
    participant (PERMISSION_DENIED), contribution signed by someone other than the caller
    (PERMISSION_DENIED), forged/tampered inner signature (UNAUTHENTICATED / DATA_LOSS), round in
    payload differs from envelope (INVALID_ARGUMENT), stale round / other spec / part already closed
    (FAILED_PRECONDITION), wrong range, length, block size, encoding, malformed packet, NaN/Inf or
    negative scales (INVALID_ARGUMENT), part not owned here (NOT_FOUND).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        max_rounds_kept: int = 3,
        long_poll_s: float = 5.0,
        hold_unknown_round_s: float = 2.0,
        max_held_requests: int = 256,
        push_grace_s: float = 0.5,
        max_concurrent_pushes: int = 2,
    ):
        if transport.address is not None:
            raise RuntimeError("create the CollectiveService before transport.start()")
        self.transport = transport
        self.peer_id = transport.identity.peer_id.to_string()
        self.max_rounds_kept = max_rounds_kept
        self.long_poll_s = long_poll_s
        self.hold_unknown_round_s = hold_unknown_round_s
        self.max_held_requests = max_held_requests
        self.push_grace_s = push_grace_s
        self.max_concurrent_pushes = max(1, int(max_concurrent_pushes))
        self._rounds: dict[int, _RoundState] = {}
        self._oldest_kept = 0  # rounds below this were pruned
        self._round_events: dict[int, asyncio.Event] = {}
        self._held = 0
        self._tasks = TaskOwner(f"collective {_short(self.peer_id)}")
        self._logged: set[tuple] = set()
        # Inner signatures (contributions, part results) are checked without skew or replay
        # windows: they are forwarded, and replay is already checked on the outer envelope.
        self._inner = Verifier(transport.run_id, max_skew_s=float("inf"),
                               max_payload_bytes=transport.config.max_message_bytes)
        transport.add_unary(COLLECTIVE_PUSH, self._handle_push)
        transport.add_unary(COLLECTIVE_PULL, self._handle_pull)

    # --------------------------------------------------------------------------- registration
    def register(self, spec: CollectiveSpec) -> _RoundState:
        """Make this node ready to accept pushes for ``spec`` (idempotent for the same spec).

        ``all_reduce`` calls it; an owner that does not contribute (a pure aggregator) calls it
        directly. Prunes rounds older than the ``max_rounds_kept`` newest. Raises ValueError for
        another run, a different spec for a registered round, a pruned round, or a client-only
        transport that owns a part.
        """
        if spec.run_id != self.transport.run_id:
            raise ValueError(f"spec is for run {spec.run_id!r}, the transport serves {self.transport.run_id!r}")
        state = self._rounds.get(spec.round)
        if state is not None:
            if state.spec.spec_id != spec.spec_id:
                raise ValueError(f"round {spec.round} is already registered with a different spec")
            return state
        if spec.round < self._oldest_kept or (
                len(self._rounds) >= self.max_rounds_kept and spec.round < min(self._rounds)):
            raise ValueError(f"round {spec.round} is older than the rounds kept here "
                             f"({self.rounds_kept() or 'from ' + str(self._oldest_kept)})")
        mine = spec.part_index_of(self.peer_id)
        if mine and self.transport.config.client_only:
            raise ValueError("a client-only peer cannot own a part")
        state = _RoundState(spec, {j: _OwnedPart(j, spec.owners[j]) for j in mine})
        self._rounds[spec.round] = state
        ev = self._round_events.pop(spec.round, None)
        if ev is not None:
            ev.set()
        if len(self._rounds) > self.max_rounds_kept:
            keep = sorted(self._rounds)[-self.max_rounds_kept:]
            self._oldest_kept = max(self._oldest_kept, keep[0])
            for r in [r for r in self._rounds if r < keep[0]]:
                del self._rounds[r]
        if state.parts:
            self._tasks.spawn(self._close_at_deadline(state), name=f"close r{spec.round}")
        return state

    def rounds_kept(self) -> list[int]:
        return sorted(self._rounds)

    async def close(self) -> None:
        """Cancel background tasks (deadline timers, reductions). The transport is the caller's."""
        await self._tasks.close()

    # ---------------------------------------------------------------- test hooks (fault injection)
    async def _before_push(self, spec: CollectiveSpec, part: int) -> None:
        """Called before this node delivers part ``part`` (also its own). Tests override it."""

    async def _before_reduce(self, spec: CollectiveSpec, part: int) -> None:
        """Called when an owned part closed, before its result is built. Tests override it."""

    # ------------------------------------------------------------------------------ logging
    def _log_once(self, key: tuple, level: int, msg: str, *args) -> None:
        if key in self._logged:
            return
        if len(self._logged) > 10_000:
            self._logged.clear()
        self._logged.add(key)
        log.log(level, msg, *args)

    # ------------------------------------------------------------------------------ owner side
    async def _round_for(self, round: int, hold_s: float) -> Optional[_RoundState]:
        """The state of ``round``; waits up to ``hold_s`` for it to be registered (None: not yet)."""
        state = self._rounds.get(round)
        if state is not None:
            return state
        if round < self._oldest_kept:
            raise EnvelopeError(Code.FAILED_PRECONDITION,
                                f"round {round} is over on this node (oldest kept: {self._oldest_kept})")
        if hold_s <= 0 or self._held >= self.max_held_requests:
            return None
        ev = self._round_events.setdefault(round, asyncio.Event())
        self._held += 1
        try:
            await wait_event(ev, hold_s)
        finally:
            self._held -= 1
            if self._held == 0:
                self._round_events.clear()  # nobody waits on the rest
        return self._rounds.get(round)

    def _check_contribution(self, spec: CollectiveSpec, part: int, signed: bytes,
                            caller: Optional[str]) -> _Contribution:
        """Verify a sender-signed contribution to ``part``; EnvelopeError (status + reason) if bad.

        Used by the owner (on push) and by relay-mode readers (on every forwarded contribution).
        """
        try:
            msg = envelope_pb2.SignedMessage.FromString(signed)
        except DecodeError:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution is not a SignedMessage") from None
        v = self._inner.verify(msg, kind=CONTRIBUTION_KIND, check_replay=False)
        sender = v.sender.to_string()
        if caller is not None and sender != caller:
            raise EnvelopeError(Code.PERMISSION_DENIED,
                                f"contribution signed by {_short(sender)} but pushed by {_short(caller)}")
        try:
            c = collective_pb2.PartContribution.FromString(v.payload)
        except DecodeError:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution payload is malformed") from None
        if c.round != v.round or c.round != spec.round:
            raise EnvelopeError(Code.INVALID_ARGUMENT,
                                f"contribution is for round {c.round} (envelope {v.round}), expected {spec.round}")
        if c.spec_id != spec.spec_id:
            raise EnvelopeError(Code.FAILED_PRECONDITION, f"contribution was made for another spec of round {spec.round}")
        if sender not in spec.participants:
            raise EnvelopeError(Code.PERMISSION_DENIED,
                                f"sender {_short(sender)} is not a participant of round {spec.round}")
        if c.part != part:
            raise EnvelopeError(Code.INVALID_ARGUMENT, f"contribution is for part {c.part}, expected {part}")
        o = spec.owners[part]
        if (c.start, c.end) != (o.start, o.end):
            raise EnvelopeError(Code.INVALID_ARGUMENT,
                                f"wrong range [{c.start}, {c.end}) for part {part}, expected [{o.start}, {o.end})")
        if c.encoding != spec.push_encoding:
            raise EnvelopeError(Code.INVALID_ARGUMENT, f"encoding {c.encoding!r}, the round uses {spec.push_encoding!r}")
        try:
            if c.encoding == "fp32":
                packet = _fp32_from_bytes(c.packet, o.size)
            else:
                packet = compression.packet_from_bytes(c.packet)
                if not isinstance(packet, compression.SignPacket):
                    raise compression.CodecError(f"packet is a {type(packet).__name__}, expected a sign packet")
                if packet.numel != o.size:
                    raise compression.CodecError(f"wrong length: {packet.numel} elements, part {part} has {o.size}")
                if packet.block_size != spec.block_size:
                    raise compression.CodecError(f"block size {packet.block_size}, the round uses {spec.block_size}")
        except compression.CodecError as e:
            raise EnvelopeError(Code.INVALID_ARGUMENT, f"bad packet: {e}") from None
        # A claimed compute end in the future is clamped: it only feeds idle accounting.
        return _Contribution(sender, int(c.tokens), packet, signed, min(float(c.compute_end), time.time())
                             if math.isfinite(c.compute_end) else 0.0)

    async def _handle_push(self, verified: Verified, context) -> bytes:
        t_in = time.monotonic()
        caller = verified.sender.to_string()
        round_, part_ix = verified.round, None
        try:
            try:
                req = collective_pb2.PushPartRequest.FromString(verified.payload)
            except DecodeError:
                raise EnvelopeError(Code.INVALID_ARGUMENT, "PushPartRequest is malformed") from None
            state = await self._round_for(verified.round, self.hold_unknown_round_s)
            if state is None:
                raise EnvelopeError(Code.UNAVAILABLE, f"round {verified.round} is not open on this node yet")
            spec = state.spec
            # Part index first (cheap), so a push to the wrong node is told so.
            try:
                msg = envelope_pb2.SignedMessage.FromString(req.contribution)
                part_ix = collective_pb2.PartContribution.FromString(msg.payload).part
            except DecodeError:
                raise EnvelopeError(Code.INVALID_ARGUMENT, "contribution is malformed") from None
            if part_ix >= len(spec.owners):
                raise EnvelopeError(Code.INVALID_ARGUMENT, f"part {part_ix} does not exist in round {spec.round}")
            c = await asyncio.to_thread(self._check_contribution, spec, part_ix, req.contribution, caller)
            part = state.parts.get(part_ix)
            if part is None:
                raise EnvelopeError(Code.NOT_FOUND, f"this node does not own part {part_ix} of round {spec.round}")
            resp = self._accept(state, part, c)
            resp.held_s = time.monotonic() - t_in  # lets the sender time its upload without our work
            return resp.SerializeToString()
        except EnvelopeError as err:
            self._log_once((round_, caller, "push", err.code), logging.WARNING,
                           "round %d: refused a push%s from %s: %s: %s", round_,
                           "" if part_ix is None else f" of part {part_ix}", _short(caller), err.code.name, err.reason)
            raise

    def _accept(self, state: _RoundState, part: _OwnedPart, c: _Contribution) -> collective_pb2.PushPartResponse:
        spec = state.spec
        if c.sender in part.contributions:
            return collective_pb2.PushPartResponse(accepted=True, reason="duplicate push ignored (first one kept)")
        if part.closed_by is not None:
            raise EnvelopeError(Code.FAILED_PRECONDITION,
                                f"part {part.index} of round {spec.round} closed ({part.closed_by}) before this push arrived")
        part.contributions[c.sender] = c
        if len(part.contributions) == len(spec.participants):
            self._close(state, part, "all pushed")
        elif spec.probation and not part.closing_early and all(p in part.contributions for p in spec.established()):
            # Every established participant pushed: the peers on probation get a short grace, not the deadline.
            part.closing_early = True
            self._tasks.spawn(self._close_after_grace(state, part), name=f"grace r{spec.round} p{part.index}")
        return collective_pb2.PushPartResponse(accepted=True, reason="")

    async def _close_after_grace(self, state: _RoundState, part: _OwnedPart) -> None:
        await asyncio.sleep(max(0.0, min(state.spec.grace_s, state.spec.deadline - time.time())))
        if self._rounds.get(state.spec.round) is state:
            self._close(state, part, "established pushed")

    def _close(self, state: _RoundState, part: _OwnedPart, reason: str) -> None:
        if part.closed_by is not None:
            return
        part.closed_by = reason
        absent = [p for p in state.spec.participants if p not in part.contributions]
        if absent and reason == "established pushed":
            log.info("round %d: part %d closed %.1fs after every established participant pushed, without %s "
                     "(on probation)", state.spec.round, part.index, state.spec.grace_s,
                     ", ".join(_short(p) for p in sorted(absent)))
        elif absent:
            log.warning("round %d: part %d closed at the deadline without %s (left out of this part)",
                        state.spec.round, part.index, ", ".join(_short(p) for p in sorted(absent)))
        else:
            log.debug("round %d: part %d closed (%s)", state.spec.round, part.index, reason)
        self._tasks.spawn(self._finish(state, part), name=f"reduce r{state.spec.round} p{part.index}")

    async def _close_at_deadline(self, state: _RoundState) -> None:
        await asyncio.sleep(max(0.0, state.spec.deadline - time.time()))
        if self._rounds.get(state.spec.round) is not state:
            return  # pruned meanwhile
        for part in state.parts.values():
            self._close(state, part, "deadline")

    async def _finish(self, state: _RoundState, part: _OwnedPart) -> None:
        spec = state.spec
        try:
            await self._before_reduce(spec, part.index)
            contributions = sorted(part.contributions.values(), key=lambda c: _pid_bytes(c.sender))
            part.signed_result = await asyncio.to_thread(self._build_result, spec, part, contributions)
            part.ready.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("round %d: building the result of part %d failed; it will be missing", spec.round,
                          part.index)

    def _build_result(self, spec: CollectiveSpec, part: _OwnedPart, contributions: list[_Contribution]) -> bytes:
        o = part.owner
        used = [min(c.tokens, spec.participants[c.sender]) for c in contributions]
        mean, listed = None, list(range(len(contributions)))
        if spec.mode == "reencode":
            dropped: list[int] = []
            mean = spec.aggregate([(n, c.packet) for n, c in zip(used, contributions)], o.size, dropped)
            listed = [i for i in listed if i not in set(dropped)]  # the filter's drops delivered nothing here
        res = collective_pb2.PartResult(
            round=spec.round, part=part.index, start=o.start, end=o.end, spec_id=spec.spec_id, mode=spec.mode,
            contributors=[_pid_bytes(contributions[i].sender) for i in listed], tokens=[used[i] for i in listed],
            aggregate_encoding=spec.aggregate_encoding if spec.mode == "reencode" else "",
            closed_by=part.closed_by or "",
            last_compute_end=max((c.compute_end for c in contributions), default=0.0))
        if spec.mode == "relay":
            res.contributions.extend(collective_pb2.Contribution(signed_message=c.signed) for c in contributions)
        else:
            res.aggregate = _encode_aggregate(spec.aggregate_encoding, mean, spec.block_size, sum(used))
        return self.transport.identity.sign_message(
            run_id=spec.run_id, round=spec.round, kind=RESULT_KIND, payload=res.SerializeToString()
        ).SerializeToString()

    async def _handle_pull(self, verified: Verified, context) -> bytes:
        caller = verified.sender.to_string()
        try:
            try:
                req = collective_pb2.PullPartRequest.FromString(verified.payload)
            except DecodeError:
                raise EnvelopeError(Code.INVALID_ARGUMENT, "PullPartRequest is malformed") from None
            if req.round != verified.round:
                raise EnvelopeError(Code.INVALID_ARGUMENT,
                                    f"payload round {req.round} differs from envelope round {verified.round}")
            wait_s = max(0.0, min(float(req.wait_s), 60.0)) if math.isfinite(req.wait_s) else 0.0
            t0 = time.monotonic()
            state = await self._round_for(req.round, min(wait_s, self.hold_unknown_round_s))
            not_ready = collective_pb2.PullPartResponse(round=req.round, part=req.part, ready=False)
            if state is None:
                return not_ready.SerializeToString()
            spec = state.spec
            if req.spec_id != spec.spec_id:
                raise EnvelopeError(Code.FAILED_PRECONDITION, f"pull is for another spec of round {spec.round}")
            if caller not in spec.participants and all(o.peer_id != caller for o in spec.owners):
                raise EnvelopeError(Code.PERMISSION_DENIED, f"{_short(caller)} is not in round {spec.round}")
            part = state.parts.get(req.part)
            if part is None:
                cached = state.cache.get(req.part)
                if cached is None:
                    raise EnvelopeError(Code.NOT_FOUND, f"part {req.part} of round {spec.round} is not held here")
                signed = cached
            else:
                left = wait_s - (time.monotonic() - t0)
                if not await wait_event(part.ready, left):
                    return not_ready.SerializeToString()
                signed = part.signed_result
            return collective_pb2.PullPartResponse(round=req.round, part=req.part, ready=True, signed_result=signed,
                                                   held_s=time.monotonic() - t0).SerializeToString()
        except EnvelopeError as err:
            if err.code != Code.NOT_FOUND:
                self._log_once((verified.round, caller, "pull", err.code), logging.WARNING,
                               "round %d: refused pull from %s: %s: %s", verified.round, _short(caller),
                               err.code.name, err.reason)
            raise

    # ----------------------------------------------------------------------------- peer side
    async def all_reduce(self, spec: CollectiveSpec, delta: torch.Tensor, tokens: int,
                         compute_end: Optional[float] = None) -> AllReduceResult:
        """Contribute ``delta`` (trained on ``tokens`` tokens) and return the round's aggregate.

        Args:
            spec: the round's :class:`CollectiveSpec`; this node must be a participant.
            delta: fp32 tensor with ``spec.numel`` elements (any shape, flattened), finite; not
                modified by this call, and must not be modified by the caller until it returns.
            tokens: tokens this peer trained on this round (>= 0; capped by the receivers).
            compute_end: unix seconds when this peer's inner steps ended (default: now); carried
                in its contributions so that every peer can tell straggler from network idle.

        Returns:
            :class:`AllReduceResult`. It returns by ``spec.pull_deadline`` (plus the time to decode),
            whatever the other peers do; parts with no result are zeros and listed as missing.

        Raises:
            ValueError: a bad spec / delta, not a participant, the round already run on this node.
            compression.CodecError: ``delta`` holds NaN or Inf.
        """
        t0 = time.time()
        me = self.peer_id
        if me not in spec.participants:
            raise ValueError(f"this node ({_short(me)}) is not a participant of round {spec.round}")
        if not isinstance(delta, torch.Tensor) or delta.numel() != spec.numel:
            raise ValueError(f"delta must be a tensor with {spec.numel} elements")
        if int(tokens) < 0:
            raise ValueError("tokens must be >= 0")
        delta = delta.detach().to("cpu", torch.float32).reshape(-1)
        if not bool(torch.isfinite(delta).all()):
            raise compression.CodecError("delta contains NaN or Inf; refusing to contribute")
        state = self.register(spec)
        if state.contributing:
            raise ValueError(f"round {spec.round} was already run on this node")
        state.contributing = True
        state.compute_end = t0 if compute_end is None else float(compute_end)
        s_before = self._collective_bytes()

        # Butterfly order: start with the part after "mine" so that not every sender hits owner 0
        # first; at most max_concurrent_pushes uploads at once, so each upload gets the link to
        # itself and arrives soon after it was signed (the receiver checks the envelope's age).
        n_parts = len(spec.owners)
        me_rank = sorted(spec.participants, key=_pid_bytes).index(me)
        order = [(me_rank + 1 + k) % n_parts for k in range(n_parts)]
        uploads = asyncio.Semaphore(self.max_concurrent_pushes)
        by_part = {j: asyncio.ensure_future(self._deliver(state, j, delta, int(tokens), uploads)) for j in order}
        pushes = [by_part[j] for j in range(n_parts)]
        pulls = [asyncio.ensure_future(self._obtain(state, j)) for j in range(len(spec.owners))]
        try:
            outcomes = await asyncio.gather(*pulls)
            pushed = dict(enumerate(await asyncio.gather(*pushes)))
        finally:
            for t in pushes + pulls:
                t.cancel()
            await asyncio.gather(*pushes, *pulls, return_exceptions=True)

        aggregate = torch.zeros(spec.numel, dtype=torch.float32)
        contributors, missing = {}, []
        packets: dict[str, dict[int, Any]] = {}
        last_compute_end = 0.0
        for j, out in enumerate(outcomes):
            o = spec.owners[j]
            if out is None:
                missing.append(j)
                continue
            aggregate[o.start:o.end] = out[0]
            contributors[j] = out[1]
            last_compute_end = max(last_compute_end, out[2])
            for sender, packet in out[3].items():
                packets.setdefault(sender, {})[j] = packet
        if missing:
            log.warning("round %d: parts %s have no result (owner gone or refused): zero update for %s", spec.round,
                        missing, ", ".join(f"[{spec.owners[j].start}, {spec.owners[j].end})" for j in missing))
        s_after = self._collective_bytes()
        up = link_sample((n, a, b) for d, n, a, b in state.transfers if d == "up")
        down = link_sample((n, a, b) for d, n, a, b in state.transfers if d == "down")
        return AllReduceResult(aggregate, contributors, missing, pushed, s_after[0] - s_before[0],
                               s_after[1] - s_before[1], time.time() - t0, last_compute_end, up, down, packets,
                               [(o.start, o.end) for o in spec.owners])

    def _collective_bytes(self) -> tuple[int, int]:
        by = self.transport.stats.by_method
        a, b = by.get(COLLECTIVE_PUSH, (0, 0)), by.get(COLLECTIVE_PULL, (0, 0))
        return a[0] + b[0], a[1] + b[1]

    def _contribution_bytes(self, spec: CollectiveSpec, j: int, delta: torch.Tensor, tokens: int,
                            compute_end: float = 0.0) -> bytes:
        o = spec.owners[j]
        v = delta[o.start:o.end]
        if spec.push_encoding == "fp32":
            packet = _fp32_to_bytes(v)
        else:
            packet = compression.encode(v, block_size=spec.block_size, tokens=tokens).to_bytes()
        c = collective_pb2.PartContribution(round=spec.round, part=j, start=o.start, end=o.end, tokens=tokens,
                                            spec_id=spec.spec_id, encoding=spec.push_encoding, packet=packet,
                                            compute_end=compute_end)
        return self.transport.identity.sign_message(run_id=spec.run_id, round=spec.round, kind=CONTRIBUTION_KIND,
                                                    payload=c.SerializeToString()).SerializeToString()

    async def _deliver(self, state: _RoundState, j: int, delta: torch.Tensor, tokens: int,
                       uploads: Optional[asyncio.Semaphore] = None) -> bool:
        """Encode, sign and push part ``j`` to its owner, retrying UNAVAILABLE / OUT_OF_RANGE until
        the deadline. ``uploads`` bounds the pushes in flight (the local part does not count)."""
        spec = state.spec
        owner = spec.owners[j]
        await self._before_push(spec, j)
        if owner.peer_id != self.peer_id and uploads is not None:
            async with uploads:
                return await self._deliver_now(state, j, delta, tokens)
        return await self._deliver_now(state, j, delta, tokens)

    async def _deliver_now(self, state: _RoundState, j: int, delta: torch.Tensor, tokens: int) -> bool:
        spec = state.spec
        owner = spec.owners[j]
        signed = await asyncio.to_thread(self._contribution_bytes, spec, j, delta, tokens,
                                         state.compute_end)
        if owner.peer_id == self.peer_id:
            part = state.parts[j]
            try:
                c = await asyncio.to_thread(self._check_contribution, spec, j, signed, self.peer_id)
                self._accept(state, part, c)
                return True
            except EnvelopeError as err:
                log.warning("round %d: own part %d refused my contribution: %s", spec.round, j, err.reason)
                return False
        payload = collective_pb2.PushPartRequest(contribution=signed).SerializeToString()
        delay = 0.05
        while True:
            remaining = spec.deadline - time.time()
            if remaining <= 0:
                log.warning("round %d: part %d not delivered to %s before the deadline", spec.round, j,
                            _short(owner.peer_id))
                return False
            try:
                t_call = time.monotonic()
                reply = await self.transport.call(owner.address, COLLECTIVE_PUSH, payload, round=spec.round,
                                                  timeout=remaining + self.push_grace_s)
                t_reply = time.monotonic()
            except RpcError as e:
                if e.code in _RETRY_PUSH and spec.deadline - time.time() > 0:
                    await asyncio.sleep(min(delay, max(0.0, spec.deadline - time.time())))
                    delay = min(2 * delay, 0.5)
                    continue
                self._log_once((spec.round, owner.peer_id, "push-failed", j), logging.WARNING,
                               "round %d: push of part %d to %s failed: %s: %s", spec.round, j,
                               _short(owner.peer_id), e.code.name, e.reason)
                return False
            if reply.sender.to_string() != owner.peer_id:
                log.warning("round %d: part %d: %s answered instead of owner %s", spec.round, j,
                            reply.sender.short(), _short(owner.peer_id))
                return False
            resp = collective_pb2.PushPartResponse.FromString(reply.payload)
            # The bytes were on the wire before the owner's handler ran: its hold ends the interval early.
            state.transfers.append(("up", len(payload), t_call, t_reply - _held(resp.held_s, t_reply - t_call)))
            return resp.accepted

    async def _obtain(self, state: _RoundState, j: int
                      ) -> Optional[tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]]:
        """Result of part ``j`` as (fp32 [size], contributors, last compute end, relayed packets by sender),
        or None if none by the pull deadline."""
        spec = state.spec
        owner = spec.owners[j]
        if owner.peer_id == self.peer_id:
            part = state.parts[j]
            left = spec.pull_deadline - time.time()
            if not await wait_event(part.ready, left):
                log.warning("round %d: my own part %d is not reduced by the pull deadline", spec.round, j)
                return None
            signed = part.signed_result
        else:
            signed = await self._pull(spec, j)
            if signed is None:
                return None
        try:
            out = await asyncio.to_thread(self._read_result, spec, j, signed)
        except EnvelopeError as err:
            # A hostile or broken owner, not a fault of this node: every reader refuses the same bytes.
            log.warning("round %d: result of part %d from %s refused: %s: %s", spec.round, j, _short(owner.peer_id),
                        err.code.name, err.reason)
            return None
        if owner.peer_id != self.peer_id and spec.round in self._rounds:
            state.cache[j] = signed  # serve it to peers that cannot reach the owner
        return out

    async def _pull(self, spec: CollectiveSpec, j: int) -> Optional[bytes]:
        owner = spec.owners[j]
        helpers = [o.address for o in {o.peer_id: o for o in spec.owners}.values()
                   if o.peer_id not in (owner.peer_id, self.peer_id)]
        delay, last_err = 0.05, "no answer"
        while True:
            remaining = spec.pull_deadline - time.time()
            if remaining <= 0:
                log.warning("round %d: part %d: no result from owner %s by the pull deadline (%s)", spec.round, j,
                            _short(owner.peer_id), last_err)
                return None
            wait_s = max(0.0, min(self.long_poll_s, remaining - 0.25))
            req = collective_pb2.PullPartRequest(round=spec.round, part=j, wait_s=wait_s, spec_id=spec.spec_id)
            try:
                t_call = time.monotonic()
                reply = await self.transport.call(owner.address, COLLECTIVE_PULL, req.SerializeToString(),
                                                  round=spec.round, timeout=remaining)
                t_reply = time.monotonic()
                resp = collective_pb2.PullPartResponse.FromString(reply.payload)
                if resp.ready:
                    # The long poll comes first, the result's bytes after it: the hold starts the interval late.
                    state = self._rounds.get(spec.round)
                    if state is not None:
                        state.transfers.append(("down", len(reply.payload),
                                                t_call + _held(resp.held_s, t_reply - t_call), t_reply))
                    return resp.signed_result
                if wait_s < 0.05:
                    await asyncio.sleep(min(0.05, max(0.0, spec.pull_deadline - time.time())))
                continue
            except RpcError as e:
                last_err = f"{e.code.name}: {e.reason}"
                if e.code not in _RETRY_PULL:
                    log.warning("round %d: part %d refused by owner %s: %s", spec.round, j, _short(owner.peer_id),
                                last_err)
                    return None
            except DecodeError:
                last_err = "malformed reply"
            # The owner is unreachable: maybe another serving peer got the owner's signed result.
            for h in helpers:
                left = spec.pull_deadline - time.time()
                if left <= 0:
                    break
                req = collective_pb2.PullPartRequest(round=spec.round, part=j, wait_s=0.0, spec_id=spec.spec_id)
                try:
                    reply = await self.transport.call(h, COLLECTIVE_PULL, req.SerializeToString(), round=spec.round,
                                                      timeout=min(1.0, left))
                    resp = collective_pb2.PullPartResponse.FromString(reply.payload)
                    if resp.ready:
                        log.info("round %d: part %d obtained from %s (owner unreachable)", spec.round, j,
                                 reply.sender.short())
                        return resp.signed_result
                except (RpcError, DecodeError):
                    pass
            await asyncio.sleep(min(delay, max(0.0, spec.pull_deadline - time.time())))
            delay = min(2 * delay, 0.5)

    def _read_result(self, spec: CollectiveSpec, j: int, signed: bytes
                     ) -> tuple[torch.Tensor, list[tuple[str, int]], float, dict[str, Any]]:
        """Verify the owner-signed PartResult of part ``j`` and turn it into (fp32 [size], contributors).

        Relay: every forwarded contribution is re-verified; invalid ones and repeated senders are
        dropped (the same bytes give the same choice on every peer), the rest are sorted by raw
        PeerID, capped, clipped and averaged with :func:`token_weighted_mean`.
        """
        o = spec.owners[j]
        try:
            msg = envelope_pb2.SignedMessage.FromString(signed)
        except DecodeError:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "part result is not a SignedMessage") from None
        v = self._inner.verify(msg, kind=RESULT_KIND, check_replay=False)
        if v.sender.to_string() != o.peer_id:
            raise EnvelopeError(Code.PERMISSION_DENIED, f"part result signed by {v.sender.short()}, not its owner")
        try:
            res = collective_pb2.PartResult.FromString(v.payload)
        except DecodeError:
            raise EnvelopeError(Code.INVALID_ARGUMENT, "part result payload is malformed") from None
        if (res.round, res.part, res.start, res.end, res.spec_id, res.mode) != (
                spec.round, j, o.start, o.end, spec.spec_id, spec.mode):
            raise EnvelopeError(Code.INVALID_ARGUMENT, "part result does not match the round's spec")
        if max(len(res.contributors), len(res.contributions)) > len(spec.participants):
            raise EnvelopeError(Code.INVALID_ARGUMENT, "part result lists more contributors than participants")
        if spec.mode == "reencode":
            if len(res.contributors) != len(res.tokens):
                raise EnvelopeError(Code.INVALID_ARGUMENT, "part result lists contributors and tokens of different lengths")
            try:
                out = _decode_aggregate(spec.aggregate_encoding, res.aggregate, o.size)
            except compression.CodecError as e:
                raise EnvelopeError(Code.INVALID_ARGUMENT, f"bad aggregate: {e}") from None
            if not spec.quorum_met(PeerID(bytes(p)).to_string() for p in res.contributors):
                raise EnvelopeError(Code.FAILED_PRECONDITION,
                                    f"part result aggregates {len(res.contributors)} contribution(s), the quorum is "
                                    f"{spec.quorum_count()} of {len(spec.established())} established participant(s)")
            return (out, [(PeerID(bytes(p)).to_string(), int(n)) for p, n in zip(res.contributors, res.tokens)],
                    float(res.last_compute_end) if math.isfinite(res.last_compute_end) else 0.0, {})
        taken: dict[str, _Contribution] = {}
        for item in res.contributions:
            try:
                c = self._check_contribution(spec, j, item.signed_message, None)
            except EnvelopeError as err:
                self._log_once((spec.round, o.peer_id, "relay-bad", j), logging.WARNING,
                               "round %d: part %d: owner %s relayed an invalid contribution, dropped: %s",
                               spec.round, j, _short(o.peer_id), err.reason)
                continue
            taken.setdefault(c.sender, c)
        if not spec.quorum_met(taken):
            raise EnvelopeError(Code.FAILED_PRECONDITION,
                                f"part result holds {len(taken)} valid contribution(s), the quorum is "
                                f"{spec.quorum_count()} of {len(spec.established())} established participant(s)")
        ordered = sorted(taken.values(), key=lambda c: _pid_bytes(c.sender))
        used = [min(c.tokens, spec.participants[c.sender]) for c in ordered]
        dropped: list[int] = []
        out = spec.aggregate([(n, c.packet) for n, c in zip(used, ordered)], o.size, dropped)
        # A contribution the agreement filter dropped delivered nothing to this part: it is not listed as a
        # contributor (every reader drops the same ones), so one dropped everywhere counts as a no-show.
        listed = [(c.sender, n) for i, (c, n) in enumerate(zip(ordered, used)) if i not in set(dropped)]
        return (out, listed, max((c.compute_end for c in ordered), default=0.0), {c.sender: c.packet for c in ordered})
