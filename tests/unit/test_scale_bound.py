"""The round's aggregate scale bound (issue 26, release 0.9.0): ``CollectiveSpec.max_scale``, computed from the plan,
the run config and the start state (:func:`geomesh_p2p.round.rules.spec.aggregate_scale_bound`), held by every reader
of a ``"sign"`` aggregate (:func:`geomesh_p2p.exchange.aggregate.decode_aggregate`). The in-swarm behaviour (a forged
-20x aggregate refused everywhere, its owner still proven) is in
``tests/integration/test_collective_accountable.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange import messages
from geomesh_p2p.exchange.aggregate import ScaleBoundError, decode_aggregate, encode_aggregate
from geomesh_p2p.exchange.groups import group_layout, level_specs
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner
from geomesh_p2p.model.state import GlobalState
from geomesh_p2p.net.identity import Identity, Verifier
from geomesh_p2p.model.training import swarm_lr_at
from geomesh_p2p.round.rules.spec import aggregate_scale_bound, collective_spec, round_lr_sum
from tests.collective_util import pid_order
from tests.unit.test_mode_auto import NUMEL, _plan

pytestmark = pytest.mark.timeout(60)

_PID = str(Identity.generate().peer_id)


def _spec(**kw) -> CollectiveSpec:
    return CollectiveSpec(
        run_id="r",
        round=1,
        participants={_PID: 10},
        owners=(PartOwner(peer_id=_PID, address="127.0.0.1:1", start=0, end=4096),),
        numel=4096,
        deadline=1000.0,
        pull_deadline=1001.0,
        mode="accountable",
        **kw,
    )


def test_the_bound_is_the_rounds_learning_rates_over_the_plans_most_steps_plus_weight_decays_share():
    run, _recs, plan = _plan(5)  # 5 peers: an accountable round of the sign method, round 2
    steps = max(a.inner_steps for a in plan.assignments)
    assert steps > 0
    lrs = [
        swarm_lr_at(2, i, steps, steps_per_round=20, lr=1e-3, warmup_steps=20, total_steps=2000) for i in range(steps)
    ]
    assert (run.uniform_inner_steps, run.inner_lr, run.warmup_steps, run.total_inner_steps) == (20, 1e-3, 20, 2000)
    assert round_lr_sum(run, 2, steps) == sum(lrs)
    assert aggregate_scale_bound(plan, run, 2.0) == sum(lrs) * (3.0 + 0.1 * 2.0)
    # the warm-up's rounds: a bound as small as their steps (round 0 of 4 uniform steps: lr x (1 + 2 + 3 + 4) / 20)
    assert round_lr_sum(run.model_copy(update={"uniform_inner_steps": 4}), 0, 4) == pytest.approx(1e-3 * 10 / 20)
    assert aggregate_scale_bound(plan, run, None) is None  # no committed state: no bound
    assert aggregate_scale_bound(plan, run.model_copy(update={"error_feedback": True}), 2.0) is None
    idle = plan.model_copy(update={"assignments": [a.model_copy(update={"inner_steps": 0}) for a in plan.assignments]})
    assert aggregate_scale_bound(idle, run, 2.0) is None
    # the round's spec carries it for the accountable sign aggregate, and not without a state or in relay mode
    assert collective_spec(plan, run, NUMEL, 64 << 20, 2.0).max_scale == sum(lrs) * 3.2
    assert collective_spec(plan, run, NUMEL, 64 << 20).max_scale is None
    run4, _r, relay = _plan(4)
    assert relay.mode == "relay" and collective_spec(relay, run4, NUMEL, 64 << 20, 2.0).max_scale is None


def test_specs_without_the_bound_keep_their_spec_id_and_a_bad_bound_is_refused():
    off, on = _spec(), _spec(max_scale=0.25)
    assert "max_scale" not in off._canonical_json()  # specs of 0.8 peers keep the spec_id they had
    assert on.spec_id != off.spec_id
    back = CollectiveSpec.from_dict(on.to_dict())
    assert back.max_scale == 0.25 and back.spec_id == on.spec_id
    assert CollectiveSpec.from_dict({k: v for k, v in off.to_dict().items() if k != "max_scale"}) == off
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_scale"):
            _spec(max_scale=bad)


def test_a_sign_aggregate_above_the_bound_is_refused_before_it_is_decoded():
    x = torch.linspace(-1.0, 1.0, 4096)  # block scales 0.5 (two blocks of 2048)
    data = compression.encode(x, 2048, 10).to_bytes()
    top = float(compression.decode(compression.packet_from_bytes(data)).abs().max())
    assert torch.equal(decode_aggregate("sign", data, 4096, max_scale=top), decode_aggregate("sign", data, 4096))
    out = torch.full((4096,), 7.0)
    with pytest.raises(ScaleBoundError, match="above the round's bound"):
        decode_aggregate("sign", data, 4096, out=out, max_scale=top * 0.999)
    assert bool((out == 7.0).all())  # checked on the packet's scales: nothing was written


def test_a_commit_records_the_states_largest_weight():
    gs = GlobalState(4, 1)
    assert gs.theta_maxabs is None
    gs.theta.copy_(torch.tensor([0.5, -3.25, 2.0, 0.0]))
    gs.commit(3)
    assert gs.theta_maxabs == 3.25 and gs.round == 3


def test_a_grouped_rounds_cross_level_refuses_a_leaders_aggregate_above_the_bound_and_reads_an_honest_one():
    """Issue 26, session 30: a grouped round's level 2 (a leader's ``"sign"`` aggregate of the slice owners' group
    aggregates, read by every participant) carries the round's bound; its level 1 (fp32, read by its owner) none."""
    ids = [Identity.generate() for _ in range(9)]
    pids = [str(i.peer_id) for i in ids]
    numel, b = 3 * 4 * 2048, 2048
    cuts = [0, 2, 4, 6, 7, 8, 9, 10, 11, 12]  # 12 blocks over 9 owners, as the swarm's helpers cut them
    owners = tuple(PartOwner(p, f"127.0.0.1:{k + 1}", cuts[k] * b, cuts[k + 1] * b) for k, p in enumerate(pids))
    spec = CollectiveSpec("r", 1, {p: 100 for p in pids}, owners, numel, 1000.0, 1001.0, max_scale=1.5)
    layout = group_layout(spec, 3)
    assert layout is not None and len(layout.groups) == 3
    gspecs, xspecs = level_specs(spec, layout, 990.0, 64 << 20)
    assert all(x.max_scale == 1.5 for x in xspecs) and all(g.max_scale is None for g in gspecs)
    assert all(x.spec_id != dataclasses.replace(x, max_scale=None).spec_id for x in xspecs)  # the bound is in it
    xs = xspecs[0]
    leader = ids[pids.index(xs.owners[0].peer_id)]
    size = xs.owners[0].size
    cross = list(xs.participants)
    # the slice owners' group aggregates: |x| ~ 1, so honest block scales ~ 1 (under the bound of 1.5)
    gen = torch.Generator().manual_seed(3)
    xs_in = [torch.randn(size, generator=gen).clamp(-2, 2) for _ in cross]

    def signed(scale: float) -> bytes:
        contributions = [
            messages.Contribution(
                p, 300, compression.encode(xs_in[cross.index(p)] * scale, b, 300), b"", members=((p, 300),)
            )
            for p in pid_order(cross)
        ]
        return messages.build_result(leader, xs, 0, xs.owners[0], "", contributions)

    verifier = Verifier("r", max_skew_s=float("inf"))
    agg, _contributors, _end, _packets = messages.read_result(verifier, xs, 0, signed(1.0))
    mean = xs.aggregate([(300, compression.encode(xs_in[cross.index(p)], b, 300)) for p in pid_order(cross)], size)
    assert torch.equal(agg, decode_aggregate("sign", encode_aggregate("sign", mean, b, 900), size))
    assert 0 < float(agg.abs().max()) <= 1.5
    out = torch.full((size,), 7.0)
    with pytest.raises(messages.OverBoundError, match="above the round's bound 1.5"):
        messages.read_result(verifier, xs, 0, signed(-20.0), out=out)  # a forging leader's -20x aggregate
    assert bool((out == 7.0).all())  # refused before it was decoded
