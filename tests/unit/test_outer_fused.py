"""The fused outer step (issue 27): OuterNesterov parts stepped in place, block by block, bitwise equal to the
copy-and-check path, which still takes every part that could overflow."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part

P = 3 * optim.FUSED_BLOCK + 12_345  # several blocks and a ragged last one


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(P, generator=g)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buf = torch.randn(P, generator=g) * 1e-2
    outer.steps = 3
    return theta, outer


def _slow(monkeypatch):
    """The copy-and-check path for every part (no state is under a negative bound)."""
    monkeypatch.setattr(optim, "FUSED_BOUND", -1.0)


@pytest.mark.parametrize("rounds", [1, 6])
def test_fused_parts_are_bitwise_equal_to_the_copy_and_check_path(monkeypatch, rounds):
    theta_f, outer_f = _state()
    theta_s, outer_s = theta_f.clone(), copy.deepcopy(outer_f)
    ranges = [(0, 1000), (1000, 200_000), (200_000, P)]
    idle = [(500, 1500), (250_000, 260_000)]  # crosses a part boundary, and inside the last part
    g = torch.Generator().manual_seed(1)
    aggs = [torch.randn(P, generator=g) * 1e-3 for _ in range(rounds)]
    for r, agg in enumerate(aggs):
        assert outer_step_per_part(outer_f, theta_f, agg, ranges, r, idle) == ([], set())
    assert outer_f._fused_bound is not None  # the fast path ran
    _slow(monkeypatch)
    for r, agg in enumerate(aggs):
        assert outer_step_per_part(outer_s, theta_s, agg, ranges, r, idle) == ([], set())
    assert torch.equal(theta_f, theta_s) and torch.equal(outer_f.buf, outer_s.buf)
    assert outer_f.steps == outer_s.steps == 3 + rounds
    start, _ = _state()
    assert torch.equal(theta_f[500:1500], start[500:1500])  # idle elements kept their weights


def test_parts_that_could_overflow_take_the_checked_path_and_are_skipped_alike(monkeypatch):
    theta_f, outer_f = _state()
    theta_s, outer_s = theta_f.clone(), copy.deepcopy(outer_f)
    agg = torch.randn(P) * 1e-3
    agg[10] = float("inf")  # part 0: not finite
    agg[150_000] = 3e38  # part 1: finite, over the bound; the step overflows there
    ranges = [(0, 100_000), (100_000, 200_000), (200_000, P)]
    want = ([(0, 100_000), (100_000, 200_000)], {(0, 100_000)})
    assert outer_step_per_part(outer_f, theta_f, agg, ranges, 0) == want
    _slow(monkeypatch)
    assert outer_step_per_part(outer_s, theta_s, agg, ranges, 0) == want
    assert torch.equal(theta_f, theta_s) and torch.equal(outer_f.buf, outer_s.buf)


def test_the_state_bound_is_measured_again_after_any_other_write(monkeypatch):
    theta, outer = _state()
    calls: list[int] = []
    real = optim._abs_max
    monkeypatch.setattr(optim, "_abs_max", lambda t: calls.append(t.numel()) or real(t))
    agg = torch.randn(P) * 1e-3
    outer_step_per_part(outer, theta, agg, [(0, P)], 0)
    assert calls == [P, P, P]  # θ and momentum measured once, then the part's aggregate
    bound = outer._fused_bound[1]
    assert bound >= max(float(theta.abs().max()), float(outer.buf.abs().max()))
    calls.clear()
    outer_step_per_part(outer, theta, agg, [(0, P)], 1)
    assert calls == [P]  # the recorded bound holds: only the aggregate is read
    calls.clear()
    theta[7] = 1e31  # any other write (a state load, a re-sync) moves the version counter
    outer_step_per_part(outer, theta, agg, [(0, P)], 2)
    assert calls == [P, P, P]  # measured again: 1e31 is over FUSED_BOUND, so the checked path took the part
    assert outer._fused_bound[1] >= float(torch.tensor(1e31))  # (1e31 in fp32)
