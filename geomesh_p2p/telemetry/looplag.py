"""Event-loop lag monitor (issue 13): how long the asyncio loop was unable to run a task.

A peer serves its parts, its state and the DHT from one event loop; any heavy work left on the loop
thread (hashing, encoding, tensor math over the model) stalls all of them at once. The monitor is a
task that sleeps ``interval_s`` and measures how late it wakes: the lateness is the loop's stall
(a stall of ``d`` seconds shows as a wake-up ``~d`` late). The node reports the worst stall of every
round (``RoundRecord.loop_stall_ms``, the round log, ``--log-json`` and Prometheus).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Measures the event loop's stalls: an owned task that sleeps ``interval_s`` seconds and records how
    late it woke (``time.perf_counter``).

    Usage: ``m = LoopLagMonitor(); m.start()`` on the running loop; ``m.take_worst()`` once per round
    (seconds, the worst lateness since the previous call; resets); ``await m.stop()`` on shutdown (the
    task is cancelled and awaited). Lateness below the loop's scheduling noise (~1 ms) is normal.

    Attributes:
        interval_s: sleep between wake-ups, seconds (smaller: finer, at a few µs of loop time each).
        worst_ever: the worst lateness seen since :meth:`start`, seconds.
        samples: wake-ups measured since :meth:`start`.
    """

    def __init__(self, interval_s: float = 0.02):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self.worst_ever = 0.0
        self.samples = 0
        self._worst = 0.0
        self._task: Optional[asyncio.Task] = None
        self._tick: Optional[asyncio.Event] = None  # set (and replaced) at each wake-up

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the monitoring task on the running loop (idempotent). Raises RuntimeError outside a loop."""
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-monitor")

    async def _run(self) -> None:
        clock = time.perf_counter
        while True:
            due = clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = max(0.0, clock() - due)
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
        """Cancel the monitoring task and wait for it to end (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # wait() does not raise the task's CancelledError (only a cancel of the caller propagates)
        await asyncio.wait({task})
