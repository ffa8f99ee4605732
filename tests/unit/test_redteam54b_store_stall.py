"""Red team 54b, the kind of the clock fixes elsewhere: a time measured across an await, inflated by a pause of the
process (SIGSTOP, a VM paused, swap, an event loop blocked), then acted on.

``DHTNode.store`` times each store with ``time.monotonic()`` around ``await self._replicate(...)`` into
``store_times`` (the last 32), and ``recent_store_s`` (their max) is acted on: ``PeerAnnouncer.lifetime_s`` makes this
peer's record live 4 x that (up to 23.8 h), and ``PlanStore.settle_s`` settles (and staggers take-overs) by it. One
pause of 10 minutes during one store -- nothing slow on the network -- makes the next 32 stores' records live 40
minutes: a peer killed after it stays in every reader's live records for 40 minutes instead of ~30 s. Fixed: a store
counts at most ``STORE_TIME_CAP_RPCS`` rpc timeouts.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import geomesh_p2p.dht.node as dht_node
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.announce import PeerAnnouncer
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.plan.agree import PlanStore
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)


def test_a_pause_during_one_store_does_not_make_records_live_four_times_the_pause(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(dht_node, "time", SimpleNamespace(monotonic=lambda: now[0]))
    ident = Identity.generate()
    node = DHTNode(Transport(ident, "run", TransportConfig(host="127.0.0.1", port=0)))

    async def replicate(by_key, *, reuse_targets=False):
        now[0] += 600.0  # the process is stopped while the store is in flight (the network took 5 ms)
        return {k: [True] * len(v) for k, v in by_key.items()}

    monkeypatch.setattr(node, "_replicate", replicate)
    asyncio.run(node.store("run/x", b"v", node.now() + 60.0, subkey="s", owner=ident))
    # fixed: a store counts at most 10 rpc timeouts (30 s at the default 3 s), what its RPCs can take
    assert node.recent_store_s() == dht_node.STORE_TIME_CAP_RPCS * node.rpc_timeout_s == 30.0
    ann = PeerAnnouncer(node, peer_record(ident.peer_id.to_string(), address="127.0.0.1:1"), period_s=2.0, ttl_s=28.0)
    store = PlanStore(node, ident, "run")
    assert ann.lifetime_s() == 120.0 and store.settle_s() == 30.0  # were 2,400 s and 600 s
