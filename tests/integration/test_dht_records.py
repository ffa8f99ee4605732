"""Signed, owner-protected records: bad records are refused on store with a status and a reason,
never returned by find, and the node keeps serving."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from geomesh_p2p.dht import RecordError, key_id_of, make_record, owned_key, verify_record
from geomesh_p2p.dht.records import RecordLimits, canonical_record_bytes, required_owner
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import DHT_FIND, DHT_STORE
from geomesh_p2p.wire import dht_pb2
from tests.dht_helpers import RUN, start_node, start_swarm, stop_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def server_and_client():
    node = await start_node()
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        yield node, client
    finally:
        await client.stop()
        await stop_all([node])


def _store_request(*records) -> bytes:
    return dht_pb2.StoreRequest(records=list(records)).SerializeToString()


def _forged(me: Identity) -> dht_pb2.SignedRecord:
    rec = make_record("run/peers", b"honest", time.time() + 60, subkey=me.peer_id.to_string(), owner=me, run_id=RUN)
    rec.value = b"altered after signing"
    return rec


def _other_owner(me: Identity) -> dht_pb2.SignedRecord:
    victim = Identity.generate()
    return make_record(
        "run/peers", b"impostor", time.time() + 60, subkey=victim.peer_id.to_string(), owner=me, run_id=RUN
    )


def _unsigned_for_owner(me: Identity) -> dht_pb2.SignedRecord:
    return make_record("run/peers", b"unsigned", time.time() + 60, subkey=me.peer_id.to_string(), run_id=RUN)


def _other_owner_key(me: Identity) -> dht_pb2.SignedRecord:
    victim = Identity.generate()
    return make_record(owned_key("run/plan/3", victim.peer_id), b"x", time.time() + 60, owner=me, run_id=RUN)


def _expired(me: Identity) -> dht_pb2.SignedRecord:
    return make_record("run/k", b"stale", time.time() - 5, owner=me, run_id=RUN)


def _too_far(me: Identity) -> dht_pb2.SignedRecord:
    return make_record("run/k", b"forever", time.time() + 10 * 24 * 3600, run_id=RUN)


def _oversized(me: Identity) -> dht_pb2.SignedRecord:
    return make_record("run/k", b"z" * (64 * 1024 + 1), time.time() + 60, run_id=RUN)


def _other_run(me: Identity) -> dht_pb2.SignedRecord:
    return make_record("run/k", b"v", time.time() + 60, owner=me, run_id="another-run")


def _half_signed(me: Identity) -> dht_pb2.SignedRecord:
    rec = make_record("run/k", b"v", time.time() + 60, run_id=RUN)
    rec.owner_public_key = me.public_key_bytes
    return rec


@pytest.mark.parametrize(
    "make, code, reason",
    [
        (_forged, grpc.StatusCode.UNAUTHENTICATED, "bad record signature"),
        (_other_run, grpc.StatusCode.UNAUTHENTICATED, "bad record signature"),
        (_other_owner, grpc.StatusCode.PERMISSION_DENIED, "subkey is owned by"),
        (_unsigned_for_owner, grpc.StatusCode.PERMISSION_DENIED, "record is unsigned"),
        (_other_owner_key, grpc.StatusCode.PERMISSION_DENIED, "key is owned by"),
        (_expired, grpc.StatusCode.OUT_OF_RANGE, "expired"),
        (_too_far, grpc.StatusCode.OUT_OF_RANGE, "maximum lifetime"),
        (_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit of 65536"),
        (_half_signed, grpc.StatusCode.INVALID_ARGUMENT, "malformed record signature"),
    ],
)
async def test_bad_record_refused_with_reason_and_node_keeps_serving(server_and_client, make, code, reason):
    node, client = server_and_client
    with pytest.raises(RpcError) as ei:
        await client.call(node.address, DHT_STORE, _store_request(make(client.identity)))
    assert ei.value.code == code
    assert reason in ei.value.reason
    assert node.stats.records_refused >= 1
    assert len(node.storage) == 0
    good = make_record("run/good", b"ok", time.time() + 60, run_id=RUN)
    reply = await client.call(node.address, DHT_STORE, _store_request(good))
    assert dht_pb2.StoreResponse.FromString(reply.payload).outcomes[0].stored


@pytest.mark.parametrize(
    "method, payload, reason",
    [
        (DHT_STORE, b"\xff" * 64, "malformed StoreRequest"),
        (DHT_FIND, b"\x0a\x05garbage\xff\xff", "malformed FindRequest"),
        (DHT_STORE, b"", "holds no records"),
        (DHT_FIND, dht_pb2.FindRequest(keys=[b"short"]).SerializeToString(), "20-byte DHTID"),
        (DHT_FIND, dht_pb2.FindRequest(keys=[bytes(20)] * 65).SerializeToString(), "over the limit of 64"),
    ],
)
async def test_garbage_requests_refused_and_node_keeps_serving(server_and_client, method, payload, reason):
    node, client = server_and_client
    with pytest.raises(RpcError) as ei:
        await client.call(node.address, method, payload)
    assert ei.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert reason in ei.value.reason
    find = dht_pb2.FindRequest(keys=[key_id_of("run/x").to_bytes()]).SerializeToString()
    reply = await client.call(node.address, DHT_FIND, find)
    assert len(dht_pb2.FindResponse.FromString(reply.payload).results) == 1


async def test_batch_with_some_bad_records_stores_the_good_ones(server_and_client):
    node, client = server_and_client
    me = client.identity
    good = make_record("run/a", b"ok", time.time() + 60, run_id=RUN)
    reply = await client.call(node.address, DHT_STORE, _store_request(_forged(me), good, _expired(me)))
    outcomes = dht_pb2.StoreResponse.FromString(reply.payload).outcomes
    assert [o.stored for o in outcomes] == [False, True, False]
    assert outcomes[0].code == grpc.StatusCode.UNAUTHENTICATED.value[0] and "forged" in outcomes[0].reason
    assert outcomes[2].code == grpc.StatusCode.OUT_OF_RANGE.value[0]


async def test_sender_nodeinfo_must_match_signer(server_and_client):
    node, client = server_and_client
    liar = dht_pb2.NodeInfo(peer_id=bytes(Identity.generate().peer_id), address="127.0.0.1:9")
    req = dht_pb2.StoreRequest(sender=liar, records=[make_record("run/a", b"v", time.time() + 9, run_id=RUN)])
    with pytest.raises(RpcError) as ei:
        await client.call(node.address, DHT_STORE, req.SerializeToString())
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "another PeerID" in ei.value.reason
    assert node.contacts() == []


async def test_bad_records_planted_on_a_node_are_never_returned_by_find():
    nodes = await start_swarm(3)
    try:
        liar, reader = nodes[0], nodes[2]
        me, victim = Identity.generate(), Identity.generate()
        key = "run/peers"
        kid = key_id_of(key)
        good = make_record(key, b"real", time.time() + 60, subkey=me.peer_id.to_string(), owner=me, run_id=RUN)
        assert await nodes[1].store_record(good)
        # the liar bypasses its own checks and serves a forged, an impostor and an expired record
        forged = make_record(key, b"x", time.time() + 60, subkey=victim.peer_id.to_string(), owner=me, run_id=RUN)
        altered = make_record(key, b"real", time.time() + 60, subkey=me.peer_id.to_string(), owner=me, run_id=RUN)
        altered.value = b"changed"
        altered.expiration_time += 1000
        stale = make_record(key, b"old", time.time() + 0.3, subkey="plain", run_id=RUN)
        for rec in (forged, altered, stale):
            sk = rec.subkey
            liar.storage.store(kid, rec.SerializeToString(), rec.expiration_time, subkey=sk)
        liar.storage.frozen = True  # keep the stale one served after it expires
        await asyncio.sleep(0.35)
        found = await reader.get(key, latest=True)
        assert {sk: v.value for sk, v in found.items()} == {me.peer_id.to_string(): b"real"}
        assert found[me.peer_id.to_string()].owner == me.peer_id
        assert reader.stats.records_dropped_on_find >= 2
        assert (await reader.get("run/unknown")) == {}
    finally:
        await stop_all(nodes)


async def test_unsigned_or_other_signer_cannot_overwrite_signed_value_in_unowned_slot():
    nodes = await start_swarm(3)
    try:
        leader, other = Identity.generate(), Identity.generate()
        now = time.time()
        assert await nodes[0].store("run/plan/7", b"plan by leader", now + 30, owner=leader)
        assert not await nodes[1].store("run/plan/7", b"squat", now + 60)
        assert not await nodes[2].store("run/plan/7", b"other", now + 60, owner=other)
        found = await nodes[2].get("run/plan/7")
        assert found[None].value == b"plan by leader" and found[None].owner == leader.peer_id
        # the owner itself may refresh it
        assert await nodes[1].store("run/plan/7", b"plan v2", now + 40, owner=leader)
        assert (await nodes[0].get("run/plan/7"))[None].value == b"plan v2"
        # a plain value cannot wipe a key that holds subkeys
        assert await nodes[0].store("run/peers", b"rec", now + 30, subkey=leader.peer_id.to_string(), owner=leader)
        assert not await nodes[1].store("run/peers", b"wipe", now + 60)
        assert set(await nodes[2].get("run/peers")) == {leader.peer_id.to_string()}
    finally:
        await stop_all(nodes)


async def test_store_raises_at_once_on_a_record_that_breaks_a_rule():
    node = await start_node()
    try:
        me, other = Identity.generate(), Identity.generate()
        with pytest.raises(RecordError, match="owned by"):
            await node.store("run/peers", b"v", time.time() + 9, subkey=other.peer_id.to_string(), owner=me)
        with pytest.raises(RecordError, match="over the limit"):
            await node.store("run/k", b"v" * 70000, time.time() + 9)
        with pytest.raises(RecordError, match="expired"):
            await node.store("run/k", b"v", time.time() - 1)
    finally:
        await stop_all([node])


def test_owner_rules_and_signature_binding():
    me = Identity.generate()
    pid = me.peer_id
    assert required_owner("run/peers", pid.to_string()) == pid
    assert required_owner("run/peers", "not-a-peer-id") is None
    assert required_owner(owned_key("run/plan/1", pid), None) == pid
    assert required_owner(owned_key("run/plan/1", pid), "anything") == pid
    with pytest.raises(RecordError, match="malformed owner"):
        required_owner("run/x/owner:zzz", None)
    now = time.time()
    rec = make_record("k", b"v", now + 10, subkey="s", owner=me, run_id=RUN)
    vr = verify_record(rec, run_id=RUN, now=now)
    assert vr.owner == pid and vr.subkey == "s" and vr.key_id == key_id_of("k")
    # subkey absent vs empty subkey are different signed statements
    assert canonical_record_bytes(RUN, "k", None, b"v", 1.0, b"") != canonical_record_bytes(
        RUN, "k", "", b"v", 1.0, b""
    )
    with pytest.raises(RecordError, match="does not hash"):
        verify_record(rec, run_id=RUN, now=now, expected_key_id=key_id_of("other"))
    with pytest.raises(RecordError, match="over the limit of 4"):
        verify_record(
            make_record("k", b"12345", now + 10, run_id=RUN),
            run_id=RUN,
            now=now,
            limits=RecordLimits(max_value_bytes=4),
        )


def test_a_record_signature_is_checked_once_and_an_altered_copy_is_still_refused(monkeypatch):
    """verify_record remembers valid signatures (an Ed25519 check costs ~0.1-0.3 ms, and a record is
    checked on store, on every find reply and against the node's own copy on every get): the same
    record again costs no check; a copy altered in any signed field is checked, and refused."""
    from geomesh_p2p.dht import records as records_mod

    calls: list = []
    real = records_mod.verify_signature

    def counting(pk, sig, data):
        calls.append(data)
        return real(pk, sig, data)

    monkeypatch.setattr(records_mod, "verify_signature", counting)
    me, other = Identity.generate(), Identity.generate()
    now = time.time()
    mine = make_record("k", b"v", now + 60, subkey="s", owner=me, run_id=RUN)
    verify_record(mine, run_id=RUN, now=now)
    assert calls == []  # made by this process: known valid
    theirs = make_record("k", b"v", now + 60, subkey="s", owner=other, run_id=RUN)
    monkeypatch.setattr(records_mod, "_checked", records_mod._CheckedSignatures())  # as if made elsewhere
    for _ in range(3):
        assert verify_record(
            dht_pb2.SignedRecord.FromString(theirs.SerializeToString()), run_id=RUN, now=now
        ).owner == (other.peer_id)
    assert len(calls) == 1
    for field, value in (("value", b"w"), ("expiration_time", now + 61), ("subkey", "t"), ("key", "k2")):
        altered = dht_pb2.SignedRecord.FromString(theirs.SerializeToString())
        setattr(altered, field, value)
        with pytest.raises(RecordError) as e:
            verify_record(altered, run_id=RUN, now=now)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert len(calls) == 5
    with pytest.raises(RecordError, match="bad record signature"):  # another run: other signed bytes
        verify_record(theirs, run_id="other-run", now=now)
    assert len(calls) == 6


def test_the_checked_signature_memory_is_bounded():
    from geomesh_p2p.dht.records import _CheckedSignatures

    ids = [Identity.generate() for _ in range(5)]
    cache = _CheckedSignatures(capacity=3)
    signed = [(i.public_key_bytes, i.sign(b"m"), b"m") for i in ids]
    for s in signed:
        assert cache.check(*s)
    assert len(cache._seen) == 3
    assert not cache.check(signed[0][0], signed[1][1], b"m")  # a valid signature, of another key
    assert not cache.check(signed[4][0], signed[4][1], b"n")  # the right key, other bytes
    assert len(cache._seen) == 3
