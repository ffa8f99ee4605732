"""Turns between a peer's inner steps and verified work's check passes (issue 27, session 39).

The background checks ran beside the inner steps: at ``gpt2-124m`` the peak RSS of a peer (2.0x the method's
minimum) was a training step's activations and a check pass's activations at once, on top of the state. On a CPU
peer both compete for the same cores anyway (a check's compute was taken from the steps), so taking turns costs
the steps no throughput there: a step does not start while a check pass runs, a pass does not start while a step
runs, and when both wait they alternate (a pass waits at most one step, a step at most one pass: a check in a
burst, its passes back to back, cost a round all its steps but one when the steps could not get in between). A job
may take up to ``passes_per_step`` passes in a row before a waiting step (session 43: a newcomer's screen, 3; the
step still goes after them, so neither side waits for ever). The passes stay paced by the
verifier's :class:`~geomesh_p2p.trust.verify_queue.Pacer` (which asks for the turn after its sleep and gives it
back before the next).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

__all__ = ["Turns"]


class Turns:
    """One peer's alternation of inner steps (:meth:`step`) and check passes (:meth:`take_check` /
    :meth:`give_check`). Thread-safe; a step and a pass never overlap."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._stepping = 0  # steps running (one trainer: 0 or 1)
        self._checking = False
        self._check_waits = False
        self._step_waits = 0
        self._last = ""  # "step" or "check": who went last (the other goes first when both wait)
        #: check passes in a row that may go before a waiting step (1: strict alternation). The verified-work queue
        #: sets it per job: a newcomer's screen gets more of the peer's compute than a sampled check (session 43)
        self.passes_per_step = 1
        self._run = 0  # check passes since the last step
        self._holding = 0  # hold() blocks under way (the round's outer step and commit): no pass starts
        #: passes that had to wait for a step to end (diagnostics, tests)
        self.check_waited = 0
        #: wall seconds check passes waited for the turn (a step, a hold, the steps' share; session 47: where a
        #: screen's latency goes, the queue's per-job log line)
        self.check_wait_s = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the turn for one inner step; waits while a check pass runs, or for the pass that waits after a step."""
        with self._cv:
            self._step_waits += 1
            while self._checking or (self._check_waits and self._ahead()):
                self._cv.wait()
            self._step_waits -= 1
            self._stepping += 1
            self._last = "step"
            self._run = 0
        try:
            yield
        finally:
            with self._cv:
                self._stepping -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep new check passes out for the block (a pass under way goes on: this never waits). For the round's
        outer step and commit, the critical path between the exchange and the next round (issue 27, session 45):
        a pass that started beside them (a forward and backward of the whole model, ~0.8 s at ``gpt2-124m``) took
        ~0.1-0.2 s of each round's outer step and digest on a peer's core."""
        with self._cv:
            self._holding += 1
        try:
            yield
        finally:
            with self._cv:
                self._holding -= 1
                self._cv.notify_all()

    def take_check(self) -> None:
        """Before a check pass: wait for the step under way, if any, to end (and for the step that waits after a
        pass), and for a :meth:`hold` to end. Taking it while held is a no-op."""
        with self._cv:
            if self._checking:
                return
            self._check_waits = True
            if self._stepping:
                self.check_waited += 1
            t0 = time.monotonic()
            while (
                self._stepping
                or self._holding
                or (self._step_waits and self._last == "check" and self._run >= self.passes_per_step)
            ):
                self._cv.wait()
            self.check_wait_s += time.monotonic() - t0
            self._check_waits = False
            self._checking = True
            self._last = "check"
            self._run += 1

    def give_check(self, again: bool = False) -> None:
        """After a check pass (idempotent): the steps go on, unless ``again`` (the job's next pass follows at once)
        and the job has passes in a row left (``passes_per_step``): then the next pass is already waiting, and a
        waiting step goes after it (else the step that wakes first would take the turn between two passes)."""
        with self._cv:
            self._checking = False
            # (one check thread: when it gives the turn back it is not waiting for it, so this is its only claim)
            self._check_waits = bool(again and self._run < self.passes_per_step)
            self._cv.notify_all()

    def _ahead(self) -> bool:
        """A waiting check pass goes before a waiting step: after a step, or within its passes in a row."""
        return self._last == "step" or (self._last == "check" and self._run < self.passes_per_step)

    @property
    def checking(self) -> bool:
        """A check pass holds the turn."""
        with self._cv:
            return self._checking
