"""Red team (session 39) on the reused gradient buffer and the turns of steps and check passes: a holder of the
round's aggregate the buffer's reuse does not see, and a check job that ends its worker while holding the turn."""

from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params, load_flat_, pseudo_gradient
from geomesh_p2p.model.grad_buffer import FlatGradBuffer, storage_shared
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.model.turns import Turns
from geomesh_p2p.trust import verify_check
from geomesh_p2p.trust.verify_queue import CheckJob, CheckQueue, Pacer

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

SEQ = 32


def _round(t: InnerTrainer, theta: torch.Tensor, r: int) -> torch.Tensor:
    load_flat_(t.model, theta)
    t.run(round=r, inner_steps=2, batch_size=4)
    return pseudo_gradient(t.model, theta, t.update_buffer())


def test_storage_shared_counts_a_holder_of_only_the_storage_object():
    """torch keeps one Python object per storage: a holder of ``agg.untyped_storage()`` alone (a zero-copy server,
    a writer handed the storage) left the C++ use count at 2, as if nothing held it."""
    t = torch.zeros(8)
    st = t.untyped_storage()
    assert storage_shared(t)
    del st
    assert not storage_shared(t)


def test_an_aggregate_held_by_its_storage_alone_is_not_overwritten_by_the_next_steps():
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    t = InnerTrainer(copy.deepcopy(base), ds, seq_len=SEQ, lr=1e-3, weight_decay=0.1, total_steps=50)
    _round(t, theta, 0)  # (the step that checks every parameter gets a gradient)
    agg = _round(t, theta, 1)
    n, kept = agg.numel(), agg.clone()
    held = agg.untyped_storage()  # the only reference a holder keeps
    del agg
    _round(t, theta, 2)  # the next round's steps zero and fill the gradients' buffer
    now = torch.empty(0).set_(held, 0, (n,))
    assert torch.equal(now, kept)


class _Killed(BaseException):
    """Not an Exception: what ends a thread (a cancellation, SystemExit) rather than a job's failure."""


def test_a_check_job_ended_by_a_base_exception_gives_the_turn_back():
    """A job that raised past ``except Exception`` ended the worker holding the check's turn: the inner steps
    (``with turns.step()``) then waited for ever."""
    turns = Turns()
    stop = threading.Event()
    q = CheckQueue(1.0, 4, pacer=Pacer(1.0, stop, turns=turns), stop=stop)
    entered = threading.Event()

    def job(pace):
        entered.set()
        raise _Killed()

    hook, seen = threading.excepthook, []
    threading.excepthook = lambda a: seen.append(a.exc_type)  # the worker's end is expected here
    try:
        q.submit(CheckJob(1, "check", job))
        assert entered.wait(30)
        q._thread.join(30)
        assert seen == [_Killed]
    finally:
        threading.excepthook = hook
    stepped = threading.Event()

    def step():
        with turns.step():
            stepped.set()

    s = threading.Thread(target=step, daemon=True)
    s.start()
    ok = stepped.wait(10)
    q.close()
    if not ok:  # let the stuck step thread end
        turns.give_check()
    s.join(10)
    assert ok and not turns.checking


class _Branchy(torch.nn.Module):
    """``b`` takes part in a step only when asked: a parameter that gets no gradient in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return (self.b(self.a(x)) if use_b else self.a(x)).square().mean()


def _train(flat: bool) -> torch.Tensor:
    torch.manual_seed(0)
    m = _Branchy()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    buf = FlatGradBuffer(list(m.parameters()), enabled=flat)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for use_b in (True, True, False, False):
        buf.zero(opt)
        m(x, use_b).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.b.parameters()])


def test_a_parameter_without_gradient_in_a_later_step_is_not_stepped():
    """Red team 39 (an xfail until session 40): steps 3 and 4 do not reach ``b``; with the buffer its gradient was
    a zeroed view and AdamW stepped it (decay, moments) where a None gradient skips it. The buffer's hooks set it to
    None before the step: the same weights to the bit, and ``b`` has no gradient after the last step."""
    torch.manual_seed(0)
    assert torch.equal(_train(True), _train(False))
    m = _Branchy()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    buf = FlatGradBuffer(list(m.parameters()))
    x = torch.randn(8, 4)
    for use_b in (True, True, False):
        buf.zero(opt)
        m(x, use_b).backward()
        opt.step()
    assert buf.enabled and buf.allocations >= 1
    assert all(p.grad is None for p in m.b.parameters()) and all(p.grad is not None for p in m.a.parameters())
    before = [p.detach().clone() for p in m.b.parameters()]
    buf.zero(opt)  # the views again, on the same buffer (nothing else holds it)
    m(x, False).backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m.b.parameters(), before))


def test_picked_gradients_after_an_oom_past_a_micro_batchs_hooks_and_no_hook_left_after_a_failure():
    """Verified work's post-accumulate hooks (verify_check._PickedGrads): an out-of-memory error on the second
    micro-batch, after the first one's hooks summed their picks, retries the batch without counting them twice;
    a failure that is no out-of-memory error leaves no hook on the check model (GPT-2's tied wte/lm_head
    included)."""
    ds = load_dataset(None, SEQ)
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    index = torch.cat([torch.arange(0, theta.numel(), 89), torch.tensor([theta.numel() - 1])])
    args = dict(seed=0, round=1, batch_size=4, seq_len=SEQ, index=index)
    streams = [("p0", 0), ("p0", 1)]
    want = verify_check.batch_gradients(copy.deepcopy(model), ds, theta, streams, micro_batch=1, **args)
    real, calls = model.forward, []

    def forward(*a, input_ids=None, **k):
        calls.append(input_ids.shape[0])
        if len(calls) == 2:  # the second micro-batch of 2 rows: the first one's backward ran its hooks
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(*a, input_ids=input_ids, **k)

    model.forward = forward  # type: ignore[method-assign]
    got = verify_check.batch_gradients(model, ds, theta, streams, micro_batch=2, **args)
    assert calls[:2] == [2, 2] and set(calls[2:]) == {1}
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())

    def broken(*a, input_ids=None, **k):
        raise ValueError("not an out-of-memory error")

    model.forward = broken  # type: ignore[method-assign]
    with pytest.raises(ValueError):
        verify_check.batch_gradients(model, ds, theta, streams, micro_batch=2, **args)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_an_out_of_memory_retry_does_not_keep_the_gradients_buffer_beside_fresh_gradients():
    """accumulate_fitting drops the gradients on an out-of-memory error and accumulates the batch again at half the
    micro-batch: the trainer kept the gradients' [P] buffer meanwhile, so the retry's backward allocated a second
    [P] of gradients beside it, on a peer that had just run out of memory (before the buffer: one [P])."""
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    t = InnerTrainer(copy.deepcopy(base), ds, seq_len=SEQ, lr=1e-3, weight_decay=0.1, total_steps=50)
    _round(t, theta, 0)
    _round(t, theta, 1)  # the buffer in use
    assert t.grads._buf is not None
    old = weakref.ref(t.grads._buf)
    real, alive = t.accumulate_grad, []

    def accumulate_grad(batch, mb):
        if not alive:
            alive.append(True)
            real(batch, mb)  # into the buffer's views, then out of memory
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
        alive.append(old() is not None)
        return real(batch, mb)

    t.accumulate_grad = accumulate_grad  # type: ignore[method-assign]
    load_flat_(t.model, theta)
    t.run(round=2, inner_steps=1, batch_size=4, micro_batch=4)
    assert alive[1:] == [False]  # freed before the retry's gradients were allocated
    assert t.max_micro_batch == 2
