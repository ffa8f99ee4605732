"""One peer on several local devices (issue 30): the inner steps of rank 0's plan run on K ranks with
torch.distributed (DDP, or FSDP2 with ``--shard``; NCCL on CUDA, gloo on CPU), rank 0 alone speaks to the swarm.

Rank 0 drives, ranks 1..K-1 follow (:meth:`RankedTrainer.follow`). Two process groups:

* the **command channel** (always gloo, CPU tensors): rank 0 broadcasts a :class:`Command` (8 float64), then
  the command's payload when it has one (the step's token batch; a STEP's broadcasts are not waited for: rank 0
  goes on with its rows, :meth:`RankChannel.send`). Idle, rank 0 sends a ``PING`` every
  :data:`PING_PERIOD_S` seconds, so a follower's wait never reaches the collective timeout and a follower
  sees rank 0's death (a closed connection) within a period;
* the **main group** (NCCL on CUDA, gloo on CPU): DDP's gradient all-reduce (on a CPU one bucket, one
  all-reduce per step: :func:`ddp_bucket_cap_mb`), the step's loss, and the
  broadcast of rank 0's weights (:data:`WEIGHTS`) before every run of inner steps.

One step of global batch ``B`` (the plan's ``batch_size``, ``micro_batch`` rows per forward pass for the
whole peer): rank 0 samples the batch as a single-device peer would
(:meth:`~geomesh_p2p.data.TokenDataset.sample_batch`) and broadcasts it; each micro-batch of ``micro``
rows is split over the ranks by :func:`split_rows`, rank ``r``'s loss is weighted by ``rows_r / B x K``
(DDP averages over the K ranks), so the all-reduced gradient is exactly the whole batch's mean gradient:
what a one-device peer computes, what verified work re-computes. Every rank then clips and steps its own
inner optimizer on the same gradient, so the inner optimizer states stay identical and the pseudo-gradient
is rank 0's. A failed collective (a rank died, a timeout) ends the run with the steps completed so far
(:class:`RankFailure` inside, a result of those steps outside) and calls ``on_failure`` once: the node
then leaves as on Ctrl+C.

Sharded (``--shard``, :func:`shard_model`): every rank holds a torch FSDP2 (``fully_shard``) copy of the model,
each parameter split on dim 0 over the ranks, and an AdamW over those shards, so gradients and optimizer state
are ``1/K`` per rank. Rank 0 also keeps the whole model (``trainer.model``: the node loads the global weights
into it, evaluates it and reads the pseudo-gradient from it). Before each run of inner steps :data:`WEIGHTS`
loads it into the shards (``set_model_state_dict``, broadcast from rank 0); after the run :data:`GATHER` puts
the trained shards back into it (``get_model_state_dict``, full and offloaded to rank 0's CPU). Gradients are
reduce-scattered after every micro-batch (they stay sharded), so the pseudo-gradient equals DDP's up to float
rounding (the reduction order and the clip's norm), not bit for bit.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import time
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from geomesh_p2p.model.rank_channel import (
    EXIT,
    GATHER,
    RUN,
    SETUP,
    STEP,
    WEIGHTS,
    Command,
    RankChannel,
    RankFailure,
    one_line,
    split_rows,
)
from geomesh_p2p.model.rank_rounds import follow_run, run_independent
from geomesh_p2p.model.training import InnerResult, InnerTrainer


# DDP's "no buffer sync per forward" flag: ``forward_sync_buffers`` from torch 2.13 (``broadcast_buffers`` is
# deprecated there), ``broadcast_buffers`` before (torch 2.11 refused the new name on a lent H200).
_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def load_sharding_modules() -> None:
    """Make sure FSDP2, DTensor and distributed checkpointing are imported before a multi-rank peer measures its
    memory in use for the sharding decision (:func:`geomesh_p2p.node.training.choose_rank_training`), so their
    memory counts as in use, not as the first step's growth. They are imported with this module today (an attempt
    to import them lazily, for a faster start of one-device peers, slowed the sharded e2e's steps in session 14 and
    was reverted); this keeps the decision right if that changes."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


log = logging.getLogger(__name__)

__all__ = ["RankedTrainer", "NoData", "shard_model", "ddp_bucket_cap_mb", "load_sharding_modules"]


def ddp_bucket_cap_mb(model: torch.nn.Module, device: torch.device) -> Optional[int]:
    """DDP's bucket size (MiB) for ``model`` on ``device``: None (torch's default, 25 MiB buckets with a first of
    1 MiB, all-reduced while the backward pass runs) on CUDA, where NCCL's all-reduce overlaps the backward pass
    on its own stream; on a CPU one bucket that holds every gradient (its bytes rounded up, plus 1 MiB), so a step
    has one gradient all-reduce, after the last micro-batch's backward pass. CPU ranks use every core for their
    forward and backward passes, which gloo's threads overlapping them can only compete with (one meeting of the
    ranks per step, not one per bucket; no gain was measurable on a shared 2-core machine, docs/multi-rank.md
    "Measured"). Every rank's gradient is the same sum either way (for 2 ranks bit for bit the same: each element
    is ``g0 / 2 + g1 / 2``). ``model``'s parameters are counted at their element size (bytes)."""
    if device.type == "cuda":
        return None
    return math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20) + 1


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard ``model`` in place with torch FSDP2 over ``mesh`` (all the peer's ranks) and return it: each block of
    its outermost ``nn.ModuleList`` (a transformer's layers: GPT-2's ``transformer.h``, LLaMA's ``model.layers``)
    is one unit, gathered for its forward and backward only, and the rest (embeddings, tied head, final norm) is
    the root unit. Every parameter becomes a DTensor split on dim 0 over the ranks (fp32, the model's device).
    A collective-free call; every rank calls it on an identically built model."""
    blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), None)
    for block in blocks if blocks is not None else ():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class RankedTrainer(InnerTrainer):
    """An :class:`InnerTrainer` whose steps run on all of a peer's ranks (DDP, or FSDP2 with ``shard``). Same
    arguments, plus ``channel`` (this rank's :class:`RankChannel`) and ``shard``. Rank 0's is the node's trainer
    (its ``run`` and ``gradient`` drive the followers); a follower's runs :meth:`follow`. Build it on every rank
    at the same time: rank 0 first sends :data:`SETUP` (``vocab_size`` and ``shard``: a follower passes
    :attr:`RankChannel.setup_shard`), then every rank wraps the model in DDP (a collective that also copies rank
    0's weights) or shards it (:func:`shard_model`; weights come with each run's :data:`WEIGHTS`), then waits at a
    barrier for the others' shards, so rank 0 joins no round before every rank can train.

    ``shard``: rank 0 keeps ``model`` whole (the node's view) and trains a sharded copy (:attr:`sharded`); a
    follower shards ``model`` itself (it never needs it whole). The inner optimizer then steps the shards, so its
    state is sharded too. Raises ValueError for ``shard`` with one rank, RankFailure when a follower fails before the
    barrier."""

    flat_grads = False  # DDP/FSDP own the gradients' layout

    def __init__(
        self, model, dataset, *, channel: RankChannel, shard: bool = False, independent: bool = False, **kwargs
    ):
        if shard and channel.world < 2:
            raise ValueError(f"shard needs >= 2 ranks, this peer has {channel.world}")
        if shard and independent:
            raise ValueError("independent ranks (--rank-sync round) each train a whole model: not with shard")
        #: rank 0, ``--rank-sync round``: each run's steps run on every rank alone, the ranks meet at its end
        self.independent = bool(independent)
        #: this rank's rows of the running independent run, int64 ``[H, b, seq_len]`` (None otherwise)
        self._local_rows: Optional[torch.Tensor] = None
        #: rank 0, independent runs: each rank's measured tokens/s (an EMA over runs), what the next run's rows
        #: per rank follow (:func:`~geomesh_p2p.model.rank_rounds.rank_split`); None until a run measured them
        self.rank_speeds: Optional[list[float]] = None
        super().__init__(model, dataset, **kwargs)
        self.channel = channel
        if channel.rank == 0:
            channel.send(Command(SETUP, step=int(shard), arg=int(getattr(model.config, "vocab_size", 0) or 0)))
        dev = self.device
        self.ddp: Optional[DistributedDataParallel] = None
        #: the FSDP2 model this rank trains (``shard``), None under DDP; a follower's is ``self.model``
        self.sharded: Optional[torch.nn.Module] = None
        if shard:
            mesh = DeviceMesh.from_group(channel.main, dev.type)
            names = [n for n, _ in self.model.named_parameters()]
            self.sharded = shard_model(self.model if channel.rank else copy.deepcopy(self.model), mesh)
            if [n for n, _ in self.sharded.named_parameters()] != names:  # the gather relies on one order
                raise RuntimeError("sharding changed the model's parameters")
            self.optimizer = self._build_optimizer(self.sharded)  # its state is created sharded at the first step
            # fully_shard is no collective (DDP's constructor is): without this rank 0 announced and was planned
            # while a follower still built its model (6 s on a loaded CPU), and its first rounds trained nothing.
            try:
                dist.barrier(group=channel.main)
            except RuntimeError as e:
                raise channel.fail("the other ranks did not build their sharded model", e) from None
        else:
            self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[dev.index if dev.index is not None else torch.cuda.current_device()]
                if dev.type == "cuda"
                else None,
                process_group=channel.main,
                # buffers (attention masks, rotary tables) are constants of the config: no sync per forward pass
                **_NO_BUFFER_SYNC,
                bucket_cap_mb=ddp_bucket_cap_mb(self.model, dev),
            )
        self._apply_step = True
        self._run_losses: list[float] = []

    def _trained_parameters(self):
        return (self.sharded if self.sharded is not None else self.model).parameters()

    # -- rank 0 ---------------------------------------------------------------------------------------
    def run(self, **kwargs) -> InnerResult:
        """:meth:`InnerTrainer.run` on all ranks (rank 0's weights broadcast first; sharded: loaded into the shards
        first and the trained shards gathered into ``self.model`` after). When a collective fails the steps done
        so far are returned (``stopped_early``) and the channel's ``on_failure`` was called; on a broken channel
        no step is run. Sharded, a failure returns 0 steps and 0 tokens: the steps trained on the shards never
        reached ``self.model``, which keeps the round's start weights."""
        t0 = time.perf_counter()
        self._run_losses = []
        try:
            self._send_weights()
            if self.independent and self.sharded is None and kwargs.get("target") is None:
                # (a run with a StepTarget, eager updates, may change its steps while it runs: lockstep then). The
                # token floor's steps and grace go to every rank (session 46: the floor is S for every peer planned
                # S; without the grace the ranks stopped at the deadline and an honest peer at S - 1 lost its round)
                return run_independent(self, **{k: v for k, v in kwargs.items() if k != "target"})
            result = super().run(**kwargs)
            if self.sharded is not None:
                self._gather_weights()
            return result
        except RankFailure:
            self.optimizer.zero_grad(set_to_none=True)
            n = len(self._run_losses) if self.sharded is None else 0
            return InnerResult(
                steps_done=n,
                tokens=n * int(kwargs.get("batch_size", 0)) * self.seq_len,
                mean_loss=sum(self._run_losses) / n if n else float("nan"),
                last_loss=self._run_losses[-1] if n else float("nan"),
                compute_s=time.perf_counter() - t0,
                stopped_early=True,
            )

    def gradient(self, **kwargs) -> tuple[torch.Tensor, InnerResult]:
        """:meth:`InnerTrainer.gradient` on all ranks (the ddp baseline; sharded, the gradient's shards are
        gathered to rank 0). A failed collective gives a zero gradient of 0 tokens (``on_failure`` was called)."""
        t0 = time.perf_counter()
        self._apply_step = False
        try:
            self._send_weights()
            return super().gradient(**kwargs)
        except RankFailure:
            self.optimizer.zero_grad(set_to_none=True)
            zero = torch.zeros(sum(p.numel() for p in self.model.parameters()), dtype=torch.float32)
            return zero, InnerResult(0, 0, float("nan"), float("nan"), time.perf_counter() - t0, True)
        finally:
            self._apply_step = True

    def _send_weights(self) -> None:
        """Rank 0: ``self.model``'s weights to every rank (DDP: one flat broadcast; sharded: into the shards)."""
        if self.sharded is None:
            self.channel.broadcast_weights(self.model)
            return
        self.channel.send(Command(WEIGHTS))
        try:
            self._load_shards(self.model.state_dict())
        except RuntimeError as e:
            raise self.channel.fail("loading the weights into the ranks' shards failed", e) from None

    def _gather_weights(self) -> None:
        """Rank 0: the trained shards into ``self.model`` (a :data:`GATHER`; ``self.model`` is written only once
        every tensor arrived, so a failed gather leaves it as it was). Raises RankFailure."""
        self.channel.send(Command(GATHER))
        try:
            full = self._gather_shards()
        except RuntimeError as e:
            raise self.channel.fail("gathering the trained shards from the other ranks failed", e) from None
        self.model.load_state_dict(full)

    def _flat_grad(self) -> torch.Tensor:
        if self.sharded is None:
            return super()._flat_grad()
        try:
            return self._gather_grad()
        except RuntimeError as e:
            raise self.channel.fail("gathering the gradient's shards from the other ranks failed", e) from None

    def _step_batch(self, round: int, step: int, batch_size: int) -> torch.Tensor:
        if self._local_rows is not None:  # an independent run: this rank's rows of the peer's batch
            return self._local_rows[step]
        return super()._step_batch(round, step, batch_size)

    def accumulate_grad(self, batch: torch.Tensor, micro_batch: int | None = None) -> float:
        """Rank 0: send the STEP (and ``batch``) to the followers, then this rank's rows of it; returns the
        whole batch's mean loss (all-reduced: the same on every rank). Raises RankFailure."""
        if self._local_rows is not None:  # an independent run: this rank alone, no meeting per step
            return super().accumulate_grad(batch, micro_batch)
        ch = self.channel
        b = int(batch.shape[0])
        ch.send(
            Command(
                STEP,
                step=len(self._run_losses),
                batch_size=b,
                micro_batch=int(micro_batch or 0),
                seq_len=int(batch.shape[1]),
                lr=float(self.last_lr or self.lr),
                arg=int(self._apply_step),
            ),
            batch,
            wait=False,  # rank 0 goes on with its rows; the followers take the batch when they are ready
        )
        try:
            loss = self._shard_accumulate(batch, micro_batch)
        except RuntimeError as e:
            raise ch.fail("a training step of the peer's ranks failed", e) from None
        self._run_losses.append(loss)
        return loss

    # -- every rank -----------------------------------------------------------------------------------
    def _shard_accumulate(self, batch: torch.Tensor, micro_batch: int | None) -> float:
        """Forward/backward of this rank's rows of each micro-batch; returns the batch's mean loss summed over the
        ranks (one scalar all-reduce). DDP all-reduces the gradients at the last micro-batch; FSDP reduce-scatters
        after each one, so no rank ever holds a whole gradient."""
        ch = self.channel
        b = int(batch.shape[0])
        mb = b if not micro_batch or micro_batch >= b else int(micro_batch)
        n = -(-b // mb)
        total = 0.0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        module = self.sharded if self.sharded is not None else self.ddp
        assert module is not None
        for i in range(n):
            chunk = batch[i * mb : (i + 1) * mb]
            s, e = split_rows(int(chunk.shape[0]), ch.world, ch.rank)
            rows = e - s
            # A rank with no row of this micro-batch still joins the all-reduce: one row at weight 0.
            x = (chunk[s:e] if rows else chunk[:1]).to(self.device, non_blocking=True)
            sync = self.ddp.no_sync() if self.ddp is not None and i < n - 1 else nullcontext()
            with sync:
                with self._autocast():
                    loss = module(input_ids=x, labels=x).loss
                (loss * (rows / b * ch.world)).backward()
            total += loss.detach().float().item() * (rows / b)
        t = torch.tensor([total], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=ch.main)
        return float(t.item())

    def _load_shards(self, full: dict[str, Any]) -> None:
        """Sharded: rank 0's whole ``full`` state dict (``{}`` on a follower) into every rank's shards (a
        collective of the main group: rank 0 broadcasts tensor by tensor, each rank keeps its slice)."""
        assert self.sharded is not None
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        with torch.no_grad():
            set_model_state_dict(self.sharded, full, options=opts)

    def _gather_shards(self) -> dict[str, Any]:
        """Sharded: the whole trained weights, fp32 on rank 0's CPU (``{}`` on a follower); a collective."""
        assert self.sharded is not None
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.sharded, options=opts)

    @torch.no_grad()
    def _gather_grad(self) -> torch.Tensor:
        """Sharded: the accumulated gradient as fp32 CPU ``[P]`` in :func:`flat_params` order, whole on every rank
        (one all-gather per parameter; zeros where a parameter has no gradient); a collective."""
        assert self.sharded is not None
        parts = []
        for p in self.sharded.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            full = g.full_tensor() if isinstance(g, DTensor) else g
            parts.append(full.reshape(-1).to(device="cpu", dtype=torch.float32))
        return torch.cat(parts)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of the trained parameters, their gradients (0 when none is held) and the inner
        optimizer's state, counting local shards only: ``{"params", "grads", "optimizer"}``. Rank 0's whole
        ``self.model`` of a sharded trainer is not counted (it is the node's view, not trained)."""
        params = list(self._trained_parameters())

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        out = {"params": 0, "grads": 0, "optimizer": 0}
        for p in params:
            out["params"] += local(p).numel() * p.element_size()
            if p.grad is not None:
                out["grads"] += local(p.grad).numel() * p.grad.element_size()
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    out["optimizer"] += local(v).numel() * v.element_size()
        return out

    # -- followers ------------------------------------------------------------------------------------
    def follow(self) -> int:
        """A follower's loop: run rank 0's commands until :data:`EXIT` (returns 0) or until rank 0 is gone or
        a collective fails (one ERROR line, returns 1)."""
        ch = self.channel
        try:
            while True:
                cmd = ch.recv()
                if cmd.op == EXIT:
                    return 0
                if cmd.op == WEIGHTS:
                    if self.sharded is None:
                        ch.recv_weights(self.model)
                    else:
                        self._load_shards({})
                elif cmd.op == GATHER:
                    self._gather_shards()
                elif cmd.op == STEP:
                    self._follow_step(cmd, ch.recv_batch(cmd.batch_size, cmd.seq_len))
                elif cmd.op == RUN:
                    follow_run(self, cmd)
        except (RankFailure, RuntimeError) as e:
            ch.broken = one_line(e)  # close() then leaves the groups without a collective that could wait
            log.error("%s; exiting", ch.broken if isinstance(e, RankFailure) else f"rank {ch.rank}: {ch.broken}")
            return 1

    def _follow_step(self, cmd: Command, batch: torch.Tensor) -> None:
        """One STEP on a follower: the same gradient as rank 0, then (``arg`` 1) the same clip and step; (``arg``
        0, sharded) the gather of the gradient rank 0 reads."""
        for g in self.optimizer.param_groups:
            g["lr"] = cmd.lr
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._shard_accumulate(batch, cmd.micro_batch or None)
        finite = math.isfinite(loss)  # rank 0 raises FloatingPointError and steps (or gathers) nothing
        if cmd.arg and finite:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self._trained_parameters(), self.grad_clip)
            self.optimizer.step()
            self.global_step += 1
        elif not cmd.arg and finite and self.sharded is not None:
            self._gather_grad()
        self.optimizer.zero_grad(set_to_none=True)


class NoData:
    """The dataset a follower's trainer is built with: followers get their rows from rank 0, never sample.
    ``vocab_size``: the model's vocabulary (tokens)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def sample_batch(self, **_: Any) -> torch.Tensor:
        """Never called on a follower. Raises RuntimeError."""
        raise RuntimeError("a follower rank samples no data: its rows come from rank 0")
