"""Issue 14 #8: the inner learning rate follows the swarm's progress (round and share of the round's plan,
geomesh_p2p.model.training.swarm_lr_at), not a peer's own step counter. A joining or resumed peer at round R
trains at the rate of a peer that trained since round 0; an AWB peer planned more inner steps does not
decay sooner than one planned fewer."""

from __future__ import annotations

import zlib

import pytest
import torch

from geomesh_p2p.model.build import build_model
from geomesh_p2p.model.training import InnerTrainer, lr_at, swarm_lr_at

pytestmark = pytest.mark.timeout(60)

SEQ = 16
SCHEDULE = dict(lr=1e-3, warmup_steps=8, total_steps=40, min_lr_ratio=0.1)


class RandomTokens:
    """The part of TokenDataset the trainer uses: batches drawn from (seed, peer, round, step) alone."""

    vocab_size = 4096

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, peer_id, round, step)).encode()))
        return torch.randint(0, self.vocab_size, (batch_size, seq_len), generator=g)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core box: one intra-op thread keeps the runtime steady
    yield
    torch.set_num_threads(n)


def _trainer(peer: str, steps_per_round=4) -> InnerTrainer:
    model = build_model("tiny", vocab_size=RandomTokens.vocab_size, seed=0)
    return InnerTrainer(model, RandomTokens(), seq_len=SEQ, peer_id=peer, steps_per_round=steps_per_round, **SCHEDULE)


def _round_lrs(t: InnerTrainer, round: int, inner_steps: int) -> list[float]:
    """The learning rate of each inner step of one round (read after each step)."""
    lrs: list[float] = []
    res = t.run(
        round=round,
        inner_steps=inner_steps,
        batch_size=1,
        progress=lambda k, loss, tps: lrs.append(t.optimizer.param_groups[0]["lr"]),
    )
    assert res.steps_done == inner_steps
    return lrs


def test_a_joining_or_resumed_peer_at_round_r_trains_at_the_rate_of_a_peer_since_round_0():
    veteran = _trainer("veteran")
    for r in range(3):  # rounds 0..2: 12 inner steps, past the 8 steps of warm-up
        _round_lrs(veteran, r, 4)
    assert veteran.global_step == 12
    joiner = _trainer("joiner")  # a fresh trainer: joined (downloaded round 3's state) or resumed at round 3
    assert joiner.global_step == 0
    want = [swarm_lr_at(3, k, 4, steps_per_round=4, **SCHEDULE) for k in range(4)]
    assert _round_lrs(veteran, 3, 4) == want
    assert _round_lrs(joiner, 3, 4) == want
    # the per-peer counter the trainer used before restarted warm-up: 2.5e-4 at a fresh step 1 against 9.47e-4
    assert lr_at(1, **SCHEDULE) == pytest.approx(2.5e-4) and want[1] == pytest.approx(9.4687e-4, rel=1e-4)


def test_peers_planned_different_inner_steps_follow_one_schedule_of_the_round():
    fast, slow = _trainer("fast"), _trainer("slow")
    _round_lrs(fast, 0, 8)  # the fast peer has taken 4x the slow one's inner steps so far
    _round_lrs(slow, 0, 2)
    lf, ls = _round_lrs(fast, 1, 8), _round_lrs(slow, 1, 2)
    assert fast.global_step == 16 and slow.global_step == 4
    assert [lf[0], lf[4]] == ls  # steps at the same share of the round: the same rate, bitwise
    assert lf == [swarm_lr_at(1, k, 8, steps_per_round=4, **SCHEDULE) for k in range(8)]
    # and the same function of progress: share k/H of round r is reference step (r + k/H) * steps_per_round
    assert lf[6] == lr_at(1.75 * 4, **SCHEDULE)


def test_the_swarm_schedule_equals_the_old_one_for_a_peer_that_did_its_plan_since_round_0():
    for r in range(12):
        for k in range(4):
            assert swarm_lr_at(r, k, 4, steps_per_round=4, **SCHEDULE) == lr_at(r * 4 + k, **SCHEDULE)


def test_swarm_lr_values_and_errors():
    # warm-up is counted in reference steps: round 0 step 1 of 2 is reference step 2 of the 8 of warm-up
    assert swarm_lr_at(0, 1, 2, steps_per_round=4, **SCHEDULE) == pytest.approx(1e-3 * 3 / 8)
    assert swarm_lr_at(10, 0, 3, steps_per_round=4, **SCHEDULE) == pytest.approx(1e-4)  # past total_steps
    assert swarm_lr_at(2, 0, 0, steps_per_round=4, **SCHEDULE) == lr_at(8, **SCHEDULE)  # no plan: round start
    with pytest.raises(ValueError):
        swarm_lr_at(0, 0, 4, steps_per_round=0, **SCHEDULE)
    with pytest.raises(ValueError):
        _trainer("bad", steps_per_round=0)
    legacy = _trainer("legacy", steps_per_round=None)  # the simulator's per-trainer counter, unchanged
    assert _round_lrs(legacy, 5, 2) == [lr_at(0, **SCHEDULE), lr_at(1, **SCHEDULE)]
