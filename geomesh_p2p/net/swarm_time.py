"""Swarm time: the one clock for every absolute time that crosses machines (issue 14 #1).

A plan's ``start_time`` / ``train_deadline`` / ``exchange_deadline`` / ``created_at``, record and plan
expiries, the collective's push and pull deadlines and a contribution's ``compute_end`` are unix
seconds read by other peers. Each machine's wall clock may be off by tens of seconds, so they are all
written and judged in *swarm time*: this machine's ``time.time()`` plus the offset the DHT measured to
its bootstraps at join and re-measures at every bootstrap ping
(:attr:`geomesh_p2p.dht.DHTNode.clock_offset_s`; a skew over 60 s is refused at join). Local durations
(timeouts, how long a step took) stay on ``time.monotonic()`` / ``time.perf_counter()``.

Time that moves while the peer runs (issue 29 #3, rippled#3101): an NTP step, ``date -s`` or a VM restored
moves ``time.time()`` by seconds to minutes. A :class:`StepWatch` sees such a step at once, as a change of
``time.time()`` against :func:`steady_clock` (which steps never move and which runs through a suspend), and
the offset in use is corrected by it, so swarm time stays continuous and every envelope, deadline and expiry
stays right without waiting for a re-measurement. A laptop that suspends and resumes needs nothing: both
clocks ran on. The DHT corrects its measured offset so (:attr:`geomesh_p2p.dht.DHTNode.clock_offset_s`),
and this module corrects a :func:`set_offset` offset the same way when it follows no source (a bootstrap).

Why process-wide, not passed around: one process runs one node (``peer.cli join``), and the times are
read deep in code that has no DHT at hand (the collective's deadlines, the inner loop's train deadline,
the plan store). Tests that need a skewed peer run it as a separate process under libfaketime
(``FAKETIME=+30s``), which moves ``time.time()`` for the whole process; in-process tests see offset 0.

    >>> set_offset(2.5); abs(swarm_time() - time.time() - 2.5) < 0.1
    True
    >>> set_offset(0.0)
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

__all__ = ["swarm_time", "to_local", "set_offset", "follow", "offset", "steady_clock", "StepWatch", "STEP_MIN_S"]

#: A change of the wall clock against the steady clock this large (seconds) is a step (smaller ones: the two
#: clocks read a few microseconds apart, or a test's frozen clock; a re-measurement takes care of them).
STEP_MIN_S = 1.0

_CLOCK_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
# bound at import: tests replace this module's ``time`` with a fixed wall clock, the step watch reads the real ones
_clock_gettime, _monotonic = getattr(time, "clock_gettime", None), time.monotonic


def steady_clock() -> float:
    """Seconds on a clock that steps of the wall clock never move and that keeps running through a suspend:
    ``CLOCK_BOOTTIME`` on Linux; elsewhere ``time.monotonic()`` (on some systems it stops during a suspend,
    which then looks like a step: the DHT's re-measurement against the bootstraps corrects that)."""
    if _CLOCK_BOOTTIME is not None and _clock_gettime is not None:
        return _clock_gettime(_CLOCK_BOOTTIME)
    return _monotonic()


class StepWatch:
    """How far a wall clock was stepped since :meth:`mark` (seconds; + = set forward): the change of
    ``wall() - steady()``, or 0.0 while it is under ``min_step_s``. ``steady`` None: never moved (an injected
    test clock that has no steady partner)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        steady: Optional[Callable[[], float]] = steady_clock,
        min_step_s: float = STEP_MIN_S,
    ):
        self.wall, self.steady, self.min_step_s = wall, steady, min_step_s
        self._base = 0.0
        self.mark()

    def mark(self) -> None:
        """From now on, :meth:`moved` counts from the wall clock as it is now."""
        self._base = 0.0 if self.steady is None else self.wall() - self.steady()

    def moved(self) -> float:
        """Seconds the wall clock was stepped since :meth:`mark` (0.0 under ``min_step_s``)."""
        if self.steady is None:
            return 0.0
        d = (self.wall() - self.steady()) - self._base
        return d if math.isfinite(d) and abs(d) >= self.min_step_s else 0.0


_offset_s: float = 0.0
_source: Optional[Callable[[], float]] = None
#: Steps of this process's wall clock since the offset was set (used while no source is followed). It reads
#: the real clocks, not this module's ``time`` (which tests replace with a fixed clock).
_steps = StepWatch()


def offset() -> float:
    """The current offset of swarm time over this machine's clock (seconds; 0 until set): the followed
    source's, or the one set, corrected by the steps of the wall clock since it was set."""
    if _source is not None:
        try:
            v = float(_source())
        except Exception:  # the followed node is gone (shut down): keep the last known offset
            return _offset_s - _steps.moved()
        if math.isfinite(v):
            return v
    return _offset_s - _steps.moved()


def swarm_time() -> float:
    """Swarm time, unix seconds: ``time.time()`` + :func:`offset`."""
    return time.time() + offset()


def to_local(t: float) -> float:
    """A swarm-time instant ``t`` (unix seconds) on this machine's ``time.time()`` scale (for code that
    compares against the local wall clock)."""
    return t - offset()


def set_offset(seconds: float) -> None:
    """Set the offset (seconds, swarm time minus this machine's clock) and stop following a source.

    Raises:
        ValueError: ``seconds`` is not finite.
    """
    global _offset_s, _source
    s = float(seconds)
    if not math.isfinite(s):
        raise ValueError(f"clock offset must be finite, got {seconds!r}")
    _offset_s, _source = s, None
    _steps.mark()


def follow(source: Optional[Callable[[], float]]) -> None:
    """Read the offset from ``source()`` (seconds) at each use, e.g. ``lambda: dht.clock_offset_s``, so
    every re-measurement by the DHT applies at once without a hook. ``None`` stops following (the last
    value read stays the offset)."""
    global _offset_s, _source
    if source is None and _source is not None:
        _offset_s = offset()
        _steps.mark()
    _source = source
