"""Red team of session 38's view tolerances: a rogue leader (with one partner, 1 of 5 here) against honest followers.

``predicted_compute_s`` was unchecked, and it is what every reader divides delivered tokens by for the next round's
delivered map (``Reprofiler.delivered_rates``, and ``unseen_rates``): fixed (``plan/views.compute_problem``), tests
below. The stated-link tolerance (4x) lets a rogue leader under-plan victims as an honest leader with slower
reads of their links would: open (xfail strict).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.plan.planner import check_plan, check_plan_sampled, make_plan
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round.rules.profiling import Reprofiler
from tests.integration.test_plan_bounds import KW, T0, by_id, paper_cfg, rec
from tests.integration.test_plan_views_redteam37 import NUMEL, random_swarm, share, with_budget
from tests.integration.test_under_plan_redteam36 import delivered, five_peers_small_batches, trained_tokens

pytestmark = pytest.mark.timeout(300)


def budgets(plan: RoundPlan) -> dict[str, int]:
    return {a.peer_id: a.token_budget for a in plan.assignments}


def next_map(plan: RoundPlan) -> dict[str, float]:
    """The delivered map every reader computes after ``plan`` when each participant claims its whole budget."""
    ar = SimpleNamespace(contributors={0: [(a.peer_id, a.token_budget) for a in plan.assignments]}, missing_parts=[])
    return Reprofiler.delivered_rates(plan, ar)


def with_compute(plan: RoundPlan, computes: dict[str, float]) -> RoundPlan:
    out = [
        a.model_copy(update={"predicted_compute_s": computes[a.peer_id], "predicted_idle_s": 0.0})
        if a.peer_id in computes
        else a
        for a in plan.assignments
    ]
    return plan.model_copy(update={"assignments": out})


def test_a_partner_stated_with_no_compute_time_is_refused():
    """FIXED (bypass of the delivered-work bound). Partner p0 announces 1e10 tokens/s (issue 28's claim; it delivered
    its real 160k): an honest plan gives it 18 steps (2x its delivered rate), 36 % of the round's tokens. Rogue leader
    p1 kept every budget and stated p0's compute as 1 us; every follower accepted it, and the next delivered map gave
    p0 1.2e12 tokens/s, so the next honest leader planned it at the 8x median cap: 66.7 % of the tokens at once (honest
    doubling from its delivered rate: 36 % -> 53.6 % -> 66.7 % over two rounds). Now the rate a plan implies must lie
    within what the record gives at the planned micro-batch (full check; a light follower that sampled p0)."""
    recs, cfg = five_peers_small_batches(), paper_cfg(window_s=5.0)
    view = [recs[0].model_copy(update={"tokens_per_s": {b: 1e10 for b in recs[0].tokens_per_s}})] + recs[1:]
    sup = delivered(recs)
    honest = make_plan(view, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    assert (honest.assignment("p0").inner_steps, share(budgets(honest), ["p0"])) == (18, 0.36)
    rogue = with_compute(honest, {"p0": 1e-6})
    # what the plan would have done: the next honest leader plans p0 at the 8x median cap
    after = make_plan(view, cfg, numel=NUMEL, supported_tokens_per_s=next_map(rogue), **KW)
    assert share(budgets(after), ["p0"]) == 0.667
    reason = check_plan(rogue, by_id(view), cfg, now=T0, supported=sup)
    assert str(reason).startswith("p0's predicted compute 1e-06 s for 1179648 tokens is 1.18e+12 tokens/s, outside")
    light = check_plan_sampled(rogue, {"p0": view[0]}, cfg, now=T0, supported=sup)
    assert str(light).startswith("p0's predicted compute 1e-06 s") and "its record gives" in str(light)
    assert check_plan_sampled(rogue, {"p2": view[2]}, cfg, now=T0, supported=sup) is None  # the sample's price


def test_victims_stated_with_overlong_compute_are_refused():
    """FIXED (bypass, lasting). Rogue leader p0 (partner p1) kept every budget and stated the three victims' compute as
    1e9 s: accepted, and the next delivered map gave them 5e-4 tokens/s. Each following honest leader planned them at
    one step (delivered work doubles per round from there): 25 rounds at 1 step of their 7-9, leader + partner 41.5 %
    -> 84.2 % of every round's tokens. Now the full check refuses the implied rate (under half the record's) and every
    light follower the compute over the window (plan alone)."""
    recs, cfg = five_peers_small_batches(), paper_cfg(window_s=5.0)
    sup = delivered(recs)
    honest = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    rogue = with_compute(honest, {p: 1e9 for p in ("p2", "p3", "p4")})
    after = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=next_map(rogue), **KW)
    assert [after.assignment(p).inner_steps for p in ("p2", "p3", "p4")] == [1, 1, 1]
    assert (share(budgets(honest), ["p0", "p1"]), share(budgets(after), ["p0", "p1"])) == (0.415, 0.842)
    assert check_plan(after, by_id(recs), cfg, now=T0, supported=next_map(rogue)) is None  # honest, given that map
    for reason in [check_plan(rogue, by_id(recs), cfg, now=T0, supported=sup)] + [
        check_plan_sampled(rogue, {r.peer_id: r}, cfg, now=T0, supported=sup) for r in recs
    ]:
        assert reason == "p2's predicted compute 1e+09 s of 7 steps exceeds the 4.97 s window", reason


def test_a_twice_the_record_budget_does_not_double_the_next_round():
    """BOUND HOLDS (repeated rounds). Session 38's 2x record tolerance (partner p0 at 22 steps, not 9) stated at the
    fastest rate the check accepts (2x the record at the planned micro-batch): the next delivered map gives p0 at most
    that, and the next honest leader plans it at its record's fit again (9 steps): no doubling from round to round."""
    recs, cfg = five_peers_small_batches(), paper_cfg(window_s=5.0)
    honest = make_plan(recs, cfg, numel=NUMEL, **KW)
    a = honest.assignment("p0")
    rogue = with_budget(honest, "p0", 22, a.batch_size * cfg.seq_len)
    assert check_plan(rogue, by_id(recs), cfg, now=T0) is None
    assert check_plan(with_budget(honest, "p0", 23, a.batch_size * cfg.seq_len), by_id(recs), cfg, now=T0)
    rate = next_map(rogue)["p0"]
    assert rate <= 2 * by_id(recs)["p0"].best_tokens_per_s()
    after = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=next_map(rogue), **KW)
    assert after.assignment("p0").inner_steps == 9


def test_honest_plans_from_other_views_pass_the_compute_check():
    """No false refusal of the new check: random honest swarms planned from a view one update apart (records 1/2-2x,
    links 1/4-4x at the leader, a leader's map lacking one rate) pass the full check and light checks of 3 samples.
    1,200 swarms of these and multi-rank / min-steps 3 / round 0 / uniform ones gave none on the helper's branch."""
    refused = []
    for seed in range(60):
        recs, cfg, sup, R = random_swarm(seed)
        lead, lmap = recs, sup
        kind = seed % 3
        if kind == 0:
            lead = [
                r.model_copy(
                    update={"tokens_per_s": {b: v * R.choice((0.5, 1.0, 2.0)) for b, v in r.tokens_per_s.items()}}
                )
                for r in recs
            ]
        elif kind == 1:
            lead = [r.model_copy(update={"upload_bps": r.upload_bps * R.choice((0.25, 1.0, 4.0))}) for r in recs]
        elif sup:
            lmap = {p: v for p, v in sup.items() if p != R.choice(sorted(sup))}
        try:
            plan = make_plan(lead, cfg, numel=NUMEL, supported_tokens_per_s=lmap, **KW)
        except ValueError:
            continue
        reasons = [check_plan(plan, by_id(recs), cfg, now=T0, supported=sup)] + [
            check_plan_sampled(plan, by_id(R.sample(recs, k=min(3, len(recs)))), cfg, now=T0, supported=sup)
            for _ in range(3)
        ]
        refused += [(seed, r) for r in reasons if r is not None and "predicted compute" in r]
    assert not refused, refused[:3]


def slow_links():
    """Five GPUs within 20 % of each other on 100 Mbit/s links: the exchange takes 6.1 s of the 19.4 s window."""
    return [rec(f"p{i}", 160_000 * f, 64, 100) for i, f in enumerate((1.0, 0.9, 0.8, 0.85, 0.95))], paper_cfg(
        window_s=20.0
    )


@pytest.mark.xfail(
    strict=True,
    reason="OPEN: the 4x link tolerance itself (an honest leader whose view of the victims' links is 3.1/3.1/2.9x "
    "slower plans these very steps, docs/security.md 'Red team 38'): victims stated with a 4x exchange are accepted at "
    "1/1/4 steps of 24/26/29, leader + partner 41.9 % -> 90.5 % of the trained tokens at 100 Mbit/s (links as read: "
    "12/13/14, 59.4 %; 800 Mbit/s at 5 s: 60.7 % -> 81.0 %)",
)
def test_victims_stated_with_a_4x_exchange_are_under_planned():
    recs, cfg = slow_links()
    sup = delivered(recs)
    honest = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    steps = {"p2": 1, "p3": 1, "p4": 4}
    out = []
    for a in honest.assignments:
        d = a.model_dump()
        if a.peer_id in steps:
            h = steps[a.peer_id]
            d.update(
                inner_steps=h,
                token_budget=h * a.batch_size * cfg.seq_len,
                predicted_compute_s=h * a.predicted_compute_s / a.inner_steps,
                predicted_comm_s=4 * a.predicted_comm_s,
                predicted_idle_s=0.0,
            )
        out.append(d)
    rogue = RoundPlan.model_validate({**honest.model_dump(), "assignments": out})
    fair, got = trained_tokens(honest, recs, cfg), trained_tokens(rogue, recs, cfg)
    assert (share(fair, ["p0", "p1"]), share(got, ["p0", "p1"])) == (0.419, 0.905)
    assert [honest.assignment(p).inner_steps for p in steps] == [24, 26, 29]
    assert check_plan(rogue, by_id(recs), cfg, now=T0, supported=sup) is not None


def test_an_assignment_of_no_steps_implies_no_rate():
    """A participant planned 0 steps (budget 0, compute 0 s) implies no delivered rate (the map skips it): the compute
    check passes it rather than reading 0 / 0 as an infinite rate; 0 tokens over 1 s is still refused (0 tokens/s)."""
    from geomesh_p2p.plan.views import compute_problem

    recs, cfg = five_peers_small_batches(), paper_cfg(window_s=5.0)
    plan = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=delivered(recs), **KW)
    a = plan.assignment("p2")
    idle = a.model_copy(update={"inner_steps": 0, "token_budget": 0, "predicted_compute_s": 0.0})
    assert compute_problem(idle, recs[2], None, "its record") is None
    slow = idle.model_copy(update={"predicted_compute_s": 1.0})
    assert str(compute_problem(slow, recs[2], None, "its record")).startswith("p2's predicted compute 1 s for 0 tokens")
