"""A peer on several local devices (issue 30, docs/multi-rank.md): where its ranks come from, and their lifecycle.

Two ways to start one peer of K ranks:

* ``geomesh-peer join --local-devices cuda:0,cuda:1 ...`` (or ``cpu,cpu``): this process is rank 0; it starts
  ranks 1..K-1 itself (:class:`LocalRanks`: ``python -c ...worker_main()`` with the rank's spec in the
  environment) and watches them;
* ``torchrun --nproc-per-node K $(which geomesh-peer) join ...``: torchrun starts K copies with ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (:func:`layout_from_env`); rank 0
  runs the node, the others :func:`run_follower`.

Rank 0 owns the identity, the DHT record, the round protocol, the exchange, state download, checkpoints and
digests; the followers hold a model and an inner optimizer and follow rank 0's commands
(:mod:`geomesh_p2p.model.ranks`). A rank that dies or a collective that fails ends the peer's round and the peer
leaves as on Ctrl+C (one ERROR line); a follower whose rank 0 died exits (self-started followers also watch
their parent process). No rank outlives the peer: :meth:`LocalRanks.close` tells them to exit, waits, then
kills.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.model.build import build_model
from geomesh_p2p.model.rank_channel import RankChannel, RankFailure, collective_timeout_s
from geomesh_p2p.model.rank_rounds import independent_ranks
from geomesh_p2p.model.ranks import NoData, RankedTrainer
from geomesh_p2p.node.training import trainer_kwargs
from geomesh_p2p.telemetry import events
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.util.exit_gc import arm_startup_freeze, freeze_startup_heap, skip_exit_collections

log = logging.getLogger("geomesh_p2p.node.ranks")

__all__ = [
    "RankLayout",
    "layout_from",
    "layout_from_env",
    "LocalRanks",
    "run_follower",
    "worker_main",
    "SPEC_ENV",
]

#: Environment variable that carries a self-started follower's spec (JSON of :class:`FollowerSpec`).
SPEC_ENV = "GEOMESH_RANK_SPEC"
#: Seconds a closing rank 0 waits for its followers to exit before it kills them.
EXIT_WAIT_S = 10.0


@dataclass(frozen=True)
class RankLayout:
    """Where this process stands among its peer's ranks: ``rank`` of ``world``, this rank's ``device``, the
    devices of every rank (``devices``; empty under torchrun, where each rank picks its own), the process
    group's ``init_method`` (``""``: rank 0 makes a rendezvous file when it starts them, :func:`_store_dir`) and whether rank 0 starts the
    others itself (``spawn``)."""

    rank: int
    world: int
    device: str
    devices: tuple[str, ...] = ()
    init_method: str = "env://"
    spawn: bool = False

    @property
    def device_share(self) -> int:
        """Ranks on this rank's device (CPU ranks share the machine's memory; ``cuda:0,cuda:0``: one GPU)."""
        if not self.devices:
            return self.world if self.device == "cpu" else 1
        return sum(1 for d in self.devices if d == self.device)


def _store_dir() -> str:
    """A fresh private folder for the self-started ranks' rendezvous file (``file://<dir>/store``).

    Why a file and not ``tcp://127.0.0.1:<a free port>``: a port found free is bound by rank 0's store only later,
    and anything on the machine may take it meanwhile (a test suite's gRPC servers and outgoing sockets did:
    rank 0 failed to bind within 2 s and its follower waited for the store until its timeout). A file in a
    folder nobody else knows cannot be taken, and the ranks share one machine anyway."""
    return tempfile.mkdtemp(prefix="geomesh-ranks-")


def _cuda_devices(devices: list[str]) -> list[str]:
    """``cuda`` entries numbered (the i-th ``cuda`` of the list is ``cuda:i``), checked against this machine.
    Raises ValueError naming ``--local-devices``."""
    if not devices or not devices[0].startswith("cuda"):
        return devices
    if not torch.cuda.is_available():
        raise ValueError(f"--local-devices {','.join(devices)}: CUDA is not available on this machine")
    out = [d if ":" in d else f"cuda:{i}" for i, d in enumerate(devices)]
    n = torch.cuda.device_count()
    bad = [d for d in out if int(d.split(":")[1]) >= n]
    if bad:
        raise ValueError(f"--local-devices: {bad[0]} does not exist (this machine has {n} CUDA device(s))")
    return out


def layout_from_env(env: Mapping[str, str], device: str = "auto") -> Optional[RankLayout]:
    """The layout torchrun gives (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``MASTER_ADDR``/``MASTER_PORT``
    read by ``env://``), None when absent or ``WORLD_SIZE`` is 1. Rank i trains on ``cuda:LOCAL_RANK``
    (``--device`` auto with CUDA, or cuda) or on the CPU. Raises ValueError for malformed variables or a
    ``--device cuda:N`` (every rank would use that one GPU)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r}: not integers") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} outside WORLD_SIZE={world}")
    if device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} under torchrun: every rank would train on that one GPU; use --device cuda "
            "(rank i takes cuda:LOCAL_RANK) or auto"
        )
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda under torchrun: CUDA is not available on this machine")
    return RankLayout(rank, world, f"cuda:{local}" if use_cuda else "cpu")


def layout_from(cfg: NodeConfig, env: Optional[Mapping[str, str]] = None) -> Optional[RankLayout]:
    """This process's rank layout from ``--local-devices``, ``--shard`` and the environment (torchrun), None for
    a one-device peer. Checked at start, before anything joins. Raises ValueError naming the flag:
    ``--shard`` on one rank (FSDP shards over >= 2), ``--local-devices`` with ``--device`` or under torchrun, a
    CUDA device this machine lacks, ``--shard`` with ``--rank-sync round``."""
    if cfg.shard and cfg.rank_sync == "round":
        raise ValueError(
            "--rank-sync round runs each rank's inner steps on a whole model of its own; --shard splits one model "
            "over the ranks: use one or the other"
        )
    env = os.environ if env is None else env
    under_torchrun = layout_from_env(env, cfg.device)
    if cfg.local_devices:
        if under_torchrun is not None:
            raise ValueError(
                "--local-devices under torchrun (RANK and WORLD_SIZE are set): torchrun starts the ranks "
                "itself; leave --local-devices out"
            )
        if cfg.device != "auto":
            raise ValueError(f"--local-devices sets each rank's device: leave --device at auto (it is {cfg.device})")
        devices = _cuda_devices(list(cfg.local_devices))
        return RankLayout(
            0, len(devices), devices[0], tuple(devices), "", True
        )  # the rendezvous file: LocalRanks.start
    if cfg.shard and under_torchrun is None:
        raise ValueError(
            "--shard shards the model over the ranks of a multi-rank peer and needs >= 2 ranks: add "
            "--local-devices DEV,DEV,... or run under torchrun --nproc-per-node K (K >= 2); a one-device peer "
            "holds the whole model anyway"
        )
    return under_torchrun


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower needs, from rank 0 (self-started) or from its own flags (torchrun)."""

    rank: int
    world: int
    device: str
    init_method: str
    timeout_s: float
    run: dict
    model_config_file: Optional[str]
    threads: Optional[int]
    speed_factor: float
    amp: bool
    parent_pid: Optional[int] = None
    #: the main group's backend ("nccl" / "gloo"; None: by the device)
    backend: Optional[str] = None


class LocalRanks:
    """Rank 0's side: the followers it started (none under torchrun), the :class:`RankChannel` and the watch.

    :meth:`start` starts the followers and forms the process groups; :meth:`attach` gives the node the channel
    and the failure callback; :meth:`watch` (a task in the node's loop) notices a follower that exited;
    :meth:`close` ends them all. Raises UserFacingError from :meth:`start` when the ranks do not form.
    """

    def __init__(
        self, layout: RankLayout, channel: RankChannel, procs: list[subprocess.Popen], store: Optional[str] = None
    ):
        self.layout, self.channel, self.procs = layout, channel, procs
        #: the self-started ranks' rendezvous folder (:func:`_store_dir`), removed by :meth:`close`
        self.store = store
        self._closing = False

    @classmethod
    def start(cls, run: RunConfig, cfg: NodeConfig, layout: RankLayout) -> "LocalRanks":
        """Start ranks 1..K-1 (``layout.spawn``) and join the process groups with them (blocks until they
        joined, at most :func:`collective_timeout_s` of the window). Raises UserFacingError."""
        timeout_s = collective_timeout_s(run.window_s)
        store = None if layout.init_method else _store_dir()  # self-started: a rendezvous file (_store_dir)
        init = layout.init_method or f"file://{store}/store"
        procs: list[subprocess.Popen] = []
        # NCCL refuses two ranks on one GPU ("duplicate GPU"): ranks sharing a device all-reduce with gloo.
        backend = "gloo" if len(set(layout.devices)) < len(layout.devices) else None
        if layout.spawn:
            env = dict(os.environ)
            # One machine: the ranks' sockets stay on the loopback interface.
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
            for r in range(1, layout.world):
                spec = FollowerSpec(
                    rank=r,
                    world=layout.world,
                    device=layout.devices[r],
                    init_method=init,
                    timeout_s=timeout_s,
                    run=run.model_dump(),
                    model_config_file=cfg.model_config_file,
                    threads=cfg.threads,
                    speed_factor=cfg.speed_factor,
                    amp=cfg.amp,
                    parent_pid=os.getpid(),
                    backend=backend,
                )
                env[SPEC_ENV] = json.dumps(asdict(spec))
                argv = [sys.executable, "-c", "from geomesh_p2p.node.ranks import worker_main; exit(worker_main())"]
                procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _nccl_raises()
        try:
            channel = RankChannel.init(0, layout.world, layout.device, init, timeout_s, backend=backend)
        except RankFailure as e:
            _end(procs, 0.0)
            _remove(store)
            raise UserFacingError(f"{e} (--local-devices / torchrun)") from None
        channel.start_keepalive()
        log.info(
            "this peer trains on %d ranks (%s; %s, torch.distributed %s, collective timeout %.0f s)",
            layout.world,
            ",".join(layout.devices) or f"torchrun, rank 0 on {layout.device}",
            "the model sharded over them (FSDP2, --shard)"
            if cfg.shard
            else "a whole model on each, each rank stepping alone and the ranks meeting once a round "
            f"(--rank-sync {cfg.rank_sync}), sharded (FSDP2, meeting every step) if one does not fit a rank"
            if independent_ranks(cfg.rank_sync, layout.device_share, False)
            else f"a whole model on each (DDP, meeting every step: --rank-sync {cfg.rank_sync}), sharded (FSDP2) if "
            "one does not fit a rank",
            backend or ("nccl" if layout.device.startswith("cuda") else "gloo"),
            timeout_s,
        )
        return cls(layout, channel, procs, store)

    def attach(self, node: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Give ``node`` (a PeerNode) the channel (``node.rank_channel``, read by its training build) and make a
        failure of the ranks stop it (one ERROR line, then ``node.request_stop`` on ``loop``)."""
        node.rank_channel = self.channel
        node.rank_device_share = self.layout.device_share

        def on_failure(reason: str) -> None:
            if self._closing:
                return
            events.emit(
                log,
                logging.ERROR,
                "ranks_failed",
                "this peer's ranks failed (%s): leaving the swarm as on Ctrl+C; restart it to rejoin",
                reason,
                peer=getattr(node, "me", None),
                reason=reason,
            )
            try:
                loop.call_soon_threadsafe(node.request_stop)
            except RuntimeError:  # the loop is closed: the node has stopped already
                pass

        self.channel.on_failure = on_failure

    async def watch(self, period_s: float = 0.5) -> None:
        """Until cancelled: a follower that exits while the peer runs breaks the channel (the ERROR line and the
        stop of :meth:`attach`)."""
        while self.procs:
            for r, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closing and self.channel.broken is None:
                    self.channel.fail(f"rank {r} (pid {p.pid}) exited", RuntimeError(f"exit status {code}"))
            await asyncio.sleep(period_s)

    def close(self) -> None:
        """End the ranks: EXIT to a healthy channel, leave the groups, wait up to :data:`EXIT_WAIT_S` for the
        followers, then kill what is left. Never raises; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        broken = self.channel.broken is not None
        self.channel.close()
        _end(self.procs, 0.0 if broken else EXIT_WAIT_S)
        _remove(self.store)


def _remove(folder: Optional[str]) -> None:
    """Remove the ranks' rendezvous folder (:func:`_store_dir`), if any. Never raises."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _end(procs: list[subprocess.Popen], wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``procs`` to exit, then SIGTERM, then SIGKILL (by PID)."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _nccl_raises() -> None:
    """On NCCL, a failed or timed-out collective raises in the calling thread after the communicators are
    aborted (mode 2, CleanUpOnly) instead of killing the process: rank 0 then leaves cleanly."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def _watch_parent(parent_pid: int, rank: int) -> None:
    """A daemon thread: when the process that started this follower is gone, exit at once (no orphan)."""

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                log.error("rank %d of this peer: rank 0 (pid %d) is gone; exiting", rank, parent_pid)
                os._exit(1)

    threading.Thread(target=loop, name="rank-parent-watch", daemon=True).start()


def run_follower(spec: FollowerSpec, build: Callable[..., torch.nn.Module] = build_model) -> int:
    """A follower rank: join the groups, wait for rank 0's SETUP, build the model and its trainer, follow the
    commands (:meth:`RankedTrainer.follow`). Returns the exit status: 0 after EXIT, 1 when rank 0 is gone."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.parent_pid is not None:
        _watch_parent(spec.parent_pid, spec.rank)
    _nccl_raises()
    try:
        channel = RankChannel.init(
            spec.rank, spec.world, spec.device, spec.init_method, spec.timeout_s, backend=spec.backend
        )
    except RankFailure as e:
        log.error("%s", e)
        return 1
    try:
        vocab = channel.wait_setup()  # keep-alives until rank 0 built its model
        if vocab is None:
            return 0
        run = RunConfig(**spec.run)
        model = build(
            run.model if not spec.model_config_file else None,
            config_file=spec.model_config_file,
            vocab_size=vocab,
            seed=run.seed,
        ).to(torch.device(spec.device))
        cfg = NodeConfig(speed_factor=spec.speed_factor, amp=spec.amp)
        trainer = RankedTrainer(
            model,
            NoData(vocab),
            channel=channel,
            shard=channel.setup_shard,  # rank 0's --shard, sent with SETUP (torchrun followers read no flag)
            device=spec.device,
            peer_id=f"rank{spec.rank}",
            **trainer_kwargs(run, cfg),
        )
        log.info(
            "rank %d of %d on %s: following rank 0%s",
            spec.rank,
            spec.world,
            spec.device,
            ", the model sharded (FSDP2)" if channel.setup_shard else "",
        )
        # as rank 0 once its model is built (PeerNode.start): the steps' full collections skip the start's objects
        # (a pass over them holds every rank's step, the all-reduce waits for the slowest); when armed only
        freeze_startup_heap()
        return trainer.follow()
    except RankFailure as e:
        channel.broken = str(e)
        log.error("%s; exiting", e)
        return 1
    finally:
        channel.close(exit_followers=False)


def follower_spec_from_flags(run: RunConfig, cfg: NodeConfig, layout: RankLayout) -> FollowerSpec:
    """A torchrun follower's spec from its own ``join`` flags (every rank gets the same command line)."""
    return FollowerSpec(
        rank=layout.rank,
        world=layout.world,
        device=layout.device,
        init_method=layout.init_method,
        timeout_s=collective_timeout_s(run.window_s),
        run=run.model_dump(),
        model_config_file=cfg.model_config_file,
        threads=cfg.threads,
        speed_factor=cfg.speed_factor,
        amp=cfg.amp,
    )


def worker_main() -> int:
    """Entry of a follower started by :class:`LocalRanks` (its spec in :data:`SPEC_ENV`). Returns the exit status."""
    # as rank 0's geomesh-peer: no full GC passes over torch's and transformers' objects at exit, which rank 0's
    # close() waits for (docs/exit-lag.md: 6-7 s at load 13, up to EXIT_WAIT_S and a SIGTERM under more)
    skip_exit_collections()
    arm_startup_freeze()  # always its own process (started by LocalRanks), never a test's
    spec = FollowerSpec(**json.loads(os.environ[SPEC_ENV]))
    # Ctrl+C in a terminal reaches every process of the group: rank 0 alone decides (it finishes its round's
    # exchange, which needs no follower, then tells them to exit); a follower never outlives it (_watch_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname).1s rank{spec.rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return run_follower(spec)
    except KeyboardInterrupt:  # Ctrl+C reaches the whole process group: rank 0 ends the peer
        return 130
