"""Where a follower's view of the records may differ from the leader's, and by how much (sessions 36-38).

A follower checks a plan (:func:`~geomesh_p2p.plan.planner.check_plan`) against the records *it* read, and a
record changes between two reads by at most one re-profiling update (:mod:`geomesh_p2p.round.rules.profiling`):
tokens/s up ``MAX_TPS_GROWTH_PER_UPDATE`` (2) x or down ``MAX_TPS_DROP_PER_UPDATE`` (1.4) x, each link figure by
``link_step_ratio`` (4) x either way. The bounds here hold an honest leader's plan made from a record one update
newer or older than the follower's; a rogue leader may use the same slack (docs/security.md, "Session 38").
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from geomesh_p2p.plan.bounds import RECORD_VIEW_TOLERANCE, UNDER_PLAN_LINK_TOLERANCE
from geomesh_p2p.plan.cost import comm_time, interpolate_tokens_per_s
from geomesh_p2p.plan.schema import PeerAssignment, PlanConfig, RoundPlan
from geomesh_p2p.schema.peer import PeerRecord


def min_steps_tokens(a: PeerAssignment, cfg: PlanConfig) -> int:
    """Tokens of ``min_inner_steps`` steps of assignment ``a``'s own batch: a budget every throughput ceiling
    accepts, as the median rule does. The leader gives a peer at least that many steps
    (:func:`~geomesh_p2p.plan.cost.inner_steps`) even where the window, capped at ``cfg.max_window_s``, holds
    fewer (the train deadline then stops it early): with a minimum of 5 steps (issue 28's screened minimum, tried
    in session 33 and not on by default), a slow peer the exclusion rule keeps (never fewer than 2 peers) was over
    the throughput ceiling, and every follower, the leader too, refused every honest plan of that swarm
    (tests/unit/test_planner.py)."""
    return cfg.min_inner_steps * int(a.batch_size) * cfg.seq_len


def throughput_problem(
    a: PeerAssignment, record: PeerRecord, cfg: PlanConfig, T: float, balanced: bool, basis: str
) -> Optional[str]:
    """Why assignment ``a``'s token budget cannot be trained in the window ``T`` (seconds), or None: over
    ``RECORD_VIEW_TOLERANCE`` x ``record``'s best tokens/s x ``T``, or (``balanced``: AWB; uniform methods fix the
    micro-batch) over the same at its tokens/s *at the planned micro-batch*, unless it is ``min_inner_steps`` steps
    of its batch (:func:`min_steps_tokens`). ``basis`` names the record in the reason ("its record").
    View-dependent: a plain reason.

    The tolerance is the most a record grows in one update (session 38: at ``PLAN_CHECK_TOLERANCE`` 1.5 a follower
    whose read of a peer was one update older than the leader's refused 22 of 400 honest swarms; an honest leader
    plans ``floor((T - c) / s)`` steps at the step time of its newer read, under 2 x the older rate x ``T``). A
    record falls at most ``MAX_TPS_DROP_PER_UPDATE`` (1.4) x per update, under it too.

    The micro-batch bound is red team 36's B1: a rogue leader planned honest peers at micro-batch 1 x 32
    accumulation steps with the budgets their best micro-batch fits; at 0.21x the speed the deadline stopped them at
    a fifth of it, and the leader and its partner took 79 % of the round's tokens (41.5 % honest)."""
    floor = min_steps_tokens(a, cfg)
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
