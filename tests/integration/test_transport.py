"""Signed envelopes over gRPC: every kind of bad request is refused with its own status, and the
server keeps serving the next valid call."""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc
import pytest

from geomesh_p2p.net.identity import EnvelopeError, Identity, canonical_header
from geomesh_p2p.net.transport import RpcError, Transport, current_request
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import DHT_FIND, DHT_PING, DHT_STORE
from geomesh_p2p.wire import envelope_pb2

pytestmark = pytest.mark.timeout(60)

RUN = "test-run"


async def _echo(verified, context) -> bytes:
    assert current_request() is verified
    return b"echo:" + verified.payload


@pytest.fixture
async def pair():
    """A server (echo on Ping, limit 1 KiB on Store) and a client transport; both stopped on teardown."""
    server_id, client_id = Identity.generate(), Identity.generate()
    server = Transport(server_id, RUN, TransportConfig(max_skew_s=5.0))
    server.add_unary(DHT_PING, _echo)
    server.add_unary(DHT_STORE, _echo, max_payload_bytes=1024)
    address = await server.start()
    client = Transport(client_id, RUN, TransportConfig(client_only=True))
    try:
        yield server, client, address
    finally:
        await client.stop()
        await server.stop()


async def _raw_call(address: str, msg: envelope_pb2.SignedMessage, method: str = DHT_PING):
    async with grpc.aio.insecure_channel(address) as ch:
        mc = ch.unary_unary(
            method,
            request_serializer=envelope_pb2.SignedMessage.SerializeToString,
            response_deserializer=envelope_pb2.SignedMessage.FromString,
        )
        return await mc(msg, timeout=5)


def _resign(identity: Identity, msg: envelope_pb2.SignedMessage) -> None:
    msg.envelope.signature = identity.sign(canonical_header(msg.envelope))


async def test_valid_call_round_trip_is_signed_by_server(pair):
    server, client, address = pair
    reply = await client.call(address, DHT_PING, b"hello", round=7)
    assert reply.payload == b"echo:hello"
    assert reply.sender == server.identity.peer_id
    assert reply.round == 7
    assert reply.kind == DHT_PING + "+resp"
    assert client.stats.bytes_sent > 5 and client.stats.bytes_received > 10
    await client.call(address, DHT_PING, b"again")
    assert client.stats.calls_by_method == {DHT_PING: 2} and client.stats.calls == 2  # answered calls, per method


async def test_traffic_is_counted_per_method_and_per_class_on_both_sides(pair):
    """Calls made (client) and requests served (server) per method; ``by_class`` sums them per method
    class with the bytes, which equal ``by_method``'s."""
    server, client, address = pair
    await client.call(address, DHT_PING, b"a")
    await client.call(address, DHT_PING, b"b")
    await client.call(address, DHT_STORE, b"c")
    assert client.stats.calls_by_method == {DHT_PING: 2, DHT_STORE: 1}
    assert server.stats.served_by_method == {DHT_PING: 2, DHT_STORE: 1}
    cls = client.stats.by_class()
    assert set(cls) == {"dht"}
    assert cls["dht"]["calls"] == 3 and cls["dht"]["served"] == 0
    assert (cls["dht"]["sent"], cls["dht"]["received"]) == client.stats.snapshot()
    srv = server.stats.by_class()["dht"]
    assert srv["served"] == 3 and srv["calls"] == 0
    # what the client sent is what the server received, request by request
    assert srv["received"] == cls["dht"]["sent"] and srv["sent"] == cls["dht"]["received"]


def _fresh(client: Transport, payload: bytes = b"x", kind: str = DHT_PING, run: str = RUN):
    return client.identity.sign_message(run_id=run, round=1, kind=kind, payload=payload)


def _bad_signature(c):
    m = _fresh(c)
    m.envelope.signature = bytes(64)
    return m


def _tampered(c):
    m = _fresh(c, b"original")
    m.payload = b"tampered"
    return m


def _other_run(c):
    return _fresh(c, run="another-run")


def _skewed(c):
    m = _fresh(c)
    m.envelope.timestamp = time.time() - 3600
    _resign(c.identity, m)
    return m


def _too_big(c):
    return _fresh(c, b"z" * 2048, kind=DHT_STORE)


def _impersonation(c):
    m = _fresh(c)
    m.envelope.sender = hashlib.sha256(b"someone else").digest()
    _resign(c.identity, m)
    return m


def _wrong_kind(c):
    return _fresh(c, kind=DHT_STORE)  # signed for Store, sent to Ping


def _malformed(c):
    m = _fresh(c)
    m.envelope.nonce = b"short"
    return m


@pytest.mark.parametrize(
    "make, method, code, reason",
    [
        (_bad_signature, DHT_PING, grpc.StatusCode.UNAUTHENTICATED, "bad signature"),
        (_tampered, DHT_PING, grpc.StatusCode.DATA_LOSS, "tampered"),
        (_other_run, DHT_PING, grpc.StatusCode.FAILED_PRECONDITION, "another-run"),
        (_skewed, DHT_PING, grpc.StatusCode.OUT_OF_RANGE, "timestamp"),
        (_too_big, DHT_STORE, grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit of 1024"),
        (_impersonation, DHT_PING, grpc.StatusCode.UNAUTHENTICATED, "does not match its public key"),
        (_wrong_kind, DHT_PING, grpc.StatusCode.INVALID_ARGUMENT, "kind"),
        (_malformed, DHT_PING, grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ],
)
async def test_bad_requests_refused_and_server_keeps_serving(pair, make, method, code, reason):
    server, client, address = pair
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _raw_call(address, make(client), method)
    assert ei.value.code() == code
    assert reason in ei.value.details()
    assert server.stats.rejected >= 1
    reply = await client.call(address, DHT_PING, b"next")
    assert reply.payload == b"echo:next"


async def test_replayed_nonce_refused(pair):
    server, client, address = pair
    msg = _fresh(client, b"once")
    assert (await _raw_call(address, msg)).payload == b"echo:once"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _raw_call(address, msg)
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "nonce already seen" in ei.value.details()
    assert (await client.call(address, DHT_PING, b"after")).payload == b"echo:after"


async def test_sender_not_in_allow_list_refused():
    banned, ok = Identity.generate(), Identity.generate()
    server = Transport(Identity.generate(), RUN, allow=lambda pid: pid != banned.peer_id)
    server.add_unary(DHT_PING, _echo)
    address = await server.start()
    clients = [Transport(i, RUN, TransportConfig(client_only=True)) for i in (banned, ok)]
    try:
        with pytest.raises(RpcError) as ei:
            await clients[0].call(address, DHT_PING, b"x")
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert banned.peer_id.short() in ei.value.reason
        assert (await clients[1].call(address, DHT_PING, b"y")).payload == b"echo:y"
    finally:
        for c in clients:
            await c.stop()
        await server.stop()


async def test_deadline_is_enforced_and_reported():
    """The caller's deadline ends a call whose handler runs and never answers by itself (released at the end);
    the hang guard fails a call that waited for the answer instead."""
    release, started = asyncio.Event(), asyncio.Event()

    async def slow(verified, context):
        started.set()
        await release.wait()
        return b""

    server = Transport(Identity.generate(), RUN)
    server.add_unary(DHT_PING, slow)
    address = await server.start()
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        with pytest.raises(RpcError) as ei:
            await asyncio.wait_for(client.call(address, DHT_PING, b"", timeout=0.3), 20)
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert started.is_set()  # the call reached its handler: the deadline ended it there, not on the way
    finally:
        release.set()
        await client.stop()
        await server.stop(grace=0)


async def test_unreachable_peer_is_an_rpc_error():
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        with pytest.raises(RpcError) as ei:
            await client.call("127.0.0.1:1", DHT_PING, b"", timeout=2)
        assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await client.stop()


async def test_forged_reply_is_refused_by_client(pair):
    """A server that signs its reply for another run: the client refuses the reply."""
    server, client, address = pair
    evil = Transport(Identity.generate(), "other-run")
    evil.add_unary(DHT_PING, _echo)
    evil.verifier.run_id = RUN  # accepts our request, but signs replies for "other-run"
    evil_addr = await evil.start()
    try:
        with pytest.raises(RpcError) as ei:
            await client.call(evil_addr, DHT_PING, b"x")
        assert "reply refused" in ei.value.reason
    finally:
        await evil.stop()


async def test_stop_leaves_no_task_behind():
    t = Transport(Identity.generate(), RUN)
    t.add_unary(DHT_PING, _echo)
    await t.start()
    ev = asyncio.Event()
    task = t.tasks.spawn(ev.wait(), name="waiter")
    assert len(t.tasks) == 1
    await t.stop()
    assert len(t.tasks) == 0
    assert task.cancelled()


async def test_garbage_bytes_refused_as_invalid_argument_and_server_keeps_serving(pair):
    server, client, address = pair
    async with grpc.aio.insecure_channel(address) as ch:
        mc = ch.unary_unary(
            DHT_PING, request_serializer=lambda b: b, response_deserializer=envelope_pb2.SignedMessage.FromString
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await mc(b"\xff\xfe garbage that is not a protobuf", timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no envelope" in ei.value.details()
    assert (await client.call(address, DHT_PING, b"ok")).payload == b"echo:ok"


async def test_port_in_use_is_a_clear_oserror(pair):
    server, client, address = pair
    other = Transport(Identity.generate(), RUN, TransportConfig(port=int(address.rsplit(":", 1)[1])))
    other.add_unary(DHT_PING, _echo)
    with pytest.raises(OSError, match="port is in use"):
        await other.start()
    await other.stop()


async def test_big_payloads_are_hashed_off_the_event_loop_once_per_message(pair, monkeypatch):
    """Issue 13/17: the SHA-256 of a payload over 1 MiB (request and reply, both ends) is computed in a
    worker thread, once per message; small payloads stay on the loop (a thread hop costs more)."""
    import threading

    import geomesh_p2p.net.identity as identity_mod

    server, client, address = pair
    loop_thread = threading.get_ident()
    hashed = []  # (payload bytes, on the loop thread?)
    real = identity_mod.payload_hash
    monkeypatch.setattr(
        identity_mod, "payload_hash", lambda p: hashed.append((len(p), threading.get_ident() == loop_thread)) or real(p)
    )
    big = bytes(range(256)) * (8 << 10)  # 2 MiB
    reply = await client.call(address, DHT_PING, big, round=2)
    assert reply.payload == b"echo:" + big
    n, m = len(big), len(big) + 5
    # client signs, server verifies, server signs its reply, client verifies: four hashes, none on the loop
    assert sorted(hashed) == sorted([(n, False), (n, False), (m, False), (m, False)])
    hashed.clear()
    assert (await client.call(address, DHT_PING, b"hi")).payload == b"echo:hi"
    assert sorted(hashed) == [(2, True), (2, True), (7, True), (7, True)]


def _restart_server(port: int) -> Transport:
    server = Transport(Identity.generate(), RUN, TransportConfig(port=port))
    server.add_unary(DHT_PING, _echo)
    return server


async def test_a_peer_restarted_on_its_old_port_is_redialled_and_failed_calls_count_no_bytes():
    """Issue 14 #10: a lost connection drops the cached channel (any method), so a peer restarted on
    its old port answers the next call instead of gRPC's reconnect backoff failing it (the old code
    failed it for seconds to minutes); a failed call counts no bytes as sent."""
    first = _restart_server(0)
    address = await first.start()
    port = int(address.rsplit(":", 1)[1])
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    second = None
    try:
        assert (await client.call(address, DHT_PING, b"a")).payload == b"echo:a"
        sent = client.stats.snapshot()
        await first.stop(grace=0)
        with pytest.raises(RpcError) as ei:
            await client.call(address, DHT_PING, b"b", timeout=5)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and ei.value.unreachable
        assert client.stats.snapshot() == sent and client.stats.by_method[DHT_PING] == sent
        assert client.stats.calls_by_method == {DHT_PING: 1}  # a failed call is not counted
        # A non-idempotent call fails too (not retried), and also drops the channel.
        with pytest.raises(RpcError) as ei:
            await client.call(address, DHT_PING, b"c", timeout=5, idempotent=False)
        assert ei.value.unreachable and client.stats.snapshot() == sent
        second = _restart_server(port)
        assert await second.start() == address
        reply = await client.call(address, DHT_PING, b"d", timeout=5)
        assert reply.payload == b"echo:d" and reply.sender == second.identity.peer_id
        assert client.stats.bytes_sent > sent[0]
    finally:
        await client.stop()
        if second is not None:
            await second.stop()


async def test_a_server_answering_unavailable_keeps_its_channel():
    """The server's own UNAVAILABLE (e.g. a round not open yet) is no lost connection: the channel stays,
    the call is not retried, and ``unreachable`` is False."""
    calls = []

    async def not_yet(verified, context):
        calls.append(verified.payload)
        raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "round 3 is not open on this node yet")

    server = Transport(Identity.generate(), RUN)
    server.add_unary(DHT_PING, _echo)
    server.add_unary(DHT_FIND, not_yet)
    address = await server.start()
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        await client.call(address, DHT_PING, b"warm")
        channel = client._channel(address)
        with pytest.raises(RpcError) as ei:
            await client.call(address, DHT_FIND, b"x")  # idempotent: it would be retried on a lost connection
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and not ei.value.unreachable
        assert calls == [b"x"] and client._channel(address) is channel
    finally:
        await client.stop()
        await server.stop()


async def test_bulk_and_control_calls_use_separate_connections():
    """Parts and state go over their own TCP connection to a peer, DHT calls over another (a DHT store
    must not queue behind seconds of part bytes in one connection's send buffer). The server sees two
    client ports; the same lane reuses its connection; dropping the address drops both lanes."""
    from geomesh_p2p.net.methods import COLLECTIVE_PUSH, STATE_GET, lane_of

    seen: dict[str, set] = {}

    def recorder(tag: str):
        async def handler(verified, context):
            seen.setdefault(tag, set()).add(context.peer())
            return b"ok"

        return handler

    server = Transport(Identity.generate(), RUN)
    server.add_unary(DHT_PING, recorder("control"))
    server.add_unary(DHT_STORE, recorder("control"))
    server.add_unary(COLLECTIVE_PUSH, recorder("bulk"))
    server.add_unary(STATE_GET, recorder("bulk"))
    address = await server.start()
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        assert (lane_of(DHT_STORE), lane_of(COLLECTIVE_PUSH), lane_of(STATE_GET)) == ("control", "bulk", "bulk")
        for method in (DHT_PING, COLLECTIVE_PUSH, DHT_STORE, STATE_GET):
            await client.call(address, method, b"x", timeout=5, idempotent=False)
        assert len(seen["control"]) == 1 and len(seen["bulk"]) == 1  # one connection per lane
        assert seen["control"] != seen["bulk"]  # two connections (client ports differ)
        assert sorted(client._channels) == [(address, "bulk"), (address, "control")]
        assert client.drop_channel(address, lane="control")  # the DHT's dial-back: bulk calls go on
        assert list(client._channels) == [(address, "bulk")]
        assert not client.drop_channel(address, lane="control")
        assert client.drop_channel(address) and not client._channels
    finally:
        await client.stop()
        await server.stop()


async def test_a_call_retried_after_a_lost_connection_is_signed_afresh():
    """rs9: the connection broke after the owner had handled a pull; the transport's one retry re-sent the
    same signed bytes, the owner refused them as a replay (ALREADY_EXISTS: nonce already seen), and the
    reader zeroed that part. The retry is now signed again (a new nonce) and answered."""
    handled = []

    async def record(verified, context) -> bytes:
        handled.append(verified.payload)
        return b"ok"

    server = Transport(Identity.generate(), RUN)
    server.add_unary(DHT_FIND, record)
    address = await server.start()
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    real_channel = client._channel
    tries = []

    class _LosesFirstReply:  # the first reply is lost after the server handled the request
        def __init__(self, channel):
            self.channel = channel

        def unary_unary(self, method, **kw):
            mc = self.channel.unary_unary(method, **kw)

            async def call(request, timeout=None):
                reply = await mc(request, timeout=timeout)
                tries.append(request)
                if len(tries) == 1:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        details="Connection reset by peer",
                    )
                return reply

            return call

    client._channel = lambda addr, lane="control": _LosesFirstReply(real_channel(addr, lane))
    try:
        reply = await client.call(address, DHT_FIND, b"x", timeout=5)
        assert reply.payload == b"ok" and handled == [b"x", b"x"]
        assert len(tries) == 2 and tries[0] != tries[1]  # another nonce (and signature)
    finally:
        await client.stop()
        await server.stop()
