"""Peer records spread over shard keys (issue 25, ``RunConfig.record_shards``): real in-process DHT nodes."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.dht import PeerAnnouncer, live_peers
from geomesh_p2p.dht.records import key_id_of
from geomesh_p2p.schema.shards import record_shard, records_key, shards_of
from geomesh_p2p.telemetry import events
from tests.dht_helpers import RUN, start_swarm, stop_all
from tests.integration.test_dht_announce import node_record

pytestmark = pytest.mark.timeout(60)

SHARDS = 4


def _holders(nodes, key: str, subkey: str) -> int:
    """How many of ``nodes`` hold ``key``/``subkey`` in their local store."""
    return sum(
        1 for n in nodes for rec in n._local_records(key_id_of(key)) if rec.HasField("subkey") and rec.subkey == subkey
    )


async def test_records_spread_over_shards_are_read_whole_or_by_shard_and_a_misplaced_one_is_dropped():
    nodes = await start_swarm(16)
    try:
        writers, reader = nodes[:12], nodes[15]
        announcers = [PeerAnnouncer(n, node_record(n), period_s=30, shards=SHARDS) for n in writers]
        assert all(await asyncio.gather(*(a.announce_once() for a in announcers)))
        ids = sorted(n.peer_id.to_string() for n in writers)
        # each record lives under its own shard's key, on that key's 8 nodes; under <run>/peers only shard 0's (a
        # mirror for nodes started with another record_shards: they see those and are refused, not an empty swarm)
        zero = sorted(a.identity.peer_id.to_string() for a in announcers if a.mirror_key is not None)
        for a in announcers:
            me = a.identity.peer_id.to_string()
            assert a.key == f"{RUN}/peers/{SHARDS}/{record_shard(me, SHARDS)}"
            assert _holders(nodes, a.key, me) == 8
            assert _holders(nodes, f"{RUN}/peers", me) == (8 if me in zero else 0)
        assert zero == sorted(
            p for p in (a.identity.peer_id.to_string() for a in announcers) if record_shard(p, SHARDS) == 0
        )
        assert [r.peer_id for r in await live_peers(reader, RUN)] == zero  # a reader of layout 1: shard 0's only
        assert [r.peer_id for r in await live_peers(reader, RUN, shards=SHARDS)] == ids
        for shard, members in shards_of(ids, SHARDS).items():
            held = await reader.get(records_key(RUN, shard, SHARDS), latest=True)
            assert sorted(held) == sorted(members)

        # a read of some peers asks their shards' keys only, each once
        asked: list[str] = []
        real_get = reader.get

        async def spy(key, *args, **kwargs):
            asked.append(key)
            return await real_get(key, *args, **kwargs)

        reader.get = spy
        two = [ids[0], ids[-1]]
        found = await live_peers(reader, RUN, only=two, shards=SHARDS)
        assert [r.peer_id for r in found] == two
        assert sorted(asked) == sorted({records_key(RUN, record_shard(p, SHARDS), SHARDS) for p in two})
        asked.clear()
        await live_peers(reader, RUN, shards=SHARDS)
        assert sorted(asked) == sorted(records_key(RUN, s, SHARDS) for s in range(SHARDS))
        reader.get = real_get

        # an owner may store its record under another shard too: readers drop that copy and keep the right one
        liar = writers[4]
        me = liar.peer_id.to_string()
        wrong = records_key(RUN, (record_shard(me, SHARDS) + 1) % SHARDS, SHARDS)
        stale = node_record(liar, round=99).to_bytes()
        assert await liar.store(wrong, stale, liar.now() + 30, subkey=me, owner=liar.identity)
        with events.capture("peer_record_dropped") as dropped:
            recs = await live_peers(reader, RUN, shards=SHARDS)
        assert [r.peer_id for r in recs] == ids
        assert {r.peer_id: r.round for r in recs}[me] != 99
        assert [(e["subkey"], e["reason"]) for e in dropped] == [(me, "wrong_shard")]
    finally:
        await stop_all(nodes)
