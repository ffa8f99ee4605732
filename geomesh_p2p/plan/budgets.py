"""A plan's token budgets, probation marks and part ownership against the bounds a follower checks (issue 11, issue
12, issue 30: per device), from the plan and the follower's records: the budget, probation and ownership parts of
:func:`~geomesh_p2p.plan.planner.check_plan` and :func:`~geomesh_p2p.plan.planner.check_plan_sampled`, and the
participants whose records a light follower must read for them (:func:`~geomesh_p2p.plan.planner.records_needed`).
Split out of planner.py (session 53) at its 800-line cap; planner imports each under its former name.
"""

from __future__ import annotations

import statistics
from typing import Collection, Mapping, Optional

from geomesh_p2p.plan.bounds import (
    BOUND_RANKS_MAX,
    BUDGET_MEDIAN_FACTOR,
    PLAN_CHECK_TOLERANCE,
    bound_ranks,
    budget_limit,
    follower_owner_count,
    max_token_share,
    probation_limit,
)
from geomesh_p2p.plan.schema import ContentRefusal, PlanConfig, RoundPlan
from geomesh_p2p.plan.views import min_steps_tokens
from geomesh_p2p.schema.partition import OWNER_SHARE_FACTOR, max_owner_units
from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR, probation_slots


def over_budget(plan: RoundPlan, cfg: PlanConfig, ranks: Mapping[str, int], floors: bool = True) -> dict[str, str]:
    """peer id -> why its budget breaks the plan's own bounds (see :func:`check_plan`): over
    :func:`budget_limit` of the plan's lower-median budget, or over :func:`max_token_share` of the total, each
    per device (``ranks``: peer id -> K; a peer not in it counts as one device), unless the budget is
    ``min_inner_steps`` steps of its batch (``floors``; without, :func:`records_needed`, that exemption too)."""
    budgets = [a.token_budget for a in plan.assignments]
    median = statistics.median_low(budgets)
    total = sum(budgets)
    out: dict[str, str] = {}
    for a in plan.assignments:
        who, k = a.peer_id[:10], ranks.get(a.peer_id, 1)
        limit, share = budget_limit(median, k), max_token_share(len(budgets), k)
        floor = min_steps_tokens(a, cfg, plan) if floors else 0
        devices = f" ({k} ranks)" if k > 1 else ""
        if a.token_budget > max(limit, floor):
            out[a.peer_id] = (
                f"token budget {a.token_budget} for {who}{devices} is over {limit / median if median else BUDGET_MEDIAN_FACTOR * k:g}x the plan's median "
                f"budget ({median:.0f})"
            )
        elif a.token_budget > floor and a.token_budget > share * total * (1 + 1e-12):
            out[a.peer_id] = (
                f"{who}{devices} holds {a.token_budget / total:.0%} of the round's tokens, over the {share:.0%} bound"
            )
    return out


def budget_problem(plan: RoundPlan, cfg: PlanConfig, ranks: Mapping[str, int]) -> Optional[str]:
    """Budgets against the plan's own median and the largest share, per device (see :func:`check_plan`)."""
    return next(iter(over_budget(plan, cfg, ranks).values()), None)


def ownership_problem(plan: RoundPlan, cfg: PlanConfig, possible: set, barred: Collection[str]) -> Optional[str]:
    """Each owner's share of the vector against a fair share among ``possible`` owners (see :func:`check_plan`)."""
    # The leader may bar owners this follower does not (an owner penalty it saw and this follower did not,
    # e.g. while it was syncing): from 4 possible owners on, a minority of them is accepted as the leader's
    # call, so honest views that differ do not refuse honest plans, while a rogue leader still cannot make
    # itself sole owner (each owner stays under ~2 OWNER_SHARE_FACTOR / n of the vector).
    unowned = possible - {pid for pid, _, _ in plan.owners()}
    n_owners = follower_owner_count(len(possible), len(unowned), len(unowned & set(barred)))
    units = -(-plan.numel // cfg.part_align)
    cap = max_owner_units(units, n_owners) * cfg.part_align
    for pid, start, end in plan.owners():
        if end - start > cap:
            return (
                f"{pid[:10]} owns {end - start} of {plan.numel} elements, over the {cap} bound "
                f"({OWNER_SHARE_FACTOR:g}x a fair share among {n_owners} owners)"
            )
    return None


def probation_problem(plan: RoundPlan, cfg: PlanConfig, ranks: Mapping[str, int]) -> Optional[str]:
    """Count, ownership and budgets of the participants ``plan`` marks as on probation (see check_plan). The count
    and the ownership follow from the plan and ``cfg`` alone: a ContentRefusal (honest followers bypass the plan).
    The budget bound is per device (:func:`over_probation`)."""
    marked = [a for a in plan.assignments if a.probation]
    if not marked:
        return None
    est = [a for a in plan.assignments if not a.probation]
    if not est:
        return ContentRefusal("it marks every participant as on probation")
    slots = probation_slots(len(est))
    if len(marked) > slots:
        return ContentRefusal(
            f"it plans {len(marked)} peers on probation with {len(est)} established; at most {slots} may join a round"
        )
    for a in marked:
        if a.owns_part:
            return ContentRefusal(f"{a.peer_id[:10]} is on probation and owns a part")
    return next(iter(over_probation(plan, cfg, ranks).values()), None)


def over_probation(plan: RoundPlan, cfg: PlanConfig, ranks: Mapping[str, int], floors: bool = True) -> dict[str, str]:
    """peer id -> why the budget of a participant ``plan`` marks as on probation is over ``PLAN_CHECK_TOLERANCE x``
    :func:`probation_limit` of the established participants' lower-median budget, unless it is its fewest steps.
    Per device (``ranks``: peer id -> K from this follower's records, 1 for a peer not in it), as the median cap:
    a plain reason (views of K differ: red team 53a; a light follower reads the record: :func:`records_needed`),
    a :class:`ContentRefusal` only over the bound of ``BOUND_RANKS_MAX`` devices, which no record lifts. A leader
    leaves such a newcomer out (``PlanRules.build_plan``: a uniform method plans K devices' rows, K up to 64)."""
    est = [a.token_budget for a in plan.assignments if not a.probation]
    if not est:
        return {}
    median = statistics.median_low(est)
    out: dict[str, str] = {}
    for a in plan.assignments:
        if not a.probation:
            continue
        k = ranks.get(a.peer_id, 1)
        floor = min_steps_tokens(a, cfg, plan) if floors else 0  # floors False: records_needed (as over_budget)
        if a.token_budget > max(PLAN_CHECK_TOLERANCE * probation_limit(median, k), floor):
            devices = f" ({k} ranks)" if k > 1 else ""
            reason = (
                f"token budget {a.token_budget} for {a.peer_id[:10]}{devices} (on probation) is over "
                f"{PROBATION_BUDGET_FACTOR * bound_ranks(k):g}x the established peers' median budget ({median})"
            )
            anyone = max(
                PLAN_CHECK_TOLERANCE * probation_limit(median, BOUND_RANKS_MAX), min_steps_tokens(a, cfg, plan)
            )
            out[a.peer_id] = ContentRefusal(reason) if a.token_budget > anyone else reason  # any record's K: content
    return out
