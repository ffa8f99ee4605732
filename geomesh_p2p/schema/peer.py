"""Record schemas shared by the DHT, the planner and the round protocol (pydantic, versioned).

A record travels as its JSON bytes inside a signed DHT value; the DHT never unpickles anything.
"""

from __future__ import annotations

import time
from typing import Optional

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from geomesh_p2p.schema.compat import WIRE_MODEL
from geomesh_p2p.util.untrusted import non_finite

RECORD_SCHEMA_VERSION = 1


#: Bandwidth bounds of a record, bytes/s: 1 B/s .. 1 TB/s (anything outside is an error or a lie).
MIN_LINK_BPS, MAX_LINK_BPS = 1.0, 1e12
#: Throughput bounds of a record, tokens/s, and the largest batch (sequences) it may state.
MIN_TOKENS_PER_S, MAX_TOKENS_PER_S = 1e-3, 1e10
MAX_BATCH = 1 << 20
#: Most ranks (local devices training as one peer, issue 30) a record may state.
MAX_RANKS = 64
#: Most peers a record may vouch for in ``standing``.
MAX_ATTESTED = 64
#: Longest ``last_plan`` reference: a PeerID (base58, under 64 characters), "/", 64 hex digits. Characters.
LAST_PLAN_REF_CHARS = 160
#: Longest ``activity`` a record may state, characters.
MAX_ACTIVITY_CHARS = 32
#: Most owner penalties a record may state in ``owner_bars`` (a peer holding more announces none: no vote then).
MAX_OWNER_BARS = 64
#: Most leader marks a record may state in ``unled_marks`` (a peer holding more announces none: no vote then).
MAX_UNLED_MARKS = 64


class SyncProgress(BaseModel):
    """How far a syncing peer's state download is (issue 14 #3), announced in its :class:`PeerRecord`
    so that a leader gathering the round waits for it as long as the download needs, within a cap
    (:func:`geomesh_p2p.round.gather.gather`). Bytes and bytes/s; a rate, not times, so
    clocks need not agree."""

    model_config = WIRE_MODEL  # a field of a newer patch is ignored, not refused (docs/compat.md)

    done_bytes: int = Field(ge=0, le=1 << 50, description="bytes of the state received so far")
    total_bytes: int = Field(ge=1, le=1 << 50, description="bytes of the whole state (weights and outer state)")
    bytes_per_s: float = Field(
        ge=0, le=MAX_LINK_BPS, description="download rate measured over the last seconds; 0: not measured yet"
    )

    @model_validator(mode="after")
    def _done_within_total(self) -> "SyncProgress":
        if self.done_bytes > self.total_bytes:
            raise ValueError(f"done_bytes {self.done_bytes} exceeds total_bytes {self.total_bytes}")
        return self

    def remaining_s(self) -> Optional[float]:
        """Seconds the rest of the download takes at the announced rate; None when no rate is known yet."""
        if self.done_bytes >= self.total_bytes:
            return 0.0
        if self.bytes_per_s <= 0:
            return None
        return (self.total_bytes - self.done_bytes) / self.bytes_per_s


class PeerRecord(BaseModel):
    """What a peer announces under ``<run>/peers`` (subkey = its PeerID), refreshed every few seconds.

    Units: bytes for memory, bytes/s for bandwidth, tokens/s for throughput, unix seconds for time.
    """

    # No NaN / Infinity anywhere: a record feeds the planner's arithmetic on every peer. A field of a newer
    # patch release is ignored (docs/compat.md): the DHT record's signature covers the bytes as received.
    model_config = WIRE_MODEL

    schema_version: int = RECORD_SCHEMA_VERSION
    peer_id: str = Field(description="PeerID (base58 of SHA-256 of the Ed25519 public key)")
    address: Optional[str] = Field(
        default=None, description="host:port the peer serves on; None means client-only (behind NAT)"
    )
    device: str = Field(description="device name, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu: AMD EPYC'")
    memory_bytes: int = Field(ge=0, le=1 << 50, description="memory budget usable for training, bytes")
    tokens_per_s: dict[int, float] = Field(
        default_factory=dict, description="measured training throughput per batch size (sequences), tokens/s"
    )
    max_batch: int = Field(ge=1, le=MAX_BATCH, description="largest batch (sequences) that fits in one micro-step")
    upload_bps: float = Field(ge=MIN_LINK_BPS, le=MAX_LINK_BPS, description="upload bandwidth, bytes/s")
    download_bps: float = Field(ge=MIN_LINK_BPS, le=MAX_LINK_BPS, description="download bandwidth, bytes/s")
    version: str = Field(description="software version (geomesh_p2p.__version__)")
    protocol_version: int = 2  # geomesh_p2p.PROTOCOL_VERSION (peers of other protocol versions are refused)
    run_config_hash: str = Field(description="hash of the run config every peer of a run shares")
    run_config: Optional[dict] = Field(
        default=None, description="the run config itself (JSON object), so a mismatch can say which field differs"
    )
    round: int = Field(ge=0, default=0, description="the round this peer is in or will join")
    weights_digest: Optional[str] = Field(default=None, description="digest of its global weights at `round`")
    timestamp: float = Field(default_factory=time.time, ge=0, le=1e11, description="unix seconds when announced")
    leaving: bool = Field(default=False, description="the peer is shutting down: plan the next rounds without it")
    pow_nonce: Optional[int] = Field(
        default=None,
        ge=0,
        le=(1 << 64) - 1,
        description="proof of work for this PeerID and run (geomesh_p2p.trust.admission); checked by every reader",
    )
    standing: dict[str, int] = Field(
        default_factory=dict,
        description="peers this one saw deliver: PeerID prefix -> rounds of its last "
        "window (geomesh_p2p.trust.standing); what a fresh joiner reads as history",
    )
    sync_progress: Optional[SyncProgress] = Field(
        default=None,
        description="while syncing (no weights_digest): the state download's progress; optional, "
        "left out of the JSON when None (records of older peers parse as before)",
    )

    ranks: int = Field(
        default=1,
        ge=1,
        le=MAX_RANKS,
        description="local devices this peer trains on as one (torch.distributed ranks, issue 30); its "
        "tokens_per_s and max_batch are their sum, and the planner gives it batches that are a multiple of "
        "it; optional, left out of the JSON when 1 (records of older peers parse as before)",
    )
    rank_memory_bytes: Optional[int] = Field(
        default=None,
        ge=0,
        le=1 << 50,
        description="with ranks > 1: the memory budget of one rank, bytes (memory_bytes is the peer's sum); "
        "left out of the JSON when None",
    )
    last_plan: Optional[str] = Field(
        default=None,
        max_length=LAST_PLAN_REF_CHARS,
        description="the plan of round `round - 1` that made `weights_digest`, as '<its leader>/<SHA-256 hex of "
        "RoundPlan.to_bytes>' (geomesh_p2p.round.last_plan, 0.16.0): what a peer that did not obtain that plan "
        "reads to take it; left out of the JSON when None",
    )

    unled_until: Optional[int] = Field(
        default=None,
        ge=0,
        le=1 << 40,
        description="the last round through which this peer is no leader candidate by the marks it holds on itself, "
        "which the others hold on it too (a no-show bench or a late mark: geomesh_p2p.round.rules.penalties, 0.18.0): "
        "what a follower that lacks the swarm's history reads instead; left out of the JSON when None",
    )

    owner_bars: Optional[dict[str, int]] = Field(
        default=None,
        description="the owner penalties in force at `round` that this peer holds (PeerID -> last round it owns no "
        "part: geomesh_p2p.round.rules.penalties), announced only while it holds every one (it applied, or took by "
        "this vote, each of the last OWNER_PENALTY_ROUNDS rounds), {} when none: what a peer planned out of one of "
        "those rounds takes from a majority of its voters (0.18.1, session 51); left out of the JSON when None",
    )

    unled_marks: Optional[dict[str, int]] = Field(
        default=None,
        description="the leader marks in force at `round` that this peer holds on the others (PeerID -> last round it "
        "is no leader candidate: a no-show bench or a late mark, geomesh_p2p.round.rules.penalties), announced only "
        "while it holds every one (it applied each of the last MARK_SPAN_ROUNDS rounds), {} when none: what backs a "
        "peer's `unled_until` for a follower without that history (Penalties.backed_unled, session 52); left "
        "out of the JSON when None",
    )

    lead_from: Optional[int] = Field(
        default=None,
        ge=0,
        le=1 << 40,
        description="the first round this peer may lead again by its own rule of the marks it lacks (joined, resumed, "
        "re-synced or planned out within their span: Penalties.lead_from, session 51): the others still rank it, and only "
        "take the next candidate's turn at once instead of waiting for its plan; left out of the JSON when None",
    )

    activity: Optional[str] = Field(
        default=None,
        max_length=MAX_ACTIVITY_CHARS,
        description="what its round loop does now, as the status views show it (RoundDriver.activity, 0.19.0, session "
        "52): 'waiting' (for peers: fewer in step than --min-peers, or held for its checkpoint's peers), 'training' (in "
        "the round's plan), 'sitting out' (not in the plan: waits for the round's end, then syncs), 'refusing plans' "
        "(refuses the plan others may follow: sits the round out), 'no plan' (no plan it accepts appeared: retrying), "
        "'syncing' (catching up or downloading the swarm's state); advisory, read by nobody's round; a reader shows a "
        "value it does not know as it is; left out of the JSON when None",
    )

    @field_validator("owner_bars", "unled_marks")
    @classmethod
    def _bounded_round_map(cls, v: Optional[dict[str, int]], info: ValidationInfo) -> Optional[dict[str, int]]:
        """``owner_bars`` and ``unled_marks``: PeerID -> round maps of at most :data:`MAX_OWNER_BARS` /
        :data:`MAX_UNLED_MARKS` entries, names of 1..64 characters, rounds in [0, 2**40]."""
        limit = MAX_OWNER_BARS if info.field_name == "owner_bars" else MAX_UNLED_MARKS
        if v is not None and (
            len(v) > limit
            or any(not 1 <= len(k) <= 64 or type(u) is not int or not 0 <= u <= 1 << 40 for k, u in v.items())
        ):
            raise ValueError(
                f"{info.field_name}: at most {limit} entries, names of 1..64 characters, rounds in [0, 2**40]"
            )
        return v

    @field_validator("tokens_per_s")
    @classmethod
    def _positive_throughput(cls, v: dict[int, float]) -> dict[int, float]:
        for b, tps in v.items():
            if not 1 <= b <= MAX_BATCH or not (MIN_TOKENS_PER_S <= tps <= MAX_TOKENS_PER_S):
                raise ValueError(
                    f"tokens_per_s[{b}]={tps}: batch must be in [1, {MAX_BATCH}] and throughput in "
                    f"[{MIN_TOKENS_PER_S:g}, {MAX_TOKENS_PER_S:g}]"
                )
        return v

    @field_validator("run_config")
    @classmethod
    def _finite_run_config(cls, v: Optional[dict]) -> Optional[dict]:
        # An untyped dict: allow_inf_nan=False does not reach into it, and JSON's Infinity, NaN and 1e999 parse. No
        # honest peer announces one (RunConfig refuses them), and readers show, hash and forward it (red team,
        # session 16).
        where = non_finite(v)
        if where is not None:
            raise ValueError(f"run_config holds a number that is not finite at {where}")
        return v

    @field_validator("standing")
    @classmethod
    def _bounded_standing(cls, v: dict[str, int]) -> dict[str, int]:
        if len(v) > MAX_ATTESTED or any(not 1 <= len(k) <= 64 or not 0 <= c <= 1 << 20 for k, c in v.items()):
            raise ValueError(
                f"standing: at most {MAX_ATTESTED} entries, names of 1..64 characters, counts in [0, 2**20]"
            )
        return v

    @property
    def client_only(self) -> bool:
        """True when the peer accepts no connections: it owns no collective part."""
        return self.address is None

    def best_tokens_per_s(self) -> float:
        """Highest measured throughput over batch sizes, tokens/s (0.0 when nothing was measured)."""
        return max(self.tokens_per_s.values(), default=0.0)

    def to_bytes(self) -> bytes:
        """JSON bytes. ``sync_progress``, ``ranks``, ``rank_memory_bytes``, ``last_plan``, ``unled_until``,
        ``owner_bars``, ``unled_marks``, ``lead_from`` and ``activity`` are written
        only when set (not their defaults), so a record without them is byte for byte what a peer of the previous
        version wrote (and such a peer, whose schema forbids unknown fields, still reads every record but a syncing or
        multi-rank peer's)."""
        defaults = (
            ("sync_progress", None),
            ("ranks", 1),
            ("rank_memory_bytes", None),
            ("last_plan", None),
            ("unled_until", None),
            ("owner_bars", None),
            ("unled_marks", None),
            ("lead_from", None),
            ("activity", None),
        )
        absent = {k for k, v in defaults if getattr(self, k) == v}
        return self.model_dump_json(exclude=absent or None).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PeerRecord":
        """Parse JSON bytes; raises pydantic.ValidationError on anything malformed."""
        return cls.model_validate_json(data)
