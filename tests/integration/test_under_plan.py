"""Session 36: a leader that under-plans honest peers (red team of session 34, #3; docs/security.md).

A rogue leader planned its partner at 4 inner steps and every honest peer at 1, all else valid, and every follower
accepted it (steps were bounded below by ``min_inner_steps`` only): the partner held most of the round's weight.
Followers now refuse a participant planned under ``1 / tolerance`` of what it fits in the plan's window when no cap
of the plan explains it (``planner._under_plan_problem``): from the plan's own predicted times (a ContentRefusal)
and from the bounded records at the delivered-work ceilings (a view-dependent reason).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geomesh_p2p.model.capability import MAX_TPS_GROWTH_PER_UPDATE
from geomesh_p2p.plan.bounds import UNDER_PLAN_TOLERANCE, bound_records
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled, make_plan, records_needed
from geomesh_p2p.plan.schema import ContentRefusal, RoundPlan
from geomesh_p2p.trust.probation import probation_slots
from tests.integration.test_plan_bounds import KW, T0, by_id, honest_swarms, node_configs, paper_cfg, rec

pytestmark = pytest.mark.timeout(120)

NUMEL = 150_000_000


def five_peers():
    """Five GPUs within 20% of each other, 800 Mbit/s each: at a 3 s window each fits 4 steps of 64 (p2 7 of 32)."""
    return [rec(f"p{i}", 160_000 * f, 64, 800) for i, f in enumerate((1.0, 0.9, 0.8, 0.85, 0.95))]


def delivered(recs):
    """Delivered rates (tokens/s) of peers that trained what they were planned: their best announced figures."""
    return {r.peer_id: r.best_tokens_per_s() for r in recs}


def red_team(honest: RoundPlan, partner: str, *, covered: bool) -> RoundPlan:
    """Session 34's rogue plan: ``partner`` at 4 inner steps, every other participant at 1, all else valid (budgets
    consistent, window, ownership and deadlines the honest plan's). ``covered``: the leader also states each
    under-planned step as filling the window (predicted compute ``window - comm``, no idle), so the plan's own
    figures look full; otherwise it keeps the true step time (and so the idle of the steps it took away)."""
    out = []
    for a in honest.assignments:
        d = a.model_dump()
        h = 4 if a.peer_id == partner else 1
        step_s = a.predicted_compute_s / a.inner_steps
        compute = honest.window_s - a.predicted_comm_s if covered and h == 1 else h * step_s
        d.update(
            inner_steps=h,
            token_budget=h * a.batch_size * honest.seq_len,
            predicted_compute_s=compute,
            predicted_idle_s=max(0.0, honest.window_s - compute - a.predicted_comm_s),
        )
        out.append(d)
    return RoundPlan.model_validate({**honest.model_dump(), "assignments": out})


def test_the_red_team_plan_is_refused_by_the_full_and_the_sampled_check():
    recs, cfg = five_peers(), paper_cfg(window_s=3.0)
    honest = make_plan(recs, cfg, numel=NUMEL, **KW)
    assert [a.inner_steps for a in honest.assignments] == [4, 4, 7, 4, 4]
    supported = delivered(recs)
    assert check_plan(honest, by_id(recs), cfg, now=T0, supported=supported) is None
    assert check_plan_sampled(honest, by_id(recs[:2]), cfg, now=T0, supported=supported) is None

    # the plan's own times show the steps taken away: every follower refuses it for its content, evidence or not
    naive = red_team(honest, "p1", covered=False)
    assert [a.inner_steps for a in naive.assignments] == [1, 4, 1, 1, 1]
    for reason in (
        check_plan(naive, by_id(recs), cfg, now=T0),
        check_plan(naive, by_id(recs), cfg, now=T0, supported=supported),
        check_plan_sampled(naive, {}, cfg, now=T0),
    ):
        assert isinstance(reason, ContentRefusal), reason
        assert reason.startswith("p0 gets 1 inner steps (65536 tokens)") and "own predicted times" in reason, reason

    # times that cover it: the records at the delivered rates show it (a view-dependent refusal)
    covered = red_team(honest, "p1", covered=True)
    reason = check_plan(covered, by_id(recs), cfg, now=T0, supported=supported)
    assert reason is not None and not isinstance(reason, ContentRefusal)
    assert reason.startswith("p0 gets 1 inner steps (65536 tokens), under the 131072 its record at 1/2"), reason
    # a light follower that sampled an under-planned peer refuses it, naming it; one that sampled the partner only
    # sees nothing wrong with the partner (4 steps is its fit)
    reason = check_plan_sampled(covered, by_id([recs[2]]), cfg, now=T0, supported=supported)
    assert reason is not None and reason.startswith("p2 gets 1 inner steps (32768 tokens)"), reason
    assert check_plan_sampled(covered, by_id([recs[1]]), cfg, now=T0, supported=supported) is None


def test_a_participant_planned_at_half_its_fit_passes_and_under_half_is_refused():
    """The tolerance, in real values: p0 fits 9 steps of 64 at a 5 s window, 4 at half its tokens/s (262,144
    tokens); 4 steps plus one step of slack is 5 (over 4: accepted), 3 steps is 4 (not over: refused)."""
    recs, cfg = five_peers(), paper_cfg(window_s=5.0)
    honest = make_plan(recs, cfg, numel=NUMEL, **KW)
    a0 = honest.assignment("p0")
    assert (a0.inner_steps, a0.batch_size) == (9, 64)
    supported = delivered(recs)

    def at(h):
        d = {**a0.model_dump(), "inner_steps": h, "token_budget": h * 64 * 1024}
        # its steps at half the record's rate (a leader one update older; covering the whole window would state a
        # rate under that, refused since red team 38 as the next round's delivered rate)
        step_s = a0.predicted_compute_s / a0.inner_steps
        d["predicted_compute_s"] = min(honest.window_s - a0.predicted_comm_s, 2 * h * step_s)
        d["predicted_idle_s"] = 0.0
        rest = [a.model_dump() for a in honest.assignments if a.peer_id != "p0"]
        return RoundPlan.model_validate({**honest.model_dump(), "assignments": [d] + rest})

    assert check_plan(at(4), by_id(recs), cfg, now=T0, supported=supported) is None
    reason = check_plan(at(3), by_id(recs), cfg, now=T0, supported=supported)
    assert reason is not None and reason.startswith("p0 gets 3 inner steps (196608 tokens), under the 262144")


def test_honest_plans_whose_caps_lower_a_peer_pass():
    """A peer legitimately planned under its window's fit: its delivered work (a tenth of its record), probation
    (a fast newcomer at the established median), a slow device (1 step), the 8x median cap (a peer 8x faster
    with 8x the memory). Each is lowered in the honest plan, and the plan passes both checks with the evidence."""
    cfg = paper_cfg(window_s=5.0)
    base = five_peers()
    supported = delivered(base)
    uncapped = make_plan(base, cfg, numel=NUMEL, **KW)

    # delivered work: p2 delivered a tenth of its figure
    low = {**supported, "p2": supported["p2"] / 10}
    plan = make_plan(base, cfg, numel=NUMEL, supported_tokens_per_s=low, **KW)
    assert (uncapped.assignment("p2").inner_steps, plan.assignment("p2").inner_steps) == (7, 1)
    assert check_plan(plan, by_id(base), cfg, now=T0, supported=low) is None
    assert check_plan_sampled(plan, by_id([base[2]]), cfg, now=T0, supported=low) is None

    # probation: p5, twice as fast as the others, planned at the established peers' median budget
    fast = base + [rec("p5", 320_000, 64, 800)]
    sup = delivered(fast)
    free = make_plan(fast, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    plan = make_plan(fast, cfg, numel=NUMEL, supported_tokens_per_s=sup, probation=["p5"], **KW)
    assert (free.assignment("p5").inner_steps, plan.assignment("p5").inner_steps) == (18, 8)
    assert check_plan(plan, by_id(fast), cfg, now=T0, supported=sup) is None
    assert check_plan_sampled(plan, by_id([fast[5]]), cfg, now=T0, supported=sup) is None

    # a slow device: one step is what it fits
    slow = base + [rec("p6", 160_000 * 0.07, 16, 800, batches=(4, 8, 16))]
    sup = delivered(slow)
    plan = make_plan(slow, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    assert plan.assignment("p6").inner_steps == 1
    assert check_plan(plan, by_id(slow), cfg, now=T0, supported=sup) is None
    assert check_plan_sampled(plan, by_id([slow[5]]), cfg, now=T0, supported=sup) is None

    # the 8x median cap: small-memory peers at batch 8, one 8x faster peer with 8x their memory
    small = [rec(f"s{i}", 20_000, 8, 800, batches=(4, 8)) for i in range(4)] + [rec("big", 160_000, 64, 800)]
    cfg8 = paper_cfg(window_s=20.0, target_batch=8)
    sup = delivered(small)
    plan = make_plan(small, cfg8, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    big, median = plan.assignment("big"), sorted(a.token_budget for a in plan.assignments)[2]
    assert big.token_budget <= 8 * median < (big.inner_steps + 1) * big.batch_size * 1024  # capped, not fit
    assert check_plan(plan, by_id(small), cfg8, now=T0, supported=sup) is None
    assert check_plan_sampled(plan, by_id([small[4]]), cfg8, now=T0, supported=sup) is None


def test_a_follower_that_read_records_one_update_faster_still_accepts_the_plan():
    """The leader planned from records one update older than the follower's: each figure the follower reads is
    MAX_TPS_GROWTH_PER_UPDATE (2x) the leader's. The leader's steps are then about half the follower's fit, within
    UNDER_PLAN_TOLERANCE."""
    assert UNDER_PLAN_TOLERANCE >= MAX_TPS_GROWTH_PER_UPDATE
    recs, cfg = five_peers(), paper_cfg(window_s=5.0)
    plan = make_plan(recs, cfg, numel=NUMEL, **KW)
    for grown in (["p0"], ["p0", "p2", "p4"], [r.peer_id for r in recs]):
        newer = [
            r.model_copy(update={"tokens_per_s": {b: 2 * v for b, v in r.tokens_per_s.items()}})
            if r.peer_id in grown
            else r
            for r in recs
        ]
        supported = delivered(newer)
        assert check_plan(plan, by_id(newer), cfg, now=T0, supported=supported) is None, grown
        assert check_plan_sampled(plan, by_id(newer), cfg, now=T0, supported=supported) is None, grown


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    recs=honest_swarms(),
    cfg_p=node_configs(),
    evidence=st.lists(st.floats(1.0, 1e6), min_size=12, max_size=12),
    seed=st.integers(0, 999),
    k=st.integers(0, 8),
    on_probation=st.integers(0, 3),
)
def test_honest_plans_with_evidence_and_probation_pass_both_checks_with_the_same_evidence(
    recs, cfg_p, evidence, seed, k, on_probation
):
    """Whatever honest records, run config, delivered-work evidence and probation marks, the leader's plan passes a
    follower holding the same evidence, full or light whatever it samples (the under-plan rule's records layer runs
    only with evidence)."""
    cfg, numel = cfg_p
    supported = {r.peer_id: e for r, e in zip(recs, evidence)}
    probation = [r.peer_id for r in recs[: min(on_probation, probation_slots(len(recs) - on_probation))]]
    try:
        plan = make_plan(recs, cfg, numel=numel, supported_tokens_per_s=supported, probation=probation, **KW)
    except ValueError:
        return  # probation left no owner: the node leaves them out (NoOwner) before planning
    assert check_plan(plan, by_id(recs), cfg, now=T0, supported=supported) is None
    # a light follower reads the records the plan alone cannot check besides its sample (a multi-rank peer's)
    needed = records_needed(plan, cfg)
    sample = random.Random(seed).sample(recs, min(k, len(recs))) + [r for r in recs if r.peer_id in needed]
    assert check_plan_sampled(plan, by_id(sample), cfg, now=T0, supported=supported) is None
    # and the bounded records are what the leader planned from (the follower's fit is the leader's)
    assert [r.peer_id for r in bound_records(sorted(recs, key=lambda r: r.peer_id))] == plan.participants()
