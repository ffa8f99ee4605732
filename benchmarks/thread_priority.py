"""Compute threads at a lower CPU priority than the event loop's thread (issue 27, docs/real-size.md "Session 27").

Several peers on a small host stall their event loops for 0.3-1.4 s: the loop thread is idle in ``select`` and
waits for a CPU while the peers' worker threads (inner steps, pseudo-gradient, outer step, digest, verified work)
and torch's intra-op threads run. On Linux the nice value is per thread: ``setpriority(PRIO_PROCESS, tid, n)``
sets one thread's, an unprivileged process may raise (never lower) its own threads' nice, and a new thread
inherits its creator's. So a worker thread that raises its own nice before its first torch op takes its OpenMP
team (created by the first thread that runs a parallel op, per calling thread in libgomp) and any pool it starts
along with it, while the loop thread and gRPC's threads stay at nice 0.

Every function here is a no-op (one DEBUG line) where unsupported (no ``os.setpriority`` or no native thread id)
and never raises.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable, Optional

__all__ = ["thread_nice", "lower_current_thread", "nice_initializer", "renice_threads"]

log = logging.getLogger(__name__)


def _supported() -> bool:
    return hasattr(os, "setpriority") and hasattr(threading, "get_native_id")


def thread_nice(tid: Optional[int] = None) -> Optional[int]:
    """The nice value (-20..19) of thread ``tid`` (a native thread id, default: the calling thread), None where it
    cannot be read (unsupported platform, thread gone)."""
    if not _supported():
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())
    except OSError:
        return None


def _raise_nice(tid: int, nice: int) -> bool:
    """Raise thread ``tid``'s nice to ``nice`` (never lowers it: that needs a privilege); True when it is at least
    ``nice`` afterwards."""
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        if cur < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError as e:  # thread exited meanwhile, or a sandbox refuses setpriority
        log.debug("could not set nice %d on thread %d: %s", nice, tid, e)
        return False


def lower_current_thread(nice: int) -> bool:
    """Raise the calling thread's nice to ``nice`` (0 or less: nothing). Threads it starts afterwards (an OpenMP
    team, a pool) inherit it. Returns True when the thread now runs at nice >= ``nice``; never raises."""
    if nice <= 0:
        return False
    if not _supported():
        log.debug("per-thread nice is not supported here; compute threads keep their priority")
        return False
    return _raise_nice(threading.get_native_id(), min(nice, 19))


def nice_initializer(nice: int) -> Callable[[], None]:
    """An ``initializer`` for a ``ThreadPoolExecutor`` whose workers run heavy work: each worker raises its own
    nice to ``nice`` when it starts (``nice`` <= 0: the initializer does nothing)."""

    def init() -> None:
        lower_current_thread(nice)

    return init


def renice_threads(nice: int, keep: Iterable[int] = ()) -> int:
    """Raise the nice of every thread of this process (``/proc/self/task``) except those in ``keep`` (native ids)
    to ``nice``: for threads started before the setting took effect (torch's intra-op pool created from a
    thread at nice 0). Returns how many threads now run at >= ``nice``; 0 where ``/proc`` is missing."""
    if nice <= 0 or not _supported():
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError) as e:
        log.debug("cannot list this process's threads: %s", e)
        return 0
    skip = set(keep)
    return sum(_raise_nice(t, min(nice, 19)) for t in tids if t not in skip)
