"""gRPC transport: an asyncio server that bounds and verifies every request, and a channel cache.

Every RPC in GeoMesh-P2P carries one :class:`~geomesh_p2p.wire.envelope_pb2.SignedMessage` each way
(a stream of them for state download). The server verifies the request envelope (signature, run,
skew, replay, size, allow-list; see ``identity.Verifier``) before the handler runs; a refusal is a
specific gRPC status with a reason, logged once per caller address and reason, and the server keeps
serving. Replies are signed by the server and verified by the client.

Bounded resources (server side; see :class:`TransportConfig` and :class:`~geomesh_p2p.net.guard._Guard`):

* size: every method has a payload limit; the server-wide ``grpc.max_receive_message_length`` is
  the largest of them (plus the envelope), so a node that serves only small methods (a bootstrap:
  DHT and link probe) refuses anything bigger from the 5-byte length prefix, before receiving it;
  a request over its own method's limit is refused from its length before it is parsed or verified
  (limits can be lowered while serving: :meth:`Transport.set_payload_limit`);
* requests are received one at a time per remote IP and size class (and a few at a time in all); the
  others wait, at ~64 KiB of flow-control window each, in a bounded queue where connections that
  already delivered a valid request go first; a request over 1 MiB keeps its slot until its handler
  returns; a connection that sent an oversized request is refused for a while; the payload is sliced
  out once (not copied by protobuf on every read) and a big one is verified off the event loop;
* concurrent calls per method class in total and per verified sender;
* connections: in total (``grpc.max_allowed_incoming_connections``), streams per connection,
  handshake timeout, idle timeout and maximum age.

Limits both ways (default 128 MiB), a deadline on every call (default 10 s), keepalive pings,
optional TLS. ``added_latency_s`` delays each outgoing call, to emulate WAN latency where netem is

Method names, lanes and limits: :mod:`geomesh_p2p.net.methods`; TLS: :mod:`geomesh_p2p.net.tls`; the
server's request bounds: :mod:`geomesh_p2p.net.guard`; parsing a
received SignedMessage: :mod:`geomesh_p2p.net.envelope`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional

import grpc
import grpc.aio

from geomesh_p2p.net.addr import AddressError, format_address
from geomesh_p2p.util.aio import create_unscoped_task
from geomesh_p2p.util.fds import fd_share
from geomesh_p2p.net import identity as identity_mod
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID, Verified, Verifier
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.wire.varint import varint
from geomesh_p2p.net.methods import (
    BIG_PAYLOAD_BYTES,
    CONTROL_LANE,
    DEFAULT_PAYLOAD_LIMITS,
    ENVELOPE_OVERHEAD,
    IDEMPOTENT_METHODS,
    METHOD_CLASS,
    RESPONSE_SUFFIX,
    lane_of,
)
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.envelope import _split_request
from geomesh_p2p.net.guard import _Guard, _Oversized, _sized_parser, peer_ip

log = logging.getLogger(__name__)

_current: contextvars.ContextVar[Optional[Verified]] = contextvars.ContextVar("geomesh_verified", default=None)

UnaryHandler = Callable[[Verified, grpc.aio.ServicerContext], Awaitable[bytes]]
StreamHandler = Callable[[Verified, grpc.aio.ServicerContext], AsyncIterator[bytes]]


def current_request() -> Verified:
    """The verified request of the RPC being handled (set before its handler runs). RuntimeError outside one."""
    v = _current.get()
    if v is None:
        raise RuntimeError("no verified request in this context")
    return v


@dataclass
class TrafficStats:
    """Bytes of serialized SignedMessages sent and received by this node (requests and replies), in total
    and per full method name; calls this node made that were answered (``calls``, ``calls_by_method``) and
    requests it received and read in full (``served_by_method``). Counters only grow."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    rejected: int = 0
    by_method: dict = field(default_factory=dict)  # method -> (bytes sent, bytes received)
    calls_by_method: dict = field(default_factory=dict)  # method -> answered calls made
    served_by_method: dict = field(default_factory=dict)  # method -> requests received

    def add(self, method: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        s, r = self.by_method.get(method, (0, 0))
        self.by_method[method] = (s + sent, r + received)

    def called(self, method: str) -> None:
        """Count one answered call of ``method`` made by this node."""
        self.calls_by_method[method] = self.calls_by_method.get(method, 0) + 1

    def served(self, method: str) -> None:
        """Count one request of ``method`` received by this node."""
        self.served_by_method[method] = self.served_by_method.get(method, 0) + 1

    def snapshot(self) -> tuple[int, int]:
        return self.bytes_sent, self.bytes_received

    def by_class(self) -> dict[str, dict[str, int]]:
        """The counters so far per method class (:data:`~geomesh_p2p.net.methods.METHOD_CLASS`: ``dht``,
        ``collective``, ``state``, ``probe``, ``other``): ``{class: {"sent", "received", "calls", "served"}}``,
        bytes and counts; only classes with traffic appear."""
        out: dict[str, dict[str, int]] = {}

        def row(method: str) -> dict[str, int]:
            return out.setdefault(METHOD_CLASS.get(method, "other"), dict.fromkeys(TRAFFIC_FIELDS, 0))

        for m, (s, r) in self.by_method.items():
            x = row(m)
            x["sent"] += s
            x["received"] += r
        for m, n in self.calls_by_method.items():
            row(m)["calls"] += n
        for m, n in self.served_by_method.items():
            row(m)["served"] += n
        return out


#: The fields of each class in :meth:`TrafficStats.by_class`.
TRAFFIC_FIELDS = ("sent", "received", "calls", "served")


# What grpc.aio raises from ``context.write`` when the call's stream is gone (the caller's process ended or
# its connection was reset); uncaught, gRPC logged it as an ERROR with a traceback for every such stream.
try:
    from grpc._cython.cygrpc import ExecuteBatchError as _ExecuteBatchError

    _WRITE_FAILED: tuple[type[BaseException], ...] = (_ExecuteBatchError,)
except ImportError:  # another grpcio layout: nothing special to catch
    _WRITE_FAILED = ()


class _ReplyToGoneCaller(logging.Filter):
    """Demotes gRPC core's ERROR + traceback for a unary reply that could not be sent because the caller had
    gone (its deadline passed, or it left): ``ExecuteBatchError raised in core by servicer method [...]``, raised
    inside grpc.aio after the handler returned, so no handler can catch it. On a loaded host (32 peers on 2
    cores) callers give up on slow Find replies routinely; the caller already counts the call as failed, so the
    server's side is a DEBUG line (shown only with ``--log-level DEBUG``), not an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (_WRITE_FAILED and isinstance(exc, _WRITE_FAILED)):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = "%s (the caller had gone: reply not sent)", (record.getMessage(),)
        record.exc_info = record.exc_text = None
        return logging.getLogger(__name__).isEnabledFor(logging.DEBUG)


logging.getLogger("grpc._cython.cygrpc").addFilter(_ReplyToGoneCaller())


# gRPC core's wording (the status details) for a connection that could not be made or was lost, as
# opposed to a server that answered UNAVAILABLE itself ("round N is not open on this node yet").
_CONNECTION_LOST = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "socket closed",
    "connection reset",
    "broken pipe",
    "endpoint closing",
    "no route to host",
    "dns resolution failed",
)


def connection_failed(code: grpc.StatusCode, details: str) -> bool:
    """True when a call failed with UNAVAILABLE because no connection to the peer could be made or kept
    (refused, reset, unresolvable), rather than by the peer's own UNAVAILABLE answer."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    d = (details or "").lower()
    return any(w in d for w in _CONNECTION_LOST)


class RpcError(Exception):
    """An outgoing call failed: the peer refused it (``code`` + ``reason``), timed out, or is unreachable.

    ``unreachable``: the call failed because no connection could be made or kept, after the transport's
    one redial (:meth:`Transport.call`): the peer's process is gone or not listening there; a caller
    waiting on this peer for a deadline can stop at once (issue 14 #10)."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, reason: str, unreachable: bool = False):
        super().__init__(f"{method} to {address} failed: {code.name}: {reason}")
        self.address, self.method, self.code, self.reason = address, method, code, reason
        self.unreachable = unreachable


class TaskOwner:
    """Owns background asyncio tasks: every task started here is cancelled and awaited by :meth:`close`."""

    def __init__(self, name: str = "node"):
        self.name = name
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro, name: Optional[str] = None) -> asyncio.Task:
        task = create_unscoped_task(coro, name=name)  # owned here, not by a TaskScope it was spawned in
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

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        config: Optional[TransportConfig] = None,
        allow: Optional[Callable[[PeerID], bool]] = None,
    ):
        self.identity = identity
        self.run_id = run_id
        self.config = config or TransportConfig()
        self.verifier = Verifier(
            run_id, max_skew_s=self.config.max_skew_s, max_payload_bytes=self.config.max_message_bytes, allow=allow
        )
        self.stats = TrafficStats()
        self.address: Optional[str] = None
        self._unary: dict[str, UnaryHandler] = {}
        self._stream: dict[str, StreamHandler] = {}
        self._payload_limits: dict[str, int] = {}
        self._guard = _Guard(self.config)
        # Keys (caller IP, status, reason head): a flood of bad messages is not a flood of logs.
        self._reject_log = LogOnce(log, capacity=4096)
        self._server: Optional[grpc.aio.Server] = None
        # (address, lane) -> channel, least recently used first
        self._channels: "OrderedDict[tuple[str, str], grpc.aio.Channel]" = OrderedDict()
        self._evicted: set = set()  # evicted channels still closing
        self.tasks = TaskOwner(f"transport {identity.peer_id.short()}")
        self._closed = False

    # ---------------------------------------------------------------- server side
    def add_unary(self, method: str, handler: UnaryHandler, max_payload_bytes: Optional[int] = None) -> None:
        """Serve ``method`` (full name, e.g. DHT_PING) with ``handler``; optional per-method payload limit
        (default: DEFAULT_PAYLOAD_LIMITS for the method, else ``max_message_bytes``)."""
        self._unary[method] = handler
        self._set_limit(method, max_payload_bytes)

    def add_stream(self, method: str, handler: StreamHandler, max_payload_bytes: Optional[int] = None) -> None:
        """Serve a server-streaming ``method``; ``handler`` is an async generator of payload bytes."""
        self._stream[method] = handler
        self._set_limit(method, max_payload_bytes)

    def _set_limit(self, method: str, max_payload_bytes: Optional[int]) -> None:
        if max_payload_bytes is None:
            max_payload_bytes = DEFAULT_PAYLOAD_LIMITS.get(method)
        if max_payload_bytes is not None:
            self._payload_limits[method] = int(max_payload_bytes)
        else:
            self._payload_limits.pop(method, None)

    def set_payload_limit(self, method: str, max_payload_bytes: Optional[int]) -> None:
        """Change ``method``'s payload limit, also while serving (e.g. the collective, once it knows the
        largest part of a round). Checked on every request from its length before parsing; the
        server-wide limit that gRPC applies before receiving is fixed at :meth:`start` (the largest
        limit registered then), so raise limits before starting, lower them at any time."""
        self._set_limit(method, max_payload_bytes)

    def payload_limit(self, method: str) -> int:
        """Largest request payload ``method`` accepts, bytes."""
        return min(self._payload_limits.get(method, self.config.max_message_bytes), self.config.max_message_bytes)

    def _request_limit(self, method: str) -> int:
        """Largest signed request message of ``method``, bytes (payload limit + envelope), read at each
        call so that a limit set after the handler was registered applies."""
        return self.payload_limit(method) + ENVELOPE_OVERHEAD

    def max_request_bytes(self) -> int:
        """The server-wide ``grpc.max_receive_message_length``: the largest request any served method
        accepts (payload limit + envelope), at most ``max_message_bytes``."""
        methods = list(self._unary) + list(self._stream)
        if not methods:
            return self.config.max_message_bytes
        return min(self.config.max_message_bytes, max(self.payload_limit(m) + ENVELOPE_OVERHEAD for m in methods))

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

    def _server_options(self) -> list[tuple[str, int]]:
        c = self.config
        opts = dict(self._options())
        # a full fd table stops accept() for everyone: gRPC's connections get their share of it (util/fds.py;
        # the status page and the client channels have theirs)
        max_conn = fd_share("grpc_server", c.max_connections, floor=16)
        opts.update(
            {
                "grpc.max_receive_message_length": self.max_request_bytes(),
                "grpc.max_allowed_incoming_connections": int(max_conn),
                "grpc.max_concurrent_streams": int(c.max_streams_per_connection),
                "grpc.server_handshake_timeout_ms": int(c.handshake_timeout_s * 1000),
                "grpc.max_connection_idle_ms": int(c.connection_idle_s * 1000),
                "grpc.max_connection_age_ms": int(c.connection_age_s * 1000),
                "grpc.max_connection_age_grace_ms": int(c.connection_age_grace_s * 1000),
                "grpc.http2.bdp_probe": int(bool(c.server_bdp_probe)),
                # No SO_REUSEPORT: a second node on a taken port must fail, not silently share its traffic.
                "grpc.so_reuseport": 0,
            }
        )
        return list(opts.items())

    def _sign_encode(self, *, round: int, kind: str, payload: bytes) -> bytes:
        """Sign ``payload`` (its SHA-256 is computed once, here) and encode the SignedMessage: the bytes
        sent on the wire (protobuf's format, written by hand so that the payload is copied once, by the
        join: building the message and serializing it copied it twice)."""
        env = self.identity.sign_envelope(
            run_id=self.run_id, round=round, kind=kind, payload_sha256=identity_mod.payload_hash(payload)
        ).SerializeToString()
        return b"".join((b"\x0a", varint(len(env)), env, b"\x12", varint(len(payload)), payload))

    async def _signed(self, *, round: int, kind: str, payload: bytes) -> bytes:
        """:meth:`_sign_encode`, in a worker thread for a payload over 1 MiB: hashing and encoding
        100 MiB takes ~0.1-0.5 s, which would stall every other call on this event loop."""
        if len(payload) > BIG_PAYLOAD_BYTES:
            return await asyncio.to_thread(self._sign_encode, round=round, kind=kind, payload=payload)
        return self._sign_encode(round=round, kind=kind, payload=payload)

    async def _sign_reply(self, request: Verified, method: str, payload: bytes) -> bytes:
        return await self._signed(round=request.round, kind=method + RESPONSE_SUFFIX, payload=payload)

    async def _receive(self, method: str, context) -> tuple[Verified, Optional[tuple]]:
        """Admit, read and verify the one request message of a call (see :class:`_Guard`). Returns the
        verified request and, for a request over 1 MiB, its read slot (release it when the handler is
        done). Raises EnvelopeError with the status to answer."""
        guard = self._guard
        peer = context.peer()
        limit = self.payload_limit(method)
        ticket = await guard.acquire_read(peer, guard.pool_for(limit, method))
        try:
            request = await context.read()
            if request is grpc.aio.EOF or request is None:
                raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "call carries no request message")
            if isinstance(request, _Oversized):
                guard.penalize(peer)
                self.stats.add(method, 0, request.nbytes)
                raise EnvelopeError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request of {request.nbytes} bytes: payload over the limit of {limit} bytes of {method}",
                )
            size = request.ByteSize()
            self.stats.add(method, 0, size)
            self.stats.served(method)
            if size > guard.SMALL_LIMIT:  # hashing a big payload would hold up every other call
                verified = await asyncio.to_thread(self.verifier.verify, request, kind=method, max_payload_bytes=limit)
            else:
                verified = self.verifier.verify(request, kind=method, max_payload_bytes=limit)
            del request
        except BaseException:
            guard.release_read(ticket)
            raise
        if size <= guard.SMALL_LIMIT:
            guard.release_read(ticket)
            return verified, None
        return verified, ticket

    async def _admit(self, method: str, context) -> tuple:
        """(verified request, read slot or None, call token); aborts the call on a refusal.

        Refusals abort *outside* the ``except`` block, with nothing big left in this frame: gRPC keeps
        the abort exception on the call's state, whose traceback (frames and their locals) would
        otherwise hold the request message in a reference cycle until the next garbage collection,
        i.e. hundreds of refused requests' bytes under a flood."""
        ticket = None
        verified: Optional[Verified] = None
        try:
            verified, ticket = await self._receive(method, context)
            token = self._guard.enter_call(method, verified.sender)
            self._guard.mark_good(context.peer())
            return verified, ticket, token
        except EnvelopeError as err:
            refusal = (err.code, err.reason)
            self.stats.rejected += 1
            peer = context.peer()
            self._reject_log(
                (peer_ip(peer), err.code, err.reason[:40]),
                logging.WARNING,
                "refused %s from %s: %s: %s",
                method,
                peer,
                err.code.name,
                err.reason,
                event="call_refused",
                peer=str(self.identity.peer_id),
                method=method,
                caller_address=peer,
                code=err.code.name,
                reason=err.reason,
            )
        if ticket is not None:
            self._guard.release_read(ticket)
        verified = None  # noqa: F841  (see the docstring)
        await context.abort(*refusal)
        raise AssertionError("unreachable: ServicerContext.abort raises")

    def _done(self, ticket: Optional[tuple], token: tuple) -> None:
        self._guard.leave_call(token)
        if ticket is not None:
            self._guard.release_read(ticket)

    def _make_generic_handlers(self) -> list[grpc.GenericRpcHandler]:
        """One handler per method. Each is registered as request-streaming, although clients make
        ordinary unary calls (the wire is the same): the handler then runs *before* the request is
        received, so it can queue or refuse it first (see :class:`_Guard`), and reads it itself."""
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        ser = None  # replies are signed and encoded by _sign_reply (in a thread when big): bytes as they are

        for method, h in self._unary.items():

            async def unary(request_iterator, context, _h=h, _m=method):
                verified, ticket, token = await self._admit(_m, context)
                var = _current.set(verified)
                refusal = None
                try:
                    payload = await _h(verified, context)
                except EnvelopeError as err:
                    refusal = (err.code, err.reason)
                finally:
                    self._done(ticket, token)
                    _current.reset(var)  # a coroutine: same task, same context
                if refusal is not None:  # abort outside the except block: see _admit
                    self.stats.rejected += 1
                    verified = payload = None
                    await context.abort(*refusal)
                reply = await self._sign_reply(verified, _m, payload)
                self.stats.add(_m, len(reply), 0)
                return reply

            de = _sized_parser(functools.partial(self._request_limit, method))
            service, name = method.rsplit("/", 1)
            by_service.setdefault(service.lstrip("/"), {})[name] = grpc.stream_unary_rpc_method_handler(
                unary, request_deserializer=de, response_serializer=ser
            )

        for method, sh in self._stream.items():

            async def stream(request_iterator, context, _h=sh, _m=method):
                # A coroutine that writes (not an async generator): a client's cancel arrives here as
                # CancelledError, in this task, and the handler's generator is closed right here, in the
                # context it ran in (an abandoned generator would be closed later by asyncio's finalizer
                # in another task and context, which printed "Token ... created in a different Context").
                verified, ticket, token = await self._admit(_m, context)
                var = _current.set(verified)
                gen = _h(verified, context)
                refusal = None
                try:
                    async for payload in gen:
                        reply = await self._sign_reply(verified, _m, payload)
                        self.stats.add(_m, len(reply), 0)
                        await context.write(reply)
                except EnvelopeError as err:
                    refusal = (err.code, err.reason)
                except _WRITE_FAILED as err:  # the caller's connection went away mid-stream (it left)
                    log.debug("%s: stream to %s ended by the caller's side: %r", _m, context.peer(), err)
                finally:
                    self._done(ticket, token)
                    await gen.aclose()
                    _current.reset(var)
                if refusal is not None:
                    self.stats.rejected += 1
                    verified = gen = None
                    await context.abort(*refusal)

            de = _sized_parser(functools.partial(self._request_limit, method))
            service, name = method.rsplit("/", 1)
            by_service.setdefault(service.lstrip("/"), {})[name] = grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=de, response_serializer=ser
            )
        return [grpc.method_handlers_generic_handler(s, m) for s, m in by_service.items()]

    async def start(self) -> Optional[str]:
        """Start serving (unless client-only). Returns the advertised ``host:port`` (None if client-only).

        Raises OSError when the port cannot be bound.
        """
        c = self.config
        if c.client_only:
            return None
        try:  # an IPv6 literal in brackets, or gRPC reads it as a host name
            bind = format_address(c.host, c.port)
            advertised_host = format_address(c.advertise_host or c.host, 1).rpartition(":")[0]
        except AddressError as e:
            raise OSError(f"cannot listen on {c.host}:{c.port}: {e}") from None
        self._guard = _Guard(c)
        self._server = grpc.aio.server(
            options=self._server_options(), maximum_concurrent_rpcs=max(1, int(c.max_concurrent_rpcs))
        )
        self._server.add_generic_rpc_handlers(self._make_generic_handlers())
        try:
            if c.tls is not None:
                port = self._server.add_secure_port(bind, c.tls.server_credentials())
            else:
                port = self._server.add_insecure_port(bind)
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") for a port in use
            port = 0
        if port == 0:
            self._server = None
            raise OSError(
                f"cannot listen on {bind}: the port is in use or the address is not local "
                "(another --port, or --port 0 for a free one)"
            )
        await self._server.start()
        self.address = f"{advertised_host}:{port}"
        return self.address

    # ---------------------------------------------------------------- client side
    def _channel(self, address: str, lane: str = CONTROL_LANE) -> grpc.aio.Channel:
        """The cached channel to ``address`` for ``lane`` (:func:`lane_of`: each lane is its own TCP
        connection). At most ``max_channels`` are kept (addresses come from other nodes, e.g. the ones a
        caller claims): the least recently used is closed, with a grace period for its calls in flight."""
        key = (address, lane)
        ch = self._channels.get(key)
        if ch is None:
            # Its own subchannels (not gRPC's process-wide pool): a channel dropped by drop_channel takes
            # its reconnect backoff with it instead of handing it to the next channel to that address.
            opts = self._options() + [("grpc.use_local_subchannel_pool", 1)]
            if self.config.tls is not None:
                ch = grpc.aio.secure_channel(address, self.config.tls.channel_credentials(), options=opts)
            else:
                ch = grpc.aio.insecure_channel(address, options=opts)
            self._channels[key] = ch
            while len(self._channels) > max(1, fd_share("channels", self.config.max_channels)):
                _, old = self._channels.popitem(last=False)
                self._evicted.add(old)
                task = self.tasks.spawn(old.close(grace=self.config.default_timeout_s), name="close-channel")
                task.add_done_callback(functools.partial(self._forget_evicted, old))
        else:
            self._channels.move_to_end(key)
        return ch

    def drop_channel(
        self, address: str, channel: Optional[grpc.aio.Channel] = None, lane: Optional[str] = None
    ) -> bool:
        """Close the cached channel to ``address`` (a grace of ``default_timeout_s`` seconds for its calls in
        flight), so the next call dials a new connection. Why: a channel whose peer went away waits out
        gRPC's reconnect backoff (up to minutes), failing every call at once with the old error, even
        after a new process listens there again (a restart on the same port). With ``channel``: only if
        that one is still the cached one (concurrent failed calls drop the dead channel once, not the new
        one a first retry dialled). Without ``channel``: the channels of every lane to ``address``, or of
        ``lane`` only. True when one was dropped."""
        keys = [
            k for k, ch in self._channels.items() if k[0] == address and channel in (None, ch) and lane in (None, k[1])
        ]
        for key in keys:
            ch = self._channels.pop(key)
            self._evicted.add(ch)
            task = self.tasks.spawn(ch.close(grace=self.config.default_timeout_s), name="close-channel")
            task.add_done_callback(functools.partial(self._forget_evicted, ch))
        return bool(keys)

    def _forget_evicted(self, channel: grpc.aio.Channel, task: asyncio.Task) -> None:
        """Done callback of an evicted channel's close: it is no longer closed at :meth:`stop`, unless the
        close was cancelled (stop cancels the tasks first, during a close's grace period): then stop still
        closes it (review: it was left to the garbage collector)."""
        if not task.cancelled():
            self._evicted.discard(channel)

    async def _check_reply(self, address: str, method: str, reply) -> Verified:
        """Verify a reply (split by :func:`_split_request`: its payload is read once, not copied by
        protobuf); in a worker thread when it is over 1 MiB (hashing it would stall the loop)."""
        try:
            if reply.ByteSize() > BIG_PAYLOAD_BYTES:
                return await asyncio.to_thread(self.verifier.verify, reply, kind=method + RESPONSE_SUFFIX)
            return self.verifier.verify(reply, kind=method + RESPONSE_SUFFIX)
        except EnvelopeError as err:
            raise RpcError(address, method, err.code, f"reply refused: {err.reason}") from None

    async def call(
        self,
        address: str,
        method: str,
        payload: bytes,
        *,
        round: int = 0,
        timeout: Optional[float] = None,
        idempotent: Optional[bool] = None,
    ) -> Verified:
        """Sign ``payload``, call ``method`` on ``address`` with a deadline (``timeout`` seconds, default
        ``default_timeout_s``, for both tries together), verify the signed reply.

        A lost connection (:func:`connection_failed`) drops the cached channel, whatever the method: a
        peer restarted on its old port is dialled afresh instead of after gRPC's reconnect backoff. An
        ``idempotent`` call (default: ``method`` in :data:`IDEMPOTENT_METHODS`) is then retried once at
        once on the new connection. Only an answered call counts its bytes in :attr:`stats` (a failed
        one may never have left this host: counting it inflated the exchange's sent bytes).

        Raises RpcError (status + reason; ``unreachable`` for a lost connection) on refusal, deadline,
        unreachable peer or a bad reply.
        """
        if self._closed:
            raise RpcError(address, method, grpc.StatusCode.CANCELLED, "transport is closed")
        request = await self._signed(round=round, kind=method, payload=payload)
        if self.config.added_latency_s > 0:
            await asyncio.sleep(self.config.added_latency_s)
        retry = method in IDEMPOTENT_METHODS if idempotent is None else idempotent
        deadline = time.monotonic() + (timeout or self.config.default_timeout_s)
        while True:
            channel = self._channel(address, lane_of(method))
            mc = channel.unary_unary(method, request_serializer=None, response_deserializer=_split_request)
            try:
                reply = await mc(request, timeout=max(0.001, deadline - time.monotonic()))
                break
            except grpc.aio.AioRpcError as e:
                lost = connection_failed(e.code(), e.details() or "")
                if lost:
                    self.drop_channel(address, channel)
                if lost and retry and not self._closed and deadline - time.monotonic() > 0.001:
                    retry = False
                    log.debug("%s to %s: connection lost (%s); redialling once", method, address, e.details())
                    # Signed afresh: the first try may have reached the server before the connection broke,
                    # and the same nonce again is refused as a replay (rs9: a pull retried this way got
                    # ALREADY_EXISTS, the reader zeroed the part and left the swarm's digest).
                    request = await self._signed(round=round, kind=method, payload=payload)
                    continue
                raise RpcError(address, method, e.code(), e.details() or "", unreachable=lost) from None
        self.stats.calls += 1
        self.stats.called(method)
        self.stats.add(method, len(request), reply.ByteSize())
        return await self._check_reply(address, method, reply)

    async def call_stream(
        self, address: str, method: str, payload: bytes, *, round: int = 0, timeout: Optional[float] = None
    ) -> AsyncGenerator[Verified, None]:
        """Server-streaming call; yields each verified reply. Same errors as :meth:`call`."""
        request = await self._signed(round=round, kind=method, payload=payload)
        if self.config.added_latency_s > 0:
            await asyncio.sleep(self.config.added_latency_s)
        channel = self._channel(address, lane_of(method))
        mc = channel.unary_stream(method, request_serializer=None, response_deserializer=_split_request)
        call = mc(request, timeout=timeout or self.config.default_timeout_s)
        answered = False  # the request's bytes count once a reply arrived (see call)
        try:
            async for reply in call:
                if not answered:
                    answered = True
                    self.stats.called(method)
                    self.stats.add(method, len(request), 0)
                self.stats.add(method, 0, reply.ByteSize())
                yield await self._check_reply(address, method, reply)
            if not answered:  # an answer with no message
                self.stats.called(method)
                self.stats.add(method, len(request), 0)
        except grpc.aio.AioRpcError as e:
            # Not retried here (replies may already have been yielded): the channel is dropped so the
            # caller's next try dials afresh.
            lost = connection_failed(e.code(), e.details() or "")
            if lost:
                self.drop_channel(address, channel)
            raise RpcError(address, method, e.code(), e.details() or "", unreachable=lost) from None
        finally:
            call.cancel()

    async def stop(self, grace: float = 1.0) -> None:
        """Cancel owned tasks, stop the server (``grace`` seconds for calls in flight), close channels."""
        self._closed = True
        await self.tasks.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        channels, self._channels = list(self._channels.values()) + list(self._evicted), OrderedDict()
        self._evicted = set()
        for ch in channels:
            await ch.close()
