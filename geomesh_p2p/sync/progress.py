"""A syncing peer's download progress, measured and announced (issue 14 #3: the leader's wait for a
syncing joiner is derived from its progress, not a fixed 4 s).

:class:`SyncMeter` counts the bytes of a state download as they arrive: :meth:`SyncMeter.wrap` gives a
transport whose ``call_stream`` counts each message's payload and passes everything else through, so
:func:`geomesh_p2p.sync.download.download_state` is measured without being changed. The node puts
:meth:`SyncMeter.progress` in its record while it syncs (``PeerRecord.sync_progress``); the announcer
refreshes the record every ``announce_period_s``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any, Callable, Optional

from geomesh_p2p.schema.peer import MAX_LINK_BPS, SyncProgress

__all__ = ["SyncMeter", "RATE_WINDOW_S", "NOTIFY_EVERY_S"]

#: The announced rate is measured over about the last this many seconds (a download that moved to a
#: faster donor after a stall shows the new donor's rate soon).
RATE_WINDOW_S = 5.0
#: ``on_progress`` is called at most this often while bytes arrive (the node then re-announces its record,
#: one DHT store): a leader sees a joiner's first rate within about a second of its download's start,
#: before its plain wait for a peer on probation (1.5 s) runs out.
NOTIFY_EVERY_S = 0.5


class SyncMeter:
    """Bytes received by one state download of ``total_bytes`` bytes, and the recent rate.

    Args:
        total_bytes: the whole state, ``(P + state_numel) * 4`` bytes.
        on_progress: called (on the caller's thread, must not block) at most every ``NOTIFY_EVERY_S``
            while bytes arrive, and when the last byte arrives: the node re-announces its record.
        clock: monotonic seconds (injected in tests).
    Raises:
        ValueError: ``total_bytes < 1``.
    """

    def __init__(
        self,
        total_bytes: int,
        on_progress: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total_bytes < 1:
            raise ValueError(f"total_bytes must be >= 1, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self.done_bytes = 0
        self._received = 0  # every byte counted, uncapped: a total corrected upwards keeps them
        self._clock = clock
        self._on_progress = on_progress
        self._points: deque[tuple[float, int]] = deque([(clock(), 0)])  # (monotonic s, bytes received)
        self._started = self._last_at = self._points[0][0]
        self._notified = self._points[0][0]
        self._complete_notified = False

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more received (capped at ``total_bytes``: message framing, ~30 bytes per 1 MiB
        chunk, is counted too, so the count reaches the total a few KiB early)."""
        self._received += max(0, int(nbytes))
        self.done_bytes = min(self.total_bytes, self._received)
        now = self._last_at = self._clock()
        self._points.append((now, self._received))
        while len(self._points) > 2 and now - self._points[1][0] >= RATE_WINDOW_S:
            self._points.popleft()  # keep one point at least RATE_WINDOW_S old when there is one
        complete = self.done_bytes >= self.total_bytes and not self._complete_notified
        if self._on_progress is not None and (now - self._notified >= NOTIFY_EVERY_S or complete):
            self._notified, self._complete_notified = now, self.done_bytes >= self.total_bytes
            self._on_progress()

    def set_total(self, total_bytes: int) -> None:
        """The transfer's size became known (an outer update's blob states it in its first chunk; the meter
        started from an estimate): ``total_bytes`` from now on (at least 1), the bytes counted so far kept.
        Without it a catch-up estimated at ``P`` bytes per update showed its download done at a quarter
        of an fp32 update, and the leader's wait for it ended 2 s later (issue 29 #7)."""
        self.total_bytes = max(1, int(total_bytes))
        self.done_bytes = min(self.total_bytes, self._received)
        self._complete_notified = self._complete_notified and self.done_bytes >= self.total_bytes

    def mean_bytes_per_s(self) -> float:
        """Bytes/s from the meter's start to its last counted byte (0.0 before any): what the next transfer
        of this peer announces as its rate before its own first byte
        (:class:`~geomesh_p2p.round.rules.state_sync.StateSync`)."""
        dt = self._last_at - self._started
        return 0.0 if self._received <= 0 or dt <= 0 else min(MAX_LINK_BPS, self._received / dt)

    def bytes_per_s(self) -> float:
        """Rate over the last ~``RATE_WINDOW_S`` seconds up to now (a stall lowers it), bytes/s; 0.0 before
        any byte arrived."""
        t0, d0 = self._points[0]
        dt = self._clock() - t0
        if self._received <= d0 or dt <= 0:
            return 0.0
        return min(MAX_LINK_BPS, (self._received - d0) / dt)

    def progress(self) -> SyncProgress:
        """What the record announces."""
        return SyncProgress(done_bytes=self.done_bytes, total_bytes=self.total_bytes, bytes_per_s=self.bytes_per_s())

    def wrap(self, transport: Any) -> "_CountingTransport":
        """``transport`` with ``call_stream`` counted into this meter (everything else passed through)."""
        return _CountingTransport(transport, self)


class _CountingTransport:
    """A transport proxy: each message of ``call_stream`` adds its payload's length to the meter."""

    def __init__(self, inner: Any, meter: SyncMeter):
        self._inner, self._meter = inner, meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def call_stream(self, *args, **kwargs):
        # aclosing: when the caller abandons this stream (a stalled piece moving to another donor), the
        # inner stream is closed now, as download_state's own aclosing would close it unwrapped
        async with contextlib.aclosing(self._inner.call_stream(*args, **kwargs)) as stream:
            async for msg in stream:
                self._meter.add(len(getattr(msg, "payload", b"") or b""))
                yield msg
