"""The round state machine (issue 13): gather members -> agree on a plan -> train -> exchange ->
outer step -> digest check / re-sync, with every collaborator injected (:mod:`geomesh_p2p.round.ports`).

One :class:`RoundDriver` runs the rounds of one peer. Each phase is a module of this package (:mod:`.gather`,
:mod:`.planning`, :mod:`.train`, :mod:`.exchange`, :mod:`.finish`; :mod:`.eager` the speculative next-round
steps, :mod:`.resync` catching up with the swarm and the end of a run; :mod:`.context` what they share), and
:attr:`RoundDriver.phase` says which one runs (the node's status and the tests read it); this module is the
loop that calls them. Whole-model work (inner steps, the outer step, loading weights, the digest,
evaluation, checkpoints) runs in worker threads, never on the event loop. Waiting for peers or for a round
reads the DHT with capped exponential backoff (50 ms -> 1 s, x1.5, restarting when what is read changes)
instead of fixed-period polling. docs/round.md lists the phases, their timeouts and the DHT requests of
one round.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from geomesh_p2p.exchange.codec.feedback import PushFeedback
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from geomesh_p2p.telemetry.metrics import RoundRecord
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.util.procstat import status_bytes
from geomesh_p2p.round import eager, exchange, finish, gather, planning, resync, train
from geomesh_p2p.round import light as light_phase
from geomesh_p2p.round.context import (
    DriverConfig,
    LineageEntry,
    Phase,
    RoundContext,
    Speculative,
    SwarmEnded,
    no_work,
)
from geomesh_p2p.round.eval_schedule import EvalSchedule
from geomesh_p2p.round.exchange import STALL_VOID_SHARE
from geomesh_p2p.round.gather import (
    PROBATION_SYNC_GRANTS,
    ROUND_END_SLACK_S,
    SYNC_WAIT_MARGIN_S,
    SYNC_WAIT_SLACK,
    SyncWaits,
)
from geomesh_p2p.round.ports import (
    Clock,
    Collective,
    GlobalStatePort,
    Membership,
    PlanAgreement,
    RoundPolicy,
    SystemClock,
    Trainer,
)
from geomesh_p2p.round.resync import RESYNC_RETRY_PAUSE_S, SURVIVOR_RULE

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: Rounds of this peer's lineage kept for telling what a re-sync to another side's state discards.
LINEAGE_ROUNDS = 4096
#: Seconds a record read by a gather still counts when a plan is checked (issue 25): under load records
#: expire (8 s) before a follower reads them; a plan naming such a peer costs at most its parts, while
#: refusing it makes the follower sit the round out.
RECENT_RECORD_S = 60.0
#: Longest wait, seconds, at the end of the rounds for a stop's leaving announcement under way (a DHT store: a few
#: RPC timeouts at worst): cut short, the announcement never reached the others (fresh user 52, below).
LEAVING_ANNOUNCE_WAIT_S = 15.0

__all__ = [
    "Phase",
    "DriverConfig",
    "RoundDriver",
    "RoundContext",
    "LineageEntry",
    "SwarmEnded",
    "no_work",
    # the phases' constants, importable from here as before the split
    "LINEAGE_ROUNDS",
    "PROBATION_SYNC_GRANTS",
    "RESYNC_RETRY_PAUSE_S",
    "ROUND_END_SLACK_S",
    "STALL_VOID_SHARE",
    "SURVIVOR_RULE",
    "SYNC_WAIT_MARGIN_S",
    "SYNC_WAIT_SLACK",
]


class RoundDriver:
    """Runs rounds until ``rounds`` / ``target_ppl`` / ``stop``.

    Args:
        membership, plans, trainer, collective, state, policy: the ports (:mod:`geomesh_p2p.round.ports`).
        cfg: :class:`DriverConfig`.
        stop: set to stop; a round under exchange finishes first (its parts stay served).
        clock: wall and monotonic time (injected in tests).
        traffic: ``() -> (bytes sent, bytes received)`` so far, for the round's row.
        traffic_classes: ``() -> {class: {"sent", "received", "calls", "served"}}`` so far
            (:meth:`~geomesh_p2p.net.transport.TrafficStats.by_class`); each row's ``extra["traffic"]`` is
            its change over the row's cycle (DHT and exchange apart). Default: none (no ``extra["traffic"]``).
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
        traffic_classes: Callable[[], dict] = dict,
        history: Optional[list[RoundRecord]] = None,
        leaving: Callable[[bool], None] = lambda _: None,
        activity_changed: Callable[[], None] = lambda: None,
        loop_stall: Callable[[], Optional[float]] = lambda: None,
        feedback: Optional[PushFeedback] = None,
    ):
        """``loop_stall``: the worst event-loop stall (seconds) since its previous call (LoopLagMonitor.take_worst),
        into each round's row as ``loop_stall_ms``; None: not measured. ``feedback``: the run's error feedback
        (:class:`~geomesh_p2p.exchange.codec.feedback.PushFeedback`, ``--error-feedback``) applied to this peer's
        sign pushes in :meth:`exchange`; None: off."""
        self.membership, self.plans, self.trainer, self.collective = membership, plans, trainer, collective
        self.state, self.policy, self.cfg, self.stop = state, policy, cfg, stop
        self.clock = clock or SystemClock()
        self.traffic = traffic
        self.traffic_classes = traffic_classes
        self.history = history if history is not None else []
        self.set_leaving = leaving
        #: what the round loop does now, as this peer's record announces it (``PeerRecord.activity``: waiting /
        #: training / sitting out / refusing plans / no plan / syncing; None before its first gather); set by
        #: :meth:`note_activity`, whose change is announced at once through ``activity_changed``
        self.activity: Optional[str] = None
        #: whether the end of the rounds waited LEAVING_ANNOUNCE_WAIT_S for a stop's leaving announcement in vain
        #: (read by the node's shutdown: it then announces nothing more)
        self.leaving_wait_expired = False
        self._activity_changed = activity_changed
        self.loop_stall = loop_stall
        self.feedback = feedback
        #: monotonic seconds of the loop's last step: a phase entered, a backoff pause (liveness is progress,
        #: issue 29 #5: the node's watchdog stops announcing a peer whose loop stopped advancing)
        self.progressed_at = self.clock.monotonic()
        self.phase = Phase.IDLE
        self.in_exchange = False
        self.leaving = False
        self._rounds_after_stop = 0  # rounds taken part in after a stop request (_planned_after_stop: at most one)
        self._waiting_logged: Optional[tuple[int, int, bool]] = None
        #: peer -> (progress-derived waits it did not arrive from, the round of the last): round/gather.py
        self._sync_misses: dict[str, tuple[int, int]] = {}
        #: the rounds this peer applied, newest last (what a re-sync to another side's state discards)
        self.lineage: collections.deque[LineageEntry] = collections.deque(maxlen=LINEAGE_ROUNDS)
        #: seconds per phase (metrics.PHASES) since this peer's previous row, and that row's monotonic time
        self._phases: dict[str, float] = {}
        #: anonymous RSS (bytes) each phase added since the previous row: end minus start, summed (issue 27: which
        #: phase the growth over the first rounds comes from); memory that a background task (verified work,
        #: background evaluation) takes between phases counts in none
        self._phase_rss: dict[str, int] = {}
        self._phase_cpu: dict[str, float] = {}  # the process's CPU seconds (all threads) in each phase
        self._t_row: Optional[float] = None
        self._traffic_row: dict = {}  # traffic_classes() at the previous row (empty: none yet)
        self._verify_busy_row = 0.0  # verified work's compute seconds at the previous row (finish.publish_row)
        #: the background evaluation under way (DriverConfig.eval_background) and the round it measures
        self._eval_task: Optional[asyncio.Future] = None
        self._eval_round: Optional[int] = None
        #: a background evaluation collected by a synchronous one (the last round): (ppl, round), for the row's extra
        self._eval_carry: Optional[tuple[float, int]] = None
        #: which rounds it evaluates after (--eval-every N, or auto from the seconds measured: eval_schedule.py);
        #: the node notes its initial evaluation's seconds here (round -1)
        self.eval_schedule = EvalSchedule(cfg.eval_every)
        #: the last round finished in sync and its end announced this peer's record: the loop top's
        #: announce and behind-check would repeat that store and the gather's own swarm-round check
        self._fresh_record = False
        self._gathered: Optional[dict[str, PeerRecord]] = None  # live records of the gather's last read, for agree()
        #: records that announced leaving in the gather's last read: a plan naming one is no fork, see agree()
        self._gathered_leaving: dict[str, PeerRecord] = {}
        #: peer -> (its latest record read by a gather, monotonic seconds read): a plan naming a peer whose
        #: record expired before this peer's read (under load) is checked against it (planning.known_view)
        self._recent: dict[str, tuple[PeerRecord, float]] = {}
        #: (round, digest, leaders) whose plans this peer refused while others could follow them: it sat that
        #: attempt out; the next attempt at the same round and state does not wait for or defer to them
        self._refused_leaders: tuple[int, Optional[str], frozenset] = (-1, None, frozenset())
        #: set when the run ends because the swarm ended without this peer (node: no "done" line)
        self.ended: Optional[SwarmEnded] = None
        #: the first round whose start state the swarm has not confirmed to this peer (a digest check that
        #: agreed, or a state adopted by a catch-up): blame noted from it on is of an unconfirmed lineage
        self._confirmed_round: int = 0
        #: (round, swarm time) of the last state a catch-up adopted: words a planned-out line (planning.left_out_why)
        self._synced_to: Optional[tuple[int, float]] = None
        #: the latest round the swarm's vote was seen at (behind / gather), for the line of a peer left alone
        self._swarm_seen: int = 0
        #: this session started from the seed (round 0) of a run known at no later round (``run``'s
        #: ``known_round``), or past round 0 from a state no older than the round the run was known at (its last
        #: state, continued: a peer restarted after every other peer left), and no read has shown another peer's record since but a previous session's
        #: leaving ones at or before that state (:meth:`left_before`): this peer is the whole swarm, its state the
        #: run's (:func:`~geomesh_p2p.round.resync.left_alone`); set in :meth:`run`, cleared by the first other record
        #: :meth:`remember` or ``behind`` reads
        self._whole_swarm = False
        #: (round, digest) this session started from (set in :meth:`run`; round -1 before)
        self._start: tuple[int, Optional[str]] = (-1, None)
        #: a previous session's leaving record at :attr:`_start` (round and digest) was read as this session began
        #: (:meth:`run`): the evidence :func:`~geomesh_p2p.round.resync.left_alone` needs, kept past its expiry
        self._start_backed = False
        #: the PeerID that wrote the checkpoint this session resumed, when another identity (:meth:`run`): its leaving
        #: record is that checkpoint's own word, no backing of :func:`~geomesh_p2p.round.resync.left_alone`
        self._written_by: Optional[str] = None
        #: the other PeerIDs that trained the resumed checkpoint's last round (:meth:`run`; empty: a fresh start)
        self._resumed_with: tuple[str, ...] = ()
        #: the other peers a gather of this session read live (not leaving): a resumed peer's end needs one of them
        self._seen_live: set[str] = set()
        #: monotonic seconds when the last "still waiting for them" line of a resumed peer was said (gather)
        self._held_logged: Optional[float] = None
        #: the state (round, digest) a resumed peer first saw peers it trained with live on other states at, and when
        #: (monotonic seconds): the start of its bounded wait (:func:`~geomesh_p2p.round.tie.resumed_tie`)
        self._tie_seen: Optional[tuple[tuple[int, str], float]] = None
        #: (this peer's state, the winning state) of the last ``resumed_tie`` line: said once per tie
        self._tie_logged: Optional[tuple[tuple[int, str], tuple[int, str]]] = None
        #: the state a resumed peer still at its start re-synced to in its start-up gather (gather.rejoin: a tie lost, a
        #: majority of its partners elsewhere): held for the checkpoint's peers there too (gather.held_for_swarm)
        self._rejoined_from_start: Optional[tuple[int, Optional[str]]] = None
        self._tie_said_at = 0.0  # monotonic seconds of that line (round/tie.py: a changed winner, once per TIE_LOG_S)
        #: the (round, digest) states a start-up gather re-synced toward (:func:`~geomesh_p2p.round.gather.rejoin`):
        #: each is tried once, a catch-up that kept this peer's state is not repeated every read of the wait
        self._rejoin_tried: set[tuple[int, str]] = set()
        #: the (round, digest) at which a gather asked whether a plan naming this peer was made with peers that
        #: announced leaving since (:func:`~geomesh_p2p.round.gather.planned_with_leavers`): asked once
        self._leavers_plan_read: tuple[int, Optional[str]] = (-1, None)
        #: ((round, digest), the other peers a gather read live in step at it): leavers it may wait a plan for
        self._in_step_seen: tuple[tuple[int, Optional[str]], set[str]] = ((-1, None), set())
        #: swarm seconds when this driver (this process's session of the run) began: leaving records announced
        #: before it are a previous session's, no sign that the swarm ended now (resync.swarm_ended)
        self.started_at: float = swarm_time()
        #: eager updates: the next round's inner steps, started speculatively while this round's exchange runs
        self._spec: Optional[Speculative] = None
        #: (round, digest, attempts in a row that ended without a plan) of the round being agreed: after one,
        #: a peer that is no leader candidate in its own view becomes the last resort
        #: (:func:`~geomesh_p2p.round.planning.last_resort`)
        self._plan_misses: tuple[int, Optional[str], int] = (-1, None, 0)
        #: the plan of the last round this peer applied: the next gather waits for its contributors still
        #: finishing it until its exchange deadline (:func:`~geomesh_p2p.round.gather.finishing_waits`)
        self._last_plan: Optional[RoundPlan] = None
        #: the plan this peer obtained for its last agreed round, followed or not (``planning.last_round_leaders``)
        self._plan_seen: Optional[RoundPlan] = None
        #: round -> the plan this peer obtained for it, the last few (round/last_plan.py: its record's reference)
        self._plans_by_round: dict[int, RoundPlan] = {}
        #: the round whose doubt of its previous round's plan was said (planning.recover_last_plan: once a round)
        self._doubt_said = -1
        #: the round at whose agreement this peer took its own marks of the round before from a recovered plan that
        #: named it (planning.recover_last_plan): its leader candidates are computed again
        self._sat_out_taken: Optional[int] = None
        #: light followers (issue 25, round/light.py): the round this peer may run light (set when it confirmed
        #: the previous round's digest), and a round sent back to the full path
        self._light_ok_round = -1
        self._light_fallback_round = -1
        #: the window of the last "trains H inner steps" line (round/steps.py): said again when it moves by a quarter
        self.said_window: Optional[float] = None

    @property
    def me(self) -> str:
        return self.membership.me

    @property
    def phase(self) -> Phase:
        """Where the driver is; entering a phase is progress (:attr:`progressed_at`)."""
        return self._phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._phase = value
        self.progressed_at = self.clock.monotonic()

    def stalled_s(self) -> float:
        """Seconds since the loop last advanced (a phase entered, a backoff pause ended)."""
        return max(0.0, self.clock.monotonic() - self.progressed_at)

    @property
    def last_plan(self) -> Optional[RoundPlan]:
        """The plan of the last round this peer exchanged and applied (None before its first): a leaving node
        keeps serving that round's parts until its exchange deadline (``PeerNode.shutdown``)."""
        return self._last_plan

    # ------------------------------------------------------------------ what the phases share
    def backoff(self) -> Backoff:
        """A fresh backoff of the driver's DHT reads (``backoff_first_s`` -> ``backoff_cap_s``)."""
        return Backoff(self.cfg.backoff_first_s, max(self.cfg.backoff_first_s, self.cfg.backoff_cap_s))

    def remember(self, records: Sequence[PeerRecord]) -> None:
        """Keep ``records`` (a gather's read) for :meth:`recent`; forget those older than ``RECENT_RECORD_S``."""
        now = self.clock.monotonic()
        self.saw_others(records)
        self._recent.update({r.peer_id: (r, now) for r in records})
        for pid in [p for p, (_, t) in self._recent.items() if now - t > RECENT_RECORD_S]:
            del self._recent[pid]

    def saw_others(self, records: Sequence[PeerRecord]) -> None:
        """Note a read of the run's records: one of another peer (leaving or not), unless a previous session's
        leaving record behind this session's start (:meth:`left_before`), ends :attr:`_whole_swarm`."""
        if self._whole_swarm and any(r.peer_id != self.me and not self.left_before(r) for r in records):
            self._whole_swarm = False

    def left_before(self, record: PeerRecord) -> bool:
        """``record`` announced leaving before this session began (less ``resync.PREVIOUS_SESSION_MARGIN_S``), at an
        earlier round than the one this session started from, or at that round with its digest: a peer that left the
        run where this peer took it up (the state it continues is the one that peer left), no other lineage."""
        r0, d0 = self._start
        return bool(
            record.leaving
            and float(record.timestamp) < self.started_at - resync.PREVIOUS_SESSION_MARGIN_S
            and (record.round < r0 or (record.round == r0 and d0 is not None and record.weights_digest == d0))
        )

    def recent(self) -> dict[str, PeerRecord]:
        """Records read by gathers within the last ``RECENT_RECORD_S`` seconds (the newest of each peer)."""
        now = self.clock.monotonic()
        return {p: r for p, (r, t) in self._recent.items() if now - t <= RECENT_RECORD_S}

    def add_phase_s(self, name: str, seconds: float, cpu_s: float = 0.0) -> None:
        """Add ``seconds`` (may be negative: a share moved to another phase) to phase ``name`` of the cycle, and
        ``cpu_s`` to the process's CPU seconds in it (``extra["phase_cpu_s"]`` of the row)."""
        self._phases[name] = self._phases.get(name, 0.0) + seconds
        self._phase_cpu[name] = self._phase_cpu.get(name, 0.0) + cpu_s

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the monotonic seconds the block takes to phase ``name`` of the current cycle (issue 17: the
        round row's ``phase_s``, what the non-compute share of a round is made of), the CPU seconds every
        thread of the process used meanwhile to its ``extra["phase_cpu_s"]`` (issue 27, session 38: a phase far
        longer than its CPU waited, for a core or for the others; one using more CPU than in isolation worked more),
        and the anonymous RSS it added to ``extra["phase_rss_mib"]`` (which phase a growth over rounds comes from)."""
        t0, c0 = self.clock.monotonic(), time.process_time()
        rss0 = status_bytes("RssAnon").get("RssAnon")
        try:
            yield
        finally:
            self.add_phase_s(name, max(0.0, self.clock.monotonic() - t0), max(0.0, time.process_time() - c0))
            rss1 = status_bytes("RssAnon").get("RssAnon")
            if rss0 is not None and rss1 is not None:
                self._phase_rss[name] = self._phase_rss.get(name, 0) + rss1 - rss0

    async def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stop; True when stopped. (The only sleep of the driver: backoff.) A loop
        that pauses comes round again: each pause is progress."""
        try:
            return await self.clock.wait(self.stop, seconds)
        finally:
            self.progressed_at = self.clock.monotonic()

    # ------------------------------------------------------------------ the loop
    async def run(
        self, known_round: int = 0, written_by: Optional[str] = None, resumed_with: Sequence[str] = ()
    ) -> None:
        """Rounds until done. Catches up first whenever the swarm holds a later round. A background
        evaluation still running at the end is waited for (its thread cannot be cancelled). ``known_round``: the
        newest round the join knew the run at (``RoundState.known_round``); past round 0, a session starting at round
        0 is not the whole swarm (red team 46: a peer resumed from a round-0 checkpoint of a run that had reached
        round 15 trained alone, then ended "its state is the run's", synced, exit 0). ``written_by``: the PeerID that
        wrote the checkpoint this session resumed, when another identity (``RoundState.written_by``): its leaving
        record backs no start (red team 48b: a fork restarted under a new key was backed by its own old record).
        ``resumed_with``: the other PeerIDs that trained the resumed checkpoint's last round (``RoundState``): the
        start-up gather waits for them past ``--wait-peers-s`` (``gather.held_for_swarm``)."""
        # The state this session starts from (round 0, or a checkpoint's round on --resume) counts as confirmed: what
        # this peer noted before it (its restored standing credits and penalties) is never dropped as an
        # unconfirmed lineage's by a re-sync (a fresh-user trial, session 31: a peer resumed at round 24 behind the
        # swarm caught up to round 30 and dropped its standing of rounds 0-23, all of them digest-checked)
        self._confirmed_round = max(self._confirmed_round, int(self.state.round))
        # The whole swarm: started from the seed of a run known at no later round, or from the round the run was
        # known at (fresh user 47: p2 restarted on its checkpoint of round 7 after p1 had left at round 7 on the same
        # state trained round 7 alone after --wait-peers-s, as --min-peers says, then ended "NOT the swarm's", exit 3,
        # though its lineage was the run's only one). Past round 0 the run must be known (a bootstrap's round, the
        # leaving records'), at this round or before (a bootstrap may have seen the last round's start only): a resume
        # with nothing known of the run is not claimed to be its last state.
        r0 = int(self.state.round)
        self._start = (r0, self.state.digest)
        # The records as they are now, kept: the leaving records that back this start expire (the record lifetime,
        # ~30-40 s at the defaults) before the wait, the lone round and the second wait are over, and read only at
        # the end they were gone even when this peer was restarted 4 s after the others left (fresh user 48: exit 3)
        at_start = [r for r in await self._records_at_start() if r.peer_id != self.me]
        self._written_by = written_by
        self._resumed_with = tuple(resumed_with)
        self._start_backed = r0 <= 0 or any(
            self.left_before(r) and (r.round, r.weights_digest) == (r0, self.state.digest) and r.peer_id != written_by
            for r in at_start
        )
        self._whole_swarm = (known_round <= 0 if r0 == 0 else 0 < known_round <= r0) and all(
            self.left_before(r) for r in at_start + [r for p, (r, _) in self._recent.items() if p != self.me]
        )
        self._swarm_seen = max(self._swarm_seen, known_round)  # a peer left alone says where the run was
        watcher = asyncio.ensure_future(self._say_leaving_on_stop())
        try:
            await self._rounds()
        finally:
            if self.stop.is_set() and not watcher.done():
                # A stop's leaving announcement under way is finished, not cancelled: a peer stopped while it waited
                # alone leaves its gather at once, and cancelling the store here (the node's shutdown then saw
                # "leaving" set and announced nothing) left its last record "training" on the others' status views
                # until it expired (fresh user 52: 98.9 s after the peer exited).
                await asyncio.wait({watcher}, timeout=LEAVING_ANNOUNCE_WAIT_S)
                # still under way: the DHT took no store in that long (gone, or unreachable); the node's shutdown
                # does not wait as long again for its own leaving announcement (red team 52c: a Ctrl-C with the DHT
                # gone waited 15 s here, then the shutdown's store without a bound)
                self.leaving_wait_expired = not watcher.done()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            # Eager: speculative steps of a round that will not run stop; the model holds the global weights.
            await self._drop_speculative("the run ends")
            if self._eval_task is not None:
                await asyncio.gather(self._eval_task, return_exceptions=True)
                self._eval_task = None

    async def _records_at_start(self) -> list[PeerRecord]:
        """The run's records (leaving ones included) read as this session starts; [] when the read fails (nothing
        then backs the claim of :func:`~geomesh_p2p.round.resync.left_alone`)."""
        try:
            return list(await self.membership.peers(include_leaving=True))
        except Exception as e:  # noqa: BLE001  a DHT that does not answer: no evidence, the claim is not made
            log.debug("the records at start could not be read: %s", e)
            return []

    async def _say_leaving_on_stop(self) -> None:
        """On a stop request (Ctrl+C, SIGTERM), announce at once that this peer leaves: the round under way
        is still finished (its plan names this peer), but no leader plans the next one with it. Announced
        only at the round's end, a stop landing late in a round raced the others' gather of the next one: a
        leader could plan a peer that was about to exit (a fresh-user trial: with ``--eager`` half the model
        went without an update that round, and the leaving peer was penalised as a no-show)."""
        await self.stop.wait()
        if self.leaving or self.ended is not None:
            return
        self.mark_leaving()
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
        while self.ended is None:  # ended: the swarm ended without this peer
            if self.stop.is_set() and (first or not await self._planned_after_stop()):
                break
            if self.cfg.rounds is not None and self.state.round >= self.cfg.rounds:
                break
            light_round = light_phase.is_light(self)
            if self._fresh_record:
                self._fresh_record = False  # gather() itself returns None when the swarm is ahead
            else:
                with self.timed("top"):
                    await self.membership.announce()
                    behind = await self.behind()
                if behind:
                    with self.timed("resync"):
                        await self.resync("the swarm is at a later round")
                    continue
            if light_round:
                # a light follower: no gather (round/light.py); None sends this round back to the full path
                outcome = await self.one_round([], light=True)
                if outcome is None:
                    continue
                expected, first = outcome, False
                if self.reached_target() or self.ended is not None:
                    break
                continue
            with self.timed("gather"):
                members = await self.gather(expected, first=first)
            if self.ended is not None:
                break  # the swarm ended without this peer (gather or resync said so in one WARNING)
            if members is None:
                continue  # the swarm is ahead: the next pass catches up
            if self.stop.is_set() and {m.peer_id for m in members} <= {self.me}:
                break  # stopped while alone: nobody plans with this peer (with others, it still takes part)
            first = False
            expected = await self.one_round(members) or set()
            if self.reached_target():
                break
            if self.ended is not None:
                break
        if self.ended is None and not self.stop.is_set() and self.history:
            await self._check_end()
        self.phase = Phase.DONE

    async def _planned_after_stop(self) -> bool:
        """Stopped between two rounds: does a leader's plan of the next round name this peer anyway? A leader that
        read this peer's record before it announced leaving planned it; had it left, its part went missing (half
        the model without an update in a 2-peer swarm) and it was marked a no-show for stopping cleanly (a
        fresh-user trial, session 34). Such a round is taken part in (the stop holds once the token floor's steps
        are done, at once without a floor: round.steps.stop_after_floor; its part served). Asked for up to
        ``plan_timeout_s`` (the plans are read; nothing is published here), once without a wait when the only
        others are peers that announced leaving during this round (``resync.leavers_of_round``: they may have planned
        it before they left; session 38); a plan agreement without ``names`` (a test's fake) says no, and so does
        every ask after one such round (a leader that kept planning a leaving peer must not keep it from leaving)."""
        names = getattr(self.plans, "names", None)
        if names is None or self._rounds_after_stop >= 1:
            return False
        try:
            everyone = await self.membership.peers(include_leaving=True)
        except Exception as e:  # the DHT may be gone while the peer stops: nobody to plan with it then
            log.debug("round %d: records not read after the stop request: %r", self.state.round, e)
            everyone = []
        others = [r for r in everyone if r.peer_id != self.me and not r.leaving]
        if not others and not resync.leavers_of_round(self, everyone):
            return False  # the others ended (or left) too: no plan will come (a 4 s wait on every Ctrl+C, session 34)
        # Only peers that announced leaving during this round: one read, no wait (a plan they made with this peer is
        # there already, unless a leader stopped during its agreement); a leave at round r is no leave from its
        # plan (session 38: a peer still gathering when the others left ended the run without the round naming it)
        wait_s = self.cfg.plan_timeout_s if others else 0.0
        log.info(
            "round %d: stop requested between rounds; reading whether the round's plan names this peer (%s)",
            self.state.round,
            f"up to {wait_s:.0f} s" if others else "once: every other peer announced leaving at this round",
        )
        planned = bool(await names(self.state.round, self.me, wait_s))
        if planned:
            self._rounds_after_stop += 1
            log.info(
                "round %d: stop requested, but a leader's plan of this round names this peer: taking part (only its "
                "token floor's inner steps, its part served), then leaving",
                self.state.round,
            )
        return planned

    def reached_target(self) -> bool:
        """True once the last row's evaluation is at or under ``target_ppl``."""
        t = self.cfg.target_ppl
        h = self.history
        return t is not None and bool(h) and h[-1].eval_ppl is not None and h[-1].eval_ppl <= t

    async def one_round(self, members: list[PeerRecord], *, light: bool = False) -> Optional[set[str]]:
        """Run round ``state.round`` with ``members``; returns the participants expected next round. ``light``:
        as a light follower (round/light.py; ``members`` unused), None when it sends the round back to the
        full path."""
        ctx = RoundContext(
            round=self.state.round,
            t_round=self.clock.time(),
            members=members,
            m_round=self.clock.monotonic(),
            light=light,
        )
        with self.timed("plan"):
            agreed = await (light_phase.agree(self, ctx) if light else self.agree(ctx))
        if agreed is None:
            return None
        if not agreed:
            return set()
        self.note_activity("training")
        if not await self.train(ctx):
            return set()
        if not self.cfg.eager:
            with self.timed("exchange"):
                exchanged = await self.exchange(ctx)
            if not exchanged:
                return set()
            return await self.finish(ctx)
        # Eager updates: the exchange runs in the background while this peer computes its own start of the
        # next round and starts that round's inner steps from it (docs/eager.md); at most one exchange is in
        # flight (the next one starts after this round's finish, which precedes the next agree).
        own = ctx.update()  # before the exchange may replace ctx.delta (error feedback pushes delta + residual)
        exchanging = asyncio.ensure_future(self.exchange(ctx))
        try:
            try:
                await eager.start_speculative(self, ctx, own)
            except Exception as e:  # never lose the round over it: the next round starts from the global weights
                log.warning(
                    "round %d: eager start failed (%s: %s); next round starts from the global weights",
                    ctx.round,
                    type(e).__name__,
                    e,
                )
            with self.timed("exchange"):
                exchanged = await exchanging
            if not exchanged:
                await self._drop_speculative("the exchange failed")
                return set()
            return await self.finish(ctx)
        except BaseException:
            await self._drop_speculative("the round failed")
            if not exchanging.done():
                exchanging.cancel()
                await asyncio.gather(exchanging, return_exceptions=True)
            raise

    def note_activity(self, activity: str) -> None:
        """What the round loop does now (:attr:`activity`); a change is announced at once, in the background (fresh
        user 52: a peer waiting for --min-peers, catching up or refusing every plan was listed ``training``)."""
        if activity != self.activity:
            self.activity = activity
            try:
                self._activity_changed()
            except Exception as e:  # advisory (the status views): the next announcement carries it
                log.debug("announcing the activity %r failed: %r", activity, e)

    def mark_leaving(self) -> None:
        """This peer leaves after the round under way (its next announcement says so; the node is told)."""
        self.leaving = True
        self.set_leaving(True)

    # ------------------------------------------------------------------ the phases (modules of this package)
    async def gather(self, expected: set[str], *, first: bool) -> Optional[list[PeerRecord]]:
        """Phase GATHER (:func:`geomesh_p2p.round.gather.gather`): the peers in sync for this round; None when
        the swarm holds a later round, or with :attr:`ended` set when the swarm ended without this peer."""
        return await gather.gather(self, expected, first=first)

    async def agree(self, ctx: RoundContext) -> bool:
        """Phase PLAN (:func:`geomesh_p2p.round.planning.agree`): the plan this peer follows. False: no round
        for this peer (no plan, or not in it: it waited for the round's end and re-synced)."""
        return await planning.agree(self, ctx)

    async def train(self, ctx: RoundContext) -> bool:
        """Phase TRAIN (:func:`geomesh_p2p.round.train.train`): inner steps, then this peer's update. False:
        the plan cannot be executed (the round is skipped)."""
        return await train.train(self, ctx)

    async def exchange(self, ctx: RoundContext) -> bool:
        """Phase EXCHANGE (:func:`geomesh_p2p.round.exchange.exchange`): the collective all-reduce of this
        peer's update (a stop request waits for it)."""
        return await exchange.exchange(self, ctx)

    async def finish(self, ctx: RoundContext) -> set[str]:
        """Phase FINISH (:func:`geomesh_p2p.round.finish.finish`): outer step and commit, announcement,
        evaluation, the round's row, digest check, then a checkpoint or a re-sync. Returns the participants
        expected next round (this round's contributors)."""
        return await finish.finish(self, ctx)

    async def behind(self) -> bool:
        """True when the swarm's vote backs a later round than this peer's (:func:`geomesh_p2p.round.resync.behind`)."""
        return await resync.behind(self)

    async def resync(self, why: str, target: Optional[tuple[int, str]] = None) -> None:
        """Download the swarm's state (:func:`geomesh_p2p.round.resync.resync`; ``target``: that (round, digest)
        only); a failure is one warning and a pause, or the end of the run when every other peer announced leaving."""
        self.note_activity("syncing")
        await resync.resync(self, why, target)

    async def wait_out(self, ctx: RoundContext) -> None:
        """A planned-out peer waits for the round's end, then re-syncs (:func:`geomesh_p2p.round.planning.wait_out`)."""
        await planning.wait_out(self, ctx)

    async def wait_for_round(self, r: int, timeout_s: float = 30.0) -> bool:
        """Wait until another peer announces round ``r`` with a digest (backoff); True when one did."""
        return await planning.wait_for_round(self, r, timeout_s)

    async def check_digest(self, r: int, participants: Sequence[str]) -> Optional[bool]:
        """This peer's digest against the majority of the round's participants
        (:func:`geomesh_p2p.round.finish.check_digest`). None: nobody else to compare with."""
        return await finish.check_digest(self, r, participants)

    # The phases' helpers under their former names (tests call them; the modules hold the details).
    def _sync_deadline(
        self, rec: PeerRecord, recs: list[PeerRecord], waits: SyncWaits, now: float, wait_s: float
    ) -> float:
        return gather.sync_deadline(self, rec, recs, waits, now, wait_s)

    def _finishing_waits(
        self, missing: set[str], recs: list[PeerRecord], end: Optional[float], now: float, logged: set[str]
    ) -> dict[str, float]:
        return gather.finishing_waits(self, missing, recs, end, now, logged)

    def _last_resort(self, r: int, members: Sequence[PeerRecord], candidates: Sequence[str]) -> list[str]:
        return planning.last_resort(self, r, members, candidates)

    async def _discard_early(self, ctx: RoundContext, plan: Optional[RoundPlan]) -> None:
        await planning.discard_early(self, ctx, plan)

    async def _drop_speculative(self, why: str) -> None:
        await eager.drop_speculative(self, why)

    async def _drop_feedback(self) -> None:
        await exchange.drop_feedback(self)

    def _end(self, ended: SwarmEnded, **facts: Any) -> None:
        resync.end_run(self, ended, **facts)

    async def _check_end(self) -> None:
        await resync.check_end(self)

    async def _catch_up(self, target: Optional[tuple[int, str]] = None) -> None:
        await resync.catch_up(self, target)

    def _log_dropped(self, before: tuple, recs: Sequence[PeerRecord]) -> None:
        """Called through the driver by :func:`geomesh_p2p.round.resync.catch_up` (a test replaces it)."""
        resync.log_dropped(self, before, recs)
