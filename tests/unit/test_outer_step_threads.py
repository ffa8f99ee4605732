"""The outer step's bits do not depend on torch's thread count (red team of session 46): two honest peers with other
``--threads`` must hold the same weights and momentum (their state digests). The whole step is run here, not the
clamp alone: :func:`~geomesh_p2p.model.optim.outer_step_per_part` on its fused path and on its copy-and-check path
(a state over ``FUSED_BOUND``), the whole-vector :meth:`OuterNesterov.step` and :func:`eager_start`, over three
rounds, on data crafted for the kernels whose bits could follow the split into threads: blocks whose aggregate is all
``±0`` (a clip bound of 0, ``minimum`` / ``maximum`` of signed zeros), ``±0`` in the momentum and the weights, a
block whose bound underflows to 0 (a denormal aggregate at c = 0.5), a ragged last block and idle ranges off the
grid. At 36f39d1 (before the bound-0 fill) 3 threads differed from 1 in 12-23 momentum elements."""

from __future__ import annotations

import pytest
import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, eager_start, outer_step_per_part

pytestmark = pytest.mark.timeout(300)

B = 2048  # the codec's block: the clip's blocks
P = optim.FUSED_BLOCK + 70 * B + 1234  # more than one fused block, a ragged last codec block


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """θ, momentum, aggregate (fp32 ``[P]``): every third block's aggregate ``±0`` (bound 0) with ``±0`` in its
    momentum and weights; block 7 a single denormal (its bound ``0.5 x 1e-45`` rounds to 0)."""
    g = torch.Generator().manual_seed(seed)
    theta, buf, agg = (
        torch.randn(P, generator=g),
        torch.randn(P, generator=g) * 1e-2,
        torch.randn(P, generator=g) * 1e-3,
    )
    for k in range(0, P // B, 3):
        blk = slice(k * B, (k + 1) * B)
        agg[blk] = 0.0
        agg[k * B + 1 : (k + 1) * B : 2] = -0.0
        buf[k * B : (k + 1) * B : 3] = -0.0
        buf[k * B + 1 : (k + 1) * B : 3] = 0.0
        theta[k * B : (k + 1) * B : 5] = -0.0
        theta[k * B + 1 : (k + 1) * B : 5] = 0.0
    agg[7 * B : 8 * B] = 0.0
    agg[7 * B + 3] = 1e-45
    buf[7 * B : 8 * B] = -0.0
    return theta, buf, agg


def _run(threads: int, path: str, c: float, idle=()) -> list[torch.Tensor]:
    """Three outer steps at ``threads`` threads, then an eager start: the bits of θ, the momentum and the start."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        theta, buf, _ = _inputs(1)
        if path == "copy":
            theta[5] = 1e31  # over FUSED_BOUND: every part takes the copy-and-check path
        o = OuterNesterov(0.7, 0.9, momentum_clip=c, block_size=B)
        o.buf = buf.clone()
        cut = [0, 5 * B, 64 * B, P]
        for r in range(3):
            agg = _inputs(10 + r)[2]
            if path == "whole":
                o.step(theta, agg)
            else:
                assert outer_step_per_part(o, theta, agg, list(zip(cut, cut[1:])), r, idle) == ([], set())
        start = eager_start(theta, o.buf, agg, 0.3, lr=0.7, momentum=0.9, momentum_clip=c, block_size=B)
        return [t.view(torch.int32).clone() for t in (theta, o.buf, start)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "path,c,idle",
    [
        ("fused", 2.0, ()),
        ("copy", 2.0, ()),
        ("whole", 2.0, ()),
        ("fused", 0.5, ()),
        ("fused", 2.0, ((10 * B + 77, 30 * B + 5),)),
    ],
)
def test_the_outer_step_has_the_same_bits_at_1_and_3_threads(path, c, idle):
    one, three = _run(1, path, c, idle), _run(3, path, c, idle)
    for name, a, b in zip(("theta", "momentum", "eager start"), one, three):
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
    if path == "fused" and not idle:  # the per-part and whole-vector steps agree too (parts start on the grid)
        assert all(torch.equal(a, b) for a, b in zip(one, _run(3, "whole", c)))
    # the edge case was there: a bound-0 block's momentum is +0 (its inputs held zeros of both signs)
    z = one[1][3 * B : 4 * B]
    assert bool((z == 0).all())
