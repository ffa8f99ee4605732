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

L, B, H, ROUND = 64, 8, 10, 1

pytestmark = pytest.mark.timeout(180)


def test_welch_t_exact_values():
    # means 2 and 0, variances 1 and 1, n = 3 each: t = 2 / sqrt(1/3 + 1/3)
    assert G.welch_t([1.0, 2.0, 3.0], [-1.0, 0.0, 1.0]) == pytest.approx(2 / (2 / 3) ** 0.5, rel=1e-12)
    assert G.welch_t([1.0, 1.0], [1.0, 1.0]) == 0.0  # no spread, no difference: nothing to weigh
    with pytest.raises(ValueError, match="needs >= 2 values"):
        G.welch_t([1.0], [1.0, 2.0])


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

        yield ds, base, theta, {"honest": train("A"), "wrong-data": train("B")}
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
