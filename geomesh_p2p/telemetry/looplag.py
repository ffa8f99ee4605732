"""Event-loop lag monitor (issue 13): how long the asyncio loop was unable to run a task.

A peer serves its parts, its state and the DHT from one event loop; any heavy work left on the loop
thread (hashing, encoding, tensor math over the model) stalls all of them at once. The monitor is a
task that sleeps ``interval_s`` and measures how late it wakes: the lateness is the loop's stall
(a stall of ``d`` seconds shows as a wake-up ``~d`` late). The node reports the worst stall of every
round (``RoundRecord.loop_stall_ms``, the round log, ``--log-json`` and Prometheus).

Where a stall comes from (issue 27: 0.9-1.4 s stalls at real size, not attributed): a watcher thread samples the
loop thread's stack every ``interval_s`` while a stall lasts past ``trace_after_s`` (``sys._current_frames``) and,
once it ends, logs one INFO line: how long, how much of it the loop thread itself ran (its CPU clock,
``pthread_getcpuclockid``), and its most sampled locations, each marked "ran" (the thread computed there: code on
the loop thread) or "waited" (it did not: a CPU or the GIL taken by other threads, or a blocking call), and how much
of it Python's cyclic garbage collector ran (in any thread: it holds the GIL; :class:`GcClock`). A full collection
over a peer's ~418,000 start-up objects took 234 ms on this machine; ``geomesh-peer join`` freezes them once its model
is built (:func:`geomesh_p2p.util.exit_gc.freeze_startup_heap`).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Optional

__all__ = ["LoopLagMonitor", "GcClock", "gc_clock", "stack_summary", "monitor_from_env", "TRACE_ENV"]

log = logging.getLogger(__name__)

#: Innermost frames a stall's location names.
STALL_FRAMES = 4
#: Environment variable for a diagnostic run: the stall length (milliseconds) from which the node's monitor locates and
#: logs a stall (default 250 ms), every such stall at INFO, the host-busy ones too (:func:`monitor_from_env`)
TRACE_ENV = "GEOMESH_LOOPLAG_TRACE_MS"
#: A stall sampled only in the loop's selector is logged at DEBUG when the loop thread ran less than this share of it
#: (it waited for a CPU or the GIL), else at INFO
OWN_CODE_SHARE = 0.25


def stack_summary(frame, frames: int = STALL_FRAMES) -> str:
    """``file:line function`` of the innermost ``frames`` frames of ``frame``'s stack, innermost first, joined
    by `` < `` (file names relative to their package folder)."""
    out = []
    for fs in reversed(traceback.extract_stack(frame)[-frames:]):
        parts = fs.filename.replace(os.sep, "/").split("/")
        out.append(f"{'/'.join(parts[-2:])}:{fs.lineno} {fs.name}")
    return " < ".join(out)


def _threads_cpu() -> dict[int, float]:
    """CPU seconds of every live Python thread, by ident (threads without a readable clock left out)."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError, ValueError):
            pass
    return out  # type: ignore[return-value]


class GcClock:
    """Seconds Python's cyclic garbage collector has run in this process since :meth:`install` (all threads and
    generations; ``gc.callbacks``), and collections by generation. Install once per process (idempotent).
    Thread-safe enough for a reader: floats are replaced, never half-written, under the GIL."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = [0, 0, 0]
        self._started: Optional[float] = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None
            g = info.get("generation", 2)
            if 0 <= g < 3:
                self.collections[g] += 1

    def now_s(self) -> float:
        """:attr:`total_s` plus a collection under way."""
        started = self._started
        return self.total_s + (time.perf_counter() - started if started is not None else 0.0)


#: the process's one :class:`GcClock` (installed by the first :meth:`LoopLagMonitor.start`)
gc_clock = GcClock()


class _Stall:
    """One stall as the watcher samples it: the monitor's wake-up before it, the loop thread's CPU seconds then and
    at the last sample, every thread's CPU seconds just before it (``base``), and the samples per
    ``(stack summary, ran)``."""

    __slots__ = ("last", "start_cpu", "prev_cpu", "cpu", "blocked", "samples", "base", "gc_s")

    def __init__(self, last: float, start_cpu: float, base: dict[int, float], gc_s: float = 0.0) -> None:
        self.last, self.start_cpu, self.prev_cpu, self.base = last, start_cpu, start_cpu, base
        self.gc_s = gc_s  # gc_clock at the last wake-up before the stall
        self.cpu: Optional[float] = None
        self.blocked = 0.0
        self.samples: collections.Counter = collections.Counter()


def monitor_from_env() -> "LoopLagMonitor":
    """The node's monitor: stalls located from 250 ms, or from :data:`TRACE_ENV` milliseconds (> 0) for a diagnostic
    run, whose located stalls are all logged at INFO. A value that is not a positive number: the default, with a
    WARNING."""
    raw = os.environ.get(TRACE_ENV, "").strip()
    if not raw:
        return LoopLagMonitor()
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not (ms > 0 and ms < float("inf")):
        log.warning("%s=%r is not a positive number of milliseconds: stalls located from 250 ms", TRACE_ENV, raw[:40])
        return LoopLagMonitor()
    return LoopLagMonitor(trace_after_s=ms / 1000.0, all_at_info=True)


class LoopLagMonitor:
    """Measures the event loop's stalls: an owned task that sleeps ``interval_s`` seconds and records how
    late it woke (``time.perf_counter``).

    Usage: ``m = LoopLagMonitor(); m.start()`` on the running loop; ``m.take_worst()`` once per round
    (seconds, the worst lateness since the previous call; resets); ``await m.stop()`` on shutdown (the
    task is cancelled and awaited). Lateness below the loop's scheduling noise (~1 ms) is normal.

    Attributes:
        interval_s: sleep between wake-ups, seconds (smaller: finer, at a few µs of loop time each).
        trace_after_s: a stall this long (seconds) is located: the watcher thread logs the loop thread's innermost
            frames once per stall (INFO) and keeps them in :attr:`stalls`; None: no watcher thread.
        worst_ever: the worst lateness seen since :meth:`start`, seconds.
        samples: wake-ups measured since :meth:`start`.
        stalls: the last 32 located stalls once they ended, ``(seconds blocked at the last sample, seconds of it
            the loop thread ran or None where unknown, [(samples, "ran" or "waited", stack summary)] most sampled
            first, at most 3, [(CPU seconds, name)] of the other Python threads that ran most meanwhile, at most 2,
            seconds Python's garbage collector ran meanwhile (any thread; it holds the GIL))``.
    Raises ValueError for ``interval_s <= 0`` or ``trace_after_s <= 0``.
    """

    def __init__(self, interval_s: float = 0.02, trace_after_s: Optional[float] = 0.25, all_at_info: bool = False):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if trace_after_s is not None and not trace_after_s > 0:
            raise ValueError(f"trace_after_s must be > 0 or None, got {trace_after_s}")
        self.interval_s = float(interval_s)
        self.trace_after_s = trace_after_s
        #: log every located stall at INFO (a diagnostic run), not the host-busy ones at DEBUG
        self.all_at_info = bool(all_at_info)
        self.worst_ever = 0.0
        self.samples = 0
        self.stalls: collections.deque = collections.deque(maxlen=32)
        self._worst = 0.0
        self._task: Optional[asyncio.Task] = None
        self._tick: Optional[asyncio.Event] = None  # set (and replaced) at each wake-up
        self._last = 0.0  # perf_counter of the last wake-up
        self._last_cpu = 0.0  # the loop thread's CPU seconds (time.thread_time) at the last wake-up
        self._loop_thread: Optional[int] = None
        self._watch: Optional[threading.Thread] = None
        self._watch_stop = threading.Event()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the monitoring task on the running loop (idempotent). Raises RuntimeError outside a loop."""
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-monitor")
        self._last_cpu = time.thread_time()
        self._last = time.perf_counter()
        if self.trace_after_s is not None and self._watch is None:
            self._loop_thread = threading.get_ident()
            self._watch_stop.clear()
            gc_clock.install()
            self._watch = threading.Thread(target=self._watch_loop, name="loop-lag-watch", daemon=True)
            self._watch.start()

    def _watch_loop(self) -> None:
        """The watcher thread: samples the loop thread's stack every ``interval_s`` while a stall lasts (from two
        intervals on), and reports a stall that lasted ``trace_after_s`` once it ends (:meth:`_report`)."""
        assert self.trace_after_s is not None and self._loop_thread is not None
        stall: Optional[_Stall] = None
        base: dict[int, float] = {}  # every Python thread's CPU seconds at the last wake-up outside a stall
        gc_base = gc_clock.now_s()  # the garbage collector's seconds then
        while not self._watch_stop.wait(self.interval_s):
            last = self._last
            if stall is not None and stall.last != last:  # the loop ran the monitor again: the stall ended
                if stall.blocked >= self.trace_after_s:
                    self._report(stall, _threads_cpu())
                stall = None
            blocked = time.perf_counter() - last - self.interval_s
            # sampled from two intervals on, so that a long stall's samples cover most of it; reported only past
            # trace_after_s
            if blocked < 2 * self.interval_s:
                if stall is None:
                    base, gc_base = _threads_cpu(), gc_clock.now_s()
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            where = stack_summary(frame)
            del frame  # no reference cycle through the loop thread's frames
            cpu = self._thread_cpu()
            if stall is None:
                stall = _Stall(last, self._last_cpu, base, gc_base)
            # a sample is "ran" when the loop thread computed for at least a fifth of the interval since the last one
            ran = cpu is not None and cpu - stall.prev_cpu >= 0.2 * self.interval_s
            if cpu is not None:
                stall.prev_cpu = cpu
                stall.cpu = cpu
            stall.samples[(where, ran)] += 1
            stall.blocked = blocked

    def _report(self, stall: "_Stall", now_cpu: dict[int, float]) -> None:
        """One INFO line and one :attr:`stalls` entry for a stall that ended: its length, the loop thread's CPU
        seconds in it, its most sampled locations, each as ran (computing there) or waited (for a CPU, the GIL,
        or a blocking call), and the other Python threads that ran most meanwhile (one of them held the GIL when
        the loop thread waited for it; a thread that ended before the report is not seen)."""
        ran = None if stall.cpu is None else max(0.0, min(stall.blocked, stall.cpu - stall.start_cpu))
        top = [(n, "ran" if r else "waited", w) for (w, r), n in stall.samples.most_common(3)]
        names = {t.ident: t.name for t in threading.enumerate()}
        others = sorted(
            (
                (now_cpu[i] - stall.base.get(i, 0.0), names.get(i, str(i)))  # a thread started meanwhile: from 0
                for i in now_cpu
                if i not in (self._loop_thread, threading.get_ident())
            ),
            reverse=True,
        )
        busy = [(round(c, 3), name) for c, name in others[:2] if c >= 0.05 * stall.blocked]
        in_gc = max(0.0, min(stall.blocked, gc_clock.now_s() - stall.gc_s))
        self.stalls.append((stall.blocked, ran, top, busy, in_gc))
        spent = "" if ran is None else f" (its thread ran {ran * 1e3:.0f} ms of them)"
        if in_gc >= 0.001:
            spent += f" (the garbage collector ran {in_gc * 1e3:.0f} ms of them)"
        where = "; ".join(f"{n}x {state} in {w}" for n, state, w in top)
        meanwhile = "".join(f"; thread {name!r} ran {c * 1e3:.0f} ms" for c, name in busy)
        # DEBUG when the loop thread was idle in its own selector and barely ran: the host was busy (it waited for a
        # CPU or the GIL), nothing on the loop blocked it; the row's loop_stall_ms still counts it (fresh-user trial,
        # session 29: 57-67 such INFO lines a peer in 8 minutes at load 9-20). INFO otherwise: a blocking call or
        # code on the loop is something to fix in this process.
        idle = bool(top) and all("selectors.py" in w for _, _, w in top)
        # (the collector is this process's own work wherever it ran: INFO)
        quiet = (
            idle and ran is not None and ran < OWN_CODE_SHARE * stall.blocked and in_gc < OWN_CODE_SHARE * stall.blocked
        )
        level = logging.DEBUG if quiet and not self.all_at_info else logging.INFO
        log.log(level, "event loop blocked for %.0f ms%s: %s%s", stall.blocked * 1e3, spent, where, meanwhile)

    def _thread_cpu(self) -> Optional[float]:
        """The loop thread's CPU seconds (Linux and other POSIX systems with per-thread clocks), else None."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._loop_thread))  # type: ignore[arg-type]
        except (AttributeError, OSError, TypeError, ValueError):
            return None

    async def _run(self) -> None:
        clock = time.perf_counter
        while True:
            due = clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._last_cpu = time.thread_time()
            self._last = clock()
            late = max(0.0, self._last - due)
            self.samples += 1
            if late > self._worst:
                self._worst = late
            if late > self.worst_ever:
                self.worst_ever = late
            tick, self._tick = self._tick, asyncio.Event()
            if tick is not None:
                tick.set()

    async def wait_samples(self, n: int = 1) -> None:
        """Wait until the monitor has measured ``n`` more wake-ups (tests, and callers that want a
        measurement covering the present moment). Raises RuntimeError when it is not running."""
        for _ in range(n):
            if not self.running:
                raise RuntimeError("the loop-lag monitor is not running")
            if self._tick is None:
                self._tick = asyncio.Event()
            await self._tick.wait()

    def take_worst(self) -> float:
        """The worst stall (seconds) since the previous call (or :meth:`start`); resets it to 0.

        A stall still in progress is not seen until the loop runs the monitor again: call it from the
        loop (the node does, at the end of each round)."""
        worst, self._worst = self._worst, 0.0
        return worst

    async def stop(self) -> None:
        """Cancel the monitoring task and wait for it to end, and end the watcher thread (idempotent)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            self._watch_stop.set()
            await asyncio.to_thread(watch.join, 5.0)
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # wait() does not raise the task's CancelledError (only a cancel of the caller propagates)
        await asyncio.wait({task})
