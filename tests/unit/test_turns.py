"""A CPU peer's inner steps and verified work's check passes take turns (issue 27, session 39): never both at once
(their activations were the peak RSS together), and a pass that asks is not overtaken by the steps."""

from __future__ import annotations

import threading

import pytest

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.model.turns import Turns
from geomesh_p2p.trust.verify_queue import Pacer

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


class _Log:
    """Who holds the turn, as events: an overlap is a step entered while a pass runs or the reverse."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.step = self.check = 0
        self.overlaps = 0
        self.events: list[str] = []

    def enter(self, kind: str) -> None:
        with self.mu:
            setattr(self, kind, getattr(self, kind) + 1)
            self.overlaps += int(self.step > 0 and self.check > 0)
            self.events.append(kind)

    def leave(self, kind: str) -> None:
        with self.mu:
            setattr(self, kind, getattr(self, kind) - 1)


def test_steps_and_check_passes_never_overlap_and_a_pass_is_not_overtaken():
    turns, log = Turns(), _Log()
    stop = threading.Event()
    steps = 0

    def train() -> None:
        nonlocal steps
        while not stop.is_set():
            with turns.step():
                log.enter("step")
                sum(range(20000))  # a little work
                log.leave("step")
            steps += 1

    t = threading.Thread(target=train)
    t.start()
    try:
        for _ in range(50):  # each pass gets its turn although the steps run back to back
            turns.take_check()
            log.enter("check")
            assert turns.checking
            sum(range(20000))
            log.leave("check")
            turns.give_check()
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive() and log.overlaps == 0 and log.events.count("check") == 50 and steps > 0


def test_the_pacer_holds_the_turn_through_a_pass_and_gives_it_back_at_the_last_pace():
    turns = Turns()
    pacer = Pacer(1.0, turns=turns)
    pacer.start()
    assert turns.checking  # a pass runs
    pacer()
    assert turns.checking  # between two passes: given back, then taken again for the next
    pacer(last=True)
    assert not turns.checking
    with turns.step():  # the steps go on
        pass


def test_a_trainers_steps_wait_for_the_pass_under_way():
    ds = load_dataset(None, 32)
    tr = InnerTrainer(build_model("tiny", vocab_size=ds.vocab_size, seed=0), ds, seq_len=32)
    log = _Log()
    inner = tr.turns.step

    class Recorded:
        def __enter__(self):
            self.cm = inner()
            self.cm.__enter__()
            log.enter("step")

        def __exit__(self, *exc):
            log.leave("step")
            return self.cm.__exit__(*exc)

    tr.turns.step = Recorded  # type: ignore[method-assign]
    done = threading.Event()

    def checker() -> None:
        while not done.is_set():
            tr.turns.take_check()
            log.enter("check")
            sum(range(50000))
            log.leave("check")
            tr.turns.give_check()

    c = threading.Thread(target=checker)
    c.start()
    try:
        res = tr.run(round=0, inner_steps=4, batch_size=2)
    finally:
        done.set()
        c.join(10)
    assert res.steps_done == 4 and log.events.count("step") == 4 and log.overlaps == 0


def test_a_pass_given_back_and_taken_again_lets_the_waiting_step_in_first():
    """A check in a burst (no sleep between its passes) gave the turn back and took it again before the waiting
    trainer woke: a round trained 1 of 18 steps (session 39's first measurement). When both wait they alternate."""
    turns = Turns()
    turns.take_check()
    stepped = threading.Event()

    def one_step() -> None:
        with turns.step():
            stepped.set()

    t = threading.Thread(target=one_step)
    t.start()
    for _ in range(1000):  # until the step waits for the turn
        with turns._cv:
            if turns._step_waits:
                break
        stepped.wait(0.01)
    assert turns._step_waits == 1 and not stepped.is_set()
    turns.give_check()
    turns.take_check()  # at once, as the next pass of a burst: after the waiting step
    assert stepped.is_set()
    turns.give_check()
    t.join(10)
    assert not t.is_alive()


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_screen_takes_up_to_passes_per_step_passes_before_a_waiting_step(per_step):
    """Session 43: a newcomer's screen may run ``passes_per_step`` passes in a row (``verify_queue``: 3 for the
    screening lane) before a waiting step, then the step goes; 1 is the strict alternation. Passes given back with
    ``again`` keep their place; the steps still run between the bursts (neither side waits for ever)."""
    turns, log = Turns(), _Log()
    turns.passes_per_step = per_step
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            with turns.step():
                log.enter("step")
                sum(range(20000))
                log.leave("step")

    turns.take_check()  # the screen holds the turn when the trainer starts asking
    t = threading.Thread(target=train)
    t.start()
    try:
        for _ in range(1000):  # until the step waits for the turn
            with turns._cv:
                if turns._step_waits:
                    break
            stop.wait(0.01)
        for i in range(30):  # back to back, as the pacer runs a screen with budget left
            if i:
                turns.take_check()
            log.enter("check")
            sum(range(20000))
            log.leave("check")
            turns.give_check(again=i < 29)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive() and log.overlaps == 0
    ev = [e for e in log.events if e in ("check", "step")]
    first_step = ev.index("step")
    runs, n = [], 0
    for e in ev[: ev.index("check", first_step) + 40]:
        if e == "check":
            n += 1
        elif n:
            runs.append(n)
            n = 0
    # every burst of passes between two steps is at most per_step long (the first one: the pass held at the start
    # plus per_step - 1 more), and a step comes after each
    assert runs and max(runs) <= per_step and runs.count(per_step) >= len(runs) - 1, runs


def _until(cond) -> None:
    """Wait (bounded) until ``cond()``: another thread reached its wait."""
    for _ in range(2000):
        if cond():
            return
        threading.Event().wait(0.005)
    raise AssertionError("the other thread never got there")


def test_a_hold_keeps_new_passes_out_and_never_waits_for_the_pass_under_way():
    # Issue 27 (session 45): the round's outer step and commit hold the turns; a pass that started before goes on
    turns, order = Turns(), []
    turns.take_check()  # a pass under way
    with turns.hold():  # entered at once all the same
        order.append("held")
        turns.give_check()

        def check() -> None:
            turns.take_check()
            order.append("pass")
            turns.give_check()

        t = threading.Thread(target=check)
        t.start()
        _until(lambda: turns._check_waits)  # the next pass asks for the turn while the hold lasts
        order.append("hold ends")
    t.join(10)
    assert not t.is_alive() and order == ["held", "hold ends", "pass"]
    # holds nest: the pass waits for the outer one
    with turns.hold():
        with turns.hold():
            pass
        t = threading.Thread(target=check)
        t.start()
        _until(lambda: turns._check_waits)
        order.append("outer hold ends")
    t.join(10)
    assert order[3:] == ["outer hold ends", "pass"]
    with turns.step():  # a hold does not touch the steps' side
        pass
