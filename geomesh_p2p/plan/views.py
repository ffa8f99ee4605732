"""Where a follower's view of the records may differ from the leader's, and by how much (sessions 36-38).

A follower checks a plan (:func:`~geomesh_p2p.plan.planner.check_plan`) against the records *it* read, and a
record changes between two reads by at most one re-profiling update (:mod:`geomesh_p2p.round.rules.profiling`):
tokens/s up ``MAX_TPS_GROWTH_PER_UPDATE`` (2) x or down ``MAX_TPS_DROP_PER_UPDATE`` (1.4) x, each link figure by
``link_step_ratio`` (4) x either way. The bounds here hold an honest leader's plan made from a record one update
newer or older than the follower's; a rogue leader may use the same slack (docs/security.md, "Session 38").
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Optional, Sequence

from geomesh_p2p.config.method import COMPRESSED_METHODS
from geomesh_p2p.plan.bounds import (
    RECORD_VIEW_TOLERANCE,
    UNDER_PLAN_LINK_TOLERANCE,
    UNDER_PLAN_TOLERANCE,
    evidence_ceiling_range,
)
from geomesh_p2p.plan.cost import (
    accum_steps_for,
    comm_time,
    interpolate_tokens_per_s,
    peer_uniform_micro,
    rank_micro,
    ranks_of,
)
from geomesh_p2p.plan.schema import ContentRefusal, PeerAssignment, PlanConfig, RoundPlan
from geomesh_p2p.schema.peer import MAX_RANKS, PeerRecord
from geomesh_p2p.trust.verify_task import VerifyConfig, screen_steps

#: Exchange modes whose contributions verified work screens (every reader, or the validators, hold them signed).
SCREENED_MODES = ("relay", "accountable")


#: At most this share of the exchange window (train deadline to exchange deadline) is given to the token floor's
#: steps past the train deadline (:func:`floor_grace_of`); the owners close a part at 75% of it (spec.py), so a push
#: made at this share still has 35% of the window, about the whole predicted exchange (the window is
#: ``planner.EXCHANGE_SAFETY`` = 3 x it). Session 45: 0.25 and one window before.
FLOOR_GRACE_EXCHANGE_SHARE = 0.4
#: ... and at most this many plan windows. Session 45: with the loss-gain test's floor in screened rounds (7 steps at
#: batch 8 x 32), one window (1.5 s in the benchmark) let all four honest peers of a clean swarm reach 6 of their
#: 12-17 planned steps in round 3 (their cores shared with the round-2 screens): every claim counted 0, and the
#: round aggregated nothing.
FLOOR_GRACE_WINDOWS = 2.0
#: Relative slack of the leader's and the followers' reach test (:func:`min_steps_of`): a plan's deadlines are unix
#: seconds (~1.7e9, an ulp of 2.4e-7 s), so the exchange window a follower reads back differs from the leader's by
#: that much; the leader raises a peer whose floor ends within (1 + this) x the window and grace, a follower asks
#: for it only where it ends within (1 - this) x.
FLOOR_REACH_SLACK = 1e-6


def floor_grace_of(window_s: float, exchange_s: float) -> float:
    """Seconds past the train deadline the token floor's steps may run (``round.steps.floor_grace_s``, the trainer's
    ``floor_grace_s``): ``FLOOR_GRACE_WINDOWS`` x the plan's ``window_s``, at most ``FLOOR_GRACE_EXCHANGE_SHARE`` x
    its exchange window ``exchange_s`` (seconds, train deadline to exchange deadline; negative counts 0)."""
    return min(FLOOR_GRACE_WINDOWS * float(window_s), FLOOR_GRACE_EXCHANGE_SHARE * max(0.0, float(exchange_s)))


def plan_floor_grace_s(plan: RoundPlan) -> float:
    """:func:`floor_grace_of` of ``plan``'s window and exchange window."""
    return floor_grace_of(plan.window_s, float(plan.exchange_deadline) - float(plan.train_deadline))


def min_steps_of(
    cfg: PlanConfig,
    *,
    round: int,
    mode: str,
    probation: bool,
    batch_size: int,
    step_s: Optional[float] = None,
    comm_s: float = 0.0,
    reach_s: Optional[float] = None,
    slack: float = 0.0,
    median_batch: Optional[int] = None,
) -> int:
    """The fewest inner steps an AWB leader plans for a peer of round ``round`` (the plan's ``mode``, the peer marked
    ``probation``, at ``batch_size`` sequences a step): ``cfg.min_inner_steps``, and for a contributor that round's
    screen covers (relay and accountable rounds of a sign-compressed method: :func:`~geomesh_p2p.trust.verify_task.
    screened_in_round`) the steps its loss-gain test needs to decide (:func:`~geomesh_p2p.trust.verify_task.
    screen_steps`: ``gain_min_tokens`` in whole steps, at least ``min_steps``), at most ``cfg.max_inner_steps`` --
    unless, with ``step_s`` given (seconds a step; ``comm_s`` its exchange, ``reach_s`` the window plus the floor's
    grace, :func:`floor_grace_of`), those steps end past ``(1 + slack) x reach_s``, or with ``median_batch`` given
    (the plan's lower-median batch, sequences) ``batch_size`` is over it: then ``cfg.min_inner_steps``. A function of
    the plan and the run config alone: every follower recomputes it (``check_plan``).

    Why (session 45): the contribution of a screened peer planned under the gain test's floor counted in the
    aggregate and could never be decided; planned these steps, its claim must reach the floor to count
    (``round.rules.spec.screen_token_floor``). The reach test (red team of session 45): a floor the deadline and grace
    cannot reach counts every honest claim 0; a fixed 20 s window of 3 steps of 6 s planned every peer 7 steps (42 s
    against 22 s): every screened round aggregated nothing. Such a peer keeps its window's steps (under the floor,
    undecided, as before session 45). The median batch (same red team): the raise is exempt from every budget cap,
    and ``min_steps`` (5) steps of a batch at the spread cap (64x the median with 8 ranks) are no floor of the gain
    test's but 5x the step that ``round.rules.spec.screen_token_cap`` caps under ``min_steps`` steps: a newcomer
    on probation announcing batch 512 against the others' 8 was planned 5 steps, 81,920 tokens, 89 % of the round's
    (1 step counted as 256 tokens before). A peer over the median batch keeps its caps' steps, as before."""
    k = int(cfg.min_inner_steps)
    if cfg.method in COMPRESSED_METHODS and mode in SCREENED_MODES:
        screen = screen_steps(
            VerifyConfig(), round=round, probation=probation, batch_size=batch_size, seq_len=cfg.seq_len
        )
        k = max(k, min(screen, int(cfg.max_inner_steps)))
    if k > cfg.min_inner_steps and median_batch is not None and int(batch_size) > int(median_batch):
        return int(cfg.min_inner_steps)
    if k > cfg.min_inner_steps and step_s is not None and reach_s is not None:
        if comm_s + k * step_s > reach_s * (1 + slack):
            return int(cfg.min_inner_steps)
    return k


def plan_min_steps(a: PeerAssignment, cfg: PlanConfig, plan: RoundPlan, *, strict: bool = False) -> int:
    """:func:`min_steps_of` for assignment ``a`` of ``plan``, at the plan's own times for it (its stated step and
    exchange seconds). ``strict`` (the step range's lower bound: refuse fewer) asks for the floor only where it ends
    ``FLOOR_REACH_SLACK`` within the window and grace, else (the caps' exemptions) grants it up to that much past
    them: either way an honest leader's rounding (the deadlines' unix seconds) never refuses its plan. A rogue leader may state a step up to ``UNDER_PLAN_TOLERANCE``
    x slower than the record (:func:`compute_problem`) and so drop the floor of a peer whose floor steps take over
    half the window and grace: a small contribution, undecided as before session 45."""
    step_s = a.predicted_compute_s / a.inner_steps if a.inner_steps > 0 else None
    return min_steps_of(
        cfg,
        round=plan.round,
        mode=plan.mode,
        probation=a.probation,
        batch_size=a.batch_size,
        step_s=step_s,
        comm_s=a.predicted_comm_s,
        reach_s=plan.window_s + plan_floor_grace_s(plan),
        slack=-FLOOR_REACH_SLACK if strict else FLOOR_REACH_SLACK,
        median_batch=statistics.median_low([int(x.batch_size) for x in plan.assignments]),
    )


def min_steps_tokens(a: PeerAssignment, cfg: PlanConfig, plan: RoundPlan) -> int:
    """Tokens of the fewest steps of assignment ``a``'s own batch the leader plans for it (:func:`plan_min_steps`:
    ``min_inner_steps``, more for a contributor its round screens): a budget every throughput ceiling accepts, as
    the median rule does. The leader gives a peer at least that many steps (:func:`~geomesh_p2p.plan.cost.
    inner_steps`, :func:`~geomesh_p2p.plan.awb.plan_round`) even where the window, capped at ``cfg.max_window_s``,
    holds fewer (the train deadline then stops it early, a screened peer's token floor a grace later): with a
    minimum of 5 steps (issue 28's screened minimum, tried in session 33 and not on by default), a slow peer the
    exclusion rule keeps (never fewer than 2 peers) was over the throughput ceiling, and every follower, the leader
    too, refused every honest plan of that swarm (tests/unit/test_planner.py)."""
    return plan_min_steps(a, cfg, plan) * int(a.batch_size) * cfg.seq_len


def accumulation_problem(a: PeerAssignment, record: PeerRecord, cfg: PlanConfig) -> Optional[str]:
    """Why assignment ``a``'s accumulation steps are not those of its micro-batch for the target batch of
    ``record``'s K devices (``cfg.target_batch`` x K: a floor per device), or None. A :class:`ContentRefusal` only
    where no K of a record (1..``MAX_RANKS``) gives them; else plain: K is the follower's record's, and a follower
    whose record of the peer was one announcement older bypassed the plan the others followed (red team 53a)."""
    target = cfg.target_batch * ranks_of(record)
    if a.accum_steps == accum_steps_for(a.micro_batch, target):
        return None
    reason = (
        f"{a.peer_id[:10]} accumulates {a.accum_steps} micro-batches of {a.micro_batch}; target batch {target} "
        f"means {accum_steps_for(a.micro_batch, target)}"
    )
    ks = range(1, MAX_RANKS + 1)
    return (
        reason
        if any(a.accum_steps == accum_steps_for(a.micro_batch, cfg.target_batch * k) for k in ks)
        else (ContentRefusal(reason))
    )


def uniform_micro_problem(a: PeerAssignment, record: PeerRecord, cfg: PlanConfig, balanced: bool) -> Optional[str]:
    """Why a uniform method's micro-batch for assignment ``a`` is over the most any uniform plan gives ``record``'s
    peer (``rank_micro(peer_uniform_micro(cfg.target_batch, record))``: the plan's per-device micro-batch is at most
    the target batch, :func:`~geomesh_p2p.plan.cost.uniform_micro`), or None (always for AWB: ``balanced``). A light
    follower's check of a sampled record, which cannot recompute that per-device micro-batch (the least of every
    record's); plain, as the full check's equality (red team 53b: a one-device accomplice announcing max_batch 64 got
    2 steps of 16 rows, twice the median, and the light followers that read its record followed)."""
    most = rank_micro(peer_uniform_micro(cfg.target_batch, record), record)
    if balanced or a.micro_batch <= most:
        return None
    return (
        f"{a.peer_id[:10]} gets micro-batch {a.micro_batch}; method {cfg.method} gives it at most {most} (the target "
        f"batch {cfg.target_batch} per device)"
    )


def throughput_problem(
    a: PeerAssignment, record: PeerRecord, cfg: PlanConfig, plan: RoundPlan, balanced: bool, basis: str
) -> Optional[str]:
    """Why assignment ``a``'s token budget cannot be trained in ``plan``'s window ``T`` (seconds), or None: over
    ``RECORD_VIEW_TOLERANCE`` x ``record``'s best tokens/s x ``T``, or (``balanced``: AWB; uniform methods fix the
    micro-batch) over the same at its tokens/s *at the planned micro-batch*, unless it is its fewest steps
    of its batch (:func:`min_steps_tokens`). ``basis`` names the record in the reason ("its record").
    View-dependent: a plain reason.

    The tolerance is the most a record grows in one update (session 38: at ``PLAN_CHECK_TOLERANCE`` 1.5 a follower
    whose read of a peer was one update older than the leader's refused 22 of 400 honest swarms; an honest leader
    plans ``floor((T - c) / s)`` steps at the step time of its newer read, under 2 x the older rate x ``T``). A
    record falls at most ``MAX_TPS_DROP_PER_UPDATE`` (1.4) x per update, under it too.

    The micro-batch bound is red team 36's B1: a rogue leader planned honest peers at micro-batch 1 x 32
    accumulation steps with the budgets their best micro-batch fits; at 0.21x the speed the deadline stopped them at
    a fifth of it, and the leader and its partner took 79 % of the round's tokens (41.5 % honest)."""
    T = plan.window_s
    floor = min_steps_tokens(a, cfg, plan)
    ceiling = max(RECORD_VIEW_TOLERANCE * record.best_tokens_per_s() * T, floor)
    if a.token_budget > ceiling:
        return f"token budget {a.token_budget} for {a.peer_id[:10]} exceeds the {ceiling:.0f} {basis} supports in {T:.3g} s"
    if not balanced:
        return None
    try:
        rate = interpolate_tokens_per_s(record.tokens_per_s, a.micro_batch)
    except ValueError:
        return None  # no measured throughput: the record checks refuse it
    ceiling = max(RECORD_VIEW_TOLERANCE * rate * T, floor)
    if a.token_budget <= ceiling:
        return None
    return (
        f"token budget {a.token_budget} for {a.peer_id[:10]} at micro-batch {a.micro_batch} exceeds the "
        f"{ceiling:.0f} its record's {rate:.0f} tokens/s at that micro-batch supports in {T:.3g} s (a micro-batch "
        "that slow trains a fraction of the budget by the deadline)"
    )


def compute_problem(a: PeerAssignment, record: PeerRecord, lowest: Optional[float], basis: str) -> Optional[str]:
    """Why the rate assignment ``a`` implies (``token_budget / predicted_compute_s``, tokens/s) is not one an honest
    leader plans with, or None. The next round's delivered map is that rate (every reader computes ``delivered /
    predicted_compute_s``, :meth:`~geomesh_p2p.round.rules.profiling.Reprofiler.delivered_rates`), so it must lie
    where an honest leader's does: at most ``RECORD_VIEW_TOLERANCE`` x ``record``'s tokens/s at the planned
    micro-batch (the leader's read one update newer), and at least the smaller of that rate over
    ``UNDER_PLAN_TOLERANCE`` (one update older) and ``lowest`` (tokens/s: the lowest delivered-work ceiling the leader
    may plan the peer at, :func:`~geomesh_p2p.plan.bounds.evidence_ceiling_range`; None: no evidence; 0: any).
    An honest plan's rate is the record's at that micro-batch, or the evidence ceiling where that is lower
    (:func:`~geomesh_p2p.plan.awb.plan_round`). View-dependent: a plain reason; ``basis`` names the record.

    Red team 38: the rate was unchecked. A rogue leader that stated its partner's compute as 1 us gave it a delivered
    rate of 1.2e12 tokens/s, and the next honest leader planned it at the 8x median cap (36 % -> 67 % of the round's
    tokens, at once instead of after two rounds of doubling); one that stated three victims' compute as 1e9 s left
    them a delivered rate of 5e-4 tokens/s, and the next 25 honest leaders planned them at one step (leader and
    partner 41.5 % -> 84.2 % of each round's tokens)."""
    if a.token_budget == 0 and a.predicted_compute_s == 0:
        return None  # no steps planned: no rate implied (the delivered map skips a zero compute)
    try:
        rate = interpolate_tokens_per_s(record.tokens_per_s, a.micro_batch)
    except ValueError:
        return None  # no measured throughput: the record checks refuse it
    implied = a.token_budget / a.predicted_compute_s if a.predicted_compute_s > 0 else math.inf
    low = rate / UNDER_PLAN_TOLERANCE if lowest is None else min(rate / UNDER_PLAN_TOLERANCE, lowest)
    if low * (1 - 1e-6) <= implied <= RECORD_VIEW_TOLERANCE * rate * (1 + 1e-6):
        return None
    return (
        f"{a.peer_id[:10]}'s predicted compute {a.predicted_compute_s:.4g} s for {a.token_budget} tokens is "
        f"{implied:.4g} tokens/s, outside the {low:.4g}..{RECORD_VIEW_TOLERANCE * rate:.4g} {basis} gives at "
        f"micro-batch {a.micro_batch} (the next round's delivered rate is that figure)"
    )


def compute_problems(
    plan: RoundPlan,
    cfg: PlanConfig,
    balanced: bool,
    records: Mapping[str, PeerRecord],
    lowest: Mapping[str, Optional[float]],
    basis: str,
) -> Optional[str]:
    """The first :func:`compute_problem` of ``plan``'s participants with a record in ``records`` (``lowest``: peer id
    -> its ``lowest``, :func:`lowest_ceilings`), after, for AWB plans (``balanced``) and every participant, a predicted compute over
    the window at more than its fewest steps (:func:`plan_min_steps`): AWB fits ``floor((T - c) / s)`` steps and its caps only lower
    them, so only the raised minimum runs past the window (plan and config alone; a light follower's lower bound on
    the rate of the participants it did not sample)."""
    if balanced:
        for a in plan.assignments:
            if a.inner_steps > plan_min_steps(a, cfg, plan) and a.predicted_compute_s > plan.window_s * (1 + 1e-6):
                return (
                    f"{a.peer_id[:10]}'s predicted compute {a.predicted_compute_s:.4g} s of {a.inner_steps} steps "
                    f"exceeds the {plan.window_s:.3g} s window"
                )
    for a in plan.assignments:
        r = records.get(a.peer_id)
        reason = None if r is None else compute_problem(a, r, lowest.get(a.peer_id), basis)
        if reason is not None:
            return reason
    return None


def lowest_ceilings(
    plan: RoundPlan,
    supported: Optional[Mapping[str, float]],
    unseen: Optional[Mapping[str, float]],
    balanced: bool,
    late: Optional[Mapping[str, float]] = None,
) -> dict[str, Optional[float]]:
    """peer id -> the ``lowest`` of :func:`compute_problem` for each participant of ``plan``: the lowest delivered-work
    ceiling (tokens/s) of :func:`~geomesh_p2p.plan.bounds.evidence_ceiling_range`. Without a usable map at this
    follower 0 (the leader may hold one: this follower sat the last round out, or missed every part listing a rate),
    but in round 0 (nobody holds one) and for uniform methods (no evidence planning) None."""
    if not balanced:
        return {p: None for p in plan.participants()}
    ranges = evidence_ceiling_range(plan.participants(), supported, unseen, late)
    if ranges:
        return {p: lo for p, (lo, _) in ranges.items()}
    return {p: None if plan.round == 0 else 0.0 for p in plan.participants()}


def link_slowdown(record: PeerRecord, a: Optional[PeerAssignment], cfg: PlanConfig) -> float:
    """Factor (1 to ``UNDER_PLAN_LINK_TOLERANCE``) to divide ``record``'s bandwidths by so that its exchange takes
    the ``predicted_comm_s`` its assignment ``a`` states (seconds; 1 without ``a`` or when the record's is longer):
    what the leader's read of the record implies, within one link update of the follower's (red team 36, F1)."""
    return min(UNDER_PLAN_LINK_TOLERANCE, max(1.0, 1.0 / link_speedup(record, a, cfg)))


def link_speedup(record: PeerRecord, a: Optional[PeerAssignment], cfg: PlanConfig) -> float:
    """Factor (``1 / UNDER_PLAN_LINK_TOLERANCE`` to ``UNDER_PLAN_LINK_TOLERANCE``) to multiply ``record``'s
    bandwidths by so that its exchange (less the latency) takes the ``predicted_comm_s`` its assignment ``a``
    states: the link figures of the leader's read, within one update of the follower's (a first link sample moves a
    figure up to ``link_step_ratio`` = 4 x either way, a later one up to 1.9 x up and 1.29 x down through the EMA).
    1 without ``a`` or without a network part."""
    if a is None:
        return 1.0
    fixed = 2 * cfg.latency_s
    mine, stated = comm_time(record, cfg) - fixed, a.predicted_comm_s - fixed
    if mine <= 0 or stated <= 0:
        return 1.0
    return min(UNDER_PLAN_LINK_TOLERANCE, max(1.0 / UNDER_PLAN_LINK_TOLERANCE, mine / stated))


def records_at_stated_links(plan: RoundPlan, records: Sequence[PeerRecord], cfg: PlanConfig) -> list[PeerRecord]:
    """``records`` (same order) with each participant's link figures moved (by :func:`link_speedup`, at most
    ``UNDER_PLAN_LINK_TOLERANCE`` x either way) to the exchange time ``plan`` states for it: the view of the links
    the leader planned from when it read a record one link update apart from this follower's (session 38: a slow
    link that doubled moved a window it stretches past the window's 1.5 x tolerance, 37 of 400 honest swarms). The
    follower recomputes the reference window from these too."""
    assigned: Mapping[str, PeerAssignment] = {a.peer_id: a for a in plan.assignments}
    out = []
    for r in records:
        k = link_speedup(r, assigned.get(r.peer_id), cfg)
        out.append(
            r if k == 1.0 else r.model_copy(update={"upload_bps": r.upload_bps * k, "download_bps": r.download_bps * k})
        )
    return out
