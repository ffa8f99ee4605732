"""The collective's agreement: who owns which part (:class:`PartOwner`, :func:`make_partition`,
:func:`split_owners`, :func:`max_part_elements`) and the round's :class:`CollectiveSpec`.

Pure and synchronous (no I/O). The partition sizes come from the planner's one partition rule
(:func:`geomesh_p2p.schema.partition.part_sizes`) and the message-size bounds from the one codec-size
formula (:func:`geomesh_p2p.config.method.encoded_nbytes`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from geomesh_p2p.exchange import robust as aggregation
from geomesh_p2p.net.identity import PeerID
from geomesh_p2p.config.method import bytes_per_element
from geomesh_p2p.schema.partition import part_sizes

__all__ = [
    "MODES",
    "PUSH_ENCODINGS",
    "AGGREGATE_ENCODINGS",
    "PartOwner",
    "CollectiveSpec",
    "make_partition",
    "max_part_elements",
    "split_owners",
]

MODES = ("relay", "reencode", "accountable")
PUSH_ENCODINGS = ("sign", "fp32")
AGGREGATE_ENCODINGS = ("sign", "int8", "fp16", "fp32")


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
    """Split ``[0, numel)`` into contiguous parts sized by bandwidth: the planner's one partition rule
    (:func:`geomesh_p2p.schema.partition.part_sizes`: hivemind's ``load_balance_peers``, no owner above
    ``max_owner_units``).

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
    sizes = part_sizes(
        numel, [None if o[2] is None else float(o[2]) for o in owners], align=block_size, min_size=min_size
    )
    parts, start = [], 0
    for pid, (_, addr, _), size in zip(ids, owners, sizes):
        if size <= 0:
            continue
        parts.append(PartOwner(pid, addr, start, start + size))
        start += size
    assert start == numel, (start, numel, sizes)
    return parts


PIPELINE_PART_BYTES = 2 << 20
"""Default largest message of one part (bytes), below the message limit: an owner's range is cut into
parts of about this size so that the stages of the exchange overlap (one part is encoded and signed
while the previous one is on the wire, reduced or read), as hivemind streams its parts in chunks;
whole-part stages ran one after another. 2 MiB: on loopback (benchmarks/collective_vs_hivemind.py
``--max-part-mb``) 2 MB parts gave the fastest fp32 exchange measured; buffers of this size are also
reused by the allocator (a fresh 50 MB buffer costs ~0.1 s of page faults on a busy host)."""


VALIDATION_BYTES = 256 << 20
"""Accountable mode: a part's inputs together (``n_participants`` contributions, what a validator holds while it
re-runs the rule) stay under about this many bytes: parts are cut smaller as the group grows."""


def max_part_elements(
    *,
    push_encoding: str,
    mode: str,
    aggregate_encoding: str,
    n_participants: int,
    block_size: int,
    max_message_bytes: int,
    pipeline_bytes: Optional[int] = PIPELINE_PART_BYTES,
) -> int:
    """The most elements one part may hold so that every message about it fits ``max_message_bytes``
    and, when ``pipeline_bytes`` is set, stays under about that many bytes (see
    :data:`PIPELINE_PART_BYTES`; never below one block).

    The largest messages of a part are a contribution (``push_encoding``) and its result: the
    re-encoded aggregate (reencode, accountable) or all ``n_participants`` contributions (relay); accountable
    parts also keep ``n_participants`` contributions under :data:`VALIDATION_BYTES` (a validator's memory).
    A tenth of the
    limit plus 64 KiB are left for envelopes and protobuf framing. Returns a positive multiple of
    ``block_size``. Raises ValueError when not even one block fits the limit.
    """
    push = bytes_per_element(push_encoding, block_size)  # the one codec-size formula (method.encoded_nbytes)
    # accountable: the re-encoded aggregate plus a 29-byte input record per contributor (small)
    result = push * max(1, n_participants) if mode == "relay" else bytes_per_element(aggregate_encoding, block_size)
    room = 0.9 * max_message_bytes - (64 << 10)
    n = int(room // max(push, result)) // block_size * block_size
    if n < block_size:
        raise ValueError(f"a part of one block ({block_size} elements) does not fit {max_message_bytes} bytes")
    if pipeline_bytes is not None:
        n = min(n, max(block_size, int(pipeline_bytes // max(push, result)) // block_size * block_size))
    if mode == "accountable":
        # a validator holds all of a part's inputs at once (the robust rule needs them together)
        inputs = push * max(1, n_participants)
        n = min(n, max(block_size, int(VALIDATION_BYTES // inputs) // block_size * block_size))
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
        mode: ``"relay"``, ``"reencode"`` or ``"accountable"`` (reencode whose owners sign receipts and a
            result committed to its inputs, checked by validators drawn after the round:
            :mod:`geomesh_p2p.exchange.accountable`).
        aggregate_encoding: reencode mode: ``"sign"``, ``"int8"``, ``"fp16"`` (or ``"fp32"``, baseline).
        block_size: codec block size B (elements per scale).
        clip_k: scale clipping factor (None = off); see :func:`token_weighted_mean`.
        push_encoding: ``"sign"`` (CSS) or ``"fp32"`` (uncompressed baseline: an fp32 butterfly
            all-reduce when combined with reencode/fp32; no scale clipping).
        rule: aggregation rule of every part (:data:`geomesh_p2p.exchange.robust.RULES`): ``"mean"`` (the
            token-weighted mean) or a robust rule (``"meanmed"``, ``"vote"``); see docs/security.md.
        weight_cap: each contributor's weight is at most this multiple of the median weight (None = off).
        min_agreement: robust rules drop a contribution whose signs agree with the first-pass consensus
            on fewer than this share of elements (None = off).
        min_support: robust rules also drop a contribution whose signs side with less than this share of the
            others' summed vote margin (:func:`geomesh_p2p.exchange.robust.aggregate_part`; None = off).
        support_z: with ``min_support``, the support filter also drops a contribution whose support is within this
            many standard deviations of random signs' (noise senders; None = off; 0.11.0).
        quorum: a part result counts only when it aggregates at least ``ceil(quorum x participants)``
            contributions (0 = any); below it every reader treats the part as missing (the same bytes
            give the same decision everywhere), so an owner cannot replace the group's update with its own.
            Participants on ``probation`` count in neither side: the basis is the established
            participants and so are the contributions counted (see :meth:`quorum_count`).
        probation: participants on probation (new identities, :mod:`geomesh_p2p.trust.probation`): they
            may contribute, but the quorum is counted without them, and an owner closes a part
            ``grace_s`` seconds after every *established* participant pushed it, without waiting for
            them until the deadline. At least one participant must be established.
        grace_s: see ``probation`` (unused when nobody is on probation).
        validators_per_part: accountable mode: participants drawn after the round to re-check each part
            (:func:`geomesh_p2p.exchange.accountable.draw_validators`); ignored by the other modes.
        readers: peers besides the participants that may pull the parts' results (base58 PeerIDs): a grouped
            round's cross-group level is read by every peer of the round (:mod:`geomesh_p2p.exchange.groups`).
        token_floor: base58 PeerID -> fewest tokens its claim must carry to count: a claim below it (after the cap)
            counts 0 tokens, so the contribution has no weight and is left out (issue 28's ``min_steps`` dodge:
            what no verified-work check can screen, :data:`geomesh_p2p.trust.verify_task.VerifyConfig.min_steps`,
            is not aggregated; from round 2 on the loss-gain test's 1,792 tokens for a peer planned that many, sessions
            45-46: :func:`geomesh_p2p.trust.verify_task.claim_floor_steps`). Absent or 0: no floor. See :meth:`counted_tokens`.
        max_scale: the largest block scale (mean ``|x|`` of a block, the unit of the pseudo-gradient) an honest
            ``"sign"`` aggregate of this round can have (:func:`geomesh_p2p.round.rules.spec.aggregate_scale_bound`);
            every reader refuses a result above it (:func:`~geomesh_p2p.exchange.aggregate.decode_aggregate`).
            None: no bound (other encodings, grouped levels, a peer that holds no committed state).

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
    min_support: Optional[float] = None
    support_z: Optional[float] = None
    quorum: float = 0.0
    probation: Sequence[str] = ()
    grace_s: float = 1.0
    validators_per_part: int = 1
    readers: Sequence[str] = ()
    max_scale: Optional[float] = None
    token_floor: Mapping[str, int] = field(default_factory=dict)
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
            raise ValueError(
                f"aggregate_encoding must be one of {AGGREGATE_ENCODINGS}, got {self.aggregate_encoding!r}"
            )
        if self.push_encoding not in PUSH_ENCODINGS:
            raise ValueError(f"push_encoding must be one of {PUSH_ENCODINGS}, got {self.push_encoding!r}")
        if self.pull_deadline < self.deadline:
            raise ValueError("pull_deadline must not be before deadline")
        if self.rule not in aggregation.RULES:
            raise ValueError(f"rule must be one of {aggregation.RULES}, got {self.rule!r}")
        for name in ("weight_cap", "min_agreement", "min_support", "support_z"):
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
        object.__setattr__(self, "validators_per_part", int(self.validators_per_part))
        if self.validators_per_part < 0:
            raise ValueError(f"validators_per_part must be >= 0, got {self.validators_per_part}")
        object.__setattr__(self, "readers", tuple(sorted({_pid_str(p) for p in self.readers} - set(parts))))
        if self.max_scale is not None:
            object.__setattr__(self, "max_scale", float(self.max_scale))
            if not (math.isfinite(self.max_scale) and self.max_scale > 0):
                raise ValueError(f"max_scale must be finite and > 0 or None, got {self.max_scale}")
        floor = {}
        for p, n in dict(self.token_floor).items():
            p, n = _pid_str(p), int(n)
            if p not in parts:
                raise ValueError(f"token floor of {p} names no participant")
            if n < 0:
                raise ValueError(f"token floor of {p} is negative")
            if n:
                floor[p] = n
        object.__setattr__(self, "token_floor", floor)
        object.__setattr__(self, "spec_id", hashlib.sha256(self._canonical_json().encode()).digest())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the inverse of :meth:`from_dict`)."""
        return {
            "run_id": self.run_id,
            "round": self.round,
            "numel": self.numel,
            "participants": dict(sorted(self.participants.items())),
            "owners": [[o.peer_id, o.address, o.start, o.end] for o in self.owners],
            "deadline": self.deadline,
            "pull_deadline": self.pull_deadline,
            "mode": self.mode,
            "aggregate_encoding": self.aggregate_encoding,
            "block_size": self.block_size,
            "clip_k": self.clip_k,
            "push_encoding": self.push_encoding,
            "rule": self.rule,
            "weight_cap": self.weight_cap,
            "min_agreement": self.min_agreement,
            "min_support": self.min_support,
            "support_z": self.support_z,
            "quorum": self.quorum,
            "probation": list(self.probation),
            "grace_s": self.grace_s,
            "validators_per_part": self.validators_per_part,
            "readers": list(self.readers),
            "max_scale": self.max_scale,
            "token_floor": dict(sorted(self.token_floor.items())),
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
        if self.min_support is None:  # likewise: specs without the support filter keep their spec_id
            del d["min_support"]
        else:
            d["min_support"] = repr(self.min_support)
        if self.support_z is None:  # likewise (0.11.0)
            del d["support_z"]
        else:
            d["support_z"] = repr(self.support_z)
        if self.mode != "accountable":  # likewise: only accountable specs name their validators
            del d["validators_per_part"]
        if not self.readers:  # likewise: only a grouped round's cross-group specs name readers
            del d["readers"]
        if self.max_scale is None:  # likewise: specs without an aggregate scale bound (0.9.0)
            del d["max_scale"]
        else:
            d["max_scale"] = repr(self.max_scale)
        if not self.token_floor:  # likewise: specs without a token floor (0.12.0)
            del d["token_floor"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def counted_tokens(self, sender: str, claimed: int) -> int:
        """Tokens ``sender``'s claim of ``claimed`` tokens counts for in this round's aggregate: the claim capped by the
        plan (``participants``), or 0 when that is below the sender's ``token_floor`` (its contribution is then
        left out, like one of 0 tokens). Every owner, reader and validator computes it alike from the signed
        claim and the spec. Raises KeyError for a sender that is no participant."""
        n = min(int(claimed), self.participants[sender])
        return n if n >= self.token_floor.get(sender, 0) else 0

    def may_read(self, peer_id: str) -> bool:
        """True when ``peer_id`` may pull this spec's results: a participant, an owner or a reader."""
        return peer_id in self.participants or peer_id in self.readers or any(o.peer_id == peer_id for o in self.owners)

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

    def aggregate(
        self,
        items: Sequence[tuple[int, Any]],
        numel: int,
        dropped: Optional[list] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """This round's rule over ``(tokens capped by the plan, packet)`` in PeerID order -> fp32 [numel]
        (written into ``out``, contiguous fp32 [numel], when given); the indices of items the
        agreement filter dropped are appended to ``dropped`` if given."""
        return aggregation.aggregate_part(
            items,
            numel,
            rule=self.rule,
            encoding=self.push_encoding,
            clip_k=self.clip_k,
            weight_cap=self.weight_cap,
            min_agreement=self.min_agreement,
            min_support=self.min_support,
            support_z=self.support_z,
            dropped=dropped,
            out=out,
        )
