"""Phase FINISH: the round's end as the algorithm reads (:func:`finish`): the outer step and its commit,
the announcement of the new round (and of leaving), the evaluation, the round's row, the digest check
against the round's contributors, then a checkpoint, or a re-sync when the digest differs. The details
are the helpers below it. Functions of the :class:`~geomesh_p2p.round.driver.RoundDriver` (its ports:
state, policy, membership, trainer)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence, cast

import torch

from geomesh_p2p.model.memory import process_peaks
from geomesh_p2p.plan.agree import digest_majority
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.sync.download import StateSyncError
from geomesh_p2p.telemetry import events
from geomesh_p2p.telemetry.metrics import RoundRecord
from geomesh_p2p.util.procstat import status_bytes
from geomesh_p2p.round.context import LineageEntry, Phase, RoundContext, Speculative
from geomesh_p2p.round import light
from geomesh_p2p.round.eager import drop_speculative
from geomesh_p2p.round.gather import ROUND_END_SLACK_S
from geomesh_p2p.round.rules.penalties import conclusive
from geomesh_p2p.round.ports import CheckHolder, EagerStatePort, SnapshotEvaluator

if TYPE_CHECKING:
    from geomesh_p2p.exchange.client import AllReduceResult
    from geomesh_p2p.round.driver import RoundDriver
    from geomesh_p2p.schema.peer import PeerRecord

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")


async def finish(drv: RoundDriver, ctx: RoundContext) -> set[str]:
    """Phase FINISH: outer step and digest (worker thread), re-profiling, announcement, evaluation, the
    round's row, digest check, then a checkpoint or a re-sync on a digest mismatch. Returns the
    participants expected next round (this round's contributors)."""
    drv.phase = Phase.FINISH
    r, plan = ctx.round, ctx.planned()
    drv._last_plan = plan
    last = drv.cfg.rounds is not None and r + 1 >= drv.cfg.rounds
    await outer_step(drv, ctx)  # outer step and commit (a worker thread), then re-profiling
    traffic = drv.traffic()
    await announce(drv, r, last)  # round r + 1's record (as leaving, when this was the last round)
    drv.eval_schedule.note_round(drv.clock.time() - ctx.t_round)  # before the evaluation it schedules
    ppl, eval_round = await evaluate_round(drv, r, last)
    note_lineage(drv, ctx)
    rec = round_record(drv, ctx, ppl, eval_round, traffic)
    rec.digest_agree = await digest_check(drv, ctx)
    publish_row(drv, rec)
    if rec.digest_agree is False:
        await resync_after_mismatch(drv)
    else:
        await checkpoint_if_due(drv, r)
        drv._fresh_record = True
        if rec.digest_agree is True:  # confirmed by others: round r + 1 may run light (round/light.py)
            drv._light_ok_round = r + 1
    return contributors(ctx.exchanged()) or set(plan.participants())


def contributors(ar: AllReduceResult) -> set[str]:
    """PeerIDs whose contributions the exchange aggregated (in any part)."""
    return {pid for part in ar.contributors.values() for pid, _ in part}


async def digest_check(drv: RoundDriver, ctx: RoundContext) -> Optional[bool]:
    """:func:`check_digest` of round ``ctx.round + 1``'s state against the round's contributors."""
    plan, delivered = ctx.planned(), contributors(ctx.exchanged())
    # Only the participants that delivered vote on the digest (and are waited for): a no-show, e.g. an
    # identity on probation that never takes part, would hold every check for its whole wait.
    voters = [p for p in plan.participants() if p in delivered] or plan.participants()
    r = ctx.round + 1
    with drv.timed("digest_check"):
        if ctx.light:  # a light follower: against a sample of the voters (round/light.py)
            votes = await light.digest_sample(drv, r, voters)
            majority, agree, total = digest_majority(drv.policy.digest_voters(votes), r, behind_digest(drv, r))
            if majority is not None and majority != drv.state.digest and 2 * agree <= total:
                # no strict majority of the sample against this peer (a tie, e.g. one rogue digest of two): the
                # full check decides, not a sample that small
                return await drv.check_digest(r, voters)
            return judge_digest(drv, r, majority, agree, total, " of a sample")
        return await drv.check_digest(r, voters)  # through the driver: its methods are the phases' hooks


async def outer_step(drv: RoundDriver, ctx: RoundContext) -> None:
    """The round's outer step and commit (:func:`advance`, a worker thread) between the policy's hooks:
    verified work keeps the start weights before it, re-profiling (EMAs, standing) after it."""
    r, plan, a, ar = ctx.round, ctx.planned(), ctx.assigned(), ctx.exchanged()
    await drv.policy.before_outer_step(r, plan, a, ar)  # verified work keeps this round's start weights
    idle = ar.idle_ranges()
    with drv.timed("outer_step"):  # advance moves its digest (commit) share to "digest"
        await asyncio.to_thread(advance, drv, r, plan, ar.aggregate, idle)
    # Re-profile before announcing round r+1: the record a leader gathers for r+1 then already holds
    # the figures every follower will check its plan against (planner.check_plan).
    drv.policy.after_outer_step(r, plan, a, ctx.trained(), ar)


async def announce(drv: RoundDriver, r: int, last: bool) -> None:
    """Announce round ``r + 1`` (this peer's record); when it stops or ``r`` is its last round, as leaving."""
    if (drv.stop.is_set() or last) and not drv.leaving:
        # Say so with the new round's record, before the others gather for it (every way of leaving
        # announces before the next gather; --target-ppl right after the evaluation below; a stop request
        # already said so when it came: _say_leaving_on_stop).
        drv.mark_leaving()
        events.emit(
            log,
            logging.INFO,
            "leaving_announced",
            "round %d: exchange done; announcing that this peer leaves (%s)",
            r,
            "stop requested" if drv.stop.is_set() else f"--rounds {drv.cfg.rounds} reached",
            peer=drv.me,
            round=r,
            reason="stop" if drv.stop.is_set() else "rounds",
        )
    with drv.timed("announce"):
        await drv.membership.announce()


async def evaluate_round(drv: RoundDriver, r: int, last: bool) -> tuple[Optional[float], Optional[int]]:
    """:func:`evaluate` of round ``r``'s end state; reaching ``target_ppl`` announces that this peer leaves."""
    with drv.timed("eval"):
        ppl, eval_round = await evaluate(drv, r, last)
    t = drv.cfg.target_ppl
    if t is not None and ppl is not None and ppl <= t and not drv.leaving:
        drv.mark_leaving()
        events.emit(
            log,
            logging.INFO,
            "leaving_announced",
            "round %d: target eval perplexity %g reached; announcing that this peer leaves",
            r,
            t,
            peer=drv.me,
            round=r,
            reason="target_ppl",
        )
        await drv.membership.announce()
    return ppl, eval_round


def note_lineage(drv: RoundDriver, ctx: RoundContext) -> None:
    """Round ``ctx.round`` into this peer's lineage: the digest it made, its plan's participants, the tokens
    aggregated (each contributor counted once: its largest claim over the parts) and this peer's own."""
    plan, ar = ctx.planned(), ctx.exchanged()
    claims: dict[str, int] = {}
    for part in ar.contributors.values():
        for pid, n in part:
            claims[pid] = max(claims.get(pid, 0), int(n))
    drv.lineage.append(
        LineageEntry(
            ctx.round,
            drv.state.digest or "",
            frozenset(plan.participants()),
            sum(claims.values()),
            int(ctx.trained().tokens),
        )
    )


def round_record(
    drv: RoundDriver, ctx: RoundContext, ppl: Optional[float], eval_round: Optional[int], traffic: tuple[int, int]
) -> RoundRecord:
    """The round's row (digest check still open): steps, tokens, loss, evaluation, idle split, bytes
    (``traffic``: the totals sent and received after the outer step), eager facts, loop stall.

    Raises:
        RuntimeError: the state has no digest after its commit (a state port bug).
    """
    r, plan, a, result, ar = ctx.round, ctx.planned(), ctx.assigned(), ctx.trained(), ctx.exchanged()
    spec = drv._spec if drv._spec is not None and drv._spec.round == r + 1 else None
    straggler, network = idle_split(ctx, ar, spec)
    delivered = contributors(ar)
    digest = drv.state.digest
    if digest is None:  # commit() always sets it: a state port that does not is a bug, not a round's fault
        raise RuntimeError(f"round {r}: the global state has no digest after its commit")
    sent1, recv1 = traffic
    rec = RoundRecord(
        round=r,
        peers=len(plan.assignments),
        leader=plan.leader[:10],
        batch_size=a.batch_size,
        inner_steps_planned=a.inner_steps,
        inner_steps_done=result.steps_done,
        tokens=result.tokens,
        train_loss=result.mean_loss,
        eval_ppl=ppl,
        compute_s=result.compute_s,
        straggler_idle_s=straggler,
        network_idle_s=network,
        round_s=drv.clock.time() - ctx.t_round,
        bytes_sent=sent1 - ctx.sent0,
        bytes_received=recv1 - ctx.recv0,
        digest=digest,
        contributors=len(delivered),
        missing_parts=len(ar.missing_parts),
        applied=conclusive(ar),
        time=drv.clock.time(),
        eval_round=eval_round,
    )
    if drv.cfg.eager:
        rec.extra["eager"] = {
            # how this round's inner steps began (RoundContext.eager_steps)
            "steps": ctx.eager_steps,
            # the next round's speculative steps started, and how many seconds before this exchange ended
            "next_started": spec is not None,
            "next_lead_s": (ctx.t_agg - spec.t_start) if spec is not None else None,
            "start_weight": spec.weight if spec is not None else None,
        }
    if ctx.light:  # a light follower's round (round/light.py): no gather, sampled checks
        rec.extra["light"] = True
    rec.extra["memory"] = process_peaks()  # peak RSS and device memory so far (issue 27)
    if drv._eval_carry is not None:  # every background evaluation lands in a row (review L3)
        rec.extra["eval_background"] = {"eval_ppl": drv._eval_carry[0], "eval_round": drv._eval_carry[1]}
        drv._eval_carry = None
    later = drv.loop_stall()
    known = [x for x in (ctx.stall_s, later) if x is not None]
    if known:
        rec.loop_stall_ms = max(known) * 1e3
    return rec


def idle_split(ctx: RoundContext, ar: AllReduceResult, spec: Optional[Speculative]) -> tuple[float, float]:
    """``(straggler idle s, network idle s)`` of the round: the compute's idle time before the aggregate
    arrived, split at the barrier (when the last contributor finished computing)."""
    # The barrier is when the last contributor finished computing (stated in its contributions):
    # waiting until then is straggler idle, waiting after it is network idle (the paper's split).
    barrier = min(ar.last_compute_end or ctx.t_compute_end, ctx.t_agg)
    # Eager: the compute is idle only from the end of the next round's speculative steps (when they ended
    # before the aggregate arrived) to the aggregate; that idle time is split at the barrier as above.
    # Steps waiting at their provisional target (for the next plan) are idle since the wait began.
    spec_end = None if spec is None else (spec.t_end or spec.target.waiting_since)
    idle_from = ctx.t_compute_end if spec is None else min(ctx.t_agg, spec_end or ctx.t_agg)
    straggler = max(0.0, barrier - idle_from)
    network = max(0.0, (ctx.t_agg - idle_from) - straggler)
    return straggler, network


def traffic_delta(now: dict, before: dict) -> dict[str, dict[str, int]]:
    """``now - before`` of two ``{class: {field: count}}`` traffic snapshots (a class or field missing in
    ``before``: 0), e.g. ``{"dht": {"sent": 41230, "received": 90112, "calls": 57, "served": 61}}``."""
    return {c: {f: v - before.get(c, {}).get(f, 0) for f, v in x.items()} for c, x in now.items()}


#: Seconds of verified work's compute in a round past which an underfilled round's warning names it.
VERIFY_NAMED_S = 0.5


def publish_row(drv: RoundDriver, rec: RoundRecord) -> None:
    """The row's phase seconds (and the process's CPU seconds in each: ``extra["phase_cpu_s"]``), cycle and cycle traffic per method class (``extra["traffic"]``: the DHT
    traffic of gather, planning, evaluation and the digest check included, unlike ``bytes_sent``), into the
    history, the log (an underfilled round warns) and the policy (Prometheus, the status page)."""
    now = drv.clock.monotonic()
    rec.phase_s = {k: round(v, 4) for k, v in drv._phases.items()}
    rec.extra["phase_cpu_s"] = {k: round(v, 4) for k, v in drv._phase_cpu.items()}
    rec.cycle_s = now - drv._t_row if drv._t_row is not None else None
    drv._phases, drv._phase_cpu, drv._t_row = {}, {}, now
    mem = status_bytes("RssAnon", "RssFile")
    if mem:  # memory by phase (issue 27): MiB added per phase this cycle, and where the process stands now
        rec.extra["phase_rss_mib"] = {k: round(v / 2**20, 1) for k, v in drv._phase_rss.items()}
        rec.extra["rss_mib"] = {k: round(v / 2**20, 1) for k, v in mem.items()}
    drv._phase_rss = {}
    traffic = drv.traffic_classes()
    if traffic:  # the cycle's bytes and calls per method class; the first row's: since the node started
        rec.extra["traffic"] = traffic_delta(traffic, drv._traffic_row)
        drv._traffic_row = traffic
    drv.history.append(rec)
    if sys.stdout.isatty():
        sys.stdout.write("\r\x1b[K")  # clear the progress line before the row
    drv.policy.publish_record(rec)
    busy = float((rec.extra.get("verify") or {}).get("busy_s") or 0.0)  # cumulative since the node started
    verify_s, drv._verify_busy_row = max(0.0, busy - drv._verify_busy_row), busy
    if rec.underfilled and not drv.stop.is_set():
        # Flagged in the table ("!"), the JSON row and Prometheus too; the next plan already follows the
        # re-measured tokens/s, so a mis-profiled peer gets fewer steps. Verified work's checks and screens run
        # on the same cores in the background of the inner steps: when they computed in this cycle, say so (a
        # fresh user read "device slower than profiled" on an idle machine in the rounds of the first screens).
        log.warning(
            "round %d: trained %d of %d planned inner steps (%sdevice slower than profiled, or busy)",
            rec.round,
            rec.inner_steps_done,
            rec.inner_steps_planned,
            f"verified work computed {verify_s:.1f} s of this round on the same cores; or the "
            if verify_s >= VERIFY_NAMED_S
            else "",
        )


async def resync_after_mismatch(drv: RoundDriver) -> None:
    """The digest differs from the majority's: speculative steps dropped, the swarm's state downloaded (a
    failure is one WARNING: the next round's behind() check tries again)."""
    drv.phase = Phase.RESYNC
    await drop_speculative(drv, "digest mismatch")
    try:
        with drv.timed("resync"):
            await drv._catch_up()
    except StateSyncError as e:  # the next round's behind() check tries again
        log.warning("re-sync failed (%s); will retry", e)


async def checkpoint_if_due(drv: RoundDriver, r: int) -> None:
    """A checkpoint after round ``r`` every ``checkpoint_every`` rounds (when checkpointing)."""
    if drv.cfg.checkpointing and (r + 1) % drv.cfg.checkpoint_every == 0:
        with drv.timed("checkpoint"):  # counted in the next row's cycle
            await drv.state.checkpoint_or_warn()


async def evaluate(drv: RoundDriver, r: int, last: bool) -> tuple[Optional[float], Optional[int]]:
    """Evaluation after round ``r``'s commit: when ``drv.eval_schedule`` says so (``--eval-every N``, or auto:
    within 5% of the wall time, :class:`~geomesh_p2p.round.eval_schedule.EvalSchedule`), and at the last. Returns
    ``(perplexity, round whose end state it measured)`` for this row, or ``(None, None)``.

    With ``eval_background`` the evaluation of round ``r`` runs in a worker thread on a snapshot of the
    global weights (``trainer.snapshot_for_eval``) while round ``r + 1`` trains, and its result is
    returned at the first finish after it completed (or waited for, when the next evaluation is due:
    the snapshot model is reused). The last round, and a peer that stops, evaluate at once; a background
    result collected then goes into the row's ``extra["eval_background"]`` (``eval_ppl``, ``eval_round``)."""
    due = drv.eval_schedule.due(r, last)  # --eval-every N, or auto: within 5% of the wall time (eval_schedule)
    background = (
        drv.cfg.eval_background and not last and not drv.stop.is_set() and isinstance(drv.trainer, SnapshotEvaluator)
    )
    ready: tuple[Optional[float], Optional[int]] = (None, None)
    if drv._eval_task is not None and (drv._eval_task.done() or due or drv.stop.is_set()):
        task, drv._eval_task = drv._eval_task, None
        try:
            ppl_bg, seconds = await task
            drv.eval_schedule.note_eval_seconds(seconds)
            ready = (ppl_bg, drv._eval_round)
            log.info("round %d: eval perplexity %.2f (evaluated in the background)", ready[1], ready[0])
        except Exception as e:  # an evaluation must never end the node; the next one is due anyway
            log.warning("round %d: background evaluation failed (%s: %s)", drv._eval_round, type(e).__name__, e)
    if not due:
        return ready
    # Eager: the model trains the next round's speculative steps; the global weights are evaluated on the
    # evaluation snapshot (one more model in memory), loaded from θ, not from the model.
    eager_snapshot = drv.cfg.eager and isinstance(drv.trainer, SnapshotEvaluator)
    weights = cast(EagerStatePort, drv.state).global_weights() if eager_snapshot else None
    if background:
        snap = cast(SnapshotEvaluator, drv.trainer)  # checked with isinstance above
        if weights is not None:
            await asyncio.to_thread(lambda: snap.snapshot_for_eval(weights=weights))
        else:
            await asyncio.to_thread(snap.snapshot_for_eval)
        drv._eval_round = r
        # the last figure until this one's own seconds arrive with its result (note_eval_seconds above)
        drv.eval_schedule.note_eval(r, drv.eval_schedule.eval_s or 0.0)

        def timed() -> tuple[float, float]:
            t0 = time.monotonic()
            return snap.evaluate_snapshot(max_batches=drv.cfg.eval_batches), time.monotonic() - t0

        drv._eval_task = asyncio.ensure_future(asyncio.to_thread(timed))
        return ready
    t0 = drv.clock.monotonic()
    if weights is not None:
        snap = cast(SnapshotEvaluator, drv.trainer)

        def on_snapshot() -> float:
            snap.snapshot_for_eval(weights=weights)
            return snap.evaluate_snapshot(max_batches=drv.cfg.eval_batches)

        ppl = await asyncio.to_thread(on_snapshot)
    else:
        ppl = await asyncio.to_thread(drv.trainer.evaluate, max_batches=drv.cfg.eval_batches)
    drv.eval_schedule.note_eval(r, drv.clock.monotonic() - t0)
    if ready[0] is not None and ready[1] is not None:
        drv._eval_carry = (ready[0], ready[1])
    return ppl, r


def advance(drv: RoundDriver, r: int, plan: RoundPlan, aggregate: torch.Tensor, idle) -> None:
    """Outer step and commit as one change of the state (worker thread): under the state's lock when it
    has one, so a reader never sees the stepped buffer under round ``r``'s digest."""
    # No check pass of verified work starts meanwhile (a pass under way goes on): one beside the outer step and
    # the digest took ~0.1-0.2 s of each round's critical path on a peer's core (issue 27, session 45)
    hold = drv.trainer.turns.hold() if isinstance(drv.trainer, CheckHolder) else contextlib.nullcontext()
    with hold, drv.state.state_lock or contextlib.nullcontext():
        drv.state.outer_step(r, plan, aggregate, idle)
        t0, c0 = time.monotonic(), time.process_time()
        if drv._spec is not None:
            # Eager: the next round's speculative steps train on the model; θ^{r+1} is committed (digest,
            # served state) without being loaded into it.
            cast(EagerStatePort, drv.state).commit(r + 1, load_model=False)
        else:
            drv.state.commit(r + 1)
        # The commit (load, digest, snapshot) is the "digest" phase; the caller's timer counts the whole
        # call as "outer_step", so the commit's seconds move from there (a float add: GIL-atomic enough
        # for the one writer, the driver's own worker thread, while the loop awaits it).
        dt, dc = time.monotonic() - t0, time.process_time() - c0
        drv.add_phase_s("digest", dt, dc)
        drv.add_phase_s("outer_step", -dt, -dc)


async def check_digest(drv: RoundDriver, r: int, participants: Sequence[str]) -> Optional[bool]:
    """This peer's digest against the majority of the round's participants (waits up to
    ``digest_wait_s`` for their records, backoff; longer for one still finishing the round:
    :func:`finishing_until`). None: nobody else to compare with.

    Each read is a fresh read of the participants' records alone (``records_of`` with the DHT's full read
    quorum), not the shared membership read: that one is reused for ``peers_max_age_s`` (0.5 s), so a record
    announced just after the check's first read was seen ~0.7 s later whatever the backoff (issue 27, session 45:
    the check took 0.69-0.71 s in most rounds of a 2-peer ``gpt2-124m`` run)."""
    t0 = drv.clock.monotonic()
    deadline = t0 + drv.cfg.digest_wait_s
    finishing = finishing_until(drv, r, t0)
    backoff = drv.backoff()
    counted = -1
    voters = list(dict.fromkeys(participants))
    settled: dict[str, PeerRecord] = {}  # voters whose record shows round r: their vote, not read again
    while True:
        # leaving peers count too (records_of includes them): their last record carries the digest they ended
        # the round with; a full read quorum, as the shared read's: a record missing from it is acted on (a
        # vote not counted). Only the voters not yet at round r are read again: a poll's read shrinks as they
        # announce (at most --full-view-peers peers run this check, each reading <= the round's voters once).
        wanted = [p for p in voters if p not in settled]
        read = {x.peer_id: x for x in await drv.membership.records_of(wanted, sampled=False) if x.peer_id in wanted}
        settled.update({p: x for p, x in read.items() if x.round == r and x.weights_digest})
        recs = list(settled.values()) + [x for p, x in read.items() if p not in settled]
        majority, agree, total = digest_majority(drv.policy.digest_voters(recs), r, behind_digest(drv, r))
        if total >= len(participants):
            break
        now = drv.clock.monotonic()
        late = any(x.round == r - 1 and x.weights_digest for x in recs)  # a voter still finishing round r - 1
        until = max(deadline, finishing) if late else deadline
        if now > until:
            break
        if total != counted:
            counted = total
            backoff.reset()
        if await drv.pause(min(backoff.next(), max(0.0, until - now) + 0.01)):
            break
    return judge_digest(drv, r, majority, agree, total)


def behind_digest(drv: RoundDriver, r: int) -> Optional[str]:
    """The start digest of round ``r - 1``'s plan this peer followed (the state a peer that applied nothing of it
    still holds: it loses a digest tie, :func:`digest_majority`); None when this peer followed no plan of ``r - 1``."""
    plan = drv._last_plan
    return plan.start_digest if plan is not None and plan.round == r - 1 else None


def finishing_until(drv: RoundDriver, r: int, t0: float) -> float:
    """Until when (monotonic seconds, from ``t0`` = now) the digest check of round ``r`` (the state after round
    ``r - 1``) waits for a voter whose live record still shows round ``r - 1``: it is finishing that round (its
    last pulls end by the exchange deadline; outer step, commit and announcement follow), until the plan's
    exchange deadline plus ``ROUND_END_SLACK_S``, the bound the next gather waits for it anyway
    (:func:`~geomesh_p2p.round.gather.finishing_waits`). ``t0`` when this peer applied no plan of round ``r - 1``.

    Why (the stalled-peer fork, docs/round.md): on a loaded host one of two voters announced its digest 3 s
    after the other; the early one's check ended at ``digest_wait_s`` with its own vote alone (None, no
    comparison) while the late one's saw both and kept its digest on the tie's break. A split round then went
    on as a fork: neither re-synced, and each trained the next round alone (the other was live, not in sync)."""
    plan = drv._last_plan
    if plan is None or plan.round != r - 1:
        return t0
    return t0 + float(plan.exchange_deadline) - drv.clock.time() + ROUND_END_SLACK_S


def judge_digest(
    drv: RoundDriver, r: int, majority: Optional[str], agree: int, total: int, of: str = ""
) -> Optional[bool]:
    """This peer's digest of round ``r`` against a :func:`digest_majority` tally (``agree`` of ``total`` votes
    for ``majority``; ``of``: what was counted, for the log line). None: nobody else to compare with; False:
    the majority holds another digest (one ERROR line, or a WARNING when this peer applied nothing of round
    ``r - 1`` and so holds its start state, behind the majority rather than apart; the caller re-syncs);
    True: confirmed."""
    if majority is None or total <= 1:
        return None
    if majority != drv.state.digest:
        # behind, not apart: this peer's round r - 1 applied nothing (every part refused or missing: its plan lost
        # the agreement, or its pulls missed the deadline), so it holds the round's start state, an ancestor of
        # the majority's; the re-sync is routine under load (WARNING). Any other digest is a state off the
        # swarm's line (ERROR).
        start = behind_digest(drv, r)
        behind = start is not None and start == drv.state.digest
        events.emit(
            log,
            logging.WARNING if behind else logging.ERROR,
            "digest_mismatch",
            f"round %d: my digest %s %s the majority's %s (%d/%d{of}); re-syncing",
            r,
            (drv.state.digest or "")[:8],
            "is the start state of the round this peer applied nothing of, behind" if behind else "differs from",
            majority[:8],
            agree,
            total,
            peer=drv.me,
            round=r,
            digest=drv.state.digest,
            majority_digest=majority,
            agree=agree,
            total=total,
            behind=behind,
        )
        return False
    drv._confirmed_round = max(drv._confirmed_round, r)
    return True
