"""The issue-28 red team's stealthy attacks in tests/adversary.py push exactly what they claim to: ``stealth-flip``
flips the sign of the 45% largest-magnitude coordinates (and no other), ``partial`` trains the last quarter of its
planned steps on those steps' batches and claims all of them."""

from types import SimpleNamespace

import pytest
import torch

import tests.adversary as adversary
from geomesh_p2p.model.training import InnerResult

pytestmark = pytest.mark.timeout(30)


def _stub(attack: str) -> SimpleNamespace:
    notes: list[tuple] = []
    return SimpleNamespace(
        attack=attack,
        me="attacker",
        forge_push="flip",
        _last_update=None,
        _rng=torch.Generator().manual_seed(0),
        _note=lambda r, kind, msg, *a, key="": notes.append((r, kind)),
        notes=notes,
    )


def test_stealth_flip_flips_exactly_the_largest_magnitude_share():
    d = torch.tensor([0.1, -3.0, 2.0, -0.5, 4.0, 0.2, -1.0, 0.05])
    # floor(0.45 x 8) = 3 coordinates: |4|, |-3|, |2| (indices 4, 1, 2)
    out = adversary.stealth_flip(d)
    assert out.equal(torch.tensor([0.1, 3.0, -2.0, -0.5, -4.0, 0.2, -1.0, 0.05]))
    assert d.tolist()[1] == -3.0  # the input is not modified
    assert adversary.STEALTH_SHARE == 0.45


def test_stealth_flip_breaks_ties_by_index_and_keeps_the_shape():
    d = torch.tensor([[1.0, -1.0], [1.0, -1.0]])
    out = adversary.stealth_flip(d, 0.5)  # 2 of 4 equal magnitudes: the first two indices
    assert out.shape == (2, 2)
    assert out.reshape(-1).tolist() == [-1.0, 1.0, 1.0, -1.0]
    assert adversary.stealth_flip(d, 0.0).equal(d)
    with pytest.raises(ValueError, match="share"):
        adversary.stealth_flip(d, 1.5)


def test_stealth_flip_push_keeps_the_honest_token_count_and_magnitudes():
    node = _stub("stealth-flip")
    d = torch.tensor([0.5, -0.25, 2.0, 1.0, -4.0, 0.125, 0.75, -0.0625, 3.0, -1.5])
    spec = SimpleNamespace(round=7, participants={"attacker": 99_999})
    out, claim = adversary.AdversaryNode.poison(node, spec, d, 1234)
    # floor(0.45 x 10) = 4: -4.0, 3.0, 2.0, -1.5 (indices 4, 8, 2, 9) flipped, the rest as trained
    assert out.tolist() == [0.5, -0.25, -2.0, 1.0, 4.0, 0.125, 0.75, -0.0625, -3.0, 1.5]
    assert claim == 1234
    assert out.abs().equal(d.abs())
    assert node.notes == [(7, "push")]


def test_partial_steps_is_the_last_quarter():
    assert adversary.PARTIAL_SHARE == 0.25
    assert adversary.partial_steps(8) == (6, 2)
    assert adversary.partial_steps(10) == (7, 3)  # ceil(2.5)
    assert adversary.partial_steps(1) == (0, 1)
    assert adversary.partial_steps(0) == (0, 0)
    with pytest.raises(ValueError):
        adversary.partial_steps(4, 0.0)


class _Corpus:
    def __init__(self):
        self.read: list[int] = []

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):  # noqa: A002
        self.read.append(step)
        return torch.full((batch_size, seq_len), step, dtype=torch.int64)


def test_partial_trains_the_last_steps_batches_and_reports_every_planned_step():
    corpus = _Corpus()
    node = _stub("partial")
    node.trainer = SimpleNamespace(dataset=corpus)
    node.run_cfg = SimpleNamespace(seq_len=16)
    asked: list[int] = []

    def honest_run(*, round, inner_steps, batch_size, micro_batch, deadline, progress, should_stop):
        asked.append(inner_steps)
        for k in range(inner_steps):  # the trainer reads step k's batch from its dataset
            node.trainer.dataset.sample_batch(
                seed=1, peer_id="attacker", round=round, step=k, batch_size=batch_size, seq_len=16
            )
        return InnerResult(
            steps_done=inner_steps,
            tokens=inner_steps * batch_size * 16,
            mean_loss=4.0,
            last_loss=4.0,
            compute_s=0.5,
            stopped_early=False,
        )

    res = adversary.AdversaryNode._partial_run(node, honest_run, 3, 12, 4, None, None, None, None)
    assert asked == [3]  # ceil(0.25 x 12)
    assert corpus.read == [9, 10, 11]  # the batches of the last 3 planned steps
    assert node.trainer.dataset is corpus  # the honest dataset is back
    assert (res.steps_done, res.tokens, res.compute_s) == (12, 12 * 4 * 16, 0.5)
    assert node.notes == [(3, "partial")]
    # what it pushes: its (partial) delta unchanged, claiming its whole budget
    d = torch.tensor([0.5, -1.0, 2.0])
    out, claim = adversary.AdversaryNode.poison(node, SimpleNamespace(round=3, participants={"attacker": 5000}), d, 768)
    assert out.tolist() == [0.5, -1.0, 2.0] and claim == 5000


def test_stealth_flip_equals_a_stable_sort_of_the_magnitudes_with_many_ties():
    d = torch.randint(-3, 4, (5000,), generator=torch.Generator().manual_seed(0)).float()
    k = int(0.45 * d.numel())
    top = torch.sort(d.abs(), descending=True, stable=True).indices[:k]
    want = d.clone()
    want[top] = -want[top]
    assert adversary.stealth_flip(d).equal(want)
    assert int((adversary.stealth_flip(d) != d).sum()) == int((d[top] != 0).sum())


def test_a_dodging_poisoner_claims_k_steps_of_its_planned_batch():
    node = _stub("poison")
    node.run_cfg = SimpleNamespace(seq_len=16)
    node.claim_steps, node._batch = 4, 8
    d = torch.tensor([0.5, -1.0, 2.0])
    spec = SimpleNamespace(round=3, participants={"attacker": 5000})
    out, claim = adversary.AdversaryNode.poison(node, spec, d, 20 * 8 * 16)  # trained 20 steps
    assert out.tolist() == [0.5, -1.0, 2.0] and claim == 4 * 8 * 16  # 4 steps' worth: below min_steps (5)
    node.claim_steps = 0  # off: what it trained, unchanged
    assert adversary.AdversaryNode.poison(node, spec, d, 2560)[1] == 2560
