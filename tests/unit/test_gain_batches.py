"""The loss-gain test batch by batch (geomesh_p2p/trust/gain_batches.py, issue 28, session 50): on hand-made
statistics, where the per-batch rule fails, marks, stays silent, and what a re-check must show to refute it. The real
tiny model's values are in tests/unit/test_gain.py (test_partial_work_fails_batch_by_batch_where_honest_work_passes).
"""

from __future__ import annotations

import dataclasses

import pytest

from geomesh_p2p.trust import gain as G
from geomesh_p2p.trust import gain_batches as GB
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT

pytestmark = pytest.mark.timeout(60)

CFG = VT.VerifyConfig()
TASK = VT.VerifyTask(round=3, verifier="v", accused="a", parts=(0,), ranges=((0, 10),), steps_done=20, steps=(),
                     controls=4, batch_size=8, seq_len=64, element_seed=1, n_elements=0, full_test=False,
                     kind=VT.SCREEN)  # fmt: skip
#: the red team's free rider (session 15): its whole t passes, its settled batches' lower half shows nothing
PARTIAL = G.GainStats(assigned=0.40, control=0.37, t=3.30, k=8, m=16, steps=20, low=-1.2)
HONEST_REF = G.GainStats(assigned=0.45, control=0.35, t=9.0, k=8, m=16, steps=20, low=6.0)


def test_the_config_holds_the_measured_thresholds():
    assert (CFG.gain_settle_steps, CFG.gain_low_share) == (4, 0.5)
    assert (CFG.gain_low_hard, CFG.gain_low_min, CFG.gain_low_stage) == (0.0, 0.25, 1.0)


def test_partial_work_fails_a_screen_only_with_power_batch_by_batch():
    v = VC.judge_screen(CFG, TASK, PARTIAL, HONEST_REF)
    assert v.outcome == VC.FAIL and "its weakest settled batches show no loss gain: low t -1.20" in v.reason, v
    marginal = dataclasses.replace(PARTIAL, low=0.1)  # between gain_low_hard and gain_low_min
    assert VC.judge_screen(CFG, TASK, marginal, HONEST_REF).outcome == VC.MARGINAL
    # no reference, or one without the gap (its low < -1.2 + 2.5): inconclusive, a pass
    for ref in (None, dataclasses.replace(HONEST_REF, low=1.29), dataclasses.replace(HONEST_REF, low=None)):
        v = VC.judge_screen(CFG, TASK, PARTIAL, ref)
        assert v.outcome == VC.PASS and v.reason.startswith("inconclusive: low t -1.20"), (ref, v)
    assert VC.judge_screen(CFG, TASK, PARTIAL, dataclasses.replace(HONEST_REF, low=1.30)).outcome == VC.FAIL
    # a reference of more steps is scaled as the t's is: 40 steps at low 2.0 is 2.0 x sqrt(20/40) = 1.41 >= 1.3
    far = dataclasses.replace(HONEST_REF, steps=40, low=2.0)
    assert GB.low_power(CFG, PARTIAL, far) and not GB.low_power(CFG, PARTIAL, dataclasses.replace(far, low=1.8))
    # a staged screen's decision on its references stands for the reference's low (judge_screen's low_power)
    assert VC.judge_screen(CFG, TASK, PARTIAL, None, low_power=True).outcome == VC.FAIL
    assert VC.judge_screen(CFG, TASK, PARTIAL, HONEST_REF, low_power=False).outcome == VC.PASS
    # under the token floor nothing decides (20 steps of 2 x 32: 1,280 tokens)
    small = dataclasses.replace(TASK, batch_size=2, seq_len=32)
    assert VC.judge_screen(CFG, small, PARTIAL, HONEST_REF).outcome == VC.PASS


def test_the_per_batch_rule_leaves_the_whole_t_its_own_cases():
    # a whole t below gain_t_hard is the t's rule (here: no power, inconclusive), whatever low says
    low_t = dataclasses.replace(PARTIAL, t=1.0)
    assert GB.low_outcome(CFG, low_t, HONEST_REF) is None
    # a marginal whole t (1.6) with a hard per-batch failure fails hard, even where the t has no power of its own
    marginal_t = dataclasses.replace(PARTIAL, t=1.6)
    assert VC.judge_screen(CFG, TASK, marginal_t, None, low_power=True).outcome == VC.FAIL
    assert VC.judge_screen(CFG, TASK, dataclasses.replace(marginal_t, low=0.1), HONEST_REF).outcome == VC.MARGINAL
    # low passing, or not measured (fewer than 2 settled batches drawn; hand-made values): the rule is silent
    for low in (CFG.gain_low_min, None):
        g = dataclasses.replace(PARTIAL, low=low)
        assert GB.low_outcome(CFG, g, HONEST_REF) is None
        assert VC.judge_screen(CFG, TASK, g, HONEST_REF).reason.startswith("gain t 3.30")


def test_a_full_check_fails_partial_work_after_its_sign_statistics_pass():
    full = dataclasses.replace(TASK, kind=VT.CHECK, full_test=True)
    stats = VC.WorkStats(plain=0.7, trace=0.6, basis=5, gain=PARTIAL)
    got = VC.judge(CFG, full, stats, all_zero=False, max_scale=0.0, bound=1.0, reference=HONEST_REF)
    assert got.outcome == VC.FAIL and "trained a part of the batches its 20 steps claim" in got.reason, got
    assert VC.judge(CFG, full, stats, all_zero=False, max_scale=0.0, bound=1.0, reference=None).outcome == VC.PASS


def test_a_recheck_refutes_a_hard_accusation_only_when_both_statistics_pass_with_margin():
    m = CFG.gain_refute_margin
    ok = dataclasses.replace(HONEST_REF, t=CFG.gain_t_min + m, low=CFG.gain_low_min + m)
    assert CFG.gain_refutes(None) and CFG.gain_refutes(ok) and CFG.gain_refutes(dataclasses.replace(ok, low=None))
    assert not CFG.gain_refutes(dataclasses.replace(ok, low=CFG.gain_low_min + m - 0.01))
    assert not CFG.gain_refutes(PARTIAL)  # its whole t alone (3.30) used to refute a per-batch accusation


def test_a_staged_half_passes_alone_only_when_each_settled_batch_shows_its_own_excess():
    order = (3, 17, 0, 9, 12, 5, 19, 1)  # drawn order; claim 20: steps 16-19 are not settled
    assert GB.settled_count(order, 20, CFG) == 6
    ctrl = [[0.0, 1.0], [-1.0, 0.0]]  # rows -1, 0, 0, 1: mean 0, variance 2/3
    # each batch [x, x + 1]: Welch's t against the controls = (x + 0.5) / sqrt(0.5 / 2 + (2/3) / 4)
    se = (0.5 / 2 + (2 / 3) / 4) ** 0.5
    at_bound = CFG.gain_low_stage * se - 0.5 + 1e-9  # (a hair above: the float t at the bound)
    half = [[at_bound, at_bound + 1.0], [5.0, 6.0], [-9.0, -8.0], [4.0, 5.0]]  # steps 3, 17, 0, 9 (17: not settled)
    assert not GB.half_may_pass(CFG, half, ctrl, [3, 17, 0, 9], order, 20)  # step 0's batch shows nothing
    half[2] = [4.0, 5.0]
    assert GB.half_may_pass(CFG, half, ctrl, [3, 17, 0, 9], order, 20)
    half[0] = [at_bound - 0.01, at_bound + 0.99]
    assert not GB.half_may_pass(CFG, half, ctrl, [3, 17, 0, 9], order, 20)
    # only its unsettled step 17 shows nothing: it passes; a half without a settled batch does not (the whole decides)
    assert GB.half_may_pass(CFG, [[5.0, 6.0], [-9.0, -8.0]], ctrl, [3, 17], order, 20)
    assert not GB.half_may_pass(CFG, [[5.0, 6.0], [5.0, 6.0]], ctrl, [17, 19], order, 20)
    # a claim of 5 (one settled step): the whole test measures no low, so the half's t decides as before
    assert GB.half_may_pass(CFG, [[-9.0, -8.0], [-9.0, -8.0]], ctrl, [0, 1], (0, 1, 2, 3, 4), 5)
