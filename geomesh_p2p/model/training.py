"""Inner loop: a Hugging Face causal LM trained for H steps per round (DiLoCo inner phase).

The model is built by :mod:`geomesh_p2p.model.build`.

Inner optimizer defaults follow DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and
this project's pre-build measurements (DESIGN.md, "Measured before building"):
AdamW, lr 1e-3 for the tiny preset with H = 20, betas (0.9, 0.95), weight decay 0.1
(applied to matrices/embeddings only, not to biases or norm gains), linear warm-up then
cosine decay to ``min_lr_ratio * lr`` over the whole run, grad-norm clip 1.0. In a swarm the
schedule follows the swarm's progress (round and share of the round's plan,
:func:`swarm_lr_at`), not a peer's own step counter (issue 14 #8). Lion
(``lion_pytorch.Lion``, lr ~1e-4) is available but untuned: the design measured it far
worse (perplexity 208 vs 106.5).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from geomesh_p2p.model.build import load_flat_
from geomesh_p2p.model.device import free_after_oom, is_oom
from geomesh_p2p.model.grad_buffer import FlatGradBuffer
from geomesh_p2p.model.turns import Turns
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.telemetry import events

log = logging.getLogger(__name__)

__all__ = ["StepTarget", "InnerResult", "InnerTrainer", "lr_at", "swarm_lr_at", "DEFAULT_INNER", "perplexity"]


#: Inner-optimizer defaults per optimizer name (lr for the tiny preset).
DEFAULT_INNER: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1},
    "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1},
}


def lr_at(step: float, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate at global inner step ``step`` (0-based; a fractional step interpolates).

    Linear warm-up ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``, then
    cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``step = total_steps``, constant
    after that.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    t = min(1.0, max(0.0, (step - warmup_steps) / span))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


def swarm_lr_at(
    round: int,
    step: int,
    planned_steps: int,
    *,
    steps_per_round: int,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
) -> float:
    """Inner learning rate of inner step ``step`` (0-based) of round ``round`` for a peer planned
    ``planned_steps`` inner steps: a function of the swarm's progress only (issue 14 #8).

    Progress is measured in rounds, ``round + step / planned_steps`` (the round plus the share of this
    peer's plan done), and converted to the steps of a reference peer that trains ``steps_per_round``
    inner steps every round (the run config's ``uniform_inner_steps``), on which ``warmup_steps`` and
    ``total_steps`` are counted: ``lr_at((round + step / planned_steps) * steps_per_round, ...)``.

    Why rounds and not the swarm's tokens: the round is part of the global state every peer agrees on
    (the digest binds it, checkpoints store it, a joiner downloads it), so a peer that joined, resumed or
    was planned out for a while computes the same value as one that trained since round 0, with nothing
    more to carry; a token count would have to be summed from round records a joiner does not have. The
    share of the plan (not the count of steps) makes an AWB peer planned 40 steps and one planned 10
    follow the same curve through the round: neither decays sooner. With ``planned_steps ==
    steps_per_round`` and every step done, this is exactly the old per-peer schedule of a peer that
    trained since round 0.

    Raises:
        ValueError: ``steps_per_round < 1``, ``round < 0`` or ``step < 0``.
    """
    if steps_per_round < 1 or round < 0 or step < 0:
        raise ValueError(f"steps_per_round={steps_per_round} must be >= 1, round={round} and step={step} >= 0")
    # (round * H + k) * S / H rather than (round + k / H) * S: exact integers when H == S
    planned = max(1, int(planned_steps))
    ref_step = (round * planned + min(step, planned)) * steps_per_round / planned
    return lr_at(ref_step, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)


def perplexity(mean_loss: float) -> float:
    """``exp(mean_loss)`` (nats per token), or ``inf`` when that overflows (loss > ~709.78) or the
    loss is NaN / infinite: an undefined perplexity is reported as the worst one. Never raises."""
    if not math.isfinite(mean_loss):
        return math.inf
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


#: Clean accumulations at an out-of-memory cap before twice the cap is tried again (doubled after each try
#: that runs out of memory again): a moment of memory pressure must not cost the rest of the run.
OOM_RETRY_STEPS = 50


@dataclass
class InnerResult:
    """Outcome of one :meth:`InnerTrainer.run`.

    Attributes:
        steps_done: optimizer steps completed this round (<= ``inner_steps``).
        tokens: tokens actually trained on, ``steps_done * batch_size * seq_len``.
        mean_loss: mean over the completed steps of the batch's training loss (nats per
            token); NaN when no step was done.
        last_loss: training loss of the last completed step (NaN if none).
        compute_s: wall-clock seconds spent in the steps, including the emulated
            slow-down of ``speed_factor``; the basis for tokens/s re-profiling.
        stopped_early: True when the deadline or ``should_stop`` ended the round before
            ``inner_steps`` steps.
    """

    steps_done: int
    tokens: int
    mean_loss: float
    last_loss: float
    compute_s: float
    stopped_early: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.compute_s if self.compute_s > 0 else 0.0


class StepTarget:
    """The inner-step target and train deadline of a running :meth:`InnerTrainer.run`, changeable from
    another thread while it runs (eager updates: steps started speculatively before the round's plan
    exists take the plan's target and deadline once it is agreed, docs/eager.md). The loop reads both
    before every step; a target already reached ends it, unless the target is still **provisional**:
    then the loop waits (a condition wait, in the trainer's thread) for :meth:`set` or :meth:`release`,
    or for the deadline, and goes on with the target set (the plan may ask for more steps than the
    provisional count: without the wait they were lost, the peer idle until the plan came).

    Args:
        inner_steps: optimizer steps wanted (>= 0).
        deadline: swarm-time unix seconds after which no step starts (None: none).
        provisional: the target may still be raised (see above); :meth:`set` and :meth:`release` end that.
    """

    def __init__(self, inner_steps: int, deadline: float | None = None, *, provisional: bool = False):
        self._cond = threading.Condition()
        self._value: tuple[int, float | None] = (int(inner_steps), deadline)
        self._provisional = provisional
        #: seconds the loop waited at the provisional target (not compute), and the swarm time the current
        #: wait began (None: not waiting)
        self.waited_s = 0.0
        self.waiting_since: float | None = None

    def set(self, inner_steps: int, deadline: float | None) -> None:
        """Replace both (thread-safe) and make the target final (wakes a waiting loop); ``inner_steps`` < 0
        raises ValueError."""
        if inner_steps < 0:
            raise ValueError(f"inner_steps must be >= 0, got {inner_steps}")
        with self._cond:
            self._value = (int(inner_steps), deadline)
            self._provisional = False
            self._cond.notify_all()

    def release(self) -> None:
        """Make the target final as it is (wakes a waiting loop, which then ends): the steps are aborted."""
        with self._cond:
            self._provisional = False
            self._cond.notify_all()

    def get(self) -> tuple[int, float | None]:
        """``(inner_steps, deadline)`` as last set."""
        with self._cond:
            return self._value

    @property
    def provisional(self) -> bool:
        """True until :meth:`set` or :meth:`release`."""
        with self._cond:
            return self._provisional

    def wait_final(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds while the target is provisional; True when it is final. The
        time waited is added to :attr:`waited_s`."""
        t0 = time.perf_counter()
        with self._cond:
            if not self._provisional:
                return True
            self.waiting_since = swarm_time()
            try:
                return self._cond.wait_for(lambda: not self._provisional, timeout=max(0.0, timeout_s))
            finally:
                self.waiting_since = None
                self.waited_s += time.perf_counter() - t0


class InnerTrainer:
    """Runs the inner steps of a round on one peer.

    The inner optimizer is created once and its state (Adam moments, step counts) persists
    across rounds, as in DiLoCo: at the start of a round the caller loads the new global
    weights with :func:`load_flat_` and calls :meth:`run`; only the weights are reset,
    not the optimizer. With ``steps_per_round`` (a node in a swarm) the learning rate of step
    ``k`` of :meth:`run` is :func:`swarm_lr_at` of the round and the share ``k / inner_steps`` of the
    plan: the same for every peer of a round whatever its own step count, and after a join or a resume
    (the round is in the downloaded state and in checkpoints; nothing else is needed). Without it
    (the simulator, single-process tools) it follows :attr:`global_step`, the number of inner steps
    this trainer has taken (:func:`lr_at`).

    Args:
        model: a causal LM from :func:`build_model`; moved to ``device``.
        dataset: a :class:`~geomesh_p2p.data.TokenDataset`.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        seq_len: tokens per training row (<= the model's context).
        optimizer: ``"adamw"`` (torch.optim.AdamW, betas (0.9, 0.95)) or ``"lion"``
            (``lion_pytorch.Lion``, betas (0.9, 0.99)).
        lr, weight_decay: peak learning rate and decoupled weight decay; ``None`` takes
            :data:`DEFAULT_INNER`. Weight decay applies to tensors with ``ndim >= 2``.
        warmup_steps, total_steps: schedule over global inner steps (:func:`lr_at`); with
            ``steps_per_round``, over the steps of a reference peer training that many per round.
        steps_per_round: the swarm schedule's unit (the run config's ``uniform_inner_steps``);
            None: the schedule follows this trainer's own :attr:`global_step`.
        grad_clip: max global grad norm (``<= 0`` disables).
        seed, peer_id: with the round and step, pick the training batches
            (:meth:`TokenDataset.sample_batch`).
        speed_factor: ``f < 1`` emulates a slower device: after each step the trainer
            sleeps ``(1/f - 1)`` times the step's compute time, so a step takes ``1/f``
            as long. ``f >= 1`` does nothing.
        amp: bf16 autocast for the forward pass, on CUDA only (ignored on CPU).
        min_lr_ratio: final lr as a fraction of ``lr``.
    """

    #: gradients in one reused CPU buffer (:class:`FlatGradBuffer`); off where another layout owns them (ranks)
    flat_grads = True

    def __init__(
        self,
        model,
        dataset,
        *,
        device: str | torch.device = "cpu",
        seq_len: int,
        optimizer: str = "adamw",
        lr: float | None = None,
        weight_decay: float | None = None,
        warmup_steps: int = 0,
        total_steps: int = 1000,
        grad_clip: float = 1.0,
        seed: int = 0,
        peer_id: str = "peer",
        speed_factor: float = 1.0,
        amp: bool = False,
        min_lr_ratio: float = 0.1,
        steps_per_round: int | None = None,
    ):
        if optimizer not in DEFAULT_INNER:
            raise ValueError(f"unknown inner optimizer {optimizer!r} (use 'adamw' or 'lion')")
        if speed_factor <= 0:
            raise ValueError(f"speed_factor must be > 0, got {speed_factor}")
        ctx = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
        if ctx is not None and seq_len > ctx:
            raise ValueError(f"seq_len {seq_len} exceeds the model context {ctx}")
        mv = getattr(model.config, "vocab_size", None)
        dv = getattr(dataset, "vocab_size", None)
        if mv is not None and dv is not None and dv > mv:
            raise ValueError(
                f"dataset vocabulary ({dv}) is larger than the model's ({mv}); "
                "build the model with vocab_size=dataset.vocab_size"
            )
        self.device = torch.device(device)
        self.model = model.to(self.device)
        #: the largest micro-batch (sequences) that ran without running out of memory, once one did (None:
        #: never); planned micro-batches are capped to it, and the node announces it as its max batch
        self.max_micro_batch: int | None = None
        self._largest_micro = 1  # the largest micro-batch asked for (where a raised cap stops)
        self._cap_clean_steps, self._cap_retry_after, self._cap_probing = 0, OOM_RETRY_STEPS, False
        self.model.train()
        self.dataset = dataset
        self.seq_len = int(seq_len)
        defaults = DEFAULT_INNER[optimizer]
        self.optimizer_name = optimizer
        self.lr = float(defaults["lr"] if lr is None else lr)
        self.weight_decay = float(defaults["weight_decay"] if weight_decay is None else weight_decay)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        if steps_per_round is not None and steps_per_round < 1:
            raise ValueError(f"steps_per_round must be >= 1, got {steps_per_round}")
        self.steps_per_round = None if steps_per_round is None else int(steps_per_round)
        self.last_lr: float | None = None  # learning rate of the last inner step (rows, tests)
        self.grad_clip = float(grad_clip)
        self.seed = int(seed)
        self.peer_id = str(peer_id)
        self.speed_factor = float(speed_factor)
        self.amp = bool(amp) and self.device.type == "cuda"
        self.global_step = 0
        self._row_time_ema: float | None = None  # seconds per batch row, for the deadline

        self.optimizer = self._build_optimizer(self.model)
        # the gradients, then the round's pseudo-gradient, in one reused [P] (CPU fp32); turns with verified work's
        self.grads, self.turns = FlatGradBuffer(list(self.model.parameters()), enabled=self.flat_grads), Turns()

    # -- pieces ---------------------------------------------------------------------

    def _build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The inner optimizer over ``module``'s trainable parameters (weight decay on tensors with ``ndim >=
        2``; a sharded DTensor reports its global ndim). Raises ImportError for ``lion`` without lion-pytorch."""
        defaults = DEFAULT_INNER[self.optimizer_name]
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _, p in module.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr, betas=defaults["betas"], eps=1e-8)
        try:
            from lion_pytorch import Lion
        except ImportError:
            raise ImportError("optimizer='lion' needs lion-pytorch (pip install lion-pytorch)") from None
        return Lion(groups, lr=self.lr, betas=defaults["betas"])

    def update_buffer(self) -> torch.Tensor | None:
        """fp32 CPU ``[P]`` for the pseudo-gradient after the steps: the gradients' (FlatGradBuffer), or None."""
        return self.grads.take()

    def _trained_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters the inner optimizer steps (and the gradient clip sees): the model's here; a sharded
        multi-rank trainer's shards (:class:`geomesh_p2p.model.ranks.RankedTrainer`)."""
        return self.model.parameters()

    def _flat_grad(self) -> torch.Tensor:
        """The accumulated gradient as fp32 CPU ``[P]`` in :func:`flat_params` order (zeros where a parameter has
        no gradient)."""
        with torch.no_grad():
            return torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p))
                    .detach()
                    .reshape(-1)
                    .to(device="cpu", dtype=torch.float32)
                    for _, p in self.model.named_parameters()
                ]
            )

    def _autocast(self):
        if self.amp:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return nullcontext()

    def accumulate_grad(self, batch: torch.Tensor, micro_batch: int | None = None) -> float:
        """Forward/backward one batch (int64 ``[B, seq_len]``) into ``.grad``.

        Splits it into micro-batches of ``micro_batch`` rows (the last may be smaller), scaling each micro-batch
        loss by ``rows / B`` so the accumulated gradient equals that of the whole batch. Does not zero gradients
        or step. Returns the batch's mean loss (nats per predicted token)."""
        b = batch.shape[0]
        mb = b if not micro_batch or micro_batch >= b else int(micro_batch)
        total = 0.0
        for i in range(0, b, mb):
            x = batch[i : i + mb].to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.model(input_ids=x, labels=x).loss
            (loss * (x.shape[0] / b)).backward()
            total += loss.detach().float().item() * (x.shape[0] / b)
        return total

    def accumulate_fitting(self, batch: torch.Tensor, micro_batch: int | None = None) -> float:
        """:meth:`accumulate_grad` that treats running out of memory as a condition (issue 27): on a CUDA or
        CPU out-of-memory error the gradients are dropped, the device's cache freed, and the same batch is
        accumulated again at half the micro-batch, down to 1 (the batch, and so the data, is unchanged;
        only the accumulation splits it finer). Each halving logs one WARNING (event ``out_of_memory``) and
        lowers :attr:`max_micro_batch`, which caps later steps and the node's announced max batch, so the
        leader plans within it from the next record on. A micro-batch already capped is used at once.
        Memory pressure passes (another job on the GPU ends): after :data:`OOM_RETRY_STEPS` clean
        accumulations at the cap it is doubled again (one INFO line), the wait doubling each time the larger
        micro-batch runs out of memory again, and dropped once it covers every micro-batch asked for.

        Raises:
            MemoryError: still out of memory at micro-batch 1 (gradients dropped); the caller contributes
                the steps done so far."""
        b = batch.shape[0]
        mb = b if not micro_batch or micro_batch >= b else int(micro_batch)
        self._largest_micro = max(self._largest_micro, mb)
        if self.max_micro_batch is not None:
            mb = min(mb, self.max_micro_batch)
        while True:
            try:
                loss = self.accumulate_grad(batch, mb)
                self._after_fitting_step()
                return loss
            except (RuntimeError, MemoryError) as e:
                if not is_oom(e):
                    raise
                self.grads.drop(self.optimizer)  # and the buffer: no second [P] beside the retry's (red team 39)
                free_after_oom(self.device)
                if mb <= 1:
                    raise MemoryError(f"out of memory at micro-batch 1 on {self.device}") from None
                new = max(1, mb // 2)
                events.emit(
                    log,
                    logging.WARNING,
                    "out_of_memory",
                    "out of memory at micro-batch %d on %s (%s); continuing at %d, this peer's max batch from its "
                    "next record",
                    mb,
                    self.device,
                    type(e).__name__,
                    new,
                    peer=self.peer_id,
                    micro_batch=mb,
                    new_micro_batch=new,
                )
                if self._cap_probing:  # the raised cap did not fit yet: wait twice as long before the next try
                    self._cap_retry_after *= 2
                self._cap_probing = False
                self._cap_clean_steps = 0
                self.max_micro_batch = mb = new

    def _after_fitting_step(self) -> None:
        """One clean accumulation under an OOM cap: past the wait, try twice the cap (or drop it)."""
        if self.max_micro_batch is None:
            return
        self._cap_clean_steps += 1
        if self._cap_clean_steps < self._cap_retry_after:
            return
        self._cap_clean_steps = 0
        raised = self.max_micro_batch * 2
        self._cap_probing = True
        if raised >= self._largest_micro:
            self.max_micro_batch = None  # covers every micro-batch asked for: no cap (it returns if needed)
        else:
            self.max_micro_batch = raised
        log.info("no out of memory for %d steps: trying micro-batch %d again", self._cap_retry_after, raised)

    def _step_batch(self, round: int, step: int, batch_size: int) -> torch.Tensor:
        """The int64 ``[batch_size, seq_len]`` rows of inner step ``step`` of ``round``: the dataset's pure
        function of (seed, peer, round, step), which verified work re-computes. A multi-rank peer's ranks that
        step independently take their share of the peer's rows instead (:mod:`geomesh_p2p.model.rank_rounds`)."""
        return self.dataset.sample_batch(
            seed=self.seed, peer_id=self.peer_id, round=round, step=step, batch_size=batch_size, seq_len=self.seq_len
        )

    def lr_for(self, round: int, step: int, planned_steps: int) -> float:
        """Learning rate of step ``step`` (0-based) of a round planned ``planned_steps`` inner steps:
        :func:`swarm_lr_at` with ``steps_per_round``, else :func:`lr_at` of :attr:`global_step`."""
        if self.steps_per_round is not None:
            return swarm_lr_at(
                round,
                step,
                planned_steps,
                steps_per_round=self.steps_per_round,
                lr=self.lr,
                warmup_steps=self.warmup_steps,
                total_steps=self.total_steps,
                min_lr_ratio=self.min_lr_ratio,
            )
        return lr_at(
            self.global_step,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def _set_lr(self, round: int = 0, step: int = 0, planned_steps: int = 1) -> float:
        lr = self.lr_for(round, step, planned_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.last_lr = lr
        return lr

    # -- main loop ------------------------------------------------------------------

    def run(
        self,
        *,
        round: int,
        inner_steps: int,
        batch_size: int,
        micro_batch: int | None = None,
        deadline: float | None = None,
        progress: Callable[[int, float, float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        target: StepTarget | None = None,
        floor_steps: int = 0,
        floor_grace_s: float = 0.0,
    ) -> InnerResult:
        """Run up to ``inner_steps`` optimizer steps of ``batch_size`` rows each.

        ``floor_steps`` / ``floor_grace_s``: the first ``floor_steps`` steps may run until ``deadline +
        floor_grace_s`` (seconds) rather than ``deadline``: the token floor of a screened round (issue 28,
        :func:`geomesh_p2p.round.rules.spec.screen_token_floor`) counts a contribution of fewer steps as 0
        tokens, so a peer the deadline stops within them (a busy machine, a slow first step) trained for
        nothing; it finishes them a little late instead, and the owners (who wait for every established
        participant's push until the part deadline) take them.

        ``target``: a :class:`StepTarget` read before every step instead of ``inner_steps`` and
        ``deadline`` (which are then ignored): another thread may change both while the steps run
        (eager updates; the learning rate of a step uses the target read before it).

        Before each step the loop ends early (``stopped_early=True``) when
        ``should_stop()`` is true, when ``swarm_time() >= deadline`` (unix seconds, swarm time:
        :mod:`geomesh_p2p.net.swarm_time`; a plan's train deadline), or
        when the step would predictably end after the deadline (now + ``batch_size``
        times a running mean of the time per batch row, kept across rounds, emulated
        slow-down included). A step in progress is always
        finished; no partial step is applied. Step ``k`` (0-based within the round)
        trains on ``dataset.sample_batch(seed, peer_id, round, k, batch_size, seq_len)``,
        with gradient accumulation over ``micro_batch``-row slices when
        ``micro_batch < batch_size``. ``progress(k + 1, loss, tokens_per_s)`` is called
        after each step (tokens/s of that step, emulation included). The learning rate of
        step ``k`` is :meth:`lr_for` ``(round, k, inner_steps)``: ``inner_steps`` is the
        plan's, so a step cut by the deadline does not shift the schedule. The gradients are
        freed on return (``.grad`` is None) and, on CPU, the freed heap memory is returned to the OS
        (:func:`geomesh_p2p.model.memory.release_freed_memory`): the exchange that follows needs it.

        Raises:
            FloatingPointError: a non-finite training loss (weights are not updated).
        """
        if inner_steps < 0 or batch_size < 1:
            raise ValueError("inner_steps must be >= 0 and batch_size >= 1")
        self.model.train()
        if self.device.type == "cpu":  # what the exchange, outer step and digest freed since the last trim (s. 41)
            release_freed_memory()
        losses: list[float] = []
        stopped = False
        tokens_per_step = batch_size * self.seq_len
        t_start = time.perf_counter()
        k = -1
        while True:
            k += 1
            if target is not None:
                inner_steps, deadline = target.get()
                if k >= inner_steps and target.provisional and not (should_stop is not None and should_stop()):
                    # Reached a provisional target (eager: the previous round's count, before the plan): wait
                    # for the plan's, up to the deadline, instead of ending the steps short of it.
                    target.wait_final(float("inf") if deadline is None else deadline - swarm_time())
                    inner_steps, deadline = target.get()
            if k >= inner_steps:
                break
            if should_stop is not None and should_stop():
                stopped = True
                break
            with self.turns.step():  # no check pass of verified work beside a step (model/turns.py)
                # this step's deadline: the floor's steps may run a grace past it (see above)
                step_deadline = None if deadline is None else deadline + (floor_grace_s if k < floor_steps else 0.0)
                if step_deadline is not None:
                    now = swarm_time()
                    est = (self._row_time_ema or 0.0) * batch_size
                    # The round's first step is not skipped on the estimate alone (only past the deadline): it
                    # re-measures, so one stall (SIGSTOP, a suspend) cannot keep the peer at 0 steps for good.
                    if now >= step_deadline or (k > 0 and now + est > step_deadline):
                        stopped = True
                        break
                t0 = time.perf_counter()
                self._set_lr(round, k, inner_steps)
                batch = self._step_batch(round, k, batch_size)
                self.grads.zero(self.optimizer)
                try:
                    loss = self.accumulate_fitting(batch, micro_batch)
                except MemoryError as e:
                    # Not even one sequence fits now (the device's owner started something else): the steps
                    # done so far are contributed; the next round starts again at micro-batch 1.
                    events.emit(
                        log,
                        logging.WARNING,
                        "out_of_memory",
                        "round %d: %s; contributing the %d inner step(s) done",
                        round,
                        e,
                        len(losses),
                        peer=self.peer_id,
                        round=round,
                        micro_batch=1,
                    )
                    stopped = True
                    break
                if not math.isfinite(loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise FloatingPointError(
                        f"non-finite training loss {loss} at round {round} step {k} (global step {self.global_step})"
                    )
                self.grads.settle()  # before the clip: an unreached parameter's zeroed view is not in its norm
                if self.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self._trained_parameters(), self.grad_clip)
                self.optimizer.step()
                self.global_step += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            compute = time.perf_counter() - t0
            if self.speed_factor < 1.0:
                slow = compute * (1.0 / self.speed_factor - 1.0)
                if step_deadline is not None:
                    # Never past the step's deadline: a step the peer was stopped in (SIGSTOP, swap, a
                    # suspend) measures the stall as compute, and the emulated slow-down slept it again
                    # (tests/e2e/test_stalled_peer_procs.py: stopped 42 s, then 42 s asleep through its
                    # exchange). The steps end at the deadline anyway; a step that really computed past it
                    # still overruns by its compute.
                    slow = min(slow, max(0.0, step_deadline - swarm_time()))
                time.sleep(slow)
            dt = time.perf_counter() - t0
            per_row = dt / batch_size
            # A step at under half the estimate replaces it (the estimate was inflated by a stall).
            self._row_time_ema = (
                per_row
                if self._row_time_ema is None or per_row < 0.5 * self._row_time_ema
                else (0.7 * self._row_time_ema + 0.3 * per_row)
            )
            losses.append(loss)
            if progress is not None:
                progress(k + 1, loss, tokens_per_step / dt if dt > 0 else 0.0)
        # Time waiting at a provisional target is not compute (it would lower the re-profiled tokens/s).
        compute_s = time.perf_counter() - t_start - (target.waited_s if target is not None else 0.0)
        # The gradients ([P]) are not needed until the next round's first step (which zeroes them anyway):
        # freed here, the exchange's pseudo-gradient and aggregate buffers take their place (issue 13). glibc
        # keeps freed heap blocks (those under its mmap threshold) resident until a trim.
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cpu":
            release_freed_memory()
        n = len(losses)
        return InnerResult(
            steps_done=n,
            tokens=n * tokens_per_step,
            mean_loss=sum(losses) / n if n else float("nan"),
            last_loss=losses[-1] if n else float("nan"),
            compute_s=compute_s,
            stopped_early=stopped or n < inner_steps,
        )

    def gradient(
        self, *, round: int, batch_size: int, micro_batch: int | None = None
    ) -> tuple[torch.Tensor, InnerResult]:
        """The gradient of one batch at the current weights, for the ``ddp`` baseline (no step).

        Trains on ``dataset.sample_batch(seed, peer_id, round, 0, batch_size, seq_len)`` with
        gradient accumulation over ``micro_batch`` rows; the emulated slow-down applies. Returns
        ``(grad, result)``: ``grad`` an fp32 CPU ``[P]`` tensor in :func:`flat_params` order (zeros
        for parameters without a gradient), ``result`` an :class:`InnerResult` of one step.

        Raises:
            FloatingPointError: a non-finite loss.
            MemoryError: out of memory even at micro-batch 1 (:meth:`accumulate_fitting`).
        """
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model.train()
        t0 = time.perf_counter()
        batch = self.dataset.sample_batch(
            seed=self.seed, peer_id=self.peer_id, round=round, step=0, batch_size=batch_size, seq_len=self.seq_len
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate_fitting(batch, micro_batch)  # MemoryError at micro-batch 1: the caller's
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite training loss {loss} at round {round}")
        grad = self._flat_grad()
        self.optimizer.zero_grad(set_to_none=True)
        compute = time.perf_counter() - t0
        if self.speed_factor < 1.0:
            time.sleep(compute * (1.0 / self.speed_factor - 1.0))
        dt = time.perf_counter() - t0
        self.global_step += 1
        return grad, InnerResult(
            steps_done=1,
            tokens=batch_size * self.seq_len,
            mean_loss=loss,
            last_loss=loss,
            compute_s=dt,
            stopped_early=False,
        )

    def decay_mask(self) -> torch.Tensor:
        """fp32 CPU ``[P]`` of 0/1 in :func:`flat_params` order: 1 where the inner optimizer applies
        weight decay (tensors with ``ndim >= 2``), for :class:`geomesh_p2p.model.optim.SyncAdamW`."""
        return torch.cat(
            [torch.full((p.numel(),), 1.0 if p.ndim >= 2 else 0.0) for _, p in self.model.named_parameters()]
        )

    @torch.no_grad()
    def snapshot_for_eval(self, weights: torch.Tensor | None = None) -> None:
        """Copy the model's weights (the global weights, right after a round's commit) into a second model
        kept for evaluation, so :meth:`evaluate_snapshot` can run in a worker thread while the next round's
        inner steps change ``self.model`` (issue 17: evaluation off the round's critical path). The copy is
        made on the first call (one more set of weights and buffers in memory, on this trainer's device);
        later calls copy the parameters in place. Not thread-safe against a running
        :meth:`evaluate_snapshot`: the caller waits for that first.

        ``weights``: a flat fp32 ``[P]`` vector (layout of :func:`flat_params`) to evaluate instead of the
        model's weights (eager updates: the model then trains on other weights while the global ones are
        evaluated); the model is not read for its parameters then. Raises ValueError on a size mismatch."""
        if getattr(self, "_eval_model", None) is None:
            import copy

            self._eval_model = copy.deepcopy(self.model)
            self._eval_model.requires_grad_(False)
            if weights is None:
                return
        if weights is not None:
            load_flat_(self._eval_model, weights)
            return
        for dst, src in zip(self._eval_model.parameters(), self.model.parameters()):
            dst.copy_(src)

    def evaluate_snapshot(self, max_batches: int = 8, batch_size: int = 8) -> float:
        """:meth:`evaluate` on the weights :meth:`snapshot_for_eval` copied last (same batches, same value
        as :meth:`evaluate` on those weights). Raises RuntimeError before any snapshot."""
        m = getattr(self, "_eval_model", None)
        if m is None:
            raise RuntimeError("evaluate_snapshot before snapshot_for_eval")
        return self._evaluate_model(m, max_batches, batch_size)

    def evaluate(self, max_batches: int = 8, batch_size: int = 8) -> float:
        """Perplexity on the held-out split: ``exp`` of the mean next-token loss.

        Uses the first ``max_batches`` fixed batches of
        :meth:`TokenDataset.eval_batches` at this trainer's ``seq_len`` (each batch
        weighted by its rows), so repeated calls on the same weights give the same value.
        The model is put back in train mode afterwards. Weights that give a non-finite or huge
        loss (a hostile update can push them there) give ``inf`` (:func:`perplexity`) and one
        WARNING line, never an exception.
        """
        return self._evaluate_model(self.model, max_batches, batch_size)

    @torch.no_grad()
    def _evaluate_model(self, model, max_batches: int, batch_size: int) -> float:
        """:meth:`evaluate`'s body on ``model`` (the trainer's own, or the evaluation snapshot)."""
        was_training = model.training
        model.eval()
        rows_wanted = None if max_batches is None else max_batches * batch_size
        try:
            while True:
                try:
                    tot, rows = self._eval_rows(model, batch_size, rows_wanted)
                    break
                except (RuntimeError, MemoryError) as e:
                    # Out of memory is a condition (issue 27): the same rows again in smaller batches.
                    if not is_oom(e) or batch_size <= 1:
                        raise
                    free_after_oom(self.device)
                    log.warning(
                        "evaluation ran out of memory at batch %d; evaluating at %d", batch_size, batch_size // 2
                    )
                    batch_size //= 2
        finally:
            model.train(was_training)
        mean = tot / rows if rows else float("nan")
        ppl = perplexity(mean)
        if not math.isfinite(ppl):
            events.emit(
                log,
                logging.WARNING,
                "eval_not_finite",
                "eval loss is %s nats/token: reporting perplexity inf (the global weights are broken)",
                f"{mean:.4g}",
                peer=self.peer_id,
                loss=mean,
            )
        return ppl

    # -- persistence ------------------------------------------------------------------

    def _eval_rows(self, model, batch_size: int, rows_wanted: int | None) -> tuple[float, int]:
        """(sum of per-row mean losses, rows) over the first ``rows_wanted`` held-out windows (all: None) in
        batches of ``batch_size``: the same rows whatever the batch size."""
        tot, rows = 0.0, 0
        for x in self.dataset.eval_batches(self.seq_len, batch_size):
            if rows_wanted is not None and rows >= rows_wanted:
                break
            if rows_wanted is not None:
                x = x[: rows_wanted - rows]
            x = x.to(self.device)
            with self._autocast():
                loss = model(input_ids=x, labels=x).loss
            tot += loss.float().item() * x.shape[0]
            rows += x.shape[0]
        return tot, rows

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state and the global step (torch objects; save with torch.save
        or flatten; never sent over the wire)."""
        return {"optimizer": self.optimizer.state_dict(), "global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["global_step"])
