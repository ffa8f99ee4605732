"""Phase TRAIN: this peer's inner steps of the plan (adopting the steps started during the plan's settle or,
with eager updates, the speculative ones), then its update of the round ([P] fp32: the pseudo-gradient, or
the ddp baseline's gradient), with a non-finite update replaced by a zero contribution of 0 tokens, and the
collective's spec of the plan. Functions of the :class:`~geomesh_p2p.round.driver.RoundDriver` (its ports:
trainer, state, policy)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Optional, cast

import torch

from geomesh_p2p.exchange.codec._format import all_finite
from geomesh_p2p.telemetry import events
from geomesh_p2p.round.context import Phase, RoundContext, no_work
from geomesh_p2p.round.eager import adopt_speculative, drop_speculative
from geomesh_p2p.round.ports import EagerStatePort
from geomesh_p2p.round.steps import inner_steps

if TYPE_CHECKING:
    from geomesh_p2p.model.training import InnerResult
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")


async def train(drv: RoundDriver, ctx: RoundContext) -> bool:
    """Phase TRAIN: the assigned inner steps (a worker thread) until the plan's train deadline, then
    this peer's pseudo-gradient. A diverged or non-finite update is replaced by a zero contribution of
    0 tokens (one WARNING line) and the model goes back to the global weights. Inner steps already
    started during the plan's settle on this very plan (:func:`~geomesh_p2p.round.planning.agree`) are
    awaited, not started again."""
    drv.phase = Phase.TRAIN
    plan, r = ctx.planned(), ctx.round
    ctx.assignment = plan.assignment(drv.me)
    ctx.sent0, ctx.recv0 = drv.traffic()
    with drv.timed("train"):
        grad, result, t_end = await _steps(drv, ctx)
        ctx.t_compute_end = t_end if t_end is not None else drv.clock.time()
    with drv.timed("pseudo_gradient"):
        if drv.stop.is_set():
            # Finish the round anyway (the inner steps stopped early): the parts this peer owns stay
            # served and the others get a full update; the node leaves right after.
            log.info("round %d: stop requested; exchanging what was trained, then leaving", r)
        ctx.delta, ctx.result = await _update(drv, ctx, grad, result)
    try:
        ctx.spec = drv.policy.collective_spec(plan)
    except ValueError as e:  # plan_problem should have caught it; never crash on a leader's plan
        log.error("round %d: the plan of %s cannot be executed (%s); skipping the round", r, plan.leader[:10], e)
        await asyncio.to_thread(drv.state.reset_model)  # this round's steps are void
        return False
    return True


async def _steps(drv: RoundDriver, ctx: RoundContext) -> tuple[Optional[torch.Tensor], InnerResult, Optional[float]]:
    """The round's inner steps: the speculative ones started for it (eager), those started during the
    plan's settle, or new ones. Returns ``(grad or None, InnerResult, when adopted steps ended or None)``."""
    r = ctx.round
    spec, drv._spec = drv._spec, None
    if spec is not None and spec.round != r:  # cannot happen (a spec is dropped whenever its round is not run)
        drv._spec = spec
        await drop_speculative(drv, f"started for round {spec.round}, not {r}")
        spec = None
    if spec is not None:
        return await adopt_speculative(drv, ctx, spec)
    if ctx.early is not None:
        grad, result = await ctx.early
    else:
        grad, result = await inner_steps(drv, ctx, ctx.planned())
    return grad, result, None


async def _update(
    drv: RoundDriver, ctx: RoundContext, grad: Optional[torch.Tensor], result: InnerResult
) -> tuple[torch.Tensor, InnerResult]:
    """This peer's update of the round ([P] fp32) and its InnerResult: ``grad`` (ddp), or the
    pseudo-gradient from this peer's own start (eager) or from the global weights; a non-finite one is
    replaced by zeros and ``no_work`` (one WARNING, the model back at the global weights)."""
    r = ctx.round
    if grad is not None:
        delta = grad
    elif ctx.start is not None:  # eager: from this peer's own start, Δ_m = x_m − y_m
        delta = await asyncio.to_thread(cast(EagerStatePort, drv.state).pseudo_gradient_from, ctx.start)
        # Not needed any more: released before the next eager start allocates its three [P] (at 124M
        # parameters the old start held 0.5 GB through that peak).
        ctx.start = None
    else:
        delta = await asyncio.to_thread(drv.state.pseudo_gradient)
    # One aminmax pass, no [P] bool temporary: at gpt2-124m ``isfinite(delta).all()`` took 0.47 s of CPU a round
    # (the page faults of its fresh 89 MB and the reduction), aminmax 0.015 s (issue 27, session 38).
    if not await asyncio.to_thread(all_finite, delta):
        events.emit(
            log,
            logging.WARNING,
            "contributing_nothing",
            "round %d: this peer's update has non-finite values (its inner steps diverged); "
            "contributing nothing this round",
            r,
            peer=drv.me,
            round=r,
            reason="update_not_finite",
        )
        delta, result = torch.zeros_like(delta), no_work(result.compute_s)
        await asyncio.to_thread(drv.state.reset_model)
    return delta, result
