"""Out of memory is a condition, not a crash (issue 27): inner steps, ddp's gradient, evaluation and verified
work run out of memory (injected: a CUDA out-of-memory error above a micro-batch cap) and go on in smaller
micro-batches, with the same data; below one row the steps done are contributed."""

from __future__ import annotations

import logging

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.model.device import is_oom
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.trust import verify_check

SEQ = 32
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return load_dataset(None, seq_len=SEQ, cache_dir=tmp_path_factory.mktemp("gmcache"))


def _trainer(ds) -> InnerTrainer:
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    return InnerTrainer(model, ds, seq_len=SEQ, lr=1e-3, warmup_steps=0, total_steps=100, seed=0, peer_id="p0")


def _oom_above(trainer: InnerTrainer, cap: int, calls: list[int]) -> None:
    """Make the trainer's accumulation raise CUDA's out-of-memory error for micro-batches above ``cap``."""
    real = trainer.accumulate_grad

    def accumulate(batch, micro_batch=None):
        mb = micro_batch or batch.shape[0]
        calls.append(mb)
        if mb > cap:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(batch, micro_batch)

    trainer.accumulate_grad = accumulate  # type: ignore[method-assign]


def test_oom_is_recognised_on_cuda_and_cpu():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


def test_inner_steps_halve_the_micro_batch_and_train_on_the_same_data(ds, caplog):
    hit, ref = _trainer(ds), _trainer(ds)
    calls: list[int] = []
    _oom_above(hit, 2, calls)
    with caplog.at_level(logging.WARNING, logger="geomesh_p2p.model.training"):
        res = hit.run(round=0, inner_steps=3, batch_size=8, micro_batch=8)
    want = ref.run(round=0, inner_steps=3, batch_size=8, micro_batch=2)
    assert (res.steps_done, res.tokens, res.stopped_early) == (3, 3 * 8 * SEQ, False)
    assert hit.max_micro_batch == 2 and calls == [8, 4, 2, 2, 2]  # capped after the first step's halvings
    assert torch.equal(flat_params(hit.model), flat_params(ref.model))  # bitwise: same batches, same splits
    assert res.mean_loss == want.mean_loss
    oom = [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert [r.levelno for r in oom] == [logging.WARNING, logging.WARNING]
    assert "at micro-batch 8" in oom[0].getMessage() and "continuing at 4" in oom[0].getMessage()


def test_out_of_memory_at_one_row_contributes_the_steps_done(ds, caplog):
    hit, ref = _trainer(ds), _trainer(ds)
    calls: list[int] = []
    real = hit.accumulate_grad

    def after_one_step(batch, micro_batch=None):
        calls.append(micro_batch or batch.shape[0])
        if len(calls) > 1:  # the owner of the GPU started something else after the first step
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(batch, micro_batch)

    hit.accumulate_grad = after_one_step  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="geomesh_p2p.model.training"):
        res = hit.run(round=0, inner_steps=4, batch_size=4, micro_batch=4)
    ref.run(round=0, inner_steps=1, batch_size=4, micro_batch=4)
    assert (res.steps_done, res.stopped_early) == (1, True) and calls == [4, 4, 2, 1]
    assert torch.equal(flat_params(hit.model), flat_params(ref.model))
    assert all(p.grad is None for p in hit.model.parameters())
    assert "contributing the 1 inner step(s) done" in caplog.text


def test_ddp_gradient_and_evaluation_go_on_at_smaller_batches(ds):
    hit, ref = _trainer(ds), _trainer(ds)
    _oom_above(hit, 1, [])
    g, res = hit.gradient(round=0, batch_size=4, micro_batch=4)
    g_ref, _ = ref.gradient(round=0, batch_size=4, micro_batch=1)
    assert res.steps_done == 1 and torch.equal(g, g_ref)
    # evaluation: out of memory above 2 rows a batch; the same held-out rows, in batches of 2
    ev, ev_ref = _trainer(ds), _trainer(ds)
    real = ev.model.forward

    def forward(*a, input_ids=None, **k):
        if input_ids is not None and input_ids.shape[0] > 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
        return real(*a, input_ids=input_ids, **k)

    ev.model.forward = forward  # type: ignore[method-assign]
    ppl = ev.evaluate(max_batches=3, batch_size=8)
    assert ppl == pytest.approx(ev_ref.evaluate(max_batches=3, batch_size=8), rel=1e-5)
    assert ppl == pytest.approx(ev_ref.evaluate(max_batches=12, batch_size=2), rel=1e-5)


def test_verified_work_batches_go_on_at_smaller_micro_batches(ds):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    index = torch.arange(0, theta.numel(), 97)
    args = dict(seed=0, round=1, batch_size=4, seq_len=SEQ, index=index)
    streams = [("p0", 0), ("p0", 1)]
    want = verify_check.batch_gradients(build_model("tiny", vocab_size=ds.vocab_size), ds, theta, streams, **args)
    real = model.forward
    rows: list[int] = []

    def forward(*a, input_ids=None, **k):
        rows.append(input_ids.shape[0])
        if input_ids.shape[0] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(*a, input_ids=input_ids, **k)

    model.forward = forward  # type: ignore[method-assign]
    got = verify_check.batch_gradients(model, ds, theta, streams, micro_batch=4, **args)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    assert rows == [4, 2] + [1] * 8  # halved twice on the first batch, then one row at a time for both


def test_a_cap_from_a_moment_of_memory_pressure_is_raised_again(ds, caplog):
    """Red team: three allocations that failed once left the peer at micro-batch 1 (and max batch 1) for the
    rest of the process. After clean steps at the cap, twice the cap is tried again; a try that runs out of
    memory again halves it back and doubles the wait."""
    passing = _trainer(ds)
    calls: list[int] = []
    real = passing.accumulate_grad
    fails = iter([True, True])  # the other job on the device ends after two allocations

    def transient(batch, micro_batch=None):
        calls.append(micro_batch or batch.shape[0])
        if next(fails, False):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(batch, micro_batch)

    passing.accumulate_grad = transient  # type: ignore[method-assign]
    passing._cap_retry_after = 2
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.model.training"):
        res = passing.run(round=0, inner_steps=6, batch_size=8, micro_batch=8)
    assert res.steps_done == 6 and calls == [8, 4, 2, 2, 4, 4, 8, 8] and passing.max_micro_batch is None
    assert caplog.text.count("trying micro-batch") == 2
    # memory that stays short: the try at 4 fails, the cap returns to 2 and the next try waits 4 clean steps
    short = _trainer(ds)
    calls2: list[int] = []
    _oom_above(short, 2, calls2)
    short._cap_retry_after = 2
    short.run(round=0, inner_steps=8, batch_size=8, micro_batch=8)
    assert calls2 == [8, 4, 2, 2, 4, 2, 2, 2, 2, 4, 2, 2] and short.max_micro_batch == 2
    assert short._cap_retry_after == 8
