"""DHT under Sybil floods (issue 12): routing-table admission that pings a caller back at the address
it claims, identities per IP bounded, storage quotas per owner / unsigned / in total, only signed
values under run keys, short lifetimes for unsigned ones; memory of a bootstrap under a store flood."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from geomesh_p2p.dht import DHTNode, make_record
from geomesh_p2p.dht.state import DHT_PROTOCOL_VERSION
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import DHT_FIND, DHT_PING, DHT_STORE
from geomesh_p2p.wire import dht_pb2
from tests.dht_helpers import RUN, start_node, stop_all, wait_for
from tests.proc_util import MiB, closed_ports

pytestmark = pytest.mark.timeout(180)


async def _fake_ping(address: str, claimed: str) -> None:
    """A fresh identity pings ``address`` claiming to serve on ``claimed`` (signed, so it is authenticated)."""
    ident = Identity.generate()
    client = Transport(ident, RUN, TransportConfig(client_only=True))
    try:
        info = dht_pb2.NodeInfo(peer_id=bytes(ident.peer_id), address=claimed)
        req = dht_pb2.PingRequest(sender=info, dht_protocol=DHT_PROTOCOL_VERSION)
        await client.call(address, DHT_PING, req.SerializeToString())
    finally:
        await client.stop()


async def _no_checks_pending(node: DHTNode):
    async def done():
        return not getattr(node, "_checking", None)

    await wait_for(done, timeout=30, what="the ping-backs to finish")


# --------------------------------------------------------------------------- routing table admission
async def test_signed_pings_with_fake_addresses_enter_neither_the_table_nor_find_answers():
    boot = await start_node()
    honest = [await start_node([boot.address]) for _ in range(2)]
    nodes = [boot, *honest]
    joiner = asker = None
    try:
        fakes = [f"127.0.0.1:{p}" for p in closed_ports(40)]
        await asyncio.gather(*(_fake_ping(boot.address, a) for a in fakes))
        await _no_checks_pending(boot)
        table = {c.address for c in boot.contacts()}
        assert table & set(fakes) == set()
        assert table == {n.address for n in honest}
        assert boot.stats.contacts_unverified == 40
        # Find answers name only real nodes
        asker = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
        req = dht_pb2.FindRequest(keys=[random.getrandbits(160).to_bytes(20, "big") for _ in range(4)])
        reply = await asker.call(boot.address, DHT_FIND, req.SerializeToString())
        named = [i.address for r in dht_pb2.FindResponse.FromString(reply.payload).results for i in r.nearest]
        assert len(named) == 8 and set(named) == {n.address for n in honest}
        # a fresh joiner learns every real node
        joiner = await start_node([boot.address])
        assert {c.address for c in joiner.contacts()} >= {n.address for n in nodes}
        # and the same fake address is not pinged again for a while
        checked = boot.stats.contacts_checked
        await _fake_ping(boot.address, fakes[0])
        assert boot.stats.contacts_checked == checked
    finally:
        if asker is not None:
            await asker.stop()
        await stop_all(nodes + ([joiner] if joiner else []))


async def test_a_caller_is_added_once_it_answers_at_its_address():
    boot = await start_node()
    other = await start_node()
    try:
        await _fake_ping(boot.address, "127.0.0.1:1")  # lies
        await other.ping(boot.address)  # other serves where it says: boot pings it back, then adds it
        await _no_checks_pending(boot)
        assert [c.address for c in boot.contacts()] == [other.address]
        assert boot.stats.contacts_checked == 2 and boot.stats.contacts_unverified == 1
    finally:
        await stop_all([boot, other])


async def test_identities_per_ip_are_bounded_in_the_routing_table():
    boot = await start_node(max_contacts_per_ip=3, limit_loopback=True)
    nodes = []
    try:
        for _ in range(6):
            nodes.append(await start_node([boot.address]))
        await _no_checks_pending(boot)
        assert len(boot.contacts()) == 3
        assert boot.stats.contacts_refused >= 3
        # the swarm still works through the admitted nodes
        owner = nodes[5].identity
        assert await nodes[5].store(f"{RUN}/k", b"v", time.time() + 30, owner=owner)
        assert (await nodes[0].get(f"{RUN}/k"))[None].value == b"v"
    finally:
        await stop_all([boot, *nodes])


# --------------------------------------------------------------------------- storage quotas
def _store_req(sender: Identity, records) -> bytes:
    return dht_pb2.StoreRequest(
        sender=dht_pb2.NodeInfo(peer_id=bytes(sender.peer_id)), records=list(records)
    ).SerializeToString()


async def _store(client: Transport, address: str, records) -> list:
    """Outcomes (stored, code) per record; a call refused as a whole counts each record as refused."""
    try:
        reply = await client.call(address, DHT_STORE, _store_req(client.identity, records))
    except RpcError as e:
        return [(False, e.code)] * len(records)
    return [
        (o.stored, grpc.StatusCode.OK if o.code == 0 else next(c for c in grpc.StatusCode if c.value[0] == o.code))
        for o in dht_pb2.StoreResponse.FromString(reply.payload).outcomes
    ]


async def test_store_quotas_per_owner_unsigned_and_in_total():
    from geomesh_p2p.dht.quota import StorageQuota

    quota = StorageQuota(
        max_total_bytes=1 * MiB,
        max_owner_bytes=256 << 10,
        max_owner_records=512,
        max_key_bytes=8 * MiB,
        max_unsigned_bytes=128 << 10,
    )
    node = await start_node(quota=quota)
    me = Identity.generate()
    client = Transport(me, RUN, TransportConfig(client_only=True))
    value = bytes(16 << 10)
    day = time.time() + 24 * 3600 - 60
    try:
        # unsigned under the run's keys: refused
        out = await _store(
            client, node.address, [make_record(f"{RUN}/x/{i:02d}", value, day, run_id=RUN) for i in range(4)]
        )
        assert out == [(False, grpc.StatusCode.PERMISSION_DENIED)] * 4
        # unsigned elsewhere: kept 60 s at most, and only up to the unsigned quota
        recs = [make_record(f"free/{i:02d}", value, day, run_id=RUN) for i in range(20)]
        size = len(recs[0].SerializeToString())
        out = await _store(client, node.address, recs)
        fit = (128 << 10) // size
        assert [s for s, _ in out] == [True] * fit + [False] * (20 - fit)
        assert {c for s, c in out if not s} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        got = await node.get("free/00")
        assert got[None].expiration_time <= time.time() + 60
        # signed by one owner: up to its quota; another owner is not affected
        recs = [make_record(f"{RUN}/flood/{i:02d}", value, day, owner=me, run_id=RUN) for i in range(30)]
        size = len(recs[0].SerializeToString())
        out = await _store(client, node.address, recs)
        fit = (256 << 10) // size
        assert [s for s, _ in out] == [True] * fit + [False] * (30 - fit)
        assert node.ledger.owner_bytes(me.peer_id) <= 256 << 10
        # many owners: up to the node's total budget
        stored_before = node.ledger.total
        owners = [Identity.generate() for _ in range(10)]
        accepted = 0
        for o in owners:
            recs = [make_record(f"{RUN}/o/{o.peer_id}/{i:02d}", value, day, owner=o, run_id=RUN) for i in range(15)]
            size = len(recs[0].SerializeToString())
            accepted += sum(s for s, _ in await _store(client, node.address, recs))
        assert node.ledger.total <= 1 * MiB
        assert accepted == (1 * MiB - stored_before) // size
        assert node.stats.records_refused >= 4 + (20 - 7) + (30 - 15)
        # the node's own records are refused the same way once the budget is spent
        assert not await node.store(f"{RUN}/mine", value, day, owner=node.identity)
    finally:
        await client.stop()
        await stop_all([node])


async def test_replacing_a_record_is_charged_the_difference_and_expired_ones_are_released():
    from geomesh_p2p.dht.quota import StorageQuota

    quota = StorageQuota(max_owner_bytes=64 << 10, max_unsigned_bytes=0)
    node = await start_node(quota=quota)
    me = Identity.generate()
    client = Transport(me, RUN, TransportConfig(client_only=True))
    try:
        for i in range(10):  # the same slot, ten times: one record's worth
            rec = make_record(f"{RUN}/slot", bytes(40 << 10), time.time() + 30 + i, owner=me, run_id=RUN)
            assert (await _store(client, node.address, [rec])) == [(True, grpc.StatusCode.OK)]
        assert node.ledger.owner_bytes(me.peer_id) < 41 << 10
        short = make_record(f"{RUN}/short", bytes(20 << 10), time.time() + 3, owner=me, run_id=RUN)
        assert (await _store(client, node.address, [short]))[0][0]
        other = make_record(f"{RUN}/other", bytes(20 << 10), time.time() + 30, owner=me, run_id=RUN)
        assert not (await _store(client, node.address, [other]))[0][0]  # over 64 KiB
        await asyncio.sleep(max(0.0, short.expiration_time - time.time()) + 0.1)
        assert (await _store(client, node.address, [other]))[0][0]  # the short one expired
        # no unsigned value at all on this node
        assert (await _store(client, node.address, [make_record("free", b"v", time.time() + 9, run_id=RUN)])) == [
            (False, grpc.StatusCode.RESOURCE_EXHAUSTED)
        ]
    finally:
        await client.stop()
        await stop_all([node])
