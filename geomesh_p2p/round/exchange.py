"""Phase EXCHANGE: this peer's update through the collective (with the run's error feedback applied to sign
pushes; the aggregate written into the update's storage except with eager updates), then what the exchange's failures mean: penalties for failed owners and no-shows, unless this
peer itself was stalled through the exchange window (:data:`STALL_VOID_SHARE`: the round is then no
evidence against the others). Also the residual zeroed when a re-sync discards this peer's lineage.
Functions of the :class:`~geomesh_p2p.round.driver.RoundDriver` (its ports: collective, policy, clock)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from geomesh_p2p.telemetry import events
from geomesh_p2p.round.context import Phase, RoundContext

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: A round in which this peer itself was not running (its event loop stalled -- SIGSTOP, swap, a debugger --
#: or the host slept: wall time jumped against monotonic time) for at least this share of the plan's
#: exchange window (train deadline -> exchange deadline) is void as evidence: every part failed at once
#: because of this peer, so the owners are not blamed (no owner/no-show penalties, no exchange-cost sample).
STALL_VOID_SHARE = 0.5


async def exchange(drv: RoundDriver, ctx: RoundContext) -> bool:
    """Phase EXCHANGE: the collective all-reduce of this peer's update (a stop request waits for it)."""
    drv.phase = Phase.EXCHANGE
    drv.in_exchange = True
    try:
        fb, spec, result = drv.feedback, ctx.collective(), ctx.trained()
        if fb is not None and spec.push_encoding == "sign":
            # Error feedback (EF-SGD): push delta + residual, keep what the sign codec drops of each
            # part (the parts this peer pushes: all of them); fp32 tensor math over [P], off the loop.
            ctx.delta = await asyncio.to_thread(
                fb.apply, ctx.update(), int(result.tokens), [(o.start, o.end) for o in spec.owners], ctx.round
            )
        # Issue 27: the aggregate is written into the update's own storage, part by part once pushed (no
        # second [P]); not with eager updates, whose speculative start reads the update meanwhile.
        in_place = not drv.cfg.eager
        try:
            ctx.ar = await drv.collective.all_reduce(
                spec, ctx.update(), tokens=result.tokens, compute_end=ctx.t_compute_end, in_place=in_place
            )
        finally:
            if in_place:
                ctx.delta = None  # its storage is the aggregate now (or garbage after a failure)
    finally:
        drv.in_exchange = False
    ctx.t_agg = drv.clock.time()
    ctx.stall_s = drv.loop_stall()  # taken now: the blame below needs it; the row keeps the worst
    paused = paused_s(drv, ctx)
    plan = ctx.planned()
    window = max(0.0, float(plan.exchange_deadline) - float(plan.train_deadline))
    if window > 0 and paused >= STALL_VOID_SHARE * window:
        # This peer was not running through the deadlines: the parts it found missing failed because of
        # it, so the round is no evidence against their owners (nor a sample of the exchange's cost).
        events.emit(
            log,
            logging.WARNING,
            "stalled_round_not_blamed",
            "round %d: this peer was stalled %.1f s (its exchange window is %.1f s); the parts and "
            "contributions it missed are not held against their owners",
            ctx.round,
            paused,
            window,
            peer=drv.me,
            round=ctx.round,
            stalled_s=paused,
            window_s=window,
        )
        # its own failures are real for everyone: penalised as the others penalise it
        drv.policy.note_own_failures(ctx.collective(), plan, ctx.exchanged(), stalled=True)
    else:
        drv.policy.after_exchange(ctx.collective(), plan, ctx.exchanged())
    return True


def paused_s(drv: RoundDriver, ctx: RoundContext) -> float:
    """Seconds this peer was not running during round ``ctx.round`` (so far): the worst event-loop stall
    (LoopLagMonitor, taken when the exchange returned) or the wall clock's jump ahead of the monotonic
    clock since the round began (a host that slept), whichever is larger; 0.0 when neither is known."""
    jump = (drv.clock.time() - ctx.t_round) - (drv.clock.monotonic() - ctx.m_round)
    return max(ctx.stall_s or 0.0, jump if ctx.m_round else 0.0, 0.0)


async def drop_feedback(drv: RoundDriver) -> None:
    """After a re-sync that discarded rounds of this peer's lineage: its error-feedback residual is the
    compression error of pushes applied to the discarded state, so it is zeroed (one INFO line)."""
    fb = drv.feedback
    if fb is None:
        return
    await asyncio.to_thread(fb.reset)  # a [P] fill: off the loop
    events.emit(
        log,
        logging.INFO,
        "residual_zeroed",
        "error feedback: residual zeroed (re-synced to the state of round %d, another lineage)",
        drv.state.round,
        peer=drv.me,
        round=drv.state.round,
    )
