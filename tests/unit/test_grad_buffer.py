"""The gradients and the round's pseudo-gradient in one reused [P] (issue 27, session 39): the same bits as fresh
tensors every round, the same storage across rounds while nothing else holds it, a fresh one while something does."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params, load_flat_, pseudo_gradient
from geomesh_p2p.model.grad_buffer import FlatGradBuffer, storage_shared
from geomesh_p2p.model.training import InnerTrainer

# one intra-op thread (conftest's one_thread): spin-waiting OpenMP threads under make test's load made this
# file's CPU steps many times slower (CI: 59 s / 36 s for its slowest test); the assertions compare bits of runs in
# the same process, so they hold at any thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

SEQ = 32


def _trainer(base, ds, flat: bool) -> InnerTrainer:
    t = InnerTrainer(copy.deepcopy(base), ds, seq_len=SEQ, lr=1e-3, weight_decay=0.1, total_steps=50)
    t.grads.enabled = t.grads.enabled and flat
    return t


def _round(t: InnerTrainer, theta: torch.Tensor, r: int, micro_batch=None) -> torch.Tensor:
    load_flat_(t.model, theta)
    t.run(round=r, inner_steps=3, batch_size=4, micro_batch=micro_batch)
    return pseudo_gradient(t.model, theta, t.update_buffer())


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_bitwise_equal_to_fresh_tensors_and_reused_across_rounds(micro_batch):
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    flat, fresh = _trainer(base, ds, True), _trainer(base, ds, False)
    assert flat.grads.enabled and fresh.update_buffer() is None
    ptrs = []
    for r in range(3):
        d_flat, d_fresh = _round(flat, theta, r, micro_batch), _round(fresh, theta, r, micro_batch)
        assert torch.equal(d_flat, d_fresh)  # the pseudo-gradient: bitwise equal
        assert torch.equal(flat_params(flat.model), flat_params(fresh.model))  # the weights after the steps
        for (_, a), (_, b) in zip(flat.model.named_parameters(), fresh.model.named_parameters()):
            sa, sb = flat.optimizer.state[a], fresh.optimizer.state[b]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert all(p.grad is None for p in flat.model.parameters())  # released after the steps, as before
        if r > 0:  # the first run's first step finds out that every parameter gets a gradient
            ptrs.append(d_flat.data_ptr())
        theta = theta - 0.5 * d_flat  # a stand-in outer step; the round's buffer is let go below
        del d_flat, d_fresh
    # rounds 1 and 2: one buffer, its storage the gradients' during the steps
    assert len(set(ptrs)) == 1 and flat.grads.allocations == 1


def test_a_held_update_is_never_overwritten():
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    t = _trainer(base, ds, True)
    _round(t, theta, 0)  # (the check step)
    held = _round(t, theta, 1)  # e.g. the update log keeps the round's aggregate until it is spilled
    kept = held.clone()
    nxt = _round(t, theta, 2)
    assert nxt.data_ptr() != held.data_ptr() and torch.equal(held, kept)
    assert t.grads.allocations == 2


def test_the_next_steps_wait_for_a_holder_that_lets_go_and_reuse_the_buffer():
    # Issue 27 (session 45): the outer update's spill holds the aggregate (this buffer) past the commit; the next
    # steps call wait_release (the node: UpdateLog.wait_spilled) before they would make a second [P]
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    t = _trainer(base, ds, True)
    _round(t, theta, 0)  # (the check step)
    holder = {"update": _round(t, theta, 1)}
    ptr, kept, calls = holder["update"].data_ptr(), holder["update"].clone(), []

    def spilled() -> None:  # the write ends: the log keeps no tensor of it
        calls.append(torch.equal(holder.pop("update"), kept))

    t.grads.wait_release = spilled
    assert _round(t, theta, 2).data_ptr() == ptr  # (not kept: the buffer is free for the next round)
    assert calls == [True] and t.grads.allocations == 1
    _round(t, theta, 3)  # nothing holds it this time: no call
    assert calls == [True] and t.grads.allocations == 1
    held = _round(t, theta, 4)
    t.grads.wait_release = lambda: calls.append("timed out")  # a holder that does not let go in time: a fresh one
    nxt = _round(t, theta, 5)
    assert calls == [True, "timed out"] and nxt.data_ptr() != held.data_ptr() and t.grads.allocations == 2


def test_storage_shared():
    t = torch.zeros(8)
    assert not storage_shared(t)
    v = t[2:4]
    assert storage_shared(t)
    del v
    a = t.numpy()
    assert storage_shared(t)
    del a
    assert not storage_shared(t)


def test_off_for_a_parameter_without_gradient_and_off_the_cpu_layouts():
    lin, unused = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.ones(3))
    params = [*lin.parameters(), unused]
    opt = torch.optim.AdamW(params)
    g = FlatGradBuffer(params)
    g.zero(opt)  # first step: gradients unknown, set to None as before
    lin(torch.ones(2, 4)).sum().backward()
    g.zero(opt)  # the unused parameter got no gradient: zeros would make AdamW decay it
    assert not g.enabled and unused.grad is None and g.take() is None
    assert not FlatGradBuffer([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]).enabled
