"""Bounded tables under a flood of identities: the link-probe rate table (geomesh_p2p.net.links) and the
collective owner's held pushes for unknown rounds (geomesh_p2p.exchange.owner)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import torch

from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.links import LinkProbeService
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.net.methods import COLLECTIVE_PULL, COLLECTIVE_PUSH
from geomesh_p2p.wire import collective_pb2
from tests.collective_util import deltas_for, reference
from tests.wait_util import until

pytestmark = pytest.mark.timeout(60)


def _probe_service(**kw) -> LinkProbeService:
    """A LinkProbeService on a stand-in transport (only ``add_unary`` is used at construction)."""
    return LinkProbeService(SimpleNamespace(add_unary=lambda *a, **k: None), **kw)


def test_probe_rate_table_is_capped_lru_and_a_staying_caller_keeps_its_count():
    svc = _probe_service(max_per_minute=3, max_callers=100)
    svc._admit("stayer", 0)
    svc._admit("stayer", 0)
    for i in range(10_000):
        svc._admit(f"sybil-{i}", 0)
        if i % 50 == 0:  # the honest caller keeps probing now and then, so it stays recent
            try:
                svc._admit("stayer", 0)
            except EnvelopeError as err:
                assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(svc._recent) <= 100
    assert len(svc._recent) == 100
    assert "stayer" in svc._recent and len(svc._recent["stayer"]) == 3  # its 3 probes of this minute
    assert "sybil-0" not in svc._recent and "sybil-9999" in svc._recent  # least recent forgotten first
    with pytest.raises(EnvelopeError) as e:
        svc._admit("stayer", 0)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in a minute" in e.value.reason


def test_probe_rate_table_cap_must_be_positive():
    with pytest.raises(ValueError):
        _probe_service(max_callers=0)


async def test_far_future_pushes_are_refused_at_once_and_an_honest_early_push_is_still_held(swarms):
    sw = await swarms(2, max_held_requests=4, hold_unknown_round_s=10.0)
    owner, sender = sw.services
    numel = 2 * 2048
    for svc in sw.services:
        svc.register(sw.spec(numel, round=1))
    # An outsider names far-future rounds: each push is refused at once (FAILED_PRECONDITION), holds no
    # slot, and is not parsed (an empty payload would otherwise be INVALID_ARGUMENT once the round existed).
    far = [sw.transports[1].call(sw.addresses[0], COLLECTIVE_PUSH, b"", round=10**6 + k, timeout=5) for k in range(20)]
    errors = await asyncio.gather(*far, return_exceptions=True)
    assert all(isinstance(e, RpcError) and e.code == grpc.StatusCode.FAILED_PRECONDITION for e in errors)
    assert errors[0].reason == "round 1000000 is too far ahead of this node's round 1"
    pull = collective_pb2.PullPartRequest(round=10**6, part=0, wait_s=5.0).SerializeToString()
    with pytest.raises(RpcError) as e:
        await sw.transports[1].call(sw.addresses[0], COLLECTIVE_PULL, pull, round=10**6, timeout=5)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "too far ahead" in e.value.reason
    assert owner._held == 0 and owner._round_events == {}
    # An honest early push for newest + 1 is still held, then accepted when its spec arrives.
    spec2 = sw.spec(numel, round=2, deadline_s=4.0)
    deltas = deltas_for(sw.pids, numel)
    tokens = {p: 100 + k for k, p in enumerate(sw.pids)}
    early = asyncio.create_task(sender.all_reduce(spec2, deltas[sw.pids[1]], tokens[sw.pids[1]]))
    try:
        await until(lambda: owner._held >= 1, timeout=10, what="the early push for round 2 is held")
        mine = await owner.all_reduce(spec2, deltas[sw.pids[0]], tokens[sw.pids[0]])
        theirs = await early
    finally:
        early.cancel()
    assert mine.missing_parts == [] and theirs.missing_parts == []
    assert torch.equal(mine.aggregate, theirs.aggregate)
    assert torch.equal(mine.aggregate, reference(spec2, deltas, tokens, {0: sw.pids, 1: sw.pids}))


async def test_before_any_round_is_registered_any_round_is_held(swarms):
    sw = await swarms(1, hold_unknown_round_s=0.2)
    pull = collective_pb2.PullPartRequest(round=10**6, part=0, wait_s=0.2).SerializeToString()
    reply = await sw.transports[0].call(sw.addresses[0], COLLECTIVE_PULL, pull, round=10**6, timeout=5)
    assert collective_pb2.PullPartResponse.FromString(reply.payload).ready is False  # held, then "not ready"


async def test_a_node_that_caught_up_holds_pushes_for_its_new_round(swarms):
    """Red team (session 13): a peer stopped at round 3 caught up to round 19 by a download; its owner service
    still measured "too far ahead" from round 3 and refused the others' round-19 pushes to the part it owned
    (one round's digests split). note_round (called when a state is adopted) moves the bound."""
    sw = await swarms(2, max_held_requests=4, hold_unknown_round_s=0.2)
    owner = sw.services[0]
    owner.register(sw.spec(2 * 2048, round=3))
    call = sw.transports[1].call(sw.addresses[0], COLLECTIVE_PUSH, b"", round=19, timeout=5)
    with pytest.raises(RpcError) as e:
        await call
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "round 19 is too far ahead" in e.value.reason
    owner.note_round(19)  # the download adopted round 19's state
    with pytest.raises(RpcError) as e:
        await sw.transports[1].call(sw.addresses[0], COLLECTIVE_PUSH, b"", round=19, timeout=5)
    # held (not refused as too far ahead), then "not open yet" once the hold ends without the spec
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "too far ahead" not in e.value.reason
    with pytest.raises(RpcError) as e:
        await sw.transports[1].call(sw.addresses[0], COLLECTIVE_PUSH, b"", round=22, timeout=5)
    assert "round 22 is too far ahead of this node's round 19" in e.value.reason
