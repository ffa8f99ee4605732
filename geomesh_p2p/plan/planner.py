"""Round planning: adaptive workload balancing (AWB) and the uniform DiLoCo baseline.

AWB is the "adaptive workload balancing" half of GeoMesh (arXiv 2609.18388, "GeoMesh:
Workload-Balanced and Sign-Compressed Geo-Distributed LLM Training"); DESIGN.md, "Round r", step 2.
The round leader turns the members' announced :class:`~geomesh_p2p.schema.peer.PeerRecord` s into a
:class:`RoundPlan`: per peer a batch size and a number of inner steps such that every peer's
compute plus its own communication fills the same sync window ``T``, so that fast GPUs do more
useful work instead of idling at the barrier. Everything here is a pure, deterministic function
of its inputs (no clock, no I/O, no randomness): the same records and config give the same plan
bytes whatever the order of the records.

The model (units: sequences, tokens, seconds, bytes, bytes/s)
--------------------------------------------------------------
For each peer ``i`` (records sorted by ``peer_id``):

* **Micro-batch** ``m_i``: the measured batch size with the highest tokens/s among those that fit
  in memory (``<= max_batch``); ties go to the larger batch. With no measured batch that fits,
  ``m_i = max_batch`` with interpolated throughput (see :func:`interpolate_tokens_per_s`).
* **Batch per inner step** ``b_i = m_i * a_i`` with ``a_i = ceil(target_batch / m_i)`` gradient
  accumulation steps: ``target_batch`` is a floor on the sequences per optimizer step (micro-batched
  when it does not fit or when a smaller micro-batch is faster); a peer whose best micro-batch is
  larger than ``target_batch`` uses it whole (the paper's "batch that fits its memory").
* **Step time** ``s_i = b_i * seq_len / tps_i(m_i)`` seconds.
* **Communication time** ``c_i = 2 * latency_s + payload_bytes / upload_bps_i +
  payload_bytes / download_bps_i``. The sum, not the max: the collective has two *sequential*
  phases (push the parts to their owners, then pull the aggregates, which exist only once every
  contribution to a part has arrived), the first bound by the upload link and the second by the
  download link, each paying one request latency. Overlap of the two directions happens only on
  the owners' side and is already counted by the caller in ``payload_bytes``.
* **Window** ``T``:

  - ``target_tokens_per_round`` set: the smallest ``T`` at which the planned budgets sum to at least
    the target (``window_s``, if also set, caps it);
  - else ``window_s`` set: that window;
  - else ``T = max_i c_i / comm_share`` (communication over the slowest link is ``comm_share`` of
    the round);

  and always ``T >= max_i (c_i + min_inner_steps * s_i)`` so that the slowest peer fits its minimum
  number of steps (an explicit ``window_s`` that is too short is stretched). Whole steps leave each
  peer up to one step of slack; the planner then moves ``T`` within ``window_slack`` of that value
  (never above an explicit ``window_s``, nor above a token target that the minimum steps already
  exceed) to the candidate that minimises the largest idle fraction.
  Candidates are the instants where some peer finishes a whole step, so the last finisher ends
  exactly at ``T``.
* **Inner steps** ``H_i = clip(floor((T - c_i) / s_i), min_inner_steps, max_inner_steps)``, token
  budget ``b_i * seq_len * H_i``, predicted idle ``idle_i = T - (H_i * s_i + c_i)`` and straggler
  idle fraction ``idle_i / T``. Unclipped, ``0 <= idle_i < s_i``.

The uniform plan (:func:`plan_uniform`, the DiLoCo baseline) gives every peer the same micro-batch
``min(target_batch, min_i max_batch_i)``, the same batch and the same ``H = uniform_inner_steps``;
``T`` is set by the slowest peer, so faster peers idle for the difference. Its partition is equal
parts among the peers that accept connections.

The collective partition (:func:`partition`) gives contiguous parts of the flat parameter vector to
the peers that accept connections, sized by bandwidth with hivemind's ``load_balance_peers`` (the
butterfly all-reduce LP: an owner of a fraction ``f`` moves ``(1 + (N - 2) f)`` vectors); client-only
peers own nothing. No owner gets more than :func:`max_owner_units` (about ``OWNER_SHARE_FACTOR / n``
of the vector, ``n`` the peers that accept connections): the LP alone hands a peer with twice the
others' bandwidth the whole vector as soon as ``N = 3``.

Untrusted records (DESIGN.md "Untrusted volunteers", issue 11)
--------------------------------------------------------------
Records are what peers *say*. Before planning, :func:`bound_records` clamps every claim to a bounded
multiple of the members' lower median (``statistics.median_low``: with two members, the smaller
one, so one liar cannot drag the median up): tokens/s to ``THROUGHPUT_SPREAD_CAP`` x, ``max_batch``
to ``BATCH_SPREAD_CAP`` x, each bandwidth direction to ``BANDWIDTH_SPREAD_CAP`` x. The leader may
also pass what each peer's last *delivered* contribution supports (``supported_tokens_per_s``): the
peer's inner steps are then planned at no more than ``EVIDENCE_GROWTH`` x that rate (this only lowers
``H_i``; the window stays what every follower can recompute). After the inner steps are known, no
budget exceeds ``BUDGET_MEDIAN_FACTOR`` x the plan's lower-median budget (``H_i`` is lowered; a peer
already at ``min_inner_steps`` keeps them). Followers run :func:`check_plan` on every plan: it
recomputes these bounds from the records they see and the run's :class:`PlanConfig` and refuses a
plan outside them with a one-line reason (the next leader then takes over, :mod:`geomesh_p2p.round`).
Every plan :func:`make_plan` makes passes :func:`check_plan` on the same records by construction.
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from typing import Callable, Collection, Iterable, Literal, Mapping, NamedTuple, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from geomesh_p2p.config import method as _method
from geomesh_p2p.schema.peer import PeerRecord

logger = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1

Method = Literal["geomesh", "awb", "diloco", "css", "ddp"]
Mode = Literal["relay", "reencode"]

#: methods planned with AWB; the others get the uniform plan (ddp with one inner step per round).
#: Re-exported from :mod:`geomesh_p2p.config.method`, where every method's rule lives.
BALANCED_METHODS = _method.BALANCED_METHODS

_STEP_EPS = 1e-9  # relative slack so that T = c + k*s computed in floats still yields k steps
_MAX_BREAKPOINTS_PER_PEER = 1000

# Bounds on claims and plans (issue 11). Each is a multiple of the members' lower median, so that a
# minority of liars cannot move the reference; honest swarms sit well inside them.
#: tokens/s claims count up to this many times the members' lower-median throughput. Real GPU spreads
#: on one model are < 4x between data-centre cards (H100 vs RTX 6000 Ada: 2.5x, GeoMesh's testbed) and
#: ~14x only with T4-class cards among H100s (volunteer32), where the slow ones sit *below* the median;
#: 8x leaves a 2x margin over the data-centre spread. An inflated record gets at most 8x the median.
THROUGHPUT_SPREAD_CAP = 8.0
#: ``max_batch`` claims count up to this many times the members' lower-median ``max_batch`` (memory
#: spreads: 80 GB vs 10-24 GB cards, < 8x).
BATCH_SPREAD_CAP = 8
#: bandwidth claims (each direction) count up to this many times the members' lower median: link
#: spreads among volunteers are wider than GPU spreads (20 Mbit/s home uplinks vs 1 Gbit/s data
#: centres, 50x in volunteer32), and a fast-link claim buys ownership, which OWNER_SHARE_FACTOR caps.
BANDWIDTH_SPREAD_CAP = 64.0
#: a peer's planned rate is at most this many times what its last delivered contribution supports
#: (tokens it delivered / compute seconds it was planned): a record can only grow that fast per round.
EVIDENCE_GROWTH = 2.0
#: no token budget exceeds this many times the plan's lower-median budget (unless it is a single
#: ``min_inner_steps`` block of its own batch). Honest budgets spread by throughput *and* by link:
#: a slow link leaves a peer less of the window (the paper's 4 GPUs with an fp32 exchange, sim
#: profile paper4 method awb: the L40S gets one step, the H100 5.6x the median), so the factor matches
#: THROUGHPUT_SPREAD_CAP rather than the 4x GPU spread (4x would cut that honest plan's tokens by
#: 18%). It also bounds a peer's share of the round's tokens: :func:`max_token_share` (4 peers: 80%).
BUDGET_MEDIAN_FACTOR = 8.0
#: no owner gets more than ~OWNER_SHARE_FACTOR / n of the vector (n: participants that accept
#: connections): twice the fair share; the partition enforces it (:func:`max_owner_units`).
OWNER_SHARE_FACTOR = 2.0

#: From this many possible owners on, followers accept that the leader bars a minority of them from owning
#: (check_plan: its owner penalties may differ from the follower's); below it, only the follower's own bars.
LEADER_BAR_MIN_OWNERS = 4
#: how far a follower's recomputation (window, budget ceilings) may differ from the leader's: views of
#: the records can differ between leader and follower by one re-announcement. Followers' recomputation
#: from the same records is exact; attacks are orders of magnitude outside.
PLAN_CHECK_TOLERANCE = 1.5
#: how far in the future a plan may say it was created (the envelope's clock-skew window, identity.Verifier)
MAX_CLOCK_SKEW_S = 30.0


# --------------------------------------------------------------------------------------------
# schemas


class PlanConfig(BaseModel):
    """What the leader needs besides the peers' records to plan a round (shared by the run).

    Units: sequences for batches, tokens, seconds, bytes. Raises ``pydantic.ValidationError`` (a
    ``ValueError``) on out-of-range values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: int = Field(ge=1, description="tokens per sequence")
    target_batch: int = Field(
        ge=1, description="desired sequences per inner step (a floor; micro-batched when it does not fit)"
    )
    target_tokens_per_round: Optional[int] = Field(
        default=None, ge=1, description="tokens the whole group should train per round; None: derive from the window"
    )
    window_s: Optional[float] = Field(
        default=None, gt=0, description="sync window T, seconds; None: T such that comm is comm_share of it"
    )
    comm_share: float = Field(default=0.1, gt=0, le=1, description="target fraction of the window spent communicating")
    min_inner_steps: int = Field(default=1, ge=1)
    max_inner_steps: int = Field(default=500, ge=1)
    payload_bytes: int = Field(
        ge=0, description="bytes one peer sends and (again) receives per round in the collective"
    )
    latency_s: float = Field(default=0.05, ge=0, description="one request's latency, seconds (paid once per phase)")
    exchange_timeout_s: float = Field(
        default=30.0, gt=0, description="seconds after the training deadline by which the collective must finish"
    )
    mode: Mode = "reencode"
    method: Method = "geomesh"
    uniform_inner_steps: int = Field(default=20, ge=1, description="H for the uniform (DiLoCo) plan")
    window_slack: float = Field(
        default=0.05, ge=0, le=0.5, description="relative room the AWB planner has to move T to cut straggler idle"
    )
    part_align: int = Field(default=1, ge=1, description="partition parts are multiples of this many elements")

    @model_validator(mode="after")
    def _steps_range(self) -> "PlanConfig":
        if self.max_inner_steps < self.min_inner_steps:
            raise ValueError(f"max_inner_steps={self.max_inner_steps} is below min_inner_steps={self.min_inner_steps}")
        return self


class PeerAssignment(BaseModel):
    """One peer's share of a round. Units: sequences, tokens, elements, seconds.

    ``batch_size`` sequences per inner (optimizer) step, run as ``accum_steps`` forward/backward
    passes of ``micro_batch`` sequences; ``token_budget = batch_size * seq_len * inner_steps``.
    ``[part_start, part_end)`` is the slice of the flat parameter vector this peer owns in the
    collective (empty for client-only peers). ``predicted_*`` are the planner's expectations.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    peer_id: str = Field(min_length=1)
    address: Optional[str] = Field(default=None, description="host:port as the leader saw it; None = client-only")
    batch_size: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    accum_steps: int = Field(ge=1)
    inner_steps: int = Field(ge=0)
    token_budget: int = Field(ge=0)
    part_start: int = Field(ge=0)
    part_end: int = Field(ge=0)
    predicted_compute_s: float = Field(ge=0)
    predicted_comm_s: float = Field(ge=0)
    predicted_idle_s: float = Field(ge=0)
    probation: bool = Field(
        default=False,
        description="a new identity (geomesh_p2p.trust.probation): owns no part, bounded budget, "
        "not counted in the part quorum",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "PeerAssignment":
        if self.micro_batch * self.accum_steps != self.batch_size:
            raise ValueError(
                f"peer {self.peer_id}: batch_size={self.batch_size} != micro_batch={self.micro_batch}"
                f" * accum_steps={self.accum_steps}"
            )
        if self.part_end < self.part_start:
            raise ValueError(f"peer {self.peer_id}: part_end={self.part_end} < part_start={self.part_start}")
        if self.probation and self.part_end > self.part_start:
            raise ValueError(f"peer {self.peer_id} is on probation and owns a part")
        return self

    @property
    def owns_part(self) -> bool:
        return self.part_end > self.part_start


class RoundPlan(BaseModel):
    """The leader's plan for one round, stored (signed) under ``<run>/plan/<r>``. JSON on the wire.

    Times are unix seconds (``train_deadline``: hard stop for inner steps, ``= start + window_s``;
    each peer is planned to stop ``predicted_comm_s`` earlier; ``exchange_deadline``: the collective
    must be over). ``numel``: elements of the flat parameter vector; the owners' parts tile
    ``[0, numel)``. ``from_bytes`` raises ``pydantic.ValidationError`` on malformed or inconsistent
    input (unsorted or duplicate peers, budgets that do not match, parts that overlap or leave gaps).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    schema_version: int = PLAN_SCHEMA_VERSION
    run_id: str
    round: int = Field(ge=0)
    leader: str
    method: Method
    mode: Mode
    numel: int = Field(ge=0)
    seq_len: int = Field(ge=1)
    window_s: float = Field(gt=0)
    train_deadline: float
    exchange_deadline: float
    start_digest: Optional[str] = None
    created_at: float
    assignments: list[PeerAssignment] = Field(min_length=1)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {v} is not the supported {PLAN_SCHEMA_VERSION}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RoundPlan":
        ids = [a.peer_id for a in self.assignments]
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError("assignments must be sorted by peer_id without duplicates")
        if self.exchange_deadline < self.train_deadline:
            raise ValueError(
                f"exchange_deadline={self.exchange_deadline} is before train_deadline={self.train_deadline}"
            )
        for a in self.assignments:
            if a.token_budget != a.batch_size * self.seq_len * a.inner_steps:
                raise ValueError(
                    f"peer {a.peer_id}: token_budget={a.token_budget} != batch_size*seq_len*inner_steps"
                    f" = {a.batch_size * self.seq_len * a.inner_steps}"
                )
            if a.part_end > self.numel:
                raise ValueError(f"peer {a.peer_id}: part_end={a.part_end} beyond numel={self.numel}")
        pos = 0
        for pid, start, end in sorted(self.owners(), key=lambda o: o[1]):
            if start != pos:
                raise ValueError(f"peer {pid}: part starts at {start}, expected {pos} (gap or overlap)")
            pos = end
        if pos != self.numel:
            raise ValueError(f"parts cover [0, {pos}) but numel={self.numel}")
        return self

    # helpers -------------------------------------------------------------------------------
    def participants(self) -> list[str]:
        """PeerIDs in the round, sorted."""
        return [a.peer_id for a in self.assignments]

    def assignment(self, peer_id: str) -> PeerAssignment:
        """This peer's assignment; raises KeyError when it is not in the plan."""
        for a in self.assignments:
            if a.peer_id == peer_id:
                return a
        raise KeyError(f"peer {peer_id} is not in the plan for round {self.round}")

    def owners(self) -> list[tuple[str, int, int]]:
        """(peer_id, start, end) of every peer owning a non-empty part, in peer_id (= start) order."""
        return [(a.peer_id, a.part_start, a.part_end) for a in self.assignments if a.owns_part]

    def probation(self) -> list[str]:
        """PeerIDs the plan marks as on probation (geomesh_p2p.trust.probation), sorted."""
        return [a.peer_id for a in self.assignments if a.probation]

    def established(self) -> list[str]:
        """PeerIDs the plan counts as established (the part quorum's basis), sorted."""
        return [a.peer_id for a in self.assignments if not a.probation]

    def predicted_straggler_idle(self) -> dict[str, float]:
        """peer_id -> predicted idle time at the barrier as a fraction of the window (0..1)."""
        return {a.peer_id: a.predicted_idle_s / self.window_s for a in self.assignments}

    def total_token_budget(self) -> int:
        """Tokens the whole group is planned to train this round."""
        return sum(a.token_budget for a in self.assignments)

    def to_bytes(self) -> bytes:
        """JSON bytes (deterministic for equal plans)."""
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RoundPlan":
        """Parse JSON bytes; raises pydantic.ValidationError on anything malformed."""
        return cls.model_validate_json(data)


# --------------------------------------------------------------------------------------------
# throughput model


def interpolate_tokens_per_s(tokens_per_s: Mapping[int, float], batch: int) -> float:
    """Training throughput (tokens/s) at ``batch`` sequences from measured ``{batch: tokens/s}``.

    The step time per batch is modelled as affine in the batch size (a fixed cost plus a cost per
    sequence), so it is interpolated linearly between the nearest measured batch sizes. Below the
    smallest measured batch the step time is taken as that batch's (pessimistic: throughput scales
    down with the batch); above the largest, throughput is taken as saturated (step time grows in
    proportion). Raises ValueError when nothing is measured or ``batch < 1``.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if not tokens_per_s:
        raise ValueError("tokens_per_s is empty: no measured throughput")
    if batch in tokens_per_s:
        return float(tokens_per_s[batch])
    sizes = sorted(tokens_per_s)
    # u(b) = seconds per step per token of sequence length = b / tps(b)
    if batch < sizes[0]:
        return float(tokens_per_s[sizes[0]]) * batch / sizes[0]
    if batch > sizes[-1]:
        return float(tokens_per_s[sizes[-1]])
    hi = next(b for b in sizes if b > batch)
    lo = max(b for b in sizes if b < batch)
    u_lo, u_hi = lo / tokens_per_s[lo], hi / tokens_per_s[hi]
    u = u_lo + (u_hi - u_lo) * (batch - lo) / (hi - lo)
    return batch / u


def _check_records(records: Sequence[PeerRecord]) -> list[PeerRecord]:
    """Validate what the planner relies on; return the records sorted by peer_id."""
    if not records:
        raise ValueError("no peers to plan for")
    seen: set[str] = set()
    for r in records:
        pid = r.peer_id
        if pid in seen:
            raise ValueError(f"peer {pid}: duplicate peer_id")
        seen.add(pid)
        if not r.tokens_per_s:
            raise ValueError(f"peer {pid}: tokens_per_s is empty (no measured throughput)")
        for b, v in r.tokens_per_s.items():
            if not (b >= 1 and math.isfinite(v) and v > 0):
                raise ValueError(f"peer {pid}: tokens_per_s[{b}]={v} must be a positive finite throughput")
        if not (r.max_batch >= 1):
            raise ValueError(f"peer {pid}: max_batch={r.max_batch} must be >= 1")
        for field in ("upload_bps", "download_bps"):
            v = getattr(r, field)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"peer {pid}: {field}={v} must be a positive finite bandwidth (bytes/s)")
    return sorted(records, key=lambda r: r.peer_id)


def bound_records(records: Sequence[PeerRecord]) -> list[PeerRecord]:
    """``records`` (same order) with each claim clamped to a bounded multiple of the members' lower median.

    Per record: every tokens/s entry to ``THROUGHPUT_SPREAD_CAP`` x the lower median of the members'
    best tokens/s; ``max_batch`` to ``BATCH_SPREAD_CAP`` x the lower median ``max_batch``;
    ``upload_bps`` and ``download_bps`` each to ``BANDWIDTH_SPREAD_CAP`` x the lower median of that
    direction. Only upper clamps: claiming less only costs the claimer its share. Records within the
    bounds are returned as they are; clamped ones are copies (``model_copy``, not re-validated: the
    values only shrink). Pure and deterministic; the leader plans on the result and every follower
    recomputes it from the same records (:func:`check_plan`).

    Not evidence: a record is what its peer says. Delivered work bounds a peer's rate further on the
    leader (``supported_tokens_per_s`` of :func:`plan_round`); bandwidth is bounded only relative to
    the median (a peer measures its own links, not the others').
    """
    if not records:
        return []
    tps_cap = THROUGHPUT_SPREAD_CAP * statistics.median_low([r.best_tokens_per_s() for r in records])
    batch_cap = int(BATCH_SPREAD_CAP * statistics.median_low([r.max_batch for r in records]))
    up_cap = BANDWIDTH_SPREAD_CAP * statistics.median_low([r.upload_bps for r in records])
    down_cap = BANDWIDTH_SPREAD_CAP * statistics.median_low([r.download_bps for r in records])
    out = []
    for r in records:
        update: dict = {}
        if r.tokens_per_s and r.best_tokens_per_s() > tps_cap:
            update["tokens_per_s"] = {b: min(v, tps_cap) for b, v in r.tokens_per_s.items()}
        if r.max_batch > batch_cap:
            update["max_batch"] = max(1, batch_cap)
        if r.upload_bps > up_cap:
            update["upload_bps"] = up_cap
        if r.download_bps > down_cap:
            update["download_bps"] = down_cap
        out.append(r.model_copy(update=update) if update else r)
    return out


def max_owner_units(units: int, n_owners: int) -> int:
    """The most partition units (multiples of ``part_align`` elements) one owner may get:
    ``max(1, ceil(OWNER_SHARE_FACTOR * units / n_owners))``. ``n_owners``: peers that accept
    connections (>= 1). Always leaves room for all ``units`` (``n_owners * cap >= units``)."""
    return max(1, math.ceil(OWNER_SHARE_FACTOR * units / max(1, n_owners)))


def max_token_share(n_peers: int) -> float:
    """The largest share of a round's token budget one of ``n_peers`` can hold when every budget is
    within ``BUDGET_MEDIAN_FACTOR`` (F) x the lower median: ``F / (F + n_peers // 2)`` (at least
    ``n_peers // 2`` other budgets are >= the lower median). 2 peers: 8/9; 4 peers: 4/5; 7 peers:
    8/11; 1 peer: 1."""
    return BUDGET_MEDIAN_FACTOR / (BUDGET_MEDIAN_FACTOR + n_peers // 2)


def best_micro_batch(record: PeerRecord) -> int:
    """The measured batch size with the highest tokens/s that fits ``max_batch`` (ties: larger).

    With no measured batch that fits, ``max_batch`` itself (its throughput is interpolated).
    """
    fits = {b: v for b, v in record.tokens_per_s.items() if b <= record.max_batch}
    if not fits:
        return record.max_batch
    return max(fits, key=lambda b: (fits[b], b))


def comm_time(record: PeerRecord, cfg: PlanConfig) -> float:
    """Predicted seconds of this peer's collective: ``2*latency + payload/up + payload/down``."""
    return 2 * cfg.latency_s + cfg.payload_bytes / record.upload_bps + cfg.payload_bytes / record.download_bps


#: Element passes of a round's collective on one peer besides the reading of the results: encoding and
#: signing its whole vector (1), and, as an owner, checking its part's contributions (about 1: n
#: contributions of 1/n of the vector).
EXCHANGE_BASE_PASSES = 2
#: The exchange window is this many times the predicted exchange (network + CPU): a peer shares its
#: cores with its own serving, with the other peers' pushes and pulls, and the prediction is a mean.
EXCHANGE_SAFETY = 3.0


def exchange_passes(n_participants: int, mode: str) -> int:
    """Whole-vector element passes of one peer's side of a round's collective (a count, >= 3).

    Encoding + signing its vector and checking the contributions of the part it owns
    (:data:`EXCHANGE_BASE_PASSES`), then reading the results: ``"relay"`` re-verifies and aggregates
    every participant's contribution to every part (``n_participants`` passes), ``"reencode"``
    decodes one aggregate (1 pass). Raises ValueError for another mode or ``n_participants < 1``.
    """
    if n_participants < 1:
        raise ValueError(f"n_participants={n_participants} must be >= 1")
    if mode == "relay":
        return EXCHANGE_BASE_PASSES + int(n_participants)
    if mode == "reencode":
        return EXCHANGE_BASE_PASSES + 1
    raise ValueError(f"unknown mode {mode!r} (relay, reencode)")


def exchange_cpu_s(numel: int, n_participants: int, mode: str, seconds_per_element: float) -> float:
    """Predicted CPU seconds of one peer's side of a round's collective besides the network:
    ``numel * seconds_per_element * exchange_passes(n_participants, mode)``.

    ``seconds_per_element``: the peer's measured cost of one element pass (encode + sign, or verify +
    aggregate; :func:`geomesh_p2p.model.capability.measure_codec`, then the EMA of its own exchanges). It grows
    linearly with the model: ~0.9 s for gpt2-124m in relay mode with 3 peers at 3.4 ns per element pass.
    Raises ValueError on a negative size or cost.
    """
    if numel < 0 or not seconds_per_element >= 0:
        raise ValueError(f"numel={numel} and seconds_per_element={seconds_per_element} must be >= 0")
    return float(numel) * float(seconds_per_element) * exchange_passes(n_participants, mode)


def exchange_timeout(comm_s: float, cpu_s: float, floor_s: float, safety: float = EXCHANGE_SAFETY) -> float:
    """Seconds from the train deadline to the exchange deadline: ``max(floor_s, safety * (comm_s + cpu_s))``.

    ``comm_s``: the slowest participant's predicted network time (:func:`comm_time`); ``cpu_s``:
    :func:`exchange_cpu_s`. The collective's pushes must arrive within the first three quarters
    (``PeerNode._collective_spec``), so the CPU time that grows with the model is in the window,
    not only the bytes. Raises ValueError on negative inputs.
    """
    if comm_s < 0 or cpu_s < 0 or floor_s < 0 or safety <= 0:
        raise ValueError(f"comm_s={comm_s}, cpu_s={cpu_s}, floor_s={floor_s} must be >= 0, safety={safety} > 0")
    return max(float(floor_s), float(safety) * (float(comm_s) + float(cpu_s)))


def accum_steps_for(micro_batch: int, target_batch: int) -> int:
    """Gradient-accumulation steps of a micro-batch: ``max(1, ceil(target_batch / micro_batch))``."""
    return max(1, -(-target_batch // micro_batch))


class _PeerModel:
    __slots__ = ("peer_id", "address", "micro", "accum", "batch", "step_s", "comm_s")

    def __init__(self, record: PeerRecord, cfg: PlanConfig, micro: int):
        self.peer_id = record.peer_id
        self.address = record.address
        self.micro = micro
        self.accum = accum_steps_for(micro, cfg.target_batch)
        self.batch = micro * self.accum
        self.step_s = self.batch * cfg.seq_len / interpolate_tokens_per_s(record.tokens_per_s, micro)
        self.comm_s = comm_time(record, cfg)

    def with_step_s(self, step_s: float) -> "_PeerModel":
        """A copy planned at another step time (seconds)."""
        m = object.__new__(_PeerModel)
        for k in self.__slots__:
            setattr(m, k, getattr(self, k))
        m.step_s = step_s
        return m


def _best_in_window(record: PeerRecord, current: "_PeerModel", T: float, cfg: PlanConfig) -> "_PeerModel":
    """The micro-batch (among measured ones that fit memory) training the most tokens within ``T``."""
    best, best_tokens = current, None
    for micro in sorted(b for b in record.tokens_per_s if b <= record.max_batch):
        m = current if micro == current.micro else _PeerModel(record, cfg, micro)
        h = int(_inner_steps(np.float64(T), np.array([m.step_s]), np.array([m.comm_s]), cfg)[0])
        if h * m.step_s + m.comm_s > T * (1 + 1e-9):
            continue  # does not fit even its minimum steps
        tokens = h * m.batch
        if best_tokens is None or tokens > best_tokens or (tokens == best_tokens and m is current):
            best, best_tokens = m, tokens
    return best


def _inner_steps(T: np.ndarray, s: np.ndarray, c: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """H = clip(floor((T - c) / s), min, max), broadcasting T against the peers."""
    raw = np.floor((T - c) / s + _STEP_EPS)
    return np.clip(raw, cfg.min_inner_steps, cfg.max_inner_steps).astype(np.int64)


def _window_for_tokens(s, c, tokens_per_step, T_lo: float, cfg: PlanConfig) -> float:
    """Smallest T >= T_lo whose planned budgets sum to >= the target (or all peers at max steps)."""
    target = cfg.target_tokens_per_round
    assert target is not None  # called only for a run with a token target (_choose_window)

    def tokens(T: float) -> int:
        return int((_inner_steps(np.float64(T), s, c, cfg) * tokens_per_step).sum())

    T_hi = float(np.max(c + cfg.max_inner_steps * s))
    if T_hi <= T_lo or tokens(T_lo) >= target:
        return T_lo
    if tokens(T_hi) < target:
        return T_hi
    lo, hi = T_lo, T_hi  # tokens(lo) < target <= tokens(hi)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if tokens(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def _choose_window(s: np.ndarray, c: np.ndarray, tokens_per_step: np.ndarray, cfg: PlanConfig) -> float:
    """The sync window T (seconds) for AWB; see the module docstring."""
    T_feasible = float(np.max(c + cfg.min_inner_steps * s))
    slack = cfg.window_slack
    if cfg.target_tokens_per_round is not None:
        T_base = _window_for_tokens(s, c, tokens_per_step, T_feasible, cfg)
        lo, hi = T_base * (1 - slack), T_base * (1 + slack)
        if T_base <= T_feasible:
            hi = T_base  # the minimum steps already overshoot the target: do not add more
        if cfg.window_s is not None:
            T_base = min(T_base, cfg.window_s)
            hi = min(hi, cfg.window_s)
            lo = min(lo, hi)
    elif cfg.window_s is not None:
        T_base = cfg.window_s
        lo, hi = T_base * (1 - slack), T_base
    else:
        T_base = float(np.max(c)) / cfg.comm_share
        lo, hi = T_base * (1 - slack), T_base * (1 + slack)
    lo = max(lo, T_feasible)
    hi = max(hi, lo)
    T_base = min(max(T_base, lo), hi)
    if hi == lo:
        return lo

    # candidate windows: the instants at which some peer completes a whole step, within [lo, hi]
    cands = [lo, hi, T_base]
    for s_i, c_i in zip(s, c):
        k_lo = max(math.ceil((lo - c_i) / s_i), cfg.min_inner_steps)
        k_hi = min(math.floor((hi - c_i) / s_i), cfg.max_inner_steps)
        if k_hi < k_lo or k_hi - k_lo > _MAX_BREAKPOINTS_PER_PEER:
            continue  # none in range, or so many that this peer's idle is negligible anyway
        cands.extend((c_i + np.arange(k_lo, k_hi + 1) * s_i).tolist())
    Ts = np.unique(np.clip(np.asarray(cands, dtype=np.float64), lo, hi))
    H = _inner_steps(Ts[:, None], s[None, :], c[None, :], cfg)
    finish = H * s[None, :] + c[None, :]
    ok = np.all(finish <= Ts[:, None] * (1 + 1e-9), axis=1)
    worst = np.max((Ts[:, None] - finish) / Ts[:, None], axis=1)
    worst = np.where(ok, worst, np.inf)
    best = float(np.min(worst))
    if not math.isfinite(best):
        return T_base
    # among the (near-)best, prefer the one closest to the base window, then the shorter
    pick = min(
        (i for i in range(len(Ts)) if worst[i] <= best + 1e-12),
        key=lambda i: (abs(Ts[i] - T_base), Ts[i]),
    )
    return float(Ts[pick])


# --------------------------------------------------------------------------------------------
# partition


_load_balance_peers: Optional[Callable] = None


def _hivemind_load_balance(vector_size: int, bandwidths: list[float], min_size: int) -> tuple[int, ...]:
    global _load_balance_peers
    if _load_balance_peers is None:  # importing hivemind takes seconds: only when needed
        from hivemind.averaging.load_balancing import load_balance_peers

        _load_balance_peers = load_balance_peers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's "interior-point is deprecated"
        return tuple(int(x) for x in _load_balance_peers(vector_size, bandwidths, min_size))


def _proportional(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of ``total`` in proportion to ``weights`` (deterministic)."""
    wsum = sum(weights)
    exact = [total * w / wsum for w in weights]
    sizes = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _cap_sizes(sizes: list[int], weights: list[float], cap: int) -> list[int]:
    """``sizes`` (units) with none above ``cap``: the excess goes to the uncapped peers of positive
    weight in proportion to their weights, again until nobody is over (deterministic). Needs
    ``cap * (peers of positive weight) >= sum(sizes)``."""
    sizes = list(sizes)
    for _ in range(len(sizes) + 1):  # each pass saturates at least one more peer, or ends
        excess = sum(max(0, x - cap) for x in sizes)
        if excess == 0:
            return sizes
        sizes = [min(x, cap) for x in sizes]
        room = [i for i, (x, w) in enumerate(zip(sizes, weights)) if w > 0 and x < cap]
        for i, extra in zip(room, _proportional(excess, [weights[i] for i in room])):
            sizes[i] += extra
    raise AssertionError(f"could not cap parts at {cap} units: {sizes}")  # unreachable when cap*n >= total


def part_sizes(
    numel: int, bandwidths: Sequence[Optional[float]], *, align: int = 1, min_size: int = 0, equal: bool = False
) -> list[int]:
    """THE partition rule (the planner's :func:`partition` and the collective's ``make_partition``
    both call it): how many elements of ``[0, numel)`` each peer gets, in the order given.

    ``bandwidths[i]``: peer i's bandwidth (bytes/s, any common unit: only ratios matter); ``0`` =
    client-only (gets nothing); ``None`` = unknown (the mean of the positive ones; all unknown:
    equal shares). Sizes come from hivemind's ``load_balance_peers`` (which may give a slow peer
    nothing; a failure falls back to shares in proportion to bandwidth), or equal shares with
    ``equal=True``. Every size is a multiple of ``align`` elements except the last non-empty one;
    ``min_size``: a peer that would get fewer elements gets none (load_balance_peers' rule). No
    peer gets more than :func:`max_owner_units` units: the excess goes to the others in proportion
    to bandwidth. The sizes sum to ``numel``.

    Raises ValueError for ``numel < 0``, ``align < 1``, no peers, a negative or non-finite
    bandwidth, or no peer with a positive (or unknown) bandwidth.
    """
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    if not bandwidths:
        raise ValueError("no peers to partition among")
    if any(b is not None and not (math.isfinite(b) and b >= 0) for b in bandwidths):
        raise ValueError(f"bandwidths must be finite and >= 0, got {list(bandwidths)}")
    known = [float(b) for b in bandwidths if b is not None and b > 0]
    unknown = known and sum(known) / len(known) or 1.0
    bw = [unknown if b is None else float(b) for b in bandwidths]
    n_owners = sum(1 for b in bw if b > 0)
    if n_owners == 0:
        raise ValueError("no peer accepts connections (all client-only): nobody can own a part")

    units = -(-numel // align)
    if units == 0:
        sizes = [0] * len(bw)
    elif equal:
        sizes = _proportional(units, [1.0 if b > 0 else 0.0 for b in bw])
    elif n_owners == 1:
        sizes = [units if b > 0 else 0 for b in bw]
    else:
        try:
            sizes = list(_hivemind_load_balance(units, bw, -(-min_size // align) if min_size else 0))
        except Exception as e:  # noqa: BLE001 - a solver failure must not stop the round
            logger.warning("load_balance_peers failed (%s); splitting in proportion to bandwidth", e)
            sizes = []
        if (
            len(sizes) != len(bw)
            or sum(sizes) != units
            or any(x < 0 for x in sizes)
            or any(x > 0 for x, b in zip(sizes, bw) if b == 0)
        ):
            if sizes:
                logger.warning("load_balance_peers gave an unusable split %s; using bandwidth-proportional", sizes)
            sizes = _proportional(units, bw)
    if units:
        sizes = _cap_sizes(
            sizes, [1.0 if b > 0 else 0.0 for b in bw] if equal else bw, max_owner_units(units, n_owners)
        )

    sizes = [x * align for x in sizes]
    excess = sum(sizes) - numel
    if excess:
        last = max(i for i, x in enumerate(sizes) if x > 0)
        sizes[last] -= excess  # excess < align <= sizes[last]
    return sizes


def partition(
    numel: int, owners: Sequence[PeerRecord], *, align: int = 1, min_size: int = 0, equal: bool = False
) -> list[tuple[str, int, int]]:
    """Split ``[0, numel)`` into contiguous parts, one per peer, in peer_id order, by :func:`part_sizes`.

    Peers that accept connections get parts sized by their bandwidth (``min(upload_bps,
    download_bps)``, bytes/s); client-only peers (``address is None``) get an empty part.
    ``equal=True`` splits equally among the owners instead (the uniform baseline). Returns
    ``[(peer_id, start, end)]`` for every peer given, sorted by peer_id; the non-empty parts tile
    ``[0, numel)`` exactly.

    Raises ValueError for ``numel < 0``, no peers, duplicate peer ids, a non-positive bandwidth, or
    no peer that accepts connections (someone must own the parts).
    """
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    if not owners:
        raise ValueError("no peers to partition among")
    recs = sorted(owners, key=lambda r: r.peer_id)
    ids = [r.peer_id for r in recs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate peer_id in partition input")
    for r in recs:
        for field in ("upload_bps", "download_bps"):
            v = getattr(r, field)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"peer {r.peer_id}: {field}={v} must be a positive finite bandwidth (bytes/s)")
    bw = [0.0 if r.client_only else float(min(r.upload_bps, r.download_bps)) for r in recs]
    sizes = part_sizes(numel, bw, align=align, min_size=min_size, equal=equal)
    out, pos = [], 0
    for r, size in zip(recs, sizes):
        out.append((r.peer_id, pos, pos + size))
        pos += size
    assert pos == numel
    return out


# --------------------------------------------------------------------------------------------
# plans


class _PlanMeta(NamedTuple):
    """What a plan states besides its assignments: the arguments of :func:`plan_round` (same names)."""

    run_id: str
    round: int
    leader: str
    numel: int
    start_time: float
    start_digest: Optional[str]
    created_at: Optional[float]


def _build_plan(
    recs: list[PeerRecord],
    models: list[_PeerModel],
    H: np.ndarray,
    T: float,
    cfg: PlanConfig,
    meta: _PlanMeta,
    probation: Collection[str],
    *,
    equal: bool,
) -> RoundPlan:
    """The RoundPlan of peers ``recs`` (their ``models`` and inner steps ``H``, window ``T`` seconds):
    ``[0, numel)`` partitioned among the established peers that accept connections (``equal``: in
    equal parts, else by bandwidth), the probation peers made client-only (:func:`_owners_only`)."""
    parts = partition(meta.numel, _owners_only(recs, probation), align=cfg.part_align, equal=equal)
    assignments = []
    for m, h, (pid, start, end) in zip(models, H.tolist(), parts):
        assert pid == m.peer_id
        compute = h * m.step_s
        assignments.append(
            PeerAssignment(
                peer_id=pid,
                address=m.address,
                batch_size=m.batch,
                micro_batch=m.micro,
                accum_steps=m.accum,
                inner_steps=int(h),
                token_budget=int(h) * m.batch * cfg.seq_len,
                part_start=start,
                part_end=end,
                predicted_compute_s=compute,
                predicted_comm_s=m.comm_s,
                predicted_idle_s=max(0.0, T - compute - m.comm_s),
                probation=pid in probation,
            )
        )
    train_deadline = meta.start_time + T
    return RoundPlan(
        run_id=meta.run_id,
        round=meta.round,
        leader=meta.leader,
        method=cfg.method,
        mode=cfg.mode,
        numel=meta.numel,
        seq_len=cfg.seq_len,
        window_s=T,
        train_deadline=train_deadline,
        exchange_deadline=train_deadline + cfg.exchange_timeout_s,
        start_digest=meta.start_digest,
        created_at=meta.start_time if meta.created_at is None else meta.created_at,
        assignments=assignments,
    )


def plan_round(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    run_id: str,
    round: int,
    leader: str,
    numel: int,
    start_time: float,
    start_digest: Optional[str] = None,
    created_at: Optional[float] = None,
    supported_tokens_per_s: Optional[Mapping[str, float]] = None,
    probation: Collection[str] = (),
) -> RoundPlan:
    """Plan a round with adaptive workload balancing (GeoMesh's AWB; see the module docstring).

    Every peer gets the batch size that fits its memory at its best measured tokens/s and the
    number of inner steps ``H_i = clip(floor((T - c_i) / s_i), min, max)`` that fills the common
    window ``T`` (seconds) with its compute (``H_i * s_i``) plus its communication (``c_i``), so
    its predicted idle ``T - H_i s_i - c_i`` is under one step. ``numel``: elements of the flat
    parameter vector to partition; ``start_time``: unix seconds the round starts (deadlines are
    ``start_time + T`` and that ``+ exchange_timeout_s``); ``created_at`` defaults to
    ``start_time`` so that the plan is a pure function of its inputs.

    Claims are bounded first (:func:`bound_records`). ``supported_tokens_per_s`` (peer_id ->
    tokens/s), when the leader has it, is what each peer's last delivered contribution supports
    (tokens delivered / compute seconds planned for it); a peer is then planned at no more than
    ``EVIDENCE_GROWTH`` x that rate: its ``H_i`` is lowered, the window ``T`` is not (followers
    recompute ``T`` from the records alone). Finally no budget exceeds ``BUDGET_MEDIAN_FACTOR`` x the
    lower-median budget unless it is ``min_inner_steps`` steps of its batch.

    The result does not depend on the order of ``records``. Raises ValueError for no peers, a
    duplicate peer_id, a peer with no measured throughput or a non-positive bandwidth (the message
    names the peer and field), no peer that accepts connections, or ``numel < 0``.
    """
    recs = bound_records(_check_records(records))
    models = [_PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
    s, c = _step_and_comm(models)
    tokens_per_step = np.array([m.batch * cfg.seq_len for m in models], dtype=np.int64)
    T = _choose_window(s, c, tokens_per_step, cfg)
    # Step granularity: with few, long steps a peer can lose most of a step to rounding. Once T is
    # known, each peer takes the measured micro-batch that trains the most tokens inside T (ties:
    # the throughput-optimal one), which can be a smaller, slightly less efficient batch.
    models = [_best_in_window(r, m, T, cfg) for r, m in zip(recs, models)]
    if supported_tokens_per_s:
        models = _bound_by_evidence(recs, models, supported_tokens_per_s, cfg)
    s, c = _step_and_comm(models)
    H = _inner_steps(np.float64(T), s, c, cfg)
    H = _cap_budgets(models, H, cfg)
    probation = _probation_ids(recs, probation)
    if probation:
        H = _cap_budgets(models, _cap_probation(models, H, cfg, probation), cfg)
    meta = _PlanMeta(run_id, round, leader, numel, start_time, start_digest, created_at)
    return _build_plan(recs, models, H, T, cfg, meta, probation, equal=False)


def _step_and_comm(models: Sequence[_PeerModel]) -> tuple[np.ndarray, np.ndarray]:
    """(step seconds, comm seconds) of the peers as float64 arrays."""
    return (
        np.array([m.step_s for m in models], dtype=np.float64),
        np.array([m.comm_s for m in models], dtype=np.float64),
    )


def _bound_by_evidence(
    recs: Sequence[PeerRecord], models: list[_PeerModel], supported: Mapping[str, float], cfg: PlanConfig
) -> list[_PeerModel]:
    """Models whose step time is at least what ``EVIDENCE_GROWTH`` x the supported rate allows.
    Longer steps only: a peer with no (or unusable) evidence keeps its model."""
    out = []
    for r, m in zip(recs, models):
        rate = supported.get(r.peer_id)
        if rate is not None and math.isfinite(rate) and rate > 0:
            ceiling = EVIDENCE_GROWTH * float(rate)
            if interpolate_tokens_per_s(r.tokens_per_s, m.micro) > ceiling:
                m = m.with_step_s(m.batch * cfg.seq_len / ceiling)
        out.append(m)
    return out


def _cap_budgets(models: Sequence[_PeerModel], H: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """``H`` lowered so that no budget exceeds ``BUDGET_MEDIAN_FACTOR`` x the lower-median budget,
    never below ``min_inner_steps``. The lower median is unchanged by the cap (a capped budget stays
    >= half the limit >= the median, since the factor is >= 2), so one pass suffices."""
    step_tokens = [m.batch * cfg.seq_len for m in models]
    budgets = [int(h) * t for h, t in zip(H.tolist(), step_tokens)]
    limit = BUDGET_MEDIAN_FACTOR * statistics.median_low(budgets)
    return _lowered_to(H, step_tokens, limit, range(len(models)), cfg)


def _lowered_to(
    H: np.ndarray, step_tokens: Sequence[int], limit: float, among: Iterable[int], cfg: PlanConfig
) -> np.ndarray:
    """A copy of ``H`` in which each peer of index in ``among`` whose budget ``H_i x step_tokens_i``
    exceeds ``limit`` tokens gets ``floor(limit / step_tokens_i)`` steps, never below ``min_inner_steps``."""
    out = H.copy()
    for i in among:
        t = step_tokens[i]
        if int(H[i]) * t > limit:
            out[i] = max(cfg.min_inner_steps, math.floor(limit / t))
    return out


def _probation_ids(recs: Sequence[PeerRecord], probation: Collection[str]) -> frozenset:
    """The probation peers among ``recs``; empty when that would leave no established peer (then the
    marking means nothing: geomesh_p2p.trust.probation, 'nobody established')."""
    ids = frozenset(r.peer_id for r in recs if r.peer_id in set(probation))
    return ids if len(ids) < len(recs) else frozenset()


def _owners_only(recs: Sequence[PeerRecord], probation: Collection[str]) -> list[PeerRecord]:
    """``recs`` with the probation peers made client-only: they own no part (:func:`partition` raises
    ValueError when no established peer accepts connections)."""
    return [r.model_copy(update={"address": None}) if r.peer_id in probation else r for r in recs]


def _cap_probation(
    models: Sequence[_PeerModel], H: np.ndarray, cfg: PlanConfig, probation: Collection[str]
) -> np.ndarray:
    """``H`` lowered so that no probation peer's budget exceeds ``PROBATION_BUDGET_FACTOR`` x the
    lower-median budget of the established peers, never below ``min_inner_steps``."""
    if not probation:
        return H
    from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR

    step_tokens = [m.batch * cfg.seq_len for m in models]
    est = [int(h) * t for m, h, t in zip(models, H.tolist(), step_tokens) if m.peer_id not in probation]
    if not est:
        return H
    limit = PROBATION_BUDGET_FACTOR * statistics.median_low(est)
    return _lowered_to(H, step_tokens, limit, [i for i, m in enumerate(models) if m.peer_id in probation], cfg)


def plan_uniform(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    run_id: str,
    round: int,
    leader: str,
    numel: int,
    start_time: float,
    start_digest: Optional[str] = None,
    created_at: Optional[float] = None,
    inner_steps: Optional[int] = None,
    probation: Collection[str] = (),
) -> RoundPlan:
    """Plan a round the DiLoCo way: the same batch and inner steps for every peer.

    Micro-batch ``m = min(target_batch, min_i max_batch_i)`` (fits everyone), batch
    ``m * ceil(target_batch / m)``, ``H = inner_steps`` (default ``cfg.uniform_inner_steps``) for
    all; the window is set by the slowest peer, ``T = max_i (H s_i + c_i)``, so faster peers idle
    ``T - H s_i - c_i``. Parts are equal among the peers that accept connections. Claims are
    bounded as in :func:`plan_round` (:func:`bound_records`). Same arguments, determinism and
    errors as :func:`plan_round`.
    """
    recs = bound_records(_check_records(records))
    H_all = cfg.uniform_inner_steps if inner_steps is None else int(inner_steps)
    if H_all < 1:
        raise ValueError(f"inner_steps={H_all} must be >= 1")
    micro = min(cfg.target_batch, min(r.max_batch for r in recs))
    models = [_PeerModel(r, cfg, micro) for r in recs]
    H = np.full(len(models), H_all, dtype=np.int64)
    T = max(H_all * m.step_s + m.comm_s for m in models)
    probation = _probation_ids(recs, probation)
    meta = _PlanMeta(run_id, round, leader, numel, start_time, start_digest, created_at)
    return _build_plan(recs, models, H, T, cfg, meta, probation, equal=True)


def make_plan(records: Sequence[PeerRecord], cfg: PlanConfig, **kwargs) -> RoundPlan:
    """Plan by ``cfg.method``: ``geomesh``/``awb`` -> :func:`plan_round`; ``diloco``/``css`` ->
    :func:`plan_uniform`; ``ddp`` -> :func:`plan_uniform` with one inner step (a sync every step).
    Keyword arguments as for :func:`plan_round` (``supported_tokens_per_s`` is used by AWB only:
    uniform plans give every peer the same steps)."""
    rule = _method_rule(cfg)
    if rule.balanced:
        return plan_round(records, cfg, **kwargs)
    kwargs.pop("supported_tokens_per_s", None)
    return plan_uniform(records, cfg, inner_steps=rule.uniform_inner_steps, **kwargs)


def _method_rule(cfg: PlanConfig) -> "_method.MethodRule":
    """The :class:`~geomesh_p2p.config.method.MethodRule` of ``cfg.method`` (balanced or not, uniform steps)."""
    return _method.MethodRule.of(cfg.method, mode=cfg.mode, uniform_inner_steps=cfg.uniform_inner_steps)


def reference_window(records: Sequence[PeerRecord], cfg: PlanConfig) -> float:
    """The window (seconds) an honest leader plans for these records and ``cfg``: what
    :func:`make_plan` would choose (claims bounded by :func:`bound_records`). Raises ValueError like
    :func:`plan_round` for records it cannot plan."""
    recs = bound_records(_check_records(records))
    rule = _method_rule(cfg)
    if rule.balanced:
        models = [_PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
        s, c = _step_and_comm(models)
        return _choose_window(s, c, np.array([m.batch * cfg.seq_len for m in models], dtype=np.int64), cfg)
    H = rule.uniform_inner_steps
    assert H is not None  # every method that is not balanced has one H for all peers (MethodRule.of)
    micro = min(cfg.target_batch, min(r.max_batch for r in recs))
    return max(H * m.step_s + m.comm_s for m in (_PeerModel(r, cfg, micro) for r in recs))


#: The window exclusion (:func:`window_exclusions`): a peer new to the plan is left out when including it would
#: make the round longer by more than this share of the round without it (the window, or longer); a peer of
#: the last round's plan only past ``EXCLUDE_KEPT_SHARE``: one noisy link figure must not flap it in and out.
EXCLUDE_NEW_SHARE = 0.5
EXCLUDE_KEPT_SHARE = 1.0


class WindowExclusion(NamedTuple):
    """What :func:`window_exclusions` decided, with the figures it decided on (seconds).

    Attributes:
        excluded: PeerIDs to plan without, slowest first.
        need_s: peer -> seconds the round needs for it: its exchange (measured when given, else
            :func:`comm_time`) plus its minimum compute (``min_inner_steps`` steps for AWB, the uniform ``H``
            steps for uniform plans).
        comm_s: peer -> the exchange seconds used in ``need_s``.
        measured: PeerIDs whose exchange figure was measured rather than predicted from the link figures.
    """

    excluded: tuple[str, ...]
    need_s: dict[str, float]
    comm_s: dict[str, float]
    measured: frozenset


def window_exclusions(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    kept: Collection[str] = (),
    measured_comm_s: Optional[Mapping[str, float]] = None,
    keep_at_least: int = 2,
) -> WindowExclusion:
    """Which peers to plan without because including them would stretch the round (the exclusion rule).

    For each peer the round needs ``need_i = c_i + k * s_i`` seconds: ``c_i`` its exchange (``measured_comm_s``
    when it has a positive finite figure -- what the leader saw of its recent exchanges -- else
    :func:`comm_time` from its link figures), ``s_i`` its step time (:func:`best_micro_batch`, or the uniform
    micro-batch), ``k`` = ``min_inner_steps`` (AWB) or the uniform ``H``. Repeatedly, the peer with the
    largest need is left out when the round with it would be longer than without it by more than
    ``EXCLUDE_NEW_SHARE`` (a peer not in ``kept``, the last round's participants) or ``EXCLUDE_KEPT_SHARE`` x
    the round without it, ``max(window_s, largest need of the others)``; it stops at the first peer kept,
    and never leaves fewer than ``keep_at_least`` peers. A peer whose exchange is long but fits the window
    with its minimum steps costs the round nothing (AWB gives it fewer steps) and is kept. Claims are
    bounded first (:func:`bound_records`). Pure; raises ValueError like :func:`plan_round` on bad records.
    """
    recs = bound_records(_check_records(records))
    rule = _method_rule(cfg)
    if rule.balanced:
        models = [_PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
        k = cfg.min_inner_steps
    else:
        micro = min(cfg.target_batch, min(r.max_batch for r in recs))
        models = [_PeerModel(r, cfg, micro) for r in recs]
        k = int(rule.uniform_inner_steps or 1)
    measured = {
        pid: float(v)
        for pid, v in (measured_comm_s or {}).items()
        if v is not None and math.isfinite(float(v)) and float(v) > 0
    }
    comm = {m.peer_id: measured.get(m.peer_id, m.comm_s) for m in models}
    need = {m.peer_id: comm[m.peer_id] + k * m.step_s for m in models}
    window = float(cfg.window_s or 0.0)
    kept_ids = set(kept)
    remaining = sorted(need, key=lambda p: (-need[p], p))
    excluded: list[str] = []
    while len(remaining) > max(1, keep_at_least):
        pid, others = remaining[0], remaining[1:]
        without = max(window, max(need[p] for p in others))
        share = EXCLUDE_KEPT_SHARE if pid in kept_ids else EXCLUDE_NEW_SHARE
        if need[pid] - without <= share * without:
            break
        excluded.append(pid)
        remaining = others
    return WindowExclusion(tuple(excluded), need, comm, frozenset(p for p in measured if p in need))


def check_plan(
    plan: RoundPlan, records: Mapping[str, PeerRecord], cfg: PlanConfig, *, now: float, barred: Collection[str] = ()
) -> Optional[str]:
    """Why a follower must refuse ``plan`` (a one-line reason), or None when it is within bounds.

    A pure function of the plan, the follower's view of the records (``peer_id -> PeerRecord``), the
    :class:`PlanConfig` the run implies (the one the follower would plan with for these participants)
    and ``now`` (unix seconds). Every plan that :func:`make_plan` makes from the same records and
    config passes; a rogue or broken leader's plan is refused when any of these fails:

    * settings: ``seq_len`` / ``method`` / ``mode`` as in ``cfg``; every participant has a record;
    * batch: ``micro_batch`` within the record's bounded ``max_batch`` (:func:`bound_records`:
      what it announces, at most ``BATCH_SPREAD_CAP`` x the lower median); ``accum_steps`` exactly
      what ``target_batch`` implies; uniform methods: the same micro-batch for all, the fixed ``H``;
    * steps: every participant gets ``min_inner_steps..max_inner_steps`` (AWB). No peer is planned
      with 0 steps: the stated rule for a peer that cannot keep up is to leave it out of the plan
      (``PlanRules.build_plan``: exchange or one sequence longer than half the window);
    * window: ``window_s`` within ``PLAN_CHECK_TOLERANCE`` x (either way) of :func:`reference_window`,
      ``train_deadline = created_at + window_s``, ``created_at`` at most ``MAX_CLOCK_SKEW_S`` ahead;
    * budgets: each at most ``PLAN_CHECK_TOLERANCE`` x (bounded best tokens/s x ``window_s``); at
      most ``BUDGET_MEDIAN_FACTOR`` x the plan's lower-median budget unless it is
      ``min_inner_steps`` steps of its own batch; hence a share of the total at most
      :func:`max_token_share`;
    * ownership: no owner without an address in its record, none with more than
      :func:`max_owner_units` x ``part_align`` elements, counting as possible owners the
      participants whose record has an address, less ``barred`` (peers this follower itself bars
      from owning, e.g. after a part they owned had no valid result: a leader that bars them too
      plans them as client-only; one that bars others cannot shrink the count);
    * probation (:mod:`geomesh_p2p.trust.probation`): at most ``probation_slots(established)`` participants
      marked ``probation``, none of them owning a part, each budget at most ``PLAN_CHECK_TOLERANCE x
      PROBATION_BUDGET_FACTOR`` x the established participants' lower-median budget (or its
      ``min_inner_steps`` steps); they do not count as possible owners. Whether the marking matches this
      follower's view of standing is checked by ``probation.marking_problem`` (the node's).
    """
    if plan.seq_len != cfg.seq_len or plan.method != cfg.method or plan.mode != cfg.mode:
        return (
            f"its seq_len/method/mode {plan.seq_len}/{plan.method}/{plan.mode} differ from the run's "
            f"{cfg.seq_len}/{cfg.method}/{cfg.mode}"
        )
    missing = [pid[:10] for pid in plan.participants() if pid not in records]
    if missing:
        return f"it names peers without a record: {missing}"
    recs = [records[pid] for pid in plan.participants()]
    try:
        T_ref = reference_window(recs, cfg)
    except ValueError as e:
        return f"its participants' records cannot be planned ({e})"
    by_id = {r.peer_id: r for r in bound_records(recs)}
    seq = cfg.seq_len
    rule = _method_rule(cfg)
    balanced, uniform_H = rule.balanced, rule.uniform_inner_steps
    uniform_micro = min(cfg.target_batch, min(r.max_batch for r in by_id.values()))
    for a in plan.assignments:
        r, who = by_id[a.peer_id], a.peer_id[:10]
        if a.micro_batch > r.max_batch:
            return f"micro-batch {a.micro_batch} for {who} exceeds the {r.max_batch} its record supports"
        if a.accum_steps != accum_steps_for(a.micro_batch, cfg.target_batch):
            return (
                f"{who} accumulates {a.accum_steps} micro-batches of {a.micro_batch}; target batch "
                f"{cfg.target_batch} means {accum_steps_for(a.micro_batch, cfg.target_batch)}"
            )
        if balanced and not cfg.min_inner_steps <= a.inner_steps <= cfg.max_inner_steps:
            return (
                f"{a.inner_steps} inner steps for {who}, outside {cfg.min_inner_steps}..{cfg.max_inner_steps}"
                " (a peer that cannot keep up is left out of the plan, not given 0 steps)"
            )
        if not balanced and (a.inner_steps != uniform_H or a.micro_batch != uniform_micro):
            return (
                f"{who} gets {a.inner_steps} steps of micro-batch {a.micro_batch}; method {cfg.method} gives "
                f"everyone {uniform_H} of {uniform_micro}"
            )
        if a.owns_part and records[a.peer_id].address is None:
            return f"client-only peer {who} owns a part"
    T = plan.window_s
    if not T_ref / PLAN_CHECK_TOLERANCE <= T <= T_ref * PLAN_CHECK_TOLERANCE:
        return f"its window {T:.3g} s is far from the {T_ref:.3g} s the records support"
    if abs(plan.train_deadline - plan.created_at - T) > 1e-6 * T + 1e-3:
        return "its train deadline is not its start plus its window"
    if plan.created_at - now > MAX_CLOCK_SKEW_S:
        return f"it starts {plan.created_at - now:.0f} s in the future"
    budgets = [a.token_budget for a in plan.assignments]
    limit = BUDGET_MEDIAN_FACTOR * statistics.median_low(budgets)
    total = sum(budgets)
    share = max_token_share(len(budgets))
    for a in plan.assignments:
        who = a.peer_id[:10]
        ceiling = PLAN_CHECK_TOLERANCE * by_id[a.peer_id].best_tokens_per_s() * T
        if a.token_budget > ceiling:
            return (
                f"token budget {a.token_budget} for {who} exceeds the {ceiling:.0f} its bounded throughput "
                f"supports in {T:.3g} s"
            )
        floor = cfg.min_inner_steps * a.batch_size * seq
        if a.token_budget > max(limit, floor):
            return (
                f"token budget {a.token_budget} for {who} is over {BUDGET_MEDIAN_FACTOR:g}x the plan's median "
                f"budget ({limit / BUDGET_MEDIAN_FACTOR:.0f})"
            )
        if a.token_budget > floor and a.token_budget > share * total * (1 + 1e-12):
            return f"{who} holds {a.token_budget / total:.0%} of the round's tokens, over the {share:.0%} bound"
    reason = _probation_problem(plan, cfg)
    if reason is not None:
        return reason
    on_probation = set(plan.probation())
    possible = {r.peer_id for r in recs if r.address is not None and r.peer_id not in on_probation}
    # The leader may bar owners this follower does not (an owner penalty it saw and this follower did not,
    # e.g. while it was syncing): from 4 possible owners on, a minority of them is accepted as the leader's
    # call, so honest views that differ do not refuse honest plans, while a rogue leader still cannot make
    # itself sole owner (each owner stays under ~2 OWNER_SHARE_FACTOR / n of the vector).
    unowned = possible - {pid for pid, _, _ in plan.owners()}
    mine = len(unowned & set(barred))
    leeway = (len(possible) - 1) // 2 if len(possible) >= LEADER_BAR_MIN_OWNERS else 0
    n_owners = max(1, len(possible) - max(mine, min(len(unowned), leeway)))
    units = -(-plan.numel // cfg.part_align)
    cap = max_owner_units(units, n_owners) * cfg.part_align
    for pid, start, end in plan.owners():
        if end - start > cap:
            return (
                f"{pid[:10]} owns {end - start} of {plan.numel} elements, over the {cap} bound "
                f"({OWNER_SHARE_FACTOR:g}x a fair share among {n_owners} owners)"
            )
    return None


def _probation_problem(plan: RoundPlan, cfg: PlanConfig) -> Optional[str]:
    """Count, ownership and budgets of the participants ``plan`` marks as on probation (see check_plan)."""
    from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR, probation_slots

    marked = [a for a in plan.assignments if a.probation]
    if not marked:
        return None
    est = [a for a in plan.assignments if not a.probation]
    if not est:
        return "it marks every participant as on probation"
    slots = probation_slots(len(est))
    if len(marked) > slots:
        return (
            f"it plans {len(marked)} peers on probation with {len(est)} established; at most {slots} may join a round"
        )
    limit = PLAN_CHECK_TOLERANCE * PROBATION_BUDGET_FACTOR * statistics.median_low([a.token_budget for a in est])
    for a in marked:
        if a.owns_part:
            return f"{a.peer_id[:10]} is on probation and owns a part"
        floor = cfg.min_inner_steps * a.batch_size * cfg.seq_len
        if a.token_budget > max(limit, floor):
            return (
                f"token budget {a.token_budget} for {a.peer_id[:10]} (on probation) is over "
                f"{PROBATION_BUDGET_FACTOR:g}x the established peers' median budget"
            )
    return None


def format_plan_table(plan: RoundPlan, names: Optional[Mapping[str, str]] = None) -> str:
    """A plain-text table of a plan (one row per peer) for logs, the CLI and ``pytest -s``.

    ``names`` optionally maps peer_id to a label (e.g. the GPU name) shown instead of the id.
    """
    names = names or {}
    head = (
        f"round {plan.round} method={plan.method} mode={plan.mode} window={plan.window_s:.3f}s"
        f" tokens={plan.total_token_budget()}"
    )
    cols = ["peer", "batch", "micro", "accum", "H", "tokens", "compute_s", "comm_s", "idle_s", "idle%", "part"]
    rows = []
    idle = plan.predicted_straggler_idle()
    for a in plan.assignments:
        rows.append(
            [
                names.get(a.peer_id, a.peer_id[:12]),
                str(a.batch_size),
                str(a.micro_batch),
                str(a.accum_steps),
                str(a.inner_steps),
                str(a.token_budget),
                f"{a.predicted_compute_s:.3f}",
                f"{a.predicted_comm_s:.3f}",
                f"{a.predicted_idle_s:.3f}",
                f"{100 * idle[a.peer_id]:.2f}",
                f"[{a.part_start},{a.part_end})" if a.owns_part else "-",
            ]
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    lines = [head, fmt.format(*cols)] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)
