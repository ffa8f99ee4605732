"""A chunked value of the stable layout (a plan in a run with record shards S > 1) has its chunks under the same keys
every other round, and a reader asks one of the holders it found before for each chunk (issue 25, session 26).

Each chunk of a plan was under a key of its own hash: a lookup per chunk every round (~7 calls at N = 1,024). Under
``<prefix>/parts/<round % 2>/<i>`` a follower's ``DHTNode.get(..., quorum=1, cached=True)`` asks one holder drawn
at random among the key's nearest nodes its last lookup found. Every chunk is checked against the head's hash, so a
holder that answers an older chunk of the owner's slot (it missed the newer store) costs a read of the chunk under the
key of its hash (where the writer always stores it: a lookup, as before), never a wrong or a missing plan.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from geomesh_p2p.dht.chunked import ChunkedReader, ChunkFormat, chunk_key, split, stable_chunk_key, store_chunked
from geomesh_p2p.dht.records import key_id_of
from geomesh_p2p.net.methods import DHT_FIND
from tests.dht_helpers import RUN, start_swarm, stop_all

pytestmark = pytest.mark.timeout(120)

FMT = ChunkFormat(magic=b"gmtest/1", what="value", value_bytes=1000)


@pytest.fixture(autouse=True)
def _patient_reads(monkeypatch):
    """The reused read's wait (twice the lookup, at least 0.1 s) is not what these tests check: on 2 loaded cores a
    slow answer would drop the cache and change the counts asserted."""
    monkeypatch.setattr("geomesh_p2p.dht.node.MIN_READ_WAIT_S", 10.0)


def _holds(node, key: str, subkey: str) -> bool:
    return any(r.HasField("subkey") and r.subkey == subkey for r in node._local_records(key_id_of(key)))


async def _settle(node) -> None:
    await asyncio.gather(*(t for t in list(node.tasks._tasks) if t.get_name() == "dht-lookup-tail"))


def _finds(node) -> int:
    return node.transport.stats.calls_by_method.get(DHT_FIND, 0)


async def _publish(leader, round: int, body: bytes):
    key = f"{RUN}/plan/{round}"
    value = split(body, FMT, stable=True)
    out = await store_chunked(
        leader, key, value, subkey=leader.peer_id.to_string(), owner=leader.identity, expiration_time=leader.now() + 60
    )
    assert out.ok and len(value.chunks) == 3
    return key, value


async def test_stable_chunks_are_read_from_one_cached_holder_each_round_after_the_first():
    """Round 7: the reader looks each of the 3 chunk keys up once. Round 9 (the same keys: 9 % 2 = 7 % 2), a new body:
    exactly one Find call per chunk and no lookup, and the body is the new one. The chunks are also under the keys of
    the layout before (readers of earlier releases)."""
    nodes = await start_swarm(16, rpc_timeout_s=20.0)  # stores that time out on loaded cores would leave stale copies
    try:
        leader, reader = nodes[0], nodes[9]
        owner = leader.peer_id.to_string()
        key, value = await _publish(leader, 7, os.urandom(2500))
        assert any(_holds(n, chunk_key(key, value.sha256, 0), owner) for n in nodes)
        assert stable_chunk_key(key, 2) == f"{RUN}/plan/parts/1/2"
        rd = ChunkedReader(reader, FMT, decode=bytes)
        assert await rd.body(key, owner, value.head) == b"".join(value.chunks)
        assert (reader.read_lookups, reader.read_reuses) == (3, 0)
        await _settle(reader)
        body9 = os.urandom(2500)
        key9, value9 = await _publish(leader, 9, body9)
        lookups0, calls0 = reader.stats.lookups, _finds(reader)
        assert await rd.body(key9, owner, value9.head) == body9
        assert (reader.read_lookups, reader.read_reuses) == (3, 3)
        assert _finds(reader) - calls0 == 3 and reader.stats.lookups == lookups0
    finally:
        await stop_all(nodes)


async def test_a_holder_answering_an_older_chunk_costs_a_lookup_not_the_value(monkeypatch):
    """The cached holder asked for chunk 0 missed round 9's store and answers round 7's chunk 0 (the owner's slot
    held it): it does not match round 9's head, so the reader drops the key's holders and reads chunk 0 under the key
    of its hash (one lookup). The body is round 9's."""
    monkeypatch.setattr("geomesh_p2p.dht.node.random.shuffle", lambda xs: None)  # ask the cache's first holder
    nodes = await start_swarm(16, rpc_timeout_s=20.0)  # stores that time out on loaded cores would leave stale copies
    try:
        leader, reader = nodes[0], nodes[9]
        owner = leader.peer_id.to_string()
        key, value = await _publish(leader, 7, os.urandom(2500))
        rd = ChunkedReader(reader, FMT, decode=bytes)
        assert await rd.body(key, owner, value.head) == b"".join(value.chunks)
        await _settle(reader)
        ckey = stable_chunk_key(key, 0)
        cached = reader._read_targets[key_id_of(ckey)]
        stale = next(n for n in nodes if n.node_id in cached.ids and _holds(n, ckey, owner))
        old = next(r for r in stale._local_records(key_id_of(ckey)) if r.subkey == owner)
        cached.ids.remove(stale.node_id)
        cached.ids.insert(0, stale.node_id)
        body9 = os.urandom(2500)
        key9, value9 = await _publish(leader, 9, body9)
        del stale.storage.get(key_id_of(ckey)).value[owner]  # it missed round 9's store: round 7's chunk is left
        assert stale._store_local(old, from_peer=None).stored
        if _holds(reader, ckey, owner):  # the reader's own copy (k = 20 > 16 nodes: every node holds) merges first
            del reader.storage.get(key_id_of(ckey)).value[owner]
        lookups0, lookups1 = reader.read_lookups, reader.stats.lookups
        assert await rd.body(key9, owner, value9.head) == body9
        assert reader.read_reuses == 3  # chunk 0 asked its cached holder (stale), chunks 1 and 2 theirs
        assert key_id_of(ckey) not in reader._read_targets  # dropped: the next read of chunk 0 looks it up
        assert reader.read_lookups == lookups0  # the key of its hash is read as before: no cache involved
        # at most one lookup: of the key of its hash (none when the reader holds that chunk itself: k = 20 > 16 nodes)
        assert reader.stats.lookups - lookups1 <= 1
    finally:
        await stop_all(nodes)
