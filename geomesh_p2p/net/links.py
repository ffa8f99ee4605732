"""Link bandwidth measured from real transfers (issue #5; DESIGN.md "Round r" step 7, re-profiling).

Two sources, both over the project's own gRPC transport:

* **Every round's exchange.** The collective times each PushPart (upload) and each ready PullPart
  (download) call; the server states in its reply how long it held the request (verifying, waiting
  for a round to open, long-polling), which is taken out, so what is left is the time the bytes were
  on the wire plus one round trip. Concurrent transfers share the link, so the bandwidth of a round
  is ``bytes / busy time``, the busy time being the length of the *union* of the transfer intervals
  (:func:`link_sample`). The node folds each round's sample into an EMA
  (:class:`geomesh_p2p.model.capability.ThroughputEMA`) and announces it, so the next plan fits the links
  as they really were.
* **A probe at start-up** (:func:`probe_link`): before a peer has taken part in any round it uploads
  and downloads a few MiB to/from a bootstrap or peer (``/geomesh.wire.Link/Probe``, served by every
  node, :class:`LinkProbeService`), so its first announcement carries a measured figure instead of a
  guess. ``geomesh-peer profile --probe HOST:PORT`` prints the same measurement.

Neither measurement can tell this peer's link from the other end's: it is a lower bound on this
peer's bandwidth (a slow counterpart or a loaded CPU shows up as a slow link). That is what the
planner needs: how fast this peer's exchange really went.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

import grpc

from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.transport import RpcError, Transport, Verified
from geomesh_p2p.net.methods import LINK_PROBE
from geomesh_p2p.wire import link_pb2

log = logging.getLogger(__name__)

#: The most padding a probe may upload or ask back (bytes); larger requests are refused.
MAX_PROBE_BYTES = 4 << 20


@dataclass(frozen=True)
class LinkSample:
    """Bytes moved in one direction and the seconds the link was busy moving them.

    Attributes:
        nbytes: payload bytes (int, >= 0).
        seconds: busy seconds (float, > 0): the union of the transfer intervals.
        transfers: how many transfers the sample is made of.
    """

    nbytes: int
    seconds: float
    transfers: int

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes/s (``nbytes / seconds``)."""
        return self.nbytes / self.seconds


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length (seconds) of the union of ``[start, end)`` intervals; empty or inverted ones count 0.

    Example: ``busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0``.
    """
    spans = sorted((float(a), float(b)) for a, b in intervals if b > a)
    if not spans:
        return 0.0
    total = 0.0
    cur_a, cur_b = spans[0]
    for a, b in spans[1:]:
        if a > cur_b:  # a gap: the current union interval is complete
            total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a)


def link_sample(transfers: Iterable[tuple[int, float, float]], min_bytes: int = 1) -> Optional[LinkSample]:
    """A :class:`LinkSample` from transfers ``(nbytes, start_s, end_s)`` (monotonic seconds).

    Returns None when fewer than ``min_bytes`` bytes moved or the busy time is 0 (nothing to learn).
    Raises ValueError for negative bytes or non-finite times.
    """
    items = list(transfers)
    for n, a, b in items:
        if n < 0 or not (math.isfinite(a) and math.isfinite(b)):
            raise ValueError(f"bad transfer ({n} bytes, {a}..{b} s)")
    nbytes = sum(n for n, _, _ in items)
    busy = busy_seconds((a, b) for _, a, b in items)
    if nbytes < max(1, min_bytes) or busy <= 0:
        return None
    return LinkSample(nbytes, busy, len(items))


class LinkProbeService:
    """Serves ``/geomesh.wire.Link/Probe`` on a transport: receives the caller's padding and sends
    back ``reply_bytes`` zero bytes (at most :data:`MAX_PROBE_BYTES` each way). Create it before
    ``await transport.start()``.

    Refusals (the node keeps serving): a request over the cap or malformed, INVALID_ARGUMENT; more
    than ``max_per_minute`` probes from one caller in the last 60 s, or replies of more than
    ``max_reply_bytes_per_10s`` bytes in all in the last 10 s, RESOURCE_EXHAUSTED. A probe is cheap
    to ask and costly to answer: a flood must not take the link or memory from the DHT and the
    collective. (A newcomer's probe moves a few MiB; the budget serves several at once.)

    Memory is bounded: the per-caller probe times (at most ``max_per_minute`` monotonic seconds
    each) are kept for at most ``max_callers`` callers, least recently seen forgotten first (LRU),
    so a flood of fake identities cannot grow the table; a caller who keeps probing stays at the
    recent end and keeps its count.
    """

    def __init__(
        self,
        transport: Transport,
        max_bytes: int = MAX_PROBE_BYTES,
        max_per_minute: int = 40,
        max_reply_bytes_per_10s: int = 64 << 20,
        max_callers: int = 4096,
    ):
        self.max_bytes = int(max_bytes)
        self.max_per_minute = int(max_per_minute)
        self.max_reply_bytes_per_10s = int(max_reply_bytes_per_10s)
        if max_callers < 1:
            raise ValueError(f"max_callers must be at least 1, got {max_callers}")
        self.max_callers = int(max_callers)
        # caller -> monotonic times (s) of its admitted probes in the last 60 s; LRU order, newest last
        self._recent: OrderedDict[str, list[float]] = OrderedDict()
        self._replies: list[tuple[float, int]] = []
        transport.add_unary(LINK_PROBE, self._handle, max_payload_bytes=self.max_bytes + 1024)

    def _admit(self, caller: str, reply_bytes: int) -> None:
        now = time.monotonic()
        times = [t for t in self._recent.get(caller, []) if now - t < 60.0]
        if caller in self._recent:
            self._recent.move_to_end(caller)  # a refused caller stays too: its count must not reset
        if len(times) >= self.max_per_minute:
            raise EnvelopeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {self.max_per_minute} probes in a minute from this peer"
            )
        self._replies = [(t, n) for t, n in self._replies if now - t < 10.0]
        if reply_bytes and sum(n for _, n in self._replies) + reply_bytes > self.max_reply_bytes_per_10s:
            raise EnvelopeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "probe reply budget spent; try again shortly")
        times.append(now)
        self._recent[caller] = times
        self._recent.move_to_end(caller)
        while len(self._recent) > self.max_callers:  # hard cap under a Sybil flood: drop the least recent
            self._recent.popitem(last=False)
        if reply_bytes:
            self._replies.append((now, reply_bytes))

    async def _handle(self, verified: Verified, context) -> bytes:
        t0 = time.monotonic()
        try:
            req = link_pb2.LinkProbeRequest.FromString(verified.payload)
        except Exception:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "LinkProbeRequest is malformed") from None
        if req.reply_bytes > self.max_bytes:
            raise EnvelopeError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe asks for {req.reply_bytes} bytes back; the most is {self.max_bytes}",
            )
        self._admit(verified.sender.to_string(), int(req.reply_bytes))
        resp = link_pb2.LinkProbeResponse(received_bytes=len(req.padding), padding=bytes(req.reply_bytes))
        resp.held_s = time.monotonic() - t0
        return resp.SerializeToString()


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_link` measured against one address. Units: bytes/s and seconds."""

    address: str
    rtt_s: float
    upload_bps: float
    download_bps: float
    nbytes: int


async def probe_link(
    transport: Transport,
    address: str,
    nbytes: int = 4 << 20,
    repeats: int = 2,
    timeout_s: float = 60.0,
    target_s: float = 0.5,
    first_bytes: int = 256 << 10,
) -> ProbeResult:
    """Measure this node's link to ``address`` with real transfers of up to ``nbytes`` each way.

    First an empty probe gives the round-trip time (the best of three). Then, per direction, a
    sizing transfer of ``min(first_bytes, nbytes)`` and ``repeats`` transfers sized to take about
    ``target_s`` seconds at the rate seen so far (between 64 KiB and ``nbytes``), so a slow link is
    not held for long and a fast one is not measured on a few packets. Each transfer's rate is
    ``bytes / (seconds - rtt - server hold)``; the best one is kept (the least disturbed).
    ``ProbeResult.nbytes`` is the largest transfer made.

    Raises ValueError for ``nbytes`` outside (0, MAX_PROBE_BYTES], ``repeats < 1`` or
    ``target_s <= 0``; RpcError when the address does not answer or refuses (e.g. an older node
    without the probe: UNIMPLEMENTED).
    """
    if not (0 < nbytes <= MAX_PROBE_BYTES):
        raise ValueError(f"nbytes={nbytes} must be in (0, {MAX_PROBE_BYTES}]")
    if repeats < 1 or not target_s > 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and target_s={target_s} > 0")

    async def once(up: int, down: int, timeout: float = timeout_s) -> tuple[float, float]:
        req = link_pb2.LinkProbeRequest(reply_bytes=down, padding=bytes(up)).SerializeToString()
        t0 = time.monotonic()
        reply = await transport.call(address, LINK_PROBE, req, timeout=timeout)
        dt = time.monotonic() - t0
        resp = link_pb2.LinkProbeResponse.FromString(reply.payload)
        if resp.received_bytes != up or len(resp.padding) != down:
            raise RpcError(
                address,
                LINK_PROBE,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe reply says {resp.received_bytes} bytes received, sent {len(resp.padding)}",
            )
        held = min(max(0.0, resp.held_s if math.isfinite(resp.held_s) else 0.0), dt)
        return dt, held

    rtt = min([(await once(0, 0, min(timeout_s, 10.0)))[0] for _ in range(3)])
    largest = 0

    async def direction(up: bool) -> float:
        nonlocal largest
        best, size = 0.0, min(first_bytes, nbytes)
        for k in range(repeats + 1):
            dt, held = await (once(size, 0) if up else once(0, size))
            largest = max(largest, size)
            # The server states its hold; trusting it for more than half the call would let a lying
            # bootstrap make this link look arbitrarily fast.
            best = max(best, size / max(dt - held - rtt, 0.5 * dt))
            size = int(min(nbytes, max(64 << 10, best * target_s)))
        return best

    best_up = await direction(True)
    best_down = await direction(False)
    return ProbeResult(address, rtt, best_up, best_down, largest)
