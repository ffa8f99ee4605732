"""Red team 52c, attack B on session 52's status52: ``PeerRecord.activity`` (announced at once on change), the end of
``RoundDriver.run`` waiting up to ``LEAVING_ANNOUNCE_WAIT_S`` for a stop's leaving announcement, ``said_leaving`` and
the ``silent`` state. In-process, no real sleeps (the driver's wait bound is patched to 0.05 s where it must expire);
the builders of tests/unit/test_leaving_alone52.py and tests/unit/test_round_driver.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

import geomesh_p2p.round.driver as driver_mod
from geomesh_p2p.dht.announce import PeerAnnouncer, live_peers
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node.report import leaving_unsaid
from geomesh_p2p.schema.peer import MAX_ACTIVITY_CHARS
from geomesh_p2p.status.swarm import _state
from tests.driver_util import record_activity
from tests.records_util import peer_record
from tests.unit.test_leaving_alone52 import _Node
from tests.unit.test_round_driver import FakeClock, FakePeer, _peers

pytestmark = pytest.mark.timeout(30)


class GoneDHT(FakePeer):
    """The DHT is gone once the stop comes: a store never returns (each RPC to a dead host waits out its timeout)."""

    async def announce(self):
        if self.stop.is_set():
            await asyncio.Event().wait()
        self.swarm.records[self.me] = self.record()


async def test_a_stop_with_the_dht_gone_waits_the_bound_once_and_the_shutdown_does_not_store_again(monkeypatch):
    """Before: the end of the rounds waited LEAVING_ANNOUNCE_WAIT_S (15 s), cancelled the store, and the shutdown (the
    announcer had stored no leaving record: said_leaving False) started a second store with no bound at all. Now the
    driver says its wait expired and the node's shutdown announces nothing more (its own store is bounded too)."""
    monkeypatch.setattr(driver_mod, "LEAVING_ANNOUNCE_WAIT_S", 0.05)
    (lone,) = _peers(1, cls=GoneDHT)
    clock = FakeClock(on_wait=lambda t: t > 1000.0 + 5 and lone.stop.set())
    drv = lone.driver(min_peers=3, wait_peers_s=600.0, clock=clock)
    await asyncio.wait_for(drv.run(), 10)
    assert drv.leaving_wait_expired is True and lone.leaving is True
    assert lone.swarm.records[lone.me].leaving is False  # nothing stored: the DHT is gone
    announcer = SimpleNamespace(said_leaving=False)  # what the node's announcer says then
    assert leaving_unsaid(SimpleNamespace(announcer=announcer, _round_driver=drv)) is False


async def test_a_stop_with_the_dht_up_stores_leaving_once():
    """The healthy case: the wait ends with the store, said_leaving is True, the shutdown does not announce again
    (never twice), and a node whose driver never ran still announces (never none)."""
    (lone,) = _peers(1)
    clock = FakeClock(on_wait=lambda t: t > 1000.0 + 5 and lone.stop.set())
    drv = lone.driver(min_peers=3, wait_peers_s=600.0, clock=clock)
    await asyncio.wait_for(drv.run(), 10)
    assert drv.leaving_wait_expired is False and lone.swarm.records[lone.me].leaving is True
    stored = SimpleNamespace(said_leaving=True)
    assert leaving_unsaid(SimpleNamespace(announcer=stored, _round_driver=drv)) is False
    assert leaving_unsaid(SimpleNamespace(announcer=SimpleNamespace(said_leaving=False), _round_driver=None)) is True
    assert leaving_unsaid(SimpleNamespace(announcer=None, _round_driver=None)) is False


class _Refusing(_Node):
    async def store(self, key, data, expiration, subkey=None, owner=None):
        self.stored.append(data)
        return False  # no node accepted it (each holds a newer value, or none answered)


async def test_said_leaving_is_false_when_no_node_accepted_the_leaving_record():
    """Before: ``last`` was set whatever the store answered, so a leaving record no node accepted read as said and the
    shutdown announced nothing (the record stayed ``training`` until it expired)."""
    ident = Identity.generate()
    node = _Refusing(ident)
    a = PeerAnnouncer(node, lambda: peer_record(str(ident.peer_id), leaving=True), period_s=2.0)
    assert await a.announce_once() is False
    assert a.last is not None and a.last.leaving is True
    assert a.said_leaving is False


class _Signalling(_Node):
    """Sets ``entered`` when a store starts and ``two`` once two stores completed."""

    def __init__(self, ident):
        super().__init__(ident)
        self.entered, self.two = asyncio.Event(), asyncio.Event()

    async def store(self, key, data, expiration, subkey=None, owner=None):
        self.entered.set()
        ok = await super().store(key, data, expiration, subkey=subkey, owner=owner)
        if len(self.stored) >= 2:
            self.two.set()
        return ok


async def test_activity_changes_during_a_store_coalesce_into_one_more_store():
    """A flapping activity (50 changes while a store is in flight) costs 2 stores, not 51: ``update`` only wakes the
    announcer's loop, one store at a time. Changes spread across completed stores cost one store each: the announcer
    does not rate-limit them, the driver's phases do (next test)."""
    ident = Identity.generate()
    node = _Signalling(ident)
    node.gate = asyncio.Event()
    state = {"activity": "waiting"}
    a = PeerAnnouncer(node, lambda: peer_record(str(ident.peer_id), activity=state["activity"]), period_s=60.0)
    task = asyncio.ensure_future(a.run())
    try:
        await asyncio.wait_for(node.entered.wait(), 5)  # the first store is in flight (blocked on the gate)
        for k in range(50):
            state["activity"] = "no plan" if k % 2 else "waiting"
            a.update(a._source)
        node.gate.set()
        await asyncio.wait_for(node.two.wait(), 5)
        for _ in range(20):  # the loop settles: due in 60 s, no wake left
            await asyncio.sleep(0)
        assert len(node.stored) == 2 and a.announced == 2
        assert json.loads(node.stored[-1])["activity"] == "no plan"  # the last change (k = 49) is what was stored
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_driver_changes_its_activity_at_most_once_a_phase():
    """Three rounds of a pair: one change in all (``training``); a peer waiting 600 virtual seconds for --min-peers
    (hundreds of gather reads) says ``waiting`` once."""
    pair = _peers(2)
    drivers = [p.driver(rounds=3, min_peers=2) for p in pair]
    seen = record_activity(drivers)
    await asyncio.wait_for(asyncio.gather(*(d.run() for d in drivers)), 30)
    assert [len(p.drv.history) for p in pair] == [3, 3]
    assert seen == [["training"], ["training"]]
    (lone,) = _peers(1)
    reads = {"n": 0}
    clock = FakeClock(on_wait=lambda t: (reads.__setitem__("n", reads["n"] + 1), t > 1000.0 + 600 and lone.stop.set()))
    drv = lone.driver(min_peers=3, wait_peers_s=6000.0, clock=clock)
    said: list = []
    drv._activity_changed = lambda: said.append(drv.activity)
    await asyncio.wait_for(drv.run(), 20)
    assert reads["n"] > 100 and said == ["waiting"]


class _Item(SimpleNamespace):
    pass


async def test_a_malformed_activity_drops_that_record_only():
    """Over MAX_ACTIVITY_CHARS, or not a string: the record is refused at parse and dropped from the read; the others
    stay. A control character is kept in the record and cleaned where shown."""
    ids = [Identity.generate() for _ in range(4)]
    good = [peer_record(str(i.peer_id), address="127.0.0.1:1", activity="training") for i in ids[:2]]
    long = json.loads(peer_record(str(ids[2].peer_id)).to_bytes())
    long["activity"] = "x" * (MAX_ACTIVITY_CHARS + 1)
    typed = json.loads(peer_record(str(ids[3].peer_id)).to_bytes())
    typed["activity"] = ["training"]
    values = [r.to_bytes() for r in good] + [json.dumps(long).encode(), json.dumps(typed).encode()]
    found = {
        str(i.peer_id): _Item(value=v, owner=SimpleNamespace(to_string=lambda i=i: str(i.peer_id)), expiration_time=0.0)
        for i, v in zip(ids, values)
    }

    class Node:
        run_id = "run"

        async def get(self, key, latest=True, subkeys=None):
            return found

    got = await live_peers(Node(), "run")
    assert sorted(r.peer_id for r in got) == sorted(str(i.peer_id) for i in ids[:2])
    with pytest.raises(ValidationError):
        peer_record("p", activity="x" * (MAX_ACTIVITY_CHARS + 1))
    rec = peer_record("p", address="127.0.0.1:1", round=9, weights_digest="d", timestamp=1000.0, activity="a\x07b")
    assert _state(rec, None, 9, 1001.0, 10.0) == "a\ufffdb"


def test_silent_reads_the_records_timestamp_so_a_skewed_clock_moves_it():
    """``silent`` compares the record's timestamp (the peer's swarm time: ``node.now()``, its measured offset applied)
    with the reader's: a fresh record of a peer whose swarm time is 35 s behind reads ``silent`` at 12 s rounds
    (34 s), and a killed peer whose swarm time was 1000 s ahead never reads ``silent`` (until its record expires).
    Advisory only (nobody's round reads it); the offset the swarm clock measures keeps honest peers within it."""
    now = 1_000_000.0
    fresh_behind = peer_record("p", address="127.0.0.1:1", round=9, weights_digest="d", timestamp=now - 35.0)
    assert _state(fresh_behind, None, 9, now, 12.0) == "silent"
    killed_ahead = peer_record("p", address="127.0.0.1:1", round=9, weights_digest="d", timestamp=now + 1000.0)
    assert _state(killed_ahead, None, 9, now + 900.0, 12.0) == "training"
