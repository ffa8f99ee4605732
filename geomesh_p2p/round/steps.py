"""This peer's inner steps of a plan (in a worker thread: the trainer port), a non-finite loss turned into a
zero contribution, and the live progress line. Used by the TRAIN phase, by the steps started during the
plan's settle and by eager updates' speculative steps."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch

from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.plan.views import plan_floor_grace_s
from geomesh_p2p.round.rules.spec import screen_token_floor
from geomesh_p2p.telemetry import events
from geomesh_p2p.round.context import RoundContext, no_work
from geomesh_p2p.round.ports import EagerStatePort

if TYPE_CHECKING:
    from geomesh_p2p.model.training import InnerResult
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")


async def inner_steps(
    drv: RoundDriver, ctx: RoundContext, plan: RoundPlan, abort: Optional[threading.Event] = None
) -> tuple[Optional[torch.Tensor], InnerResult]:
    """This peer's inner steps of ``plan`` in a worker thread, until the plan's train deadline, a stop
    request (once the token floor's steps are done: :func:`stop_after_floor`) or ``abort``; ddp: one batch's
    gradient. Returns ``(grad or None, InnerResult)``; a non-finite loss gives ``(None, no_work(...))`` and the
    model back at the global weights."""
    r = ctx.round
    a = plan.assignment(drv.me)
    say_assignment(drv, plan, a.inner_steps, a.batch_size)
    t_train = time.perf_counter()
    try:
        if drv.cfg.exchanges_gradient:
            return await asyncio.to_thread(
                lambda: drv.trainer.gradient(round=r, batch_size=a.batch_size, micro_batch=a.micro_batch)
            )
        k = floor_steps(drv, plan, a)
        done = StepsDone(progress_printer(r, a.inner_steps))
        stop = stop_after_floor(drv, done, k)
        should_stop = stop if abort is None else (lambda: stop() or abort.is_set())
        # only where the round has a floor for this peer: a trainer (a test's fake) may lack the two arguments
        run = (
            functools.partial(drv.trainer.run, floor_steps=k, floor_grace_s=floor_grace_s(plan))
            if k
            else drv.trainer.run
        )
        return None, await asyncio.to_thread(
            lambda: run(
                round=r,
                inner_steps=a.inner_steps,
                batch_size=a.batch_size,
                micro_batch=a.micro_batch,
                deadline=plan.train_deadline,
                should_stop=should_stop,
                progress=done,
            )
        )
    except FloatingPointError as e:
        # The global weights give a non-finite loss (e.g. a hostile update blew them up): this peer has
        # nothing sound to contribute this round, but it keeps serving and following the swarm.
        say_loss_not_finite(drv, r, e)
        await reset_to_start(drv, ctx)
        return None, no_work(time.perf_counter() - t_train)
    except MemoryError as e:
        # ddp's one gradient did not fit even at micro-batch 1 (inner steps contribute the steps done
        # instead: InnerTrainer.run): nothing to contribute this round; the peer keeps following the swarm.
        say_contributing_nothing(drv, r, e, "out_of_memory")
        await reset_to_start(drv, ctx)
        return None, no_work(time.perf_counter() - t_train)


def floor_steps(drv: RoundDriver, plan: RoundPlan, a) -> int:
    """Inner steps this peer's contribution to ``plan`` must carry to count (its token floor over its batch's
    tokens, :func:`~geomesh_p2p.round.rules.spec.screen_token_floor`); 0 where the round has no floor for it."""
    tokens = screen_token_floor(plan, drv.cfg.push_encoding).get(drv.me, 0)
    per_step = int(a.batch_size) * int(plan.seq_len)
    return -(-int(tokens) // per_step) if tokens and per_step else 0


class StepsDone:
    """The trainer's ``progress`` callback that counts the inner steps done (``steps``) and passes each call on to
    ``show`` (the live progress line, or None)."""

    def __init__(self, show: Optional[Callable[[int, float, float], None]] = None) -> None:
        self.steps = 0
        self.show = show

    def __call__(self, step: int, loss: float, tokens_per_s: float) -> None:
        self.steps = max(self.steps, int(step))
        if self.show is not None:
            self.show(step, loss, tokens_per_s)


def stop_after_floor(drv: RoundDriver, done: StepsDone, floor: int) -> Callable[[], bool]:
    """The inner steps' ``should_stop`` for this peer's stop request (Ctrl+C, SIGTERM): true once a stop was requested
    and ``done`` counts ``floor`` steps (:func:`floor_steps`; 0: at once). The floor's steps stay bounded by the train
    deadline plus :func:`floor_grace_s`, as when the deadline stops a peer within them.

    Why (session 35, a fresh user's trial): cut under its token floor, a stopping peer's work counts 0 tokens and its
    contribution abstains. Two of three peers stopped together after 1 and 3 of their ~30 steps: one voting
    contribution of three is below the quorum (2), so every part aggregated zeros at every peer and the survivor's
    full round was thrown away (``no part aggregated a token``). The floor's few steps make a stopper's work count;
    it waits for the exchange anyway (its parts stay served until the others' pushes at their train deadline)."""

    def stop() -> bool:
        return drv.stop.is_set() and done.steps >= floor

    return stop


def floor_grace_s(plan: RoundPlan) -> float:
    """Seconds past the train deadline the token floor's steps may run (:meth:`InnerTrainer.run`):
    ``plan.views.FLOOR_GRACE_WINDOWS`` windows, at most ``plan.views.FLOOR_GRACE_EXCHANGE_SHARE`` of the exchange
    window (the owners take pushes until well after it). The leader plans a screened peer the loss-gain test's
    steps only where they end within it (``plan.views.min_steps_of``)."""
    return plan_floor_grace_s(plan)


def say_assignment(drv: RoundDriver, plan: RoundPlan, steps: int, batch: int) -> None:
    """One INFO line with this peer's share of ``plan`` (inner steps, batch, the window in seconds): at the first
    round it trains, then whenever the window moved by more than a quarter since the last such line (an operator
    sees what ``--window-s auto`` and the planner gave it without reading the rows)."""
    last = drv.said_window
    if last is not None and abs(plan.window_s - last) <= 0.25 * last:
        return
    drv.said_window = plan.window_s
    log.info(
        "round %d: this peer trains %d inner step(s) of batch %d in the plan's %.1f s window (leader %s)",
        plan.round,
        steps,
        batch,
        plan.window_s,
        plan.leader[:10],
    )


def say_loss_not_finite(drv: RoundDriver, r: int, e: FloatingPointError) -> None:
    """The one WARNING of inner steps stopped by a non-finite loss (event ``contributing_nothing``)."""
    say_contributing_nothing(drv, r, e, "loss_not_finite")


def say_contributing_nothing(drv: RoundDriver, r: int, e: BaseException, reason: str) -> None:
    """One WARNING (event ``contributing_nothing``, ``reason``) for a round this peer contributes nothing to."""
    events.emit(
        log,
        logging.WARNING,
        "contributing_nothing",
        "round %d: %s; contributing nothing this round",
        r,
        e,
        peer=drv.me,
        round=r,
        reason=reason,
        detail=str(e),
    )


async def reset_to_start(drv: RoundDriver, ctx: RoundContext) -> None:
    """The model back at this round's start weights: its own eager start (``ctx.start``) or the global ones."""
    if ctx.start is not None:
        await asyncio.to_thread(cast(EagerStatePort, drv.state).load_model, ctx.start)
    else:
        await asyncio.to_thread(drv.state.reset_model)


def progress_printer(r: int, planned: int) -> Optional[Callable[[int, float, float], None]]:
    """A live progress line for the inner steps, on a terminal only (logs stay clean)."""
    if not sys.stdout.isatty():
        return None

    def show(step: int, loss: float, tokens_per_s: float) -> None:
        sys.stdout.write(
            f"\r  round {r}: inner step {step}/{planned}  loss {loss:.3f}  {tokens_per_s:,.0f} tokens/s\x1b[K"
        )
        sys.stdout.flush()

    return show
