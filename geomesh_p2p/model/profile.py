"""The start-up profile: tokens/s per batch size and the largest batch that fits a memory budget.

DESIGN.md, "capability". A peer profiles itself at start-up (:func:`profile_training`; :func:`profile`,
shown by ``geomesh-peer profile``) and announces the result in its
:class:`~geomesh_p2p.schema.peer.PeerRecord`; during the run
:class:`~geomesh_p2p.model.capability.ThroughputEMA` folds each round's observations into it.

Units: bytes for memory, tokens/s for throughput, bytes/s for bandwidth, seconds for time.
Throughput is keyed by the batch size of one forward/backward pass (the micro-batch). Measurements
do not disturb a live model (:class:`~geomesh_p2p.model.device.MeasureSession`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from geomesh_p2p.model.build import build_model
from geomesh_p2p.model.device import (
    DeviceInfo,
    MeasureSession,
    ModelOrFactory,
    OptimizerFactory,
    detect_device,
    free_after_oom,
    is_oom,
    materialize,
    model_vocab_size,
    parse_device,
    timed_step,
)
from geomesh_p2p.model.memory import (
    DEFAULT_EXTRA_BYTES_PER_PARAM,
    SHIPPED_VOCAB_SIZE,
    MemoryEstimate,
    MemoryProbe,
    cuda_probe,
    rss_probe,
)
from geomesh_p2p.telemetry import events


def measure_throughput(
    model_factory: ModelOrFactory,
    seq_len: int,
    batch_sizes: Iterable[int],
    device: Union[str, torch.device, DeviceInfo],
    vocab_size: Optional[int] = None,
    steps: int = 3,
    warmup: int = 1,
    optimizer_factory: Optional[OptimizerFactory] = None,
    speed_factor: float = 1.0,
    seed: int = 0,
    amp: bool = False,
) -> dict[int, float]:
    """Training throughput in tokens/s for each batch size (sequences of ``seq_len`` tokens).

    Runs real steps (``model(input_ids=x, labels=x).loss``, backward, optimizer step; the model
    is a transformers causal LM) on random token ids in ``[0, vocab_size)``: ``warmup`` untimed,
    then ``steps`` timed; the result is ``batch * seq_len / median step time``. ``model_factory``
    is a module (moved to ``device``; its weights are untouched with the default lr=0 AdamW) or a
    callable building one. ``speed_factor`` f in (0, 1] emulates a slower device: after each step
    it sleeps so that the step takes 1/f as long. On an out-of-memory error the batch size and all
    larger ones are left out of the result. ``amp``: bf16 autocast for the forward pass on CUDA
    (as :class:`geomesh_p2p.model.training.InnerTrainer` trains there); ignored on CPU.

    Raises ValueError for ``seq_len < 1``, no/invalid batch sizes, ``steps < 1``, ``warmup < 0``,
    ``speed_factor`` outside (0, 1], or a missing vocab size.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes={sizes}: need at least one batch size, all >= 1")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    if not (0 < speed_factor <= 1):
        raise ValueError(f"speed_factor={speed_factor} must be in (0, 1]")
    dev = parse_device(device)
    model = materialize(model_factory, dev)
    vocab = model_vocab_size(model, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    result: dict[int, float] = {}
    with MeasureSession(model, dev, optimizer_factory, amp=amp) as sess:
        for b in sizes:
            x = torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev)
            times = []
            try:
                for i in range(warmup + steps):
                    dt = timed_step(sess, x, dev, speed_factor)
                    if i >= warmup:
                        times.append(dt)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                del x
                free_after_oom(dev)
                break
            result[b] = b * seq_len / statistics.median(times)
    return result


def remeasure_tps(
    model: torch.nn.Module,
    seq_len: int,
    batch: int,
    device: Union[str, torch.device],
    vocab_size: int,
    *,
    speed_factor: float = 1.0,
    amp: bool = False,
    budget_s: float = 10.0,
    seed: int = 0,
) -> float:
    """Tokens/s of one training step at ``batch`` sequences of ``seq_len`` tokens on the live ``model``: a
    warm-up step, then one timed step when the warm-up took under half of ``budget_s`` (seconds; else the
    warm-up's own time, the slower figure, stands). The weights stay bit-identical and the caller's RNG state
    untouched (:class:`MeasureSession`: lr=0 AdamW, forked RNG, gradients dropped after). The caller makes sure
    nothing else steps or loads ``model`` meanwhile. Worker thread: it blocks for one or two steps.

    Raises ValueError for ``seq_len``, ``batch`` or ``vocab_size`` < 1 or ``speed_factor`` outside (0, 1]; an
    out-of-memory error propagates (the batch was planned, so it fitted before).
    """
    if seq_len < 1 or batch < 1 or vocab_size < 1:
        raise ValueError(f"seq_len={seq_len}, batch={batch} and vocab_size={vocab_size} must be >= 1")
    if not (0 < speed_factor <= 1):
        raise ValueError(f"speed_factor={speed_factor} must be in (0, 1]")
    dev = parse_device(device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(dev)
    with MeasureSession(model, dev, None, amp=amp) as sess:
        dt = timed_step(sess, x, dev, speed_factor)
        if dt < budget_s / 2:
            dt = timed_step(sess, x, dev, speed_factor)
    return batch * seq_len / dt


@dataclass(frozen=True)
class TrainingProfile:
    """Result of :func:`profile_training`.

    Attributes:
        tokens_per_s: ``{batch: tokens/s}`` for the batch sizes measured (at least one).
        max_batch: largest batch whose predicted peak fits the budget (``>= 1``).
        memory: the fitted model of the peak (bytes): ``static_bytes`` = memory in use before the
            first step + gradients + optimizer state + ``extra_bytes``; ``per_sequence_bytes`` from
            the measured peaks.
        memory_bytes: the budget (bytes).
        peak_bytes: ``{batch: measured peak}`` (bytes) of each step measured, the memory step at
            batch 1 included.
        skipped: requested batch sizes not measured (over the budget, the time budget or
            ``max_sizes``).
        seconds: wall-clock duration of the profile.
    """

    tokens_per_s: dict[int, float]
    max_batch: int
    memory: MemoryEstimate
    memory_bytes: int
    peak_bytes: dict[int, int]
    skipped: list[int]
    seconds: float


class ProfileStopped(Exception):
    """:func:`profile_training` ended early: its ``should_stop`` said True (a stop was requested)."""


def profile_training(
    model: ModelOrFactory,
    seq_len: int,
    device: Union[str, torch.device, DeviceInfo],
    memory_bytes: int,
    *,
    vocab_size: Optional[int] = None,
    batch_sizes: Optional[Iterable[int]] = None,
    max_sizes: int = 3,
    steps: int = 2,
    warmup: int = 0,
    time_budget_s: float = 30.0,
    speed_factor: float = 1.0,
    amp: bool = False,
    limit: int = 256,
    extra_bytes: Optional[int] = None,
    optimizer_factory: Optional[OptimizerFactory] = None,
    memory_probe: Optional[MemoryProbe] = None,
    logger: Optional[Any] = None,
    should_stop: Optional[Callable[[], bool]] = None,
    state_bytes: Optional[int] = None,
) -> TrainingProfile:
    """Start-up profile within a memory budget: the largest batch that fits, and tokens/s per batch.

    Never runs a step whose predicted peak exceeds ``memory_bytes``. Order:

    1. Static check, before any step: memory in use now + ``state_bytes`` (what training adds to the
       model: default gradients (parameter bytes) + AdamW's two moments (2 x parameter bytes); a rank of a
       sharded peer counts its shard instead, :attr:`geomesh_p2p.model.run_memory.ShardChoice.state_bytes`)
       + ``extra_bytes`` (what the run holds besides: the node passes
       :meth:`geomesh_p2p.model.run_memory.RunMemory.profile_extra`, i.e. global weights, outer state,
       exchange buffers and verified work; default on CPU: ``8P`` bytes, the global weights and the
       outer momentum; 0 on CUDA, where those live in host memory) must fit, else ValueError.
    2. One step at batch 1 under ``memory_probe`` (CPU: :func:`rss_probe`, the process's RSS; CUDA:
       the allocator's peak). Its growth minus what the step left allocated (the gradients and the
       measuring optimizer's state, counted tensor by tensor) is taken as the cost of one sequence (a
       linear extrapolation that over-counts the batch-independent part: safe). The static part is
       then memory in use before that step + ``state_bytes`` + ``extra_bytes``.
       ``max_batch = min(limit, (memory_bytes - static) // per_sequence)``; ValueError when 0.
    3. Up to ``max_sizes`` of ``batch_sizes`` (default 1, 2, 4, ...) that fit, smallest first:
       ``warmup`` untimed then ``steps`` timed steps each (tokens/s = ``batch * seq_len`` / median
       step time). A size is skipped when the steps it needs, predicted from the last tokens/s,
       would end the profile after ``time_budget_s`` (the first size is always measured). Each
       measured peak can only raise ``per_sequence`` (and lower ``max_batch``), so later sizes are
       checked against what was seen.

    One INFO line per batch size on ``logger`` (default: this module's), with tokens/s and the
    peak against the budget. The model's weights, mode and the RNG are left as they were (lr=0
    AdamW, forked RNG, see :func:`measure_throughput`). ``speed_factor`` and ``amp`` as there.

    A CUDA out-of-memory error at a later size (another process took memory meanwhile) marks that
    size and every larger one as not fitting.

    ``should_stop`` (e.g. the node's Ctrl+C flag; called from this thread) is checked before each
    timed step: when it says True the profile ends there (issue 14 #10: Ctrl+C waited for the whole
    profile) with :class:`ProfileStopped`.

    ``optimizer_factory``: the optimizer of the measuring steps (default: lr=0 AdamW). A sharded rank passes
    :func:`stateless_optimizer`: its steps then hold the whole gradients but no optimizer state, so they need
    no more than the sharded training counted (for up to 4 ranks), not a whole copy's AdamW moments.

    Raises:
        ProfileStopped: ``should_stop()`` said True; the model's weights and mode are restored.
        ValueError: bad arguments, or the budget is below the static memory or batch 1.
        OSError: the default CPU probe cannot read /proc/self/statm.
        torch.cuda.OutOfMemoryError: at the step at batch 1.
    """
    log = logger or logging.getLogger(__name__)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} must be > 0")
    if steps < 1 or warmup < 0 or max_sizes < 1 or limit < 1:
        raise ValueError(
            f"need steps >= 1 ({steps}), warmup >= 0 ({warmup}), max_sizes >= 1 ({max_sizes}), limit >= 1 ({limit})"
        )
    if not (0 < speed_factor <= 1):
        raise ValueError(f"speed_factor={speed_factor} must be in (0, 1]")
    t_start = time.perf_counter()
    dev = parse_device(device)
    m = materialize(model, dev)
    vocab = model_vocab_size(m, vocab_size)
    params = [p for p in m.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in m.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    counted = 3 * param_bytes if state_bytes is None else int(state_bytes)  # default: gradients + AdamW's moments
    if counted < 0:
        raise ValueError(f"state_bytes={state_bytes} must be >= 0")
    if extra_bytes is None:
        extra_bytes = DEFAULT_EXTRA_BYTES_PER_PARAM * n_params if dev.type == "cpu" else 0
    probe = memory_probe or (cuda_probe(dev) if dev.type == "cuda" else rss_probe)
    gib = 2.0**30

    if batch_sizes is None:
        wanted = [1 << i for i in range(0, 11) if (1 << i) <= limit]
    else:
        wanted = sorted(set(int(b) for b in batch_sizes))
        if not wanted or wanted[0] < 1:
            raise ValueError(f"batch_sizes={wanted}: need at least one batch size, all >= 1")

    gen = torch.Generator().manual_seed(0)
    peaks: dict[int, int] = {}
    tps: dict[int, float] = {}
    skipped: list[int] = []
    steps_run = [0]
    with MeasureSession(m, dev, optimizer_factory, amp=amp) as sess:

        def run_step(b: int) -> float:
            if should_stop is not None and should_stop():
                raise ProfileStopped(f"profile stopped after {steps_run[0]} step(s): stop requested")
            steps_run[0] += 1
            return timed_step(sess, torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev), dev, speed_factor)

        # 1. static part, checked before any step
        base_probe_before = None
        before0, _ = probe(lambda: None)
        static = int(before0 + counted + extra_bytes)
        if static >= memory_bytes:
            raise ValueError(
                f"memory budget {gib_text(memory_bytes)} GiB is below what training this model needs before any "
                f"activation: {static / gib:.2f} GiB ({before0 / gib:.2f} in use + {counted / gib:.2f} gradients and "
                f"optimizer state + {extra_bytes / gib:.2f} the rest of the run's static memory)"
            )
        # 2. one step at batch 1: its growth gives the cost of a sequence
        dt1 = [0.0]
        base_probe_before, peak1 = probe(lambda: dt1.__setitem__(0, run_step(1)))
        grad_opt = _held_bytes(sess)
        static = int(base_probe_before + counted + extra_bytes)
        per_seq = max(1, int(peak1 - base_probe_before - grad_opt))
        peaks[1] = int(peak1)

        def max_fit() -> int:
            return int(min(limit, max(0, (memory_bytes - static) // per_seq)))

        if max_fit() < 1:
            raise ValueError(
                f"memory budget {gib_text(memory_bytes)} GiB is below the predicted peak of one sequence of "
                f"{seq_len} tokens: {(static + per_seq) / gib:.2f} GiB (measured step peak {peak1 / gib:.2f} GiB "
                f"+ {extra_bytes / gib:.2f} GiB the rest of the run's static memory)"
            )
        log.info(
            "profile: %d parameters, seq_len %d, budget %.2f GiB: batch 1 step %.2fs, measured peak %.2f GiB "
            "(+ %.2f GiB the rest of the run's static memory); predicted %.0f MiB per sequence, max batch %d at first "
            "(the larger batches' peaks may lower it)",
            n_params,
            seq_len,
            memory_bytes / gib,
            dt1[0],
            peak1 / gib,
            extra_bytes / gib,
            per_seq / 2**20,
            max_fit(),
        )
        # 3. tokens/s at a few batch sizes that fit, within the time budget
        last_tps = seq_len / dt1[0] if dt1[0] > 0 else None
        for b in wanted:
            if len(tps) >= max_sizes or b > max_fit():
                skipped.append(b)
                continue
            elapsed = time.perf_counter() - t_start
            if tps and last_tps and elapsed + (warmup + steps) * b * seq_len / last_tps > time_budget_s:
                skipped.append(b)
                continue
            times: list[float] = []

            def timed() -> None:
                for i in range(warmup + steps):
                    dt = run_step(b)
                    if i >= warmup:
                        times.append(dt)

            try:
                _, peak_b = probe(timed)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                # A GPU shared with another process: b does not fit after all; neither does anything larger.
                free_after_oom(dev)
                per_seq = max(per_seq, (memory_bytes - static) // b + 1)
                skipped.append(b)
                log.info("profile: batch %d ran out of device memory; max batch now %d", b, max_fit())
                continue
            peaks[b] = max(peaks.get(b, 0), int(peak_b))
            # everything above the static part at this batch is charged to its sequences
            per_seq = max(per_seq, int(math.ceil((peak_b - base_probe_before - grad_opt) / b)))
            tps[b] = last_tps = b * seq_len / statistics.median(times)
            events.emit(
                log,
                logging.INFO,
                "profile_batch",
                "profile: batch %d: %.0f tokens/s (%.2fs/step over %d steps), measured peak %.2f GiB "
                "+ %.2f GiB global weights and outer state, budget %.2f GiB",
                b,
                tps[b],
                statistics.median(times),
                steps,
                peak_b / gib,
                extra_bytes / gib,
                memory_bytes / gib,
                batch=b,
                tokens_per_s=tps[b],
                step_s=statistics.median(times),
                steps=steps,
                peak_bytes=int(peak_b),
                extra_bytes=extra_bytes,
                budget_bytes=memory_bytes,
            )
        if not tps:  # every requested size over the budget: measure the largest that fits
            b = max_fit()
            times = [run_step(b) for _ in range(steps)]
            tps[b] = b * seq_len / statistics.median(times)
            log.info("profile: batch %d (none of %s fits): %.0f tokens/s", b, wanted, tps[b])
    if skipped:
        log.info(
            "profile: not measured: batch %s (over the budget, %d sizes, or past %.0fs)",
            ",".join(map(str, skipped)),
            max_sizes,
            time_budget_s,
        )
    # the final figure, the one the table and the record give: the first estimate above was of batch 1 alone
    # (a fresh-user trial read two different max batches in the log and the table)
    log.info("profile: max batch %d (%.0f MiB per sequence as measured)", max(1, max_fit()), per_seq / 2**20)
    est = MemoryEstimate(static_bytes=static, per_sequence_bytes=per_seq, n_params=n_params)
    return TrainingProfile(
        tokens_per_s=tps,
        max_batch=max(1, max_fit()),
        memory=est,
        memory_bytes=int(memory_bytes),
        peak_bytes=peaks,
        skipped=skipped,
        seconds=time.perf_counter() - t_start,
    )


def gib_text(n_bytes: float) -> str:
    """``n_bytes`` in GiB for a message: two decimals, or three significant digits under 0.1 GiB (a budget of
    0.001 GiB read "0.00 GiB", fresh-user trial, session 45)."""
    gib = float(n_bytes) / 2.0**30
    return f"{gib:.2f}" if abs(gib) >= 0.1 else f"{gib:.3g}"


def _held_bytes(sess: MeasureSession) -> int:
    """Bytes the session's last step left allocated: the gradients and the optimizer's per-parameter state
    (tensors of a parameter's size: AdamW's two moments; its scalar step counts are left out)."""
    n = sum(p.grad.numel() * p.grad.element_size() for p in sess.model.parameters() if p.grad is not None)
    for param, state in sess.opt.state.items():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() == param.numel():
                n += v.numel() * v.element_size()
    return int(n)


def stateless_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer for measuring steps that keeps no state: lr=0 SGD without momentum (weights unchanged)."""
    return torch.optim.SGD(params, lr=0.0)


def memory_in_use(device: Union[str, torch.device]) -> int:
    """The memory :func:`profile_training` counts as in use before its first step (bytes): this process's RSS on
    a CPU, the CUDA allocator's bytes on ``device`` otherwise. Raises OSError where the RSS is unreadable."""
    dev = parse_device(device)
    before, _ = (cuda_probe(dev) if dev.type == "cuda" else rss_probe)(lambda: None)
    return int(before)


def default_batch_sizes(max_batch: int, cap: int = 64) -> list[int]:
    """Powers of two up to ``min(max_batch, cap)``, plus that bound itself."""
    top = max(1, min(max_batch, cap))
    sizes, b = [], 1
    while b <= top:
        sizes.append(b)
        b *= 2
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def profile(
    model_factory: Optional[ModelOrFactory] = None,
    seq_len: int = 64,
    *,
    preset: Optional[str] = None,
    vocab_size: Optional[int] = None,
    device: str = "auto",
    batch_sizes: Optional[Iterable[int]] = None,
    memory_budget_bytes: Optional[int] = None,
    upload_bps: Optional[float] = None,
    download_bps: Optional[float] = None,
    steps: int = 2,
    warmup: int = 0,
    speed_factor: float = 1.0,
    max_sizes: int = 3,
    time_budget_s: float = 30.0,
    limit: int = 256,
    memory_probe: Optional[MemoryProbe] = None,
) -> dict[str, Any]:
    """Profile this machine for a model: device, max batch, tokens/s per batch, stated bandwidth.

    The model is ``model_factory`` (a module or a callable building one) or, by name, a
    ``preset`` of :func:`geomesh_p2p.model.build.build_model` at ``vocab_size`` (default
    :data:`SHIPPED_VOCAB_SIZE`, what ``geomesh-peer join`` trains with by default).
    ``memory_budget_bytes``: the training memory budget on a CPU (the process's peak RSS; default:
    a share of MemAvailable), a cap on the free memory on a GPU. Measured by
    :func:`profile_training` (a few batch sizes, ``steps`` timed steps each, within
    ``time_budget_s``; ``memory_probe`` as there).

    Returns a JSON-serialisable dict: ``device`` {kind, name, memory_bytes, index}, ``seq_len``,
    ``n_params``, ``max_batch``, ``tokens_per_s`` {batch: tokens/s}, ``memory`` {static_bytes,
    per_sequence_bytes, peak_bytes {batch: bytes}}, ``profile_s`` (seconds), ``bandwidth``
    ({upload_bps, download_bps} in bytes/s as stated by flags, or None: links are measured during
    the run), ``speed_factor``. Raises ValueError for neither or both of
    ``model_factory``/``preset``, a non-positive bandwidth or budget, and as
    :func:`detect_device` and :func:`profile_training` do.
    """
    if (model_factory is None) == (preset is None):
        raise ValueError("give exactly one of model_factory and preset")
    for name, v in (("upload_bps", upload_bps), ("download_bps", download_bps)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v} must be a positive bandwidth (bytes/s)")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes} must be > 0")
    info = detect_device(device, memory_budget_bytes)
    if info.kind == "cuda" and memory_budget_bytes is not None:
        info = DeviceInfo(info.kind, info.name, min(info.memory_bytes, int(memory_budget_bytes)), info.index)
    dev = info.torch_device
    if preset is not None:
        # The vocabulary a run trains with by default (the shipped tokenizer's), not the preset's own
        # (gpt2-124m's 50257 would measure a model 40% larger than the one `join` trains).
        vocab_size = SHIPPED_VOCAB_SIZE if vocab_size is None else vocab_size
        model_factory = build_model(preset, vocab_size=vocab_size)
    elif model_factory is None:  # excluded above; restated so the type checker sees it
        raise ValueError("give exactly one of model_factory and preset")
    model = materialize(model_factory, dev)
    n_params = sum(p.numel() for p in model.parameters())
    prof = profile_training(
        model,
        seq_len,
        dev,
        info.memory_bytes,
        vocab_size=vocab_size,
        batch_sizes=batch_sizes,
        max_sizes=max_sizes,
        steps=steps,
        warmup=warmup,
        time_budget_s=time_budget_s,
        speed_factor=speed_factor,
        limit=limit,
        memory_probe=memory_probe,
    )
    bandwidth = None
    if upload_bps is not None or download_bps is not None:
        bandwidth = {"upload_bps": upload_bps, "download_bps": download_bps}
    return {
        "device": asdict(info),
        "seq_len": seq_len,
        "n_params": n_params,
        "max_batch": prof.max_batch,
        "tokens_per_s": prof.tokens_per_s,
        "memory": {
            "static_bytes": prof.memory.static_bytes,
            "per_sequence_bytes": prof.memory.per_sequence_bytes,
            "peak_bytes": prof.peak_bytes,
        },
        "profile_s": prof.seconds,
        "bandwidth": bandwidth,
        "speed_factor": speed_factor,
    }


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_profile_table(result: Mapping[str, Any]) -> str:
    """Human-readable table of a :func:`profile` result (for ``geomesh-peer profile``)."""
    dev = result["device"]
    lines = [
        f"device      {dev['name']} ({dev['kind']})",
        f"memory      {_fmt_bytes(dev['memory_bytes'])} budget",
        f"model       {result.get('n_params', 0):,} parameters, seq_len {result.get('seq_len')}",
        f"max batch   {result['max_batch']} sequences",
    ]
    if result.get("speed_factor", 1.0) != 1.0:
        lines.append(f"speed       x{result['speed_factor']} (emulated slower device)")
    bw = result.get("bandwidth")
    if bw:
        up, down = bw.get("upload_bps"), bw.get("download_bps")
        how = (
            f"measured against {bw['measured_against']}, RTT {1000 * bw.get('rtt_s', 0.0):.1f} ms"
            if bw.get("measured_against")
            else "stated"
        )
        # Mbit/s, the unit of the --upload-mbps / --download-mbps flags
        mbit = lambda v: "-" if not v else f"{v * 8 / 1e6:,.1f} Mbit/s"  # noqa: E731
        lines.append(
            f"bandwidth   up {mbit(up)}, down {mbit(down)} ({how})" if (up or down) else "bandwidth   not stated"
        )
    else:
        lines.append("bandwidth   not stated (measured during the run)")
    tps = {int(b): float(v) for b, v in result["tokens_per_s"].items()}
    seq_len = result.get("seq_len") or 1
    lines.append("")
    lines.append(f"{'batch':>6}  {'tokens/s':>12}  {'step ms':>9}")
    for b in sorted(tps):
        lines.append(f"{b:>6}  {tps[b]:>12.1f}  {1000 * b * seq_len / tps[b]:>9.1f}")
    return "\n".join(lines)
