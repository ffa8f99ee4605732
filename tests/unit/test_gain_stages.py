"""A screen's loss-gain test in two stages (issue 28, session 43; geomesh_p2p/trust/gain_stages.py): a half of the
batches decides a clear case (an honest newcomer far above the thresholds, a poisoner far below), with the verdict
the whole screen gives, in far fewer forward passes; a case no half decides runs the whole screen, the same t to
the bit; and the stage bounds keep an early decision's disagreement with the whole screen under 1e-3 each.

Passes are counted as the batches the screen draws from the dataset (one forward pass each), never timed. The world
is tests/verify_util.py's (real tiny model, KJV corpus, batch 8 x 64, round 2).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest
import torch

from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.gain_stages import disagreement, stage_bounds
from tests.poison import PartialData, PoisonedCorpus, trigger_ids
from tests.verify_util import Counting, _fixed_identity, _packets, _plan, _train_round, world_fixture

# one intra-op thread (conftest's one_thread) for the screens too, not only the world's training: under make test's
# load (3 workers on 2 cores) spin-waiting OpenMP threads made each screen's CPU steps many times slower
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

world = pytest.fixture(scope="module", name="world")(world_fixture)

CFG = VT.VerifyConfig()
WHOLE = dataclasses.replace(CFG, gain_staged=False)
SEED = hashlib.sha256(b"s43").digest()


@pytest.fixture(scope="module")
def contributions(world):
    """A's candidates of round 2 (H = 10): honest, trained on B's batches, the backdoor poisoner's (its own copy of
    the corpus with the trigger as 16 % of its tokens: tests/poison.py), and its honest update flipped."""
    a = world.pid["A"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        poisoned = PoisonedCorpus(world.ds, trigger_ids(world.ds.vocab_size))
        poison = _train_round(world.base, poisoned, world.theta, world.b_state, 10, a)
    finally:
        torch.set_num_threads(threads)
    return {
        "honest": world.honest[10],
        "wrong data": world.wrong_data,
        "backdoor": poison,
        "flipped": -world.honest[10],
    }


def _screen(world, cfg, contribution, *, H=10, own_H=10):
    """Screener V (its own honest update of ``own_H`` steps: the power reference) screens A's ``contribution`` of
    round 2 (``H`` steps) from a fresh cache. Returns (stats, verdict, forward passes)."""
    v = _fixed_identity("screener-V")
    vid, a = str(v.peer_id), world.pid["A"]
    if own_H == 10:
        own = world.honest_of(vid)
    else:
        own = _train_round(world.base, world.ds, world.theta, world.b_state, own_H, vid)
    packets = _packets(world, contribution, H, extra={vid: own}, extra_H=own_H)
    plan = _plan(world, {"V": v}, steps={"A": H, "V": own_H})
    task = VT.derive_screen(
        cfg, plan=plan, verifier=vid, accused=a, seed=SEED, packets=packets, part_ranges=world.part_ranges
    )
    assert task is not None and task.steps_done == H
    ds = Counting(world.ds)
    stats, verdict = VC.screen_contribution(
        cfg, task, model=copy.deepcopy(world.base), dataset=ds, theta=world.theta, seed=0, packets=packets,
        lr=1e-3, weight_decay=0.1, plan=plan, checker=vid, cache={},
    )  # fmt: skip
    assert stats.gain is not None and (stats.gain.passes == ds.batches or not cfg.gain_staged)
    return stats, verdict, ds.batches


@pytest.fixture(scope="module")
def screened(world, contributions):
    """kind -> ((stats, verdict, passes) staged, the same unstaged)."""
    return {k: (_screen(world, CFG, c), _screen(world, WHOLE, c)) for k, c in contributions.items()}


def test_the_stage_bounds_keep_each_early_decision_within_1e_3_of_the_whole_screen():
    # the supremum over every true effect of P(a half decides one side, the whole finds the other)
    assert 9.5e-4 < disagreement(CFG.gain_stage_kappa) <= 1e-3
    assert disagreement(1.6) > 1e-3  # a smaller kappa would not hold the bound
    assert disagreement(CFG.gain_stage_kappa, drifts=[i * 0.05 - 6 for i in range(441)]) <= 1e-3  # a wider search
    k = CFG.gain_stage_kappa
    assert stage_bounds(CFG.gain_t_hard, k)[0] == pytest.approx(-0.649, abs=1e-3)  # a half fails below
    assert stage_bounds(CFG.gain_t_min, k)[1] == pytest.approx(2.947, abs=1e-3)  # a half passes at or above
    assert stage_bounds(CFG.gain_t_gap, k, 2**0.5)[1] == pytest.approx(4.186, abs=1e-3)  # the reference's gap, s = 1


def test_an_honest_newcomer_far_above_the_thresholds_passes_on_half_its_batches(screened):
    (stats, verdict, passes), (whole, whole_verdict, whole_passes) = screened["honest"]
    assert verdict.outcome == whole_verdict.outcome == VC.PASS and "decided on half its batches" in verdict.reason
    assert (stats.gain.k, stats.gain.m) == (4, 8) and stats.gain.t >= stage_bounds(CFG.gain_t_min, 1.71)[1]
    assert passes == 2 * (4 + 8) and whole_passes == 2 * (8 + 16)  # half the forward passes, no reference
    assert whole.gain.t >= CFG.gain_t_min


def test_a_clear_poisoner_fails_on_half_its_batches_and_half_the_reference(screened):
    """A's honest update flipped (the sign-flip attacker: it lowers the fit of its own batches)."""
    (stats, verdict, passes), (whole, whole_verdict, whole_passes) = screened["flipped"]
    assert verdict.outcome == whole_verdict.outcome == VC.FAIL and "decided on half its batches" in verdict.reason
    assert stats.gain.k == 4 and stats.gain.t < stage_bounds(CFG.gain_t_hard, 1.71)[0]
    # its half (2 x (4 + 8)) and the reference's half (4 before, 4 + 8 after: the controls' losses at theta are
    # kept) against the whole screen's 2 x (8 + 16) and the whole reference's 8 + 8 + 16
    assert passes == 24 + 16 <= 40 and whole_passes == 48 + 32
    assert whole.gain.t < CFG.gain_t_hard


@pytest.mark.parametrize("kind", ["backdoor", "wrong data"])
def test_a_case_no_half_decides_runs_the_whole_screen_with_the_same_t_to_the_bit(screened, kind):
    """The backdoor poisoner of tests/poison.py and a free rider on B's batches measure t around 0 here: their half
    is within the bounds, so the whole screen runs on the same rows (the same statistic as unstaged, to the bit,
    and the same verdict); only the reference is measured on its half (it clears the gap by far)."""
    (stats, verdict, passes), (whole, whole_verdict, whole_passes) = screened[kind]
    assert stats.gain == whole.gain and (stats.gain.k, stats.gain.m) == (8, 16)
    assert verdict.outcome == whole_verdict.outcome == VC.FAIL
    assert "power decided on half its own batches" in verdict.reason
    assert passes == 48 + 16 and whole_passes == 48 + 32


def test_no_honest_contribution_is_excluded(world, screened):
    for H in (10, 20):
        for cfg in (CFG, WHOLE):
            got = _screen(world, cfg, world.honest[H], H=H) if H != 10 else screened["honest"][cfg is WHOLE]
            stats, verdict, _ = got
            assert verdict.outcome == VC.PASS and stats.gain.t >= CFG.gain_t_min, (H, cfg.gain_staged, verdict)


def test_a_contribution_of_an_odd_number_of_batches_is_screened_whole(world):
    """H = 5: k = 5 batches, no halves of equal information (``gain_stages.can_stage``): the unstaged screen."""
    a = world.honest[5]
    v = _fixed_identity("screener-V")
    vid = str(v.peer_id)
    packets = _packets(world, a, 5, extra={vid: world.honest_of(vid)})
    plan = _plan(world, {"V": v}, steps={"A": 5})
    task = VT.derive_screen(
        CFG, plan=plan, verifier=vid, accused=world.pid["A"], seed=SEED, packets=packets, part_ranges=world.part_ranges
    )
    ds = Counting(world.ds)
    stats, verdict = VC.screen_contribution(
        CFG, task, model=copy.deepcopy(world.base), dataset=ds, theta=world.theta, seed=0, packets=packets,
        lr=1e-3, weight_decay=0.1, plan=plan, checker=vid, cache={},
    )  # fmt: skip
    assert stats.gain.k == 5 and ds.batches == 2 * (5 + 16) and verdict.outcome == VC.PASS


def test_a_reference_of_an_odd_number_of_batches_is_measured_whole(world, contributions, screened):
    """Session 43's first benchmark run: a screener that trained 5 steps (k = 5: its reference has no halves of
    equal information) took that for no reference at all and passed the poisoner as inconclusive. Its whole
    reference decides now, as unstaged."""
    stats, verdict, passes = _screen(world, CFG, contributions["backdoor"], own_H=5)
    whole, whole_verdict, whole_passes = _screen(world, WHOLE, contributions["backdoor"], own_H=5)
    assert verdict.outcome == whole_verdict.outcome == VC.FAIL and verdict.reason == whole_verdict.reason
    assert stats.gain == whole.gain == screened["backdoor"][0][0].gain  # the accused's whole test, as before
    assert passes == whole_passes == 48 + 2 * 5 + 16  # the reference: 5 + 5 + 16 (controls kept)


@pytest.mark.parametrize("trained", [[9], [7, 8, 9]], ids=["last step", "last quarter"])
def test_partial_work_does_not_pass_the_screen_staged_or_whole(world, trained):
    """Session 50: A trains only its last ``trained`` steps of 10 (the red team's way: the cheapest batches to train
    are the last) and claims all 10. A staged screen's half passes alone only when each of its settled batches shows a
    t of ``gain_low_stage``, so the whole test runs; its ``low`` (the settled batches' lower half, the screener's own
    honest contribution as the power reference) fails or marks it, staged and unstaged alike. Here: the last step
    alone measures whole t 1.65 and low 0.20 (marginal by both), the last three t 3.57 (a pass before) and low -0.46."""
    a = world.pid["A"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        partial = _train_round(world.base, PartialData(world.ds, trained), world.theta, world.b_state, len(trained), a)
    finally:
        torch.set_num_threads(threads)
    for cfg in (CFG, WHOLE):
        stats, verdict, _ = _screen(world, cfg, partial, H=10)
        assert stats.gain.low is not None and stats.gain.low < CFG.gain_low_min, stats.gain
        assert verdict.outcome in (VC.FAIL, VC.MARGINAL), (verdict, stats.gain)
        if stats.gain.low < CFG.gain_low_hard:
            assert verdict.outcome == VC.FAIL and "weakest settled batches show no loss gain" in verdict.reason
