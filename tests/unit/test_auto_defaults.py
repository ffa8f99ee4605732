"""Defaults that fit the model (issue 27): with only ``--model`` changed, the window, the inner steps per round
and the evaluation schedule follow the measured step times. ``--window-s auto`` (the default): each round's
leader sets the window from the records so that the median peer runs ``--target-inner-steps`` steps
(plan.awb.auto_window), and every follower recomputes it from the same records; an explicit ``--window-s``
wins. ``--eval-every auto``: evaluation within 5% of the wall time (round/eval_schedule.py)."""

from __future__ import annotations

import argparse

import pytest

from geomesh_p2p import __version__
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.plan.awb import AUTO_WINDOW_MIN_S, plan_round
from geomesh_p2p.plan.bounds import PLAN_CHECK_TOLERANCE
from geomesh_p2p.plan.planner import check_plan, window_exclusions
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.round.eval_schedule import EvalSchedule, eval_interval
from geomesh_p2p.schema.peer import PeerRecord
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

SEQ, BATCH = 64, 8
PLAN_KW = dict(run_id="run", round=3, leader="a", start_time=1_700_000_000.0, start_digest="d0")


def record(peer_id: str, step_s: float) -> PeerRecord:
    """A peer measured at ``step_s`` seconds per inner step of BATCH sequences (its start-up profile), on a link
    fast enough that its exchange is ~0 s (1 Tbit/s, no payload in these configs)."""
    return PeerRecord(
        peer_id=peer_id,
        address=f"{peer_id}.example:7000",
        device="cpu",
        memory_bytes=24 * 2**30,
        tokens_per_s={BATCH: BATCH * SEQ / step_s},
        max_batch=BATCH,
        upload_bps=1.25e11,
        download_bps=1.25e11,
        version=__version__,
        run_config_hash="cfg",
    )


def auto_cfg(**kw) -> PlanConfig:
    """The planner's settings of a run at ``--window-s auto --target-inner-steps 30`` (no exchange cost)."""
    base = dict(
        seq_len=SEQ, target_batch=BATCH, payload_bytes=0, latency_s=0.0, target_inner_steps=30, max_inner_steps=200
    )
    return PlanConfig(**{**base, **kw})


def steps(plan) -> dict[str, int]:
    return {a.peer_id: a.inner_steps for a in plan.assignments}


def test_the_issues_gpt2_step_gets_the_target_steps_not_one():
    """gpt2-124m on one CPU thread: 6.6 s a step at batch 8. The fixed 6 s window gave H = 1 (stretched to one
    step); auto gives the target 30 steps in 198 s."""
    recs = [record("a", 6.6)]
    fixed = plan_round(recs, auto_cfg(window_s=6.0), numel=1000, **PLAN_KW)
    assert steps(fixed) == {"a": 1} and fixed.window_s == pytest.approx(6.6)
    plan = plan_round(recs, auto_cfg(), numel=1000, **PLAN_KW)
    assert steps(plan) == {"a": 30}
    assert plan.window_s == pytest.approx(30 * 6.6, rel=1e-12)


def test_auto_window_fits_the_median_peer_and_balances_the_others():
    recs = [record("a", 2.0), record("b", 4.0), record("c", 8.0)]
    plan = plan_round(recs, auto_cfg(), numel=1000, **PLAN_KW)
    assert plan.window_s == pytest.approx(120.0, rel=1e-12)  # the median peer's 30 steps of 4 s
    assert steps(plan) == {"a": 60, "b": 30, "c": 15}
    # an even count takes the lower median, the faster of the middle two: half the peers claiming to be slow
    # cannot stretch everyone's round (red team, session 15: 2 of 4 at 15 s a step gave 427.5 s with the upper)
    plan = plan_round(recs + [record("d", 16.0)], auto_cfg(), numel=1000, **PLAN_KW)
    assert plan.window_s <= 120.0 and steps(plan) == {"a": 57, "b": 28, "c": 14, "d": 7}  # AWB trims it to 114 s
    slow = [record("a", 2.0), record("b", 2.0), record("x", 15.0), record("y", 15.0)]
    assert plan_round(slow, auto_cfg(), numel=1000, **PLAN_KW).window_s == pytest.approx(60.0, rel=1e-12)


def test_auto_window_has_a_floor_for_tiny_models_and_a_cap_followers_accept():
    tiny = plan_round([record("a", 0.01)], auto_cfg(), numel=1000, **PLAN_KW)
    assert tiny.window_s == AUTO_WINDOW_MIN_S == 6.0 and steps(tiny) == {"a": 200}  # max_inner_steps
    slow = plan_round([record("a", 20.0)], auto_cfg(max_window_s=324.0), numel=1000, **PLAN_KW)
    assert slow.window_s == 324.0 and steps(slow) == {"a": 16}


def test_a_follower_recomputes_the_auto_window_and_refuses_one_far_from_it():
    recs = [record("a", 2.0), record("b", 4.0), record("c", 8.0)]
    cfg = auto_cfg()
    plan = plan_round(recs, cfg, numel=1000, **PLAN_KW)
    live = {r.peer_id: r for r in recs}
    assert check_plan(plan, live, cfg, now=plan.created_at) is None
    T = plan.window_s * PLAN_CHECK_TOLERANCE * 1.5
    stretched = plan.model_copy(update={"window_s": T, "train_deadline": plan.created_at + T})
    assert "far from the 120 s the records support" in (check_plan(stretched, live, cfg, now=plan.created_at) or "")


def test_the_exclusion_rule_compares_with_the_auto_window():
    """A peer whose one step needs more than 1.5 x the auto window (the median peer's 30 steps) is planned out;
    with no window to compare with, the old rule compared it with the others' single steps."""
    recs = [record("a", 2.0), record("b", 4.0), record("c", 8.0), record("s", 170.0)]
    ex = window_exclusions(recs, auto_cfg())
    assert ex.window_s == pytest.approx(120.0) and ex.excluded == ()  # 170 s fits 1.5 x the 120 s window
    recs[-1] = record("s", 400.0)
    ex = window_exclusions(recs, auto_cfg())
    assert ex.window_s == pytest.approx(120.0) and ex.excluded == ("s",)


def test_run_config_defaults_to_auto_and_an_explicit_window_wins():
    run = RunConfig()
    assert run.window_s is None and run.target_inner_steps == 30
    cfg = make_rules(run, numel=1000).planning.plan_config(3)
    assert (cfg.window_s, cfg.target_inner_steps) == (None, 30)
    fixed = make_rules(RunConfig(window_s=6.0), numel=1000).planning.plan_config(3)
    assert (fixed.window_s, fixed.target_inner_steps) == (6.0, None)
    assert RunConfig(window_s=6.0).config_hash() != run.config_hash()  # peers must agree on it
    with pytest.raises(ValueError, match="target_inner_steps 300 is over max_inner_steps 200"):
        RunConfig(target_inner_steps=300)


def _join_parser() -> argparse.ArgumentParser:
    from peer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["join"]


def test_flags_take_auto_or_a_number():
    p = _join_parser()
    ns = p.parse_args([])
    assert (ns.window_s, ns.eval_every, ns.target_inner_steps) == (None, None, 30)
    ns = p.parse_args(["--window-s", "AUTO", "--eval-every", "auto"])
    assert (ns.window_s, ns.eval_every) == (None, None)
    ns = p.parse_args(["--window-s", "6", "--eval-every", "3", "--target-inner-steps", "50"])
    assert (ns.window_s, ns.eval_every, ns.target_inner_steps) == (6.0, 3, 50)
    assert NodeConfig().eval_every is None
    from peer.node_cli import run_argv

    argv = run_argv(p.parse_args([]))  # the demo's peers: auto is passed on as auto, not dropped
    assert argv[argv.index("--window-s") + 1] == "auto"
    help_text = p.format_help()
    assert "--target-inner-steps" in help_text and "median peer" in " ".join(help_text.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--window-s", "fast"], "argument --window-s: expected auto or a number, got 'fast'"),
        (["--window-s", "0"], "argument --window-s: must be a finite number > 0, got 0"),
        (["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
    ],
)
def test_bad_auto_flags_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        _join_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_eval_interval_keeps_evaluation_within_5_percent():
    assert eval_interval(15.0, 200.0) == 2  # gpt2-124m at auto: 15 / (2 x 200 + 15) = 3.6%
    assert eval_interval(15.0, 7.0) == 41  # ... at the old fixed window: one step a round
    assert eval_interval(0.1, 3.0) == 1
    assert eval_interval(0.95, 1.0) == 19  # exactly 5%: 0.95 / (19 + 0.95)
    assert eval_interval(0.0, 0.0) == eval_interval(5.0, 0.0) == 1  # nothing measured yet
    for e, t in [(15.0, 200.0), (15.0, 7.0), (3.0, 1.0)]:
        k = eval_interval(e, t)
        assert e / (k * t + e) <= 0.05 < e / ((k - 1) * t + e) or k == 1
    with pytest.raises(ValueError):
        eval_interval(1.0, 1.0, share=0.0)


def test_auto_schedule_from_the_initial_evaluation_and_the_rounds():
    s = EvalSchedule(None)
    s.note_eval(-1, 15.0)  # the node's initial evaluation
    due = []
    for r in range(6):
        s.note_round(200.0)  # the round's seconds, noted before its evaluation is decided
        if s.due(r, last=False):
            due.append(r)
            s.note_eval(r, 15.0)
    assert due == [1, 3, 5] and s.interval == 2
    assert s.due(0, last=True)  # the last round always
    s.note_eval(5, 300.0)  # evaluation got slower: sparser
    assert s.interval == eval_interval(300.0, 200.0) == 29
    assert not s.due(33, last=False) and s.due(34, last=False)
    for _ in range(8):
        s.note_round(100.0)  # the mean of the latest 8 rounds
    assert s.interval == eval_interval(300.0, 100.0) == 57


def test_fixed_schedule_and_a_driver_without_an_initial_evaluation():
    s = EvalSchedule(3)
    assert [r for r in range(9) if s.due(r, last=False)] == [2, 5, 8]
    fresh = EvalSchedule(None)
    assert fresh.due(0, last=False)  # nothing measured: evaluate to measure
    with pytest.raises(ValueError):
        EvalSchedule(0)
