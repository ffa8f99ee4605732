"""Eager updates in the simulator (issue 17; geomesh_p2p/sim): the method option, the update equations
(Kale, Douillard, Donchev 2025, as in Simulator._run_sync's docstring) and the overlapped charge."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.sim import MethodError, parse_method
from geomesh_p2p.sim.link_time import RoundTiming
from geomesh_p2p.sim.engine import _overlapped
from tests.unit.test_sim import TOY

pytestmark = pytest.mark.timeout(120)


def test_eager_is_a_modifier_of_the_synchronous_methods_and_geomesh_eager_an_alias():
    assert parse_method("geomesh+eager").eager and parse_method("diloco+eager").eager
    alias = parse_method("geomesh-eager")
    assert alias.eager and alias.base == "geomesh" and alias.compressed
    assert not parse_method("geomesh").eager
    for bad in ("ddp+eager", "async+eager"):
        with pytest.raises(MethodError, match="eager applies to the synchronous methods"):
            parse_method(bad)


def test_the_overlapped_charge_keeps_only_the_exchange_past_the_next_window():
    t = RoundTiming(compute_s=[4.0, 3.0], straggler_s=[0.0, 1.0], network_s=5.0, round_s=9.0, end_s=[9.0, 9.0])
    o = _overlapped(t, last=False)
    assert (o.network_s, o.round_s, o.compute_s, o.straggler_s) == (1.0, 5.0, [4.0, 3.0], [0.0, 1.0])
    o.check()
    short = RoundTiming(compute_s=[4.0], straggler_s=[0.0], network_s=0.5, round_s=4.5)
    assert (_overlapped(short, last=False).network_s, _overlapped(short, last=False).round_s) == (0.0, 4.0)
    assert _overlapped(t, last=True) is t  # nothing follows the last round: its exchange is waited for


def test_eager_start_weights_are_the_global_weights_stepped_by_the_own_share():
    """x_m = O(θ, v; w_m Δ_m^r) on copies; θ and the outer state untouched."""
    from geomesh_p2p.sim.engine import Simulator

    g = torch.Generator().manual_seed(0)
    P = 64
    theta = torch.randn(P, generator=g)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.step(theta, torch.randn(P, generator=g))  # a momentum buffer that is not zero
    theta0, buf0 = theta.clone(), outer.buf.clone()
    deltas = [torch.randn(P, generator=g) for _ in range(3)]
    tokens = [100, 300, 0]
    sim = Simulator.__new__(Simulator)  # the method needs no profile
    starts = sim._eager_starts(theta, outer, deltas, tokens)
    assert torch.equal(theta, theta0) and torch.equal(outer.buf, buf0) and outer.steps == 1
    for m in range(3):
        x, o = theta0.clone(), copy.deepcopy(outer)
        o.step(x, (deltas[m] * (tokens[m] / 400.0)).contiguous())
        assert torch.equal(starts[m], x)
    x, o = theta0.clone(), copy.deepcopy(outer)
    o.step(x, torch.zeros(P))  # a peer that trained nothing: the momentum alone moves its start
    assert torch.equal(starts[2], x)


@pytest.fixture(scope="module")
def toy_sim():
    from geomesh_p2p.sim.engine import Simulator
    from geomesh_p2p.sim.hardware import parse_profile

    torch.set_num_threads(1)
    return Simulator(parse_profile(TOY, "toy2.yaml"), rounds=3)


def test_eager_geomesh_on_the_toy_profile_overlaps_the_exchange_at_equal_tokens(toy_sim):
    """Same plan, same tokens; the exchange of every round but the last hides under the next window, so
    network idle and run time drop; the global weights are a real training run (ppl finite, falling)."""
    from geomesh_p2p.sim import report

    res = {m: toy_sim.run(parse_method(m)) for m in ("geomesh", "geomesh+eager")}
    rows = {r["method"]: r for r in report.summaries(list(res.values()), target_ppl=None)}
    base, eager = res["geomesh"], res["geomesh+eager"]
    assert eager.tokens_ref == base.tokens_ref and len(eager.rounds) == len(base.rounds)
    assert [lg.inner_steps for lg in eager.rounds] == [lg.inner_steps for lg in base.rounds]
    assert eager.total_s < base.total_s
    assert rows["geomesh+eager"]["network_idle_pct"] < rows["geomesh"]["network_idle_pct"]
    for lb, le in zip(base.rounds[:-1], eager.rounds[:-1]):
        assert le.network_s[0] == pytest.approx(max(0.0, lb.network_s[0] - max(lb.compute_s)))
    assert eager.rounds[-1].network_s == base.rounds[-1].network_s
    # the first round starts from the same weights: its aggregate and so its global weights are equal
    assert eager.curve[1][1] == base.curve[1][1]
    assert all(p < eager.curve[0][1] for _, p, _ in eager.curve[1:])
    # deterministic: the same run again gives the same curve
    again = toy_sim.run(parse_method("geomesh+eager"))
    assert again.curve == eager.curve


def test_the_nodes_eager_start_is_the_simulators_bit_for_bit():
    """optim.eager_start (the real node's, RunConfig.eager) against Simulator._eager_starts: x_m = O(θ, v; w_m Δ_m)
    with the same bits, for every peer, a momentum that is not zero, and a weight of 0."""
    from geomesh_p2p.model.optim import eager_start
    from geomesh_p2p.sim.engine import Simulator

    g = torch.Generator().manual_seed(3)
    P = 4099  # not a multiple of anything
    theta = torch.randn(P, generator=g)
    outer = OuterNesterov(lr=0.35, momentum=0.9)
    for _ in range(2):
        outer.step(theta, torch.randn(P, generator=g) * 1e-2)
    deltas = [torch.randn(P, generator=g) * 1e-2 for _ in range(3)]
    tokens = [3 * 512, 7 * 512, 0]
    sim = Simulator.__new__(Simulator)
    want = sim._eager_starts(theta, outer, deltas, tokens)
    buf0, theta0 = outer.buf.clone(), theta.clone()
    for m in range(3):
        got = eager_start(theta, outer.buf, deltas[m], tokens[m] / sum(tokens), lr=0.35, momentum=0.9)
        assert torch.equal(got, want[m])
        assert got.view(torch.int32).equal(want[m].view(torch.int32))  # the same bits, -0.0 included
    assert torch.equal(theta, theta0) and torch.equal(outer.buf, buf0)  # the state is not touched
