"""Bounds on untrusted records and plans (DESIGN.md "Untrusted volunteers", issue 11).

Records are what peers *say*. Before planning, :func:`bound_records` clamps every claim to a bounded
multiple of the members' lower median (``statistics.median_low``: with two members, the smaller
one, so one liar cannot drag the median up): tokens/s to ``THROUGHPUT_SPREAD_CAP`` x, ``max_batch``
to ``BATCH_SPREAD_CAP`` x, each bandwidth direction to ``BANDWIDTH_SPREAD_CAP`` x. The leader may
also pass what each peer's last *delivered* contribution supports (``supported_tokens_per_s``): the
peer's inner steps are then planned at no more than ``EVIDENCE_GROWTH`` x that rate (this only lowers
``H_i``; the window stays what every follower can recompute). After the inner steps are known, no
budget exceeds ``BUDGET_MEDIAN_FACTOR`` x the plan's lower-median budget (``H_i`` is lowered; a peer
already at ``min_inner_steps`` keeps them). The caps are per device: a peer of ``ranks`` K gets K x each
(:func:`bound_records`, :func:`budget_limit`; bandwidth is the peer's link, not scaled). Followers run :func:`~geomesh_p2p.plan.planner.check_plan` on every plan: it
recomputes these bounds from the records they see and the run's :class:`PlanConfig` and refuses a
plan outside them with a one-line reason (the next leader then takes over, :mod:`geomesh_p2p.round`).
Every plan :func:`~geomesh_p2p.plan.planner.make_plan` makes passes :func:`~geomesh_p2p.plan.planner.check_plan` on the same records by construction.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Mapping, Optional, Sequence

from geomesh_p2p.model.capability import MAX_TPS_GROWTH_PER_UPDATE
from geomesh_p2p.plan.cost import ranks_of
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR

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


#: A participant that contributed to no part of a conclusive round (a no-show, or a push that reached its owners after
#: they closed: a late peer) is planned at no more than this share of the rate its plan of that round gave it (token
#: budget / predicted compute seconds) for ``probation.LATE_MARK_ROUNDS`` rounds (:func:`evidence_ceilings`'
#: ``late``): a late peer gets less work, never more, and a free rider no larger share than it had.
LATE_RATE_SHARE = 0.5


def late_ceiling(planned_tokens_per_s: float, held: Optional[float] = None) -> float:
    """Tokens/s ceiling of a participant after a round it contributed to no part of: ``LATE_RATE_SHARE`` x the rate
    its plan gave it (``planned_tokens_per_s``), and no more than ``held`` (the ceiling of an earlier miss still
    in force: a peer planned at it and late again gets half of it)."""
    c = LATE_RATE_SHARE * float(planned_tokens_per_s)
    return c if held is None else min(c, float(held))


class LateCeilings(dict):
    """A follower's late ceilings (peer id -> tokens/s, as the plain map of :func:`evidence_ceilings`' ``late``) and
    ``blind``: the peers whose late ceiling this follower cannot bound from below, as it did not apply every round a
    mark on them could come from (joined, restarted, re-synced or planned out since: session 50,
    :meth:`~geomesh_p2p.round.rules.penalties.Penalties.follower_late`). :func:`evidence_ceiling_range` gives them a
    low end of 0 (no under-plan fit, as for an unseen rate); the high end and every leader's own ceilings stay."""

    def __init__(self, ceilings: Optional[Mapping[str, float]] = None, blind: Iterable[str] = ()):
        super().__init__(ceilings or {})
        self.blind: frozenset[str] = frozenset(blind)


def evidence_ceilings(
    peer_ids: Iterable[str],
    supported: Optional[Mapping[str, float]],
    late: Optional[Mapping[str, float]] = None,
) -> dict[str, float]:
    """Tokens/s ceiling of each of ``peer_ids`` from delivered work (issue 28, "claims planned by delivered
    work"): ``EVIDENCE_GROWTH`` x its rate in ``supported`` (peer id -> tokens/s its last round's delivered
    contribution supports: tokens the owners took from it, capped by its budget, over the compute seconds
    its plan predicted; every peer that applied that round computes the same map), and for a peer with no
    such rate (a newcomer, or one that sat the round out) the lower median of the rates there: an announced
    figure seeds a newcomer at most at what the peers that delivered deliver. Empty when ``supported`` has no
    usable rate (round 0, or a node that did not apply the last round: records alone bound the plan then).
    Pure: the leader plans with it (:func:`~geomesh_p2p.plan.awb.plan_round`) and followers check the plan
    against it (:func:`~geomesh_p2p.plan.planner.check_plan`).

    ``late`` (peer id -> tokens/s, :func:`late_ceiling`): the peers that contributed to no part of a recent round,
    each planned at no more than that rate as well (held by every peer that applied those rounds:
    :meth:`~geomesh_p2p.round.rules.penalties.Penalties.late_ceilings`)."""
    rates = usable_rates(supported)
    if not rates:
        return {}
    seed = statistics.median_low(sorted(rates.values()))
    caps = usable_rates(late)
    out = {p: EVIDENCE_GROWTH * rates[p] if p in rates else seed for p in peer_ids}
    return {p: min(c, caps[p]) if p in caps else c for p, c in out.items()}


def usable_rates(supported: Optional[Mapping[str, float]]) -> dict[str, float]:
    """The entries of a delivered-rate map (peer id -> tokens/s) that bound a plan: finite and positive."""
    return {p: float(v) for p, v in (supported or {}).items() if v is not None and math.isfinite(v) and v > 0}


def evidence_ceiling_range(
    peer_ids: Iterable[str],
    supported: Optional[Mapping[str, float]],
    unseen: Optional[Mapping[str, float]] = None,
    late: Optional[Mapping[str, float]] = None,
) -> dict[str, tuple[float, float]]:
    """peer id -> (lowest, highest) tokens/s ceiling an honest leader may have planned it at, for a follower whose
    delivered map is ``supported``: the leader's map may lack one entry this one has (red team 37: a node computes
    it from the part results it read, so one that missed the parts listing a peer has it as a newcomer). Such a
    leader seeds that peer at the newcomer seed, and its seed is the lower median of the rates less that entry:
    each peer's range spans :func:`evidence_ceilings`' ``EVIDENCE_GROWTH`` x its rate (when it has one) and the
    seeds of the map less its highest or its lowest rate (the map's own seed lies between). Empty as
    :func:`evidence_ceilings`. A leader with no usable rate at all plans by the records alone and is not tolerated
    (that would drop the bound for any leader claiming so): with one rate the seed is that rate.

    ``unseen`` (session 38): peer id -> the rate its last round's plan gave it (token budget / predicted compute
    seconds, the most its delivered rate can be) for the participants of that round absent from ``supported`` because
    this follower missed a part that would list them (:meth:`~geomesh_p2p.round.rules.profiling.Reprofiler.unseen_rates`):
    a leader that read those parts may hold any rate up to that, so their range is (0, the larger of the seed's and
    ``EVIDENCE_GROWTH`` x it); 0: no lower bound (the under-plan fit is skipped; with one known rate the leader's
    seed may be an unseen rate, so every peer's). A peer that delivered nothing in the parts this follower read is
    not unseen: it stays at the newcomer seed.

    ``late`` (:func:`evidence_ceilings`): this follower's late ceilings lower the range's low end to them (an honest
    leader holding the same marks plans the peer there); the high end stays, as a leader that did not apply the
    round of the miss holds no mark (its no-show rules bench such a peer anyway). The ``blind`` peers of a
    :class:`LateCeilings` get a low end of 0."""
    known = usable_rates(supported)
    rates = sorted(known.values())
    if not rates:
        return {}
    n = len(rates)
    lo, hi = (rates[(n - 2) // 2], rates[(n - 2) // 2 + 1]) if n > 1 else (rates[0], rates[0])
    missed = {p: v for p, v in usable_rates(unseen).items() if p not in known}
    if missed and n == 1:
        lo = 0.0  # the leader's map may hold a second rate, lower than any known: its seed
    own = evidence_ceilings(peer_ids, supported)
    caps = usable_rates(late)
    out = {
        p: (min(c, lo), max(c, hi))
        if p in known
        else ((0.0, max(hi, EVIDENCE_GROWTH * missed[p])) if p in missed else (lo, hi))
        for p, c in own.items()
    }
    blind: frozenset[str] = getattr(late, "blind", frozenset())
    return {p: (0.0 if p in blind else min(low, caps[p]) if p in caps else low, high) for p, (low, high) in out.items()}


#: no token budget exceeds this many times the plan's lower-median budget (unless it is a single
#: ``min_inner_steps`` block of its own batch). Honest budgets spread by throughput *and* by link:
#: a slow link leaves a peer less of the window (the paper's 4 GPUs with an fp32 exchange, sim
#: profile paper4 method awb: the L40S gets one step, the H100 5.6x the median), so the factor matches
#: THROUGHPUT_SPREAD_CAP rather than the 4x GPU spread (4x would cut that honest plan's tokens by
#: 18%). It also bounds a peer's share of the round's tokens: :func:`max_token_share` (4 peers: 80%).
BUDGET_MEDIAN_FACTOR = 8.0

#: The per-device scale of the caps (issue 30) counts at most this many ranks. ``ranks`` is a claim like any
#: other field of a record (a record may state up to ``MAX_RANKS`` = 64), and each rank claimed multiplies the
#: caps; past one 8-GPU server (DGX/HGX) a larger claim buys no larger share. A real box of more devices still
#: trains on all of them, planned as 8.
BOUND_RANKS_MAX = 8


def bound_ranks(ranks: int) -> int:
    """The ranks the caps scale by: ``ranks`` within ``[1, BOUND_RANKS_MAX]``."""
    return min(BOUND_RANKS_MAX, max(1, int(ranks)))


#: From this many possible owners on, followers accept that the leader bars a minority of them from owning
#: (check_plan: its owner penalties may differ from the follower's); below it, only the follower's own bars.
LEADER_BAR_MIN_OWNERS = 4


def follower_owner_count(possible: int, unowned: int, mine: int = 0) -> int:
    """The owners a follower's ownership bound is a fair share among (``check_plan``): ``possible`` participants
    whose records have an address (less probation), ``unowned`` of them owning nothing in the plan, ``mine`` of those
    barred by the follower itself. From ``LEADER_BAR_MIN_OWNERS`` possible owners on, a minority the leader leaves
    out is its call; below, only the follower's own bars shrink the count. At least 1. The leader caps each part at
    the bound of the follower that bars none (``mine`` 0: the tightest; :func:`~geomesh_p2p.plan.assign.partition`'s
    ``share_among``), so that honest views of the bars that differ do not refuse its plan."""
    leeway = (possible - 1) // 2 if possible >= LEADER_BAR_MIN_OWNERS else 0
    return max(1, possible - max(mine, min(unowned, leeway)))


#: how far a follower's recomputation (window, budget ceilings) may differ from the leader's: views of
#: the records can differ between leader and follower by one re-announcement. Followers' recomputation
#: from the same records is exact; attacks are orders of magnitude outside.
PLAN_CHECK_TOLERANCE = 1.5


#: how far over a participant's record (best tokens/s, and tokens/s at the planned micro-batch, x the window) a follower
#: accepts its budget (session 38): the record a leader reads may be one update newer than the follower's, and a
#: re-profiled figure grows at most ``MAX_TPS_GROWTH_PER_UPDATE`` = 2x per update (a first in-swarm measurement
#: reaches it: docs/collective.md, a start-up profile 8 tokens/s against 60-370 measured). At 1.5 a follower one update
#: behind refused 22 of 400 honest swarms. What it concedes: a budget 2 / 1.5 = 1.33x larger where the record is the
#: binding bound (the delivered-work bound, EVIDENCE_GROWTH x the delivered rate x 1.5, still applies).
RECORD_VIEW_TOLERANCE = MAX_TPS_GROWTH_PER_UPDATE


#: how far under what its record fits in the plan's window a follower accepts a participant's budget (x, after one
#: step of slack; session 36, a leader that under-plans honest peers): the record a follower reads may be one update
#: newer than the leader's, and a re-profiled figure grows at most ``MAX_TPS_GROWTH_PER_UPDATE`` = 2x per update
#: (geomesh_p2p.model.capability): followers divide each figure by this before they fit the window
#: (planner._under_plan_problem), so a leader that held the older record still plans at least that fit.
UNDER_PLAN_TOLERANCE = 2.0
#: the same for a record's link figures (upload / download bytes/s): a round's link sample moves the figure by at most
#: ``link_step_ratio`` (4 by default) either way, so followers fit the window at links this many times slower
#: (red team 36, F1)
UNDER_PLAN_LINK_TOLERANCE = 4.0


#: how far in the future a plan may say it was created (the envelope's clock-skew window, identity.Verifier)
MAX_CLOCK_SKEW_S = 30.0
#: how far in the past (seconds before a follower checks it) a plan may say it was created: a rogue leader dating its
#: plan most of a window back left honest peers a sliver of the window, under their token floor, so their work
#: counted 0 tokens while accomplices that trained ahead claimed theirs (red team, session 34). An honest plan is read
#: within the plan timeouts (seconds); the clock-skew window is the margin. Below it (short windows) the token floor's
#: grace (round.steps.floor_grace_s) still gives honest peers their floor steps.
MAX_PLAN_AGE_S = MAX_CLOCK_SKEW_S


def check_records(records: Sequence[PeerRecord]) -> list[PeerRecord]:
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

    Per device (issue 30): the spreads above are between *devices*, and a peer of ``ranks`` K devices announces
    their sum, so its tokens/s and ``max_batch`` caps are K x the one-device caps (the median stays the
    members' own figures: a ranks claim moves no other peer's cap). Without it a 2-rank peer 11x a slow
    ordinary peer was planned at 8x (two one-rank peers on the same cores, 5.5x each, were not cut). K counts
    at most ``BOUND_RANKS_MAX`` (8): a claim of more ranks loosens no cap further (:func:`bound_ranks`).

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
        k = bound_ranks(ranks_of(r))  # the caps are per device (see above), at most BOUND_RANKS_MAX of them
        if r.tokens_per_s and r.best_tokens_per_s() > k * tps_cap:
            update["tokens_per_s"] = {b: min(v, k * tps_cap) for b, v in r.tokens_per_s.items()}
        if r.max_batch > k * batch_cap:
            update["max_batch"] = max(1, k * batch_cap)
        if r.upload_bps > up_cap:
            update["upload_bps"] = up_cap
        if r.download_bps > down_cap:
            update["download_bps"] = down_cap
        out.append(r.model_copy(update=update) if update else r)
    return out


def budget_limit(median_budget: float, ranks: int = 1) -> float:
    """The largest token budget of a peer of ``ranks`` devices in a plan whose lower-median budget is
    ``median_budget`` (tokens): ``BUDGET_MEDIAN_FACTOR x ranks x median_budget``. Per device, as the record
    caps (:func:`bound_records`): a K-rank peer trains K devices' share, as K one-rank peers would (issue 30).
    K counts at most ``BOUND_RANKS_MAX`` (:func:`bound_ranks`)."""
    return BUDGET_MEDIAN_FACTOR * bound_ranks(ranks) * median_budget


def probation_limit(established_median: float, ranks: int = 1) -> float:
    """The largest token budget a follower accepts for a peer on probation of ``ranks`` devices (before
    ``PLAN_CHECK_TOLERANCE``) when the established participants' lower-median budget is ``established_median``
    (tokens): ``PROBATION_BUDGET_FACTOR x ranks x`` it, per device as :func:`budget_limit` (K at most
    ``BOUND_RANKS_MAX``). An AWB leader caps at the one-device bound (``awb._cap_probation``), under this one; a
    uniform method (diloco, css) plans everyone the same steps, and a K-rank peer's batch is its K devices' rows.
    Session 53 (stop 62's CI failure): the check's bound was per peer, so a 2-rank newcomer's 2 uniform steps (2x
    the median) were over it while no leader could plan fewer: every follower refused every honest plan of that
    round, which then never ended."""
    return PROBATION_BUDGET_FACTOR * bound_ranks(ranks) * established_median


def max_token_share(n_peers: int, ranks: int = 1) -> float:
    """The largest share of a round's token budget one of ``n_peers`` (of ``ranks`` K devices) can hold when
    every budget is within :func:`budget_limit` (``F K`` x the lower median, F = ``BUDGET_MEDIAN_FACTOR``):
    ``F K / (F K + n_peers // 2)`` (at least ``n_peers // 2`` other budgets are >= the lower median). One
    rank: 2 peers: 8/9; 4 peers: 4/5; 7 peers: 8/11; 1 peer: 1. 2 ranks, 2 peers: 16/17. K counts at most
    ``BOUND_RANKS_MAX``: 64 ranks claimed, 4 peers: 64/66, as 8."""
    fk = BUDGET_MEDIAN_FACTOR * bound_ranks(ranks)
    return fk / (fk + n_peers // 2)
