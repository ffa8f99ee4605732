"""Verified-work evidence of 4,096 parts (issue 25: 386 KB signed, over one DHT value) published and read
back over real DHT nodes on 127.0.0.1: its chunks land under their own keys, the verifier's first 128
contributions beside it (within a node's quota per signer), another identity cannot write the
verifier's chunk, and a chunk the verifier replaced with other bytes is refused by a reader that had not
read the evidence before."""

from __future__ import annotations

import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.chunked import ChunksPending, chunk_key, parse_head
from geomesh_p2p.dht.records import RecordError
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.trust import evidence as EV
from tests.dht_helpers import RUN, start_swarm, stop_all
from tests.evidence_util import big_evidence

pytestmark = pytest.mark.timeout(120)
ROUND = 9


async def test_evidence_of_4096_parts_is_stored_in_chunks_and_read_back_from_every_node():
    nodes: list[DHTNode] = await start_swarm(4)
    try:
        v = nodes[0].transport.identity
        me = str(v.peer_id)
        ev = big_evidence(4096, run_id=RUN, round=ROUND, verifier=v)
        assert len(ev.to_signed(v)) > 5 * 65536  # version 1 could not store it
        out = await EV.publish_evidence(nodes[0], ev, v, expiration_time=swarm_time() + 120)
        assert out == EV.Published(True, 4, 128, 128, 4096 - 128)
        key = EV.evidence_key(RUN, ROUND)
        for node in nodes[1:]:
            head = (await node.get(key))[me]
            assert str(head.owner) == me
            data = await EV.EvidenceReader(node).load(key, me, head.value)
            got = await EV.fetch_contributions(node, ev)
            assert got == {j: ev.contributions[j] for j in range(128)}  # byte for byte
            opened = EV.Evidence.open(data, RUN, got)
            assert opened == ev and opened.header() == ev.header() and opened.contributions == got
        sha = parse_head(head.value, EV.evidence_format()).sha256
        # another identity cannot write the verifier's chunk slot: refused before anything is sent
        with pytest.raises(RecordError):
            await nodes[2].store(chunk_key(key, sha, 1), b"x", swarm_time() + 60, subkey=me, owner=Identity.generate())
        # the verifier itself replaces chunk 2 with other bytes (a later expiry wins): a fresh reader refuses it
        found = await nodes[1].get(chunk_key(key, sha, 1))
        good = found[me].value
        bad = good[:-1] + bytes([good[-1] ^ 1])
        assert await nodes[0].store(chunk_key(key, sha, 1), bad, swarm_time() + 200, subkey=me, owner=v)
        with pytest.raises(ChunksPending, match="chunk 2/4 does not match the head's hash"):
            await EV.EvidenceReader(nodes[3]).load(key, me, head.value)
        assert await nodes[0].store(chunk_key(key, sha, 1), good, swarm_time() + 201, subkey=me, owner=v)
        assert EV.Evidence.open(await EV.EvidenceReader(nodes[3]).load(key, me, head.value), RUN) == ev
    finally:
        await stop_all(nodes)
