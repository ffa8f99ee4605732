"""A training peer: DHT + capability + round protocol + collective + inner training, wired together.

Lifecycle (DESIGN.md, all of it):

1. Start the gRPC transport (server unless client-only), join the DHT through the bootstraps,
   register the collective and the state server, announce a PeerRecord every few seconds.
2. Build the model and data from the run config, profile this device (tokens/s per batch size).
3. Take the global state: ``--resume`` from the newest checkpoint; else, when the swarm is already
   past round 0, download it from peers whose digest is the majority's; else initialise from the
   run seed (every fresh peer gets the same weights, so their digests agree).
4. Each round r: agree on the plan (leader by rendezvous hashing, :mod:`geomesh_p2p.round`), run
   the assigned inner steps until the train deadline, exchange the pseudo-gradient through the
   collective, apply the outer Nesterov step, publish the new digest, evaluate, log a row,
   checkpoint every N rounds. A peer not in the plan (late joiner, re-syncing) waits for the
   round to end and downloads the new state.
5. Ctrl+C / SIGTERM: finish the exchange if it is under way, write a checkpoint, stop every task,
   exit 0. When the swarm ends without this peer (every other peer left while it was behind or short of
   ``--min-peers``): a WARNING instead of "done", exit 0 when it holds the swarm's last state, else
   :data:`EXIT_NOT_SYNCED`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Optional, cast

import torch

import geomesh_p2p
from geomesh_p2p.node.started import started
from geomesh_p2p.status import swarm as swarm_status  # noqa: F401  (kept importable from here: tests patch it)
from geomesh_p2p.trust.admission import Admission, load_or_solve_pow, pow_cache_path, run_record_store_check
from geomesh_p2p.trust.admission import pow_done_line
from geomesh_p2p.model.capability import ThroughputEMA
from geomesh_p2p.exchange import CollectiveService, GroupedCollective
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht import DHTNode, PeerAnnouncer, record_ttl_s
from geomesh_p2p.util.aio import SharedRead
from geomesh_p2p.util.errors import StartInputError, UserFacingError
from geomesh_p2p.util.exit_gc import freeze_startup_heap
from geomesh_p2p.net.identity import Identity, IdentityError, allow_list
from geomesh_p2p.net.links import LinkProbeService
from geomesh_p2p.telemetry.looplag import LoopLagMonitor, monitor_from_env
from geomesh_p2p.telemetry.metrics import RoundLog, RoundRecord
from geomesh_p2p.model.optim import OuterNesterov, SyncAdamW, eager_args, eager_start
from geomesh_p2p.schema.peer import MAX_LINK_BPS, MAX_TOKENS_PER_S, MIN_LINK_BPS, MIN_TOKENS_PER_S, PeerRecord
from geomesh_p2p.net import swarm_time as clock
from geomesh_p2p.telemetry import events
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.round import DhtPlanAgreement, DriverConfig, PlanStore, RoundDriver
from geomesh_p2p.plan.awb import AUTO_WINDOW_MIN_S
from geomesh_p2p.node import data_load, joining, report, training
from geomesh_p2p.node.checkpoints import Checkpointer, check_writable_dir, node_verdicts
from geomesh_p2p.node.watchdog import ProgressWatchdog
from geomesh_p2p.node.joining import DuplicateIdentityError, StoppedBeforeJoining
from geomesh_p2p.node.device_probe import DeviceProber
from geomesh_p2p.node.links import LinkProber
from geomesh_p2p.round.policy import OWNER_PENALTY_ROUNDS, NodeRoundPolicy
from geomesh_p2p.round.rules import OuterStepRule, Penalties, PlanRules, Reprofiler, RoundState, StateSync, VerifiedWork
from geomesh_p2p.round.rules.accountable import Accountability
from geomesh_p2p.round.rules.spec import PULL_SHARE_OF_EXCHANGE as PULL_SHARE
from geomesh_p2p.trust import verify
from geomesh_p2p.trust.standing import Standing
from geomesh_p2p.sync.server import StateServer

if TYPE_CHECKING:
    from geomesh_p2p.exchange.codec.feedback import PushFeedback
    from geomesh_p2p.model.state import GlobalState
    from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.model.training import load_flat_
from geomesh_p2p.model.build import pseudo_gradient
from geomesh_p2p.net.transport import Transport, TransportConfig
from geomesh_p2p.net.tls import tls_from_flags

#: the second Ctrl+C's hint (fresh user, session 37)
_FORCE_HINT = "(seconds: the round's exchange and a checkpoint; SIGKILL forces it, and the others then wait out this peer's parts)"
log = logging.getLogger(__name__)

__all__ = ["PeerNode", "RunConfig", "NodeConfig", "StoppedBeforeJoining", "DuplicateIdentityError"]
__all__ += ["check_writable_dir", "OWNER_PENALTY_ROUNDS", "RoundRecord"]

#: Bandwidth assumed for a direction that is neither stated nor measured yet (bytes/s, 800 Mbit/s).
DEFAULT_LINK_BPS = 1e8


def _link(bps: Optional[float]) -> float:
    """A bandwidth for this peer's record: the default when unknown, else clamped to the record's bounds."""
    return DEFAULT_LINK_BPS if not bps else min(max(float(bps), MIN_LINK_BPS), MAX_LINK_BPS)


def _record_tps(tps: dict) -> dict:
    """This peer's tokens/s clamped to a record's bounds (a near-zero compute time must not void its records)."""
    return {b: min(max(float(v), MIN_TOKENS_PER_S), MAX_TOKENS_PER_S) for b, v in tps.items()}


#: A leaving peer serves its last round's parts to peers still pulling them, and lets the results it handed
#: out finish on the wire, until that round's exchange deadline and at most this long (seconds).
MAX_LINGER_S = 120.0


class PeerNode:
    """One volunteer node. ``await node.run()`` trains until ``rounds`` / ``target_ppl`` / stop().

    Composition and lifecycle only: the rounds are run by a :class:`~geomesh_p2p.round.RoundDriver`, the
    round rules are the objects of :mod:`geomesh_p2p.round.rules` over this node's :class:`RoundState`
    (``self.rs``), composed into the driver's policy by :class:`~geomesh_p2p.round.policy.NodeRoundPolicy`."""

    # Built by start() (node/training.py, node/services of start()); declared for the type checker.
    dataset: Any
    device: torch.device
    device_info: Any  # capability.DeviceInfo
    model: torch.nn.Module
    profiled_tps: dict[int, float]
    trainer: InnerTrainer

    def __init__(self, run: RunConfig, cfg: NodeConfig, identity: Optional[Identity] = None):
        self.run_cfg = run
        self.cfg = cfg
        self.identity = identity or Identity.load_or_create(cfg.identity)
        self.me = str(self.identity.peer_id)
        self.config_hash = run.config_hash()
        self.rs = RoundState(me=self.me)  # round, digest, P, standing, history: shared with the round rules
        self.theta: Optional[torch.Tensor] = None
        self.outer: Optional[OuterNesterov | SyncAdamW] = None
        self._stop = asyncio.Event()
        self.initial_ppl: Optional[float] = None
        self.initial_round: Optional[int] = None  # the round whose start state initial_ppl measured
        self.time_to_target: Optional[float] = None
        self._t_start = time.time()
        self.transport: Optional[Transport] = None
        self.max_batch = 1
        self._leaving = False  # announced once this peer is on its way out (Ctrl+C / SIGTERM)
        self.made_dirs: list[Path] = []  # folders start() made (--checkpoint-dir): the CLI removes them left empty
        #: another live process runs this PeerID (joining.check_identity_unique): its record is not this one's
        self.identity_taken = False
        self.round_log: Optional[RoundLog] = None  # made by start(); None once shut down
        # built by start() (None before it and in the unit tests that never start the node)
        self.event_sink: Any = None
        self.dht: Optional[DHTNode] = None
        self.collective: Optional[CollectiveService] = None
        self.grouped: Optional[GroupedCollective] = None  # the round's exchange: one group, or groups (issue 26)
        self.state_server: Optional[StateServer] = None
        self.announcer: Optional[PeerAnnouncer] = None
        self.plans: Optional[PlanStore] = None
        self.member_reads = SharedRead(self._read_records, max_age_s=cfg.peers_max_age_s)
        self.looplag: Optional[LoopLagMonitor] = None
        self._round_driver: Optional[RoundDriver] = None
        self.gstate: Optional[GlobalState] = None
        self.feedback: Optional[PushFeedback] = None  # --error-feedback's residual
        self._init_admission()
        self._init_rules()

    def _init_rules(self) -> None:
        """The round rules (:mod:`geomesh_p2p.round.rules`) over ``self.rs``, with what each reads of this node
        passed explicitly (getters for what ``start`` builds later), and the driver's policy composing them."""
        self.penalties = Penalties(self.rs)  # owner and no-show penalties (peer id -> last round)
        self.profile = Reprofiler(self.cfg, self.rs)  # tokens/s and link EMAs, exchange cost (re-profiled)
        self.planning = PlanRules(self.run_cfg, self.cfg, self.rs, self.penalties, self.profile)
        self.verified = VerifiedWork(
            self.rs,
            lambda: verify.WorkVerifier.for_node(self),  # a private copy of the model, on first use
            theta=self._global_theta,
            collective=lambda: self.collective,
        )
        self.resync = StateSync(
            self.run_cfg,
            self.rs,
            self._stop,
            # late-bound: the node's own methods at call time
            peers=lambda include_leaving=False: self.peers(include_leaving=include_leaving),
            announce=lambda: self.announce(),
            record_changed=lambda: started(self.announcer).update(self.my_record),
            set_state=lambda rnd, theta, momentum: joining.adopt_state(self, rnd, theta, momentum),
            transport=lambda: self.transport,
            plans=lambda: self.plans,  # the run's signed plans: made by start()
            gstate=lambda: self.gstate,  # built by start()
            outer=lambda: self.outer,
            address=lambda: self.record_address,
        )
        self.links = LinkProber(self.cfg, transport=lambda: self.transport, ema=lambda: self.profile.ema)
        self.device_probe = DeviceProber.for_node(self)  # its device half (model, EMAs: late-bound)
        self.checkpoints = Checkpointer(
            self.run_cfg,
            self.cfg,
            self.rs,
            self.config_hash,
            theta=lambda: self.theta,
            outer=lambda: self.outer,
            gstate=lambda: self.gstate,  # built by start()
            feedback=lambda: self.feedback,  # --error-feedback's residual (start)
            verdicts=lambda: node_verdicts(self),  # issue 28: exclusions, penalties, the last round's delivered work
            inner=lambda: getattr(self, "trainer", None),  # its inner optimizer state beside each checkpoint
        )
        self.outer_rule = OuterStepRule.for_node(self)  # with the exact undo of RunConfig.undo_forged
        self.accountable = Accountability(
            self.verified.verdicts,
            # the grouped exchange validates both levels of a grouped round (and the flat one's parts otherwise)
            collective=lambda: getattr(self, "grouped", None) or self.collective,
            dht=lambda: self.dht,
            identity=self.identity,
            run_id=self.run_cfg.run_id,
        )
        self.policy = NodeRoundPolicy(
            self.planning,
            verified=self.verified,
            accountable=self.accountable,
            sync=self.resync,
            publish=self._publish_record,
            max_message_bytes=lambda: self._started_transport().config.max_message_bytes,
        )

    # The round state lives in self.rs (shared with the rules); the node's attributes read and write it.
    @property
    def round(self) -> int:
        return self.rs.round

    @round.setter
    def round(self, value: int) -> None:
        self.rs.round = value

    @property
    def digest(self) -> Optional[str]:
        return self.rs.digest

    @digest.setter
    def digest(self, value: Optional[str]) -> None:
        self.rs.digest = value

    @property
    def numel(self) -> int:
        """P, the model's parameters (0 until ``start`` built the model)."""
        return self.rs.numel

    @numel.setter
    def numel(self, value: int) -> None:
        self.rs.numel = value

    @property
    def state_numel(self) -> int:
        """Elements of the outer optimizer's state (k x P)."""
        return self.rs.state_numel

    @state_numel.setter
    def state_numel(self, value: int) -> None:
        self.rs.state_numel = value

    @property
    def standing(self) -> Standing:
        """The standing ledger (rounds seen delivered; replaced by ``--resume``)."""
        return self.rs.standing

    @standing.setter
    def standing(self, value: Standing) -> None:
        self.rs.standing = value

    @property
    def history(self) -> list[RoundRecord]:
        """The rows of the rounds this peer trained."""
        return self.rs.history

    @property
    def ema(self) -> Optional[ThroughputEMA]:
        """Tokens/s per micro-batch and link bytes/s, re-profiled each round (None before the profile)."""
        return self.profile.ema

    @ema.setter
    def ema(self, value: Optional[ThroughputEMA]) -> None:
        self.profile.ema = value

    @property
    def codec_s_per_element(self) -> Optional[float]:
        """The exchange's CPU seconds per element pass (calibrated at start, refined by each exchange)."""
        return self.profile.codec_s_per_element

    @codec_s_per_element.setter
    def codec_s_per_element(self, value: Optional[float]) -> None:
        self.profile.codec_s_per_element = value

    @property
    def method_rule(self):
        """What the run's method means for a round (:class:`~geomesh_p2p.config.method.MethodRule`)."""
        return self.planning.method_rule

    def _global_theta(self) -> torch.Tensor:
        """The global weights ``self.theta``: [P] fp32 CPU. Raises RuntimeError before ``start`` built them."""
        if self.theta is None:
            raise RuntimeError("the global weights do not exist yet (the node has not built its training state)")
        return self.theta

    def _publish_record(self, rec: RoundRecord) -> None:
        """The round's row to the log, Prometheus and the status page. Raises RuntimeError after shutdown
        (the round log is closed)."""
        if self.round_log is None:
            raise RuntimeError(f"round {rec.round}: the round log is closed (the node is shut down)")
        self.round_log.add(rec)
        swarm_status.publish_round_summary(self, rec)  # the bootstrap's status page (issue 16)
        if self.announcer is not None and rec.cycle_s:  # records outlive rounds as long as they really run
            self.announcer.follow_rounds(rec.cycle_s, self.run_cfg.window_s or AUTO_WINDOW_MIN_S)

    def _started_transport(self) -> Transport:
        """``self.transport``, the node's gRPC transport. Raises RuntimeError before ``start`` or after shutdown."""
        if self.transport is None:
            raise RuntimeError("the node's transport is not running (the node is not started, or shut down)")
        return self.transport

    def _init_admission(self) -> None:
        """Standing ledger, proof-of-work state and the record filter (issue 12); allow-list when private."""
        self.pow_nonce: Optional[int] = None
        # The nonce is cached next to the key file, only when that file holds this identity's key.
        self._pow_cache = None
        try:
            key = Path(self.cfg.identity).expanduser()
            if key.is_file() and Identity.load_or_create(key).peer_id == self.identity.peer_id:
                self._pow_cache = str(key)
        except (IdentityError, OSError):
            pass
        self._allow = (
            allow_list(self.cfg.allow_peers, also=[self.identity.peer_id]) if self.cfg.allow_peers is not None else None
        )
        self.admission = Admission(self.run_cfg.run_id, self.run_cfg.pow_bits, self._allow)

    async def _prove_work(self) -> None:
        """This identity's proof of work for the run: cached next to the key file, else computed (seconds)."""
        bits = self.run_cfg.pow_bits
        if bits <= 0:
            return
        cache = pow_cache_path(self._pow_cache) if self._pow_cache else None
        if cache is None or not cache.exists():
            log.info(
                "computing this identity's proof of work for run %r (%d bits, ~%.0e hashes)...",
                self.run_cfg.run_id,
                bits,
                2.0**bits,
            )
        nonce, took, cached = await asyncio.to_thread(
            load_or_solve_pow, self.identity, self.run_cfg.run_id, bits, cache, self._stop.is_set
        )
        if nonce is None:
            raise StoppedBeforeJoining("stopped while computing the proof of work")
        self.pow_nonce = nonce
        log.info("%s", pow_done_line(bits, took, cached, cache))  # computed or reused, said either way

    def request_stop(self) -> None:
        """Stop after the current step (or the exchange under way); a second request says so too (was silent)."""
        what = "finishing the exchange first" if self._in_exchange else "leaving"
        if self._stop.is_set():  # fresh user, session 37: a second Ctrl+C gave no hint how long, or how to force
            what += f" cleanly {_FORCE_HINT}"
        log.info("stop requested%s: %s", " again (already under way)" if self._stop.is_set() else "", what)
        self._stop.set()

    async def start(self) -> None:
        c = self.cfg
        self.event_sink = events.open_json_sink(c.log_json)  # <log-json>.events.jsonl; closed in shutdown()
        if c.threads:
            torch.set_num_threads(c.threads)
        if c.checkpoint_dir:
            check_writable_dir(c.checkpoint_dir, "--checkpoint-dir", self.made_dirs)
        # This machine's own resources, one line each and before the DHT join (issue 14 #10), not after the probes.
        if c.device.startswith("cuda") and not torch.cuda.is_available():
            raise StartInputError(  # a flag this machine cannot serve: exit 2, as for a bad flag
                f"--device {c.device}: CUDA is not available on this machine (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu "
                f"or auto"
            )
        try:
            self.round_log = RoundLog(c.log_json, c.metrics_port, metrics_host=c.metrics_host)
        except OSError as e:
            raise UserFacingError(
                f"--metrics-port {c.metrics_port}: cannot listen on {c.metrics_host}:"
                f"{c.metrics_port}: {e.strerror or e}"
            ) from None
        # --tls-*: checked before anything listens (a bad file is one line naming it); PEM reads off the loop.
        tls = await asyncio.to_thread(
            tls_from_flags, getattr(c, "tls_cert", None), getattr(c, "tls_key", None), getattr(c, "tls_ca", None)
        )
        tcfg = TransportConfig(
            host=c.host,
            port=c.port,
            advertise_host=c.advertise_host,
            client_only=c.client_only,
            added_latency_s=c.added_latency_s,
            tls=tls,
        )
        await joining.check_before_proof_of_work(self, tls)  # a busy --port, a wrong --bootstrap or --run-id: now
        await asyncio.to_thread(data_load.load_training_data, self)  # a bad --data file too (exit 2): fresh user 47
        await self._prove_work()
        self.transport = Transport(self.identity, self.run_cfg.run_id, tcfg, allow=self._allow)
        check = run_record_store_check(self.run_cfg.run_id, self.run_cfg.pow_bits)  # junk takes no slot, on any run key
        self.dht = DHTNode(self.transport, join_attempts=c.join_attempts, store_check=check, pow_nonce=self.pow_nonce)
        self.collective = CollectiveService(self.transport)
        self.grouped = GroupedCollective(self.collective, group_size=self.run_cfg.group_size, pull_share=PULL_SHARE)
        # the newest outer update goes to a temp file once sealed (issue 27: not 4P of RAM through the next round)
        self.state_server = StateServer(self.transport, spill_updates=True)
        LinkProbeService(self.transport)
        address = await self.transport.start()
        log.info("peer %s serving on %s", self.identity.peer_id.short(), address or "(client-only)")
        # Ctrl+C during the join's retries ends the node at once (not after the last backoff, ~30 s).
        join = asyncio.ensure_future(self.dht.join(c.bootstrap))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({join, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not join.done():
                join.cancel()
            await asyncio.gather(stopped, join, return_exceptions=True)
        if join.cancelled():
            raise StoppedBeforeJoining("stop requested while joining the DHT")
        join.result()
        # Every absolute time that crosses machines (plans, deadlines, expiries) is in swarm time from now on;
        # read from the DHT at each use, so its re-measurements at each bootstrap ping apply too.
        clock.set_offset(self.dht.clock_offset_s)
        clock.follow(lambda: started(self.dht).clock_offset_s)
        # Refuse an incompatible run config now, before spending half a minute on data and profiling.
        await joining.check_swarm(self, self._placeholder_record(), remembered=True)
        await joining.check_identity_unique(self)
        probed = await self.links.probe()
        # follows the sync window (issue 25); --window-s auto: its shortest, AUTO_WINDOW_MIN_S, until rounds ran
        ttl_s = record_ttl_s(c.announce_period_s, self.run_cfg.window_s or AUTO_WINDOW_MIN_S)
        self.announcer = PeerAnnouncer(
            self.dht, self.my_record, period_s=c.announce_period_s, ttl_s=ttl_s, shards=self.run_cfg.record_shards
        )
        self.announcer.live = ProgressWatchdog.for_node(self).problem  # liveness is progress (issue 29 #5)
        stable = self.run_cfg.record_shards > 1  # a chunked plan's chunks from cached holders (issue 25, session 26)
        self.plans = PlanStore(self.dht, self.identity, self.run_cfg.run_id, c.plan_ttl_floor_s, stable_parts=stable)
        # Off the event loop: tokenizing and profiling take seconds, and the DHT must keep answering.
        await asyncio.to_thread(self._build_training)
        freeze_startup_heap()  # the run's full collections skip the imports' and the model's objects (join's own process)
        self._stop_point("after building training")
        self._init_ema(probed)
        self.looplag = monitor_from_env()  # worst event-loop stall per round, in each row (loop_stall_ms)
        self.looplag.start()

    def _stop_point(self, where: str) -> None:
        """End the start-up here when a stop was requested (Ctrl+C during the seconds to minutes of data,
        model and profile: issue 14 #10). Any thread. Raises StoppedBeforeJoining (a clean stop, exit 0)."""
        if self._stop.is_set():
            raise StoppedBeforeJoining(f"stop requested during start-up ({where})")

    def _build_training(self) -> None:
        """Data, model, profile, trainers, global state (:func:`.training.build_training`; worker thread)."""
        training.build_training(self)

    async def remeasure(self) -> None:
        """Round driver port (:meth:`~geomesh_p2p.round.ports.Membership.remeasure`): a planned-out peer probes its
        link (:class:`~geomesh_p2p.node.links.LinkProber`) and times its device (:class:`DeviceProber`) again."""
        await asyncio.gather(self.links.remeasure(), self.device_probe.remeasure())

    def _init_ema(self, probed) -> None:
        c = self.cfg
        up = c.upload_bps or (probed.upload_bps if probed else None)
        down = c.download_bps or (probed.download_bps if probed else None)
        self.ema = ThroughputEMA(alpha=c.ema_alpha, tokens_per_s=self.profiled_tps, upload_bps=up, download_bps=down)

    @property
    def record_address(self) -> Optional[str]:
        """The ``host:port`` this peer's records name: the DHT's advertised address once joined (None when a
        bootstrap could not dial it back, issue 14 #5: then it is client-only, owns no part and donates no
        state, since the planner gives a record without address no bandwidth), the transport's before."""
        dht = self.dht
        return dht.advertised_address if dht is not None else self._started_transport().address

    def my_record(self) -> PeerRecord:
        c, ema = self.cfg, self.profile.throughput_ema()
        max_batch = max(1, self.max_batch)
        oom_cap = getattr(getattr(self, "trainer", None), "max_micro_batch", None)
        if oom_cap:  # it ran out of memory above this (issue 27): the leader plans within it from now on
            max_batch = min(max_batch, oom_cap)
        return PeerRecord(
            peer_id=self.me,
            address=self.record_address,
            device=self.device_info.name,
            **training.record_capacity(self),  # memory; ranks of a multi-rank peer (issue 30)
            tokens_per_s=_record_tps(ema.tokens_per_s),
            max_batch=max_batch,
            upload_bps=_link(c.upload_bps or ema.upload_bps),
            download_bps=_link(c.download_bps or ema.download_bps),
            version=geomesh_p2p.__version__,
            protocol_version=geomesh_p2p.PROTOCOL_VERSION,
            run_config_hash=self.config_hash,
            run_config=self.run_cfg.model_dump(),
            **training.record_state(self),  # round, weights digest, the plan that made them (round/last_plan.py)
            leaving=self._leaving,
            pow_nonce=self.pow_nonce,
            standing=self.standing.attestations(exclude=self.me, own=True),
            sync_progress=self.resync.progress(),  # while syncing (issue 14 #3)
            timestamp=swarm_time(),
        )  # read by other machines (status page: last seen)

    async def announce(self) -> None:
        """Store this peer's current record now (the announcer also refreshes it every period)."""
        try:
            await started(self.announcer).announce_once()
        except Exception as e:  # a failed announcement is retried by the announcer's loop
            log.warning("announce failed: %s", e)

    async def peers(self, include_leaving: bool = False) -> list[PeerRecord]:
        """Live, compatible peers of this run (this node's own record always included, fresh); leaving ones only
        with ``include_leaving``. Records without a valid proof of work, or off a private run's allow-list, are
        ignored (admission.py). Calls share one DHT read while it runs and ``peers_max_age_s`` after it."""
        recs = await self.member_reads.get()
        out = {r.peer_id: r for r in self.admission.filter(recs) if include_leaving or not r.leaving}
        out[self.me] = self.my_record()
        return list(out.values())

    async def records_of(self, peer_ids: Collection[str], *, sampled: bool = True) -> list[PeerRecord]:
        """Live, admitted records of ``peer_ids`` only (:func:`joining.records_of`: a subkey read, issue 25;
        ``sampled=False``: from the DHT's full read quorum)."""
        return await joining.records_of(self, peer_ids, sampled=sampled)

    async def _read_records(self) -> list[PeerRecord]:
        """One full read of the run's records, leaving peers' included (:attr:`member_reads`' read)."""
        return await joining.read_records(self)

    def _set_state(
        self, round: int, theta: torch.Tensor, momentum: Optional[torch.Tensor], load_model: bool = True
    ) -> None:
        """Make (``theta`` [P] fp32, ``momentum`` [k * P] fp32 or None: unchanged) the global state of ``round``:
        copied into the state buffer (not when ``theta`` is already its view: the outer step's result),
        digest recomputed in place (the state server serves the buffer itself), weights loaded into the model
        (not with ``load_model=False``: eager updates' speculative steps train on it). Synchronous,
        whole-model: call it in a worker thread."""
        gs = started(self.gstate)
        with gs.lock:
            if theta is not gs.theta:
                server = self.state_server
                if server is not None and getattr(server, "state", None) is gs:
                    server.retain()  # a download of the state replaced here finishes from a copy
                gs.theta.copy_(theta.detach().reshape(-1))
            if momentum is not None:
                gs.opt_state.copy_(momentum.detach().to(torch.float32).reshape(-1))
            self.digest, self.rs.theta_maxabs = gs.commit(round), gs.theta_maxabs
        self.round = round
        self.theta = gs.theta
        if load_model:
            load_flat_(self.model, gs.theta)

    def _placeholder_record(self) -> PeerRecord:
        """This peer's version, protocol and run config, before its device is profiled (never announced)."""
        return joining.placeholder_record(self)

    async def _warn_if_resumed_behind(self) -> None:
        await joining.warn_if_resumed_behind(self)

    async def _on_empty_swarm(self) -> None:
        await joining.on_empty_swarm(self)

    async def run(self) -> int:
        """Train until done; returns a process exit code (0 on success or clean stop)."""
        try:
            try:
                await self.start()
                if new_key := self.identity.keep_created():  # said once it serves: a failed start prints one line
                    log.info("%s", new_key)
                await joining.initial_state(self)
            except BaseException as e:
                # stopped, refused or failed before it took the run's state: no checkpoint of the seed, which a
                # later --resume would start from (a refused join wrote one: fresh-user trial 41)
                self.checkpoints.skip = True
                if not isinstance(e, StoppedBeforeJoining):
                    raise
                log.info("stop requested before this peer joined the swarm: leaving (%s)", e)
                return 0
            if self._stop.is_set():  # Ctrl+C during start-up: no initial evaluation (seconds at real size)
                log.info("stop requested during start-up: leaving before the first round")
                return 0
            started(self.announcer).start()
            t0 = time.monotonic()
            self.initial_ppl = await asyncio.to_thread(self.trainer.evaluate, max_batches=self.cfg.eval_batches)
            self.initial_round = self.round
            eval_s = time.monotonic() - t0
            log.info("round %d: eval perplexity %.2f (at start, %.1f s)", self.round, self.initial_ppl, eval_s)
            driver = self._driver()
            driver.eval_schedule.note_eval(-1, eval_s)  # --eval-every auto schedules from it (eval_schedule.py)
            await driver.run(self.rs.known_round, self.rs.written_by, self.rs.resumed_with)
            self._reached_target()
            # the last round's tending lines before the closing line, "done" or a swarm that ended first (red team 44)
            await self.verified.settle()
            if driver.ended is not None:
                return report.log_swarm_ended(self, driver.ended)
            report.log_done(self)
        finally:
            await self.shutdown()
        return 0

    def _driver(self) -> RoundDriver:
        """The round state machine over this node's parts (built once; rebuilt when a test swapped a part)."""
        parts = (self.trainer, self.collective)
        d = self._round_driver
        if d is not None and (d.trainer, d.collective) == parts:
            return d
        cfg = DriverConfig.from_node(
            self.cfg,
            checkpointing=bool(self.cfg.checkpoint_dir),
            exchanges_gradient=self.method_rule.exchanges_gradient,
            push_encoding=self.method_rule.push_encoding,
            eager=self.run_cfg.eager,
            record_shards=self.run_cfg.record_shards,
        )
        transport = self.transport

        def traffic() -> tuple[int, int]:
            if transport is None:
                raise RuntimeError("the round driver was built before the node's transport started")
            return transport.stats.snapshot()

        self._round_driver = RoundDriver(
            membership=self,
            plans=DhtPlanAgreement(cast(PlanStore, self.plans)),  # None only in tests driving a round by hand
            trainer=self.trainer,
            collective=cast(CollectiveService, self.grouped or self.collective),  # a test may set collective alone
            state=self,
            policy=self.policy,
            cfg=cfg,
            stop=self._stop,
            history=self.history,
            traffic=traffic,
            traffic_classes=transport.stats.by_class if transport is not None else dict,  # per class: the DHT apart
            leaving=self._set_leaving,
            activity_changed=lambda: started(self.announcer).update(self.my_record),  # announced at once
            loop_stall=self.looplag.take_worst if self.looplag is not None else lambda: None,
            feedback=self.feedback,
        )
        return self._round_driver

    def _set_leaving(self, leaving: bool) -> None:
        self._leaving = leaving

    @property
    def _in_exchange(self) -> bool:
        d = self._round_driver
        return d is not None and d.in_exchange

    @property
    def syncing(self) -> bool:
        """True while this peer downloads the swarm's state (its record then carries no digest)."""
        return self.resync.syncing

    @syncing.setter
    def syncing(self, value: bool) -> None:
        self.resync.syncing = value

    async def _one_round(self, members: list[PeerRecord]) -> set[str]:
        """Run round ``self.round`` (:meth:`RoundDriver.one_round`); returns the participants expected next."""
        return await self._driver().one_round(members) or set()

    def pseudo_gradient(self) -> torch.Tensor:
        """Global weights minus the model's after the inner steps: [P] fp32 (worker thread)."""
        return pseudo_gradient(self.model, self._global_theta(), self.trainer.update_buffer())  # the gradients' [P]

    @property
    def state_lock(self):
        """Held while the global state changes in place (re-entrant): the state server never serves a
        half-stepped buffer under the old round's digest."""
        return self.gstate.lock

    def outer_step(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """Round ``r``'s outer step in place, per part (:meth:`OuterStepRule.apply`), under the state's lock (worker thread).
        Before it (issue 14 #3): the state server keeps a copy of round ``r`` while a download of it is in
        progress, and the update is recorded for peers that fell behind (:class:`~geomesh_p2p.sync.server.UpdateLog`)."""
        lock = getattr(self.gstate, "lock", None)
        if lock is None:
            return self.outer_rule.apply(r, plan, aggregate, idle)
        with lock:
            server = self.state_server
            if server is not None and getattr(server, "state", None) is self.gstate:
                server.retain()
                server.updates.record(
                    r,
                    started(self.gstate).digest if started(self.gstate).round == r else None,
                    [(s, e) for _, s, e in plan.owners()] or [(0, self.numel)],
                    idle,
                    aggregate,
                    copy=False,  # the round's own buffer, only read from now on: no second [P] (issue 27)
                )
            return self.outer_rule.apply(r, plan, aggregate, idle)

    def reset_model(self) -> None:
        """The model back at the global weights (worker thread)."""
        load_flat_(self.model, self._global_theta())

    def commit(self, round: int, load_model: bool = True) -> str:
        """The outer step's result becomes round ``round``'s state: model (not with ``load_model=False``),
        digest, snapshot (worker thread)."""
        self._set_state(round, self._global_theta(), None, load_model=load_model)
        if self.digest is None:  # _set_state always sets it
            raise RuntimeError(f"round {round}: the global state has no digest after its commit")
        server = self.state_server
        if server is not None and getattr(server, "state", None) is self.gstate:
            server.updates.seal(round, self.digest)  # the update recorded by outer_step is now served
        return self.digest

    # Eager updates (RunConfig.eager, docs/eager.md): the driver's EagerStatePort.
    def eager_start(self, delta: torch.Tensor, weight: float) -> torch.Tensor:
        """This peer's next start weights ``O(θ, v; weight·delta)`` on copies (worker thread; three [P] more
        while it runs): :func:`geomesh_p2p.model.optim.eager_start` with the run's outer lr and momentum."""
        with started(self.gstate).lock:  # θ and v of one round, never half-stepped by a concurrent outer step
            return eager_start(
                self._global_theta(),
                started(self.gstate).opt_state,
                delta,
                weight,
                **eager_args(self.outer),  # the run's outer lr, momentum and momentum clip
            )

    def load_model(self, flat: torch.Tensor) -> None:
        """Load ``flat`` ([P] fp32) into the model (worker thread)."""
        load_flat_(self.model, flat)

    def pseudo_gradient_from(self, start: torch.Tensor) -> torch.Tensor:
        """``start`` minus the model's weights after the inner steps: [P] fp32 (worker thread)."""
        return pseudo_gradient(self.model, start)

    def global_weights(self) -> torch.Tensor:
        """The global weights θ ([P] fp32 CPU view of the state buffer)."""
        return self._global_theta()

    async def catch_up(self, target: Optional[tuple[int, str]] = None) -> None:
        await self.resync.catch_up(target)

    async def checkpoint_or_warn(self):
        return await self.checkpoints.checkpoint_or_warn()

    def _reached_target(self) -> bool:
        t = self.cfg.target_ppl
        if t is None or not self.history or self.history[-1].eval_ppl is None:
            return False
        if self.history[-1].eval_ppl <= t:
            if self.time_to_target is None:
                self.time_to_target = time.time() - self._t_start
            return True
        return False

    async def shutdown(self) -> None:
        """Checkpoint, stop tasks, server and channels. Safe to call twice."""
        if self.transport is None:  # stopped before the transport existed: only the metrics server may run
            round_log = self.round_log  # absent before start() made it
            if round_log is not None:
                round_log.close()
                self.round_log = None
            return
        # Leaving is announced first (before a checkpoint of seconds), so the others plan the next round without it
        try:
            if report.leaving_unsaid(self) and self.ema is not None and not self.identity_taken:
                self._leaving = True
                events.emit(
                    log,
                    logging.INFO,
                    "leaving_announced",
                    "announcing that this peer leaves",
                    peer=self.me,
                    round=self.round,
                    reason="shutdown",
                )
                await asyncio.wait_for(self.announce(), report.LEAVING_ANNOUNCE_WAIT_S)
        except Exception as e:  # the DHT may be gone already (a timeout included); the record expires on its own
            log.warning("could not announce that this peer leaves: %s", e)
        await self.checkpoints.final_checkpoint()
        if self.cfg.summary_json:
            self.write_summary(self.cfg.summary_json)
        grace = await self._serve_last_parts()
        await report.serve_final_state(self)  # peers planned out of the last round download it now
        try:
            if self.looplag is not None:
                await self.looplag.stop()
            if self.announcer is not None:
                await self.announcer.stop()
            self.accountable.cancel()
            self.verified.cancel()
            if self.collective is not None:
                await asyncio.gather(self.collective.close(), *([self.grouped.close()] if self.grouped else []))
            if self.dht is not None:
                clock.follow(None)  # keep the last measured offset, drop the reference to this DHT
                await self.dht.shutdown()
        finally:
            # results handed out may still be on a slow link: the server's stop waits for calls in flight up to
            # the last round's exchange deadline (it returns as soon as none is left)
            await self.transport.stop(grace=grace)
            await asyncio.to_thread(self.verified.close)  # verified work's kept start weights: temp files
            if self.state_server is not None:
                await asyncio.to_thread(self.state_server.updates.close)  # spilled outer updates: temp files
            if self.round_log is not None:
                self.round_log.close()
            events.close_sink(self.event_sink)
            self.transport = None

    async def _serve_last_parts(self) -> float:  # :func:`report.serve_last_parts`, before the server stops
        return await report.serve_last_parts(self, MAX_LINGER_S)

    def summary(self) -> dict:
        """This peer's run in numbers (:func:`geomesh_p2p.node.report.summary`)."""
        return report.summary(self)

    def write_summary(self, path: str) -> None:
        """:meth:`summary` as strict JSON at ``path`` (atomic)."""
        report.write_summary(self, path)
