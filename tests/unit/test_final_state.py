"""A peer whose run ended serves its last state to the peers still catching up to it (session 27,
``node.report.serve_final_state``): peers planned out of the last round download it after the round ends, and
before, every participant could be gone by then."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node.report import catching_up, serve_final_state
from geomesh_p2p.telemetry import events
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)


def _ids(n: int) -> list[str]:
    return [str(Identity.generate().peer_id) for _ in range(n)]


def _node(me: str, round: int, reads: list) -> SimpleNamespace:
    """A node at ``round`` whose k-th read of the records returns ``reads[min(k, last)]``."""
    node = SimpleNamespace(me=me, round=round, _stop=asyncio.Event(), calls=0)

    async def peers(include_leaving=False):
        assert include_leaving
        k = min(node.calls, len(reads) - 1)
        node.calls += 1
        return reads[k]

    node.peers = peers
    return node


def test_who_catches_up_is_a_live_syncing_peer_announcing_this_round():
    me, a, b, c, d, e = _ids(6)
    recs = [
        peer_record(me, round=3, weights_digest="x"),
        peer_record(a, round=3),  # syncing to round 3: waits for this state
        peer_record(b, round=3, weights_digest="x"),  # holds it
        peer_record(c, round=2),  # syncing to another round
        peer_record(d, round=3, leaving=True),  # gone
        peer_record(e, round=3),
    ]
    assert catching_up(recs, me, 3) == sorted([a, e])


async def test_it_waits_until_the_peer_catching_up_holds_the_state_and_says_so_once():
    me, a = _ids(2)
    waiting = [peer_record(me, round=3, weights_digest="x"), peer_record(a, round=3)]
    synced = [peer_record(me, round=3, weights_digest="x"), peer_record(a, round=3, weights_digest="x")]
    node = _node(me, 3, [waiting, waiting, waiting, synced])
    with events.capture("serving_final_state") as said:
        left = await serve_final_state(node, max_linger_s=20.0, poll_s=0.01)
    assert left == [] and node.calls == 4
    assert [(e["round"], e["readers"]) for e in said] == [(3, [a])]


async def test_nobody_catching_up_costs_one_read_and_a_stop_request_none():
    me, a = _ids(2)
    node = _node(me, 5, [[peer_record(me, round=5, weights_digest="x"), peer_record(a, round=5, weights_digest="x")]])
    assert await serve_final_state(node, poll_s=0.01) == [] and node.calls == 1
    stopped = _node(me, 5, [[peer_record(a, round=5)]])
    stopped._stop.set()
    assert await serve_final_state(stopped, poll_s=0.01) == [] and stopped.calls == 0


async def test_it_stops_waiting_at_its_limit_and_returns_who_did_not_catch_up():
    me, a = _ids(2)
    node = _node(me, 2, [[peer_record(a, round=2)]])
    assert await serve_final_state(node, max_linger_s=0.05, poll_s=0.01) == [a]
    assert node.calls >= 2


async def test_a_failed_read_ends_the_wait():
    me = _ids(1)[0]
    node = SimpleNamespace(me=me, round=1, _stop=asyncio.Event())

    async def peers(include_leaving=False):
        raise RuntimeError("the DHT is gone")

    node.peers = peers
    assert await serve_final_state(node, poll_s=0.01) == []


def test_a_peer_holding_the_last_rounds_start_state_is_catching_up_to_its_end():
    """Session 48: a peer planned out of the last round (2) whose wait for its end passed announces the round's start
    state (round 2, the plan's start digest) between two catch-ups; a trainer that read its record then exited, and
    it ended exit 3. With the plan's start, it is served; another state, or a leaving peer, is not waited for."""
    me, a, b, c, d = _ids(5)
    recs = [
        peer_record(me, round=3, weights_digest="y"),
        peer_record(d, round=2, weights_digest="x"),  # a participant: finishes round 2 itself, or was killed
        peer_record(a, round=2, weights_digest="x"),  # planned out of round 2: holds its start, will catch up
        peer_record(b, round=2, weights_digest="z"),  # another state: not this run's lineage
        peer_record(c, round=2, weights_digest="x", leaving=True),
    ]
    assert catching_up(recs, me, 3) == []  # before: nobody, and the trainer exited
    assert catching_up(recs, me, 3, (2, "x"), [me, d]) == [a]


def test_the_start_served_is_the_plan_of_the_round_before_this_one():
    from geomesh_p2p.node.report import final_plan_start

    me = _ids(1)[0]
    plan = SimpleNamespace(round=2, start_digest="x", participants=lambda: [me])
    node = SimpleNamespace(me=me, round=3, _round_driver=SimpleNamespace(last_plan=plan))
    assert final_plan_start(node) == ((2, "x"), [me])
    node.round = 4  # its last plan is of an older round (it caught up since): no start to serve
    assert final_plan_start(node) == (None, [])
    assert final_plan_start(SimpleNamespace(me=me, round=3)) == (None, [])  # no driver (stopped before its rounds)
