"""A screened contribution carries the loss-gain test's token floor (session 45, issue 28).

The gain test decides nothing under ``VerifyConfig.gain_min_tokens`` (1,792 tokens), the draws start at ``min_steps``
(5): a contributor its round screens (rounds 2-4, later those on probation) planned 5-6 steps at batch 8 x 32 counted
its whole claim and could never be decided. Now the AWB leader plans it at least ``ceil(1792 / 256)`` = 7 steps
(``plan.views.min_steps_of``), a follower refuses fewer, its claim counts from 1,792 tokens on
(``round.rules.spec.screen_token_floor``), and an honest peer trains up to them (``round.steps.floor_steps``, a grace
past the train deadline). Unscreened rounds and peers keep their window's steps; session 46: any peer planned 7 steps
or more has the 1,792-token floor from round 2 on (``verify_task.claim_floor_steps``), and the sampled draws take
only claims that count and, for a screen, that the gain test decides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.exchange import CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.planner import check_plan, check_plan_sampled
from geomesh_p2p.plan.schema import ContentRefusal, PlanConfig
from geomesh_p2p.plan.views import min_steps_of
from geomesh_p2p.round.rules.spec import screen_token_floor
from geomesh_p2p.round.steps import floor_steps
from geomesh_p2p.trust.verify_commit import Committed
from geomesh_p2p.trust.verify_task import (
    SCREEN,
    VerifyConfig,
    VerifyTask,
    _eligible,
    _sampled_pool,
    claim_floor_steps,
    gain_floor_steps,
    reference_task,
    sample_probability,
    sampled_candidates,
    screen_candidates,
    screen_steps,
    screened_in_round,
)
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(60)

L, BATCH = 32, 8
STEP_TOKENS = L * BATCH  # 256
START = 1_700_000_000.0

# one slow peer (1,000 tokens/s at batch 8: 0.256 s a step, 5 steps in the window) and three twice as fast (10)
IDS = sorted(str(Identity.generate().peer_id) for _ in range(4))
SLOW, FAST = IDS[0], IDS[1:]
RECORDS = {
    p: peer_record(p, address=f"127.0.0.1:{7000 + k}", tokens_per_s={8: 1000.0 if p == SLOW else 2000.0})
    for k, p in enumerate(IDS)
}


def _cfg(**kw) -> PlanConfig:
    base = dict(seq_len=L, target_batch=BATCH, window_s=1.45, payload_bytes=1000, mode="relay", method="geomesh")
    return PlanConfig(**{**base, **kw})


def _plan(round: int, probation=(), cfg=None):
    return plan_round(
        list(RECORDS.values()),
        cfg or _cfg(),
        run_id="run",
        round=round,
        leader=FAST[0],
        numel=1 << 16,
        start_time=START,
        probation=probation,
    )


def _steps(plan) -> dict[str, int]:
    return {a.peer_id: a.inner_steps for a in plan.assignments}


def test_which_contributions_a_round_screens_and_the_steps_they_need():
    cfg = VerifyConfig()
    assert (cfg.gain_first_round, cfg.screen_rounds, cfg.min_steps, cfg.gain_min_tokens) == (2, 3, 5, 1792)
    assert [screened_in_round(cfg, r, False) for r in range(7)] == [False, False, True, True, True, False, False]
    assert [screened_in_round(cfg, r, True) for r in (1, 2, 5, 40)] == [False, True, True, True]
    kw = dict(round=3, probation=False, seq_len=L)
    # ceil(1792 / (batch x 32)), never under min_steps (5)
    assert [screen_steps(cfg, batch_size=b, **kw) for b in (4, 6, 8, 16, 64)] == [14, 10, 7, 5, 5]
    assert screen_steps(cfg, batch_size=8, round=5, probation=False, seq_len=L) == 0  # not screened
    assert screen_steps(cfg, batch_size=8, round=5, probation=True, seq_len=L) == 7
    c = _cfg()
    assert min_steps_of(c, round=3, mode="relay", probation=False, batch_size=8) == 7
    assert min_steps_of(c, round=3, mode="accountable", probation=False, batch_size=8) == 7
    # nobody screens reencode rounds or fp32 methods; 0-1 and established peers later: min_inner_steps (1)
    assert min_steps_of(c, round=3, mode="reencode", probation=False, batch_size=8) == 1
    assert min_steps_of(_cfg(method="diloco"), round=3, mode="relay", probation=False, batch_size=8) == 1
    assert min_steps_of(c, round=1, mode="relay", probation=True, batch_size=8) == 1
    assert min_steps_of(c, round=9, mode="relay", probation=False, batch_size=8) == 1
    # a run whose max_inner_steps holds fewer: at most that
    assert min_steps_of(_cfg(max_inner_steps=6), round=3, mode="relay", probation=False, batch_size=8) == 6


def test_the_leader_plans_a_screened_peer_the_gain_tests_steps_and_only_then():
    unscreened = _plan(5)
    assert _steps(unscreened) == {SLOW: 5, **{p: 10 for p in FAST}}  # what the window fits
    screened = _plan(2)
    assert _steps(screened) == {SLOW: 7, **{p: 10 for p in FAST}}  # 2 extra steps for the slow peer, none else
    a = screened.assignment(SLOW)
    assert a.token_budget == 7 * STEP_TOKENS == 1792
    assert a.predicted_compute_s == pytest.approx(7 * 0.256)  # its rate is its record's: 1,000 tokens/s
    assert a.predicted_idle_s == 0.0 and a.predicted_compute_s > screened.window_s
    assert screened.window_s == unscreened.window_s  # the window is the records', not stretched for anyone
    # later rounds: a peer on probation is screened, the established ones are not
    later = _plan(5, probation=(SLOW,))
    assert later.assignment(SLOW).probation and _steps(later)[SLOW] == 7
    assert _steps(_plan(5, probation=(FAST[0],))) == {SLOW: 5, **{p: 10 for p in FAST}}
    # unscreened modes: the window's steps
    assert _steps(_plan(2, cfg=_cfg(mode="reencode"))) == {SLOW: 5, **{p: 10 for p in FAST}}


def test_a_follower_accepts_the_screened_plan_and_refuses_one_that_plans_under_the_gain_floor():
    for plan in (_plan(2), _plan(3), _plan(5, probation=(SLOW,)), _plan(5)):
        assert check_plan(plan, RECORDS, _cfg(), now=plan.created_at) is None
        assert check_plan_sampled(plan, {SLOW: RECORDS[SLOW]}, _cfg(), now=plan.created_at) is None
    # a leader that plans the screened slow peer at its window's 5 steps (1,280 tokens: never decided)
    plan = _plan(2)
    rows = [
        a.model_copy(update={"inner_steps": 5, "token_budget": 5 * STEP_TOKENS, "predicted_compute_s": 5 * 0.256})
        if a.peer_id == SLOW
        else a
        for a in plan.assignments
    ]
    rogue = plan.model_copy(update={"assignments": rows})
    for reason in (
        check_plan(rogue, RECORDS, _cfg(), now=plan.created_at),
        check_plan_sampled(rogue, {}, _cfg(), now=plan.created_at),
    ):
        assert isinstance(reason, ContentRefusal)  # the plan and the run config alone: every honest follower
        assert reason.startswith("5 inner steps for ") and "outside 7..500" in reason


def _spec(plan) -> CollectiveSpec:
    owners = [PartOwner(p, RECORDS[p].address, k * 64, (k + 1) * 64) for k, p in enumerate(IDS)]
    budgets = {a.peer_id: a.token_budget for a in plan.assignments}
    return CollectiveSpec(
        "run",
        plan.round,
        budgets,
        owners,
        4 * 64,
        10.0,
        11.0,
        mode="relay",
        token_floor=screen_token_floor(plan, "sign"),
    )


def test_a_claim_under_the_gain_floor_counts_nothing_where_the_plan_gives_its_steps():
    screened, later = _spec(_plan(2)), _spec(_plan(5))
    assert screened.token_floor == {p: 7 * STEP_TOKENS for p in IDS}  # 1,792: whole steps of the gain floor
    # session 46: an established peer planned 7 or more has the gain floor too; the slow one, planned its window's
    # 5 (the leader raises only screened peers), keeps min_steps' (1,280)
    assert later.token_floor == {SLOW: 5 * STEP_TOKENS, **{p: 7 * STEP_TOKENS for p in FAST}}
    fast = FAST[0]
    # 6 steps' claim (1,536 tokens) of a peer planned 10: nothing, screened or not (session 45: all of it when not)
    assert screened.counted_tokens(fast, 6 * STEP_TOKENS) == 0
    assert later.counted_tokens(fast, 6 * STEP_TOKENS) == 0
    assert [later.counted_tokens(fast, 256 * k) for k in (5, 6, 7, 8, 10, 11)] == [0, 0, 1792, 2048, 2560, 2560]
    assert [screened.counted_tokens(SLOW, 256 * k) for k in (5, 6, 7, 8)] == [0, 0, 1792, 1792]  # capped at 7
    # the slow peer's window holds 5 steps: its 5 count, as before (no floor it cannot reach at its planned step)
    assert [later.counted_tokens(SLOW, 256 * k) for k in (4, 5, 6)] == [0, 1280, 1280]
    # a probation peer later: the gain floor, raised to 7 steps by the leader
    assert screen_token_floor(_plan(5, probation=(SLOW,)), "sign") == {p: 1792 for p in IDS}
    # a run whose steps hold fewer than the gain floor (max_inner_steps 6): min_steps' floor, as before
    capped = _plan(2, cfg=_cfg(max_inner_steps=6))
    assert _steps(capped) == {SLOW: 6, **{p: 6 for p in FAST}}
    assert screen_token_floor(capped, "sign") == {p: 1280 for p in IDS}
    assert set(screen_token_floor(_plan(9, cfg=_cfg(max_inner_steps=6)), "sign").values()) == {1280}


def _planned(steps: dict[str, int], round: int = 9, batch: int = BATCH):
    """A plan of established peers (no probation) planned ``steps`` at ``batch`` x 32 in ``round``."""
    rows = [
        SimpleNamespace(peer_id=p, batch_size=batch, inner_steps=h, token_budget=h * batch * L, probation=False)
        for p, h in steps.items()
    ]
    return SimpleNamespace(round=round, mode="accountable", seq_len=L, start_digest="d", assignments=rows)


def test_an_established_peer_planned_the_gain_floor_has_it_in_every_round_from_gain_first_round():
    """Session 46: the floor per peer, a pure function of the plan (``claim_floor_steps``): S = 7 at 8 x 32 for a peer
    planned 7+, min_steps (5) for one planned 5-6, none under 5; rounds 0-1 (no gain test) keep min_steps."""
    cfg = VerifyConfig()
    kw = dict(batch_size=8, seq_len=L)
    assert [claim_floor_steps(cfg, round=9, inner_steps=h, **kw) for h in (3, 4, 5, 6, 7, 8, 40)] == [
        0,
        0,
        5,
        5,
        7,
        7,
        7,
    ]
    assert [claim_floor_steps(cfg, round=r, inner_steps=8, **kw) for r in (0, 1, 2, 5, 100)] == [5, 5, 7, 7, 7]
    assert [gain_floor_steps(cfg, batch_size=b, seq_len=L) for b in (4, 8, 16)] == [14, 7, 5]
    plan = _planned({"a": 8, "b": 6, "c": 7, "d": 4, "e": 20})
    assert screen_token_floor(plan, "sign") == {"a": 1792, "b": 1280, "c": 1792, "e": 1792}
    assert screen_token_floor(_planned({"a": 8, "b": 6}, round=1), "sign") == {"a": 1280, "b": 1280}
    assert screen_token_floor(_planned({"a": 16, "b": 13}, batch=4), "sign") == {"a": 1792, "b": 640}
    # a peer planned 8 at batch 8 x 32 claiming 6 steps counts 0 tokens, 7 steps 1,792 (in the collective's spec)
    a, b, d = FAST[0], FAST[1], FAST[2]
    plan = _planned({a: 8, b: 6, d: 4})
    owners = [PartOwner(p, f"127.0.0.1:{7000 + k}", k * 64, (k + 1) * 64) for k, p in enumerate((a, b, d))]
    spec = CollectiveSpec(
        "run", 9, {x.peer_id: x.token_budget for x in plan.assignments}, owners, 3 * 64, 10.0, 11.0,
        mode="accountable", token_floor=screen_token_floor(plan, "sign"),
    )  # fmt: skip
    assert [spec.counted_tokens(a, 256 * k) for k in (5, 6, 7, 8)] == [0, 0, 1792, 2048]
    assert [spec.counted_tokens(b, 256 * k) for k in (4, 5, 6)] == [0, 1280, 1536]  # planned 6: min_steps
    assert [spec.counted_tokens(d, 256 * k) for k in (1, 4)] == [256, 1024]  # under min_steps: no floor


def test_the_sampled_draws_take_only_what_counts_and_what_the_gain_test_decides():
    """Session 46: a check or screen draws a claim from its floor on (``verify_task._eligible``), so none of the
    claims that count 0 costs a check; a sampled screen (the gain test alone) draws only claims of 1,792 tokens or
    more (``_sampled_pool``); a sampled full check may still draw a 5-6-step claim of a peer planned 5-6 (its sign
    statistics decide it; its gain test does not)."""
    cfg = VerifyConfig(sample_share=1.0)
    plan = _planned({"a": 8, "b": 8, "c": 6, "d": 10, "e": 20})
    claims = {"a": 6, "b": 7, "c": 6, "d": 5, "e": 20}  # a: under its floor of 7; c: planned 6, at min_steps' floor
    packets = {p: {0: Committed(tokens=k * STEP_TOKENS, digest=b"x" * 16)} for p, k in claims.items()}
    assert [(a.peer_id, k) for a, k, _ in _eligible(cfg, plan, packets)] == [("b", 7), ("c", 6), ("e", 20)]
    assert _eligible(cfg, _planned({"a": 8}, round=1), {"a": packets["a"]})[0][1] == 6  # rounds 0-1: min_steps
    assert [(a.peer_id, k) for a, k in _sampled_pool(cfg, plan, packets)] == [("b", 7), ("e", 20)]
    # own compute 3 x 52 steps x 8 rows over 2 screeners x 2 x ((7 + 16) + (8 + 16)) x 8 rows: b and e alone
    assert sample_probability(cfg, plan, packets) == pytest.approx(1248 / 1504)
    everyone = VerifyConfig(sample_share=2.0)
    assert sample_probability(everyone, plan, packets) == 1.0
    assert sampled_candidates(everyone, plan, packets, b"s" * 32) == ["b", "e"]
    # the claims that count 0 are not screened either: screen_candidates of a screened round (2) likewise
    assert screen_candidates(cfg, _planned({"a": 8, "b": 8, "c": 6}, round=2), packets) == ["b", "c"]
    # ... but a checker's own contribution under its floor is still its power reference (honest work, stopped early)
    task = VerifyTask(9, "e", "b", (0,), ((0, 64),), 7, (), 16, 8, L, 1, 0, False, kind=SCREEN)
    assert reference_task(cfg, task, plan=plan, packets=packets, checker="a").steps_done == 6


def test_an_honest_screened_peer_trains_the_floors_steps_past_the_deadline_if_it_must():
    def drv(me):
        return SimpleNamespace(me=me, cfg=SimpleNamespace(push_encoding="sign"))

    screened, unscreened = _plan(2), _plan(5)
    assert floor_steps(drv(SLOW), screened, screened.assignment(SLOW)) == 7  # all its planned steps
    assert floor_steps(drv(FAST[0]), screened, screened.assignment(FAST[0])) == 7  # of its 10
    assert floor_steps(drv(SLOW), unscreened, unscreened.assignment(SLOW)) == 5  # planned 5: min_steps
    assert floor_steps(drv(FAST[0]), unscreened, unscreened.assignment(FAST[0])) == 7  # session 46: of its 10
    assert (
        floor_steps(
            SimpleNamespace(me=SLOW, cfg=SimpleNamespace(push_encoding="fp32")), screened, screened.assignment(SLOW)
        )
        == 0
    )
