"""Verified work that always runs (issue 28): a background worker with a compute budget.

A check of round ``r`` (:mod:`geomesh_p2p.trust.verify`) costs ``k + m`` forward/backward passes of the
contributor's batch: on a busy device that is often longer than what is left before round ``r + 1``
starts, and the first version skipped such checks (21 of 28 in a clean 4-peer run) or abandoned them at a
deadline, so whoever was drawn then went unchecked. Here a check is a *job* in :class:`CheckQueue`: one
daemon thread runs the jobs one at a time, in the background of the next rounds' inner steps, and paces
itself (:class:`Pacer`) so that it computes at most ``duty`` of the wall time: after each pass of ``t``
seconds it sleeps ``t x (1 - duty) / duty`` (on a CPU device ``t`` is the thread's CPU time: :class:`Pacer`). A check is never skipped or abandoned for being late: it ends
later, and its verdict is applied when it ends (:meth:`CheckQueue.results`, drained by the event loop).

Bounded: at most ``max_pending`` jobs wait. A job needs its round's kept start weights, which the
verifier keeps (pins) while a job of that round waits or runs; a new job past ``max_pending`` drops the
*oldest* waiting one, whose round is then released (counted in ``dropped``, with the reason logged). With
the draw budget (``VerifyConfig.share``, the mean compute drawn per round) below the duty cycle, the
worker keeps up on average (utilisation ``share / duty``, 0.67 by default), so a drop needs a burst of
draws: rare (docs/security.md, "Verified work").

Screening first (issue 28): jobs of the kinds in :data:`FIRST` (screening checks of newcomers and re-checks of
others' screening evidence: the loss-gain test alone, forward passes only) wait in a lane of their own that the
worker empties before it takes an ordinary check or re-check, under the same pacing (the same duty). That lane
holds at most ``max_screens`` jobs (past it the oldest waiting one is dropped, counted): how many there are
follows from the plans (a newcomer's first rounds, a few screeners each), not from what anyone publishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.model.turns import Turns

log = logging.getLogger(__name__)

__all__ = ["Pacer", "CheckJob", "CheckQueue", "CheckCounts", "QueueClosed", "FIRST", "SCREEN_PASSES_PER_STEP"]

#: Job kinds the worker runs before any other waiting job (screening checks and re-checks of screening evidence).
FIRST = frozenset({"screen", "rescreen"})

#: Check passes a :data:`FIRST`-lane job may run in a row before a waiting inner step on a CPU peer (others: 1, the
#: strict alternation of :class:`~geomesh_p2p.model.turns.Turns`). Session 42: a screen's worker got 0.12-0.19 CPU-s
#: a second on two loaded cores (a pass per step: ~1/4 of its process's compute), and the poisoner's verdict came
#: ~5 rounds after its round. The wall-time duty (``Pacer``) still bounds the worker over its window.
SCREEN_PASSES_PER_STEP = 3


class QueueClosed(RuntimeError):
    """The queue was closed while a job ran: raised at the job's next pace, so it stops there."""


class Pacer:
    """Keeps a thread's compute at ``duty`` of the wall time: call it between two units of work; it sleeps
    ``busy x (1 - duty) / duty`` where ``busy`` is the time since the last call returned (the work's time).

    ``stop``: an event that ends the sleeps early (the queue's close); ``clock`` (seconds) and ``sleep(s)``:
    how to read the time and wait (default: ``time.monotonic`` and ``stop.wait``; a test passes fakes).
    ``cpu_clock``: when given (a CPU device: ``time.thread_time`` of the worker thread, read in that thread),
    ``busy`` is the work's CPU seconds x ``cpu_threads`` (its intra-op threads), at most its wall time: on a CPU
    shared with the peer's own training (the same process, the GIL, other processes) a pass's wall time is mostly
    waiting for a core, and pacing on it spent the budget on waiting (session 16: a 48-pass screen counted ~5 s
    busy for well under 1 s of compute). A GPU device keeps wall time (its kernels run outside the thread).

    **Burst allowance** (session 19, ``window_s`` > 0): the duty is held over any ``window_s`` seconds rather than
    per pass: a pass is not paced while the worker's compute over the last ``window_s`` seconds (this pass
    included) stays at most ``duty x window_s``; past that it sleeps until it is back under (the oldest passes
    leave the window). So a round's screens run at once when the worker was quiet before (the swarm's first
    screens concluded 5-7 rounds after their round when every pass was paced at 15%), and every window of
    ``window_s`` seconds holds at most ``duty x window_s`` of the worker's compute plus one pass (the pacer acts
    after a pass; a pass is one batch); a stretch of ``T`` seconds at most ``duty x (T + window_s)`` plus one pass.
    ``window_s`` 0: every pass paced (the rule above).
    Raises ValueError unless ``0 < duty <= 1`` and ``window_s >= 0``."""

    def __init__(
        self,
        duty: float,
        stop: Optional[threading.Event] = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Optional[Callable[[float], Any]] = None,
        cpu_clock: Optional[Callable[[], float]] = None,
        cpu_threads: int = 1,
        window_s: float = 0.0,
        turns: Optional[Turns] = None,
    ):
        if not 0.0 < float(duty) <= 1.0:
            raise ValueError(f"duty={duty} must be in (0, 1]")
        if not float(window_s) >= 0.0:
            raise ValueError(f"window_s={window_s} must be >= 0")
        self.window_s = float(window_s)
        self._passes: deque[tuple[float, float]] = deque()  # (end time, compute seconds) of the window's passes
        self.duty = float(duty)
        self.stop = stop if stop is not None else threading.Event()
        self.clock = clock
        self.sleep = sleep if sleep is not None else self.stop.wait
        self.cpu_clock = cpu_clock
        self.cpu_threads = max(1, int(cpu_threads))
        #: the peer's :class:`~geomesh_p2p.model.turns.Turns`: each pass (from :meth:`start` or a pace to the next
        #: pace) holds the check's turn, so no inner step runs beside it (issue 27, session 39); None: no turns
        self.turns = turns
        self._since = clock()
        self._cpu_since = cpu_clock() if cpu_clock is not None else 0.0
        #: seconds computed and seconds slept so far
        self.busy_s = 0.0
        self.slept_s = 0.0

    def set_window(self, window_s: float) -> None:
        """Hold the duty over ``window_s`` seconds from now on (0: pace every pass)."""
        self.window_s = max(0.0, float(window_s))

    def _window_rest(self, now: float, busy: float) -> float:
        """Seconds to sleep after a pass of ``busy`` compute seconds ending at ``now`` so that the compute of the
        passes within the last ``window_s`` seconds is at most ``duty x window_s`` (the pass counts at its end)."""
        w = self.window_s
        self._passes.append((now, busy))
        while self._passes and self._passes[0][0] <= now - w:
            self._passes.popleft()
        over = sum(b for _, b in self._passes) - self.duty * w
        if over <= 0:
            return 0.0
        wait_until = now
        for end, b in self._passes:  # the oldest passes leave the window first (this one last: it always ends)
            over -= b
            wait_until = end + w
            if over <= 0:
                break
        return max(0.0, wait_until - now)

    def start(self) -> None:
        """Begin a unit of work now (a job starts; it takes the turn)."""
        if self.turns is not None:
            self.turns.take_check()
        self._since = self.clock()
        if self.cpu_clock is not None:
            self._cpu_since = self.cpu_clock()

    def __call__(self, last: bool = False) -> None:
        """Pace: sleep for the work since the last call (the turn given back meanwhile, taken again for the next pass
        unless ``last``). Raises :class:`QueueClosed` once ``stop`` is set."""
        if self.turns is not None:
            # The pass's activations were freed in this thread's malloc arena, which the steps' thread does not
            # reuse: returned to the OS before the steps go on, or the two arenas' peaks add up anyway (session 39)
            release_freed_memory()
        busy = max(0.0, self.clock() - self._since)
        if self.cpu_clock is not None:
            busy = min(busy, max(0.0, self.cpu_clock() - self._cpu_since) * self.cpu_threads)
        self.busy_s += busy
        if self.window_s > 0:
            rest = self._window_rest(self.clock(), busy)
        else:
            rest = busy * (1.0 - self.duty) / self.duty
        if self.turns is not None:  # a pass that follows at once keeps its place (Turns.passes_per_step)
            self.turns.give_check(again=not last and rest <= 0 and not self.stop.is_set())
        if self.stop.is_set():
            raise QueueClosed("the verified-work queue was closed")
        if rest > 0:
            t0 = self.clock()
            self.sleep(rest)
            self.slept_s += max(0.0, self.clock() - t0)
        if self.turns is not None and not last:
            self.turns.take_check()  # before the clocks are read: the wait for a step to end is not compute
        self._since = self.clock()
        if self.cpu_clock is not None:
            self._cpu_since = self.cpu_clock()


@dataclass
class CheckJob:
    """One job: ``run(pace)`` (blocking, in the worker; calls ``pace()`` between its passes) for ``round``.
    ``kind``: "check" (this node's own check) or "recheck" (another verifier's evidence); ``key``: what
    the caller names it by; ``due``: unix seconds by which the first version required it to end (the next
    round's start: it skipped or abandoned a check that would not), None: no such time (never late)."""

    round: int
    kind: str
    run: Callable[["Pacer"], Any]
    key: Any = None
    due: Optional[float] = None


@dataclass
class CheckCounts:
    """What the queue did, since it started. ``queued``: jobs accepted; ``done``: jobs that ended (a
    verdict or an outcome); ``late``: of those, the ones that ended after their ``due`` time (the first
    version skipped or abandoned every one of them); ``dropped``: jobs dropped before they ran, their round's
    weights released (queue full); ``failed``: jobs that raised; ``waiting``: jobs queued now (the running
    one included); ``busy_s`` / ``slept_s``: the worker's compute and pacing seconds."""

    queued: int = 0
    done: int = 0
    late: int = 0
    dropped: int = 0
    failed: int = 0
    waiting: int = 0
    busy_s: float = 0.0
    slept_s: float = 0.0
    by_kind: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-able (the round row's ``extra["verify"]``)."""
        return {
            "queued": self.queued,
            "done": self.done,
            "late": self.late,
            "dropped": self.dropped,
            "failed": self.failed,
            "waiting": self.waiting,
            "busy_s": round(self.busy_s, 3),
            "slept_s": round(self.slept_s, 3),
        }


class CheckQueue:
    """The background worker of verified work (see the module docstring).

    Args:
        duty: largest share of the wall time the worker computes (0 < duty <= 1).
        max_pending: jobs that may wait (besides the running one); a new one past it drops the oldest.
        on_drop: called with each dropped job (in the caller's thread), e.g. to release its round.
        pacer: the :class:`Pacer` (default: one at ``duty`` whose sleeps :meth:`close` cuts short).
        max_screens: jobs of the :data:`FIRST` kinds that may wait (their own lane, run first); None: ``max_pending``.
        stop: the event :meth:`close` sets (pass the one a custom ``pacer`` waits on, so that close cuts its sleeps).

    The worker thread starts on the first :meth:`submit` and ends at :meth:`close`.
    """

    def __init__(
        self,
        duty: float,
        max_pending: int,
        *,
        on_drop: Optional[Callable[[CheckJob], None]] = None,
        pacer: Optional[Pacer] = None,
        max_screens: Optional[int] = None,
        stop: Optional[threading.Event] = None,
    ):
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.max_pending = int(max_pending)
        self.max_screens = int(max_pending if max_screens is None else max_screens)
        if self.max_screens < 1:
            raise ValueError(f"max_screens={max_screens} must be >= 1")
        self._first: deque[CheckJob] = deque()  # the FIRST lane, run before _waiting
        self._stop = stop if stop is not None else threading.Event()
        self.pacer = pacer if pacer is not None else Pacer(duty, self._stop)
        self._on_drop = on_drop
        self._cond = threading.Condition()
        self._waiting: deque[CheckJob] = deque()
        self._running: Optional[CheckJob] = None
        self._done: deque[tuple[CheckJob, Any, Optional[BaseException]]] = deque()
        self._thread: Optional[threading.Thread] = None
        self.counts = CheckCounts()

    # -- the caller's side ----------------------------------------------------------------------------
    def submit(self, job: CheckJob) -> Optional[CheckJob]:
        """Queue ``job``; returns the job dropped to make room, or None: past ``max_pending`` the oldest waiting
        re-check, else the oldest waiting check, but never a check for a re-check (then ``job`` itself).

        Raises RuntimeError after :meth:`close`."""
        dropped = None
        with self._cond:
            if self._stop.is_set():
                raise RuntimeError("the verified-work queue is closed")
            if job.kind in FIRST:
                if len(self._first) >= self.max_screens:
                    # re-checks of others' screening evidence go first, then the oldest screen
                    dropped = next((j for j in self._first if j.kind != "screen"), None) or self._first[0]
                    if job.kind != "screen" and dropped.kind == "screen":
                        dropped = job  # a re-check never pushes out a screen of this node's own
                    if dropped is not job:
                        self._first.remove(dropped)
                    self.counts.dropped += 1
                if dropped is not job:
                    self._first.append(job)
                    self.counts.queued += 1
                    self.counts.by_kind[job.kind] = self.counts.by_kind.get(job.kind, 0) + 1
            elif len(self._waiting) >= self.max_pending:
                # Re-checks of others' evidence go first, the oldest first, and a new re-check never pushes out
                # a check of this node's own: anyone can publish evidence records (red team: junk records
                # re-queued every round dropped a peer's own checks).
                dropped = next((j for j in self._waiting if j.kind == "recheck"), None)
                if dropped is None:
                    dropped = job if job.kind == "recheck" else self._waiting[0]
                if dropped is not job:
                    self._waiting.remove(dropped)
                self.counts.dropped += 1
            if job.kind not in FIRST and dropped is not job:
                self._waiting.append(job)
                self.counts.queued += 1
                self.counts.by_kind[job.kind] = self.counts.by_kind.get(job.kind, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="geomesh-verify", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped is not None:
            log.info(
                "verified work: the %s of round %d was dropped before it ran: %d checks were waiting (its round's "
                "kept weights are released)",
                dropped.kind,
                dropped.round,
                self.max_screens if dropped.kind in FIRST else self.max_pending,
            )
            if self._on_drop is not None:
                self._on_drop(dropped)
        return dropped

    def promote(self, key: Any) -> bool:
        """Move the waiting :data:`FIRST`-lane job named ``key`` to the front of that lane (another screener's
        evidence about the same newcomer arrived: this node's own measurement of it settles that evidence for
        everyone here). True when one was waiting; a running or unknown one is left as it is."""
        with self._cond:
            job = next((j for j in self._first if j.key == key), None)
            if job is None:
                return False
            self._first.remove(job)
            self._first.appendleft(job)
            return True

    def results(self) -> list[tuple[CheckJob, Any, Optional[BaseException]]]:
        """The jobs that ended since the last call, oldest first: ``(job, its result, the exception it raised
        or None)``."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
        return out

    def rounds(self) -> set[int]:
        """Rounds with a job waiting or running (their kept weights must stay)."""
        with self._cond:
            out = {j.round for j in self._waiting} | {j.round for j in self._first}
            if self._running is not None:
                out.add(self._running.round)
        return out

    def snapshot(self) -> CheckCounts:
        """A copy of the counts, ``waiting`` and the pacer's seconds filled in."""
        with self._cond:
            c = CheckCounts(**{**self.counts.__dict__, "by_kind": dict(self.counts.by_kind)})
            c.waiting = len(self._waiting) + len(self._first) + (self._running is not None)
        c.busy_s, c.slept_s = self.pacer.busy_s, self.pacer.slept_s
        return c

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job waits or runs (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._first or self._running is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: waiting jobs are dropped (not counted), the running one ends at its next pace (the
        pacer's sleep is cut short and it raises :class:`QueueClosed`). Safe to call twice."""
        with self._cond:
            self._stop.set()
            self._waiting.clear()
            self._first.clear()
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # -- the worker -----------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._first and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                job = self._running = (self._first or self._waiting).popleft()
            result, error = None, None
            turns = getattr(self.pacer, "turns", None)
            if turns is not None:
                turns.passes_per_step = SCREEN_PASSES_PER_STEP if job.kind in FIRST else 1
            self.pacer.start()
            try:
                result = job.run(self.pacer)
            except Exception as e:  # noqa: BLE001  a job's failure is reported with its result, never ends the worker
                error = e
            except BaseException:
                # what ends the thread (SystemExit, a cancellation) ends it without the turn: else the inner steps
                # wait for ever for the pass it held (red team 39)
                if turns is not None:
                    turns.give_check()
                raise
            try:
                self.pacer(last=True)  # the rest of the job's compute is paced too (and the turn given back)
            except QueueClosed:
                pass
            with self._cond:
                self._running = None
                if self._stop.is_set():  # closed while it ran: nothing reported
                    self._cond.notify_all()
                    return
                if error is not None:
                    self.counts.failed += 1
                else:
                    self.counts.done += 1
                    if job.due is not None and time.time() > job.due:
                        self.counts.late += 1
                self._done.append((job, result, error))
                self._cond.notify_all()
