"""A plan of 1,024 participants (issue 25: 80 KB compressed, over one DHT value) published and read back
through PlanStore over real DHT nodes on 127.0.0.1: its chunks land under their own keys, another
identity cannot write the leader's chunk, and a chunk the leader replaced with other bytes makes the plan
not valid (refused with the reason) for a reader that had not read it before."""

from __future__ import annotations

import logging

import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.records import RecordError
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.agree import PlanStore, plan_key
from geomesh_p2p.plan.wire import chunk_key, split_plan
from tests.dht_helpers import RUN, start_swarm, stop_all
from tests.plan_util import big_plan

pytestmark = pytest.mark.timeout(90)


async def test_a_1024_peer_plan_is_stored_in_chunks_and_read_back_from_every_node(caplog):
    nodes: list[DHTNode] = await start_swarm(6)
    try:
        leader = nodes[0].transport.identity
        plan = big_plan(1024, run_id=RUN, round=7, leader=str(leader.peer_id))
        wire = split_plan(plan)
        assert len(wire.chunks) == 2 and len(plan.to_bytes()) > 5 * 65536  # version 1 could not store it
        assert await PlanStore(nodes[0], leader, RUN).publish(plan)
        for node in nodes[1:]:
            got = await PlanStore(node, Identity.generate(), RUN).read(7)
            assert got == [plan] and got[0].to_bytes() == plan.to_bytes()
        # each chunk under its own key, signed by the leader, byte for byte
        key = plan_key(RUN, 7)
        for i, chunk in enumerate(wire.chunks):
            found = await nodes[3].get(chunk_key(key, wire.sha256, i))
            assert found[str(leader.peer_id)].value == chunk and str(found[str(leader.peer_id)].owner) == str(
                leader.peer_id
            )
        # another identity cannot write the leader's chunk slot: refused before anything is sent
        forger = Identity.generate()
        with pytest.raises(RecordError):
            await nodes[2].store(
                chunk_key(key, wire.sha256, 1), b"x", swarm_time() + 60, subkey=str(leader.peer_id), owner=forger
            )
        # the leader itself replaces chunk 2 with other bytes (a later expiry wins): a reader that had not
        # assembled the plan yet refuses it, with the reason, until the right chunk is back
        bad = wire.chunks[1][:-1] + bytes([wire.chunks[1][-1] ^ 1])
        expires = swarm_time() + 200
        assert await nodes[0].store(
            chunk_key(key, wire.sha256, 1), bad, expires, subkey=str(leader.peer_id), owner=leader
        )
        fresh = PlanStore(nodes[4], Identity.generate(), RUN)
        with caplog.at_level(logging.INFO, logger="geomesh_p2p.plan.agree"):
            assert await fresh.read(7) == []
        assert any("chunk 2/2 does not match the head's hash" in r.getMessage() for r in caplog.records)
        assert await nodes[0].store(
            chunk_key(key, wire.sha256, 1), wire.chunks[1], expires + 1, subkey=str(leader.peer_id), owner=leader
        )
        assert await fresh.read(7) == [plan]
    finally:
        await stop_all(nodes)


async def test_a_sharded_runs_plan_is_read_from_stable_chunk_keys_round_after_round():
    """``PlanStore(stable_parts=True)`` (a run with record shards S > 1): the head says ``layout`` 2 and its chunks are
    also under ``<run>/plan/parts/<r % 2>/<i>``. Every node reads rounds 7 and 9 (the same chunk keys) back; a reader
    that looked those keys up in round 7 reads round 9's chunks through one Find call each, without a lookup."""
    nodes: list[DHTNode] = await start_swarm(6)
    try:
        leader = nodes[0].transport.identity
        plans = {r: big_plan(1024, run_id=RUN, round=r, leader=str(leader.peer_id)) for r in (7, 9)}
        assert b'"layout":2' in split_plan(plans[7], stable=True).head
        readers = [PlanStore(node, Identity.generate(), RUN, stable_parts=True) for node in nodes[1:]]
        for r, plan in plans.items():
            assert await PlanStore(nodes[0], leader, RUN, stable_parts=True).publish(plan)
            for store in readers:
                assert await store.read(r) == [plan]
        for node in nodes[1:]:
            assert node.read_reuses >= 2  # round 9's two chunks from the holders round 7's lookups found
    finally:
        await stop_all(nodes)
