"""Loss gain on assigned data (geomesh_p2p/trust/gain.py, issue 28): a contribution trained on its sender's
assigned batches lowers their loss more than control batches'; one trained on other text does not.

The real tiny model and the shipped KJV corpus (seq_len 64, batch 8), one DiLoCo round of warm-up, then A's
candidates at H = 10: honest, and wrong data (A's optimizer on B's batches: a free rider copying a peer, or a
poisoner's own corpus). Fixed seeds and one thread: the same values on every run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust import gain as G
from geomesh_p2p.trust.verify_task import CONTROL_STREAM
from tests.poison import PartialData

L, B, H, ROUND = 64, 8, 10, 1

pytestmark = pytest.mark.timeout(180)


def test_welch_t_exact_values():
    # means 2 and 0, variances 1 and 1, n = 3 each: t = 2 / sqrt(1/3 + 1/3)
    assert G.welch_t([1.0, 2.0, 3.0], [-1.0, 0.0, 1.0]) == pytest.approx(2 / (2 / 3) ** 0.5, rel=1e-12)
    assert G.welch_t([1.0, 1.0], [1.0, 1.0]) == 0.0  # no spread, no difference: nothing to weigh
    with pytest.raises(ValueError, match="needs >= 2 values"):
        G.welch_t([1.0], [1.0, 2.0])


#: partial-work candidates: the steps of its H = 10 each trains (claiming all 10): the red team's last step only (10%
#: of the work), and a quarter (3 of 10, the last settled one and two the gain test's last 4 steps hold)
PARTIAL = {"partial-last": [9], "partial-quarter": [5, 7, 8]}


@pytest.fixture(scope="module")
def world():
    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.build import build_model, flat_params, load_flat_
    from geomesh_p2p.model.training import InnerTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = load_dataset(None, seq_len=L)
        base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
        theta = flat_params(base)

        def trainer(model, pid):
            return InnerTrainer(model, ds, seq_len=L, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id=pid)

        a = trainer(copy.deepcopy(base), "A")
        a.run(round=0, inner_steps=H, batch_size=B)  # warm-up: A's AdamW state, as a peer has after a round
        theta = theta - compression.decode(compression.encode(theta - flat_params(a.model), 2048, 0))

        def train(data_of: str) -> torch.Tensor:
            m = copy.deepcopy(a.model)
            load_flat_(m, theta)
            t = trainer(m, data_of)
            t.load_state_dict(copy.deepcopy(a.state_dict()))
            t.run(round=ROUND, inner_steps=H, batch_size=B)
            return compression.decode(compression.encode(theta - flat_params(m), 2048, 0))  # as owners get it

        def train_only(steps: list[int]) -> torch.Tensor:
            """A's optimizer on only ``steps`` of its H batches, in order (partial work: it claims all H)."""
            m = copy.deepcopy(a.model)
            load_flat_(m, theta)
            t = InnerTrainer(
                m, PartialData(ds, steps), seq_len=L, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id="A"
            )
            t.load_state_dict(copy.deepcopy(a.state_dict()))
            t.run(round=ROUND, inner_steps=len(steps), batch_size=B)
            return compression.decode(compression.encode(theta - flat_params(m), 2048, 0))

        cands = {"honest": train("A"), "wrong-data": train("B")}
        for name, steps in PARTIAL.items():
            cands[name] = train_only(steps)
        yield ds, base, theta, cands
    finally:
        torch.set_num_threads(threads)


def _stats(world, name: str, *, keep: slice = slice(None)) -> G.GainStats:
    ds, base, theta, cands = world
    d = torch.zeros_like(theta)
    d[keep] = cands[name][keep]
    assigned = [("A", j) for j in range(0, H, 2)] + [("A", 1), ("A", 3), ("A", 5)]
    controls = [(CONTROL_STREAM, i) for i in range(8)]
    return G.gain_stats(
        copy.deepcopy(base), ds, theta, d, assigned, controls, seed=0, round=ROUND, batch_size=B, seq_len=L
    )


def test_an_honest_contribution_gains_more_on_its_assigned_batches_than_on_controls(world):
    s = _stats(world, "honest")
    assert (s.k, s.m) == (8, 8)
    assert s.assigned > s.control and s.excess > 0.02 and s.t > 3.0, s


def test_a_contribution_trained_on_other_text_shows_no_excess(world):
    honest, wrong = _stats(world, "honest"), _stats(world, "wrong-data")
    assert wrong.t < 2.0 and wrong.excess < 0.5 * honest.excess, (wrong, honest)


def test_the_gain_of_the_checked_parts_only_still_separates(world):
    """A check that holds some of the parts applies those only (zero elsewhere)."""
    half = slice(0, world[2].numel() // 2)
    honest, wrong = _stats(world, "honest", keep=half), _stats(world, "wrong-data", keep=half)
    assert honest.t > 2.0 > wrong.t, (honest, wrong)


def test_bad_inputs_are_refused(world):
    ds, base, theta, cands = world
    with pytest.raises(ValueError, match=">= 2 batches a side"):
        G.gain_stats(base, ds, theta, cands["honest"], [("A", 0)], [("c", 0), ("c", 1)], **_kw())
    with pytest.raises(TimeoutError, match="past the deadline"):
        G.gain_stats(
            copy.deepcopy(base),
            ds,
            theta,
            cands["honest"],
            [("A", 0), ("A", 1)],
            [("c", 0), ("c", 1)],
            **_kw(),
            deadline=1.0,
        )


def _kw() -> dict:
    return dict(seed=0, round=ROUND, batch_size=B, seq_len=L)


def test_the_per_batch_statistic_exact_values():
    """``lower_t`` sorts the batches by mean gain and takes Welch's t of the lower half's rows (at least 2 batches)
    against every control row; ``settled_low`` keeps only the batches ``settle`` steps or more before the claim's
    end."""
    ctrl = [[0.0, 1.0], [-1.0, 0.0]]  # rows -1, 0, 0, 1: mean 0, variance 2/3
    batches = [[5.0, 6.0], [1.0, 2.0], [9.0, 9.0], [2.0, 3.0]]  # means 5.5, 1.5, 9, 2.5: the lowest two 1.5, 2.5
    low = [1.0, 2.0, 2.0, 3.0]  # their rows: mean 2, variance 2/3
    assert G.lower_t(batches, ctrl) == pytest.approx(2.0 / (2 / 3 / 4 + 2 / 3 / 4) ** 0.5, rel=1e-12)
    assert G.lower_t(batches, ctrl) == G.welch_t(low, [-1.0, 0.0, 0.0, 1.0]) == G.lower_t(batches[::-1], ctrl)
    # the lower three of six (ceil of half), a tie at the boundary taken in the order given
    six = batches + [[1.5, 1.5], [2.5, 2.5]]
    assert G.lower_t(six, ctrl) == G.welch_t([1.0, 2.0, 1.5, 1.5, 2.0, 3.0], [0.0, 1.0, -1.0, 0.0])
    # a claim of 10 steps, settle 4: steps 8 and 9 are not settled (the lowest two then are 5.5 and 9's batches)
    assert G.settled_low(batches, ctrl, [0, 8, 3, 9], 10, 4, 0.5) == G.welch_t([5.0, 6.0, 9.0, 9.0], [0, 1, -1, 0])
    assert G.settled_low(batches, ctrl, [0, 7, 8, 9], 10, 4, 0.5) is None  # one settled batch: not measured
    assert G.settled_low(batches, ctrl, [0, 1, 2, 3], 0, 4, 0.5) is None  # steps unknown
    g = G.gain_of(batches, ctrl, steps=10, at=[0, 1, 2, 3])
    assert g.low == G.lower_t(batches, ctrl) and G.gain_of(batches, ctrl).low is None
    with pytest.raises(ValueError, match=">= 2 batches a side"):
        G.lower_t(batches, ctrl[:1])


def _low(world, name: str) -> G.GainStats:
    """The test on 8 of the H = 10 steps with the claim's steps: ``low`` over the settled ones (0-5)."""
    ds, base, theta, cands = world
    assigned = [("A", j) for j in (0, 1, 2, 3, 4, 5, 7, 9)]
    controls = [(CONTROL_STREAM, i) for i in range(16)]
    return G.gain_stats(
        copy.deepcopy(base), ds, theta, cands[name], assigned, controls, seed=0, round=ROUND, batch_size=B, seq_len=L,
        steps=H,
    )  # fmt: skip


def test_partial_work_fails_batch_by_batch_where_honest_work_passes(world):
    """The red team's free rider (session 15: its last step of H only, all H claimed) and one that trained a quarter
    of its batches: each drawn settled batch must show its own gain (gain_batches), and theirs do not."""
    from geomesh_p2p.trust.gain_batches import low_outcome
    from geomesh_p2p.trust.verify_task import VerifyConfig

    cfg = VerifyConfig()
    honest = _low(world, "honest")
    assert honest.t >= cfg.gain_t_min and honest.low is not None and honest.low >= cfg.gain_low_min + 1.0, honest
    assert low_outcome(cfg, honest, honest) is None
    for name in PARTIAL:
        part = _low(world, name)
        assert part.low is not None and part.low < cfg.gain_low_hard, (name, part)
        # against the honest contribution as the power reference: a hard failure (when its whole t passes)
        if part.t >= cfg.gain_t_min:
            assert low_outcome(cfg, part, honest) == ("fail", low_outcome(cfg, part, honest)[1]), part
        assert honest.low >= part.low + cfg.gain_t_gap, (honest, part)
