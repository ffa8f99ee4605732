"""Kademlia over gRPC: 32 nodes in one process, churn, re-publishing, joining, client-only nodes."""

from __future__ import annotations

import random
import time

import pytest

from geomesh_p2p.node.joining import SAMPLED_READ_QUORUM

from geomesh_p2p.telemetry import events
from geomesh_p2p.dht import DHTJoinError, DHTNode, LookupStats, key_id_of
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.methods import DHT_FIND
from tests.dht_helpers import RUN, start_node, start_swarm, stop_all, stop_node, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_32_nodes_value_found_from_every_node_survives_a_third_dying_and_newcomers_join():
    nodes = await start_swarm(32)
    newcomers = []
    try:
        rnd = random.Random(7)
        # a value stored at any node ...
        stored = {}
        for i, at in enumerate(rnd.sample(nodes, 4)):
            key, value = f"run/key-{i}", f"value-{i}".encode()
            assert await at.store(key, value, time.time() + 120)
            stored[key] = value
        assert await nodes[5].store("run/dict", b"a", time.time() + 120, subkey="sa")
        assert await nodes[9].store("run/dict", b"b", time.time() + 120, subkey="sb")
        # ... is found from every node
        for node in nodes:
            for key, value in stored.items():
                found = await node.get(key, latest=False)
                assert found[None].value == value, (node.peer_id, key)
        for node in rnd.sample(nodes, 4):
            stats = LookupStats()
            found = await node.get("run/dict", latest=True, stats=stats)
            assert {sk: v.value for sk, v in found.items()} == {"sa": b"a", "sb": b"b"}
            assert stats.hops <= 3
        # killing a third of the nodes loses no value stored before
        dead = rnd.sample(nodes, len(nodes) // 3)
        await stop_all(dead)
        alive = [n for n in nodes if n not in dead]
        for node in alive:
            for key, value in stored.items():
                found = await node.get(key, latest=False)
                assert found[None].value == value
        for node in rnd.sample(alive, 3):
            found = await node.get("run/dict", latest=True)
            assert set(found) == {"sa", "sb"}
        # a new node joins through any live node, finds old values, and its value is found by others
        for via in rnd.sample(alive, 2):
            newcomers.append(await start_node([via.address]))
        new = newcomers[-1]
        for key, value in stored.items():
            assert (await newcomers[0].get(key))[None].value == value
        assert await new.store("run/new", b"fresh", time.time() + 60)
        for node in rnd.sample(alive, 8) + newcomers:
            assert (await node.get("run/new", latest=False))[None].value == b"fresh"
    finally:
        await stop_all(nodes + newcomers)


async def test_replicas_are_republished_before_they_expire():
    # 3 replicas only (every node still knows every other: k=20 > 12 nodes, so this tests
    # re-replication, not routing): kill the holders one by one, the survivors re-replicate
    nodes = await start_swarm(12, num_replicas=3, republish_period_s=0.5, refresh_period_s=0.5)
    try:
        publisher = nodes[0]
        key = "run/orphan"
        assert await publisher.store(key, b"keep me", time.time() + 120)
        await stop_node(publisher)
        alive = nodes[1:]
        kid = key_id_of(key)

        def holders():
            return [n for n in alive if kid in n.storage]

        for _ in range(3):

            async def enough():
                return len(holders()) >= 2

            await wait_for(enough, timeout=20, what="the value to be re-replicated")
            victim = holders()[0]
            await stop_node(victim)
            alive.remove(victim)

        async def replicated():
            return len(holders()) >= 2

        await wait_for(replicated, timeout=20, what="the value to be re-replicated after the last kill")
        for node in random.sample(alive, 3):
            assert (await node.get(key))[None].value == b"keep me"
        assert sum(n.stats.republished for n in nodes) > 0  # the dead ones may have done it
    finally:
        await stop_all(nodes)


async def test_expired_values_disappear_and_newest_expiration_wins():
    nodes = await start_swarm(4)
    try:
        now = time.time()
        assert await nodes[0].store("run/x", b"old", now + 60)
        assert await nodes[1].store("run/x", b"new", now + 90)
        assert not await nodes[2].store("run/x", b"older", now + 30)  # a newer value is held everywhere
        for n in nodes:
            assert (await n.get("run/x"))[None].value == b"new"
        assert await nodes[3].store("run/short", b"v", time.time() + 1.0)
        assert (await nodes[0].get("run/short"))[None].value == b"v"

        async def gone():
            return await nodes[0].get("run/short") == {}

        await wait_for(gone, timeout=5, what="the value to expire")
    finally:
        await stop_all(nodes)


async def test_client_only_node_joins_stores_and_gets_by_calling_others():
    nodes = await start_swarm(3)
    client = None
    try:
        client = await start_node([nodes[0].address], client_only=True)
        assert client.address is None
        assert await client.store("run/from-client", b"hello", time.time() + 30)
        assert (await nodes[2].get("run/from-client"))[None].value == b"hello"
        assert await nodes[1].store("run/to-client", b"world", time.time() + 30)
        assert (await client.get("run/to-client"))[None].value == b"world"
        # nobody put the client-only node in a routing table
        for n in nodes:
            assert all(c.peer_id != client.peer_id for c in n.contacts())
    finally:
        await stop_all(nodes + ([client] if client else []))


async def test_join_without_answering_bootstrap_raises_clear_error():
    me = Identity.generate()
    with events.capture("dht_join_retry") as retries, pytest.raises(DHTJoinError) as ei:
        await start_node(["127.0.0.1:1", "127.0.0.1:2"], identity=me, join_attempts=3, join_backoff_s=0.05)
    msg = str(ei.value)
    assert "127.0.0.1:1" in msg and "127.0.0.1:2" in msg and "3 attempt" in msg and "UNAVAILABLE" in msg
    # 3 attempts = 2 waits, the backoff doubling from 0.05 s with +-20 % jitter; none after the last attempt
    mine = [e for e in retries if e["peer"] == me.peer_id.to_string()]
    assert [(e["attempt"], e["attempts"]) for e in mine] == [(1, 3), (2, 3)]
    assert 0.04 <= mine[0]["wait_s"] <= 0.06 and 0.08 <= mine[1]["wait_s"] <= 0.12
    with pytest.raises(DHTJoinError, match="not host:port"):
        await start_node(["nonsense"])


async def test_join_refused_by_another_run_says_so_without_retrying():
    other = await start_node(run_id="another-run")
    try:
        me = Identity.generate()
        with events.capture("dht_join_retry") as retries, pytest.raises(DHTJoinError) as ei:
            await start_node([other.address], identity=me, join_attempts=5, join_backoff_s=1.0)
        assert str(ei.value) == (
            f"could not join the DHT: bootstrap {other.address} serves run 'another-run', "
            f"not the run '{RUN}' asked for: check --run-id"
        )
        # a refusal is final: no backoff, no second attempt
        assert [e for e in retries if e["peer"] == me.peer_id.to_string()] == []
    finally:
        await stop_node(other)


async def test_several_bootstraps_one_dead():
    a = await start_node()
    b = None
    try:
        b = await start_node(["127.0.0.1:1", a.address])
        assert [c.peer_id for c in b.contacts()] == [a.peer_id]
    finally:
        await stop_all([a] + ([b] if b else []))


async def test_create_starts_transport_and_joins():
    from geomesh_p2p.net.transport import Transport

    a = await start_node()
    t = Transport(Identity.generate(), a.run_id)
    node = await DHTNode.create(t, bootstrap=[a.address], k=20, alpha=3, refresh_period_s=30)
    try:
        assert node.address is not None and len(node.contacts()) == 1
        with pytest.raises(RuntimeError, match="before transport.start"):
            DHTNode(t)
    finally:
        await stop_all([a, node])


async def test_a_stores_lookup_asks_for_nodes_only_and_a_get_still_sees_every_record():
    # Issue 25: a store's lookup (every announcement) carried every record held under the key from every node
    # on the way: at N peers' records under <run>/peers, N x ~1 KB per Find reply. It now asks for nodes only.
    nodes = await start_swarm(6)
    try:
        writers = nodes[:5]
        for i, w in enumerate(writers):  # 5 owners' records under one key, 2 KB each
            assert await w.store(
                "run/peers", bytes([i]) * 2000, time.time() + 120, subkey=w.peer_id.to_string(), owner=w.identity
            )
        reader = nodes[5]
        stats = reader.transport.stats
        before = stats.by_method.get(DHT_FIND, (0, 0))[1]
        assert await reader.store(
            "run/peers", b"r" * 2000, time.time() + 120, subkey=reader.peer_id.to_string(), owner=reader.identity
        )
        store_recv = stats.by_method.get(DHT_FIND, (0, 0))[1] - before
        calls = reader.stats.lookups
        before = stats.by_method.get(DHT_FIND, (0, 0))[1]
        found = await reader.get("run/peers", latest=True)
        get_recv = stats.by_method.get(DHT_FIND, (0, 0))[1] - before
        assert sorted(found) == sorted(n.peer_id.to_string() for n in nodes)  # every record, its own included
        assert {found[w.peer_id.to_string()].value for w in writers} == {bytes([i]) * 2000 for i in range(5)}
        assert calls >= 1 and store_recv > 0
        # the store's Find replies carried node lists only (less than two of the 2 KB records in all, where each
        # node holds 5 of them); the get's carried the records (all 6 from a node)
        assert store_recv < 2 * 2000, store_recv
        assert get_recv > 6 * 2000, get_recv
    finally:
        await stop_all(nodes)


async def _store_peer_records(writers, size: int) -> None:
    """Writer i stores ``bytes([i]) * size`` under ``run/peers``, its own PeerID as subkey, for 120 s."""
    for i, w in enumerate(writers):
        assert await w.store(
            "run/peers", bytes([i]) * size, time.time() + 120, subkey=w.peer_id.to_string(), owner=w.identity
        )


async def test_a_read_of_chosen_subkeys_carries_only_their_records():
    # Issue 25: a light follower checks a sample of the plan's participants; reading their records must not
    # carry the key's N records. FindRequest.subkeys asks a node for these subkeys' records only.
    nodes = await start_swarm(6)
    try:
        await _store_peer_records(nodes[:5], 8000)
        reader = nodes[5]
        reader.read_quorum = None  # both reads ask every holder: the same nodes answer, whatever the load
        stats = reader.transport.stats
        wanted = [nodes[1].peer_id.to_string(), nodes[3].peer_id.to_string(), "not-a-writer"]
        before = stats.by_method.get(DHT_FIND, (0, 0))[1]
        found = await reader.get("run/peers", latest=True, subkeys=wanted)
        sampled_recv = stats.by_method.get(DHT_FIND, (0, 0))[1] - before
        assert {sk: v.value for sk, v in found.items()} == {wanted[0]: bytes([1]) * 8000, wanted[1]: bytes([3]) * 8000}
        before = stats.by_method.get(DHT_FIND, (0, 0))[1]
        everyone = await reader.get("run/peers", latest=True)
        full_recv = stats.by_method.get(DHT_FIND, (0, 0))[1] - before
        assert len(everyone) == 5
        # each answering node sent 2 of its 5 records of 8 KB (the full read: all 5)
        assert sampled_recv < 0.6 * full_recv, (sampled_recv, full_recv)
        with pytest.raises(ValueError, match="subkeys asked"):
            await reader.get("run/peers", subkeys=[f"s{i}" for i in range(reader.limits.max_keys_per_find + 1)])
    finally:
        await stop_all(nodes)


async def test_a_sampled_read_with_its_own_quorum_asks_fewer_holders_for_the_same_records():
    # Session 18 (issue 25): a light follower's sampled read (joining.records_of) asks SAMPLED_READ_QUORUM (2)
    # holders, not the node's read_quorum (5); a record stored on every replica is found the same way.
    nodes = await start_swarm(12)
    try:
        await _store_peer_records(nodes[:8], 500)
        reader = nodes[11]
        wanted = [nodes[2].peer_id.to_string(), nodes[5].peer_id.to_string()]
        default, sampled = LookupStats(), LookupStats()
        full_q = await reader.get("run/peers", latest=True, stats=default, subkeys=wanted)
        low_q = await reader.get("run/peers", latest=True, stats=sampled, subkeys=wanted, quorum=SAMPLED_READ_QUORUM)
        expected = {wanted[0]: bytes([2]) * 500, wanted[1]: bytes([5]) * 500}
        assert {sk: v.value for sk, v in full_q.items()} == expected
        assert {sk: v.value for sk, v in low_q.items()} == expected
        # at most quorum + alpha - 1 holders asked (the calls in flight when it ended), fewer than the default's
        assert sampled.rpcs <= SAMPLED_READ_QUORUM + reader.alpha - 1 < default.rpcs, (sampled.rpcs, default.rpcs)
    finally:
        await stop_all(nodes)


async def test_a_latest_read_ends_at_its_quorum_of_answering_replicas_with_the_same_records():
    # Issue 25: get(latest=True) asked all k nearest nodes, each answering with every record under the key. It
    # now ends once read_quorum (5) nodes answered with records; every writer stored on all of them, so the
    # merged dictionary is the same.
    nodes = await start_swarm(12)
    try:
        await _store_peer_records(nodes[:8], 500)
        reader = nodes[11]
        assert reader.read_quorum == 5
        quorum_stats = LookupStats()
        quorum = await reader.get("run/peers", latest=True, stats=quorum_stats)
        reader.read_quorum = None  # the old rule: every replica
        all_stats = LookupStats()
        everyone = await reader.get("run/peers", latest=True, stats=all_stats)
        expected = {w.peer_id.to_string(): bytes([i]) * 500 for i, w in enumerate(nodes[:8])}
        assert {sk: v.value for sk, v in quorum.items()} == expected
        assert {sk: v.value for sk, v in everyone.items()} == expected
        # the quorum read asked at most quorum + alpha - 1 nodes (calls in flight when it ended), the old one 11
        assert quorum_stats.rpcs <= 5 + reader.alpha - 1 < all_stats.rpcs == 11, (quorum_stats.rpcs, all_stats.rpcs)
        with pytest.raises(ValueError, match="read_quorum"):
            DHTNode(reader.transport, read_quorum=0)
    finally:
        await stop_all(nodes)
