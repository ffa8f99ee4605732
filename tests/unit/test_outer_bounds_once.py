"""The fused outer step with the momentum clip reads each part's aggregate for its bounds once (issue 27, session
45): the part's max |g| is the max of its block maxima, not a separate ``aminmax`` pass. The same bits as a step that
measures both, and the same parts skipped for a NaN or an infinite aggregate value."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part

pytestmark = pytest.mark.timeout(60)

P = 300_007  # parts off the block size's multiples


def _state() -> tuple[torch.Tensor, OuterNesterov]:
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(P, generator=g)
    outer = OuterNesterov(lr=0.7, momentum=0.9, momentum_clip=2.0, block_size=2048)
    outer.buf = torch.randn(P, generator=g) * 1e-2
    outer.steps = 3
    return theta, outer


def test_the_aggregate_is_read_once_for_the_bounds_and_the_bits_are_those_of_two_reads(monkeypatch):
    theta, outer = _state()
    agg = torch.randn(P, generator=torch.Generator().manual_seed(5)) * 1e-3
    agg[17] = float("nan")  # part 0: not finite
    agg[150_001] = float("-inf")  # part 1: not finite
    ranges = [(0, 100_000), (100_000, 200_000), (200_000, P)]
    want = outer_step_per_part_reference(copy.deepcopy(outer), theta.clone(), agg, ranges)
    reads: list[int] = []
    real = optim._abs_max
    monkeypatch.setattr(optim, "_abs_max", lambda t: reads.append(t.numel()) or real(t))
    got = outer_step_per_part(outer, theta, agg, ranges, 0)
    assert got == ([(0, 100_000), (100_000, 200_000)], {(0, 100_000), (100_000, 200_000)})
    assert got == want[0]
    assert reads == [P, P]  # θ and the momentum (the state bound, first step): no aggregate part
    assert torch.equal(theta, want[1]) and torch.equal(outer.buf, want[2])
    reads.clear()
    outer_step_per_part(outer, theta, torch.zeros(P), [(0, P)], 1)
    assert reads == []  # the recorded state bound holds, and the part's max came from its block maxima


def outer_step_per_part_reference(outer: OuterNesterov, theta: torch.Tensor, agg: torch.Tensor, ranges):
    """The fused step with the part's max measured by its own pass (``_abs_max``) and the bounds by
    ``block_bounds``, as before session 45: (its result, θ, momentum)."""
    clip, outer.momentum_clip = outer.momentum_clip, 0.0  # the step's clip branch off: no block maxima
    res = []
    for s, e in ranges:
        g_max = optim._abs_max(agg[s:e])
        if not g_max == g_max or g_max == float("inf"):
            res.append((s, e))
            continue
        bounds = optim.block_bounds(agg[s:e], outer.block_size, clip)
        optim._nesterov_fused(outer, theta, agg, [(s, e)], s, bounds)
    return (res, set(res)), theta, outer.buf
