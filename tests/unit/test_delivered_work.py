"""Claims planned by delivered work (issue 28): an attacker announcing 1e10 tokens/s at an ordinary batch size
was planned a 147-164k-token budget every round against 35-40k for an honest peer of the same speed. The
planner's rate for a peer now follows what it delivered last round (``evidence_ceilings``: EVIDENCE_GROWTH x
the tokens/s its contribution supports, a newcomer at most the median of those), its record only lowers it,
and followers check it (``check_plan`` / ``check_plan_sampled`` with ``supported``)."""

from __future__ import annotations

import math

import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.bounds import EVIDENCE_GROWTH, PLAN_CHECK_TOLERANCE, THROUGHPUT_SPREAD_CAP, evidence_ceilings
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled, make_plan
from geomesh_p2p.plan.schema import PlanConfig
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0
KW = dict(run_id="run", round=5, leader="h0", start_time=T0, start_digest="d", numel=10_000)
CFG = PlanConfig(seq_len=64, target_batch=8, window_s=6.0, payload_bytes=240_000)
STEP_TOKENS = 8 * 64  # batch 8 x seq_len 64


def _rec(pid: str, tps: float):
    return peer_record(pid, address=f"{pid}.example:7000", tokens_per_s={8: tps}, max_batch=8)


def _by_id(recs):
    return {r.peer_id: r for r in recs}


def _budget_at(rate: float, a, T: float) -> int:
    """The AWB budget of a peer planned at ``rate`` tokens/s whose exchange takes ``a.predicted_comm_s``."""
    return math.floor((T - a.predicted_comm_s) / (STEP_TOKENS / rate) + 1e-9) * STEP_TOKENS


def test_an_inflated_claim_gets_no_more_than_an_honest_peer_of_the_same_delivered_work():
    # h0, h1: honest at 2,000 tokens/s; y: honest and really 4x faster, announcing 8,000 (it was planned at
    # 2,000 last round); z announces 1e10 (bounded to 8x the lower median). Each delivered 2,000 tokens/s.
    recs = [_rec("h0", 2000.0), _rec("h1", 2000.0), _rec("y", 8000.0), _rec("z", 1e10)]
    delivered = {"h0": 2000.0, "h1": 2000.0, "y": 2000.0, "z": 2000.0}
    by_claim = make_plan(recs, CFG, **KW)
    plan = make_plan(recs, CFG, supported_tokens_per_s=delivered, **KW)
    T = plan.window_s
    assert T == by_claim.window_s  # the window follows the records (followers recompute it)
    z, y, h0 = plan.assignment("z"), plan.assignment("y"), plan.assignment("h0")
    # planned by its claim, z got 8x the lower median (16,000 tokens/s): 8x an honest budget
    assert by_claim.assignment("z").token_budget == _budget_at(THROUGHPUT_SPREAD_CAP * 2000.0, z, T)
    assert by_claim.assignment("z").token_budget >= 7 * by_claim.assignment("h0").token_budget
    # planned by delivered work: exactly the budget of the honest peer that delivered as much and can do more
    assert z.token_budget == y.token_budget == _budget_at(EVIDENCE_GROWTH * 2000.0, z, T)
    assert (z.inner_steps, z.batch_size) == (y.inner_steps, y.batch_size)
    assert h0.token_budget == _budget_at(2000.0, h0, T)  # its record (2,000) is lower: the record lowers it
    assert z.token_budget <= EVIDENCE_GROWTH * h0.token_budget + STEP_TOKENS
    # followers that applied the last round hold the same evidence: the plan passes, the plan by claim not
    assert check_plan(plan, _by_id(recs), CFG, now=T0, supported=delivered) is None
    why = check_plan(by_claim, _by_id(recs), CFG, now=T0, supported=delivered)
    assert why is not None and why.startswith("token budget") and "for y" in why and "delivered work" in why
    # (y too was planned by its record, 4x what it delivered: the first refused; without y, z is)
    three = [r for r in recs if r.peer_id != "y"]
    why = check_plan(make_plan(three, CFG, **KW), _by_id(three), CFG, now=T0, supported=delivered)
    assert why is not None and why.startswith("token budget") and "for z" in why
    assert why.endswith("(2000 tokens/s delivered last round)")
    # a light follower needs no record for it (sampled: the leader alone)
    why = check_plan_sampled(by_claim, {"h0": recs[0]}, CFG, now=T0, supported=delivered)
    assert why is not None and "delivered work" in why
    assert check_plan_sampled(plan, {"h0": recs[0]}, CFG, now=T0, supported=delivered) is None
    # a follower that did not apply the last round (no evidence) checks the records alone, as before
    assert check_plan(by_claim, _by_id(recs), CFG, now=T0) is None


def test_a_newcomer_is_seeded_at_most_at_the_median_delivered_rate():
    recs = [_rec("h0", 1500.0), _rec("h1", 2000.0), _rec("h2", 2500.0), _rec("n", 1e10)]
    delivered = {"h0": 1500.0, "h1": 2000.0, "h2": 2500.0}  # n took no part in the last round
    assert evidence_ceilings(["h0", "n"], delivered) == {"h0": EVIDENCE_GROWTH * 1500.0, "n": 2000.0}
    assert evidence_ceilings(["n"], {}) == {} and evidence_ceilings(["n"], {"h0": float("nan"), "h1": 0.0}) == {}
    plan = make_plan(recs, CFG, supported_tokens_per_s=delivered, **KW)
    T = plan.window_s
    n = plan.assignment("n")
    assert n.token_budget == _budget_at(2000.0, n, T)  # the median delivered rate, whatever it announces
    assert plan.assignment("h1").token_budget == _budget_at(2000.0, plan.assignment("h1"), T)  # its record
    assert check_plan(plan, _by_id(recs), CFG, now=T0, supported=delivered) is None
    by_claim = make_plan(recs, CFG, **KW)
    assert by_claim.assignment("n").token_budget > PLAN_CHECK_TOLERANCE * 2000.0 * T
    why = check_plan(by_claim, _by_id(recs), CFG, now=T0, supported=delivered)
    assert why is not None and "for n" in why and "a newcomer" in why


def test_uniform_plans_are_not_bounded_by_delivered_work():
    recs = [_rec("h0", 2000.0), _rec("h1", 2000.0), _rec("z", 1e10)]
    cfg = PlanConfig(
        seq_len=64, target_batch=8, window_s=6.0, payload_bytes=240_000, method="diloco", uniform_inner_steps=10
    )
    plan = make_plan(recs, cfg, supported_tokens_per_s={"h0": 10.0, "h1": 10.0, "z": 10.0}, **KW)
    assert {a.inner_steps for a in plan.assignments} == {10}
    assert check_plan(plan, _by_id(recs), cfg, now=T0, supported={"h0": 10.0, "h1": 10.0, "z": 10.0}) is None


def test_a_follower_refuses_a_leader_that_plans_by_the_claim():
    """The node's rules (PlanRules): the leader plans within the delivered rates of the last round, which every
    peer that applied it holds (Reprofiler.supported_tps); a follower holding them refuses a plan made by the
    claims, and one that did not apply the last round checks the records alone."""
    run = RunConfig(seq_len=32, window_s=5.0)
    ids = [str(Identity.generate().peer_id) for _ in range(4)]
    z = ids[3]
    recs = [
        peer_record(
            p,
            address=f"127.0.0.1:{1001 + i}",
            round=3,
            weights_digest="d",
            tokens_per_s={8: 1e10 if p == z else 1000.0},
        )
        for i, p in enumerate(ids)
    ]
    live = {r.peer_id: r for r in recs}
    delivered = (2, {p: 1000.0 for p in ids})  # round 2's deliveries: every peer 1,000 tokens/s

    def rules(me, evidence):
        r = make_rules(run, NodeConfig(), me=me, round=3, digest="d", numel=5000).planning
        r.profile.supported_tps = evidence
        return r

    leader, follower = rules(ids[0], delivered), rules(ids[1], delivered)
    plan = leader.make_plan(recs, ids[0])
    # honest: 19 steps of 8 x 32 tokens (1,000 tokens/s); z: EVIDENCE_GROWTH x its delivered 1,000, 38 steps
    assert [plan.assignment(p).token_budget for p in ids] == [4864, 4864, 4864, 9728]
    assert follower.plan_problem(plan, live) is None
    by_claim = rules(ids[0], None).make_plan(recs, ids[0])  # a leader that plans by the records alone
    assert by_claim.assignment(z).token_budget == 38912  # its claim, bounded to 8x the median: 152 steps
    why = follower.plan_problem(by_claim, live)
    assert why is not None and "delivered work" in why and z[:10] in why
    assert rules(ids[1], None).plan_problem(by_claim, live) is None  # no evidence held: the records alone
    assert rules(ids[1], (1, delivered[1])).plan_problem(by_claim, live) is None  # evidence of another round


def test_an_owner_listing_a_peer_above_its_budget_does_not_lift_its_delivered_rate():
    """Red team (session 15): delivered work was read from the owners' token lists uncapped, so one owner listing
    a partner at 1e15 tokens voided the partner's ceiling. Every reader now caps it at the plan's budget."""
    from types import SimpleNamespace

    from geomesh_p2p.round.rules.profiling import Reprofiler

    recs = [_rec("h0", 2000.0), _rec("h1", 2000.0), _rec("z", 2000.0)]
    plan = make_plan(recs, CFG, **KW)
    honest = {p: plan.assignment(p).token_budget for p in ("h0", "h1", "z")}
    lists = {0: [(p, n) for p, n in honest.items()], 1: [("h0", honest["h0"]), ("h1", honest["h1"]), ("z", 10**15)]}
    rates = Reprofiler.delivered_rates(plan, SimpleNamespace(contributors=lists))
    a = plan.assignment("z")
    assert rates["z"] == a.token_budget / a.predicted_compute_s  # the budget, not 1e15
