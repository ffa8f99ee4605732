"""The server side's bounds on requests, before a handler runs (see :mod:`geomesh_p2p.net.transport`):
:class:`_Guard` decides which request is read now, which waits (per remote IP, per size class, good
connections first) and which is refused, and caps calls in progress per method class and sender; the
request deserializer (:func:`_sized_parser`) refuses an oversized request from its length, before it
is parsed (:func:`~geomesh_p2p.net.envelope._split_request`) or verified.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import unquote
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Dict, Optional

import grpc
import grpc.aio

from geomesh_p2p.net.identity import EnvelopeError, PeerID
from geomesh_p2p.net.methods import BULK_LANE, DEFAULT_CALL_LIMITS, METHOD_CLASS, lane_of
from geomesh_p2p.net.envelope import _split_request

if TYPE_CHECKING:
    from geomesh_p2p.net.transport_config import TransportConfig


class _Oversized:
    """What the request deserializer returns for a message over its method's limit (never parsed)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def _sized_parser(max_message: Callable[[], int]) -> Callable[[bytes], object]:
    """A request deserializer that refuses, from its length alone, a message over ``max_message()``
    bytes: it is neither parsed (a protobuf copy) nor hashed and signature-checked."""

    def parse(data: bytes):
        if len(data) > max_message():
            return _Oversized(len(data))
        return _split_request(data)

    return parse


def peer_ip(peer: str) -> str:
    """The remote IP of a gRPC ``context.peer()`` string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", which gRPC
    writes percent-encoded: "ipv6:%5B::1%5D:5"); the string itself when it has no port (e.g. "unix:...")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest:
        host = unquote(rest).rsplit(":", 1)[0]
        return host.strip("[]")
    return peer


def _count_down(counts: dict, key) -> None:
    """Decrement ``counts[key]`` (KeyError when absent), deleting the key at 0 so that the per-IP and
    per-sender tables hold only the keys with something in progress (they stay bounded)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


class _Pool:
    """Read slots of one size class: at most ``per_ip`` per remote IP and ``total`` in all; waiters
    in two FIFO lanes, connections with a good record first."""

    def __init__(self, name: str, per_ip: int, total: int):
        self.name, self.per_ip, self.total = name, max(1, int(per_ip)), max(1, int(total))
        self.reading = 0
        self.by_ip: Dict[str, int] = {}
        self.fast: "OrderedDict[object, tuple[str, asyncio.Future]]" = OrderedDict()
        self.queue: "OrderedDict[object, tuple[str, asyncio.Future]]" = OrderedDict()

    def waits(self, ip: str, fast: bool) -> bool:
        """Whether a request of ``ip`` waits in this lane or ahead of it."""
        lanes = (self.fast,) if fast else (self.fast, self.queue)
        return any(q_ip == ip for lane in lanes for q_ip, _ in lane.values())

    def free_for(self, ip: str) -> bool:
        return self.reading < self.total and self.by_ip.get(ip, 0) < self.per_ip

    def take(self, ip: str) -> None:
        self.reading += 1
        self.by_ip[ip] = self.by_ip.get(ip, 0) + 1

    def give(self, ip: str) -> None:
        self.reading -= 1
        _count_down(self.by_ip, ip)


class _Guard:
    """Admission of requests on one server: who may be read now, who waits, who is refused.

    What gRPC (C core, chttp2) holds before this code runs: the call's headers and, per stream, at most
    its HTTP/2 receive window of request data (64 KiB with BDP probing off, see
    ``TransportConfig.server_bdp_probe``; the sender blocks on flow control beyond it). A request over
    the server-wide ``grpc.max_receive_message_length`` is refused by the core from its 5-byte length
    prefix, without receiving it. Once a handler asks for the message (``context.read()``), the core
    opens the window and buffers the whole message (up to that server-wide limit), then copies it into
    a Python ``bytes`` object for the deserializer: so a request to a method with a small limit can
    still cost up to the server-wide limit, twice over, while it is read. Hence:

    * reads take a slot of their method's class: "bulk" for :data:`BULK_METHODS` (PushPart, PullPart,
      the state, outer updates, link probes), else by payload limit "small" (up to 1 MiB, e.g. DHT ping
      and find) or "large" (e.g. DHT store); at most ``max_reads_per_ip`` per remote IP and ``max_reads``
      in all per class (bulk: half of them, large: a quarter, at least 1). Control calls never wait for a
      bulk slot: a peer's DHT store is not held up behind its own or others' part uploads (the client's
      connection lanes alone did not help while the server queued both for one slot); the others wait holding only their flow-control window, at most
      ``max_waiting_per_ip`` per IP and ``max_waiting`` in all (more: RESOURCE_EXHAUSTED at once),
      in two FIFO lanes: connections that already delivered a valid signed request first (an honest
      peer's DHT ping does not queue behind a flood of new connections from its IP);
    * a request bigger than 1 MiB keeps its slot until its handler returns (its bytes live that
      long), a smaller one gives it back once read;
    * the deserializer checks the length against the method's own limit before parsing;
      :meth:`penalize` then refuses that connection (``context.peer()``, IP and port) for
      ``oversize_penalty_s`` seconds before reading anything more from it;
    * :meth:`enter_call` caps calls in progress per method class in total and per verified sender.
    """

    SMALL_LIMIT = 1 << 20

    def __init__(self, config: "TransportConfig"):
        c = config
        self.pools = {
            "small": _Pool("small", c.max_reads_per_ip, c.max_reads),
            "large": _Pool("large", c.max_reads_per_ip, max(1, c.max_reads // 4)),
            "bulk": _Pool("bulk", c.max_reads_per_ip, max(1, c.max_reads // 2)),
        }
        self.max_waiting_per_ip, self.max_waiting = max(0, c.max_waiting_per_ip), max(0, c.max_waiting)
        self.penalty_s = c.oversize_penalty_s
        self.limits = {**DEFAULT_CALL_LIMITS, **c.call_limits}
        self._waiting_by_ip: Dict[str, int] = {}
        self._waiting = 0
        self._penalty: "OrderedDict[str, float]" = OrderedDict()  # connection -> until (monotonic)
        self._good: "OrderedDict[str, None]" = OrderedDict()  # connections that sent a valid request
        self._calls: Dict[str, int] = {}
        self._sender_calls: Dict[tuple, int] = {}
        self.refused = 0

    def pool_for(self, payload_limit: int, method: str = "") -> str:
        """The read pool of a call: "bulk" for a bulk ``method`` (:func:`lane_of`), else "small" or
        "large" by ``payload_limit`` (bytes)."""
        if lane_of(method) == BULK_LANE:
            return "bulk"
        return "small" if payload_limit <= self.SMALL_LIMIT else "large"

    # -------------------------------------------------------------- reading
    def _refuse(self, reason: str) -> EnvelopeError:
        self.refused += 1
        return EnvelopeError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)

    def penalize(self, peer: str) -> None:
        self._good.pop(peer, None)
        self._penalty[peer] = time.monotonic() + self.penalty_s
        self._penalty.move_to_end(peer)
        while len(self._penalty) > 8192:
            self._penalty.popitem(last=False)

    def _penalized(self, peer: str) -> Optional[float]:
        until = self._penalty.get(peer)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self._penalty[peer]
            return None
        return left

    def _unwait(self, ip: str) -> None:
        self._waiting -= 1
        _count_down(self._waiting_by_ip, ip)

    def _wake(self, pool: _Pool) -> None:
        """Start the first waiting reads (good connections first, FIFO) whose IP and the pool have a free slot."""
        for lane in (pool.fast, pool.queue):
            for key, (ip, fut) in list(lane.items()):
                if pool.reading >= pool.total:
                    return
                if fut.done():
                    continue
                if pool.free_for(ip):
                    del lane[key]
                    self._unwait(ip)
                    pool.take(ip)
                    fut.set_result(None)

    def mark_good(self, peer: str) -> None:
        """``peer`` (a connection) delivered a valid signed request: its next ones wait in the first lane."""
        self._good[peer] = None
        self._good.move_to_end(peer)
        while len(self._good) > 8192:
            self._good.popitem(last=False)

    async def acquire_read(self, peer: str, pool_name: str = "small") -> tuple:
        """Wait for a read slot for a request from ``peer``; returns a ticket for :meth:`release_read`.
        Raises EnvelopeError(RESOURCE_EXHAUSTED) when the connection is penalized or the queues are full."""
        left = self._penalized(peer)
        if left is not None:
            raise self._refuse(
                f"this connection sent a request over its method's size limit; refused for {left:.0f}s more"
            )
        ip = peer_ip(peer)
        pool = self.pools[pool_name]
        fast = peer in self._good
        if pool.free_for(ip) and not pool.waits(ip, fast):  # nobody of this IP waits ahead of it
            pool.take(ip)
            return pool, ip
        mine = self._waiting_by_ip.get(ip, 0)
        if mine >= self.max_waiting_per_ip or self._waiting >= self.max_waiting:
            raise self._refuse(f"too many requests waiting to be received ({mine} from {ip}, {self._waiting} in all)")
        fut = asyncio.get_running_loop().create_future()
        key = object()
        lane = pool.fast if fast else pool.queue
        lane[key] = (ip, fut)
        self._waiting_by_ip[ip] = mine + 1
        self._waiting += 1
        try:
            await fut
        except BaseException:  # cancelled (deadline, client gone, server stop) while waiting
            if key in lane:
                del lane[key]
                self._unwait(ip)
            elif fut.done() and not fut.cancelled():  # granted just as it was cancelled: give it back
                self.release_read((pool, ip))
            raise
        return pool, ip

    def release_read(self, ticket: tuple) -> None:
        pool, ip = ticket
        pool.give(ip)
        self._wake(pool)

    # -------------------------------------------------------------- calls in progress
    def enter_call(self, method: str, sender: PeerID) -> tuple:
        """Count a verified call; raises EnvelopeError(RESOURCE_EXHAUSTED) over a cap. Returns the token
        for :meth:`leave_call`."""
        cls = METHOD_CLASS.get(method, "other")
        total, per_sender = self.limits.get(cls, DEFAULT_CALL_LIMITS["other"])
        key = (cls, bytes(sender))
        mine = self._sender_calls.get(key, 0)
        if mine >= per_sender:
            raise self._refuse(f"{mine} {cls} calls from this sender in progress (at most {per_sender} per caller)")
        n = self._calls.get(cls, 0)
        if n >= total:
            raise self._refuse(f"{n} {cls} calls in progress (at most {total} in total); try again shortly")
        self._sender_calls[key] = mine + 1
        self._calls[cls] = n + 1
        return cls, key

    def leave_call(self, token: tuple) -> None:
        cls, key = token
        self._calls[cls] -= 1
        _count_down(self._sender_calls, key)

    def snapshot(self) -> dict:
        """Counters, for tests and benchmarks."""
        return {
            "reading": sum(p.reading for p in self.pools.values()),
            "waiting": self._waiting,
            "ips": len(set().union(*(p.by_ip for p in self.pools.values()))),
            "calls": {k: v for k, v in self._calls.items() if v},
            "penalized": len(self._penalty),
            "refused": self.refused,
        }
