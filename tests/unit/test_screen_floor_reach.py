"""Red team of session 45's screen floor: a screened peer is planned the loss-gain test's steps only where its plan's
own times reach them by the train deadline plus the floor's grace (``round.steps.floor_grace_s``).

The leader raised every screened contributor to ``ceil(gain_min_tokens / (batch x seq_len))`` steps whatever the
window held, and its claim under them counts 0: in a fixed-window swarm whose window holds 3 steps of 6 s (a CPU
peer's gpt2-class step), the 5-7 floor steps take 30-42 s, the window and grace 22 s, so every honest claim of the
screened rounds 2-4 counted 0 and those rounds aggregated nothing (before the change: 3 steps, no floor, counted)."""

from __future__ import annotations

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled
from geomesh_p2p.plan.schema import ContentRefusal, PlanConfig
from geomesh_p2p.round.rules.spec import screen_token_cap, screen_token_floor
from geomesh_p2p.round.steps import floor_grace_s
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(60)

L, BATCH = 32, 8
START = 1_700_000_000.0
IDS = sorted(str(Identity.generate().peer_id) for _ in range(4))


def _records(tps: float) -> dict:
    return {p: peer_record(p, address=f"127.0.0.1:{7100 + k}", tokens_per_s={8: tps}) for k, p in enumerate(IDS)}


def _cfg(**kw) -> PlanConfig:
    base = dict(seq_len=L, target_batch=BATCH, payload_bytes=1000, mode="relay", method="geomesh")
    return PlanConfig(**{**base, **kw})


def _plan(records, cfg, round: int = 2):
    return plan_round(
        list(records.values()), cfg, run_id="run", round=round, leader=IDS[0], numel=1 << 16, start_time=START
    )


def _reachable(plan, floor: dict) -> dict[str, bool]:
    """peer -> whether its token floor's steps end by the train deadline plus the grace at its plan's own times."""
    out = {}
    for a in plan.assignments:
        steps = -(-floor.get(a.peer_id, 0) // (a.batch_size * plan.seq_len))
        step_s = a.predicted_compute_s / a.inner_steps
        out[a.peer_id] = a.predicted_comm_s + steps * step_s <= plan.window_s + floor_grace_s(plan) + 1e-9
    return out


def _refusals_of_a_rogue_row(plan, peer_id: str, update: dict, records, cfg) -> tuple:
    """What a full follower (``check_plan``) and a sampled one (``check_plan_sampled``, no records) say of ``plan``
    with ``peer_id``'s assignment changed by ``update`` (a rogue leader's row)."""
    rows = [x.model_copy(update=update) if x.peer_id == peer_id else x for x in plan.assignments]
    rogue = plan.model_copy(update={"assignments": rows})
    return (
        check_plan(rogue, records, cfg, now=plan.created_at),
        check_plan_sampled(rogue, {}, cfg, now=plan.created_at),
    )


def test_an_honest_screened_round_never_plans_every_peer_a_floor_its_times_cannot_reach():
    # 256 tokens a step at 42.67 tokens/s: 6 s a step; a 20 s window holds 3; the exchange window 5 s: 2 s of grace
    records, cfg = _records(256 / 6.0), _cfg(window_s=20.0, exchange_timeout_s=5.0)
    plan = _plan(records, cfg)
    assert floor_grace_s(plan) == pytest.approx(2.0)
    floor = screen_token_floor(plan, "sign")
    assert all(_reachable(plan, floor).values()), {a.peer_id[:6]: a.inner_steps for a in plan.assignments}
    # here the window's 3 steps: under min_steps (5), no floor, every claim counts as before session 45
    assert {a.inner_steps for a in plan.assignments} == {3} and floor == {}
    for p in (plan, _plan(records, cfg, round=5)):
        assert check_plan(p, records, cfg, now=p.created_at) is None
        assert check_plan_sampled(p, {IDS[1]: records[IDS[1]]}, cfg, now=p.created_at) is None


def test_the_floor_is_still_planned_where_the_grace_reaches_it_and_a_rogue_cannot_drop_it():
    # 3 steps of 1 s in a 3.1 s window (c + 3 s), a 10 s exchange window: 4 s of grace, the 7 floor steps end at
    # exactly the window and grace (7.1002 s): the leader plans them and every follower accepts them (the same sums
    # from the plan's unix-second deadlines differ in the last bits)
    records = _records(256.0)
    for exchange_s in (10.0, 12.0):
        cfg = _cfg(window_s=3.2, exchange_timeout_s=exchange_s)
        plan = _plan(records, cfg)
        assert {a.inner_steps for a in plan.assignments} == {7}
        assert all(_reachable(plan, screen_token_floor(plan, "sign")).values())
        assert check_plan(plan, records, cfg, now=plan.created_at) is None
        assert check_plan_sampled(plan, {IDS[2]: records[IDS[2]]}, cfg, now=plan.created_at) is None
    # with 0.8 s to spare, a leader that plans one of them its window's 3 steps (never decided) is refused
    update = {"inner_steps": 3, "token_budget": 3 * 256, "predicted_compute_s": 3.0}
    for reason in _refusals_of_a_rogue_row(plan, IDS[2], update, records, cfg):
        assert isinstance(reason, ContentRefusal) and "outside 7..500" in reason


def test_a_newcomer_announcing_a_batch_at_the_spread_cap_is_not_raised_past_the_caps():
    # four honest peers at batch 8 (10 steps in 1.45 s) and a newcomer on probation announcing 8 ranks, batch 512
    # (64x the median, the spread cap x its ranks) at 100,000 tokens/s: 5 steps of it end in 0.82 s, within reach
    honest = IDS
    new = str(Identity.generate().peer_id)
    records = {
        p: peer_record(p, address=f"127.0.0.1:{7200 + k}", tokens_per_s={8: 2000.0}) for k, p in enumerate(honest)
    }
    records[new] = peer_record(
        new, address="127.0.0.1:7300", tokens_per_s={8: 2000.0, 512: 100000.0}, max_batch=512, ranks=8
    )
    cfg = _cfg(window_s=1.45)
    for r in (2, 5):
        plan = plan_round(
            list(records.values()),
            cfg,
            run_id="run",
            round=r,
            leader=honest[0],
            numel=1 << 16,
            start_time=START,
            probation=(new,),
        )
        a = plan.assignment(new)
        assert (a.probation, a.batch_size) == (True, 512)
        # its caps' 1 step, counted as one step of the median batch (256 tokens; was 5 steps, 81,920 tokens: 89 %
        # of the round's, counted whole)
        assert a.inner_steps == 1 and screen_token_cap(plan, "sign") == {new: 256}
        assert screen_token_floor(plan, "sign").get(new) is None
        assert {x.inner_steps for x in plan.assignments if x.peer_id != new} == {10}
        assert check_plan(plan, records, cfg, now=plan.created_at) is None
        assert check_plan_sampled(plan, {new: records[new]}, cfg, now=plan.created_at) is None
        # a leader that raises it to the 5 steps anyway is refused by every follower
        update = {"inner_steps": 5, "token_budget": 5 * 512 * L, "predicted_compute_s": 5 * 0.16384}
        for reason in _refusals_of_a_rogue_row(plan, new, update, records, cfg):
            assert reason is not None and "token budget 81920 for " in reason, reason
