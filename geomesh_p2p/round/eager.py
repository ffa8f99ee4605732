"""Eager updates (``DriverConfig.eager``, docs/eager.md): the next round's inner steps, started
speculatively from this peer's own start ``O(θ, v; w·Δ)`` while this round's exchange runs
(:func:`start_speculative`), adopted by the next TRAIN phase or restarted from the own start when the plan's
batch shape differs (:func:`adopt_speculative`), or dropped (:func:`drop_speculative`: the model back at the
global weights). Functions of the :class:`~geomesh_p2p.round.driver.RoundDriver` (its ports: trainer and
the :class:`~geomesh_p2p.round.ports.EagerStatePort` of its state)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Optional, cast

import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.model.training import StepTarget
from geomesh_p2p.round.context import RoundContext, Speculative, no_work
from geomesh_p2p.round.ports import EagerStatePort
from geomesh_p2p.round.steps import inner_steps, say_loss_not_finite

if TYPE_CHECKING:
    from geomesh_p2p.model.training import InnerResult
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")


async def start_speculative(drv: RoundDriver, ctx: RoundContext, own: torch.Tensor) -> None:
    """Eager updates: right after round ``r``'s pseudo-gradient ``own`` (its exchange runs meanwhile), this
    peer's start of round ``r + 1``, ``x = O(θ^r, v^r; w·own)`` with ``w`` its planned token share of round
    ``r`` (the real token total is not known before the exchange), computed on copies in a worker thread
    and loaded into the model; then round ``r + 1``'s inner steps start on it with round ``r``'s assignment
    and a train deadline of now + the round's window (:class:`~geomesh_p2p.round.context.Speculative`).
    Nothing when the peer stops or leaves after this round, or after its last round."""
    r, plan, a = ctx.round, ctx.planned(), ctx.assigned()
    last = drv.cfg.rounds is not None and r + 1 >= drv.cfg.rounds
    if drv.stop.is_set() or drv.leaving or last:
        return
    total = plan.total_token_budget()
    weight = float(a.token_budget) / float(total) if total > 0 else 0.0
    state = cast(EagerStatePort, drv.state)
    with drv.timed("pseudo_gradient"):
        start = await asyncio.to_thread(state.eager_start, own, weight)
        await asyncio.to_thread(state.load_model, start)
    spec = Speculative(
        round=r + 1,
        start=start,
        batch_size=a.batch_size,
        micro_batch=a.micro_batch,
        # Provisional: steps that reach round r's count before round r + 1's plan wait for its count.
        target=StepTarget(a.inner_steps, drv.clock.time() + float(plan.window_s), provisional=True),
        abort=threading.Event(),
        weight=weight,
        t_start=drv.clock.time(),
    )
    spec.task = asyncio.ensure_future(speculative_steps(drv, spec))
    drv._spec = spec


async def speculative_steps(drv: RoundDriver, spec: Speculative) -> InnerResult:
    """The speculative inner steps (worker thread) until their target, deadline, a stop or an abort.
    Returns an InnerResult; a non-finite loss gives ``no_work`` and the model back at ``spec.start``."""
    should_stop = lambda: drv.stop.is_set() or spec.abort.is_set()  # noqa: E731
    t_train = time.perf_counter()
    try:
        return await asyncio.to_thread(
            lambda: drv.trainer.run(
                round=spec.round,
                inner_steps=spec.target.get()[0],
                batch_size=spec.batch_size,
                micro_batch=spec.micro_batch,
                should_stop=should_stop,
                target=spec.target,
            )
        )
    except FloatingPointError as e:
        say_loss_not_finite(drv, spec.round, e)
        await asyncio.to_thread(cast(EagerStatePort, drv.state).load_model, spec.start)
        return no_work(time.perf_counter() - t_train)
    finally:
        spec.t_end = drv.clock.time()


async def drop_speculative(drv: RoundDriver, why: str) -> None:
    """Abort the speculative inner steps (a peer not in the plan, a re-sync, a digest mismatch, a stop, the
    end of the run), wait for their thread, and load the global weights back into the model (one INFO
    line, event ``eager_steps_aborted``). Nothing when none runs."""
    spec, drv._spec = drv._spec, None
    if spec is None:
        return
    spec.abort.set()
    spec.target.release()  # a loop waiting at the provisional target ends now
    if spec.task is not None:
        await asyncio.gather(spec.task, return_exceptions=True)
    await asyncio.to_thread(drv.state.reset_model)
    events.emit(
        log,
        logging.INFO,
        "eager_steps_aborted",
        "round %d: speculative inner steps aborted (%s); the model is back at the global weights",
        spec.round,
        why,
        peer=drv.me,
        round=spec.round,
        reason=why,
    )


async def adopt_speculative(
    drv: RoundDriver, ctx: RoundContext, spec: Speculative
) -> tuple[Optional[torch.Tensor], InnerResult, Optional[float]]:
    """The TRAIN phase of round ``ctx.round`` with speculative steps ``spec`` started for it: with the plan's
    batch shape they are this round's (they take the plan's target and train deadline, and are awaited);
    with another shape they are void and the round's inner steps restart from this peer's own start.
    ``ctx.start`` and ``ctx.eager_steps`` say which. Returns ``(grad or None, InnerResult, when the adopted
    steps ended or None)``."""
    plan, a = ctx.planned(), ctx.assigned()
    ctx.start = spec.start
    if (spec.batch_size, spec.micro_batch) == (a.batch_size, a.micro_batch):
        # Eager: the speculative steps are this round's; they take the plan's target and deadline.
        spec.target.set(a.inner_steps, plan.train_deadline)
        try:
            result = await cast(asyncio.Future, spec.task)
        except asyncio.CancelledError:
            # The driver is cancelled: the steps are no longer in ``_spec`` (run()'s final drop
            # cannot see them), so their thread is told to end here, not at its deadline.
            spec.abort.set()
            spec.target.release()
            raise
        ctx.eager_steps = "adopted"
        return None, result, spec.t_end
    # Another batch shape: those steps are void; restart from this peer's own start.
    spec.abort.set()
    spec.target.release()
    await asyncio.gather(cast(asyncio.Future, spec.task), return_exceptions=True)
    await asyncio.to_thread(cast(EagerStatePort, drv.state).load_model, spec.start)
    ctx.eager_steps = "restarted"
    grad, result = await inner_steps(drv, ctx, plan)
    return grad, result, None
