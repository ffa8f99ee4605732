"""The node's round rules, as a mixin of :class:`~geomesh_p2p.node.peer.PeerNode` (issue 13): planning
(admission of members, penalties for failed owners and no-shows, the plan itself), the checks a
follower makes on a leader's plan, the collective's spec, the outer step per part, re-profiling (EMAs),
the state vote and the re-sync. It implements :class:`~geomesh_p2p.round.ports.RoundPolicy` and the
state half of :class:`~geomesh_p2p.round.ports.GlobalStatePort` for the driver.

Attributes it reads on the node: ``run_cfg``, ``cfg``, ``me``, ``numel``, ``round``, ``digest``, ``standing``,
``theta`` / ``outer`` (global weights [P] and outer optimizer, fp32 CPU), ``ema``, ``transport``, ``dht``,
``model``, ``trainer``, ``collective``; penalties ``_owner_penalty`` / ``_noshow_penalty`` (peer id -> last
round of the penalty).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.model import capability
from geomesh_p2p import exchange as collective
from geomesh_p2p.telemetry import events
from geomesh_p2p.plan import planner
from geomesh_p2p.sync import download as state_sync
from geomesh_p2p.status import swarm as swarm_status
from geomesh_p2p.trust import verify
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.round.driver import no_work
from geomesh_p2p.plan.agree import choose_plan
from geomesh_p2p.plan.agree import PlanDeferred
from geomesh_p2p.trust.standing import OnceLog, choose_state, would_adopt
from geomesh_p2p.sync.progress import SyncMeter

if TYPE_CHECKING:
    from geomesh_p2p.model.capability import ThroughputEMA
    from geomesh_p2p.exchange import CollectiveService
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from geomesh_p2p.dht import PeerAnnouncer
    from geomesh_p2p.telemetry.metrics import RoundLog
    from geomesh_p2p.model.optim import OuterNesterov, SyncAdamW
    from geomesh_p2p.schema.peer import PeerRecord
    from geomesh_p2p.plan.agree import PlanStore
    from geomesh_p2p.trust.standing import Standing
    from geomesh_p2p.model.state import GlobalState
    from geomesh_p2p.model.training import InnerTrainer
    from geomesh_p2p.net.transport import Transport

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["NodeRoundPolicy", "OWNER_PENALTY_ROUNDS", "outer_step_per_part"]

#: Rounds during which a peer owns no part after a part it owned had no valid result (owner gone, or a
#: result every reader refused, e.g. below the quorum). All honest peers saw the same missing part, so
#: honest leaders agree; the peer still contributes, it only stops deciding a range.
OWNER_PENALTY_ROUNDS = 5
#: Reads of the swarm's records a catch-up makes, 0.5 s apart, while no state has a majority (mid-round).
NO_MAJORITY_RETRIES = 8
#: The measured cost per element pass of the exchange moves at most this factor per round (either way).
EXCHANGE_COST_STEP = 4.0
#: Full state downloads tried before a joiner gives up: donors may leave or lag mid-download for minutes.
STATE_SYNC_ATTEMPTS = 30
#: Followers refuse a plan whose deadlines lie further ahead than PLAN_HORIZON_WINDOWS x window +
#: PLAN_HORIZON_SLACK_S (window_s None: PLAN_HORIZON_DEFAULT_WINDOW_S): a rogue leader cannot park the swarm.
PLAN_HORIZON_WINDOWS = 4
PLAN_HORIZON_SLACK_S = 120.0
PLAN_HORIZON_DEFAULT_WINDOW_S = 60.0
#: A leader's own exchange timeout stays under this share of that horizon, so its followers accept the plan.
EXCHANGE_HORIZON_SHARE = 0.9
#: The exchange timeout is at least max(EXCHANGE_FLOOR_S, EXCHANGE_FLOOR_PLAN_TIMEOUTS x --plan-timeout-s).
EXCHANGE_FLOOR_S = 5.0
EXCHANGE_FLOOR_PLAN_TIMEOUTS = 3
#: The pushes close this share of the exchange before its deadline: the last part is left to the pulls.
PULL_SHARE_OF_EXCHANGE = 0.25
#: Seconds between reads of the swarm's plans while a sync runs: the donors' busy windows (their exchange
#: deadlines) that the download's stall clock waits for (state_sync.BusyFn).
BUSY_REFRESH_S = 1.0


def plan_horizon_s(window_s: Optional[float]) -> float:
    """Seconds ahead of now that a plan's deadlines may lie (followers refuse farther ones)."""
    return PLAN_HORIZON_WINDOWS * (window_s or PLAN_HORIZON_DEFAULT_WINDOW_S) + PLAN_HORIZON_SLACK_S


def outer_step_per_part(
    outer,
    theta: torch.Tensor,
    aggregate: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    r: int,
    idle: Sequence[tuple[int, int]] = (),
) -> tuple[list, set]:
    """Apply ``outer``'s step (OuterNesterov / SyncAdamW: element-wise) part by part, in place.

    Each part ``[s, e)`` of ``ranges`` steps on a private copy of its slices of ``theta`` and of the k
    optimizer-state slices (``outer.buf``: k consecutive [P] slices, Nesterov momentum or AdamW m then v),
    written back only when every new value is finite; a part whose aggregate is not finite is not stepped.
    Elements in ``idle`` ranges keep weights and state. Peak extra memory is (1 + k) x the largest part
    (not (1 + k) x P: 1.2 GB at 150M parameters). Bitwise equal to one whole-vector step on the parts
    that step (the ops are element-wise).

    Args:
        theta: [P] fp32 CPU global weights (modified in place).
        aggregate: [P] fp32 CPU, not modified.
    Returns:
        (parts skipped, sorted; the subset of them skipped for a non-finite aggregate).
    """
    p = theta.numel()
    if outer.buf is None:
        outer.buf = torch.zeros(p * int(getattr(outer, "state_factor", 1)), dtype=torch.float32)
    buf = outer.buf
    k = buf.numel() // p if p else 0
    steps_after = None
    bad, bad_in = [], set()
    for s, e in ranges:
        if not bool(torch.isfinite(aggregate[s:e]).all()):
            bad.append((s, e))
            bad_in.add((s, e))
            continue
        part = copy.copy(outer)  # shares lr / momentum / schedule; its buffer is this part's own copy
        part.buf = torch.cat([buf[j * p + s : j * p + e] for j in range(k)]) if k else None
        if getattr(outer, "decay_mask", None) is not None:
            part.decay_mask = outer.decay_mask[s:e]
        new = theta[s:e].clone()
        part.step(new, aggregate[s:e].contiguous(), round=r)
        steps_after = part.steps
        if not bool(torch.isfinite(new).all()) or (part.buf is not None and not bool(torch.isfinite(part.buf).all())):
            bad.append((s, e))
            continue
        n = e - s
        for i0, i1 in idle:  # idle elements keep their values
            a0, a1 = max(i0, s), min(i1, e)
            if a0 < a1:
                new[a0 - s : a1 - s] = theta[a0:a1]
                for j in range(k):
                    part.buf[j * n + a0 - s : j * n + a1 - s] = buf[j * p + a0 : j * p + a1]
        theta[s:e] = new
        for j in range(k):
            buf[j * p + s : j * p + e] = part.buf[j * n : (j + 1) * n]
    if steps_after is None:  # no part stepped: the step count still advances, as a whole-vector step would
        part = copy.copy(outer)
        part.buf = torch.zeros(0) if k else None
        if getattr(outer, "decay_mask", None) is not None:
            part.decay_mask = outer.decay_mask[:0]
        part.step(theta[:0].clone(), aggregate[:0].contiguous(), round=r)
        steps_after = part.steps
    outer.steps = steps_after
    return sorted(bad), bad_in


class _NoOwner(Exception):
    """:meth:`NodeRoundPolicy._make_plan`: no member to plan has an address (nobody can own a part)."""


class NodeRoundPolicy:
    """Mixin of :class:`~geomesh_p2p.node.peer.PeerNode`: the round rules (see the module docstring)."""

    # What the mixin reads on the node (set by PeerNode.__init__ / start; declared for the type checker
    # only: annotations without values create no class attributes, so getattr(self, name, None) still works).
    run_cfg: RunConfig
    cfg: NodeConfig
    me: str
    round: int
    digest: Optional[str]
    numel: int
    state_numel: int
    theta: Optional[torch.Tensor]  # [P] fp32 CPU, None until the global state exists
    gstate: GlobalState  # the one buffer theta and the outer state are views of
    outer: Optional[OuterNesterov | SyncAdamW]
    ema: Optional[ThroughputEMA]
    standing: Standing
    transport: Optional[Transport]
    trainer: InnerTrainer
    collective: CollectiveService
    announcer: PeerAnnouncer
    plans: PlanStore  # the run's signed plans (read while a sync runs: the donors' busy windows)
    round_log: Optional[RoundLog]  # None once shut down
    codec_s_per_element: float
    _stop: asyncio.Event
    _syncing: bool
    _sync_meter: Optional[SyncMeter]
    _measured: set[str]
    _owner_penalty: dict[str, int]
    _noshow_penalty: dict[str, int]
    _supported_tps: tuple[int, dict[str, float]]
    _exchange_cost_measured: bool
    _vote_log: OnceLog
    _work_verifier: Optional[verify.WorkVerifier]
    _verify_task: Optional[asyncio.Future]

    if TYPE_CHECKING:  # PeerNode's methods the mixin calls (not defined here: PeerNode's own must be found)

        async def peers(self, include_leaving: bool = False) -> list[PeerRecord]: ...

        async def announce(self) -> None: ...

        def my_record(self) -> PeerRecord: ...

        def _set_state(self, round: int, theta: torch.Tensor, momentum: Optional[torch.Tensor]) -> None: ...

        def _started_transport(self) -> Transport: ...

    def _global_theta(self) -> torch.Tensor:
        """The global weights ``self.theta``: [P] fp32 CPU.

        Raises:
            RuntimeError: the global state does not exist yet (called before the node built it in ``start``).
        """
        if self.theta is None:
            raise RuntimeError("the global weights do not exist yet (the node has not built its training state)")
        return self.theta

    def _throughput_ema(self) -> ThroughputEMA:
        """``self.ema``: the re-profiled tokens/s and link figures.

        Raises:
            RuntimeError: before the node's start-up profile (``start``) created it.
        """
        if self.ema is None:
            raise RuntimeError("the throughput EMAs do not exist yet (the node has not profiled its device)")
        return self.ema

    # ------------------------------------------------------------------ RoundPolicy port
    def make_plan(self, members, leader):
        """This peer's plan when it leads (:meth:`_make_plan`).

        Raises :class:`~geomesh_p2p.plan.agree.PlanDeferred` when no member to plan can own a part
        (every one client-only, e.g. a lone peer nobody can dial, or on probation): it says so in one
        WARNING when that starts and one INFO when it ends, not at every retry (issue 14 #10)."""
        try:
            plan = self._make_plan(members, leader)
        except _NoOwner as e:
            if getattr(self, "_no_owner", False) is False:
                log.warning("round %d: no reachable peer can own a part (%s): waiting for one", self.round, e)
            self._no_owner = True
            raise PlanDeferred(str(e)) from None
        if getattr(self, "_no_owner", False):
            log.info("round %d: a peer can own a part again: planning", self.round)
        self._no_owner = False
        return plan

    def plan_problem(self, plan, live: dict) -> Optional[str]:
        """Why this peer refuses ``plan``: :meth:`_plan_problem`, then verified work's objection."""
        return self._plan_problem(plan, live) or self._verified_plan_problem(plan)

    def leader_candidates(self, members, live: dict):
        """(members without the peers verified work excluded, the established ones that may lead)."""
        members = self._verified_members(members)
        return members, pb.leader_candidates(
            self._standing_view(list(live.values())), [m.peer_id for m in members], barred=self._noshows()
        )

    def collective_spec(self, plan):
        return self._collective_spec(plan)

    def swarm_round(self, records) -> Optional[int]:
        return self._swarm_round(records)

    def standing_established(self, records, peer_id: str) -> bool:
        return self._standing_view(records).established(peer_id)

    def after_exchange(self, spec, plan, ar) -> None:
        self.note_own_failures(spec, plan, ar)
        self._note_failed_owners(spec, ar)
        self._note_no_shows(plan, ar)
        self._update_exchange_cost(spec, ar)

    def _marks_noted(self) -> dict[tuple[str, str], int]:
        """(penalty kind "owner" | "noshow", peer id) -> the round in which this peer noted that penalty."""
        noted = self.__dict__.get("_marks_noted_at")
        if noted is None:
            noted = self.__dict__["_marks_noted_at"] = {}
        return noted

    def forget_marks_since(self, round: int) -> list[str]:
        """Drop the owner and no-show penalties this peer noted in round ``round`` or later (the driver calls it
        after a re-sync to a state this peer did not make: those rounds were of a lineage the swarm never
        confirmed, e.g. every part failed while this peer itself was stalled). A penalty noted earlier and
        renewed in such a round goes too (the renewal replaced it). This peer's penalties on itself are not
        noted here: they are the others' view of its own failures, which they keep. Returns the peer ids whose
        marks went."""
        noted = self._marks_noted()
        gone = [(kind, pid) for (kind, pid), r in noted.items() if r >= round]
        pens = {"owner": getattr(self, "_owner_penalty", {}), "noshow": self._noshows()}
        for kind, pid in gone:
            pens[kind].pop(pid, None)
            del noted[(kind, pid)]
        return sorted({pid for _, pid in gone})

    async def before_outer_step(self, r, plan, assignment, ar) -> None:
        """Verified work keeps round ``r``'s start weights: copied in a worker thread (a whole-model copy)."""
        theta0 = await asyncio.to_thread(self._global_theta().clone) if getattr(ar, "contributions", None) else None
        if theta0 is not None and getattr(self, "_work_verifier", None) is None:
            # Its private copy of the model (a whole-model deepcopy) is made in a worker thread, not on the loop.
            self._work_verifier = await asyncio.to_thread(verify.WorkVerifier.for_node, self)
        self._verify_round(r, plan, assignment, ar, theta0=theta0)

    def after_outer_step(self, r, plan, assignment, result, ar) -> None:
        """Re-profile before round r+1 is announced: its leader then plans with the figures every follower
        checks the plan against (planner.check_plan); delivered rates; standing credits (standing.py)."""
        self._update_throughput(assignment.micro_batch, result)
        self._update_links(ar)
        self._supported_tps = (r, self._delivered_rates(plan, ar))
        self.standing.credit(r, {pid for part in ar.contributors.values() for pid, _ in part})

    def publish_record(self, rec) -> None:
        """The round's row to the log, Prometheus and the status page. Raises RuntimeError after shutdown
        (the round log is closed)."""
        if self.round_log is None:
            raise RuntimeError(f"round {rec.round}: the round log is closed (the node is shut down)")
        self.round_log.add(rec)
        swarm_status.publish_round_summary(self, rec)  # the bootstrap's status page (issue 16)

    # ------------------------------------------------------------------ outer step
    def _outer_step(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """Apply the outer step to ``self.theta`` / ``self.outer.buf`` part by part
        (:func:`outer_step_per_part`): parts whose aggregate has a non-finite value, or whose new weights
        or optimizer state would not be finite, keep their values (one WARNING line). Every honest peer
        holds the same weights, state and aggregate bytes, so every one skips the same parts and the
        digests stay equal. Parts: the plan's owner ranges, ``[start, end)`` elements of ``[P]``.

        ``idle``: ranges that aggregated no token (missing parts, rounds nobody trained in): weights and
        outer momentum stay as they were there (issue 14 #8: momentum alone must not move the model
        through rounds that trained nothing); one INFO line. Synchronous: the driver runs it in a thread."""
        theta = self._global_theta()
        p = theta.numel()
        if idle:
            n_idle = sum(e - s for s, e in idle)
            events.emit(
                log,
                logging.INFO,
                "idle_parts_unchanged",
                "round %d: %d of %d elements aggregated no token (%s); weights and outer momentum unchanged there",
                r,
                n_idle,
                p,
                "the whole model" if n_idle >= p else f"{len(idle)} part(s)",
                peer=self.me,
                round=r,
                idle=[[s, e] for s, e in idle],
                idle_elements=n_idle,
                elements=p,
            )
            if n_idle >= p:
                return
        ranges = [(start, end) for _, start, end in plan.owners()] or [(0, p)]
        bad, bad_in = outer_step_per_part(self.outer, theta, aggregate, ranges, r, idle)
        if bad:
            events.emit(
                log,
                logging.WARNING,
                "outer_step_skipped",
                "round %d: outer step skipped on %d of %d parts (%d of %d elements): %d with non-finite "
                "aggregate values, %d where the step would overflow",
                r,
                len(bad),
                len(ranges),
                sum(e - s for s, e in bad),
                p,
                len(bad_in),
                len(bad) - len(bad_in),
                peer=self.me,
                round=r,
                skipped=[[s, e] for s, e in bad],
                not_finite=[[s, e] for s, e in bad_in],
                parts=len(ranges),
                elements=p,
            )

    outer_step = _outer_step

    # ------------------------------------------------------------------ moved from node.py
    async def _catch_up(self) -> None:
        """Bring this peer to the state the swarm's vote backs (late join, planned out, digest mismatch):
        weighted by standing once this peer knows who delivered, else by distinct addresses with history
        (standing.py).

        Incremental (issue 14 #3): a state of an earlier round -- this peer's own when it is of the swarm's
        lineage (planned out), or one it downloaded while the swarm moved on -- is brought forward by the
        donors' outer updates (:func:`state_sync.catch_up_updates`, each checked against the digests, the
        last against the digest the vote backs); the whole state is downloaded only when no such base
        exists or the updates are refused (one INFO line with the reason). A download crossing a round
        boundary finishes from the donors' kept copy of its round. ``self.sync_stats`` counts full downloads
        and updates applied."""
        stats = self.__dict__.setdefault("sync_stats", {"downloads": 0, "updates": 0, "refused": 0})
        self._syncing = True
        busy: dict[str, float] = {}  # donor address -> swarm seconds it is busy with its own round until
        watcher = asyncio.ensure_future(self._watch_busy_donors(busy)) if getattr(self, "plans", None) else None
        start_round = self.round
        gs = getattr(self, "gstate", None)  # None: a node built without a model (tests of the vote)
        held_round, held_digest = (gs.round, gs.digest) if gs is not None else (self.round, None)
        base: Optional[state_sync.Snapshot] = None
        own_tried = False
        downloaded: Optional[state_sync.Snapshot] = None  # the last full download, kept whole
        caught_from: Optional[int] = None  # the round the incremental catch-up started from
        try:
            for attempt in range(STATE_SYNC_ATTEMPTS):
                if self._stop.is_set():
                    return
                # leaving peers vote and donate too: they serve their last state until they exit, and a peer
                # stalled while the swarm finished must catch up to it rather than train alone (docs/round.md)
                recs = [r for r in await self.peers(include_leaving=True) if r.peer_id != self.me]
                choice = self._state_vote(recs).choice
                if choice is None:
                    # No state has a majority: mostly a moment mid-round, when the others announce round r+1 one
                    # by one. Read again a few times; returning at once left a planned-out peer announcing a
                    # round whose state it does not hold, and it forked by leading that round alone.
                    if attempt < NO_MAJORITY_RETRIES:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), 0.5)
                        continue
                    if base is not None and (base is downloaded or caught_from is not None):
                        await self._adopt(
                            base,
                            "downloaded"
                            if caught_from is None
                            # nobody backs a state
                            else f"caught up from round {caught_from} by {base.round - caught_from} outer update(s)",
                        )  # now: keep what was verified against the swarm
                        return
                    self.round = held_round if held_digest else start_round  # the round of the state it holds
                    return
                if held_digest and choice.round < held_round:
                    # The vote backs an OLDER state than the one this peer holds (rs7: the round-10 donors
                    # left, a live peer at round 5 remained): never back, unless it is the only way to rejoin.
                    why = self._why_not_back(choice, recs, held_round, held_digest)
                    if why is not None:
                        if (
                            base is not None
                            and base.round > held_round
                            and (base is downloaded or caught_from is not None)
                        ):
                            await self._adopt(base, "downloaded" if caught_from is None else "caught up")
                            return  # verified against the vote that brought it here: newer than the state held
                        self._back_log()(
                            ("not_back", held_round, held_digest, choice.round, choice.digest),
                            logging.INFO,
                            "keeping the state of round %d (digest %s): the swarm's vote backs the state of "
                            "round %d (digest %s), an OLDER one, and %s",
                            held_round,
                            held_digest[:8],
                            choice.round,
                            choice.digest[:8],
                            why,
                            event="older_state_declined",
                            peer=self.me,
                            round=choice.round,
                            digest=choice.digest,
                            held_round=held_round,
                            held_digest=held_digest,
                            reason=why,
                        )
                        self.round = held_round
                        return
                    if choice.digest != held_digest:
                        self._note_going_back(choice, recs, held_round, held_digest)
                if choice.digest == self.digest and base is None:
                    # This peer holds the backed state already (its digest check was outvoted by identities
                    # without standing, or the others have not moved on yet).
                    self.round = choice.round
                    return
                top, donors = choice.round, choice.donors
                self.round = top
                # (a fresh peer's round-0 state, or one older than the donors keep updates for, is not tried)
                if (
                    base is None
                    and not own_tried
                    and held_digest
                    and 0 < held_round < top
                    and top - held_round <= state_sync.DEFAULT_KEEP_UPDATES
                ):
                    own_tried = True  # this peer's own state may be of the swarm's lineage: try the updates
                    base = await asyncio.to_thread(self._state_copy)
                if base is not None and base.round == top and base.digest == choice.digest:
                    await self._adopt(
                        base,
                        "downloaded"
                        if caught_from is None
                        else f"caught up from round {caught_from} by {top - caught_from} outer update(s)",
                    )
                    return
                if base is not None and base.round < top:
                    from_round = base.round
                    # progress announced as for a download (the leader's wait follows it); the size is estimated
                    # as P bytes per update (a sign-compressed swarm's zlib blob is ~0.25 x 4P)
                    self._sync_meter = SyncMeter(
                        max(1, (top - from_round) * self.numel),
                        on_progress=lambda: self.announcer.update(self.my_record),
                    )
                    await self.announce()
                    log.info(
                        "catching up from round %d to %d by %d outer update(s) from %d donor(s)",
                        from_round,
                        top,
                        top - from_round,
                        len(donors),
                    )
                    work = await asyncio.to_thread(self._snapshot_copy, base)  # kept whole if an update is refused
                    try:
                        snap = await state_sync.catch_up_updates(
                            self._sync_meter.wrap(self.transport),
                            donors,
                            work,
                            target_round=top,
                            target_digest=choice.digest,
                            outer=self.outer,
                            busy_until=lambda d: busy.get(d, 0.0),
                        )
                    except state_sync.StateSyncError as e:
                        stats["refused"] += 1
                        # every donor was tried (fetch_update): the updates are gone or refused, or this
                        # peer's own state is not of the swarm's lineage: the whole state it is
                        log.info(
                            "incremental catch-up from round %d to %d refused (%s); downloading the state",
                            from_round,
                            top,
                            e,
                        )
                        base, caught_from = None, None
                        continue
                    stats["updates"] += top - from_round
                    caught_from = from_round if caught_from is None else caught_from
                    # not adopted yet: the swarm may have sealed another round meanwhile; the next pass adopts
                    # this state or brings it further (no copy into the model, no evaluation in between)
                    base = snap
                    continue
                # the record announces the download's progress: the leader's wait for it follows (issue 14 #3)
                self._sync_meter = SyncMeter(
                    (self.numel + self.state_numel) * 4, on_progress=lambda: self.announcer.update(self.my_record)
                )
                await self.announce()  # tell the leader we are syncing for this round
                log.info(
                    "downloading the state of round %d (%d bytes) from %d donor(s)",
                    top,
                    (self.numel + self.state_numel) * 4,
                    len(donors),
                )
                try:
                    snap = await state_sync.download_state(
                        self._sync_meter.wrap(self.transport),
                        donors,
                        round=top,
                        numel=self.numel,
                        expected_digest=choice.digest,
                        state_numel=self.state_numel,
                        busy_until=lambda d: busy.get(d, 0.0),
                    )
                except state_sync.StateSyncError as e:
                    log.info("state download for round %d failed (%s); retrying", top, e)
                    await asyncio.sleep(0.5)
                    continue
                stats["downloads"] += 1
                events.emit(
                    log,
                    logging.INFO,
                    "state_downloaded",
                    "downloaded state of round %d from %d donor(s), digest %s; %s",
                    top,
                    len(donors),
                    snap.digest[:8],
                    choice.describe(),
                    peer=self.me,
                    round=top,
                    donors=list(donors),
                    digest=snap.digest,
                    vote=choice.mode,
                )
                base = downloaded = snap  # the next pass adopts it, or brings it to the round the swarm moved on to
            self.round = held_round if held_digest else start_round  # nothing adopted: it holds its own state
            raise state_sync.StateSyncError(
                f"could not download the swarm's state after {STATE_SYNC_ATTEMPTS} attempts; see the log for why"
            )
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            self._syncing, self._sync_meter = False, None
            await self.announce()

    def _why_not_back(self, choice, recs, held_round: int, held_digest: str) -> Optional[str]:
        """Why this peer must not adopt ``choice`` (a state of a round below ``held_round``, the round of the
        state it holds), or None when going back is the only way to rejoin the live swarm.

        It waits (keeps its state, announced with its digest, so peers behind can download it) when:

        * a live peer (not leaving) announces round ``held_round`` or later, with a digest or syncing: newer
          donors are there or may come back (a failed download, a donor restarting);
        * a live peer backing ``choice`` would adopt this peer's state by its own vote
          (:func:`~geomesh_p2p.trust.standing.would_adopt`, read from its record's attestations): the swarm behind
          can come up to this peer (rs7: the peer at round 5 had seen this one deliver).

        ``recs``: the other peers' records, leaving ones included. A state whose digest is the one held
        (rounds that moved nothing) is never adopted at a lower round either."""
        if choice.digest == held_digest:
            return "it is this peer's own state (rounds that changed nothing)"
        newer = sorted(r.peer_id for r in recs if not r.leaving and r.round >= held_round)
        if newer:
            return (
                f"{len(newer)} live peer(s) announce round {held_round} or later ({', '.join(p[:10] for p in newer[:5])}): "
                "waiting for the newer state"
            )
        try:
            address = getattr(self, "record_address", None)
        except Exception:  # no transport yet (a node built without one): only the vote's address key differs
            address = None
        mine = SimpleNamespace(
            peer_id=self.me,
            address=address or "this-peer",
            round=held_round,
            weights_digest=held_digest,
            standing={},
            leaving=False,
        )
        backers = [r for r in recs if not r.leaving and (r.round, r.weights_digest) == (choice.round, choice.digest)]
        coming = sorted(
            b.peer_id
            for b in backers
            if would_adopt(b, [x for x in recs if x.peer_id != b.peer_id] + [mine], held_round, held_digest)
        )
        if coming:
            return (
                f"{len(coming)} live peer(s) at round {choice.round} ({', '.join(p[:10] for p in coming[:5])}) would "
                f"adopt this peer's state by their own vote: waiting for them to catch up to round {held_round}"
            )
        return None

    def _back_log(self) -> LogOnce:
        """Logs each decision about an older state once (a catch-up retried every few seconds repeats it)."""
        once = self.__dict__.get("_back_once")
        if once is None:
            once = self.__dict__["_back_once"] = LogOnce(log)
        return once

    def _note_going_back(self, choice, recs, held_round: int, held_digest: str) -> None:
        """The one WARNING (``older_state_adopted``, once per pair of states) of a peer that adopts an older
        state: the only way to rejoin the live swarm (:meth:`_why_not_back` found no reason to wait)."""
        live = sorted({r.peer_id for r in recs if not r.leaving and r.weights_digest})
        self._back_log()(
            ("back", held_round, held_digest, choice.round, choice.digest),
            logging.WARNING,
            "going back from the state of round %d (digest %s) to the OLDER state of round %d (digest %s): no "
            "live peer is at round %d or later, and none of the %d live peer(s) at round %d would adopt this "
            "peer's state; the only way to rejoin the live swarm (%s)",
            held_round,
            held_digest[:8],
            choice.round,
            choice.digest[:8],
            held_round,
            len(live),
            choice.round,
            choice.describe(),
            event="older_state_adopted",
            peer=self.me,
            round=choice.round,
            digest=choice.digest,
            held_round=held_round,
            held_digest=held_digest,
            live=live,
        )

    async def _watch_busy_donors(self, busy: dict[str, float]) -> None:
        """While a sync runs: every ``BUSY_REFRESH_S``, the plans of the round being synced to and the next
        one (the donors' rounds) set ``busy[address]`` to that plan's exchange deadline for each participant
        (addresses from the live records, else the plan's), capped at the plan horizon followers accept. A plan
        whose deadlines followers refuse (farther than that horizon) is ignored: the cap alone is re-read from
        "now" every refresh, so such a rogue plan held its donors busy for as long as it stayed in the DHT.
        A failed read keeps the figures it had."""
        while True:
            try:
                addr = {r.peer_id: r.address for r in await self.peers(include_leaving=True) if r.address}
                now = swarm_time()
                horizon = plan_horizon_s(self.run_cfg.window_s)
                for rnd in (self.round, self.round + 1):
                    # Deadlines farther than the horizon: refused by every follower (_plan_problem), so no
                    # evidence of a busy donor (and not allowed to hide the round's real plan either).
                    sane = [
                        p
                        for p in await self.plans.read(rnd)
                        if float(p.train_deadline) - now <= horizon
                        and float(p.exchange_deadline) - float(p.train_deadline) <= horizon
                    ]
                    plan = choose_plan(self.run_cfg.run_id, rnd, sane)
                    if plan is None:
                        continue
                    end = min(float(plan.exchange_deadline), now + horizon)
                    for a in plan.assignments:
                        where = addr.get(a.peer_id) or a.address
                        if where:
                            busy[where] = max(busy.get(where, 0.0), end)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a DHT hiccup: the download keeps the plain stall limits meanwhile
                log.debug("reading the donors' plans failed: %r", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), BUSY_REFRESH_S)
            if self._stop.is_set():
                return

    def _state_copy(self) -> "state_sync.Snapshot":
        """This peer's global state as a Snapshot owning a copy of the buffer (worker thread).

        Raises:
            RuntimeError: the state has no digest yet (it was never committed: nothing of the swarm's lineage).
        """
        gs = self.gstate
        with gs.lock:
            if gs.digest is None:  # _catch_up asks only for a committed state
                raise RuntimeError("this peer's global state has no digest yet: it cannot be a base to catch up from")
            return self._snapshot_copy(
                state_sync.Snapshot(gs.round, gs.theta, gs.opt_state, gs.digest, buffer=gs.buffer)
            )

    @staticmethod
    def _snapshot_copy(snap: "state_sync.Snapshot") -> "state_sync.Snapshot":
        """``snap`` with a buffer of its own ((1 + k) * P * 4 bytes; worker thread).

        Raises:
            ValueError: ``snap`` has no ``buffer`` (a snapshot not backed by one contiguous state buffer).
        """
        if snap.buffer is None:
            raise ValueError(f"the snapshot of round {snap.round} has no contiguous buffer to copy")
        buf = snap.buffer.clone()
        P = snap.theta.numel()
        return state_sync.Snapshot(snap.round, buf[:P], buf[P:], snap.digest, buffer=buf)

    async def _adopt(self, snap: "state_sync.Snapshot", how: str) -> None:
        """Make ``snap`` this peer's state (worker thread for the copy); one INFO line."""
        await asyncio.to_thread(self._set_state, snap.round, snap.theta, snap.momentum)
        log.info("state of round %d adopted (%s), digest %s", snap.round, how, (self.digest or "")[:8])

    async def _behind(self) -> bool:
        """True when the swarm already holds the state of a later round (this peer must catch up)."""
        sr = self._swarm_round(await self.peers(include_leaving=True))  # leaving peers show the swarm's round
        return sr is not None and sr > self.round

    def _swarm_round(self, recs) -> Optional[int]:
        """The round the other peers are at: the round of the state their vote backs (standing.choose_state),
        None when no state is backed by more than half of the vote. Votes count work, not identities: a
        peer that trained weighs each record by the rounds it saw that peer deliver (30 fresh identities
        announcing round+1 weigh nothing); a fresh peer counts distinct addresses, preferring peers others
        vouch for. One record alone cannot drag a peer to a round nobody else is at."""
        vote = self._state_vote(recs)
        return vote.choice.round if vote.choice is not None else None

    def _state_vote(self, recs):
        """:func:`~geomesh_p2p.trust.standing.choose_state` for this peer; logs once a state that most identities
        announce but the standing this peer sees does not back, when it would have moved this peer."""
        vote = choose_state(
            recs, me=self.me, standing=getattr(self, "standing", None), trained=bool(getattr(self, "history", None))
        )
        ref = vote.refusal
        if ref is not None:
            mine = (getattr(self, "round", 0), getattr(self, "digest", None))
            if ref.round > mine[0] or (ref.round == mine[0] and ref.digest != mine[1]):
                if getattr(self, "_vote_log", None) is None:
                    self._vote_log = OnceLog()
                self._vote_log(
                    ("refused", ref.round, ref.digest),
                    logging.WARNING,
                    "%s",
                    ref.message(),
                    event="state_refused",
                    peer=self.me,
                    round=ref.round,
                    digest=ref.digest,
                    identities=ref.identities,
                    backing=ref.backing,
                    total=ref.total,
                )
        return vote

    @property
    def method_rule(self) -> MethodRule:
        """What the run's method means for a round (encodings, balanced or uniform, part alignment)."""
        return MethodRule.from_run(self.run_cfg)

    def _plan_config(self, n_peers: int):
        r, rule = self.run_cfg, self.method_rule
        payload = rule.payload_bytes(self.numel, n_peers)
        return PlanConfig(
            seq_len=r.seq_len,
            target_batch=r.target_batch,
            window_s=r.window_s,
            part_align=rule.part_align,
            comm_share=r.comm_share,
            payload_bytes=payload,
            mode=r.mode,
            method=r.method,
            uniform_inner_steps=r.uniform_inner_steps,
            max_inner_steps=r.max_inner_steps,
            exchange_timeout_s=self._exchange_window(n_peers, payload),
        )

    def _exchange_window(self, n_peers: int, payload_bytes: int) -> float:
        """Seconds from a plan's train deadline to its exchange deadline (this peer's plans; followers check
        only that it is not unreasonably far): :func:`planner.exchange_timeout` of this peer's predicted
        exchange, network (its link EMAs) plus CPU (:func:`planner.exchange_cpu_s` at its measured cost per
        element pass, :meth:`_update_exchange_cost`), at least ``max(5, 3 x --plan-timeout-s)`` and at most
        90% of the horizon followers accept (``4 x window + 120 s``). The CPU part grows with the model
        (encoding, signing, verifying and aggregating every element)."""
        floor = max(EXCHANGE_FLOOR_S, EXCHANGE_FLOOR_PLAN_TIMEOUTS * self.cfg.plan_timeout_s)
        cost = getattr(self, "codec_s_per_element", None)
        if not cost or not getattr(self, "numel", 0):
            return floor
        ema = getattr(self, "ema", None)
        up = (getattr(ema, "upload_bps", None) or 0) or 1e8
        down = (getattr(ema, "download_bps", None) or 0) or 1e8
        comm = payload_bytes / up + payload_bytes / down
        cpu = planner.exchange_cpu_s(self.numel, max(1, n_peers), self.run_cfg.mode, cost)
        # Never past what followers accept (_plan_problem: "deadlines unreasonably far"), with 10% to spare.
        horizon = EXCHANGE_HORIZON_SHARE * plan_horizon_s(self.run_cfg.window_s)
        return max(floor, min(planner.exchange_timeout(comm, cpu, floor), horizon))

    def _update_exchange_cost(self, spec, ar) -> None:
        """Fold this round's exchange into ``codec_s_per_element`` (seconds per element pass), as the link
        EMAs fold its transfers: the call's wall time less the wait for the last contributor to finish
        computing and less the network busy time, over the round's element passes. The first sample
        replaces the start-up calibration (taken alone); later ones move the figure by an EMA (alpha 0.5),
        at most ``EXCHANGE_COST_STEP`` x either way per round. Skipped for a call without a wall time."""
        cur = getattr(self, "codec_s_per_element", None)
        wall = float(getattr(ar, "wall_s", 0.0) or 0.0)
        if not cur or wall <= 0 or not self.numel:
            return
        t0 = swarm_time() - wall  # last_compute_end is swarm time
        wait = max(0.0, min(wall, float(ar.last_compute_end or 0.0) - t0))
        net = sum(x.seconds for x in (ar.upload, ar.download) if x is not None)
        cpu = max(0.0, wall - wait - net)
        sample = cpu / (self.numel * planner.exchange_passes(max(1, len(spec.participants)), spec.mode))
        first = not getattr(self, "_exchange_cost_measured", False)
        self._exchange_cost_measured = True
        sample = min(max(sample, cur / EXCHANGE_COST_STEP), cur * EXCHANGE_COST_STEP)
        self.codec_s_per_element = sample if first else 0.5 * cur + 0.5 * sample
        log.debug(
            "round %d: exchange %.2fs (%.2fs waiting, %.2fs network): %.2f ns per element pass, EMA %.2f ns",
            spec.round,
            wall,
            wait,
            net,
            sample * 1e9,
            self.codec_s_per_element * 1e9,
        )

    def note_own_failures(self, spec, plan, ar, *, stalled: bool = False) -> None:
        """Penalties the other peers give this peer for round ``plan.round``, taken on by itself so that its
        plans and checks agree with theirs (one INFO line each when it starts):

        * its own parts with no valid result: every other peer bars it from owning for
          ``OWNER_PENALTY_ROUNDS`` rounds (:meth:`_note_failed_owners`); barred in its own view too, it
          plans itself client-only and accepts their plans that give it no part (planner.check_plan);
        * a participant in no part's contributors (``stalled``: it pushed nothing in time, whatever its own
          view of the parts): they mark it a no-show (:meth:`_note_no_shows`), refuse its plans and do not
          plan it; marked in its own view too, it does not lead meanwhile (leader_candidates' ``barred``).

        The driver calls it alone (``stalled=True``) for a round this peer was stalled through: its view
        of the others is void then, its own failures are real for everyone."""
        self._note_own_no_show(plan, ar, stalled)
        for j in ar.missing_parts:
            if spec.owners[j].peer_id != self.me:
                continue
            if self.me not in self._owner_penalty:
                log.info(
                    "round %d: this peer's own part %d had no valid result; the others bar it from owning a "
                    "part for the next %d rounds, and so does it",
                    spec.round,
                    j,
                    OWNER_PENALTY_ROUNDS,
                )
            self._owner_penalty[self.me] = spec.round + OWNER_PENALTY_ROUNDS

    def _note_own_no_show(self, plan, ar, stalled: bool) -> None:
        """:meth:`note_own_failures`' no-show half."""
        me = getattr(self, "me", None)
        if me is None or me not in plan.participants():
            return
        if not stalled and me not in pb.absent_participants(plan.participants(), ar.contributors):
            return
        pen = self._noshows()
        rounds = pb.noshow_penalty_rounds(me in set(plan.probation()))
        if me not in pen:
            log.info(
                "round %d: this peer contributed to no part the others applied; they do not plan it nor "
                "follow its plans for the next %d rounds, so it does not lead meanwhile",
                plan.round,
                rounds,
            )
        pen[me] = plan.round + rounds

    def _note_failed_owners(self, spec, ar) -> None:
        """Owners of parts with no valid result this round own no part for ``OWNER_PENALTY_ROUNDS`` rounds
        (this peer's own parts: :meth:`note_own_failures`)."""
        for j in ar.missing_parts:
            pid = spec.owners[j].peer_id
            if pid == self.me:
                continue
            if pid not in self._owner_penalty:
                log.warning(
                    "round %d: part %d of %s had no valid result; it owns no part for the next %d rounds",
                    spec.round,
                    j,
                    pid[:10],
                    OWNER_PENALTY_ROUNDS,
                )
            self._owner_penalty[pid] = spec.round + OWNER_PENALTY_ROUNDS
            self._marks_noted()[("owner", pid)] = spec.round

    def _without_parts(self, members, probation=()):
        """``members`` with the peers under an owner penalty planned as client-only (they own no part),
        unless that would leave no owner at all; peers on ``probation`` always own no part."""
        self._owner_penalty = {p: until for p, until in self._owner_penalty.items() if until >= self.round}
        if probation:
            members = [
                m.model_copy(update={"address": None}) if m.peer_id in probation and m.address else m for m in members
            ]
        barred = [m for m in members if m.peer_id in self._owner_penalty and m.address]
        if not barred or all(m in barred or not m.address for m in members):
            return members
        return [m.model_copy(update={"address": None}) if m in barred else m for m in members]

    def _noshows(self) -> dict[str, int]:
        """Peers under a no-show penalty this round (peer id -> last round of it); expired ones dropped."""
        pen = getattr(self, "_noshow_penalty", None)
        if pen is None:
            pen = self._noshow_penalty = {}
        for p in [p for p, until in pen.items() if until < self.round]:
            del pen[p]
        return pen

    def _note_no_shows(self, plan, ar) -> None:
        """Participants of ``plan`` in no aggregate this node applied are not planned (nor leader
        candidates) for ``probation.noshow_penalty_rounds`` rounds. Every honest peer applied the same
        aggregates, so honest leaders agree. Nothing is concluded when no part had a result."""
        pen = self._noshows()
        marked = set(plan.probation())
        for pid in pb.absent_participants(plan.participants(), ar.contributors):
            if pid == getattr(self, "me", None):
                continue
            rounds = pb.noshow_penalty_rounds(pid in marked)
            if pid not in pen:
                log.log(
                    logging.INFO if pid in marked else logging.WARNING,
                    "round %d: %s%s was planned and contributed to no part; not planned for the next %d rounds",
                    plan.round,
                    pid[:10],
                    " (on probation)" if pid in marked else "",
                    rounds,
                )
            pen[pid] = plan.round + rounds
            self._marks_noted()[("noshow", pid)] = plan.round

    def _standing_view(self, records):
        """This node's :class:`~geomesh_p2p.trust.probation.StandingView` of ``records`` for the current round."""
        return pb.StandingView(getattr(self, "standing", None), records, round=self.round, me=getattr(self, "me", None))

    def _admit(self, members):
        """(members to plan, those of them on probation): no-shows left out; of the peers on probation
        (standing below ``probation.threshold``), at most ``probation_slots(established)``, highest
        standing first, then by a per-round rendezvous hash (probation.py)."""
        pen = self._noshows()
        me = getattr(self, "me", None)
        kept = [m for m in members if m.peer_id not in pen or m.peer_id == me]
        view = self._standing_view(members)
        est, waiting = pb.split(view, [m.peer_id for m in kept])
        chosen = pb.select_probation(self.run_cfg.run_id, self.round, view, waiting, pb.probation_slots(len(est)))
        left = len(waiting) - len(chosen)
        if left or len(kept) < len(members):
            log.info(
                "round %d: planning %d established peer(s) and %d of %d on probation; %d no-show(s) left out",
                self.round,
                len(est),
                len(chosen),
                len(waiting),
                len(members) - len(kept),
            )
        keep = set(est) | set(chosen)
        return [m for m in kept if m.peer_id in keep], tuple(chosen)

    def _make_plan(self, members, leader):
        members, chosen = self._admit(members)
        probation = chosen
        members = self._without_parts(members, probation)
        cfg = self._plan_config(len(members))
        evidence = getattr(self, "_supported_tps", None)
        supported = evidence[1] if evidence is not None and evidence[0] == self.round - 1 else None
        if self.run_cfg.window_s:
            # A peer whose exchange plus minimum compute would stretch the round well past what it takes
            # without it is planned out this round (planner.window_exclusions; docs/round.md, "Exclusion
            # rule"). One that fits the window costs nothing: AWB gives it fewer steps. A peer that delivered
            # last round stays unless it would double the round: a noisy link figure must not flap it.
            ex = planner.window_exclusions(members, cfg, kept=supported or ())
            if ex.excluded:
                slow = set(ex.excluded)
                log.warning(
                    "round %d: planning without %s: the round needs %s s with it (exchange %s s), %.1f s "
                    "without (window %.1f s)",
                    self.round,
                    ", ".join(p[:10] for p in ex.excluded),
                    ", ".join(f"{ex.need_s[p]:.1f}" for p in ex.excluded),
                    ", ".join(f"{ex.comm_s[p]:.1f}" for p in ex.excluded),
                    max([self.run_cfg.window_s] + [v for p, v in ex.need_s.items() if p not in slow]),
                    self.run_cfg.window_s,
                )
                members = [m for m in members if m.peer_id not in slow]
                # Still at most probation_slots(established) on probation (those first in line stay).
                ids = {m.peer_id for m in members}
                n_est = sum(1 for p in ids if p not in probation)
                probation = tuple(p for p in chosen if p in ids)[: pb.probation_slots(n_est)]
                members = [m for m in members if m.peer_id not in chosen or m.peer_id in probation]
                cfg = self._plan_config(len(members))
        # geomesh/awb: AWB plan; diloco/css: uniform; ddp: uniform with one step per round. Claims are
        # bounded by the planner (planner.bound_records) and, for the peers of the last round, by what
        # their delivered contributions support (_delivered_rates).
        if not any(m.address for m in members):
            raise _NoOwner(f"{len(members)} peer(s) to plan, all client-only or on probation")
        return planner.make_plan(
            members,
            cfg,
            run_id=self.run_cfg.run_id,
            round=self.round,
            leader=leader,
            numel=self.numel,
            start_time=swarm_time() + 0.5,
            start_digest=self.digest,
            supported_tokens_per_s=supported,
            probation=probation,
        )

    def _plan_problem(self, plan, live: dict) -> Optional[str]:
        """Why this peer must not follow ``plan`` (None: it may). Guards against a rogue or broken
        leader: wrong model size or settings, unknown leader or participants, owners at addresses
        their records do not announce, deadlines far in the future (a stall); then
        :func:`geomesh_p2p.plan.planner.check_plan`: batches, steps, window, token budgets and ownership
        within what the participants' records and the run config support."""
        rc = self.run_cfg
        if plan.numel != self.numel:
            return f"it is for {plan.numel} parameters, the model has {self.numel}"
        if plan.seq_len != rc.seq_len or plan.method != rc.method or plan.mode != rc.mode:
            return "its seq_len / method / mode differ from the run config"
        if plan.leader not in live:
            return "its leader is not a live peer of this run"
        unknown = [p[:10] for p in plan.participants() if p not in live]
        if unknown:
            return f"it names peers that are not live: {unknown}"
        for a in plan.assignments:
            if a.part_end > a.part_start and a.address != live[a.peer_id].address:
                return f"owner {a.peer_id[:10]} is placed at {a.address}, its record says {live[a.peer_id].address}"
            if a.inner_steps > rc.max_inner_steps:
                return f"{a.inner_steps} inner steps for {a.peer_id[:10]} exceed the run's {rc.max_inner_steps}"
        horizon = plan_horizon_s(rc.window_s)
        if plan.train_deadline - swarm_time() > horizon or plan.exchange_deadline - plan.train_deadline > horizon:
            return "its deadlines are unreasonably far in the future"
        # Probation (issue 12): the leader is not a new identity, and those it plans as established are
        # established in this peer's view too (lenient by the rounds this peer did not see).
        reason = pb.marking_problem(plan, self._standing_view(list(live.values())), live.keys())
        if reason is not None:
            return reason
        # Batches, steps, window, budgets and ownership, recomputed from the records (issue 11).
        barred = [p for p, until in getattr(self, "_owner_penalty", {}).items() if until >= self.round]
        # Penalties hold whoever leads (an adversarial review found a no-show leading and giving itself 64%
        # of the model again): a leader this peer saw deliver nothing, or a part given to an owner whose
        # part had no valid result, is refused; the next leader takes over.
        noshows = self._noshows()
        if plan.leader in noshows and plan.leader != self.me:
            return f"its leader {plan.leader[:10]} contributed to no part recently (not planned until round {noshows[plan.leader]})"
        owning = [pid for pid, _, _ in plan.owners() if pid in barred and pid != self.me]
        if owning:
            return f"it gives a part to {owning[0][:10]}, whose part had no valid result in a recent round"
        return planner.check_plan(plan, live, self._plan_config(len(plan.assignments)), now=swarm_time(), barred=barred)

    def _collective_spec(self, plan):
        """The collective's spec for ``plan``. Raises ValueError when the plan cannot be executed."""
        r = plan.round
        rule = self.method_rule
        push, agg = rule.push_encoding, rule.aggregate_encoding
        # Owners' addresses come from the plan (the leader's view), so every peer dials the same ones.
        addresses = {x.peer_id: x.address for x in plan.assignments}
        owners = [
            collective.PartOwner(peer_id=pid, address=addresses.get(pid) or "", start=start, end=end)
            for pid, start, end in plan.owners()
        ]
        # A part too big for one gRPC message (fp32 baselines of large models) is cut into several.
        owners = collective.split_owners(
            owners,
            collective.max_part_elements(
                push_encoding=push,
                mode=plan.mode,
                aggregate_encoding=agg,
                n_participants=len(plan.assignments),
                block_size=self.run_cfg.block_size,
                max_message_bytes=self.transport.config.max_message_bytes,
            ),
        )
        return collective.CollectiveSpec(
            run_id=self.run_cfg.run_id,
            round=r,
            participants={x.peer_id: x.token_budget for x in plan.assignments},
            owners=owners,
            numel=self.numel,
            mode=plan.mode,
            aggregate_encoding=agg,
            push_encoding=push,
            block_size=self.run_cfg.block_size,
            clip_k=self.run_cfg.clip_k,
            rule=rule.rule,
            weight_cap=self.run_cfg.weight_cap,
            min_agreement=self.run_cfg.min_agreement,
            quorum=self.run_cfg.quorum,
            probation=plan.probation(),
            grace_s=pb.early_close_grace_s(plan.window_s),
            deadline=plan.exchange_deadline - PULL_SHARE_OF_EXCHANGE * (plan.exchange_deadline - plan.train_deadline),
            pull_deadline=plan.exchange_deadline,
        )

    def _verify_round(self, r: int, plan, a, ar, theta0: Optional[torch.Tensor] = None) -> None:
        """Verified work (:mod:`geomesh_p2p.trust.verify`): keep round ``r``'s start weights and the signed
        contributions received (relay mode), then, off the event loop and in parallel with the evaluation,
        check the contributor this peer's selection draws and re-check published evidence. Bounded by
        ``time_share`` of the window after the exchange (skipped with a debug line past it); at most one
        such task runs at a time. Never raises: a failure here must not cost the round."""
        try:
            if not ar.contributions:
                return  # reencode mode (or nothing received): no contributions to check
            wv = getattr(self, "_work_verifier", None)
            if wv is None:
                wv = self._work_verifier = verify.WorkVerifier.for_node(self)
            wv.keep_round(
                r,
                theta=self._global_theta().clone() if theta0 is None else theta0,
                plan=plan,
                part_ranges=ar.part_ranges,
                packets=ar.contributions,
            )
            running = getattr(self, "_verify_task", None)
            if running is not None and not running.done():
                log.debug("round %d: verified work skipped: the previous check is still running", r)
                return
            deadline = time.time() + max(1.0, wv.cfg.time_share * float(plan.window_s))
            self._verify_task = asyncio.ensure_future(
                wv.run_round(
                    r,
                    micro_batch=a.micro_batch,
                    seconds_per_row=getattr(self.trainer, "_row_time_ema", None),
                    deadline=deadline,
                    signed_of=lambda part, sender: verify.signed_contribution(self.collective, r, part, sender),
                )
            )

            def failed(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is not None:
                    log.warning("round %d: verified work failed: %s", r, t.exception())

            self._verify_task.add_done_callback(failed)
        except Exception as e:
            log.warning("round %d: verified work skipped: %s", r, e)

    def _verified_plan_problem(self, plan) -> Optional[str]:
        """Why this peer refuses ``plan`` for verified work's sake (an excluded peer that leads would plan
        itself back in): :meth:`geomesh_p2p.trust.verify.WorkVerifier.plan_problem`. None: no objection."""
        wv = getattr(self, "_work_verifier", None)
        return None if wv is None else wv.plan_problem(plan, me=self.me)

    def _verified_members(self, members):
        """The planner's input without the peers that verified work excluded (their evidence re-checked
        here, :meth:`geomesh_p2p.trust.verify.WorkVerifier.filter`); this peer itself always stays."""
        wv = getattr(self, "_work_verifier", None)
        return members if wv is None else wv.filter(members, keep=self.me)

    @staticmethod
    def _no_work(compute_s: float):
        """The InnerResult of a round in which this peer trained nothing usable (:func:`driver.no_work`)."""
        return no_work(compute_s)

    @staticmethod
    def _delivered_rates(plan, ar) -> dict[str, float]:
        """peer_id -> tokens/s its contribution to this round supports: the tokens the owners took from
        it (its claim, capped to its plan budget; the most over the parts) over the compute seconds its
        plan predicted. The next leader plans no peer above ``planner.EVIDENCE_GROWTH`` x this. It bounds
        how fast a peer's planned rate can grow, not a claim made at the budget: telling work done from
        a claim is verified work's job (geomesh_p2p.trust.verify)."""
        delivered: dict[str, int] = {}
        for part in ar.contributors.values():
            for pid, n in part:
                delivered[pid] = max(delivered.get(pid, 0), int(n))
        rates = {}
        for a in plan.assignments:
            n = delivered.get(a.peer_id, 0)
            if n > 0 and a.predicted_compute_s > 0:
                rates[a.peer_id] = n / a.predicted_compute_s
        return rates

    def _update_throughput(self, micro_batch: int, result) -> None:
        """Re-profiling (beyond the paper's one-off profile): EMA of this round's measured tokens/s
        (the other micro-batch sizes are rescaled by the same ratio, capability.ThroughputEMA), growing
        at most ``capability.MAX_TPS_GROWTH_PER_UPDATE`` x per round."""
        if result.compute_s > 0 and result.tokens > 0:
            # The start-up profile is a prior, taken alone and with other processes starting up; the
            # first measurement in the swarm replaces it (then the EMA smooths round-to-round noise).
            first = "tps" not in self._measured
            self._measured.add("tps")
            # A self-measured compute time is not evidence (a free rider can report ~0 s): the announced
            # figure grows at most capability.MAX_TPS_GROWTH_PER_UPDATE x per round, first measurement included.
            self._throughput_ema().update(
                micro_batch,
                result.tokens,
                result.compute_s,
                alpha=1.0 if first else None,
                max_growth=capability.MAX_TPS_GROWTH_PER_UPDATE,
            )

    def _update_links(self, ar) -> None:
        """Fold this round's measured exchange into the link EMAs (links.py). A direction stated by
        a flag stays as stated; samples under ``min_link_sample_bytes`` (latency-bound) are skipped.
        The busy time keeps its latency (the RTT to the bootstrap says nothing about the RTT to the
        owners). A sample moves the figure by at most ``link_step_ratio`` either way per round: the
        owners state their own hold times, so a lying owner can skew one sample, not the record."""
        c = self.cfg
        for direction, sample, stated in (("up", ar.upload, c.upload_bps), ("down", ar.download, c.download_bps)):
            if stated or sample is None or sample.nbytes < c.min_link_sample_bytes:
                continue
            seconds = sample.seconds
            ema = self._throughput_ema()
            current = ema.upload_bps if direction == "up" else ema.download_bps
            if current:
                rate = sample.nbytes / seconds
                rate = min(max(rate, current / c.link_step_ratio), current * c.link_step_ratio)
                seconds = sample.nbytes / rate
            first = direction not in self._measured  # the first real exchange replaces the probe's figure
            self._measured.add(direction)
            new = ema.update_link(sample.nbytes, seconds, direction, alpha=1.0 if first else None)
            log.debug(
                "round %d: %sload %.1f Mbit/s measured (%d bytes in %.3fs), EMA %.1f Mbit/s",
                self.round - 1,
                direction,
                sample.nbytes / seconds * 8e-6,
                sample.nbytes,
                seconds,
                new * 8e-6,
            )
