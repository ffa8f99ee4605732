"""The outer momentum clip (RunConfig.outer_momentum_clip, geomesh_p2p.model.optim): the exact clamp, the same
bits on every path, and the one-round perplexity spike it removes from a young swarm at 2 inner steps per round
(benchmarks/outer_stability.py is the longer run)."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import aggregate_part
from geomesh_p2p.model import optim
from geomesh_p2p.model.build import build_model, flat_params, load_flat_, pseudo_gradient
from geomesh_p2p.model.optim import OuterNesterov, eager_start, outer_step_per_part
from geomesh_p2p.model.training import InnerTrainer

pytestmark = pytest.mark.timeout(60)


def test_clip_on_crafted_input():
    """buf = μ·buf + g, then clamped to ±c·max|g| of its block; the step uses the clamped momentum."""
    o = OuterNesterov(lr=0.5, momentum=0.5, momentum_clip=2.0, block_size=4)
    o.buf = torch.tensor([10.0, -10.0, 0.5, 0.0, 3.0, 3.0, -3.0, 0.0, 7.0])
    g = torch.tensor([1.0, 0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    theta = torch.zeros(9)
    o.step(theta, g)
    # block 0: bound 2·1 = 2; block 1: g = 0 there, bound 0 (no momentum where the aggregate says nothing);
    # the short last block: bound 2·0.5 = 1
    assert o.buf.tolist() == [2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert theta.tolist() == [-1.0, 0.25, 0.125, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    off = OuterNesterov(lr=0.5, momentum=0.5)
    off.buf = torch.tensor([10.0, -10.0, 0.5, 0.0, 3.0, 3.0, -3.0, 0.0, 7.0])
    off.step(torch.zeros(9), g)
    assert off.buf[0] == 6.0  # off: the plain DiLoCo step


def test_clip_bitwise_equal_on_every_path(monkeypatch):
    """Fused parts (chunks not aligned to the blocks), the copy-and-check path and the whole-vector step give the
    same bits; the parts start on codec blocks, as the compressed methods' parts do."""
    B = 2048
    p = 3 * optim.FUSED_BLOCK + 5 * B + 77
    g = torch.Generator().manual_seed(1)
    theta0, buf0 = torch.randn(p, generator=g), torch.randn(p, generator=g) * 1e-2
    agg = torch.randn(p, generator=g) * 1e-3
    ranges = [(0, 7 * B), (7 * B, 150 * B), (150 * B, p)]

    def fresh():
        o = OuterNesterov(0.7, 0.9, momentum_clip=2.0, block_size=B)
        o.buf = buf0.clone()
        return theta0.clone(), o

    t1, o1 = fresh()
    o1.step(t1, agg)
    t2, o2 = fresh()
    outer_step_per_part(o2, t2, agg, ranges, 0)
    monkeypatch.setattr(optim, "FUSED_BOUND", -1.0)
    t3, o3 = fresh()
    outer_step_per_part(o3, t3, agg, ranges, 0)
    for t, o in ((t2, o2), (t3, o3)):
        assert torch.equal(t, t1) and torch.equal(o.buf, o1.buf)
    assert not torch.equal(o1.buf, buf0 * 0.9 + agg)  # the clip did clamp something
    x = eager_start(theta0, buf0, agg, 1.0, lr=0.7, momentum=0.9, momentum_clip=2.0, block_size=B)
    assert torch.equal(x, t1)


def _young_swarm(clip: float, rounds: int) -> list[float]:
    """3 peers x 2 inner steps of the tiny preset (seq 32, batch 8) per round through the peer's code: inner
    trainer, sign codec per part, meanmed, outer step per part. Eval perplexity after each round."""
    run = RunConfig(seq_len=32)
    ds = load_dataset(None, run.seq_len)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    p, block = theta.numel(), run.block_size
    cut = [0, p // 3 // block * block, 2 * p // 3 // block * block, p]
    ranges = list(zip(cut, cut[1:]))
    kw = dict(seq_len=run.seq_len, lr=run.inner_lr, weight_decay=0.1, warmup_steps=run.warmup_steps)
    kw.update(total_steps=run.total_inner_steps, steps_per_round=run.uniform_inner_steps)
    trainers = [InnerTrainer(copy.deepcopy(base), ds, peer_id=f"peer{i}", **kw) for i in range(3)]
    ev = InnerTrainer(copy.deepcopy(base), ds, seq_len=run.seq_len)
    outer = OuterNesterov(run.outer_lr, run.outer_momentum, momentum_clip=clip, block_size=block)
    ppl = []
    for r in range(rounds):
        packets = []
        for tr in trainers:
            load_flat_(tr.model, theta)
            res = tr.run(round=r, inner_steps=2, batch_size=8)
            packets.append((res.tokens, compression.encode(pseudo_gradient(tr.model, theta), block, res.tokens)))
        agg = torch.empty(p)
        for s, e in ranges:
            agg[s:e] = aggregate_part(
                [(n, compression.slice_packet(pk, s, e)) for n, pk in packets],
                e - s,
                rule=run.aggregation,
                clip_k=run.clip_k,
                weight_cap=run.weight_cap,
                min_agreement=run.min_agreement,
            )
        outer_step_per_part(outer, theta, agg, ranges, r)
        load_flat_(ev.model, theta)
        ppl.append(ev.evaluate(max_batches=4, batch_size=8))
    return ppl


def test_young_swarm_has_no_perplexity_spike():
    torch.set_num_threads(1)
    assert RunConfig().outer_momentum_clip == 2.0
    rounds = 10  # the unclipped run jumps ~10x after round 8 (benchmarks/outer_stability.py, seed 0)
    clipped = _young_swarm(2.0, rounds)
    worst = max(b / a for a, b in zip(clipped, clipped[1:]))
    assert worst < 1.2, clipped
    assert clipped[-1] < 700, clipped
    plain = _young_swarm(0.0, rounds)
    assert max(b / a for a, b in zip(plain, plain[1:])) > 3.0, plain  # what the clip removes
