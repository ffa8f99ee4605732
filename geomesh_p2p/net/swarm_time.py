"""Swarm time: the one clock for every absolute time that crosses machines (issue 14 #1).

A plan's ``start_time`` / ``train_deadline`` / ``exchange_deadline`` / ``created_at``, record and plan
expiries, the collective's push and pull deadlines and a contribution's ``compute_end`` are unix
seconds read by other peers. Each machine's wall clock may be off by tens of seconds, so they are all
written and judged in *swarm time*: this machine's ``time.time()`` plus the offset the DHT measured to
its bootstraps at join and re-measures at every bootstrap ping
(:attr:`geomesh_p2p.dht.DHTNode.clock_offset_s`; a skew over 60 s is refused at join). Local durations
(timeouts, how long a step took) stay on ``time.monotonic()`` / ``time.perf_counter()``.

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

__all__ = ["swarm_time", "to_local", "set_offset", "follow", "offset"]

_offset_s: float = 0.0
_source: Optional[Callable[[], float]] = None


def offset() -> float:
    """The current offset of swarm time over this machine's clock (seconds; 0 until set)."""
    if _source is not None:
        try:
            v = float(_source())
        except Exception:  # the followed node is gone (shut down): keep the last known offset
            return _offset_s
        if math.isfinite(v):
            return v
    return _offset_s


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


def follow(source: Optional[Callable[[], float]]) -> None:
    """Read the offset from ``source()`` (seconds) at each use, e.g. ``lambda: dht.clock_offset_s``, so
    every re-measurement by the DHT applies at once without a hook. ``None`` stops following (the last
    value read stays the offset)."""
    global _offset_s, _source
    if source is None and _source is not None:
        _offset_s = offset()
    _source = source
