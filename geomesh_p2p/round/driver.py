"""The round state machine (issue 13): gather members -> agree on a plan -> train -> exchange ->
outer step -> digest check / re-sync, with every collaborator injected (:mod:`geomesh_p2p.round.ports`).

One :class:`RoundDriver` runs the rounds of one peer. Each phase is a method and :attr:`RoundDriver.phase`
says which one runs (the node's status and the tests read it). Whole-model work (inner steps, the outer
step, loading weights, the digest, evaluation, checkpoints) runs in worker threads, never on the event
loop. Waiting for peers or for a round reads the DHT with capped exponential backoff (50 ms -> 1 s,
x1.5, restarting when what is read changes) instead of fixed-period polling. docs/round.md lists the
phases, their timeouts and the DHT requests of one round.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence, cast

import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.telemetry.metrics import RoundRecord
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.trust.probation import PROBATION_SYNC_WAIT_S
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.plan.agree import PlanDeferred, digest_majority
from geomesh_p2p.round.ports import (
    Clock,
    Collective,
    EagerStatePort,
    GlobalStatePort,
    Membership,
    PlanAgreement,
    RoundPolicy,
    SnapshotEvaluator,
    SystemClock,
    Trainer,
)
from geomesh_p2p.sync.download import StateSyncError

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: A syncing peer's wait (issue 14 #3) is its announced remaining download time x ``SYNC_WAIT_SLACK`` plus
#: ``SYNC_WAIT_MARGIN_S``: its record is up to one announcement old, the rate varies, and after the last
#: byte it still checks the digest and loads the state.
SYNC_WAIT_SLACK = 1.25
SYNC_WAIT_MARGIN_S = 2.0
#: Pause after a failed catch-up before the next: long enough for a donor to come back, short for a joiner.
RESYNC_RETRY_PAUSE_S = 3.0
#: A planned-out peer waits for the next round until the plan's exchange deadline plus this (at least this).
#: The gather waits as long for a contributor of the last round still finishing it (its outer step, commit
#: and announcement come after its last pull, which ends by the exchange deadline at the latest).
ROUND_END_SLACK_S = 5.0
#: Gathers a peer on probation may hold past ``PROBATION_SYNC_WAIT_S`` by announcing a download and then
#: not arrive in sync: an identity announcing a slow download forever costs the swarm at most this many
#: capped waits (and each identity costs its proof of work).
PROBATION_SYNC_GRANTS = 2
#: Rounds of this peer's lineage kept for telling what a re-sync to another side's state discards.
LINEAGE_ROUNDS = 4096
#: A round in which this peer itself was not running (its event loop stalled -- SIGSTOP, swap, a debugger --
#: or the host slept: wall time jumped against monotonic time) for at least this share of the plan's
#: exchange window (train deadline -> exchange deadline) is void as evidence: every part failed at once
#: because of this peer, so the owners are not blamed (no owner/no-show penalties, no exchange-cost sample).
STALL_VOID_SHARE = 0.5

#: Which side of a healed partition survives (docs/round.md, "Partitions"); said in the dropped side's line.
SURVIVOR_RULE = (
    "a peer adopts the state more than half of the vote backs (standing.choose_state: each other peer "
    "weighs the rounds this peer saw it deliver among the last 32) once it is at a later round than its "
    "own, or when a plan of the other side's leader plans it out; after a partition of under 16 rounds "
    "the side at the later round survives (docs/round.md, Partitions)"
)

__all__ = ["Phase", "DriverConfig", "RoundDriver", "RoundContext", "LineageEntry", "SwarmEnded", "no_work"]


class Phase(enum.Enum):
    """Where the driver is."""

    IDLE = "idle"
    GATHER = "gather"
    PLAN = "plan"
    TRAIN = "train"
    EXCHANGE = "exchange"
    FINISH = "finish"
    RESYNC = "resync"
    DONE = "done"


@dataclass(frozen=True)
class SwarmEnded:
    """Why :meth:`RoundDriver.run` ended before ``rounds`` / ``target_ppl`` (the node then does not log
    "done" as if healthy; docs/round.md, "A stalled peer and a swarm that ended").

    Attributes:
        round: the round of the state this peer holds at the end.
        swarm_round: the latest round the swarm's records (leaving peers included) show.
        synced: this peer's state is the swarm's last state (same round and digest as the swarm's vote or
            the majority of the records at that round); False: it holds a state the swarm never had or an
            older one it could not catch up from.
        why: one sentence for the log.
        cause: why, in one word (the ``swarm_ended`` event's ``cause``): ``"others_left"`` (every other
            peer announced leaving), ``"alone"`` (after its first round no other peer was live for
            ``wait_peers_s``), ``"digest_differs"`` (its last state is not the one the others hold).
    """

    round: int
    swarm_round: int
    synced: bool
    why: str
    cause: str = ""


def _node_default(name: str) -> Any:
    """NodeConfig's default of field ``name`` (KeyError when NodeConfig has no such field)."""
    return NodeConfig.model_fields[name].default


@dataclass
class DriverConfig:
    """The driver's knobs (seconds). ``min_peers`` peers are waited for before the first round; after it,
    ``min(min_peers, 2)``: a peer never trains alone when ``min_peers`` >= 2 (a swarm that lost one of its N
    peers goes on without stalling every round). Short of it a peer waits up to ``wait_peers_s`` (one INFO
    line "waiting for N peers, M live") and ends (:class:`SwarmEnded`) when every other peer left. Rounds
    with enough peers gather for ``gather_wait_s`` after the first."""

    # The node's knobs take their defaults from NodeConfig's fields (one definition each, issue 15);
    # :meth:`from_node` copies them from a node's config.
    min_peers: int = _node_default("min_peers")
    wait_peers_s: float = _node_default("wait_peers_s")
    gather_wait_s: float = _node_default("gather_wait_s")
    sync_wait_cap_s: float = _node_default("sync_wait_cap_s")  # longest gather wait for a syncing peer
    plan_timeout_s: float = _node_default("plan_timeout_s")
    digest_wait_s: float = 2.0
    rounds: Optional[int] = _node_default("rounds")
    target_ppl: Optional[float] = _node_default("target_ppl")
    eval_every: int = _node_default("eval_every")
    eval_batches: int = _node_default("eval_batches")
    #: evaluate in a worker thread on a copy of the global weights while the next round trains (issue 17);
    #: the result goes into the next row (``eval_round`` says which round's weights it measured), the last
    #: round is evaluated at once. Needs a trainer with ``snapshot_for_eval`` / ``evaluate_snapshot``.
    eval_background: bool = _node_default("eval_background")
    checkpoint_every: int = _node_default("checkpoint_every")
    checkpointing: bool = False
    exchanges_gradient: bool = False  # ddp (MethodRule.exchanges_gradient): one batch's gradient, no pseudo-gradient
    #: eager updates (RunConfig.eager, docs/eager.md): a round's exchange runs in the background while the next
    #: round's inner steps run from this peer's own start ``O(θ, v; w Δ)``; needs an :class:`EagerStatePort`
    eager: bool = False
    backoff_first_s: float = 0.05
    backoff_cap_s: float = 1.0
    live_refresh_s: float = 1.0  # refresh of the live view while plans are read (backoff cap)

    @classmethod
    def from_node(cls, node_cfg: NodeConfig, **overrides: Any) -> "DriverConfig":
        """The driver's knobs of a node: every field that NodeConfig also has, copied from ``node_cfg``,
        then ``overrides`` (fields the node derives, e.g. ``checkpointing``)."""
        shared = {f.name: getattr(node_cfg, f.name) for f in fields(cls) if f.name in NodeConfig.model_fields}
        return cls(**{**shared, **overrides})


def no_work(compute_s: float):
    """The InnerResult of a round in which this peer trained nothing usable (0 tokens: the collective
    gives its contribution no weight)."""
    from geomesh_p2p.model.training import InnerResult  # training imports transformers: load it only when needed

    return InnerResult(
        steps_done=0,
        tokens=0,
        mean_loss=float("nan"),
        last_loss=float("nan"),
        compute_s=max(0.0, compute_s),
        stopped_early=True,
    )


@dataclass
class RoundContext:
    """What one round carries from phase to phase. Times are wall-clock seconds, bytes are totals."""

    round: int
    t_round: float
    members: list = field(default_factory=list)
    live: dict = field(default_factory=dict)
    plan: Optional[RoundPlan] = None
    assignment: Any = None
    result: Any = None
    delta: Optional[torch.Tensor] = None
    spec: Any = None
    ar: Any = None
    t_compute_end: float = 0.0
    t_agg: float = 0.0
    sent0: int = 0
    recv0: int = 0
    #: inner steps started on the provisional plan during the plan's settle (issue 17), with that plan and
    #: the flag that stops them when the plan finally followed is another
    early: Optional[asyncio.Future] = None
    early_plan: Optional[RoundPlan] = None
    early_abort: Optional[threading.Event] = None
    #: monotonic start of the round (its wall start is ``t_round``): the wall-vs-monotonic gap over the
    #: round tells a host that slept; and the worst loop stall (seconds) taken when the exchange returned
    m_round: float = 0.0
    stall_s: Optional[float] = None
    #: eager updates: this round's own start weights ([P] fp32) when it is not the global weights, and how its
    #: inner steps began: "adopted" (the speculative steps, kept), "restarted" (from the own start, with the
    #: plan's assignment), "global" (from the global weights: no eager start, e.g. the first round). ``start``
    #: is released (None) once the round's update is computed from it.
    start: Optional[torch.Tensor] = None
    eager_steps: str = "global"

    def planned(self) -> RoundPlan:
        """The round's plan, set by the PLAN phase.

        Raises:
            RuntimeError: no plan yet (a later phase called before ``agree`` returned True: a driver bug).
        """
        if self.plan is None:
            raise RuntimeError(f"round {self.round}: no plan yet (a phase ran before the PLAN phase agreed one)")
        return self.plan

    def update(self) -> torch.Tensor:
        """This peer's update of the round ([P] fp32: pseudo-gradient, or the ddp baseline's gradient), set by
        the TRAIN phase.

        Raises:
            RuntimeError: no update yet (the EXCHANGE phase called before ``train`` returned True: a driver bug).
        """
        if self.delta is None:
            raise RuntimeError(f"round {self.round}: no update yet (the exchange ran before the TRAIN phase)")
        return self.delta


@dataclass(frozen=True)
class LineageEntry:
    """One round this peer applied (issue 14 #11): the state it made and who made it.

    Attributes:
        round: the round ``r``.
        digest: digest of the state after it (round ``r + 1``'s start state).
        participants: PeerIDs of the round's plan.
        tokens: tokens aggregated in the round, all contributors together (each counted once: its
            largest claim over the parts).
        own_tokens: tokens this peer trained in it.
    """

    round: int
    digest: str
    participants: frozenset
    tokens: int
    own_tokens: int


@dataclass
class _Speculative:
    """Eager updates (docs/eager.md): round ``round``'s inner steps, started before its plan exists from this
    peer's own start ``start`` = ``O(θ^{r-1}, v^{r-1}; weight·Δ_m^{r-1})`` with the assignment of the round
    before; ``target`` (a :class:`~geomesh_p2p.model.training.StepTarget`) takes the plan's inner steps and train
    deadline once it is agreed. Times are swarm (wall) seconds."""

    round: int
    start: torch.Tensor
    batch_size: int
    micro_batch: Optional[int]
    target: Any
    abort: threading.Event
    weight: float
    t_start: float
    task: Optional[asyncio.Future] = None
    t_end: Optional[float] = None  # when the steps ended (None: still running)


@dataclass
class _SyncWaits:
    """One gather's bookkeeping of syncing peers (:meth:`RoundDriver._sync_deadline`); monotonic seconds."""

    t0: float
    until: dict = field(default_factory=dict)  # peer -> end of its progress-derived wait
    seen: dict = field(default_factory=dict)  # peer -> done_bytes that wait was derived from
    extended: set = field(default_factory=set)  # peers waited for past the plain wait by their progress
    established: set = field(default_factory=set)  # standing asked once per gather
    probation: set = field(default_factory=set)
    logged: set = field(default_factory=set)


class RoundDriver:
    """Runs rounds until ``rounds`` / ``target_ppl`` / ``stop``.

    Args:
        membership, plans, trainer, collective, state, policy: the ports (:mod:`geomesh_p2p.round.ports`).
        cfg: :class:`DriverConfig`.
        stop: set to stop; a round under exchange finishes first (its parts stay served).
        clock: wall and monotonic time (injected in tests).
        traffic: ``() -> (bytes sent, bytes received)`` so far, for the round's row.
        history: the node's list of RoundRecord rows (appended to).
    """

    def __init__(
        self,
        *,
        membership: Membership,
        plans: PlanAgreement,
        trainer: Trainer,
        collective: Collective,
        state: GlobalStatePort,
        policy: RoundPolicy,
        cfg: DriverConfig,
        stop: asyncio.Event,
        clock: Optional[Clock] = None,
        traffic: Callable[[], tuple[int, int]] = lambda: (0, 0),
        history: Optional[list] = None,
        leaving: Callable[[bool], None] = lambda _: None,
        loop_stall: Callable[[], Optional[float]] = lambda: None,
        feedback: Any = None,
    ):
        """``loop_stall``: the worst event-loop stall (seconds) since its previous call (LoopLagMonitor.take_worst),
        into each round's row as ``loop_stall_ms``; None: not measured. ``feedback``: the run's error feedback
        (:class:`~geomesh_p2p.exchange.codec.feedback.PushFeedback`, ``--error-feedback``) applied to this peer's
        sign pushes in :meth:`exchange`; None: off."""
        self.membership, self.plans, self.trainer, self.collective = membership, plans, trainer, collective
        self.state, self.policy, self.cfg, self.stop = state, policy, cfg, stop
        self.clock = clock or SystemClock()
        self.traffic = traffic
        self.history = history if history is not None else []
        self.set_leaving = leaving
        self.loop_stall = loop_stall
        self.feedback = feedback
        self.phase = Phase.IDLE
        self.in_exchange = False
        self.leaving = False
        self._waiting_logged: Optional[tuple[int, int]] = None
        self._sync_misses: dict[str, int] = {}  # peer -> progress-derived waits it did not arrive from
        #: the rounds this peer applied, newest last (what a re-sync to another side's state discards)
        self.lineage: collections.deque[LineageEntry] = collections.deque(maxlen=LINEAGE_ROUNDS)
        #: seconds per phase (metrics.PHASES) since this peer's previous row, and that row's monotonic time
        self._phases: dict[str, float] = {}
        self._t_row: Optional[float] = None
        #: the background evaluation under way (DriverConfig.eval_background) and the round it measures
        self._eval_task: Optional[asyncio.Future] = None
        self._eval_round: Optional[int] = None
        #: a background evaluation collected by a synchronous one (the last round): (ppl, round), for the row's extra
        self._eval_carry: Optional[tuple[float, int]] = None
        #: the last round finished in sync and its end announced this peer's record: the loop top's
        #: announce and behind-check would repeat that store and the gather's own swarm-round check
        self._fresh_record = False
        self._gathered: Optional[dict] = None  # live records of the gather's last read, for agree()
        #: set when the run ends because the swarm ended without this peer (node: no "done" line)
        self.ended: Optional[SwarmEnded] = None
        #: the first round whose start state the swarm has not confirmed to this peer (a digest check that
        #: agreed, or a state adopted by a catch-up): blame noted from it on is of an unconfirmed lineage
        self._confirmed_round: int = 0
        #: the latest round the swarm's vote was seen at (behind / gather), for the line of a peer left alone
        self._swarm_seen: int = 0
        #: eager updates: the next round's inner steps, started speculatively while this round's exchange runs
        self._spec: Optional[_Speculative] = None
        #: (round, digest, attempts in a row that ended without a plan) of the round being agreed: after one,
        #: a peer that is no leader candidate in its own view becomes the last resort (:meth:`_last_resort`)
        self._plan_misses: tuple[int, Optional[str], int] = (-1, None, 0)
        #: the plan of the last round this peer applied: the next gather waits for its contributors still
        #: finishing it until its exchange deadline (:meth:`_finishing_waits`)
        self._last_plan: Optional[RoundPlan] = None

    @property
    def me(self) -> str:
        return self.membership.me

    @property
    def last_plan(self) -> Optional[RoundPlan]:
        """The plan of the last round this peer exchanged and applied (None before its first): a leaving node
        keeps serving that round's parts until its exchange deadline (``PeerNode.shutdown``)."""
        return self._last_plan

    def _backoff(self) -> Backoff:
        return Backoff(self.cfg.backoff_first_s, max(self.cfg.backoff_first_s, self.cfg.backoff_cap_s))

    @contextlib.contextmanager
    def _timed(self, name: str):
        """Add the monotonic seconds the block takes to phase ``name`` of the current cycle (issue 17: the
        round row's ``phase_s``, what the non-compute share of a round is made of)."""
        t0 = self.clock.monotonic()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + max(0.0, self.clock.monotonic() - t0)

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stop; True when stopped. (The only sleep of the driver: backoff.)"""
        return await self.clock.wait(self.stop, seconds)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Rounds until done. Catches up first whenever the swarm holds a later round. A background
        evaluation still running at the end is waited for (its thread cannot be cancelled)."""
        watcher = asyncio.ensure_future(self._say_leaving_on_stop())
        try:
            await self._rounds()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            # Eager: speculative steps of a round that will not run stop; the model holds the global weights.
            await self._drop_speculative("the run ends")
            if self._eval_task is not None:
                await asyncio.gather(self._eval_task, return_exceptions=True)
                self._eval_task = None

    async def _say_leaving_on_stop(self) -> None:
        """On a stop request (Ctrl+C, SIGTERM), announce at once that this peer leaves: the round under way
        is still finished (its plan names this peer), but no leader plans the next one with it. Announced
        only at the round's end, a stop landing late in a round raced the others' gather of the next one: a
        leader could plan a peer that was about to exit (a fresh-user trial: with ``--eager`` half the model
        went without an update that round, and the leaving peer was penalised as a no-show)."""
        await self.stop.wait()
        if self.leaving or self.ended is not None:
            return
        self._leave()
        events.emit(
            log,
            logging.INFO,
            "leaving_announced",
            "round %d: stop requested; announcing now that this peer leaves (the round under way is finished)",
            self.state.round,
            peer=self.me,
            round=self.state.round,
            reason="stop",
        )
        try:
            await self.membership.announce()
        except Exception as e:  # the round's end announces it again
            log.debug("announcing that this peer leaves failed: %r", e)

    async def _rounds(self) -> None:
        expected: set[str] = set()
        first = True
        while not self.stop.is_set() and self.ended is None:  # ended: the swarm ended without this peer
            if self.cfg.rounds is not None and self.state.round >= self.cfg.rounds:
                break
            if self._fresh_record:
                self._fresh_record = False  # gather() itself returns None when the swarm is ahead
            else:
                with self._timed("top"):
                    await self.membership.announce()
                    behind = await self.behind()
                if behind:
                    with self._timed("resync"):
                        await self.resync("the swarm is at a later round")
                    continue
            with self._timed("gather"):
                members = await self.gather(expected, first=first)
            if self.ended is not None:
                break  # the swarm ended without this peer (gather or resync said so in one WARNING)
            if members is None:
                continue  # the swarm is ahead: the next pass catches up
            if self.stop.is_set() and {m.peer_id for m in members} <= {self.me}:
                break  # stopped while alone: nobody plans with this peer (with others, it still takes part)
            first = False
            expected = await self.one_round(members)
            if self.reached_target():
                break
            if self.ended is not None:
                break
        if self.ended is None and not self.stop.is_set() and self.history:
            await self._check_end()
        self.phase = Phase.DONE

    async def behind(self) -> bool:
        """True when the swarm's vote backs a later round than this peer's. Peers that announced leaving
        count: their last record says which round and state the swarm reached (a swarm whose peers all
        finished their last round is ahead of a peer that was stalled, not gone)."""
        sr = self.policy.swarm_round(await self.membership.peers(include_leaving=True))
        self._swarm_seen = max(self._swarm_seen, sr or 0)
        return sr is not None and sr > self.state.round

    def _swarm_ended(self, everyone: Sequence[PeerRecord]) -> Optional[SwarmEnded]:
        """A :class:`SwarmEnded` when ``everyone`` (the run's records, leaving peers included) holds at least
        one other peer and every other peer announced leaving; None while another peer is live.

        ``synced``: the majority digest of the others' records at this peer's round is this peer's digest
        (the swarm ended on the state this peer holds); ``swarm_round``: the latest round they announced."""
        others = [x for x in everyone if x.peer_id != self.me]
        if not others or any(not x.leaving for x in others):
            return None
        r = self.state.round
        majority, _, _ = digest_majority(others, r)
        swarm_round = max(x.round for x in others)
        synced = majority is not None and majority == self.state.digest and swarm_round <= r
        state = (
            f"the swarm's last state (round {r}, digest {(self.state.digest or '')[:8]})"
            if synced
            else f"NOT the swarm's: this peer holds round {r}, digest {(self.state.digest or '')[:8]}, the swarm "
            f"ended at round {swarm_round}" + (f" with digest {majority[:8]}" if majority else "")
        )
        why = (
            f"the swarm ended: every other peer ({len(others)}) announced leaving, the latest at round "
            f"{swarm_round}; this peer's state is {state}"
        )
        return SwarmEnded(round=r, swarm_round=swarm_round, synced=synced, why=why, cause="others_left")

    def _left_alone(self, everyone: Sequence[PeerRecord], waited_s: float) -> SwarmEnded:
        """The :class:`SwarmEnded` of a peer that, after its first round, found no other live peer for a
        whole ``wait_peers_s`` short of ``min_peers``. Never ``synced``: with the others' records gone nothing
        shows where the swarm ended (it may have gone on after the last state it confirmed to this peer), so
        the run is not claimed healthy; the line says whether the swarm confirmed this peer's state (a digest
        check that agreed, or a catch-up adopted it)."""
        r = self.state.round
        others = [x for x in everyone if x.peer_id != self.me]
        seen = max([self._swarm_seen] + [x.round for x in others])
        state = (
            f"NOT the swarm's: the swarm was last seen at round {seen}"
            if seen > r
            else "NOT known to be the swarm's last: the swarm confirmed it, and where the swarm ended is unknown"
            if self._confirmed_round >= r
            else "NOT the swarm's: the swarm never confirmed it (its last round had no agreeing digest check)"
        )
        why = (
            f"no other peer of the run is live (waited {waited_s:.0f} s for --min-peers {self.cfg.min_peers}); "
            f"this peer's state (round {r}, digest {(self.state.digest or '')[:8]}) is {state}"
        )
        return SwarmEnded(round=r, swarm_round=max(r, seen), synced=False, why=why, cause="alone")

    def _end(self, ended: SwarmEnded, **facts: Any) -> None:
        """Record that the run ends without reaching its goal because the swarm ended (one WARNING, the
        ``swarm_ended`` event; ``facts``: more event fields of the call site)."""
        self.ended = ended
        events.emit(
            log,
            logging.WARNING,
            "swarm_ended",
            "round %d: %s; ending without reaching %s",
            ended.round,
            ended.why,
            f"--rounds {self.cfg.rounds}" if self.cfg.rounds is not None else "the target",
            peer=self.me,
            round=ended.round,
            swarm_round=ended.swarm_round,
            synced=ended.synced,
            cause=ended.cause,
            **facts,
        )

    async def _check_end(self) -> None:
        """After the last round: when the other peers' records at this peer's round back another digest
        (this peer trained its last rounds on a state the swarm never had), the run did not end healthy:
        :attr:`ended` says so (synced False) and one WARNING line. Others at a later round are no failure
        (peers with a larger ``--rounds`` go on). One DHT read."""
        everyone = await self.membership.peers(include_leaving=True)
        others = [x for x in everyone if x.peer_id != self.me]
        r = self.state.round
        majority, agree, total = digest_majority(others, r)
        if majority is not None and majority != self.state.digest:
            later = max((x.round for x in others), default=r)
            self._end(
                SwarmEnded(
                    round=r,
                    swarm_round=max(later, r),
                    synced=False,
                    why=(
                        f"this peer's last state (round {r}, digest {(self.state.digest or '')[:8]}) is NOT the swarm's: "
                        f"{agree} of {total} other peer(s) hold digest {majority[:8]}"
                    ),
                    cause="digest_differs",
                ),
                others=total,
                majority_digest=majority,
            )

    def reached_target(self) -> bool:
        """True once the last row's evaluation is at or under ``target_ppl``."""
        t = self.cfg.target_ppl
        h = self.history
        return t is not None and bool(h) and h[-1].eval_ppl is not None and h[-1].eval_ppl <= t

    async def resync(self, why: str) -> None:
        """Download the swarm's state; a failure is one warning and a pause (the donors may come back), or,
        when every other peer announced leaving, the end of the run (:attr:`ended`, one WARNING)."""
        self.phase = Phase.RESYNC
        await self._drop_speculative("re-sync")  # no eager start after a re-sync: the peer starts from θ
        try:
            await self._catch_up()
        except StateSyncError as e:
            # Every donor gone for good (all of them announced leaving): retrying would never end.
            ended = self._swarm_ended(await self.membership.peers(include_leaving=True))
            if ended is not None:
                self._end(ended)
                return
            log.warning("catching up failed (%s; %s); retrying in a few seconds", e, why)
            await self._pause(RESYNC_RETRY_PAUSE_S)

    async def _catch_up(self) -> None:
        """``state.catch_up()``; when the state adopted is not of this peer's lineage (its side of a
        partition lost the vote), one WARNING line says what is discarded (:meth:`_log_dropped`). Raises
        what ``catch_up`` raises (StateSyncError)."""
        before = (self.state.round, self.state.digest)
        # The sides as announced before the download (a peer that trained with this one: its lineage);
        # read only when there is a lineage to lose (a joiner's catch-up costs no extra DHT read).
        recs = await self.membership.peers(include_leaving=True) if self.lineage else []
        kept = len(self.lineage)
        mine = {e.digest for e in self.lineage}
        await self.state.catch_up()
        if self.lineage and self.state.digest != before[1]:
            self._log_dropped(before, recs)
        if len(self.lineage) < kept:  # rounds of this peer's lineage were discarded
            await self._drop_feedback()
        if self.state.digest != before[1] and self.state.digest not in mine:
            self._forget_blame()
        if self.state.digest != before[1] and not getattr(self.state, "syncing", False):
            self._confirmed_round = self.state.round  # adopted the swarm's state: its start is confirmed

    def _forget_blame(self) -> None:
        """After a re-sync to a state this peer did not make: penalties it noted in rounds the swarm never
        confirmed to it (from :attr:`_confirmed_round` on) came from the lineage it abandoned (e.g. every part
        failed while it was stalled) and are dropped (``policy.forget_marks_since``; one INFO line)."""
        forget = getattr(self.policy, "forget_marks_since", None)
        if forget is None:
            return
        dropped = forget(self._confirmed_round)
        if dropped:
            log.info(
                "re-synced to the swarm's state: %d penalty mark(s) this peer noted since round %d (a lineage "
                "the swarm did not confirm) dropped: %s",
                len(dropped),
                self._confirmed_round,
                ", ".join(p[:10] for p in dropped),
            )

    def _log_dropped(self, before: tuple, recs: Sequence[PeerRecord]) -> None:
        """After a re-sync from ``before`` (round, digest) to the state now held: when that state is not of
        this peer's lineage, log one WARNING with the rounds trained since the fork, the peers of this
        side, the tokens discarded and :data:`SURVIVOR_RULE`, and forget those rounds.

        The fork is found from the records read before the download: peers announcing a digest that is
        not in this peer's lineage are the other side; the rounds discarded are the newest rounds of the
        lineage that none of them took part in (a round with a peer of the other side was before the
        split)."""
        mine = {e.digest for e in self.lineage} | {before[1]}
        if self.state.digest in mine:
            return  # a state this peer made itself: nothing of its lineage is lost
        others = {r.peer_id for r in recs if r.peer_id != self.me and r.weights_digest and r.weights_digest not in mine}
        dropped: list[LineageEntry] = []
        for e in reversed(self.lineage):
            if e.participants & others:
                break
            dropped.append(e)
        if not others or not dropped:
            return  # no round of this peer's is known to be discarded (nobody of another side in view)
        dropped.reverse()
        side = sorted(set().union(*(e.participants for e in dropped)))
        tokens, own = sum(e.tokens for e in dropped), sum(e.own_tokens for e in dropped)
        span = f"round {dropped[0].round}" if len(dropped) == 1 else f"rounds {dropped[0].round}-{dropped[-1].round}"
        events.emit(
            log,
            logging.WARNING,
            "partition_lost",
            "re-synced to the state of round %d (digest %s), not of this peer's lineage: its side of a "
            "partition lost; discarded %d round(s) trained since the fork (%s) by %d peer(s) of this side "
            "(%s), %d tokens (%d of them this peer's). Rule: %s",
            self.state.round,
            (self.state.digest or "")[:8],
            len(dropped),
            span,
            len(side),
            ", ".join(p[:10] for p in side),
            tokens,
            own,
            SURVIVOR_RULE,
            peer=self.me,
            round=self.state.round,
            digest=self.state.digest,
            discarded_rounds=[e.round for e in dropped],
            side=side,
            tokens=tokens,
            own_tokens=own,
        )
        for _ in dropped:
            self.lineage.pop()

    # ------------------------------------------------------------------ phases
    async def gather(self, expected: set[str], *, first: bool) -> Optional[list[PeerRecord]]:
        """Phase GATHER: the peers in sync for this round (announced it with this digest). Waits for
        ``expected`` (last round's contributors, less those leaving) up to ``gather_wait_s``
        (``wait_peers_s`` and ``min_peers`` before the first round); one of them whose record still shows
        the last round is finishing its exchange and is waited for until that round's exchange deadline plus
        ``ROUND_END_SLACK_S`` (:meth:`_finishing_waits`); and for each peer announced as
        syncing for this round as long as :meth:`_sync_deadline` says (its announced download progress,
        within ``sync_wait_cap_s``). None at once when the swarm holds a later round (leaving peers' records
        count: they show where the swarm is). Short of ``min_peers`` (after the first round ``min(min_peers,
        2)``: never alone): one INFO line "waiting for N peers, M live" (not one per read), a wait of up to
        ``wait_peers_s``; None with :attr:`ended` set
        (one WARNING) when every other peer's record says it left, on two reads in a row (a live peer's
        record may be a moment old) -- this peer never trains alone on a swarm that ended."""
        self.phase = Phase.GATHER
        # After the first round only "not alone" holds: waiting for all N every round would stall a swarm
        # that lost one peer by wait_peers_s per round; the fork risk is a peer training by itself.
        min_peers = self.cfg.min_peers if first else min(self.cfg.min_peers, 2)
        t0 = self.clock.monotonic()
        finish_end = self._finishing_end(t0)
        finish_logged: set[str] = set()
        backoff = self._backoff()
        last_ids: Optional[frozenset] = None
        waits = _SyncWaits(t0)
        synced: list[PeerRecord] = []
        left_reads = 0  # consecutive reads on which every other peer's record says it left
        try:
            while True:
                everyone = await self.membership.peers(include_leaving=True)
                now = self.clock.monotonic()
                # A peer that said it is leaving is not waited for (it finished its last exchange).
                expected = expected - {r.peer_id for r in everyone if r.leaving}
                recs = [r for r in everyone if not r.leaving]
                self._gathered = {r.peer_id: r for r in recs}  # the live view PLAN starts from (no re-read)
                # Leaving peers' records are evidence of the swarm's progress (their round and digest): a
                # stalled peer whose swarm finished while it was stopped must catch up, not train alone.
                sr = self.policy.swarm_round(everyone)
                self._swarm_seen = max(self._swarm_seen, sr or 0)
                if sr is not None and sr > self.state.round:
                    return None
                synced = [r for r in recs if r.round == self.state.round and r.weights_digest == self.state.digest]
                ids = {r.peer_id for r in synced}
                short = len(ids) < min_peers
                ended = self._swarm_ended(everyone) if short and not self.stop.is_set() else None
                # A record of a peer still live may be a moment old (it re-announces at its loop top): the end
                # is confirmed by the next read, one backoff pause later. Not a longer wait: the leaving
                # records expire a few announce periods after their peers exit, and without them this peer
                # could only say it was left alone (not synced).
                left_reads = 0 if ended is None else left_reads + 1
                if ended is not None and left_reads >= 2:
                    self._end(ended)
                    return None
                wait_s = self.cfg.wait_peers_s if first or short else self.cfg.gather_wait_s
                syncing = [
                    r
                    for r in recs
                    if r.round == self.state.round
                    and r.weights_digest is None
                    and r.peer_id not in ids
                    and r.peer_id != self.me
                ]
                ends = {r.peer_id: self._sync_deadline(r, recs, waits, now, wait_s) for r in syncing}
                if not short:
                    ends.update(self._finishing_waits(expected - ids, recs, finish_end, now, finish_logged))
                waited = {p for p, end in ends.items() if end > now}
                if (expected | waited) <= ids and len(ids) >= min_peers:
                    return synced
                if len(ids) < min_peers and self._waiting_logged != (min_peers, len(recs)):
                    self._waiting_logged = (min_peers, len(recs))
                    events.emit(
                        log,
                        logging.INFO,
                        "waiting_for_peers",
                        "round %d: waiting for %d peers, %d live (up to %.0f s)",
                        self.state.round,
                        min_peers,
                        len(recs),
                        wait_s,
                        peer=self.me,
                        round=self.state.round,
                        min_peers=min_peers,
                        live=len(recs),
                        wait_s=wait_s,
                    )
                until = max([t0 + wait_s] + [ends[p] for p in waited])
                if now > until or self.stop.is_set():
                    if short and not first and not self.stop.is_set() and not any(x.peer_id != self.me for x in recs):
                        # After the first round nobody else is live at all: the swarm is gone (its records
                        # may have vanished with its peers). Training on alone would fork the run.
                        self._end(self._left_alone(everyone, now - t0), waited_s=now - t0, min_peers=min_peers)
                        return None
                    if len(ids) < min_peers and not self.stop.is_set():  # says so (issue 14 #10)
                        log.info(
                            "round %d: starting with %d of the %d peers wanted (--min-peers): waited %.0f s",
                            self.state.round,
                            len(ids),
                            min_peers,
                            now - t0,
                        )
                    return synced
                now_ids = frozenset(r.peer_id for r in recs)
                if now_ids != last_ids:
                    last_ids = now_ids
                    backoff.reset()
                wake = until
                if syncing and now - t0 <= PROBATION_SYNC_WAIT_S:
                    wake = min(until, t0 + PROBATION_SYNC_WAIT_S)  # standing decides the wait from then on
                if await self._pause(min(backoff.next(), max(0.0, wake - self.clock.monotonic()) + 0.01)):
                    return synced
        finally:
            arrived = {r.peer_id for r in synced}
            for p in waits.extended - arrived:  # it held the round by its progress and did not arrive
                self._sync_misses[p] = self._sync_misses.get(p, 0) + 1
            for p in waits.extended & arrived:
                self._sync_misses.pop(p, None)

    def _finishing_end(self, t0: float) -> Optional[float]:
        """Until when (monotonic seconds) the gather that starts at ``t0`` waits for contributors of the last
        round still finishing it: that round's exchange deadline plus ``ROUND_END_SLACK_S`` (None when this
        peer did not apply the round before this one). A peer of a uniform-H method on a slow link finishes
        its pulls later than the others, up to the deadline; leaving it out made it download the state."""
        plan = self._last_plan
        if plan is None or plan.round != self.state.round - 1:
            return None
        return t0 + float(plan.exchange_deadline) - self.clock.time() + ROUND_END_SLACK_S  # past: no wait

    def _finishing_waits(
        self, missing: set[str], recs: list[PeerRecord], end: Optional[float], now: float, logged: set[str]
    ) -> dict[str, float]:
        """Peer -> until when (monotonic seconds) to wait for it, for each of ``missing`` (last round's
        contributors not yet in sync) whose live record still shows the last round at its start digest: it
        is finishing that round's exchange (or its outer step). ``end``: :meth:`_finishing_end`. A peer that
        died is not waited for past ``end``, and not at all once its record expired. One INFO line per peer
        (``waiting_for_late_peer``) when the wait goes past the plain gather wait."""
        plan = self._last_plan
        if end is None or plan is None or not missing:
            return {}
        out = {
            r.peer_id: end
            for r in recs
            if r.peer_id in missing
            and r.round == plan.round
            and r.weights_digest is not None
            and r.weights_digest == (plan.start_digest or r.weights_digest)
        }
        for pid in sorted(set(out) - logged):
            if end > now:
                logged.add(pid)
                events.emit(
                    log,
                    logging.INFO,
                    "waiting_for_late_peer",
                    "round %d: waiting up to %.1f s more for %s, still finishing round %d (its exchange ends by "
                    "the deadline)",
                    self.state.round,
                    end - now,
                    pid[:10],
                    plan.round,
                    peer=self.me,
                    round=self.state.round,
                    finishing_peer=pid,
                    wait_s=end - now,
                )
        return out

    def _sync_deadline(
        self, rec: PeerRecord, recs: list[PeerRecord], waits: "_SyncWaits", now: float, wait_s: float
    ) -> float:
        """Until when (monotonic seconds) this gather waits for syncing peer ``rec`` (issue 14 #3).

        Without a usable announced download progress: ``wait_s`` from the gather's start for an established
        peer, ``PROBATION_SYNC_WAIT_S`` for one on probation, as before. With one (a record with
        ``sync_progress``), ``wait_s`` at least, and each time its ``done_bytes`` moves, until now + its
        announced remaining time x ``SYNC_WAIT_SLACK`` + ``SYNC_WAIT_MARGIN_S``; never past
        ``sync_wait_cap_s`` from the gather's start. A download that stops moving is not waited for past
        the wait derived from its last progress. A peer on probation gets a progress-derived wait only
        while it has failed to arrive after fewer than ``PROBATION_SYNC_GRANTS`` of them."""
        pid, t0 = rec.peer_id, waits.t0
        if pid in waits.established:
            established: Optional[bool] = True
        elif pid in waits.probation:
            established = False
        elif now - t0 <= PROBATION_SYNC_WAIT_S:
            established = None  # not asked yet: every syncing peer is waited for that long
        else:
            established = self.policy.standing_established(recs, pid)
            (waits.established if established else waits.probation).add(pid)
        plain = t0 + (PROBATION_SYNC_WAIT_S if established is False else wait_s)
        sp = rec.sync_progress
        if sp is None or (established is False and self._sync_misses.get(pid, 0) >= PROBATION_SYNC_GRANTS):
            return plain
        if waits.seen.get(pid) != sp.done_bytes:  # it moved (or is new): derive its wait again
            waits.seen[pid] = sp.done_bytes
            remaining = sp.remaining_s()
            if remaining is not None:
                cap = t0 + max(wait_s, self.cfg.sync_wait_cap_s)
                waits.until[pid] = min(cap, now + remaining * SYNC_WAIT_SLACK + SYNC_WAIT_MARGIN_S)
                if waits.until[pid] > t0 + wait_s and pid not in waits.logged:
                    waits.logged.add(pid)
                    events.emit(
                        log,
                        logging.INFO,
                        "waiting_for_syncing_peer",
                        "round %d: waiting up to %.1f s more for %s, syncing (%d of %d MiB at %.1f MiB/s)",
                        self.state.round,
                        waits.until[pid] - now,
                        pid[:10],
                        sp.done_bytes >> 20,
                        sp.total_bytes >> 20,
                        sp.bytes_per_s / 2**20,
                        peer=self.me,
                        round=self.state.round,
                        syncing_peer=pid,
                        wait_s=waits.until[pid] - now,
                        done_bytes=sp.done_bytes,
                        total_bytes=sp.total_bytes,
                        bytes_per_s=sp.bytes_per_s,
                    )
        end = max(t0 + wait_s, waits.until.get(pid, 0.0))
        if end > plain and end > now:
            waits.extended.add(pid)  # held past its plain wait by its progress: a miss if it does not arrive
        return end

    async def one_round(self, members: list[PeerRecord]) -> set[str]:
        """Run round ``state.round`` with ``members``; returns the participants expected next round."""
        ctx = RoundContext(
            round=self.state.round, t_round=self.clock.time(), members=members, m_round=self.clock.monotonic()
        )
        with self._timed("plan"):
            agreed = await self.agree(ctx)
        if not agreed:
            return set()
        if not await self.train(ctx):
            return set()
        if not self.cfg.eager:
            with self._timed("exchange"):
                exchanged = await self.exchange(ctx)
            if not exchanged:
                return set()
            return await self.finish(ctx)
        # Eager updates: the exchange runs in the background while this peer computes its own start of the
        # next round and starts that round's inner steps from it (docs/eager.md); at most one exchange is in
        # flight (the next one starts after this round's finish, which precedes the next agree).
        own = ctx.update()  # before the exchange may replace ctx.delta (error feedback pushes delta + residual)
        exchange = asyncio.ensure_future(self.exchange(ctx))
        try:
            try:
                await self._start_speculative(ctx, own)
            except Exception as e:  # never lose the round over it: the next round starts from the global weights
                log.warning(
                    "round %d: eager start failed (%s: %s); next round starts from the global weights",
                    ctx.round,
                    type(e).__name__,
                    e,
                )
            with self._timed("exchange"):
                exchanged = await exchange
            if not exchanged:
                await self._drop_speculative("the exchange failed")
                return set()
            return await self.finish(ctx)
        except BaseException:
            await self._drop_speculative("the round failed")
            if not exchange.done():
                exchange.cancel()
                await asyncio.gather(exchange, return_exceptions=True)
            raise

    async def _refresh_live(self, live: dict, done: asyncio.Event) -> None:
        """Add newly seen live peers to ``live`` until ``done``: backoff, restarting when a peer appears.
        Stopped by the event, not cancelled, so that a lookup in flight finishes and its result is kept
        (a cancelled lookup is safe too: its tasks are owned by an :class:`~geomesh_p2p.util.aio.TaskScope`)."""
        backoff = Backoff(self.cfg.backoff_first_s * 4, max(self.cfg.backoff_first_s * 4, self.cfg.live_refresh_s))
        while not await wait_event(done, backoff.next()):
            try:
                fresh = {x.peer_id: x for x in await self.membership.peers()}
            except Exception as e:  # a failed DHT read: keep the last view
                log.debug("refreshing live peers failed: %s", e)
                continue
            if set(fresh) - set(live):
                backoff.reset()
            live.update(fresh)

    async def agree(self, ctx: RoundContext) -> bool:
        """Phase PLAN: the plan this peer follows (it publishes one when its turn as leader comes). A peer
        alone in the run plans its own round at once (no DHT round trips eat its window). False: no
        round for this peer (no plan, or not in it: it waited for the round's end and re-synced)."""
        self.phase = Phase.PLAN
        r = ctx.round
        live = ctx.live
        # The gather's last read is a moment old: reuse it (one DHT get less between the gather and the
        # plan, issue 17); the refresher below keeps the view fresh while the plan is agreed.
        gathered, self._gathered = self._gathered, None
        live.update(gathered if gathered is not None else {x.peer_id: x for x in await self.membership.peers()})
        members, candidates = self.policy.leader_candidates(ctx.members, live)
        plan: Optional[RoundPlan]
        if [m.peer_id for m in members] == [self.me] and set(live) == {self.me}:
            # Lone peer: nobody else can lead, follow or read a plan; plan with a fresh start time so
            # the whole window trains (the DHT, maybe unreachable, is not asked).
            try:
                plan = self.policy.make_plan(members, self.me)
            except PlanDeferred:  # the policy said why, once: wait without an ERROR every pause
                await self._pause(self.cfg.plan_timeout_s)
                return False
            except Exception as e:
                log.error("round %d: planning failed (%s: %s)", r, type(e).__name__, e)
                await self._pause(self.cfg.plan_timeout_s)
                return False
            publish = getattr(self.plans, "publish_background", None)
            if publish is not None:
                publish(plan)  # for the status page; nobody waits for it
        else:
            # Not cancelled by a stop request (bounded by the plan timeouts): once the others follow a plan
            # naming this peer, it must serve its part and contribute (0 steps if stopping). The live view
            # stays fresh meanwhile: a peer that (re)joined just now may lead a better-ranked plan.
            done = asyncio.Event()
            refresher = asyncio.ensure_future(self._refresh_live(live, done))

            def on_provisional(p: RoundPlan) -> None:
                # The settle (plans.obtain_plan) waits for a better-ranked plan that almost never comes:
                # train on the plan it will most likely return meanwhile; discarded below if another wins.
                if ctx.early is None and self._spec is None and self._may_start_early(p):
                    ctx.early_plan, ctx.early_abort = p, threading.Event()
                    ctx.early = asyncio.ensure_future(self._inner_steps(ctx, p, ctx.early_abort))

            last_resort = self._last_resort(r, members, candidates)
            try:
                plan = await self.plans.agree(
                    r,
                    members,
                    self.policy.make_plan,
                    accept=lambda p: self.policy.plan_problem(p, live),
                    candidates=candidates,
                    plan_timeout_s=self.cfg.plan_timeout_s,
                    provisional=on_provisional,
                    **({"last_resort": last_resort} if last_resort else {}),
                )
            finally:
                done.set()  # the lookup under way finishes (bounded by the DHT's RPC timeouts)
                await asyncio.gather(refresher, return_exceptions=True)
        if ctx.early is not None and (
            plan is None or ctx.early_plan is None or plan.to_bytes() != ctx.early_plan.to_bytes()
        ):
            await self._discard_early(ctx, plan)
        key = (r, self.state.digest)
        misses = self._plan_misses[2] if self._plan_misses[:2] == key else 0
        self._plan_misses = (r, self.state.digest, misses + 1 if plan is None else 0)
        if plan is None:
            await self._drop_speculative("no plan appeared")
            if not self.stop.is_set():
                log.warning("round %d: no plan appeared; retrying", r)
            return False
        ctx.plan = plan
        if self.stop.is_set() and self.me not in plan.participants():
            await self._drop_speculative("stopping, not in the plan")
            return False
        if self.me not in plan.participants() or plan.start_digest != self.state.digest:
            await self._drop_speculative("not in the plan" if self.me not in plan.participants() else "weights differ")
            await self.wait_out(ctx)
            return False
        return True

    def _last_resort(self, r: int, members: Sequence[PeerRecord], candidates: Sequence[str]) -> list[str]:
        """The members that are no leader candidates (this peer among them) when this peer must publish a plan
        itself if no candidate does (``last_resort`` of
        :func:`~geomesh_p2p.plan.agree.obtain_plan`), else ``[]``.

        The leader candidates are computed by each member from its own view (standing, no-show marks), and
        a member leaves itself out where it expects the others to refuse its plan: while it is not
        established in its own view (a newcomer follows the peers whose state it downloaded), or while it
        marked itself a no-show. Views differ, so every member can defer to another that defers in turn
        (rs7: two peers, each the other's only candidate, "no plan appeared; retrying" for 6 minutes). So
        once an attempt at this round and state ended with no plan at all, a member in sync that is no
        candidate becomes the last resort: it publishes after every candidate's turn has passed with no
        plan read, refused ones included (docs/round.md, "Leader election when nobody leads"). A healthy
        established leader publishes within its turn of the first attempt, so a newcomer following it never
        gets there (the young-swarm rule holds); one WARNING per round."""
        member_ids = {m.peer_id for m in members}
        if self.me in candidates or self.me not in member_ids:
            return []
        if self._plan_misses[:2] != (r, self.state.digest) or self._plan_misses[2] < 1:
            return []
        if self._plan_misses[2] == 1:  # the first escalated attempt of this round: said once
            events.emit(
                log,
                logging.WARNING,
                "plan_last_resort",
                "round %d: no plan appeared in a whole attempt; this peer is no leader candidate in its own view "
                "and the %d it defers to (%s) published none: it publishes a plan itself if none appears "
                "after their turns",
                r,
                len(candidates),
                ", ".join(c[:10] for c in candidates) or "none",
                peer=self.me,
                round=r,
                candidates=list(candidates),
                attempts=self._plan_misses[2],
            )
        # Every member that is no candidate, not only this peer: obtain_plan ranks them among themselves, so
        # two last resorts publish a stagger apart and the second follows the first's plan (review: with
        # ``[me]`` alone both sat at the same instant and, refusing each other's plans, split the round).
        return sorted(member_ids - set(candidates))

    async def wait_out(self, ctx: RoundContext) -> None:
        """A planned-out peer (joined late, too slow for the window, or other weights): announce as syncing
        for the next round (its leader then waits for it), wait for the others to announce it, re-sync."""
        plan, r = ctx.planned(), ctx.round
        planned_in = self.me in plan.participants()
        why = (
            f"not in the plan of leader {plan.leader[:10]} (the leader left it out: it joined late, missed an "
            f"earlier round's exchange, or its link or device is too slow for the {plan.window_s:.1f} s window; "
            "see the leader's log)"
            if not planned_in
            else "weights differ from the plan's"
        )
        events.emit(
            log,
            logging.INFO,
            "planned_out",
            "round %d: %s; waiting for the round to end, then syncing",
            r,
            why,
            peer=self.me,
            round=r,
            leader=plan.leader,
            reason="not_in_plan" if not planned_in else "weights_differ",
        )
        self.state.syncing, self.state.round = True, r + 1
        await self.membership.announce()
        # Left out by the leader: re-measure the link while the round ends (bounded, see the port), and
        # announce the fresh figure as soon as it is known, before the next round is planned.
        reprobe = None if planned_in else asyncio.ensure_future(self._reprobe_and_announce())
        try:
            await self.wait_for_round(
                r + 1, timeout_s=max(ROUND_END_SLACK_S, plan.exchange_deadline - self.clock.time() + ROUND_END_SLACK_S)
            )
            if reprobe is not None and not self.stop.is_set():
                await reprobe
        finally:
            if reprobe is not None and not reprobe.done():
                reprobe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reprobe
        await self.resync("planned out")

    async def _reprobe_and_announce(self) -> None:
        """A planned-out peer's link re-probe (:meth:`Membership.remeasure_links`), then its announcement.
        A failure is logged once at DEBUG: the peer keeps the figures it had."""
        try:
            await self.membership.remeasure_links()
            await self.membership.announce()
        except Exception as e:  # never fail the wait for the round's end over a probe
            log.debug("link re-probe failed: %r", e)

    async def wait_for_round(self, r: int, timeout_s: float = 30.0) -> bool:
        """Wait until another peer announces round ``r`` with a digest (backoff); True when one did."""
        deadline = self.clock.monotonic() + timeout_s
        backoff = self._backoff()
        while self.clock.monotonic() < deadline and not self.stop.is_set():
            # leaving peers count: their last record says they finished round r - 1
            recs = [x for x in await self.membership.peers(include_leaving=True) if x.peer_id != self.me]
            if any(x.round >= r and x.weights_digest for x in recs):
                return True
            if await self._pause(min(backoff.next(), max(0.0, deadline - self.clock.monotonic()) + 0.01)):
                break
        return False

    def _may_start_early(self, plan: RoundPlan) -> bool:
        """Whether this peer may start its inner steps on ``plan`` before the settle confirms it: it is in
        the plan, holds the plan's start weights, is not stopping, and trains inner steps (ddp's one-batch
        gradient gains nothing from it)."""
        return (
            not self.cfg.exchanges_gradient
            and not self.stop.is_set()
            and self.me in plan.participants()
            and plan.start_digest == self.state.digest
        )

    async def _discard_early(self, ctx: RoundContext, plan: Optional[RoundPlan]) -> None:
        """The plan followed is not the one the inner steps started on during the settle (a better-ranked
        leader's plan appeared, or none is followed): stop those steps and load the global weights back."""
        early, early_plan, abort = ctx.early, ctx.early_plan, ctx.early_abort
        if early is None or early_plan is None or abort is None:  # set together by agree's on_provisional
            raise RuntimeError(f"round {ctx.round}: no inner steps were started during the settle")
        abort.set()
        await asyncio.gather(early, return_exceptions=True)
        ctx.early = None
        await asyncio.to_thread(self.state.reset_model)
        events.emit(
            log,
            logging.INFO,
            "early_steps_discarded",
            "round %d: the plan of leader %s started on during the settle is not the one followed (%s); "
            "its inner steps are discarded",
            ctx.round,
            early_plan.leader[:10],
            f"leader {plan.leader[:10]}'s is" if plan is not None else "none is",
            peer=self.me,
            round=ctx.round,
            started_leader=early_plan.leader,
            followed_leader=plan.leader if plan is not None else None,
        )

    async def _inner_steps(self, ctx: RoundContext, plan: RoundPlan, abort: Optional[threading.Event] = None):
        """This peer's inner steps of ``plan`` in a worker thread, until the plan's train deadline, a stop
        request or ``abort``; ddp: one batch's gradient. Returns ``(grad or None, InnerResult)``; a
        non-finite loss gives ``(None, no_work(...))`` and the model back at the global weights."""
        r = ctx.round
        a = plan.assignment(self.me)
        should_stop = self.stop.is_set if abort is None else (lambda: self.stop.is_set() or abort.is_set())
        t_train = time.perf_counter()
        try:
            if self.cfg.exchanges_gradient:
                return await asyncio.to_thread(
                    lambda: self.trainer.gradient(round=r, batch_size=a.batch_size, micro_batch=a.micro_batch)
                )
            return None, await asyncio.to_thread(
                lambda: self.trainer.run(
                    round=r,
                    inner_steps=a.inner_steps,
                    batch_size=a.batch_size,
                    micro_batch=a.micro_batch,
                    deadline=plan.train_deadline,
                    should_stop=should_stop,
                    progress=_progress_printer(r, a.inner_steps),
                )
            )
        except FloatingPointError as e:
            # The global weights give a non-finite loss (e.g. a hostile update blew them up): this peer has
            # nothing sound to contribute this round, but it keeps serving and following the swarm.
            self._say_loss_not_finite(r, e)
            await self._reset_to_start(ctx)
            return None, no_work(time.perf_counter() - t_train)

    def _say_loss_not_finite(self, r: int, e: FloatingPointError) -> None:
        """The one WARNING of inner steps stopped by a non-finite loss (event ``contributing_nothing``)."""
        events.emit(
            log,
            logging.WARNING,
            "contributing_nothing",
            "round %d: %s; contributing nothing this round",
            r,
            e,
            peer=self.me,
            round=r,
            reason="loss_not_finite",
            detail=str(e),
        )

    async def _reset_to_start(self, ctx: RoundContext) -> None:
        """The model back at this round's start weights: its own eager start (``ctx.start``) or the global ones."""
        if ctx.start is not None:
            await asyncio.to_thread(cast(EagerStatePort, self.state).load_model, ctx.start)
        else:
            await asyncio.to_thread(self.state.reset_model)

    # ------------------------------------------------------------------ eager updates (docs/eager.md)
    async def _start_speculative(self, ctx: RoundContext, own: torch.Tensor) -> None:
        """Eager updates: right after round ``r``'s pseudo-gradient ``own`` (its exchange runs meanwhile), this
        peer's start of round ``r + 1``, ``x = O(θ^r, v^r; w·own)`` with ``w`` its planned token share of round
        ``r`` (the real token total is not known before the exchange), computed on copies in a worker thread
        and loaded into the model; then round ``r + 1``'s inner steps start on it with round ``r``'s assignment
        and a train deadline of now + the round's window (:class:`_Speculative`). Nothing when the peer stops
        or leaves after this round, or after its last round."""
        r, plan, a = ctx.round, ctx.planned(), ctx.assignment
        last = self.cfg.rounds is not None and r + 1 >= self.cfg.rounds
        if self.stop.is_set() or self.leaving or last:
            return
        total = plan.total_token_budget()
        weight = float(a.token_budget) / float(total) if total > 0 else 0.0
        state = cast(EagerStatePort, self.state)
        t0 = self.clock.monotonic()
        start = await asyncio.to_thread(state.eager_start, own, weight)
        await asyncio.to_thread(state.load_model, start)
        self._phases["pseudo_gradient"] = self._phases.get("pseudo_gradient", 0.0) + max(
            0.0, self.clock.monotonic() - t0
        )
        from geomesh_p2p.model.training import StepTarget  # training imports transformers: load it only when needed

        spec = _Speculative(
            round=r + 1,
            start=start,
            batch_size=a.batch_size,
            micro_batch=a.micro_batch,
            # Provisional: steps that reach round r's count before round r + 1's plan wait for its count.
            target=StepTarget(a.inner_steps, self.clock.time() + float(plan.window_s), provisional=True),
            abort=threading.Event(),
            weight=weight,
            t_start=self.clock.time(),
        )
        spec.task = asyncio.ensure_future(self._speculative_steps(spec))
        self._spec = spec

    async def _speculative_steps(self, spec: _Speculative):
        """The speculative inner steps (worker thread) until their target, deadline, a stop or an abort.
        Returns an InnerResult; a non-finite loss gives ``no_work`` and the model back at ``spec.start``."""
        should_stop = lambda: self.stop.is_set() or spec.abort.is_set()  # noqa: E731
        t_train = time.perf_counter()
        try:
            return await asyncio.to_thread(
                lambda: self.trainer.run(
                    round=spec.round,
                    inner_steps=spec.target.get()[0],
                    batch_size=spec.batch_size,
                    micro_batch=spec.micro_batch,
                    should_stop=should_stop,
                    target=spec.target,
                )
            )
        except FloatingPointError as e:
            self._say_loss_not_finite(spec.round, e)
            await asyncio.to_thread(cast(EagerStatePort, self.state).load_model, spec.start)
            return no_work(time.perf_counter() - t_train)
        finally:
            spec.t_end = self.clock.time()

    async def _drop_speculative(self, why: str) -> None:
        """Abort the speculative inner steps (a peer not in the plan, a re-sync, a digest mismatch, a stop, the
        end of the run), wait for their thread, and load the global weights back into the model (one INFO
        line, event ``eager_steps_aborted``). Nothing when none runs."""
        spec, self._spec = self._spec, None
        if spec is None:
            return
        spec.abort.set()
        spec.target.release()  # a loop waiting at the provisional target ends now
        if spec.task is not None:
            await asyncio.gather(spec.task, return_exceptions=True)
        await asyncio.to_thread(self.state.reset_model)
        events.emit(
            log,
            logging.INFO,
            "eager_steps_aborted",
            "round %d: speculative inner steps aborted (%s); the model is back at the global weights",
            spec.round,
            why,
            peer=self.me,
            round=spec.round,
            reason=why,
        )

    async def train(self, ctx: RoundContext) -> bool:
        """Phase TRAIN: the assigned inner steps (a worker thread) until the plan's train deadline, then
        this peer's pseudo-gradient. A diverged or non-finite update is replaced by a zero contribution of
        0 tokens (one WARNING line) and the model goes back to the global weights. Inner steps already
        started during the plan's settle on this very plan (:meth:`agree`) are awaited, not started again."""
        self.phase = Phase.TRAIN
        plan, r = ctx.planned(), ctx.round
        ctx.assignment = plan.assignment(self.me)
        ctx.sent0, ctx.recv0 = self.traffic()
        t_phase = self.clock.monotonic()
        spec, self._spec = self._spec, None
        t_end: Optional[float] = None
        if spec is not None and spec.round != r:  # cannot happen (a spec is dropped whenever its round is not run)
            self._spec = spec
            await self._drop_speculative(f"started for round {spec.round}, not {r}")
            spec = None
        if spec is not None:
            a = ctx.assignment
            ctx.start = spec.start
            if (spec.batch_size, spec.micro_batch) == (a.batch_size, a.micro_batch):
                # Eager: the speculative steps are this round's; they take the plan's target and deadline.
                spec.target.set(a.inner_steps, plan.train_deadline)
                try:
                    grad, result = None, await cast(asyncio.Future, spec.task)
                except asyncio.CancelledError:
                    # The driver is cancelled: the steps are no longer in ``_spec`` (run()'s final drop
                    # cannot see them), so their thread is told to end here, not at its deadline.
                    spec.abort.set()
                    spec.target.release()
                    raise
                t_end, ctx.eager_steps = spec.t_end, "adopted"
            else:
                # Another batch shape: those steps are void; restart from this peer's own start.
                spec.abort.set()
                spec.target.release()
                await asyncio.gather(cast(asyncio.Future, spec.task), return_exceptions=True)
                await asyncio.to_thread(cast(EagerStatePort, self.state).load_model, spec.start)
                ctx.eager_steps = "restarted"
                grad, result = await self._inner_steps(ctx, plan)
        elif ctx.early is not None:
            grad, result = await ctx.early
        else:
            grad, result = await self._inner_steps(ctx, plan)
        ctx.t_compute_end = t_end if t_end is not None else self.clock.time()
        self._phases["train"] = self._phases.get("train", 0.0) + max(0.0, self.clock.monotonic() - t_phase)
        t_phase = self.clock.monotonic()
        if self.stop.is_set():
            # Finish the round anyway (the inner steps stopped early): the parts this peer owns stay
            # served and the others get a full update; the node leaves right after.
            log.info("round %d: stop requested; exchanging what was trained, then leaving", r)
        if grad is not None:
            delta = grad
        elif ctx.start is not None:  # eager: from this peer's own start, Δ_m = x_m − y_m
            delta = await asyncio.to_thread(cast(EagerStatePort, self.state).pseudo_gradient_from, ctx.start)
            # Not needed any more: released before the next eager start allocates its three [P] (at 124M
            # parameters the old start held 0.5 GB through that peak).
            ctx.start = None
        else:
            delta = await asyncio.to_thread(self.state.pseudo_gradient)
        if not await asyncio.to_thread(lambda: bool(torch.isfinite(delta).all())):
            events.emit(
                log,
                logging.WARNING,
                "contributing_nothing",
                "round %d: this peer's update has non-finite values (its inner steps diverged); "
                "contributing nothing this round",
                r,
                peer=self.me,
                round=r,
                reason="update_not_finite",
            )
            delta, result = torch.zeros_like(delta), no_work(result.compute_s)
            await asyncio.to_thread(self.state.reset_model)
        ctx.delta, ctx.result = delta, result
        self._phases["pseudo_gradient"] = self._phases.get("pseudo_gradient", 0.0) + max(
            0.0, self.clock.monotonic() - t_phase
        )
        try:
            ctx.spec = self.policy.collective_spec(plan)
        except ValueError as e:  # plan_problem should have caught it; never crash on a leader's plan
            log.error("round %d: the plan of %s cannot be executed (%s); skipping the round", r, plan.leader[:10], e)
            await asyncio.to_thread(self.state.reset_model)  # this round's steps are void
            return False
        return True

    async def exchange(self, ctx: RoundContext) -> bool:
        """Phase EXCHANGE: the collective all-reduce of this peer's update (a stop request waits for it)."""
        self.phase = Phase.EXCHANGE
        self.in_exchange = True
        try:
            fb, spec = self.feedback, ctx.spec
            if fb is not None and getattr(spec, "push_encoding", "sign") == "sign":
                # Error feedback (EF-SGD): push delta + residual, keep what the sign codec drops of each
                # part (the parts this peer pushes: all of them); fp32 tensor math over [P], off the loop.
                ctx.delta = await asyncio.to_thread(
                    fb.apply, ctx.update(), int(ctx.result.tokens), [(o.start, o.end) for o in spec.owners], ctx.round
                )
            ctx.ar = await self.collective.all_reduce(
                ctx.spec, ctx.update(), tokens=ctx.result.tokens, compute_end=ctx.t_compute_end
            )
        finally:
            self.in_exchange = False
        ctx.t_agg = self.clock.time()
        ctx.stall_s = self.loop_stall()  # taken now: the blame below needs it; the row keeps the worst
        paused = self._paused_s(ctx)
        plan = ctx.planned()
        window = max(0.0, float(getattr(plan, "exchange_deadline", 0.0)) - float(getattr(plan, "train_deadline", 0.0)))
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
                peer=self.me,
                round=ctx.round,
                stalled_s=paused,
                window_s=window,
            )
            own = getattr(self.policy, "note_own_failures", None)
            if own is not None:  # its own failures are real for everyone: penalised as the others penalise it
                own(ctx.spec, ctx.planned(), ctx.ar, stalled=True)
        else:
            self.policy.after_exchange(ctx.spec, ctx.planned(), ctx.ar)
        return True

    def _paused_s(self, ctx: RoundContext) -> float:
        """Seconds this peer was not running during round ``ctx.round`` (so far): the worst event-loop stall
        (LoopLagMonitor, taken when the exchange returned) or the wall clock's jump ahead of the monotonic
        clock since the round began (a host that slept), whichever is larger; 0.0 when neither is known."""
        jump = (self.clock.time() - ctx.t_round) - (self.clock.monotonic() - ctx.m_round)
        return max(ctx.stall_s or 0.0, jump if ctx.m_round else 0.0, 0.0)

    async def _drop_feedback(self) -> None:
        """After a re-sync that discarded rounds of this peer's lineage: its error-feedback residual is the
        compression error of pushes applied to the discarded state, so it is zeroed (one INFO line)."""
        fb = self.feedback
        if fb is None:
            return
        await asyncio.to_thread(fb.reset)  # a [P] fill: off the loop
        events.emit(
            log,
            logging.INFO,
            "residual_zeroed",
            "error feedback: residual zeroed (re-synced to the state of round %d, another lineage)",
            self.state.round,
            peer=self.me,
            round=self.state.round,
        )

    async def finish(self, ctx: RoundContext) -> set[str]:
        """Phase FINISH: outer step and digest (worker thread), re-profiling, announcement, evaluation, the
        round's row, digest check, then a checkpoint or a re-sync on a digest mismatch. Returns the
        participants expected next round (this round's contributors)."""
        self.phase = Phase.FINISH
        r, plan, a, result, ar = ctx.round, ctx.planned(), ctx.assignment, ctx.result, ctx.ar
        self._last_plan = plan
        await self.policy.before_outer_step(r, plan, a, ar)  # verified work keeps this round's start weights
        idle = ar.idle_ranges() if hasattr(ar, "idle_ranges") else ()
        with self._timed("outer_step"):  # _advance moves its digest (commit) share to "digest"
            await asyncio.to_thread(self._advance, r, plan, ar.aggregate, idle)
        # Re-profile before announcing round r+1: the record a leader gathers for r+1 then already holds
        # the figures every follower will check its plan against (planner.check_plan).
        self.policy.after_outer_step(r, plan, a, result, ar)
        sent1, recv1 = self.traffic()
        last = self.cfg.rounds is not None and r + 1 >= self.cfg.rounds
        if (self.stop.is_set() or last) and not self.leaving:
            # Say so with the new round's record, before the others gather for it (every way of leaving
            # announces before the next gather; --target-ppl right after the evaluation below; a stop request
            # already said so when it came: _say_leaving_on_stop).
            self._leave()
            events.emit(
                log,
                logging.INFO,
                "leaving_announced",
                "round %d: exchange done; announcing that this peer leaves (%s)",
                r,
                "stop requested" if self.stop.is_set() else f"--rounds {self.cfg.rounds} reached",
                peer=self.me,
                round=r,
                reason="stop" if self.stop.is_set() else "rounds",
            )
        with self._timed("announce"):
            await self.membership.announce()
        with self._timed("eval"):
            ppl, eval_round = await self._evaluate(r, last)
        t = self.cfg.target_ppl
        if t is not None and ppl is not None and ppl <= t and not self.leaving:
            self._leave()
            events.emit(
                log,
                logging.INFO,
                "leaving_announced",
                "round %d: target eval perplexity %g reached; announcing that this peer leaves",
                r,
                t,
                peer=self.me,
                round=r,
                reason="target_ppl",
            )
            await self.membership.announce()
        # The barrier is when the last contributor finished computing (stated in its contributions):
        # waiting until then is straggler idle, waiting after it is network idle (the paper's split).
        barrier = min(ar.last_compute_end or ctx.t_compute_end, ctx.t_agg)
        spec = self._spec if self._spec is not None and self._spec.round == r + 1 else None
        # Eager: the compute is idle only from the end of the next round's speculative steps (when they ended
        # before the aggregate arrived) to the aggregate; that idle time is split at the barrier as above.
        # Steps waiting at their provisional target (for the next plan) are idle since the wait began.
        spec_end = None if spec is None else (spec.t_end or getattr(spec.target, "waiting_since", None))
        idle_from = ctx.t_compute_end if spec is None else min(ctx.t_agg, spec_end or ctx.t_agg)
        straggler = max(0.0, barrier - idle_from)
        network = max(0.0, (ctx.t_agg - idle_from) - straggler)
        delivered = {pid for part in ar.contributors.values() for pid, _ in part}
        claims: dict[str, int] = {}
        for part in ar.contributors.values():
            for pid, n in part:
                claims[pid] = max(claims.get(pid, 0), int(n))
        self.lineage.append(
            LineageEntry(
                r, self.state.digest or "", frozenset(plan.participants()), sum(claims.values()), int(result.tokens)
            )
        )
        digest = self.state.digest
        if digest is None:  # commit() always sets it: a state port that does not is a bug, not a round's fault
            raise RuntimeError(f"round {r}: the global state has no digest after its commit")
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
            round_s=self.clock.time() - ctx.t_round,
            bytes_sent=sent1 - ctx.sent0,
            bytes_received=recv1 - ctx.recv0,
            digest=digest,
            contributors=len(delivered),
            missing_parts=len(ar.missing_parts),
            time=self.clock.time(),
            eval_round=eval_round,
        )
        if self.cfg.eager:
            rec.extra["eager"] = {
                # how this round's inner steps began (RoundContext.eager_steps)
                "steps": ctx.eager_steps,
                # the next round's speculative steps started, and how many seconds before this exchange ended
                "next_started": spec is not None,
                "next_lead_s": (ctx.t_agg - spec.t_start) if spec is not None else None,
                "start_weight": spec.weight if spec is not None else None,
            }
        if self._eval_carry is not None:  # every background evaluation lands in a row (review L3)
            rec.extra["eval_background"] = {"eval_ppl": self._eval_carry[0], "eval_round": self._eval_carry[1]}
            self._eval_carry = None
        later = self.loop_stall()
        known = [x for x in (ctx.stall_s, later) if x is not None]
        if known:
            rec.loop_stall_ms = max(known) * 1e3
        # Only the participants that delivered vote on the digest (and are waited for): a no-show, e.g. an
        # identity on probation that never takes part, would hold every check for its whole wait.
        with self._timed("digest_check"):
            rec.digest_agree = await self.check_digest(
                r + 1, [p for p in plan.participants() if p in delivered] or plan.participants()
            )
        now = self.clock.monotonic()
        rec.phase_s = {k: round(v, 4) for k, v in self._phases.items()}
        rec.cycle_s = now - self._t_row if self._t_row is not None else None
        self._phases, self._t_row = {}, now
        self.history.append(rec)
        if sys.stdout.isatty():
            sys.stdout.write("\r\x1b[K")  # clear the progress line before the row
        if rec.underfilled and not self.stop.is_set():
            # Flagged in the table ("!"), the JSON row and Prometheus too; the next plan already follows the
            # re-measured tokens/s, so a mis-profiled peer gets fewer steps.
            log.warning(
                "round %d: trained %d of %d planned inner steps (device slower than profiled, or busy)",
                r,
                rec.inner_steps_done,
                rec.inner_steps_planned,
            )
        self.policy.publish_record(rec)
        if rec.digest_agree is False:
            self.phase = Phase.RESYNC
            await self._drop_speculative("digest mismatch")
            try:
                with self._timed("resync"):
                    await self._catch_up()
            except StateSyncError as e:  # the next round's behind() check tries again
                log.warning("re-sync failed (%s); will retry", e)
        else:
            if self.cfg.checkpointing and (r + 1) % self.cfg.checkpoint_every == 0:
                with self._timed("checkpoint"):  # counted in the next row's cycle
                    await self.state.checkpoint_or_warn()
            self._fresh_record = True
        return delivered or set(plan.participants())

    async def _evaluate(self, r: int, last: bool) -> tuple[Optional[float], Optional[int]]:
        """Evaluation after round ``r``'s commit: every ``eval_every`` rounds and at the last. Returns
        ``(perplexity, round whose end state it measured)`` for this row, or ``(None, None)``.

        With ``eval_background`` the evaluation of round ``r`` runs in a worker thread on a snapshot of the
        global weights (``trainer.snapshot_for_eval``) while round ``r + 1`` trains, and its result is
        returned at the first finish after it completed (or waited for, when the next evaluation is due:
        the snapshot model is reused). The last round, and a peer that stops, evaluate at once; a background
        result collected then goes into the row's ``extra["eval_background"]`` (``eval_ppl``, ``eval_round``)."""
        due = (r + 1) % self.cfg.eval_every == 0 or last
        background = (
            self.cfg.eval_background
            and not last
            and not self.stop.is_set()
            and hasattr(self.trainer, "snapshot_for_eval")
        )
        ready: tuple[Optional[float], Optional[int]] = (None, None)
        if self._eval_task is not None and (self._eval_task.done() or due or self.stop.is_set()):
            task, self._eval_task = self._eval_task, None
            try:
                ready = (await task, self._eval_round)
                log.info("round %d: eval perplexity %.2f (evaluated in the background)", ready[1], ready[0])
            except Exception as e:  # an evaluation must never end the node; the next one is due anyway
                log.warning("round %d: background evaluation failed (%s: %s)", self._eval_round, type(e).__name__, e)
        if not due:
            return ready
        # Eager: the model trains the next round's speculative steps; the global weights are evaluated on the
        # evaluation snapshot (one more model in memory), loaded from θ, not from the model.
        eager_snapshot = self.cfg.eager and hasattr(self.trainer, "snapshot_for_eval")
        weights = cast(EagerStatePort, self.state).global_weights() if eager_snapshot else None
        if background:
            snap = cast(SnapshotEvaluator, self.trainer)  # checked with hasattr above
            if weights is not None:
                await asyncio.to_thread(lambda: snap.snapshot_for_eval(weights=weights))
            else:
                await asyncio.to_thread(snap.snapshot_for_eval)
            self._eval_round = r
            self._eval_task = asyncio.ensure_future(
                asyncio.to_thread(snap.evaluate_snapshot, max_batches=self.cfg.eval_batches)
            )
            return ready
        if weights is not None:
            snap = cast(SnapshotEvaluator, self.trainer)

            def on_snapshot() -> float:
                snap.snapshot_for_eval(weights=weights)
                return snap.evaluate_snapshot(max_batches=self.cfg.eval_batches)

            ppl = await asyncio.to_thread(on_snapshot)
        else:
            ppl = await asyncio.to_thread(self.trainer.evaluate, max_batches=self.cfg.eval_batches)
        if ready[0] is not None and ready[1] is not None:
            self._eval_carry = (ready[0], ready[1])
        return ppl, r

    def _advance(self, r: int, plan: RoundPlan, aggregate: torch.Tensor, idle) -> None:
        """Outer step and commit as one change of the state (worker thread): under the state's lock when it
        has one, so a reader never sees the stepped buffer under round ``r``'s digest."""
        with getattr(self.state, "state_lock", None) or contextlib.nullcontext():
            self.state.outer_step(r, plan, aggregate, idle)
            t0 = time.monotonic()
            if self._spec is not None:
                # Eager: the next round's speculative steps train on the model; θ^{r+1} is committed (digest,
                # served state) without being loaded into it.
                cast(EagerStatePort, self.state).commit(r + 1, load_model=False)
            else:
                self.state.commit(r + 1)
            # The commit (load, digest, snapshot) is the "digest" phase; the caller's timer counts the whole
            # call as "outer_step", so the commit's seconds move from there (a float add: GIL-atomic enough
            # for the one writer, the driver's own worker thread, while the loop awaits it).
            dt = time.monotonic() - t0
            self._phases["digest"] = self._phases.get("digest", 0.0) + dt
            self._phases["outer_step"] = self._phases.get("outer_step", 0.0) - dt

    def _leave(self) -> None:
        self.leaving = True
        self.set_leaving(True)

    async def check_digest(self, r: int, participants: Sequence[str]) -> Optional[bool]:
        """This peer's digest against the majority of the round's participants (waits up to
        ``digest_wait_s`` for their records, backoff). None: nobody else to compare with."""
        deadline = self.clock.monotonic() + self.cfg.digest_wait_s
        backoff = self._backoff()
        counted = -1
        while True:
            # leaving peers count too: their last record carries the digest they ended the round with
            recs = [x for x in await self.membership.peers(include_leaving=True) if x.peer_id in participants]
            majority, agree, total = digest_majority(recs, r)
            if total >= len(participants) or self.clock.monotonic() > deadline:
                break
            if total != counted:
                counted = total
                backoff.reset()
            if await self._pause(min(backoff.next(), max(0.0, deadline - self.clock.monotonic()) + 0.01)):
                break
        if majority is None or total <= 1:
            return None
        if majority != self.state.digest:
            events.emit(
                log,
                logging.ERROR,
                "digest_mismatch",
                "round %d: my digest %s differs from the majority's %s (%d/%d); re-syncing",
                r,
                (self.state.digest or "")[:8],
                majority[:8],
                agree,
                total,
                peer=self.me,
                round=r,
                digest=self.state.digest,
                majority_digest=majority,
                agree=agree,
                total=total,
            )
            return False
        self._confirmed_round = max(self._confirmed_round, r)
        return True


def _progress_printer(r: int, planned: int):
    """A live progress line for the inner steps, on a terminal only (logs stay clean)."""
    if not sys.stdout.isatty():
        return None

    def show(step: int, loss: float, tokens_per_s: float) -> None:
        sys.stdout.write(
            f"\r  round {r}: inner step {step}/{planned}  loss {loss:.3f}  {tokens_per_s:,.0f} tokens/s\x1b[K"
        )
        sys.stdout.flush()

    return show
