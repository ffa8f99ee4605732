"""gRPC transport: an asyncio server whose interceptor verifies every envelope, and a channel cache.

Every RPC in GeoMesh-P2P carries one :class:`~geomesh_p2p.wire.envelope_pb2.SignedMessage` each way
(a stream of them for state download). The server's :class:`EnvelopeInterceptor` verifies the
request envelope (signature, run, skew, replay, size, allow-list; see ``identity.Verifier``) before
the handler runs; a refusal is a specific gRPC status with a reason, logged once per sender and
reason, and the server keeps serving. Replies are signed by the server and verified by the client.

Limits: max message size both ways (default 128 MiB), a deadline on every call (default 10 s),
keepalive pings, optional TLS. ``added_latency_s`` delays each outgoing call, to emulate WAN latency
where netem is unavailable (DESIGN.md, "Measuring").
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

import grpc
import grpc.aio

from geomesh_p2p.identity import EnvelopeError, Identity, PeerID, Verified, Verifier
from geomesh_p2p.wire import envelope_pb2

log = logging.getLogger(__name__)

SignedMessage = envelope_pb2.SignedMessage

# Full method names, as in geomesh_p2p/wire/envelope.proto.
DHT_PING = "/geomesh.wire.Dht/Ping"
DHT_STORE = "/geomesh.wire.Dht/Store"
DHT_FIND = "/geomesh.wire.Dht/Find"
COLLECTIVE_PUSH = "/geomesh.wire.Collective/PushPart"
COLLECTIVE_PULL = "/geomesh.wire.Collective/PullPart"
STATE_GET = "/geomesh.wire.State/GetState"
STATE_STATUS = "/geomesh.wire.State/Status"
LINK_PROBE = "/geomesh.wire.Link/Probe"

DEFAULT_MAX_MESSAGE_BYTES = 128 << 20
RESPONSE_SUFFIX = "+resp"

_current: contextvars.ContextVar[Optional[Verified]] = contextvars.ContextVar("geomesh_verified", default=None)

UnaryHandler = Callable[[Verified, grpc.aio.ServicerContext], Awaitable[bytes]]
StreamHandler = Callable[[Verified, grpc.aio.ServicerContext], AsyncIterator[bytes]]


def _parse_request(data: bytes) -> SignedMessage:
    """Request deserializer that never raises: garbage becomes an empty message, which the
    interceptor refuses with INVALID_ARGUMENT ("message has no envelope") and logs once."""
    try:
        return SignedMessage.FromString(data)
    except Exception:  # DecodeError and friends: the bytes are not a SignedMessage
        return SignedMessage()


def current_request() -> Verified:
    """The verified request of the RPC being handled (set by the interceptor). RuntimeError outside one."""
    v = _current.get()
    if v is None:
        raise RuntimeError("no verified request in this context")
    return v


@dataclass
class TlsConfig:
    """PEM files. Server: cert + key. Client: ca (the root that signed the servers' certs)."""

    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None

    def server_credentials(self) -> grpc.ServerCredentials:
        with open(self.key_file, "rb") as k, open(self.cert_file, "rb") as c:
            return grpc.ssl_server_credentials([(k.read(), c.read())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        root = open(self.ca_file, "rb").read() if self.ca_file else None
        return grpc.ssl_channel_credentials(root_certificates=root)


@dataclass
class TransportConfig:
    """Transport settings. Units: bytes, seconds."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    advertise_host: Optional[str] = None  # what others dial; defaults to host
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    default_timeout_s: float = 10.0
    keepalive_s: float = 20.0
    # The skew window also covers the time a large message spends in flight (a 25 MB part over a slow
    # uplink takes tens of seconds), so it is wider than clock skew alone needs.
    max_skew_s: float = 120.0
    added_latency_s: float = 0.0
    tls: Optional[TlsConfig] = None
    client_only: bool = False


@dataclass
class TrafficStats:
    """Bytes of serialized SignedMessages sent and received by this node (requests and replies)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    rejected: int = 0
    by_method: dict = field(default_factory=dict)

    def add(self, method: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        s, r = self.by_method.get(method, (0, 0))
        self.by_method[method] = (s + sent, r + received)

    def snapshot(self) -> tuple[int, int]:
        return self.bytes_sent, self.bytes_received


class RpcError(Exception):
    """An outgoing call failed: the peer refused it (``code`` + ``reason``), timed out, or is unreachable."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, reason: str):
        super().__init__(f"{method} to {address} failed: {code.name}: {reason}")
        self.address, self.method, self.code, self.reason = address, method, code, reason


class _RejectLog:
    """Logs each (sender, status, reason head) once, so a flood of bad messages is not a flood of logs."""

    def __init__(self, capacity: int = 4096):
        self._seen: dict[tuple, None] = {}
        self.capacity = capacity

    def __call__(self, peer: str, method: str, err: EnvelopeError) -> None:
        key = (peer, err.code, err.reason[:40])
        if key in self._seen:
            return
        if len(self._seen) >= self.capacity:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = None
        log.warning("refused %s from %s: %s: %s", method, peer, err.code.name, err.reason)


class EnvelopeInterceptor(grpc.aio.ServerInterceptor):
    """Verifies the request envelope of every geomesh RPC before its handler runs.

    The expected envelope kind is the RPC's full method name, so a message signed for one RPC cannot
    be replayed against another. On failure the call is aborted with the verifier's status code and
    reason; nothing reaches the handler.
    """

    def __init__(self, verifier: Verifier, stats: TrafficStats, max_payload: Callable[[str], Optional[int]]):
        self.verifier = verifier
        self.stats = stats
        self.max_payload = max_payload
        self.reject_log = _RejectLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/geomesh.wire."):
            return handler
        verifier, stats, reject_log = self.verifier, self.stats, self.reject_log
        limit = self.max_payload(method)

        async def _verify(request: SignedMessage, context) -> Optional[Verified]:
            stats.add(method, 0, request.ByteSize())
            try:
                return verifier.verify(request, kind=method, max_payload_bytes=limit)
            except EnvelopeError as err:
                stats.rejected += 1
                reject_log(context.peer(), method, err)
                await context.abort(err.code, err.reason)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                verified = await _verify(request, context)
                token = _current.set(verified)
                try:
                    return await inner(request, context)
                finally:
                    _current.reset(token)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            async def unary_stream(request, context):
                verified = await _verify(request, context)
                token = _current.set(verified)
                try:
                    async for item in inner_s(request, context):
                        yield item
                finally:
                    _current.reset(token)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class TaskOwner:
    """Owns background asyncio tasks: every task started here is cancelled and awaited by :meth:`close`."""

    def __init__(self, name: str = "node"):
        self.name = name
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro, name: Optional[str] = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task %s failed: %r", self.name, task.get_name(), task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def __len__(self) -> int:
        return len(self._tasks)


class Transport:
    """One node's gRPC endpoint: a verifying server (unless client-only) plus a signing client.

    Usage::

        t = Transport(identity, run_id="demo", config=TransportConfig(port=0))
        t.add_unary(DHT_PING, handler)      # handler(verified, context) -> reply payload bytes
        address = await t.start()           # "host:port", or None when client-only
        reply = await t.call(other, DHT_PING, payload)   # -> Verified (the signed reply)
        await t.stop()

    Handlers return reply payload bytes; the transport signs them (kind = method + "+resp", same
    round as the request). Raise :class:`EnvelopeError` in a handler to refuse with a status.
    """

    def __init__(self, identity: Identity, run_id: str, config: Optional[TransportConfig] = None,
                 allow: Optional[Callable[[PeerID], bool]] = None):
        self.identity = identity
        self.run_id = run_id
        self.config = config or TransportConfig()
        self.verifier = Verifier(run_id, max_skew_s=self.config.max_skew_s,
                                 max_payload_bytes=self.config.max_message_bytes, allow=allow)
        self.stats = TrafficStats()
        self.address: Optional[str] = None
        self._unary: dict[str, UnaryHandler] = {}
        self._stream: dict[str, StreamHandler] = {}
        self._payload_limits: dict[str, int] = {}
        self._server: Optional[grpc.aio.Server] = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.tasks = TaskOwner(f"transport {identity.peer_id.short()}")
        self._closed = False

    # ---------------------------------------------------------------- server side
    def add_unary(self, method: str, handler: UnaryHandler, max_payload_bytes: Optional[int] = None) -> None:
        """Serve ``method`` (full name, e.g. DHT_PING) with ``handler``; optional per-method payload limit."""
        self._unary[method] = handler
        if max_payload_bytes is not None:
            self._payload_limits[method] = max_payload_bytes

    def add_stream(self, method: str, handler: StreamHandler, max_payload_bytes: Optional[int] = None) -> None:
        """Serve a server-streaming ``method``; ``handler`` is an async generator of payload bytes."""
        self._stream[method] = handler
        if max_payload_bytes is not None:
            self._payload_limits[method] = max_payload_bytes

    def _options(self) -> list[tuple[str, int]]:
        c = self.config
        return [
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.keepalive_time_ms", int(c.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ]

    def _sign_reply(self, request: Verified, method: str, payload: bytes) -> SignedMessage:
        return self.identity.sign_message(run_id=self.run_id, round=request.round,
                                          kind=method + RESPONSE_SUFFIX, payload=payload)

    def _make_generic_handlers(self) -> list[grpc.GenericRpcHandler]:
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        ser, de = SignedMessage.SerializeToString, _parse_request

        for method, h in self._unary.items():
            async def unary(request, context, _h=h, _m=method):
                verified = current_request()
                try:
                    payload = await _h(verified, context)
                except EnvelopeError as err:
                    self.stats.rejected += 1
                    await context.abort(err.code, err.reason)
                reply = self._sign_reply(verified, _m, payload)
                self.stats.add(_m, reply.ByteSize(), 0)
                return reply

            service, name = method.rsplit("/", 1)
            by_service.setdefault(service.lstrip("/"), {})[name] = grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=de, response_serializer=ser)

        for method, h in self._stream.items():
            async def stream(request, context, _h=h, _m=method):
                verified = current_request()
                try:
                    async for payload in _h(verified, context):
                        reply = self._sign_reply(verified, _m, payload)
                        self.stats.add(_m, reply.ByteSize(), 0)
                        yield reply
                except EnvelopeError as err:
                    self.stats.rejected += 1
                    await context.abort(err.code, err.reason)

            service, name = method.rsplit("/", 1)
            by_service.setdefault(service.lstrip("/"), {})[name] = grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=de, response_serializer=ser)
        return [grpc.method_handlers_generic_handler(s, m) for s, m in by_service.items()]

    async def start(self) -> Optional[str]:
        """Start serving (unless client-only). Returns the advertised ``host:port`` (None if client-only).

        Raises OSError when the port cannot be bound.
        """
        c = self.config
        if c.client_only:
            return None
        interceptor = EnvelopeInterceptor(self.verifier, self.stats, self._payload_limits.get)
        # No SO_REUSEPORT: a second node on a taken port must fail, not silently share its traffic.
        self._server = grpc.aio.server(interceptors=[interceptor], options=self._options() + [("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers(self._make_generic_handlers())
        bind = f"{c.host}:{c.port}"
        try:
            if c.tls is not None:
                port = self._server.add_secure_port(bind, c.tls.server_credentials())
            else:
                port = self._server.add_insecure_port(bind)
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") for a port in use
            port = 0
        if port == 0:
            self._server = None
            raise OSError(f"cannot listen on {bind}: the port is in use or the address is not local")
        await self._server.start()
        self.address = f"{c.advertise_host or c.host}:{port}"
        return self.address

    # ---------------------------------------------------------------- client side
    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            if self.config.tls is not None:
                ch = grpc.aio.secure_channel(address, self.config.tls.channel_credentials(), options=self._options())
            else:
                ch = grpc.aio.insecure_channel(address, options=self._options())
            self._channels[address] = ch
        return ch

    def _check_reply(self, address: str, method: str, reply: SignedMessage) -> Verified:
        try:
            return self.verifier.verify(reply, kind=method + RESPONSE_SUFFIX)
        except EnvelopeError as err:
            raise RpcError(address, method, err.code, f"reply refused: {err.reason}") from None

    async def call(self, address: str, method: str, payload: bytes, *, round: int = 0,
                   timeout: Optional[float] = None) -> Verified:
        """Sign ``payload``, call ``method`` on ``address`` with a deadline, verify the signed reply.

        Raises RpcError (status + reason) on refusal, deadline, unreachable peer or a bad reply.
        """
        if self._closed:
            raise RpcError(address, method, grpc.StatusCode.CANCELLED, "transport is closed")
        request = self.identity.sign_message(run_id=self.run_id, round=round, kind=method, payload=payload)
        if self.config.added_latency_s > 0:
            await asyncio.sleep(self.config.added_latency_s)
        mc = self._channel(address).unary_unary(
            method, request_serializer=SignedMessage.SerializeToString, response_deserializer=SignedMessage.FromString)
        try:
            reply = await mc(request, timeout=timeout or self.config.default_timeout_s)
        except grpc.aio.AioRpcError as e:
            self.stats.add(method, request.ByteSize(), 0)
            raise RpcError(address, method, e.code(), e.details() or "") from None
        self.stats.calls += 1
        self.stats.add(method, request.ByteSize(), reply.ByteSize())
        return self._check_reply(address, method, reply)

    async def call_stream(self, address: str, method: str, payload: bytes, *, round: int = 0,
                          timeout: Optional[float] = None) -> AsyncIterator[Verified]:
        """Server-streaming call; yields each verified reply. Same errors as :meth:`call`."""
        request = self.identity.sign_message(run_id=self.run_id, round=round, kind=method, payload=payload)
        if self.config.added_latency_s > 0:
            await asyncio.sleep(self.config.added_latency_s)
        mc = self._channel(address).unary_stream(
            method, request_serializer=SignedMessage.SerializeToString, response_deserializer=SignedMessage.FromString)
        call = mc(request, timeout=timeout or self.config.default_timeout_s)
        self.stats.add(method, request.ByteSize(), 0)
        try:
            async for reply in call:
                self.stats.add(method, 0, reply.ByteSize())
                yield self._check_reply(address, method, reply)
        except grpc.aio.AioRpcError as e:
            raise RpcError(address, method, e.code(), e.details() or "") from None
        finally:
            call.cancel()

    async def stop(self, grace: float = 1.0) -> None:
        """Cancel owned tasks, stop the server (``grace`` seconds for calls in flight), close channels."""
        self._closed = True
        await self.tasks.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
