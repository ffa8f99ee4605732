"""Turns between a peer's inner steps and verified work's check passes (issue 27, session 39).

The background checks ran beside the inner steps: at ``gpt2-124m`` the peak RSS of a peer (2.0x the method's
minimum) was a training step's activations and a check pass's activations at once, on top of the state. On a CPU
peer both compete for the same cores anyway (a check's compute was taken from the steps), so taking turns costs
the steps no throughput there: a step does not start while a check pass runs, a pass does not start while a step
runs, and when both wait they alternate (a pass waits at most one step, a step at most one pass: a check in a
burst, its passes back to back, cost a round all its steps but one when the steps could not get in between). The
passes stay paced by the
verifier's :class:`~geomesh_p2p.trust.verify_queue.Pacer` (which asks for the turn after its sleep and gives it
back before the next).
"""

from __future__ import annotations

import contextlib
import threading
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
        #: passes that had to wait for a step to end (diagnostics, tests)
        self.check_waited = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the turn for one inner step; waits while a check pass runs, or for the pass that waits after a step."""
        with self._cv:
            self._step_waits += 1
            while self._checking or (self._check_waits and self._last == "step"):
                self._cv.wait()
            self._step_waits -= 1
            self._stepping += 1
            self._last = "step"
        try:
            yield
        finally:
            with self._cv:
                self._stepping -= 1
                self._cv.notify_all()

    def take_check(self) -> None:
        """Before a check pass: wait for the step under way, if any, to end (and for the step that waits after a
        pass). Taking it while held is a no-op."""
        with self._cv:
            if self._checking:
                return
            self._check_waits = True
            if self._stepping:
                self.check_waited += 1
            while self._stepping or (self._step_waits and self._last == "check"):
                self._cv.wait()
            self._check_waits = False
            self._checking = True
            self._last = "check"

    def give_check(self) -> None:
        """After a check pass (idempotent): the steps go on."""
        with self._cv:
            self._checking = False
            self._cv.notify_all()

    @property
    def checking(self) -> bool:
        """A check pass holds the turn."""
        with self._cv:
            return self._checking
