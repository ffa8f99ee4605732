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
   exit 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

import geomesh_p2p
from geomesh_p2p.admission import DEFAULT_POW_BITS, MAX_POW_BITS
from geomesh_p2p.errors import UserFacingError
from geomesh_p2p.identity import Identity
from geomesh_p2p.metrics import RoundLog, RoundRecord
from geomesh_p2p.records import PeerRecord
from geomesh_p2p import swarm_status
from geomesh_p2p.transport import Transport, TransportConfig

log = logging.getLogger(__name__)

#: Bandwidth assumed for a direction that is neither stated nor measured yet (bytes/s, 800 Mbit/s).
DEFAULT_LINK_BPS = 1e8

#: Rounds during which a peer owns no part after a part it owned had no valid result (owner gone, or a
#: result every reader refused, e.g. below the quorum). All honest peers saw the same missing part, so
#: honest leaders agree; the peer still contributes, it only stops deciding a range.
OWNER_PENALTY_ROUNDS = 5

#: Envelope, protobuf and codec headers around a pushed part (bytes): the push limit is 4 x numel + this.
PUSH_FRAMING_BYTES = 1 << 20
#: A PullPart request is a few ids and numbers (bytes).
PULL_REQUEST_BYTES = 16 << 10


def _link(bps: Optional[float]) -> float:
    """A bandwidth for this peer's record: the default when unknown, else clamped to the record's bounds."""
    from geomesh_p2p.records import MAX_LINK_BPS, MIN_LINK_BPS

    return DEFAULT_LINK_BPS if not bps else min(max(float(bps), MIN_LINK_BPS), MAX_LINK_BPS)


def _record_tps(tps: dict) -> dict:
    """This peer's tokens/s figures clamped to what a record may state (an EMA fed a near-zero
    compute time must not make the record invalid, and with it every announcement)."""
    from geomesh_p2p.records import MAX_TOKENS_PER_S, MIN_TOKENS_PER_S

    return {b: min(max(float(v), MIN_TOKENS_PER_S), MAX_TOKENS_PER_S) for b, v in tps.items()}


class RunConfig(BaseModel):
    """What every peer of a run shares; its hash is in every PeerRecord and mismatches are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = "geomesh-demo"
    model: str = Field("tiny", description="model preset, or the SHA-256 of --model-config's contents")
    model_config_json: Optional[str] = Field(None, description="contents of --model-config, if given")
    data: str = Field("kjv", description="'kjv' (shipped) or an identifier of --data's contents")
    vocab_size: int = 4096
    seq_len: int = 64
    seed: int = 0
    method: Literal["geomesh", "awb", "css", "diloco", "ddp"] = "geomesh"
    mode: Literal["relay", "reencode"] = Field(
        "relay", description="relay: every peer aggregates the signed contributions itself (an owner cannot forge "
                             "the update); reencode: the owner sends its re-encoded aggregate (fewer bytes; trusted owners)")
    aggregate_encoding: Literal["sign", "int8", "fp16"] = "sign"
    block_size: int = 2048
    error_feedback: bool = False
    clip_k: float = 4.0
    aggregation: Literal["mean", "meanmed", "vote"] = Field(
        "meanmed", description="rule of every part (geomesh_p2p.aggregation): robust 'meanmed' / 'vote', or 'mean'")
    weight_cap: Optional[float] = Field(1.0, gt=0, description="no contributor weighs more than this x the median weight")
    min_agreement: Optional[float] = Field(
        0.5, gt=0, le=1, description="robust rules drop a contribution agreeing with the consensus on fewer elements")
    quorum: float = Field(0.5, ge=0, le=1, description="a part result must aggregate this share of the participants")
    inner_optimizer: Literal["adamw", "lion"] = "adamw"
    inner_lr: float = 1e-3
    warmup_steps: int = 20
    total_inner_steps: int = 2000
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    target_batch: int = 8
    window_s: Optional[float] = 6.0
    uniform_inner_steps: int = 20
    comm_share: float = 0.1
    max_inner_steps: int = 200
    pow_bits: int = Field(DEFAULT_POW_BITS, ge=0, le=MAX_POW_BITS,
                          description="proof of work per identity (leading zero bits of SHA-256; admission.py); "
                                      "records without it are ignored. 0 = off (private runs use --allow-peers)")

    @model_validator(mode="after")
    def _ddp_uses_adamw(self) -> "RunConfig":
        if self.method == "ddp" and self.inner_optimizer != "adamw":
            raise ValueError("method 'ddp' applies AdamW to the averaged gradient; use inner_optimizer 'adamw'")
        return self

    def config_hash(self) -> str:
        """First 16 hex chars of SHA-256 of the canonical JSON of this config."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]

    def diff(self, other: "RunConfig") -> list[str]:
        """Human-readable differences, e.g. ["inner_lr: 0.001 vs 0.0003"]."""
        a, b = self.model_dump(), other.model_dump()
        return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]


class NodeConfig(BaseModel):
    """Per-peer settings (not shared). Units: seconds, bytes, bytes/s."""

    model_config = ConfigDict(extra="forbid")

    bootstrap: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: Optional[str] = None
    client_only: bool = False
    identity: str = "~/.geomesh/identity.key"
    device: str = "auto"
    threads: Optional[int] = None
    data_path: Optional[str] = None
    model_config_file: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 5
    checkpoint_keep: int = 3
    resume: bool = False
    rounds: Optional[int] = None
    target_ppl: Optional[float] = None
    min_peers: int = 1
    wait_peers_s: float = 60.0
    speed_factor: float = 1.0
    memory_budget_bytes: Optional[int] = None
    upload_bps: Optional[float] = None
    download_bps: Optional[float] = None
    probe_bytes: int = Field(4 << 20, gt=0, le=4 << 20, description="bytes each way of the start-up link probe")
    min_link_sample_bytes: int = Field(64 << 10, ge=1, description="smallest round sample used to update a link EMA")
    ema_alpha: float = Field(0.3, gt=0, le=1, description="weight of a new measurement in the re-profiling EMAs")
    link_step_ratio: float = Field(4.0, ge=1, description="most a round's link sample may move the figure (x or /)")
    added_latency_s: float = 0.0
    profile_batches: list[int] = Field(default_factory=lambda: [4, 8, 16])
    amp: bool = Field(True, description="bf16 autocast for the forward pass on CUDA (ignored on CPU)")
    eval_batches: int = 8
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds (and at the last)")
    announce_period_s: float = 2.0
    plan_timeout_s: float = 4.0
    gather_wait_s: float = 4.0
    log_json: Optional[str] = None
    metrics_port: Optional[int] = None
    summary_json: Optional[str] = None
    allow_peers: Optional[list[str]] = Field(
        None, description="private run: base58 PeerIDs / public keys of the only peers this node deals with")


#: How long a peer waits for the address of a record under its own PeerID to answer at start (seconds).
IDENTITY_PING_TIMEOUT_S = 3.0


class StoppedBeforeJoining(Exception):
    """Ctrl+C / SIGTERM arrived while the node was still joining the DHT (a clean stop, exit 0)."""


class DuplicateIdentityError(UserFacingError):
    """Another live process runs this PeerID (the same --identity key file)."""


def check_writable_dir(path: str, flag: str) -> Path:
    """Create ``path`` if needed and check that a file can be written there (then removed).

    Raises:
        UserFacingError: one line naming ``flag`` and the reason (read-only, not a directory, no permission).
    """
    import tempfile

    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
            pass
    except OSError as e:
        raise UserFacingError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return d


class PeerNode:
    """One volunteer node. ``await node.run()`` trains until ``rounds`` / ``target_ppl`` / stop()."""

    def __init__(self, run: RunConfig, cfg: NodeConfig, identity: Optional[Identity] = None):
        self.run_cfg = run
        self.cfg = cfg
        self.identity = identity or Identity.load_or_create(cfg.identity)
        self.me = str(self.identity.peer_id)
        self.config_hash = run.config_hash()
        self.round = 0
        self.digest: Optional[str] = None
        self.theta: Optional[torch.Tensor] = None
        self.outer = None
        self._stop = asyncio.Event()
        self._in_exchange = False
        self.history: list[RoundRecord] = []
        self.initial_ppl: Optional[float] = None
        self.time_to_target: Optional[float] = None
        self._t_start = time.time()
        self.transport: Optional[Transport] = None
        self.ema = None  # capability.ThroughputEMA: tokens/s per micro-batch and link bytes/s, re-profiled
        self.max_batch = 1
        self.probe_result = None  # links.ProbeResult of the start-up probe, if one was made
        self._measured: set[str] = set()  # quantities measured in a round at least once ("tps", "up", "down")
        self._syncing = False
        self._leaving = False  # announced once this peer is on its way out (Ctrl+C / SIGTERM)
        self._owner_penalty: dict[str, int] = {}  # peer id -> last round it owns no part (OWNER_PENALTY_ROUNDS)
        self._noshow_penalty: dict[str, int] = {}  # peer id -> last round it is not planned (probation.py, no-shows)
        self._init_admission()

    def _init_admission(self) -> None:
        """Standing ledger, proof-of-work state and the record filter (issue 12); allow-list when private."""
        from geomesh_p2p.admission import Admission
        from geomesh_p2p.identity import IdentityError, allow_list
        from geomesh_p2p.standing import OnceLog, Standing

        self.standing = Standing()
        self.pow_nonce: Optional[int] = None
        # The nonce is cached next to the key file, only when that file holds this identity's key.
        self._pow_cache = None
        try:
            key = Path(self.cfg.identity).expanduser()
            if key.is_file() and Identity.load_or_create(key).peer_id == self.identity.peer_id:
                self._pow_cache = str(key)
        except (IdentityError, OSError):
            pass
        self._allow = (allow_list(self.cfg.allow_peers, also=[self.identity.peer_id])
                       if self.cfg.allow_peers is not None else None)
        self.admission = Admission(self.run_cfg.run_id, self.run_cfg.pow_bits, self._allow)
        self._vote_log = OnceLog()

    async def _prove_work(self) -> None:
        """This identity's proof of work for the run: cached next to the key file, else computed (seconds)."""
        from geomesh_p2p.admission import load_or_solve_pow, pow_cache_path

        bits = self.run_cfg.pow_bits
        if bits <= 0:
            return
        cache = pow_cache_path(self._pow_cache) if self._pow_cache else None
        if cache is None or not cache.exists():
            log.info("computing this identity's proof of work for run %r (%d bits, ~%.0e hashes)...",
                     self.run_cfg.run_id, bits, 2.0 ** bits)
        nonce, took, cached = await asyncio.to_thread(load_or_solve_pow, self.identity, self.run_cfg.run_id, bits,
                                                      cache, self._stop.is_set)
        if nonce is None:
            raise UserFacingError("stopped while computing the proof of work")
        self.pow_nonce = nonce
        if not cached:
            log.info("proof of work done in %.1fs%s", took, f" (cached in {cache})" if cache else "")

    # ------------------------------------------------------------------ setup
    def request_stop(self) -> None:
        """Ask the node to stop after the current step (or after the exchange, if one is under way)."""
        if not self._stop.is_set():
            log.info("stop requested: %s", "finishing the exchange first" if self._in_exchange else "leaving")
        self._stop.set()

    async def start(self) -> None:
        from geomesh_p2p.collective import CollectiveService
        from geomesh_p2p.dht import DHTNode
        from geomesh_p2p.links import LinkProbeService
        from geomesh_p2p.round import PlanStore
        from geomesh_p2p.state_sync import StateServer

        c = self.cfg
        if c.threads:
            torch.set_num_threads(c.threads)
        if c.checkpoint_dir:
            check_writable_dir(c.checkpoint_dir, "--checkpoint-dir")
        tcfg = TransportConfig(host=c.host, port=c.port, advertise_host=c.advertise_host,
                               client_only=c.client_only, added_latency_s=c.added_latency_s)
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
        # Refuse an incompatible run config now, before spending half a minute on data and profiling.
        await self._check_swarm(self._placeholder_record())
        await self._check_identity_unique()
        probed = await self._probe_links()
        from geomesh_p2p.dht import PeerAnnouncer

        self.announcer = PeerAnnouncer(self.dht, self.my_record, period_s=c.announce_period_s,
                                       ttl_s=4 * c.announce_period_s)
        self.plans = PlanStore(self.dht, self.identity, self.run_cfg.run_id)
        # Off the event loop: tokenizing and profiling take seconds, and the DHT must keep answering.
        await asyncio.to_thread(self._build_training)
        self._init_ema(probed)
        self.round_log = RoundLog(c.log_json, c.metrics_port)

    def _build_training(self) -> None:
        from geomesh_p2p.capability import detect_device, find_max_batch, measure_throughput
        from geomesh_p2p.data import load_dataset
        from geomesh_p2p.optim import OuterNesterov
        from geomesh_p2p.training import InnerTrainer, build_model, flat_params

        r, c = self.run_cfg, self.cfg
        self.dataset = load_dataset(c.data_path, seq_len=r.seq_len, vocab_size=r.vocab_size)
        self.device_info = detect_device(c.device, c.memory_budget_bytes)
        device = "cuda" if self.device_info.kind == "cuda" and c.device == "auto" else (
            c.device if c.device != "auto" else "cpu")
        self.device = torch.device(device)
        self.model = build_model(r.model if not c.model_config_file else None, config_file=c.model_config_file,
                                 vocab_size=self.dataset.vocab_size, seed=r.seed).to(self.device)
        self.numel = flat_params(self.model).numel()
        # No legitimate push exceeds one fp32 copy of the vector (the fp32 baselines' largest part) plus
        # framing: a larger one is refused from its length prefix, before it is read (issue 12).
        from geomesh_p2p.transport import COLLECTIVE_PULL, COLLECTIVE_PUSH

        self.transport.set_payload_limit(COLLECTIVE_PUSH, min(self.transport.config.max_message_bytes,
                                                              4 * self.numel + PUSH_FRAMING_BYTES))
        self.transport.set_payload_limit(COLLECTIVE_PULL, PULL_REQUEST_BYTES)
        # Outer optimizer state: Nesterov's momentum [P], or the ddp baseline's AdamW moments [2P].
        self.state_numel = self.numel * (2 if r.method == "ddp" else 1)
        self.trainer = InnerTrainer(
            self.model, self.dataset, device=self.device, seq_len=r.seq_len, optimizer=r.inner_optimizer,
            lr=r.inner_lr, weight_decay=0.1, warmup_steps=r.warmup_steps, total_steps=r.total_inner_steps,
            seed=r.seed, peer_id=self.me, speed_factor=c.speed_factor, amp=c.amp)
        if r.method == "ddp":
            # Data-parallel baseline: the "outer" step is AdamW on the swarm's mean gradient.
            from geomesh_p2p.optim import SyncAdamW
            from geomesh_p2p.training import DEFAULT_INNER, lr_at

            self.outer = SyncAdamW(
                lambda rnd: lr_at(rnd, lr=r.inner_lr, warmup_steps=r.warmup_steps, total_steps=r.total_inner_steps),
                betas=DEFAULT_INNER["adamw"]["betas"], weight_decay=0.1, decay_mask=self.trainer.decay_mask())
        else:
            self.outer = OuterNesterov(lr=r.outer_lr, momentum=r.outer_momentum)
        self.outer.buf = torch.zeros(self.state_numel)
        t0 = time.time()
        # Profile on a throwaway copy so the real model's weights and optimizer stay untouched.
        import copy
        probe = copy.deepcopy(self.model)
        self.profiled_tps = measure_throughput(probe, seq_len=r.seq_len, batch_sizes=c.profile_batches,
                                          device=self.device, vocab_size=self.dataset.vocab_size, steps=2,
                                          warmup=1, speed_factor=c.speed_factor, amp=c.amp)
        self.max_batch = find_max_batch(probe, seq_len=r.seq_len, device=self.device,
                                        memory_bytes=self.device_info.memory_bytes, limit=256,
                                        vocab_size=self.dataset.vocab_size)
        del probe
        log.info("device %s: %s tokens/s per batch, max batch %d (%.1fs to measure)", self.device_info.name,
                 {b: round(t) for b, t in self.profiled_tps.items()}, self.max_batch, time.time() - t0)

    async def _probe_links(self):
        """Measure this peer's link against the first bootstrap that answers (links.probe_link);
        None when both directions are stated by flags or no bootstrap answers the probe."""
        from geomesh_p2p.links import probe_link

        c = self.cfg
        if c.upload_bps and c.download_bps:
            return None
        for b in c.bootstrap:
            try:
                res = await probe_link(self.transport, b, nbytes=c.probe_bytes, repeats=2, timeout_s=30.0)
            except Exception as e:  # an old or busy bootstrap: the first rounds will measure instead
                log.info("link probe of %s failed (%s); bandwidth will be measured in the first round", b, e)
                continue
            log.info("link to %s: upload %.1f Mbit/s, download %.1f Mbit/s, RTT %.1f ms (probe, up to %d KiB)", b,
                     res.upload_bps * 8e-6, res.download_bps * 8e-6, res.rtt_s * 1e3, res.nbytes >> 10)
            self.probe_result = res
            return res
        return None

    def _init_ema(self, probed) -> None:
        from geomesh_p2p.capability import ThroughputEMA

        c = self.cfg
        up = c.upload_bps or (probed.upload_bps if probed else None)
        down = c.download_bps or (probed.download_bps if probed else None)
        self.ema = ThroughputEMA(alpha=c.ema_alpha, tokens_per_s=self.profiled_tps, upload_bps=up, download_bps=down)

    # ------------------------------------------------------------------ records
    def my_record(self) -> PeerRecord:
        c = self.cfg
        max_batch = max(1, self.max_batch)
        return PeerRecord(
            peer_id=self.me, address=self.transport.address, device=self.device_info.name,
            memory_bytes=self.device_info.memory_bytes, tokens_per_s=_record_tps(self.ema.tokens_per_s),
            max_batch=max_batch, upload_bps=_link(c.upload_bps or self.ema.upload_bps),
            download_bps=_link(c.download_bps or self.ema.download_bps),
            version=geomesh_p2p.__version__, protocol_version=geomesh_p2p.PROTOCOL_VERSION,
            run_config_hash=self.config_hash, run_config=self.run_cfg.model_dump(), round=self.round,
            weights_digest=None if self._syncing else self.digest, leaving=self._leaving,
            pow_nonce=self.pow_nonce, standing=self.standing.attestations(exclude=self.me))

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
        from geomesh_p2p.dht import live_peers

        recs = await live_peers(self.dht, self.run_cfg.run_id, expected_version=geomesh_p2p.__version__,
                                expected_config_hash=self.config_hash, latest=True, include_leaving=include_leaving)
        out = {r.peer_id: r for r in self.admission.filter(recs)}
        out[self.me] = self.my_record()
        return list(out.values())

    # ------------------------------------------------------------------ state
    def _set_state(self, round: int, theta: torch.Tensor, momentum: Optional[torch.Tensor]) -> None:
        from geomesh_p2p.state import digest
        from geomesh_p2p.state_sync import Snapshot
        from geomesh_p2p.training import load_flat_

        self.round = round
        self.theta = theta.clone()
        if momentum is not None:
            self.outer.buf = momentum.detach().to(torch.float32).reshape(-1).contiguous().clone()
        load_flat_(self.model, self.theta)
        self.digest = digest(self.theta, self.outer.buf)
        self.state_server.publish(Snapshot(round, self.theta.clone(), self.outer.buf.clone(), self.digest))

    def _placeholder_record(self) -> PeerRecord:
        """This peer's version, protocol and run config, before its device is profiled (never announced)."""
        return PeerRecord(
            peer_id=self.me, address=self.transport.address, device="(starting)", memory_bytes=0, max_batch=1,
            upload_bps=1.0, download_bps=1.0, version=geomesh_p2p.__version__,
            protocol_version=geomesh_p2p.PROTOCOL_VERSION, run_config_hash=self.config_hash,
            run_config=self.run_cfg.model_dump())

    async def _check_identity_unique(self) -> None:
        """Refuse to start when another live process already runs this PeerID (issue 14 #7).

        A record under this PeerID at another address may be this identity's previous run (a restart
        within the record's lifetime) or a second process with the same key: the address is pinged, and
        only an answer signed by this very PeerID (only the key's holder can sign it) proves the second.

        Raises:
            DuplicateIdentityError: "this PeerID is already live at ADDRESS".
        """
        from geomesh_p2p import __version__
        from geomesh_p2p.dht import live_peers
        from geomesh_p2p.dht.node import DHT_PROTOCOL_VERSION
        from geomesh_p2p.transport import DHT_PING
        from geomesh_p2p.wire import dht_pb2

        mine = self.transport.address
        for rec in await live_peers(self.dht, self.run_cfg.run_id, include_leaving=True):
            if rec.peer_id != self.me or not rec.address or rec.address == mine:
                continue
            req = dht_pb2.PingRequest(sender=self.dht.self_info(), dht_protocol=DHT_PROTOCOL_VERSION,
                                      software_version=__version__)
            try:
                reply = await self.transport.call(rec.address, DHT_PING, req.SerializeToString(),
                                                  timeout=IDENTITY_PING_TIMEOUT_S)
            except Exception:  # nobody there (a stale record of this identity's previous run)
                continue
            if reply.sender == self.identity.peer_id:
                raise DuplicateIdentityError(
                    f"this PeerID ({self.identity.peer_id.short()}) is already live at {rec.address}: another "
                    f"process runs with the same --identity key; give each peer its own key file")

    async def _check_swarm(self, mine: Optional[PeerRecord] = None) -> None:
        """Refuse to start when the swarm's live peers all run another config or version.

        Raises IncompatibleSwarmError naming the differing fields (e.g. "inner_lr: 0.001 here vs
        0.0003 in the swarm").
        """
        from geomesh_p2p.dht import IncompatibleSwarmError, check_compatible, live_peers

        mine = mine or self.my_record()
        others = [r for r in await live_peers(self.dht, self.run_cfg.run_id) if r.peer_id != self.me]
        if not others or any(check_compatible(mine, r) is None for r in others):
            return
        other = others[0]
        detail = check_compatible(mine, other)
        if other.run_config and other.run_config_hash != self.config_hash:
            a, b = self.run_cfg.model_dump(), other.run_config
            fields = [f"{k}: {a.get(k)!r} here vs {b.get(k)!r} in the swarm"
                      for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            detail = "; ".join(fields) or detail
        raise IncompatibleSwarmError(
            f"the {len(others)} live peer(s) of run {self.run_cfg.run_id!r} use another run config: {detail}")

    async def _initial_state(self) -> None:
        from geomesh_p2p.state import load_latest_checkpoint
        from geomesh_p2p.training import flat_params

        await self._check_swarm()

        if self.cfg.resume and self.cfg.checkpoint_dir:
            ck = load_latest_checkpoint(self.cfg.checkpoint_dir)
            if ck is not None:
                rnd, theta, momentum, meta = ck
                if meta.get("run_config_hash") not in (None, self.config_hash):
                    old = (meta.get("meta") or {}).get("run_config") or {}
                    diff = [f"{k}: {old.get(k)!r} there vs {v!r} here" for k, v in self.run_cfg.model_dump().items()
                            if k in old and old[k] != v]
                    raise UserFacingError(f"checkpoint in {self.cfg.checkpoint_dir} is from another run config ("
                                          + ("; ".join(diff) or f"{meta.get('run_config_hash')} vs {self.config_hash}")
                                          + "); resume with the same flags, or use another --checkpoint-dir")
                if momentum is None or momentum.numel() != self.state_numel:
                    raise UserFacingError(f"checkpoint in {self.cfg.checkpoint_dir} holds no or another optimizer "
                                          f"state ({0 if momentum is None else momentum.numel()} elements, this run "
                                          f"needs {self.state_numel}); was it written by another --method?")
                self._set_state(rnd, theta, momentum)
                from geomesh_p2p.standing import Standing

                self.standing = Standing.from_meta((meta.get("meta") or {}).get("standing"))
                log.info("resumed from checkpoint at round %d (digest %s)", rnd, self.digest[:8])
                return
            log.info("--resume: no checkpoint in %s, starting fresh", self.cfg.checkpoint_dir)
        # Fresh peer: join the swarm's state if it already trained, else the seed's.
        self._set_state(0, flat_params(self.model), torch.zeros(self.state_numel))
        recs = [r for r in await self.peers() if r.peer_id != self.me]
        if any(r.round > 0 and r.weights_digest for r in recs):
            await self._catch_up()

    async def _catch_up(self) -> None:
        """Download the state the swarm's vote backs (late join or digest mismatch): weighted by standing
        once this peer knows who delivered, else by distinct addresses with history (standing.py)."""
        from geomesh_p2p.state_sync import StateSyncError, download_state

        self._syncing = True
        start_round = self.round
        try:
            for attempt in range(30):
                if self._stop.is_set():
                    return
                recs = [r for r in await self.peers() if r.peer_id != self.me]
                choice = self._state_vote(recs).choice
                if choice is None:
                    self.round = start_round
                    return
                if choice.digest == self.digest:
                    # This peer holds the backed state already (its digest check was outvoted by identities
                    # without standing, or the others have not moved on yet).
                    self.round = choice.round
                    return
                top, donors = choice.round, choice.donors
                self.round = top
                await self.announce()  # tell the leader we are syncing for this round
                try:
                    snap = await download_state(self.transport, donors, round=top, numel=self.numel,
                                                expected_digest=choice.digest, state_numel=self.state_numel)
                except StateSyncError as e:
                    log.info("state download for round %d failed (%s); retrying", top, e)
                    await asyncio.sleep(0.5)
                    continue
                self._set_state(snap.round, snap.theta, snap.momentum)
                log.info("downloaded state of round %d from %d donor(s), digest %s (%s vote: %g of %g)", top,
                         len(donors), self.digest[:8], choice.mode, choice.backing, choice.total)
                return
            self.round = start_round  # nothing was downloaded: this peer still holds its own state
            raise StateSyncError("could not download the swarm's state after 30 attempts; see the log for why")
        finally:
            self._syncing = False
            await self.announce()

    async def _checkpoint_or_warn(self) -> Optional[Path]:
        """Write a checkpoint in a worker thread; a failure (disk full, directory gone read-only, ...) is one
        WARNING line: the previous checkpoint stays valid (writes are atomic), training goes on and the next
        checkpoint retries. Awaited before the next round starts, so the state does not change while it is written."""
        try:
            return await asyncio.to_thread(self.checkpoint)
        except Exception as e:  # never end a training peer over its checkpoint
            log.warning("round %d: checkpoint failed (%s: %s); the previous one stays valid, retrying at the next",
                        self.round, type(e).__name__, e)
            return None

    def checkpoint(self) -> Optional[Path]:
        from geomesh_p2p.state import save_checkpoint

        if not self.cfg.checkpoint_dir or self.theta is None:
            return None
        return save_checkpoint(self.cfg.checkpoint_dir, round=self.round, theta=self.theta,
                               momentum=self.outer.buf, keep=self.cfg.checkpoint_keep,
                               meta={"run_config_hash": self.config_hash, "peer_id": self.me,
                                     "run_config": self.run_cfg.model_dump(), "standing": self.standing.to_meta()})

    # ------------------------------------------------------------------ rounds
    def _plan_config(self, n_peers: int):
        from geomesh_p2p.planner import PlanConfig

        r = self.run_cfg
        p = self.numel
        sign_bytes = (p + 7) // 8 + 4 * ((p + r.block_size - 1) // r.block_size)
        per_peer = {"reencode": 2 * sign_bytes, "relay": sign_bytes * max(1, n_peers)}[r.mode]
        if r.method in ("diloco", "awb", "ddp"):
            per_peer = 2 * 4 * p
        return PlanConfig(seq_len=r.seq_len, target_batch=r.target_batch, window_s=r.window_s,
                          part_align=r.block_size if r.method in ("geomesh", "css") else 1,
                          comm_share=r.comm_share, payload_bytes=per_peer, mode=r.mode, method=r.method,
                          uniform_inner_steps=r.uniform_inner_steps, max_inner_steps=r.max_inner_steps,
                          exchange_timeout_s=max(5.0, 3 * self.cfg.plan_timeout_s))

    def _note_failed_owners(self, spec, ar) -> None:
        """Owners of parts with no valid result this round own no part for ``OWNER_PENALTY_ROUNDS`` rounds."""
        for j in ar.missing_parts:
            pid = spec.owners[j].peer_id
            if pid == self.me:
                continue
            if pid not in self._owner_penalty:
                log.warning("round %d: part %d of %s had no valid result; it owns no part for the next %d rounds",
                            spec.round, j, pid[:10], OWNER_PENALTY_ROUNDS)
            self._owner_penalty[pid] = spec.round + OWNER_PENALTY_ROUNDS

    def _without_parts(self, members, probation=()):
        """``members`` with the peers under an owner penalty planned as client-only (they own no part),
        unless that would leave no owner at all; peers on ``probation`` always own no part."""
        self._owner_penalty = {p: until for p, until in self._owner_penalty.items() if until >= self.round}
        if probation:
            members = [m.model_copy(update={"address": None}) if m.peer_id in probation and m.address else m
                       for m in members]
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
        from geomesh_p2p.probation import absent_participants, noshow_penalty_rounds

        pen = self._noshows()
        marked = set(plan.probation())
        for pid in absent_participants(plan.participants(), ar.contributors):
            if pid == getattr(self, "me", None):
                continue
            rounds = noshow_penalty_rounds(pid in marked)
            if pid not in pen:
                log.log(logging.INFO if pid in marked else logging.WARNING,
                        "round %d: %s%s was planned and contributed to no part; not planned for the next %d rounds",
                        plan.round, pid[:10], " (on probation)" if pid in marked else "", rounds)
            pen[pid] = plan.round + rounds

    def _standing_view(self, records):
        """This node's :class:`~geomesh_p2p.probation.StandingView` of ``records`` for the current round."""
        from geomesh_p2p.probation import StandingView

        return StandingView(getattr(self, "standing", None), records, round=self.round, me=getattr(self, "me", None))

    def _admit(self, members):
        """(members to plan, those of them on probation): no-shows left out; of the peers on probation
        (standing below ``probation.threshold``), at most ``probation_slots(established)``, highest
        standing first, then by a per-round rendezvous hash (probation.py)."""
        from geomesh_p2p import probation as pb

        pen = self._noshows()
        me = getattr(self, "me", None)
        kept = [m for m in members if m.peer_id not in pen or m.peer_id == me]
        view = self._standing_view(members)
        est, waiting = pb.split(view, [m.peer_id for m in kept])
        chosen = pb.select_probation(self.run_cfg.run_id, self.round, view, waiting, pb.probation_slots(len(est)))
        left = len(waiting) - len(chosen)
        if left or len(kept) < len(members):
            log.info("round %d: planning %d established peer(s) and %d of %d on probation; %d no-show(s) left out",
                     self.round, len(est), len(chosen), len(waiting), len(members) - len(kept))
        keep = set(est) | set(chosen)
        return [m for m in kept if m.peer_id in keep], tuple(chosen)

    def _make_plan(self, members, leader):
        from geomesh_p2p.planner import comm_time, make_plan
        from geomesh_p2p.probation import probation_slots

        members, chosen = self._admit(members)
        probation = chosen
        members = self._without_parts(members, probation)
        cfg = self._plan_config(len(members))
        if self.run_cfg.window_s:
            # A peer whose link cannot move its share of the exchange in half the window would stretch
            # the round for everyone (or make a plan the others refuse): plan without it this round.
            limit = 0.5 * self.run_cfg.window_s
            # Likewise one that needs more than half the window for a single sequence.
            seq = self.run_cfg.seq_len
            slow = [m for m in members if comm_time(m, cfg) > limit or seq / max(m.best_tokens_per_s(), 1e-9) > limit]
            if slow and len(slow) < len(members):
                log.warning("round %d: planning without %s: predicted exchange %s s, one sequence %s s; the limit is "
                            "%.1f s (half the window)", self.round, ", ".join(m.peer_id[:10] for m in slow),
                            ", ".join(f"{comm_time(m, cfg):.1f}" for m in slow),
                            ", ".join(f"{seq / max(m.best_tokens_per_s(), 1e-9):.1f}" for m in slow), limit)
                members = [m for m in members if m not in slow]
                # Still at most probation_slots(established) on probation (those first in line stay).
                ids = {m.peer_id for m in members}
                n_est = sum(1 for p in ids if p not in probation)
                probation = tuple(p for p in chosen if p in ids)[:probation_slots(n_est)]
                members = [m for m in members if m.peer_id not in chosen or m.peer_id in probation]
                cfg = self._plan_config(len(members))
        # geomesh/awb: AWB plan; diloco/css: uniform; ddp: uniform with one step per round. Claims are
        # bounded by the planner (planner.bound_records) and, for the peers of the last round, by what
        # their delivered contributions support (_delivered_rates).
        evidence = getattr(self, "_supported_tps", None)
        supported = evidence[1] if evidence is not None and evidence[0] == self.round - 1 else None
        return make_plan(members, cfg, run_id=self.run_cfg.run_id, round=self.round, leader=leader, numel=self.numel,
                         start_time=time.time() + 0.5, start_digest=self.digest, supported_tokens_per_s=supported,
                         probation=probation)

    async def _gather_members(self, expected: set[str], min_peers: int, wait_s: float) -> list[PeerRecord]:
        """Peers in sync for this round: announced this round with this digest. Waits for ``expected``
        peers (last round's participants, less those that announced they are leaving) and for peers
        announced as syncing, up to ``wait_s`` (syncing peers on probation, e.g. identities that only
        announce, up to ``probation.PROBATION_SYNC_WAIT_S``). Returns None at once when a live peer already
        holds a later round (this peer must catch up before it can take part)."""
        from geomesh_p2p.probation import PROBATION_SYNC_WAIT_S

        t0 = time.monotonic()
        deadline = t0 + wait_s
        while True:
            everyone = await self.peers(include_leaving=True)
            # A peer that said it is leaving is not waited for (it finished its last exchange).
            expected = expected - {r.peer_id for r in everyone if r.leaving}
            recs = [r for r in everyone if not r.leaving]
            sr = self._swarm_round(recs)
            if sr is not None and sr > self.round:
                return None  # the swarm is ahead (e.g. resumed from an older checkpoint): catch up first
            synced = [r for r in recs if r.round == self.round and r.weights_digest == self.digest]
            ids = {r.peer_id for r in synced}
            syncing = {r.peer_id for r in recs if r.round == self.round and r.weights_digest is None}
            if syncing - ids and time.monotonic() - t0 > PROBATION_SYNC_WAIT_S:
                view = self._standing_view(recs)
                syncing = {p for p in syncing if view.established(p)}
            if (expected | syncing) <= ids and len(ids) >= min_peers:
                return synced
            if time.monotonic() > deadline or self._stop.is_set():
                return synced
            await asyncio.sleep(0.2)

    async def run(self) -> int:
        """Train until done; returns a process exit code (0 on success or clean stop)."""
        from geomesh_p2p.state_sync import StateSyncError

        try:
            try:
                await self.start()
            except StoppedBeforeJoining:
                log.info("stop requested before this peer joined the swarm: leaving")
                return 0
            await self._initial_state()
            self.announcer.start()
            self.initial_ppl = await asyncio.to_thread(self.trainer.evaluate, max_batches=self.cfg.eval_batches)
            log.info("round %d: eval perplexity %.2f (initial)", self.round, self.initial_ppl)
            expected: set[str] = set()
            first = True
            while not self._stop.is_set():
                if self.cfg.rounds is not None and self.round >= self.cfg.rounds:
                    break
                await self.announce()
                if await self._behind():
                    try:
                        await self._catch_up()
                    except StateSyncError as e:  # keep serving and retry: the donors may come back
                        log.warning("catching up failed (%s); retrying in a few seconds", e)
                        await asyncio.sleep(3.0)
                    continue
                members = await self._gather_members(
                    expected, self.cfg.min_peers if first else 1,
                    self.cfg.wait_peers_s if first else self.cfg.gather_wait_s)
                if members is None:
                    continue  # _behind() is true now: the next pass catches up
                first = False
                expected = await self._one_round(members)
                if self._reached_target():
                    break
            self._log_done()
        finally:
            await self.shutdown()
        return 0

    def _log_done(self) -> None:
        """One closing line: why the node stops, rounds trained here, the last perplexity."""
        h = self.history
        why = ("stop requested" if self._stop.is_set() else
               f"target eval perplexity {self.cfg.target_ppl:g} reached" if self._reached_target() else
               f"--rounds {self.cfg.rounds} reached")
        ppl = next((r.eval_ppl for r in reversed(h) if r.eval_ppl is not None), self.initial_ppl)
        log.info("done (%s): %d round(s) trained here, now at round %d, eval perplexity %.2f (from %.2f)", why,
                 len(h), self.round, ppl if ppl is not None else float("nan"),
                 self.initial_ppl if self.initial_ppl is not None else float("nan"))

    async def _refresh_live(self, live: dict, stop: asyncio.Event, period_s: float = 0.25) -> None:
        """Add newly seen live peers to ``live`` (peer_id -> record) every ``period_s`` until ``stop`` is set.
        Stopped by the event, not cancelled: a DHT lookup cancelled mid-flight leaves hivemind's
        ``traverse_dht`` helper tasks pending ("Task was destroyed but it is pending!")."""
        from geomesh_p2p.aio import wait_event

        while not await wait_event(stop, period_s):
            try:
                live.update({x.peer_id: x for x in await self.peers()})
            except Exception as e:  # a failed DHT read: keep the last view
                log.debug("refreshing live peers failed: %s", e)

    async def _behind(self) -> bool:
        """True when the swarm already holds the state of a later round (this peer must catch up)."""
        sr = self._swarm_round(await self.peers())
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
        """:func:`~geomesh_p2p.standing.choose_state` for this peer; logs once a state that most identities
        announce but the standing this peer sees does not back, when it would have moved this peer."""
        from geomesh_p2p.standing import OnceLog, choose_state

        vote = choose_state(recs, me=self.me, standing=getattr(self, "standing", None),
                            trained=bool(getattr(self, "history", None)))
        ref = vote.refusal
        if ref is not None:
            mine = (getattr(self, "round", 0), getattr(self, "digest", None))
            if ref.round > mine[0] or (ref.round == mine[0] and ref.digest != mine[1]):
                if getattr(self, "_vote_log", None) is None:
                    self._vote_log = OnceLog()
                self._vote_log(("refused", ref.round, ref.digest), logging.WARNING, "%s", ref.message())
        return vote

    def _reached_target(self) -> bool:
        t = self.cfg.target_ppl
        if t is None or not self.history or self.history[-1].eval_ppl is None:
            return False
        if self.history[-1].eval_ppl <= t:
            if self.time_to_target is None:
                self.time_to_target = time.time() - self._t_start
            return True
        return False

    async def _one_round(self, members: list[PeerRecord]) -> set[str]:
        """Run round ``self.round``; returns the participants expected next round."""
        from geomesh_p2p.round import obtain_plan
        from geomesh_p2p.training import flat_params, load_flat_

        r = self.round
        t_round = time.time()
        live = {x.peer_id: x for x in await self.peers()}
        # Not cancelled by a stop request (it is bounded by the plan timeouts): once the others follow a
        # plan that names this peer, it must serve its part and contribute (0 steps if stopping).
        # Keep the view of live peers fresh while plans are read: a peer that (re)joined just now may lead
        # a better-ranked plan, and refusing it as "not live" would split the round.
        refresh_stop = asyncio.Event()
        refresher = asyncio.ensure_future(self._refresh_live(live, refresh_stop))
        # Leader candidates: the established members, no-shows excepted (probation.leader_candidates), so
        # identities that only announce never lead and cost the take-over nothing.
        from geomesh_p2p.probation import leader_candidates

        members = self._verified_members(members)
        candidates = leader_candidates(self._standing_view(list(live.values())), [m.peer_id for m in members],
                                       barred=self._noshows())
        try:
            plan = await obtain_plan(self.plans, r, members, self._make_plan, plan_timeout_s=self.cfg.plan_timeout_s,
                                     accept=lambda p: self._plan_problem(p, live) or self._verified_plan_problem(p),
                                     candidates=candidates)
        finally:
            refresh_stop.set()  # the lookup under way finishes (bounded by the DHT's RPC timeouts)
            await asyncio.gather(refresher, return_exceptions=True)
        if plan is None:
            if not self._stop.is_set():
                log.warning("round %d: no plan appeared; retrying", r)
            return set()
        if self._stop.is_set() and self.me not in plan.participants():
            return set()
        if self.me not in plan.participants() or plan.start_digest != self.digest:
            why = (f"not in the plan of leader {plan.leader[:10]} (it joined late, or the leader found its link or "
                   f"device too slow for the {plan.window_s:.1f} s window: see the leader's log)"
                   if self.me not in plan.participants() else "weights differ from the plan's")
            log.info("round %d: %s; waiting for the round to end, then syncing", r, why)
            # Announce as syncing for the next round now, so that its leader waits for this peer.
            self._syncing, self.round = True, r + 1
            await self.announce()
            # Catch up as soon as the others announce round r+1 (well before the plan's exchange deadline).
            await self._wait_for_round(r + 1, timeout_s=max(5.0, plan.exchange_deadline - time.time() + 5.0))
            await self._catch_up()
            return set(plan.participants())
        a = plan.assignment(self.me)
        sent0, recv0 = self.transport.stats.snapshot()
        loop = asyncio.get_running_loop()
        grad = None
        t_train = time.perf_counter()
        try:
            if self.run_cfg.method == "ddp":
                # DDP: exchange this batch's gradient, not a pseudo-gradient; every peer then applies
                # the same AdamW step to the mean (optim.SyncAdamW).
                grad, result = await loop.run_in_executor(None, lambda: self.trainer.gradient(
                    round=r, batch_size=a.batch_size, micro_batch=a.micro_batch))
            else:
                result = await loop.run_in_executor(None, lambda: self.trainer.run(
                    round=r, inner_steps=a.inner_steps, batch_size=a.batch_size, micro_batch=a.micro_batch,
                    deadline=plan.train_deadline, should_stop=self._stop.is_set,
                    progress=self._progress_printer(r, a.inner_steps)))
        except FloatingPointError as e:
            # The global weights give a non-finite loss (e.g. a hostile update blew them up): this peer
            # has nothing sound to contribute this round, but it keeps serving and following the swarm.
            log.warning("round %d: %s; contributing nothing this round", r, e)
            grad, result = None, self._no_work(time.perf_counter() - t_train)
            load_flat_(self.model, self.theta)
        t_compute_end = time.time()
        if self._stop.is_set():
            # Finish the round anyway (the inner steps stopped early): the parts this peer owns stay
            # served and the others get a full update; the node leaves right after.
            log.info("round %d: stop requested; exchanging what was trained, then leaving", r)
        delta = grad if grad is not None else self.theta - flat_params(self.model)
        if not bool(torch.isfinite(delta).all()):
            log.warning("round %d: this peer's update has non-finite values (its inner steps diverged); "
                        "contributing nothing this round", r)
            delta, result = torch.zeros_like(delta), self._no_work(result.compute_s)
            load_flat_(self.model, self.theta)
        try:
            spec = self._collective_spec(plan)
        except ValueError as e:  # _plan_problem should have caught it; never crash on a leader's plan
            log.error("round %d: the plan of %s cannot be executed (%s); skipping the round", r, plan.leader[:10], e)
            load_flat_(self.model, self.theta)  # back to the global weights: this round's steps are void
            return set()
        self._in_exchange = True
        try:
            ar = await self.collective.all_reduce(spec, delta, tokens=result.tokens, compute_end=t_compute_end)
        finally:
            self._in_exchange = False
        self._note_failed_owners(spec, ar)
        self._note_no_shows(plan, ar)
        t_agg = time.time()
        return await self._finish_round(r, plan, a, result, ar, t_round, t_compute_end, t_agg, sent0, recv0)

    def _collective_spec(self, plan):
        """The collective's spec for ``plan``. Raises ValueError when the plan cannot be executed."""
        from geomesh_p2p.collective import CollectiveSpec, PartOwner, max_part_elements, split_owners
        from geomesh_p2p.probation import early_close_grace_s

        r = plan.round
        compressed = self.run_cfg.method in ("geomesh", "css")
        push, agg = ("sign", self.run_cfg.aggregate_encoding) if compressed else ("fp32", "fp32")
        # Owners' addresses come from the plan (the leader's view), so every peer dials the same ones.
        addresses = {x.peer_id: x.address for x in plan.assignments}
        owners = [PartOwner(peer_id=pid, address=addresses.get(pid) or "", start=start, end=end)
                  for pid, start, end in plan.owners()]
        # A part too big for one gRPC message (fp32 baselines of large models) is cut into several.
        owners = split_owners(owners, max_part_elements(
            push_encoding=push, mode=plan.mode, aggregate_encoding=agg, n_participants=len(plan.assignments),
            block_size=self.run_cfg.block_size, max_message_bytes=self.transport.config.max_message_bytes))
        return CollectiveSpec(
            run_id=self.run_cfg.run_id, round=r,
            participants={x.peer_id: x.token_budget for x in plan.assignments},
            owners=owners, numel=self.numel, mode=plan.mode,
            aggregate_encoding=agg, push_encoding=push,
            block_size=self.run_cfg.block_size, clip_k=self.run_cfg.clip_k,
            rule=self.run_cfg.aggregation if compressed else "mean",
            weight_cap=self.run_cfg.weight_cap, min_agreement=self.run_cfg.min_agreement, quorum=self.run_cfg.quorum,
            probation=plan.probation(), grace_s=early_close_grace_s(plan.window_s),
            deadline=plan.exchange_deadline - 0.25 * (plan.exchange_deadline - plan.train_deadline),
            pull_deadline=plan.exchange_deadline)

    def _plan_problem(self, plan, live: dict) -> Optional[str]:
        """Why this peer must not follow ``plan`` (None: it may). Guards against a rogue or broken
        leader: wrong model size or settings, unknown leader or participants, owners at addresses
        their records do not announce, deadlines far in the future (a stall); then
        :func:`geomesh_p2p.planner.check_plan`: batches, steps, window, token budgets and ownership
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
        horizon = 4 * (rc.window_s or 60.0) + 120.0
        if plan.train_deadline - time.time() > horizon or plan.exchange_deadline - plan.train_deadline > horizon:
            return "its deadlines are unreasonably far in the future"
        # Probation (issue 12): the leader is not a new identity, and those it plans as established are
        # established in this peer's view too (lenient by the rounds this peer did not see).
        from geomesh_p2p.probation import marking_problem

        reason = marking_problem(plan, self._standing_view(list(live.values())), live.keys())
        if reason is not None:
            return reason
        # Batches, steps, window, budgets and ownership, recomputed from the records (issue 11).
        from geomesh_p2p.planner import check_plan

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
        return check_plan(plan, live, self._plan_config(len(plan.assignments)), now=time.time(), barred=barred)

    async def _finish_round(self, r, plan, a, result, ar, t_round, t_compute_end, t_agg, sent0, recv0) -> set[str]:
        """Outer step, digest, evaluation, the round's row, checkpoint; re-sync on a digest mismatch."""
        self._verify_round(r, plan, a, ar)  # before the outer step: it keeps this round's start weights
        self._outer_step(r, plan, ar.aggregate, idle=ar.idle_ranges())
        self._set_state(r + 1, self.theta, None)
        # Re-profile before announcing round r+1: the record a leader gathers for r+1 then already holds
        # the figures every follower will check its plan against (planner.check_plan).
        self._update_throughput(a.micro_batch, result)
        self._update_links(ar)
        self._supported_tps = (r, self._delivered_rates(plan, ar))
        self.standing.credit(r, {pid for part in ar.contributors.values() for pid, _ in part})  # standing.py
        sent1, recv1 = self.transport.stats.snapshot()
        last = self.cfg.rounds is not None and r + 1 >= self.cfg.rounds
        if self._stop.is_set() or last:
            # Say so with the new round's record, before the others gather for it (issue 14 #4: every way
            # of leaving announces before the next gather; --target-ppl right after the evaluation below).
            self._leaving = True
            log.info("round %d: exchange done; announcing that this peer leaves (%s)", r,
                     "stop requested" if self._stop.is_set() else f"--rounds {self.cfg.rounds} reached")
        await self.announce()
        ppl = (await asyncio.to_thread(self.trainer.evaluate, max_batches=self.cfg.eval_batches)
               if (r + 1) % self.cfg.eval_every == 0 or last else None)
        t = self.cfg.target_ppl
        if t is not None and ppl is not None and ppl <= t and not self._leaving:
            self._leaving = True
            log.info("round %d: target eval perplexity %g reached; announcing that this peer leaves", r, t)
            await self.announce()
        # The barrier is when the last contributor finished computing (stated in its contributions):
        # waiting until then is straggler idle, waiting after it is network idle (the paper's split).
        barrier = min(ar.last_compute_end or t_compute_end, t_agg)
        straggler = max(0.0, barrier - t_compute_end)
        network = max(0.0, (t_agg - t_compute_end) - straggler)
        rec = RoundRecord(
            round=r, peers=len(plan.assignments), leader=plan.leader[:10], batch_size=a.batch_size,
            inner_steps_planned=a.inner_steps, inner_steps_done=result.steps_done, tokens=result.tokens,
            train_loss=result.mean_loss, eval_ppl=ppl, compute_s=result.compute_s,
            straggler_idle_s=straggler, network_idle_s=network, round_s=time.time() - t_round,
            bytes_sent=sent1 - sent0, bytes_received=recv1 - recv0, digest=self.digest,
            contributors=len({pid for part in ar.contributors.values() for pid, _ in part}),
            missing_parts=len(ar.missing_parts),
            time=time.time())
        # Only the participants that delivered vote on the digest (and are waited for): a no-show, e.g. an
        # identity on probation that never takes part, would hold every check for its whole wait.
        delivered = {pid for part in ar.contributors.values() for pid, _ in part}
        rec.digest_agree = await self._check_digest(
            r + 1, [p for p in plan.participants() if p in delivered] or plan.participants())
        resync = rec.digest_agree is False
        self.history.append(rec)
        if sys.stdout.isatty():
            sys.stdout.write("\r\x1b[K")  # clear the progress line before the row
        if rec.underfilled and not self._stop.is_set():
            # Flagged in the table ("!"), the JSON row and Prometheus too; the next plan already follows the
            # re-measured tokens/s (_update_throughput), so a mis-profiled peer gets fewer steps.
            log.warning("round %d: trained %d of %d planned inner steps (device slower than profiled, or busy)",
                        r, rec.inner_steps_done, rec.inner_steps_planned)
        self.round_log.add(rec)
        swarm_status.publish_round_summary(self, rec)  # the bootstrap's status page (issue 16)
        if resync:
            from geomesh_p2p.state_sync import StateSyncError

            try:
                await self._catch_up()
            except StateSyncError as e:  # the next round's _behind() check tries again
                log.warning("re-sync failed (%s); will retry", e)
        elif self.cfg.checkpoint_dir and (r + 1) % self.cfg.checkpoint_every == 0:
            await self._checkpoint_or_warn()
        contributed = {pid for part in ar.contributors.values() for pid, _ in part}
        return contributed or set(plan.participants())

    def _verify_round(self, r: int, plan, a, ar) -> None:
        """Verified work (:mod:`geomesh_p2p.verify`): keep round ``r``'s start weights and the signed
        contributions received (relay mode), then, off the event loop and in parallel with the evaluation,
        check the contributor this peer's selection draws and re-check published evidence. Bounded by
        ``time_share`` of the window after the exchange (skipped with a debug line past it); at most one
        such task runs at a time. Never raises: a failure here must not cost the round."""
        try:
            from geomesh_p2p import verify

            if not ar.contributions:
                return  # reencode mode (or nothing received): no contributions to check
            wv = getattr(self, "_work_verifier", None)
            if wv is None:
                wv = self._work_verifier = verify.WorkVerifier.for_node(self)
            wv.keep_round(r, theta=self.theta.clone(), plan=plan, part_ranges=ar.part_ranges, packets=ar.contributions)
            running = getattr(self, "_verify_task", None)
            if running is not None and not running.done():
                log.debug("round %d: verified work skipped: the previous check is still running", r)
                return
            deadline = time.time() + max(1.0, wv.cfg.time_share * float(plan.window_s))
            self._verify_task = asyncio.ensure_future(wv.run_round(
                r, micro_batch=a.micro_batch, seconds_per_row=getattr(self.trainer, "_row_time_ema", None),
                deadline=deadline, signed_of=lambda part, sender: verify.signed_contribution(
                    self.collective, r, part, sender)))
            self._verify_task.add_done_callback(
                lambda t: t.cancelled() or t.exception() is None or log.warning(
                    "round %d: verified work failed: %s", r, t.exception()))
        except Exception as e:
            log.warning("round %d: verified work skipped: %s", r, e)

    def _verified_plan_problem(self, plan) -> Optional[str]:
        """Why this peer refuses ``plan`` for verified work's sake (an excluded peer that leads would plan
        itself back in): :meth:`geomesh_p2p.verify.WorkVerifier.plan_problem`. None: no objection."""
        wv = getattr(self, "_work_verifier", None)
        return None if wv is None else wv.plan_problem(plan, me=self.me)

    def _verified_members(self, members):
        """The planner's input without the peers that verified work excluded (their evidence re-checked
        here, :meth:`geomesh_p2p.verify.WorkVerifier.filter`); this peer itself always stays."""
        wv = getattr(self, "_work_verifier", None)
        return members if wv is None else wv.filter(members, keep=self.me)

    @staticmethod
    def _no_work(compute_s: float):
        """The InnerResult of a round in which this peer trained nothing usable (0 tokens: the
        collective gives its contribution no weight)."""
        from geomesh_p2p.training import InnerResult

        return InnerResult(steps_done=0, tokens=0, mean_loss=float("nan"), last_loss=float("nan"),
                           compute_s=max(0.0, compute_s), stopped_early=True)

    def _outer_step(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """Apply the outer step to ``self.theta`` / ``self.outer.buf``, except on collective parts
        whose aggregate has a non-finite value or whose new weights or optimizer state would not be
        finite: those keep their values from before the step (one WARNING line). Every honest peer
        holds the same weights, state and aggregate bytes, so every one skips the same parts and the
        digests stay equal. Parts: the plan's owner ranges, ``[start, end)`` elements of ``[P]``.

        ``idle``: ranges that aggregated no token (missing parts, rounds nobody trained in): weights and
        outer momentum stay as they were there (issue 14 #8: momentum alone must not move the model
        through rounds that trained nothing); one INFO line."""
        if idle:
            p = self.theta.numel()
            n_idle = sum(e - s for s, e in idle)
            log.info("round %d: %d of %d elements aggregated no token (%s); weights and outer momentum unchanged "
                     "there", r, n_idle, p, "the whole model" if n_idle >= p else f"{len(idle)} part(s)")
            if n_idle >= p:
                return
        ranges = [(start, end) for _, start, end in plan.owners()] or [(0, self.theta.numel())]
        bad_in = {(s, e) for s, e in ranges if not bool(torch.isfinite(aggregate[s:e]).all())}
        if bad_in:
            aggregate = aggregate.clone()
            for s, e in bad_in:
                aggregate[s:e] = 0.0
        theta0 = self.theta.clone()
        buf0 = None if self.outer.buf is None else self.outer.buf.clone()
        self.outer.step(self.theta, aggregate, round=r)
        buf, p = self.outer.buf, self.theta.numel()
        # Optimizer state is k consecutive [P] slices (Nesterov: momentum; AdamW: m then v).
        views = [(self.theta, theta0)] + ([] if buf is None or buf0 is None else [
            (buf[k * p:(k + 1) * p], buf0[k * p:(k + 1) * p]) for k in range(buf.numel() // p)])
        bad = sorted(bad_in | {(s, e) for s, e in ranges
                               if any(not bool(torch.isfinite(new[s:e]).all()) for new, _ in views)})
        for s, e in bad:
            for new, old in views:
                new[s:e] = old[s:e]
        for s, e in idle:
            for new, old in views:
                new[s:e] = old[s:e]
        if bad:
            log.warning("round %d: outer step skipped on %d of %d parts (%d of %d elements): %d with non-finite "
                        "aggregate values, %d where the step would overflow", r, len(bad), len(ranges),
                        sum(e - s for s, e in bad), p, len(bad_in), len(bad) - len(bad_in))

    @staticmethod
    def _delivered_rates(plan, ar) -> dict[str, float]:
        """peer_id -> tokens/s its contribution to this round supports: the tokens the owners took from
        it (its claim, capped to its plan budget; the most over the parts) over the compute seconds its
        plan predicted. The next leader plans no peer above ``planner.EVIDENCE_GROWTH`` x this. It bounds
        how fast a peer's planned rate can grow, not a claim made at the budget: telling work done from
        a claim is verified work's job (geomesh_p2p.verify)."""
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

    @staticmethod
    def _progress_printer(r: int, planned: int):
        """A live progress line for the inner steps, on a terminal only (logs stay clean)."""
        if not sys.stdout.isatty():
            return None

        def show(step: int, loss: float, tokens_per_s: float) -> None:
            sys.stdout.write(f"\r  round {r}: inner step {step}/{planned}  loss {loss:.3f}  "
                             f"{tokens_per_s:,.0f} tokens/s\x1b[K")
            sys.stdout.flush()
        return show

    def _update_throughput(self, micro_batch: int, result) -> None:
        """Re-profiling (beyond the paper's one-off profile): EMA of this round's measured tokens/s
        (the other micro-batch sizes are rescaled by the same ratio, capability.ThroughputEMA), growing
        at most ``capability.MAX_TPS_GROWTH_PER_UPDATE`` x per round."""
        from geomesh_p2p.capability import MAX_TPS_GROWTH_PER_UPDATE

        if result.compute_s > 0 and result.tokens > 0:
            # The start-up profile is a prior, taken alone and with other processes starting up; the
            # first measurement in the swarm replaces it (then the EMA smooths round-to-round noise).
            first = "tps" not in self._measured
            self._measured.add("tps")
            # A self-measured compute time is not evidence (a free rider can report ~0 s): the announced
            # figure grows at most MAX_TPS_GROWTH_PER_UPDATE x per round, first measurement included.
            self.ema.update(micro_batch, result.tokens, result.compute_s, alpha=1.0 if first else None,
                            max_growth=MAX_TPS_GROWTH_PER_UPDATE)

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
            current = self.ema.upload_bps if direction == "up" else self.ema.download_bps
            if current:
                rate = sample.nbytes / seconds
                rate = min(max(rate, current / c.link_step_ratio), current * c.link_step_ratio)
                seconds = sample.nbytes / rate
            first = direction not in self._measured  # the first real exchange replaces the probe's figure
            self._measured.add(direction)
            new = self.ema.update_link(sample.nbytes, seconds, direction, alpha=1.0 if first else None)
            log.debug("round %d: %sload %.1f Mbit/s measured (%d bytes in %.3fs), EMA %.1f Mbit/s", self.round - 1,
                      direction, sample.nbytes / seconds * 8e-6, sample.nbytes, seconds, new * 8e-6)

    async def _wait_for_round(self, r: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            recs = [x for x in await self.peers() if x.peer_id != self.me]
            if any(x.round >= r and x.weights_digest for x in recs):
                return
            await asyncio.sleep(0.2)

    async def _check_digest(self, r: int, participants: list[str], wait_s: float = 2.0) -> Optional[bool]:
        """Compare this peer's digest with the majority of the round's participants (waits briefly)."""
        from geomesh_p2p.round import digest_majority

        deadline = time.monotonic() + wait_s
        while True:
            # leaving peers count too: their last record carries the digest they ended the round with
            recs = [x for x in await self.peers(include_leaving=True) if x.peer_id in participants]
            majority, agree, total = digest_majority(recs, r)
            if total >= len(participants) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if majority is None or total <= 1:
            return None
        if majority != self.digest:
            log.error("round %d: my digest %s differs from the majority's %s (%d/%d); re-syncing",
                      r, self.digest[:8], majority[:8], agree, total)
            return False
        return True

    async def shutdown(self) -> None:
        """Checkpoint, stop tasks, server and channels. Safe to call twice."""
        if self.transport is None:
            return
        # Leaving is announced first (before the checkpoint, which takes seconds on a large model), so
        # the others plan their next round without this peer whatever the reason it stops.
        try:
            if getattr(self, "announcer", None) is not None and not self._leaving and getattr(self, "ema", None) is not None:
                self._leaving = True
                log.info("announcing that this peer leaves")
                await self.announce()
        except Exception as e:  # the DHT may be gone already; the record expires on its own
            log.warning("could not announce that this peer leaves: %s", e)
        path = await self._checkpoint_or_warn() if self.outer is not None else None
        if path:
            log.info("checkpoint written: %s (round %d)", path, self.round)
        if self.cfg.summary_json:
            self.write_summary(self.cfg.summary_json)
        try:
            if getattr(self, "announcer", None) is not None:
                await self.announcer.stop()
            if getattr(self, "collective", None) is not None:
                await self.collective.close()
            if getattr(self, "dht", None) is not None:
                await self.dht.shutdown()
        finally:
            await self.transport.stop(grace=0.5)
            if getattr(self, "round_log", None) is not None:
                self.round_log.close()
            self.transport = None

    def summary(self) -> dict:
        h = self.history
        return {
            "peer_id": self.me,
            "rounds": len(h),
            "last_round": self.round,
            "initial_eval_ppl": self.initial_ppl,
            "final_eval_ppl": next((r.eval_ppl for r in reversed(h) if r.eval_ppl is not None), self.initial_ppl),
            "time_to_target_s": self.time_to_target,
            "straggler_idle_pct": (sum(r.straggler_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100) if h else 0.0,
            "network_idle_pct": (sum(r.network_idle_s for r in h) / max(1e-9, sum(r.round_s for r in h)) * 100) if h else 0.0,
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
                "probe": None if self.probe_result is None else {
                    "address": self.probe_result.address, "rtt_s": self.probe_result.rtt_s,
                    "upload_bps": self.probe_result.upload_bps, "download_bps": self.probe_result.download_bps},
            },
            "rows": [json.loads(r.to_json()) for r in h],
        }

    def write_summary(self, path: str) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        from geomesh_p2p.metrics import json_safe

        # strict JSON: an infinite perplexity (weights a hostile update blew up) is written as null
        tmp.write_text(json.dumps(json_safe(self.summary()), indent=1, allow_nan=False))
        os.replace(tmp, p)
