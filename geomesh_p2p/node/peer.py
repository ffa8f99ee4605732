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
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

import geomesh_p2p
from geomesh_p2p.status import swarm as swarm_status  # noqa: F401  (kept importable from here: tests patch it)
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.trust.admission import Admission, load_or_solve_pow, pow_cache_path
from geomesh_p2p.model.capability import (
    ProfileStopped,
    ThroughputEMA,
    detect_device,
    measure_codec,
    profile_training,
    release_freed_memory,
)
from geomesh_p2p.exchange import CollectiveService
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.data import load_dataset
from geomesh_p2p.dht import IncompatibleSwarmError, PeerAnnouncer, check_compatible, live_peers
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.node import DHT_PROTOCOL_VERSION
from geomesh_p2p.dht.progress import swarm_progress
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.exchange.codec.feedback import PushFeedback
from geomesh_p2p.net.identity import Identity, IdentityError, allow_list
from geomesh_p2p.net.links import LinkProbeService
from geomesh_p2p.telemetry.looplag import LoopLagMonitor
from geomesh_p2p.telemetry.metrics import RoundLog, RoundRecord, json_safe
from geomesh_p2p.model.optim import OuterNesterov, SyncAdamW, eager_start
from geomesh_p2p.schema.peer import MAX_LINK_BPS, MAX_TOKENS_PER_S, MIN_LINK_BPS, MIN_TOKENS_PER_S, PeerRecord
from geomesh_p2p.net import swarm_time as clock
from geomesh_p2p.telemetry import events
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.round import DhtPlanAgreement, DriverConfig, PlanStore, RoundDriver
from geomesh_p2p.node.checkpoints import Checkpointer
from geomesh_p2p.node.links import LinkProber
from geomesh_p2p.round.policy import OWNER_PENALTY_ROUNDS, NodeRoundPolicy
from geomesh_p2p.round.rules import OuterStepRule, Penalties, PlanRules, Reprofiler, RoundState, StateSync, VerifiedWork
from geomesh_p2p.trust import verify
from geomesh_p2p.trust.standing import Standing
from geomesh_p2p.model import state as gstate  # module-qualified: tests replace gstate.save_checkpoint
from geomesh_p2p.sync.transfer import StateServer
from geomesh_p2p.model.training import (
    DEFAULT_INNER,
    InnerTrainer,
    build_model,
    flat_params,
    load_flat_,
    lr_at,
    num_params,
    pseudo_gradient,
)
from geomesh_p2p.net.transport import (
    COLLECTIVE_PULL,
    COLLECTIVE_PUSH,
    DHT_PING,
    Transport,
    TransportConfig,
    tls_from_flags,
)
from geomesh_p2p.wire import dht_pb2

log = logging.getLogger(__name__)

__all__ = [
    "PeerNode",
    "RunConfig",
    "NodeConfig",
    "StoppedBeforeJoining",
    "DuplicateIdentityError",
    "check_writable_dir",
    "OWNER_PENALTY_ROUNDS",
    "RoundRecord",
]

#: Bandwidth assumed for a direction that is neither stated nor measured yet (bytes/s, 800 Mbit/s).
DEFAULT_LINK_BPS = 1e8

#: Envelope, protobuf and codec headers around a pushed part (bytes): the push limit is 4 x numel + this.
PUSH_FRAMING_BYTES = 1 << 20
#: A PullPart request is a few ids and numbers (bytes).
PULL_REQUEST_BYTES = 16 << 10


def _link(bps: Optional[float]) -> float:
    """A bandwidth for this peer's record: the default when unknown, else clamped to the record's bounds."""
    return DEFAULT_LINK_BPS if not bps else min(max(float(bps), MIN_LINK_BPS), MAX_LINK_BPS)


def _record_tps(tps: dict) -> dict:
    """This peer's tokens/s figures clamped to what a record may state (an EMA fed a near-zero
    compute time must not make the record invalid, and with it every announcement)."""
    return {b: min(max(float(v), MIN_TOKENS_PER_S), MAX_TOKENS_PER_S) for b, v in tps.items()}


#: Longest pause between two looks for a live peer while ``--on-empty-swarm wait`` waits (seconds).
EMPTY_SWARM_POLL_MAX_S = 15.0

#: How long a peer waits for the address of a record under its own PeerID to answer at start (seconds).
IDENTITY_PING_TIMEOUT_S = 3.0


#: Exit code of a peer whose run ended on a state that is not the swarm's (the swarm ended while it was behind,
#: or its last rounds were trained on a state the others never had): docs/round.md, "A stalled peer and a swarm that ended".
EXIT_NOT_SYNCED = 3
#: A leaving peer serves its last round's parts to peers still pulling them, and lets the results it handed
#: out finish on the wire, until that round's exchange deadline and at most this long (seconds).
MAX_LINGER_S = 120.0


class StoppedBeforeJoining(Exception):
    """Ctrl+C / SIGTERM arrived while the node was still joining the DHT (a clean stop, exit 0)."""


class DuplicateIdentityError(UserFacingError):
    """Another live process runs this PeerID (the same --identity key file)."""


def check_writable_dir(path: str, flag: str) -> Path:
    """Create ``path`` if needed and check that a file can be written there (then removed).

    Raises:
        UserFacingError: one line naming ``flag`` and the reason (read-only, not a directory, no permission).
    """
    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
            pass
    except OSError as e:
        raise UserFacingError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return d


class PeerNode:
    """One volunteer node. ``await node.run()`` trains until ``rounds`` / ``target_ppl`` / stop().

    Composition and lifecycle only: the rounds are run by a :class:`~geomesh_p2p.round.RoundDriver`, the
    round rules are the objects of :mod:`geomesh_p2p.round.rules` over this node's :class:`RoundState`
    (``self.rs``), composed into the driver's policy by :class:`~geomesh_p2p.round.policy.NodeRoundPolicy`."""

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
        self.time_to_target: Optional[float] = None
        self._t_start = time.time()
        self.transport: Optional[Transport] = None
        self.max_batch = 1
        self._leaving = False  # announced once this peer is on its way out (Ctrl+C / SIGTERM)
        self.round_log: Optional[RoundLog] = None  # made by start(); None once shut down
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
            row_time=lambda: getattr(self.trainer, "_row_time_ema", None),
        )
        self.resync = StateSync(
            self.run_cfg,
            self.rs,
            self._stop,
            # late-bound: the node's own methods at call time
            peers=lambda include_leaving=False: self.peers(include_leaving=include_leaving),
            announce=lambda: self.announce(),
            record_changed=lambda: self.announcer.update(self.my_record),
            set_state=lambda rnd, theta, momentum: self._set_state(rnd, theta, momentum),
            transport=lambda: self.transport,
            plans=lambda: getattr(self, "plans", None),  # the run's signed plans: made by start()
            gstate=lambda: getattr(self, "gstate", None),  # built by start()
            outer=lambda: self.outer,
            address=lambda: self.record_address,
        )
        self.links = LinkProber(self.cfg, transport=lambda: self.transport, ema=lambda: self.profile.ema)
        self.checkpoints = Checkpointer(
            self.run_cfg,
            self.cfg,
            self.rs,
            self.config_hash,
            theta=lambda: self.theta,
            outer=lambda: self.outer,
            gstate=lambda: getattr(self, "gstate", None),  # built by start()
            feedback=lambda: getattr(self, "feedback", None),  # --error-feedback's residual (start)
        )
        self.outer_rule = OuterStepRule(self.rs, theta=lambda: self.theta, outer=lambda: self.outer)
        self.policy = NodeRoundPolicy(
            self.planning,
            verified=self.verified,
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
        """The global weights ``self.theta``: [P] fp32 CPU.

        Raises:
            RuntimeError: the global state does not exist yet (called before the node built it in ``start``).
        """
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

    def _started_transport(self) -> Transport:
        """``self.transport``, the node's gRPC transport.

        Raises:
            RuntimeError: the node is not started yet (``start``) or already shut down.
        """
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
            raise UserFacingError("stopped while computing the proof of work")
        self.pow_nonce = nonce
        if not cached:
            log.info("proof of work done in %.1fs%s", took, f" (cached in {cache})" if cache else "")

    def request_stop(self) -> None:
        """Ask the node to stop after the current step (or after the exchange, if one is under way)."""
        if not self._stop.is_set():
            log.info("stop requested: %s", "finishing the exchange first" if self._in_exchange else "leaving")
        self._stop.set()

    async def start(self) -> None:

        c = self.cfg
        self.event_sink = events.open_json_sink(c.log_json)  # <log-json>.events.jsonl; closed in shutdown()
        if c.threads:
            torch.set_num_threads(c.threads)
        if c.checkpoint_dir:
            check_writable_dir(c.checkpoint_dir, "--checkpoint-dir")
        # This machine's own resources, one line each and before the DHT join (issue 14 #10): not found
        # out after the join, the link probe and the profile.
        if c.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserFacingError(
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
        await self._prove_work()
        self.transport = Transport(self.identity, self.run_cfg.run_id, tcfg, allow=self._allow)
        self.dht = DHTNode(self.transport, join_attempts=8)
        self.collective = CollectiveService(self.transport)
        self.state_server = StateServer(self.transport)
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
        clock.follow(lambda: self.dht.clock_offset_s)
        # Refuse an incompatible run config now, before spending half a minute on data and profiling.
        await self._check_swarm(self._placeholder_record())
        await self._check_identity_unique()
        probed = await self.links.probe()

        self.announcer = PeerAnnouncer(
            self.dht, self.my_record, period_s=c.announce_period_s, ttl_s=4 * c.announce_period_s
        )
        self.plans = PlanStore(self.dht, self.identity, self.run_cfg.run_id)
        # Off the event loop: tokenizing and profiling take seconds, and the DHT must keep answering.
        await asyncio.to_thread(self._build_training)
        self._stop_point("after building training")
        self._init_ema(probed)
        self.looplag = LoopLagMonitor()  # worst event-loop stall per round, in each row (loop_stall_ms)
        self.looplag.start()

    def _stop_point(self, where: str) -> None:
        """End the start-up here when a stop was requested (Ctrl+C during the seconds to minutes of data,
        model and profile: issue 14 #10). Any thread. Raises StoppedBeforeJoining (a clean stop, exit 0)."""
        if self._stop.is_set():
            raise StoppedBeforeJoining(f"stop requested during start-up ({where})")

    def _build_training(self) -> None:
        """Data, model, start-up profile, inner trainer, outer optimizer and the global state buffer
        (worker thread). The profile (:func:`capability.profile_training`) runs on the model itself
        (weights restored bit-identical, no copy) before anything else of the model's size is
        allocated, so its measured peaks are the process's and ``--memory-budget-gb`` binds the batch.

        Raises:
            UserFacingError: the memory budget (``--memory-budget-gb``, else the memory available) cannot
                hold training this model (the profile's one-line reason).
        """
        r, c = self.run_cfg, self.cfg
        # No release_freed_memory(configure=True) (a 1 MiB mmap threshold): every inner step then mapped and
        # faulted in its activations and gradients afresh. Freed memory goes back by trims instead: after
        # the profile (below) and after each round's inner steps (InnerTrainer.run).
        # Start-up says what it is doing: data, tokenizer and model take seconds to minutes (issue 14 #10).
        log.info(
            "loading the training data (%s) and its tokenizer (cached after the first run)...",
            c.data_path or "the shipped corpus",
        )
        t0 = time.monotonic()
        self.dataset = load_dataset(c.data_path, seq_len=r.seq_len, vocab_size=r.vocab_size)
        log.info(
            "data loaded in %.1fs; building the model and profiling this device (a few timed steps)...",
            time.monotonic() - t0,
        )
        self._stop_point("after loading the data")
        self.device_info = detect_device(c.device, c.memory_budget_bytes)
        device = (
            "cuda"
            if self.device_info.kind == "cuda" and c.device == "auto"
            else (c.device if c.device != "auto" else "cpu")
        )
        self.device = torch.device(device)
        self.model = build_model(
            r.model if not c.model_config_file else None,
            config_file=c.model_config_file,
            vocab_size=self.dataset.vocab_size,
            seed=r.seed,
        ).to(self.device)
        self.numel = num_params(self.model)
        # Outer optimizer state: Nesterov's momentum [P], or the ddp baseline's AdamW moments [2P].
        rule = self.method_rule
        self.state_numel = self.numel * rule.outer_state_slots
        ef_slots = int(r.error_feedback and rule.push_encoding == "sign")  # the --error-feedback residual [P]
        # Profile first: the inner optimizer and the global state are not allocated yet, so the profile's
        # static estimate (gradients + AdamW state + global weights and outer state) is what the node adds.
        try:
            prof = profile_training(
                self.model,
                r.seq_len,
                self.device,
                self.device_info.memory_bytes,
                vocab_size=self.dataset.vocab_size,
                batch_sizes=c.profile_batches,
                speed_factor=c.speed_factor,
                amp=c.amp,
                limit=256,
                extra_bytes=(
                    4 * (1 + rule.outer_state_slots + ef_slots) * self.numel if self.device.type == "cpu" else 0
                ),
                logger=log,
                should_stop=self._stop.is_set,
            )
        except ValueError as e:  # the budget (stated or the memory available) cannot hold this model
            raise UserFacingError(f"cannot train {r.model} here: {e}") from None
        except ProfileStopped as e:
            raise StoppedBeforeJoining(str(e)) from None
        self.profiled_tps, self.max_batch = prof.tokens_per_s, prof.max_batch
        release_freed_memory()
        self._stop_point("after the profile")
        # The exchange's CPU cost per element (encode, sign, verify, aggregate): the exchange window of this
        # peer's plans grows with the model by it (planner.exchange_cpu_s); each exchange then refines it.
        self.codec_s_per_element = measure_codec(
            block_size=r.block_size,
            push_encoding=rule.push_encoding,
            rule=rule.rule,
            weight_cap=r.weight_cap,
            min_agreement=r.min_agreement,
            clip_k=r.clip_k,
        )
        log.info(
            "device %s: %s tokens/s per batch, max batch %d (%.1fs to measure, peak %.2f GiB, budget %.2f GiB); "
            "exchange CPU %.1f ns per element pass",
            self.device_info.name,
            {b: round(t) for b, t in self.profiled_tps.items()},
            self.max_batch,
            prof.seconds,
            max(prof.peak_bytes.values()) / 2**30,
            prof.memory_bytes / 2**30,
            self.codec_s_per_element * 1e9,
        )
        # No legitimate push exceeds one fp32 copy of the vector (the fp32 baselines' largest part) plus
        # framing: a larger one is refused from its length prefix, before it is read (issue 12).
        transport = self._started_transport()
        transport.set_payload_limit(
            COLLECTIVE_PUSH, min(transport.config.max_message_bytes, 4 * self.numel + PUSH_FRAMING_BYTES)
        )
        transport.set_payload_limit(COLLECTIVE_PULL, PULL_REQUEST_BYTES)
        self.trainer = InnerTrainer(
            self.model,
            self.dataset,
            device=self.device,
            seq_len=r.seq_len,
            optimizer=r.inner_optimizer,
            lr=r.inner_lr,
            weight_decay=0.1,
            warmup_steps=r.warmup_steps,
            total_steps=r.total_inner_steps,
            seed=r.seed,
            peer_id=self.me,
            speed_factor=c.speed_factor,
            amp=c.amp,
            steps_per_round=r.uniform_inner_steps,
        )  # the inner LR follows the swarm's rounds (issue 14 #8)
        if rule.exchanges_gradient:
            # Data-parallel baseline: the "outer" step is AdamW on the swarm's mean gradient.
            self.outer = SyncAdamW(
                lambda rnd: lr_at(rnd, lr=r.inner_lr, warmup_steps=r.warmup_steps, total_steps=r.total_inner_steps),
                betas=DEFAULT_INNER["adamw"]["betas"],
                weight_decay=0.1,
                decay_mask=self.trainer.decay_mask(),
            )
        else:
            self.outer = OuterNesterov(lr=r.outer_lr, momentum=r.outer_momentum)
        # The global state in one buffer [(1 + k) * P]: theta and the outer optimizer's state are views of it,
        # stepped in place (no copies of the model per round), hashed in place (state.GlobalState).
        self.gstate = gstate.GlobalState(self.numel, rule.outer_state_slots)
        self.theta = self.gstate.theta
        self.outer.buf = self.gstate.opt_state
        self.state_server.serve(self.gstate)  # served by byte range from the buffer itself (no snapshot copies)
        # --error-feedback: the residual [P] fp32 of this peer's sign pushes (fp32 pushes lose nothing).
        self.feedback = (
            PushFeedback(self.numel, r.block_size) if r.error_feedback and rule.push_encoding == "sign" else None
        )

    async def remeasure_links(self) -> None:
        """Round driver port (:meth:`~geomesh_p2p.round.ports.Membership.remeasure_links`): a planned-out peer
        probes its link again (:meth:`~geomesh_p2p.node.links.LinkProber.remeasure`)."""
        await self.links.remeasure()

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
        dht = getattr(self, "dht", None)
        return dht.advertised_address if dht is not None else self._started_transport().address

    def my_record(self) -> PeerRecord:
        c, ema = self.cfg, self.profile.throughput_ema()
        max_batch = max(1, self.max_batch)
        return PeerRecord(
            peer_id=self.me,
            address=self.record_address,
            device=self.device_info.name,
            memory_bytes=self.device_info.memory_bytes,
            tokens_per_s=_record_tps(ema.tokens_per_s),
            max_batch=max_batch,
            upload_bps=_link(c.upload_bps or ema.upload_bps),
            download_bps=_link(c.download_bps or ema.download_bps),
            version=geomesh_p2p.__version__,
            protocol_version=geomesh_p2p.PROTOCOL_VERSION,
            run_config_hash=self.config_hash,
            run_config=self.run_cfg.model_dump(),
            round=self.round,
            weights_digest=None if self.resync.syncing else self.digest,
            leaving=self._leaving,
            pow_nonce=self.pow_nonce,
            standing=self.standing.attestations(exclude=self.me, own=True),
            sync_progress=self.resync.progress(),  # while syncing (issue 14 #3)
            timestamp=swarm_time(),
        )  # read by other machines (status page: last seen)

    async def announce(self) -> None:
        """Store this peer's current record now (the announcer also refreshes it every period)."""
        try:
            await self.announcer.announce_once()
        except Exception as e:  # a failed announcement is retried by the announcer's loop
            log.warning("announce failed: %s", e)

    async def peers(self, include_leaving: bool = False) -> list[PeerRecord]:
        """Live, compatible peers of this run (this node's own record always included, fresh); peers
        that announced they are leaving only with ``include_leaving``. Records without a valid proof of
        work, or of identities off the allow-list in a private run, are ignored (admission.py)."""

        recs = await live_peers(
            self.dht,
            self.run_cfg.run_id,
            expected_version=geomesh_p2p.__version__,
            expected_config_hash=self.config_hash,
            latest=True,
            include_leaving=include_leaving,
        )
        out = {r.peer_id: r for r in self.admission.filter(recs)}
        out[self.me] = self.my_record()
        return list(out.values())

    def _set_state(
        self, round: int, theta: torch.Tensor, momentum: Optional[torch.Tensor], load_model: bool = True
    ) -> None:
        """Make (``theta`` [P] fp32, ``momentum`` [k * P] fp32 or None: unchanged) the global state of ``round``:
        copied into the state buffer (not when ``theta`` is already its view: the outer step's result),
        digest recomputed in place (the state server serves the buffer itself), weights loaded into the model
        (not with ``load_model=False``: eager updates' speculative steps train on it). Synchronous,
        whole-model: call it in a worker thread."""
        gs = self.gstate
        with gs.lock:
            if theta is not gs.theta:
                server = getattr(self, "state_server", None)
                if server is not None and getattr(server, "state", None) is gs:
                    server.retain()  # a download of the state replaced here finishes from a copy
                gs.theta.copy_(theta.detach().reshape(-1))
            if momentum is not None:
                gs.opt_state.copy_(momentum.detach().to(torch.float32).reshape(-1))
            self.digest = gs.commit(round)
        self.round = round
        self.theta = gs.theta
        if load_model:
            load_flat_(self.model, gs.theta)

    def _placeholder_record(self) -> PeerRecord:
        """This peer's version, protocol and run config, before its device is profiled (never announced)."""
        return PeerRecord(
            peer_id=self.me,
            address=self.record_address,
            device="(starting)",
            memory_bytes=0,
            max_batch=1,
            upload_bps=1.0,
            download_bps=1.0,
            version=geomesh_p2p.__version__,
            protocol_version=geomesh_p2p.PROTOCOL_VERSION,
            run_config_hash=self.config_hash,
            run_config=self.run_cfg.model_dump(),
        )

    async def _check_identity_unique(self) -> None:
        """Refuse to start when another live process already runs this PeerID (issue 14 #7).

        A record under this PeerID at another address may be this identity's previous run (a restart
        within the record's lifetime) or a second process with the same key: the address is pinged, and
        only an answer signed by this very PeerID (only the key's holder can sign it) proves the second.

        Raises:
            DuplicateIdentityError: "this PeerID is already live at ADDRESS".
        """

        transport = self._started_transport()
        mine = transport.address
        for rec in await live_peers(self.dht, self.run_cfg.run_id, include_leaving=True):
            if rec.peer_id != self.me or not rec.address or rec.address == mine:
                continue
            req = dht_pb2.PingRequest(
                sender=self.dht.self_info(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=geomesh_p2p.__version__
            )
            try:
                reply = await transport.call(
                    rec.address, DHT_PING, req.SerializeToString(), timeout=IDENTITY_PING_TIMEOUT_S
                )
            except Exception:  # nobody there (a stale record of this identity's previous run)
                continue
            if reply.sender == self.identity.peer_id:
                raise DuplicateIdentityError(
                    f"this PeerID ({self.identity.peer_id.short()}) is already live at {rec.address}: another "
                    f"process runs with the same --identity key; give each peer its own key file"
                )

    async def _check_swarm(self, mine: Optional[PeerRecord] = None) -> None:
        """Refuse to start when the swarm's live peers all run another config or version.

        Raises IncompatibleSwarmError naming the differing fields (e.g. "inner_lr: 0.001 here vs
        0.0003 in the swarm").
        """

        mine = mine or self.my_record()
        others = [r for r in await live_peers(self.dht, self.run_cfg.run_id) if r.peer_id != self.me]
        if not others or any(check_compatible(mine, r) is None for r in others):
            return
        other = others[0]
        detail = check_compatible(mine, other)
        if other.run_config and other.run_config_hash != self.config_hash:
            a, b = self.run_cfg.model_dump(), other.run_config
            fields = [
                f"{k}: {a.get(k)!r} here vs {b.get(k)!r} in the swarm"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
            detail = "; ".join(fields) or detail
        raise IncompatibleSwarmError(
            f"the {len(others)} live peer(s) of run {self.run_cfg.run_id!r} use another run config: {detail}"
        )

    async def _initial_state(self) -> None:

        await self._check_swarm()

        if self.cfg.resume and self.cfg.checkpoint_dir:
            ck = await asyncio.to_thread(gstate.load_latest_checkpoint, self.cfg.checkpoint_dir)
            if ck is not None:
                await self._resume_from(ck)
                await self._warn_if_resumed_behind()
                return
            log.info("--resume: no checkpoint in %s, starting fresh", self.cfg.checkpoint_dir)
        # Fresh peer: join the swarm's state if it already trained, else the seed's.
        # The seed weights are written into the state buffer itself, in the worker thread (not on the loop).
        await asyncio.to_thread(
            lambda: self._set_state(0, flat_params(self.model, out=self.gstate.theta), self.gstate.opt_state.zero_())
        )
        recs = [r for r in await self.peers() if r.peer_id != self.me]
        if any(r.round > 0 and r.weights_digest for r in recs):
            await self.resync.catch_up()
        elif not recs:
            await self._on_empty_swarm()

    async def _resume_from(self, ck) -> None:
        """Take the global state of checkpoint ``ck`` (``gstate.load_latest_checkpoint``'s tuple: round,
        theta [P] fp32, optimizer state [k * P] fp32 or None, meta) and the standing ledger it saved.

        Raises:
            UserFacingError: the checkpoint is of another run config, or holds no or another optimizer state.
        """
        rnd, theta, momentum, meta = ck
        if meta.get("run_config_hash") not in (None, self.config_hash):
            old = (meta.get("meta") or {}).get("run_config") or {}
            diff = [
                f"{k}: {old.get(k)!r} there vs {v!r} here"
                for k, v in self.run_cfg.model_dump().items()
                if k in old and old[k] != v
            ]
            raise UserFacingError(
                f"checkpoint in {self.cfg.checkpoint_dir} is from another run config ("
                + ("; ".join(diff) or f"{meta.get('run_config_hash')} vs {self.config_hash}")
                + "); resume with the same flags, or use another --checkpoint-dir"
            )
        if momentum is None or momentum.numel() != self.state_numel:
            raise UserFacingError(
                f"checkpoint in {self.cfg.checkpoint_dir} holds no or another optimizer "
                f"state ({0 if momentum is None else momentum.numel()} elements, this run "
                f"needs {self.state_numel}); was it written by another --method?"
            )
        await asyncio.to_thread(self._set_state, rnd, theta, momentum)
        self.standing = Standing.from_meta((meta.get("meta") or {}).get("standing"))
        events.emit(
            log,
            logging.INFO,
            "resumed_from_checkpoint",
            "resumed from checkpoint at round %d (digest %s)",
            rnd,
            str(self.digest)[:8],
            peer=self.me,
            round=rnd,
            digest=self.digest,
        )
        fb: Optional[PushFeedback] = getattr(self, "feedback", None)  # absent before _build_training
        if fb is not None and self.digest is not None:  # _set_state set the digest
            got = await asyncio.to_thread(fb.load, self.cfg.checkpoint_dir, state_round=rnd, digest=self.digest)
            log.info(
                "error feedback: %s",
                "residual resumed from the checkpoint" if got == "loaded" else f"residual starts at zero ({got})",
            )

    async def _warn_if_resumed_behind(self) -> None:
        """After ``--resume``: when no other peer of the run is live but a bootstrap saw the run at a later
        round than the checkpoint's, say so in one WARNING (event ``resumed_behind_swarm``): this peer now
        trains alone from an older state, a fork of the run if its peers come back (a fresh-user trial resumed
        round 6 of a run that had reached round 12, untold). Live peers at a later round need no line: the
        first round's behind-check catches up to them."""
        if [r for r in await self.peers() if r.peer_id != self.me]:
            return
        prog = await swarm_progress(self.dht, self.run_cfg.run_id)
        if prog is None or prog.round <= self.round:
            return
        events.emit(
            log,
            logging.WARNING,
            "resumed_behind_swarm",
            "resumed at round %d, but bootstrap %s saw run %r at round %d and no peer of it is live now: this peer "
            "trains alone from an older state (a fork of the run if its peers come back); to continue the run, "
            "resume from a checkpoint of round %d, or wait for its peers (--on-empty-swarm wait, without --resume)",
            self.round,
            prog.by[:8] or "?",
            self.run_cfg.run_id,
            prog.round,
            prog.round,
            peer=self.me,
            round=self.round,
            swarm_round=prog.round,
            bootstrap=prog.by,
        )

    async def _on_empty_swarm(self) -> None:
        """No other live peer of this run (issue 14 #2): when a bootstrap saw the run at round N > 0
        (:func:`~geomesh_p2p.dht.progress.swarm_progress`, kept across bootstrap restarts), say so in one
        line and act by ``--on-empty-swarm``: ``wait`` (default) polls with a capped backoff until a peer
        of the run is live (then downloads its state) or Ctrl+C; ``resume`` takes ``--checkpoint-dir``'s
        newest checkpoint; ``seed`` keeps the seed's state at round 0 (a new run under the same id). A run
        no bootstrap knows past round 0 starts from the seed silently, as before.

        Raises:
            UserFacingError: ``resume`` with no ``--checkpoint-dir`` or no checkpoint in it.
            StoppedBeforeJoining: Ctrl+C / SIGTERM while waiting.
        """
        prog = await swarm_progress(self.dht, self.run_cfg.run_id)
        if prog is None or prog.round <= 0:
            return
        how = self.cfg.on_empty_swarm
        ago = max(0.0, swarm_time() - prog.seen_at)
        events.emit(
            log,
            logging.WARNING,
            "empty_swarm",
            "run %r was at round %d (bootstrap %s saw %d peer(s) %.0f s ago) but no peer of it is live now",
            self.run_cfg.run_id,
            prog.round,
            prog.by[:8] or "?",
            prog.peers,
            ago,
            peer=self.me,
            run_id=self.run_cfg.run_id,
            round=prog.round,
            bootstrap=prog.by,
            peers=prog.peers,
            seen_ago_s=ago,
            action=how,
        )
        if how == "seed":
            log.info("--on-empty-swarm seed: starting the run again from the seed at round 0")
            return
        if prog.config_hash and prog.config_hash != self.config_hash:
            # The remembered swarm's peers would refuse this one when they come back (and it them): say so
            # now rather than wait for them (a fresh-user trial waited, untold).
            raise IncompatibleSwarmError(
                f"run {self.run_cfg.run_id!r} was at round {prog.round} with another run config (hash "
                f"{prog.config_hash[:12]} there, {self.config_hash[:12]} here): its peers could not take this one "
                "back; use the run's flags, another --run-id, or --on-empty-swarm seed to start this run id anew"
            )
        if how == "resume":
            d = self.cfg.checkpoint_dir
            ck = await asyncio.to_thread(gstate.load_latest_checkpoint, d) if d else None
            if ck is None:
                raise UserFacingError(
                    f"--on-empty-swarm resume: no checkpoint in {d}"
                    if d
                    else "--on-empty-swarm resume needs --checkpoint-dir (the directory of this run's checkpoints)"
                )
            await self._resume_from(ck)
            return
        events.emit(
            log,
            logging.INFO,
            "empty_swarm_waiting",
            "waiting for a peer of run %r to come back (Ctrl+C to stop; --on-empty-swarm resume or seed "
            "starts without one)",
            self.run_cfg.run_id,
            peer=self.me,
            run_id=self.run_cfg.run_id,
        )
        backoff = Backoff(first=1.0, cap=EMPTY_SWARM_POLL_MAX_S)
        while True:
            if await wait_event(self._stop, backoff.next()):
                raise StoppedBeforeJoining("stop requested while waiting for a peer of the run")
            recs = [r for r in await self.peers() if r.peer_id != self.me]
            if not recs:
                continue
            events.emit(
                log,
                logging.INFO,
                "swarm_back",
                "%d peer(s) of run %r are live again",
                len(recs),
                self.run_cfg.run_id,
                peer=self.me,
                run_id=self.run_cfg.run_id,
                peers=sorted(r.peer_id for r in recs),
            )
            if any(r.round > 0 and r.weights_digest for r in recs):
                await self.resync.catch_up()
            return

    async def run(self) -> int:
        """Train until done; returns a process exit code (0 on success or clean stop)."""
        try:
            try:
                await self.start()
                await self._initial_state()
            except StoppedBeforeJoining as e:
                log.info("stop requested before this peer joined the swarm: leaving (%s)", e)
                self.checkpoints.skip = True  # it holds no state of the run: a checkpoint would be the seed's
                return 0
            if self._stop.is_set():  # Ctrl+C during start-up: no initial evaluation (seconds at real size)
                log.info("stop requested during start-up: leaving before the first round")
                return 0
            self.announcer.start()
            self.initial_ppl = await asyncio.to_thread(self.trainer.evaluate, max_batches=self.cfg.eval_batches)
            log.info("round %d: eval perplexity %.2f (initial)", self.round, self.initial_ppl)
            driver = self._driver()
            await driver.run()
            self._reached_target()
            if driver.ended is not None:
                return self._log_swarm_ended(driver.ended)
            self._log_done()
        finally:
            await self.shutdown()
        return 0

    def _log_swarm_ended(self, ended) -> int:
        """The closing line of a run the swarm ended before its ``--rounds`` / target (``RoundDriver.ended``,
        a :class:`~geomesh_p2p.round.driver.SwarmEnded`): a WARNING, never "done". Returns the exit code:
        0 when this peer holds the swarm's last state (the run's result is here and sound; it only did not
        reach its own goal), :data:`EXIT_NOT_SYNCED` when it does not (its state is not the swarm's: a script
        must not take its checkpoint or perplexity for the run's)."""
        code = 0 if ended.synced else EXIT_NOT_SYNCED
        events.emit(
            log,
            logging.WARNING,
            "run_not_done",
            "not done: %s; %d round(s) trained here, now at round %d; exit %d",
            ended.why,
            len(self.history),
            self.round,
            code,
            peer=self.me,
            round=self.round,
            rounds_trained=len(self.history),
            synced=ended.synced,
            cause=ended.cause,
            exit_code=code,
        )
        return code

    # ------------------------------------------------------------------ the round driver's ports
    def _driver(self) -> RoundDriver:
        """The round state machine over this node's parts (built once; rebuilt when a test swapped a part)."""
        c = self.cfg
        parts = (self.trainer, self.collective)
        d = getattr(self, "_round_driver", None)
        if d is not None and (d.trainer, d.collective) == parts:
            return d
        cfg = DriverConfig.from_node(
            c,
            checkpointing=bool(c.checkpoint_dir),
            exchanges_gradient=self.method_rule.exchanges_gradient,
            eager=self.run_cfg.eager,
        )
        transport = self.transport

        def traffic() -> tuple[int, int]:
            if transport is None:
                raise RuntimeError("the round driver was built before the node's transport started")
            return transport.stats.snapshot()

        self._round_driver = RoundDriver(
            membership=self,
            plans=DhtPlanAgreement(self.plans),
            trainer=self.trainer,
            collective=self.collective,
            state=self,
            policy=self.policy,
            cfg=cfg,
            stop=self._stop,
            history=self.history,
            traffic=traffic,
            leaving=self._set_leaving,
            loop_stall=self.looplag.take_worst if getattr(self, "looplag", None) is not None else lambda: None,
            feedback=getattr(self, "feedback", None),
        )
        return self._round_driver

    def _set_leaving(self, leaving: bool) -> None:
        self._leaving = leaving

    @property
    def _in_exchange(self) -> bool:
        d = getattr(self, "_round_driver", None)
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
        return await self._driver().one_round(members)

    def pseudo_gradient(self) -> torch.Tensor:
        """Global weights minus the model's after the inner steps: [P] fp32 (worker thread)."""
        return pseudo_gradient(self.model, self._global_theta())  # one [P], no flattened copy of the model

    @property
    def state_lock(self):
        """Held while the global state changes in place (re-entrant): the state server never serves a
        half-stepped buffer under the old round's digest."""
        return self.gstate.lock

    def outer_step(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """Round ``r``'s outer step in place, per part (:meth:`OuterStepRule.apply`), under the state's lock (worker thread).
        Before it (issue 14 #3): the state server keeps a copy of round ``r`` while a download of it is in
        progress, and the update is recorded for peers that fell behind (:class:`~geomesh_p2p.sync.transfer.UpdateLog`)."""
        lock = getattr(getattr(self, "gstate", None), "lock", None)
        if lock is None:
            return self.outer_rule.apply(r, plan, aggregate, idle)
        with lock:
            server = getattr(self, "state_server", None)
            if server is not None and getattr(server, "state", None) is self.gstate:
                server.retain()
                server.updates.record(
                    r,
                    self.gstate.digest if self.gstate.round == r else None,
                    [(s, e) for _, s, e in plan.owners()] or [(0, self.numel)],
                    idle,
                    aggregate,
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
        server = getattr(self, "state_server", None)
        if server is not None and getattr(server, "state", None) is getattr(self, "gstate", None):
            server.updates.seal(round, self.digest)  # the update recorded by outer_step is now served
        return self.digest

    # Eager updates (RunConfig.eager, docs/eager.md): the driver's EagerStatePort.
    def eager_start(self, delta: torch.Tensor, weight: float) -> torch.Tensor:
        """This peer's next start weights ``O(θ, v; weight·delta)`` on copies (worker thread; three [P] more
        while it runs): :func:`geomesh_p2p.model.optim.eager_start` with the run's outer lr and momentum."""
        with self.gstate.lock:  # θ and v of one round, never half-stepped by a concurrent outer step
            return eager_start(
                self._global_theta(),
                self.gstate.opt_state,
                delta,
                weight,
                lr=self.run_cfg.outer_lr,
                momentum=self.run_cfg.outer_momentum,
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

    async def catch_up(self) -> None:
        await self.resync.catch_up()

    async def checkpoint_or_warn(self):
        return await self.checkpoints.checkpoint_or_warn()

    def _log_done(self) -> None:
        """One closing line: why the node stops, rounds trained here, the last perplexity."""
        h = self.history
        why = (
            "stop requested"
            if self._stop.is_set()
            else f"target eval perplexity {self.cfg.target_ppl:g} reached"
            if self._reached_target()
            else f"--rounds {self.cfg.rounds} reached"
        )
        ppl = next((r.eval_ppl for r in reversed(h) if r.eval_ppl is not None), self.initial_ppl)
        log.info(
            "done (%s): %d round(s) trained here, now at round %d, eval perplexity %.2f (from %.2f)",
            why,
            len(h),
            self.round,
            ppl if ppl is not None else float("nan"),
            self.initial_ppl if self.initial_ppl is not None else float("nan"),
        )

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
            round_log = getattr(self, "round_log", None)  # absent before start() made it
            if round_log is not None:
                round_log.close()
                self.round_log = None
            return
        # Leaving is announced first (before the checkpoint, which takes seconds on a large model), so
        # the others plan their next round without this peer whatever the reason it stops.
        try:
            if (
                getattr(self, "announcer", None) is not None
                and not self._leaving
                and getattr(self, "ema", None) is not None
            ):
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
                await self.announce()
        except Exception as e:  # the DHT may be gone already; the record expires on its own
            log.warning("could not announce that this peer leaves: %s", e)
        await self.checkpoints.final_checkpoint()
        if self.cfg.summary_json:
            self.write_summary(self.cfg.summary_json)
        grace = await self._serve_last_parts()
        try:
            if getattr(self, "looplag", None) is not None:
                await self.looplag.stop()
            if getattr(self, "announcer", None) is not None:
                await self.announcer.stop()
            if getattr(self, "collective", None) is not None:
                await self.collective.close()
            if getattr(self, "dht", None) is not None:
                clock.follow(None)  # keep the last measured offset, drop the reference to this DHT
                await self.dht.shutdown()
        finally:
            # results handed out may still be on a slow link: the server's stop waits for calls in flight up to
            # the last round's exchange deadline (it returns as soon as none is left)
            await self.transport.stop(grace=grace)
            round_log = getattr(self, "round_log", None)
            if round_log is not None:
                round_log.close()
            events.close_sink(getattr(self, "event_sink", None))
            self.transport = None

    async def _serve_last_parts(self) -> float:
        """Before the server stops: keep serving the last round's owned parts to participants still pulling
        them (a slow link, a uniform-H method's slow peer), until each has been handed them or the round's
        exchange deadline passed (at most :data:`MAX_LINGER_S`), with one INFO line when it waits and one
        more if some never pulled. Returns the grace (seconds) the server's stop gives calls still in flight:
        a result handed out is still on the wire (rs10: a 2.8 MB relay result on a 4.64 Mbit/s link was cut
        by the 0.5 s grace), so until that deadline, at least 0.5 s. A second Ctrl+C ends the wait."""
        collective = getattr(self, "collective", None)
        plan = getattr(getattr(self, "_round_driver", None), "last_plan", None)
        if collective is None or plan is None or not hasattr(collective, "linger"):
            return 0.5
        until = min(float(plan.exchange_deadline), swarm_time() + MAX_LINGER_S)
        left = collective.unserved()
        if left and until > swarm_time():
            readers = sorted({p for ps in left.values() for p in ps})
            events.emit(
                log,
                logging.INFO,
                "serving_last_parts",
                "round %d: %d peer(s) still pulling this peer's %d part(s) (%s); serving them for at most %.0f s",
                plan.round,
                len(readers),
                len(left),
                ", ".join(p[:10] for p in readers[:5]),
                until - swarm_time(),
                peer=self.me,
                round=plan.round,
                readers=readers,
                wait_s=until - swarm_time(),
            )
            left = await collective.linger(until)
            if left:
                log.info(
                    "round %d: %d peer(s) did not pull this peer's parts by the exchange deadline; stopping",
                    plan.round,
                    len({p for ps in left.values() for p in ps}),
                )
        return max(0.5, until - swarm_time())

    def summary(self) -> dict:
        h = self.history
        return {
            "peer_id": self.me,
            "rounds": len(h),
            "last_round": self.round,
            "initial_eval_ppl": self.initial_ppl,
            "final_eval_ppl": next((r.eval_ppl for r in reversed(h) if r.eval_ppl is not None), self.initial_ppl),
            "time_to_target_s": self.time_to_target,
            "straggler_idle_pct": (sum(r.straggler_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100)
            if h
            else 0.0,
            "network_idle_pct": (sum(r.network_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100)
            if h
            else 0.0,
            "bytes_sent": sum(r.bytes_sent for r in h),
            "bytes_received": sum(r.bytes_received for r in h),
            # the weights digest after each round's outer step (= the digest round r+1 starts from)
            "digests_after_round": {r.round: r.digest for r in h},
            "digest_mismatches": sum(1 for r in h if r.digest_agree is False),
            # bytes/s: what this peer announced last (stated by a flag, else measured) and the probe's figures
            "links": {
                "upload_bps": self.cfg.upload_bps or (self.ema.upload_bps if self.ema else None),
                "download_bps": self.cfg.download_bps or (self.ema.download_bps if self.ema else None),
                "stated": {"upload": self.cfg.upload_bps is not None, "download": self.cfg.download_bps is not None},
                "probe": None
                if self.links.probe_result is None
                else {
                    "address": self.links.probe_result.address,
                    "rtt_s": self.links.probe_result.rtt_s,
                    "upload_bps": self.links.probe_result.upload_bps,
                    "download_bps": self.links.probe_result.download_bps,
                },
            },
            "rows": [json.loads(r.to_json()) for r in h],
        }

    def write_summary(self, path: str) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")

        # strict JSON: an infinite perplexity (weights a hostile update blew up) is written as null
        tmp.write_text(json.dumps(json_safe(self.summary()), indent=1, allow_nan=False))
        os.replace(tmp, p)
