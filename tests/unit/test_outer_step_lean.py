"""Issue 27 (session 46): the clipped fused outer step in fewer array streams (the momentum updated in place, 0-dim
fp32 scalars, the clip's ``±bounds`` made once a part, 512 Ki-element blocks with the clamp in the 128 Ki pieces of
before, the block maxima from ``amax`` / ``amin``) gives the bits of session 45's code, kept here as the reference:
random data, elements of the momentum exactly at ``±c·max|g|`` of their block, blocks whose bound is 0 (signed zeros
in the aggregate and the momentum), a ragged last block, idle ranges off the block grid; and the clip is applied."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part

pytestmark = pytest.mark.timeout(120)

B = 2048  # the codec's block: the clip's blocks
OLD_FUSED_BLOCK = 1 << 17  # session 45's FUSED_BLOCK


def old_block_maxima(g: torch.Tensor, block_size: int) -> torch.Tensor:
    """Session 45's ``block_maxima``: ``amax(|g|)`` a block, 1 Mi elements at a time."""
    n = g.numel()
    nfull = n // block_size
    parts = []
    step = max(1, (1 << 20) // block_size) * block_size
    for a in range(0, nfull * block_size, step):
        b = min(nfull * block_size, a + step)
        parts.append(torch.abs(g[a:b]).view((b - a) // block_size, block_size).amax(dim=1))
    if nfull * block_size < n:
        parts.append(torch.abs(g[nfull * block_size :]).amax().reshape(1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def old_clamp_blocks(x: torch.Tensor, bounds: torch.Tensor, offset: int, block_size: int) -> None:
    """Session 45's ``clamp_blocks``, then every element of a bound-0 block ``+0`` (session 46: ``minimum`` /
    ``maximum`` of signed zeros gave either sign, by thread count and piece)."""
    n = x.numel()
    i = 0
    head = min(n, (-offset) % block_size)
    if head:
        b = bounds[offset // block_size]
        torch.minimum(x[:head], b, out=x[:head])
        torch.maximum(x[:head], torch.neg(b), out=x[:head])
        i = head
    k = (offset + i) // block_size
    m = (n - i) // block_size
    if m:
        v = x[i : i + m * block_size].view(m, block_size)
        b = bounds[k : k + m].unsqueeze(1)
        torch.minimum(v, b, out=v)
        torch.maximum(v, torch.neg(b), out=v)
        i += m * block_size
    if i < n:
        b = bounds[k + m]
        torch.minimum(x[i:], b, out=x[i:])
        torch.maximum(x[i:], torch.neg(b), out=x[i:])
    x[bounds[torch.div(torch.arange(offset, offset + n), block_size, rounding_mode="floor")] == 0] = 0.0


def old_fused(outer, theta, aggregate, spans, part_start, bounds, block) -> None:
    """Session 45's ``_nesterov_fused``: Python-float scalars, a scratch for ``μ·buf``, ``block``-element blocks."""
    mu, lr = outer.momentum, outer.lr
    buf = outer.buf
    nb = torch.empty(block, dtype=torch.float32)
    upd = torch.empty(block, dtype=torch.float32)
    for s, e in spans:
        for a in range(s, e, block):
            z = min(e, a + block)
            n = z - a
            g, b, th, m, u = aggregate[a:z], buf[a:z], theta[a:z], nb[:n], upd[:n]
            torch.mul(b, mu, out=m)
            torch.add(m, g, out=b)
            if bounds is not None:
                old_clamp_blocks(b, bounds, a - part_start, outer.block_size)
            torch.mul(b, mu, out=u)
            torch.add(g, u, out=u)
            torch.mul(u, lr, out=u)
            torch.sub(th, u, out=th)


def old_step(outer, theta, aggregate, ranges, idle=(), block=OLD_FUSED_BLOCK) -> list:
    """Session 45's fused path of ``outer_step_per_part`` (every part here is under FUSED_BOUND): the parts skipped."""
    bad = []
    for s, e in ranges:
        maxima = old_block_maxima(aggregate[s:e], outer.block_size) if outer.momentum_clip > 0 else None
        g_max = optim._abs_max(aggregate[s:e]) if maxima is None else optim._max_of(maxima)
        if not g_max == g_max or g_max == float("inf"):
            bad.append((s, e))
            continue
        bounds = None if maxima is None else torch.mul(maxima, float(outer.momentum_clip))
        old_fused(outer, theta, aggregate, optim._minus(s, e, idle), s, bounds, block)
    outer.steps += 1
    return bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _inputs(p: int, seed: int, mu: float, c: float):
    """θ, momentum and aggregate with the clip's edge cases in them: exact hits of ``±bound`` (dyadic values, μ = 0.5),
    blocks whose aggregate is all ``±0`` (bound 0), ``±0`` in the momentum."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(p, generator=g)
    buf = torch.randn(p, generator=g) * 1e-2
    agg = torch.randn(p, generator=g) * 1e-3
    agg[B : 2 * B] = 0.0  # a block of zeros: bound 0
    agg[B + 5 : 2 * B : 7] = -0.0
    buf[B : 2 * B : 3] = -0.0
    buf[B + 1 : 2 * B : 3] = 0.0
    theta[B : B + 64] = 0.0  # θ = ±0 where the bound is 0: θ − u keeps the sign of the momentum's zeros
    theta[B + 64 : B + 128] = -0.0
    if mu == 0.5:  # block 3: max|g| = 0.5, bound c·0.5; μ·buf + g lands exactly on ±bound at some elements
        blk = slice(3 * B, 4 * B)
        agg[blk] = 0.25
        agg[3 * B] = 0.5
        agg[3 * B + 1 :: 2][: B // 2 - 1] = -0.25
        bound = c * 0.5
        buf[3 * B + 2 : 4 * B : 4] = 2 * (bound - 0.25)  # 0.5·buf + 0.25 = bound
        buf[3 * B + 3 : 4 * B : 4] = -2 * (bound - 0.25)  # 0.5·buf − 0.25 = −bound
    agg[p - 100 :] = 0.0  # the ragged last block: bound 0 too
    for k in (412, 476):  # bound 0 where a span starts off the grid (412) and where a clamp piece ends inside (476)
        agg[k * B : (k + 1) * B] = 0.0
    return theta, buf, agg


@pytest.mark.parametrize("mu,lr,c", [(0.9, 0.7, 2.0), (0.5, 0.5, 1.5)])
def test_the_lean_clipped_step_has_session_45s_bits(mu, lr, c):
    p = 2 * optim.FUSED_BLOCK + 37 * B + 1234  # several new blocks, a ragged last codec block
    assert p > 8 * OLD_FUSED_BLOCK
    theta0, buf0, _ = _inputs(p, 0, mu, c)
    cut = [0, 5 * B, 200 * B, 400 * B, p]
    ranges = list(zip(cut, cut[1:]))
    idle = [(200 * B + 777, 200 * B + 5000), (220 * B + 13, 220 * B + 3 * OLD_FUSED_BLOCK + 99)]  # off the grid
    o_new = OuterNesterov(lr, mu, momentum_clip=c, block_size=B)
    o_new.buf = buf0.clone()
    o_old = copy.deepcopy(o_new)
    t_new, t_old = theta0.clone(), theta0.clone()
    for r in range(3):
        agg = _inputs(p, 0, mu, c)[2] if r == 0 else _inputs(p, 10 + r, mu, c)[2]
        if r == 2:
            agg[10] = float("nan")  # part 0 skipped alike
        got = outer_step_per_part(o_new, t_new, agg, ranges, r, idle)
        want = old_step(o_old, t_old, agg, ranges, idle)
        assert got[0] == want
        assert torch.equal(_bits(t_new), _bits(t_old)), r  # the bits: signed zeros too
        assert torch.equal(_bits(o_new.buf), _bits(o_old.buf)), r
        if r == 0 and mu == 0.5:  # the exact hits of ±bound were there (block 3 is in part 1, not idle)
            hits = o_new.buf[3 * B : 4 * B].abs() == c * 0.5
            assert int(hits.sum()) == B // 2 - 1  # 512 at +bound, 511 at -bound
    assert o_new.steps == o_old.steps == 3
    assert got[0] == [(0, 5 * B)]
    # the edge cases were there: the bound-0 block's momentum all +0 (its inputs held zeros of both signs)
    z = o_new.buf[B : 2 * B]
    assert bool((z == 0).all()) and not bool(torch.signbit(z).any())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_bound_0_block_has_the_same_bits_at_any_thread_count_and_piece(threads):
    """``minimum`` / ``maximum`` of ``-0`` and ``+0`` return either by where an element falls in the kernel's vector
    loop (thread count, piece start): 1 and 3 threads differed in 14 of 131,072 elements before session 46. Now a
    bound-0 block is +0 whatever the threads and however the vector is cut into pieces."""
    n = 64 * B + 77
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(n, generator=g)
    x0[::3] = 0.0
    x0[1::3] = -0.0
    bounds = torch.rand(-(-n // B), generator=g)
    bounds[::2] = 0.0
    want = x0.clone()
    old_clamp_blocks(want, bounds, 0, B)  # the reference: element-wise, +0 in bound-0 blocks
    assert not bool(torch.signbit(want[:B]).any()) and bool(torch.signbit(want[B : 2 * B]).any())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for piece in (n, 1 << 17, 5 * B + 13, 999):
            x = x0.clone()
            for a in range(0, n, piece):
                optim.clamp_blocks(x[a : a + piece], bounds, a, B)
            assert torch.equal(_bits(x), _bits(want)), piece
    finally:
        torch.set_num_threads(before)


def test_the_clip_is_applied_in_the_fused_step():
    """Every momentum element within ``c·max|g|`` of its block after the step, the ones that were over it set to the
    bound with their sign, the others ``μ·buf + g``; θ moved by ``η·(g + μ·buf)`` with the clipped momentum."""
    p = optim.FUSED_BLOCK + 3 * B + 100
    gen = torch.Generator().manual_seed(7)
    buf0 = torch.randn(p, generator=gen)  # large against the aggregate: most elements are clipped
    agg = torch.randn(p, generator=gen) * 1e-2
    theta0 = torch.randn(p, generator=gen)
    o = OuterNesterov(0.7, 0.9, momentum_clip=2.0, block_size=B)
    o.buf = buf0.clone()
    theta = theta0.clone()
    assert outer_step_per_part(o, theta, agg, [(0, p)], 0) == ([], set())
    raw = buf0 * 0.9 + agg
    nblk = -(-p // B)
    bound = torch.stack([agg[k * B : (k + 1) * B].abs().max() for k in range(nblk)]) * 2.0
    per_el = bound.repeat_interleave(B)[:p]
    over = raw.abs() > per_el
    assert 0.5 < float(over.float().mean()) < 1.0  # the clip did cut, not everywhere
    assert torch.equal(o.buf[over], torch.sign(raw[over]) * per_el[over])
    assert torch.equal(o.buf[~over], raw[~over])
    assert bool((o.buf.abs() <= per_el).all())
    want = theta0 - (agg + o.buf * 0.9) * 0.7
    assert torch.equal(theta, want)
    # a crafted block: bound 2·0.5 = 1
    o = OuterNesterov(0.5, 0.5, momentum_clip=2.0, block_size=4)
    o.buf = torch.tensor([10.0, -10.0, 1.0, 0.0] * 3)
    theta = torch.zeros(12)
    outer_step_per_part(o, theta, torch.tensor([0.5, -0.25, 0.25, 0.0] * 3), [(0, 12)], 0)
    assert o.buf.tolist() == [1.0, -1.0, 0.75, 0.0] * 3
    assert theta.tolist() == [-0.5, 0.375, -0.3125, 0.0] * 3


def test_block_maxima_are_the_old_bits():
    g = torch.Generator().manual_seed(3)
    for n, block in ((0, 8), (5, 8), (70_000, 2048), (3 << 18, 2048), (1001, 16)):
        x = torch.randn(n, generator=g)
        if n > 4 * block:
            x[block : 2 * block] = -0.0  # max of -0s is -0: the bound must be +0
            x[2 * block : 3 * block] = 0.0
            x[3 * block + 1] = float("-inf")
            x[3 * block + 2 :: 97] = float("nan")
        got, want = optim.block_maxima(x, block), old_block_maxima(x, block)
        assert torch.equal(_bits(got), _bits(want)), (n, block)
