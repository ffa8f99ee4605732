"""Fresh user 52: a peer stopped by Ctrl-C while it waited alone for ``--min-peers`` logged "announcing now that this
peer leaves" and exited 0, yet the status views listed it ``training`` until its record expired (98.9 s after the exit).
Its gather ended at once on the stop, and the end of the rounds cancelled the announcement under way; the node's
shutdown then saw its ``leaving`` flag set and announced nothing."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.dht.announce import PeerAnnouncer
from geomesh_p2p.net.identity import Identity
from tests.driver_util import record_activity
from tests.records_util import peer_record
from tests.unit.test_round_driver import FakeClock, FakePeer, _peers

pytestmark = pytest.mark.timeout(30)


class SlowAnnounce(FakePeer):
    """A DHT store takes real time (a lookup and k stores): the leaving announcement is still in flight when the lone
    peer's gather returns on the stop."""

    async def announce(self):
        record = self.record()
        await asyncio.sleep(0.2)
        self.swarm.records[self.me] = record


async def test_a_peer_stopped_while_waiting_alone_stores_its_leaving_record():
    (lone,) = _peers(1, cls=SlowAnnounce)
    clock = FakeClock(on_wait=lambda t: t > 1000.0 + 5 and lone.stop.set())
    await asyncio.wait_for(lone.driver(min_peers=3, wait_peers_s=600.0, clock=clock).run(), 20)
    assert lone.drv.history == []  # it never trained: it waited for 3 peers alone
    assert lone.leaving is True
    assert lone.swarm.records[lone.me].leaving is True  # stored, not only flagged


class _Node:
    """The DHT node an announcer stores through: ``store`` blocks on ``gate`` when one is set."""

    def __init__(self, ident: Identity):
        self.identity, self.run_id, self.stored = ident, "run", []
        self.gate: asyncio.Event | None = None

    def now(self) -> float:
        return 1_000_000.0

    async def store(self, key, data, expiration, subkey=None, owner=None):
        if self.gate is not None:
            await self.gate.wait()
        self.stored.append(data)
        return True

    async def get(self, key, latest=True):
        return {}


async def test_said_leaving_follows_what_was_stored_not_what_was_asked():
    ident = Identity.generate()
    me = str(ident.peer_id)
    node = _Node(ident)
    records = {"leaving": False}
    a = PeerAnnouncer(node, lambda: peer_record(me, leaving=records["leaving"]), period_s=2.0)
    assert a.said_leaving is False  # nothing announced yet
    assert await a.announce_once() is True
    assert a.said_leaving is False
    records["leaving"] = True
    node.gate = asyncio.Event()
    task = asyncio.ensure_future(a.announce_once())
    await asyncio.sleep(0.05)
    task.cancel()  # cancelled mid-store, as the end of the rounds did
    await asyncio.gather(task, return_exceptions=True)
    assert a.said_leaving is False  # so the node's shutdown announces it again
    node.gate = None
    assert await a.announce_once() is True
    assert a.said_leaving is True


async def test_the_driver_announces_what_it_does_when_that_changes():
    """RoundDriver.activity (PeerRecord.activity): a change is announced at once (``activity_changed``), once."""
    (lone,) = _peers(1)
    clock = FakeClock(on_wait=lambda t: t > 1000.0 + 5 and lone.stop.set())
    drv = lone.driver(min_peers=3, wait_peers_s=600.0, clock=clock)
    said: list = []
    drv._activity_changed = lambda: said.append(drv.activity)
    await asyncio.wait_for(drv.run(), 20)
    assert said == ["waiting"]  # said once, not at every read of the wait
    pair = _peers(2)
    drivers = [p.driver(rounds=2, min_peers=2) for p in pair]
    seen = record_activity(drivers)
    await asyncio.wait_for(asyncio.gather(*(d.run() for d in drivers)), 30)
    assert seen == [["training"], ["training"]]
