"""The round's outer step and commit hold the trainer's turns (issue 27, session 45): no check pass of verified work
starts beside them (:meth:`geomesh_p2p.model.turns.Turns.hold`), and the turns are free again once they end."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.model.turns import Turns
from geomesh_p2p.round import finish

pytestmark = pytest.mark.timeout(30)


class _State:
    """A state port that notes, in each call, whether a check pass could start (the turns held)."""

    state_lock = None

    def __init__(self, turns: Turns):
        self.turns, self.seen, self.digest = turns, [], None

    def outer_step(self, r, plan, aggregate, idle=()):
        self.seen.append(("outer_step", r, self.turns._holding))

    def commit(self, round):
        self.seen.append(("commit", round, self.turns._holding))
        self.digest = f"{round:032x}"
        return self.digest


def _driver(trainer) -> SimpleNamespace:
    phases: dict = {}
    return SimpleNamespace(
        state=_State(getattr(trainer, "turns", None) or Turns()),
        trainer=trainer,
        _spec=None,
        add_phase_s=lambda name, s, c=0.0: phases.__setitem__(name, phases.get(name, 0.0) + s),
    )


def test_the_outer_step_and_commit_run_with_the_turns_held_then_a_pass_may_start():
    trainer = SimpleNamespace(turns=Turns())
    drv = _driver(trainer)
    finish.advance(drv, 4, None, torch.zeros(3), ())
    assert drv.state.seen == [("outer_step", 4, 1), ("commit", 5, 1)]
    assert trainer.turns._holding == 0
    got = threading.Event()
    t = threading.Thread(target=lambda: (trainer.turns.take_check(), got.set()))
    t.start()
    t.join(10)
    assert got.is_set() and trainer.turns.checking  # free again: the next pass takes the turn at once


def test_a_trainer_without_turns_is_stepped_as_before():
    drv = _driver(SimpleNamespace())  # e.g. the tests' fakes: no CheckHolder
    finish.advance(drv, 0, None, torch.zeros(3), ())
    assert [s[:2] for s in drv.state.seen] == [("outer_step", 0), ("commit", 1)]
