"""Measuring a device for the planner: memory, tokens/s per batch size, link bandwidth.

DESIGN.md, "capability" and "Round r" step 7. A peer profiles itself at start-up (``profile``,
shown by ``geomesh-peer profile``) and announces the result in its
:class:`~geomesh_p2p.schema.peer.PeerRecord`; during the run :class:`ThroughputEMA` folds each round's
observed step times and transfer times into that record, so the next plan fits reality (GeoMesh
profiles once; we re-profile every round).

Units: bytes for memory, tokens/s for throughput, bytes/s for bandwidth, seconds for time.
Throughput is keyed by the batch size of one forward/backward pass (the micro-batch).

Measurements do not disturb a live model: the default optimizer is AdamW with ``lr=0`` (the same
kernels run, the weights do not change), gradients are cleared afterwards, the train/eval mode is
restored and the global RNG state is forked (dropout draws do not shift later training).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Union

import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.schema.peer import PeerRecord

ModelOrFactory = Union[torch.nn.Module, Callable[[], torch.nn.Module]]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

#: share of MemAvailable a CPU peer budgets for training when no budget is given
DEFAULT_CPU_MEMORY_FRACTION = 0.5
#: fp32 bytes per parameter kept besides weights, grads and optimizer state: the global weights
#: copy and the outer (Nesterov) momentum (DESIGN.md "Round r" step 5)
DEFAULT_EXTRA_BYTES_PER_PARAM = 8
#: headroom on measured activation memory for what autograd does not save: the gradient of the
#: logits and of one layer's activations during backward, allocator fragmentation
DEFAULT_ACTIVATION_SAFETY = 1.5
#: the most a peer's announced tokens/s may grow in one re-profiling update (x): its self-measured
#: compute time is not evidence (a free rider can report ~0 s), so a figure can only be inflated
#: slowly; a real speed-up (a profile taken under load) is reached in a few rounds (2x per round).
MAX_TPS_GROWTH_PER_UPDATE = 2.0


# --------------------------------------------------------------------------------------------
# device


@dataclass(frozen=True)
class DeviceInfo:
    """A compute device and its memory budget for training (bytes)."""

    kind: Literal["cuda", "cpu"]
    name: str
    memory_bytes: int
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    return "cpu: " + " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def _mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to physical memory."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _parse_device(device: Union[str, torch.device, DeviceInfo]) -> torch.device:
    if isinstance(device, DeviceInfo):
        return device.torch_device
    if isinstance(device, torch.device):
        dev = device
    else:
        if device == "auto":
            return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        return torch.device("cuda", 0 if dev.index is None else dev.index)
    if dev.type != "cpu":
        raise ValueError(f"device={str(dev)!r}: only 'cpu' and 'cuda' are supported")
    return dev


def detect_device(
    device: str = "auto",
    cpu_memory_budget_bytes: Optional[int] = None,
    cpu_memory_fraction: float = DEFAULT_CPU_MEMORY_FRACTION,
) -> DeviceInfo:
    """Name and memory budget (bytes) of ``device`` ('auto', 'cpu', 'cuda' or 'cuda:N').

    CUDA: the name from ``torch.cuda.get_device_properties`` and the memory this process can
    still use (free memory plus what its caching allocator already holds). CPU: the processor
    name from /proc/cpuinfo (fallback ``platform.processor()``), prefixed ``cpu:``; the budget is
    ``cpu_memory_budget_bytes`` if given, else ``cpu_memory_fraction`` of MemAvailable.

    Raises ValueError for an unknown device string or a non-positive budget/fraction, and
    RuntimeError when CUDA is asked for but not available.
    """
    dev = _parse_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r}: CUDA is not available on this machine")
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        props = torch.cuda.get_device_properties(dev.index)
        try:
            free, _total = torch.cuda.mem_get_info(dev.index)
            budget = int(free + torch.cuda.memory_reserved(dev.index))
        except RuntimeError:
            budget = int(props.total_memory)
        return DeviceInfo("cuda", props.name, min(budget, int(props.total_memory)), dev.index)
    if cpu_memory_budget_bytes is not None:
        if cpu_memory_budget_bytes <= 0:
            raise ValueError(f"cpu_memory_budget_bytes={cpu_memory_budget_bytes} must be > 0")
        budget = int(cpu_memory_budget_bytes)
    else:
        if not (0 < cpu_memory_fraction <= 1):
            raise ValueError(f"cpu_memory_fraction={cpu_memory_fraction} must be in (0, 1]")
        budget = int(_mem_available_bytes() * cpu_memory_fraction)
        if budget <= 0:
            raise RuntimeError("could not read the available memory; pass cpu_memory_budget_bytes")
    return DeviceInfo("cpu", _cpu_name(), budget, 0)


# --------------------------------------------------------------------------------------------
# one training step


def _materialize(model: ModelOrFactory, dev: torch.device) -> torch.nn.Module:
    """The module itself (moved to ``dev``) or a fresh one from the factory."""
    m = model if isinstance(model, torch.nn.Module) else model()
    if not isinstance(m, torch.nn.Module):
        raise ValueError(f"model factory returned {type(m).__name__}, not a torch.nn.Module")
    p = next(m.parameters(), None)
    if p is None:
        raise ValueError("model has no parameters")
    if p.device != dev:
        m.to(dev)
    return m


def _vocab_size(model: torch.nn.Module, vocab_size: Optional[int]) -> int:
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab_size or vocab_size < 1:
        raise ValueError("vocab_size is needed (model has no config.vocab_size)")
    return int(vocab_size)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # lr=0: the full AdamW arithmetic runs, the weights stay bit-identical
    return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)


def _timed_step(sess: "_Session", x: torch.Tensor, dev: torch.device, speed_factor: float) -> float:
    """Seconds one training step on token ids ``x`` (int64 [batch, seq_len]) takes, device synchronised;
    ``speed_factor`` < 1 emulates a slower device by sleeping the difference (counted in the result)."""
    t0 = time.perf_counter()
    sess.step(x)
    _sync(dev)
    dt = time.perf_counter() - t0
    if speed_factor < 1:
        time.sleep(dt * (1.0 / speed_factor - 1.0))
        dt = time.perf_counter() - t0
    return dt


class _Session:
    """Model in train mode, an optimizer, forked RNG; restores the model's state on exit."""

    def __init__(
        self,
        model: torch.nn.Module,
        dev: torch.device,
        optimizer_factory: Optional[OptimizerFactory],
        amp: bool = False,
    ):
        self.model, self.dev = model, dev
        self.amp = bool(amp) and dev.type == "cuda"  # bf16 autocast as training uses it (CUDA only)
        self.optimizer_factory = optimizer_factory or _default_optimizer
        self._rng = torch.random.fork_rng(devices=[dev.index] if dev.type == "cuda" else [])

    def __enter__(self) -> "_Session":
        self._was_training = self.model.training
        self._rng.__enter__()
        self.model.train()
        self.opt = self.optimizer_factory([p for p in self.model.parameters() if p.requires_grad])
        return self

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.amp:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = self.model(input_ids=x, labels=x).loss
        else:
            loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()

    def __exit__(self, *exc) -> None:
        self.opt.zero_grad(set_to_none=True)
        del self.opt
        self.model.zero_grad(set_to_none=True)
        self.model.train(self._was_training)
        self._rng.__exit__(*exc)
        if (
            self.dev.type == "cuda"
        ):  # (a full gc costs ~1 s with transformers loaded: only where it frees device memory)
            gc.collect()
            torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower()
    )


def _free_after_oom(dev: torch.device) -> None:
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


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
    dev = _parse_device(device)
    model = _materialize(model_factory, dev)
    vocab = _vocab_size(model, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    result: dict[int, float] = {}
    with _Session(model, dev, optimizer_factory, amp=amp) as sess:
        for b in sizes:
            x = torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev)
            times = []
            try:
                for i in range(warmup + steps):
                    dt = _timed_step(sess, x, dev, speed_factor)
                    if i >= warmup:
                        times.append(dt)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not _is_oom(e):
                    raise
                del x
                _free_after_oom(dev)
                break
            result[b] = b * seq_len / statistics.median(times)
    return result


# --------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class MemoryEstimate:
    """Training memory model (bytes): ``static_bytes + batch * per_sequence_bytes``.

    ``static_bytes``: weights, gradients, optimizer state and the extra per-parameter state
    (global copy, outer momentum) plus batch-independent activations. ``per_sequence_bytes``:
    activations autograd keeps for backward per sequence, times a safety factor.
    """

    static_bytes: int
    per_sequence_bytes: int
    n_params: int

    def bytes_for(self, batch: int) -> int:
        return self.static_bytes + batch * self.per_sequence_bytes

    def max_batch(self, memory_bytes: int) -> int:
        """Largest batch whose estimate fits ``memory_bytes`` (0 when not even one does)."""
        room = memory_bytes - self.static_bytes
        return max(0, room // max(1, self.per_sequence_bytes))


def analytic_activation_bytes(
    n_layer: int, hidden: int, n_head: int, seq_len: int, vocab_size: int, bytes_per_element: int = 4
) -> int:
    """Activation memory for one sequence of a GPT-style transformer (bytes), from the formula.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): one
    layer keeps ``s*h*(34 + 5*a*s/h)`` bytes per sequence at 2 bytes per element (no recomputation,
    no flash attention); scaled to ``bytes_per_element``; plus the logits and their log-softmax
    (``2*s*V`` elements). A cross-check for :func:`estimate_memory`, which measures instead.
    """
    per_layer = seq_len * hidden * (34 + 5 * n_head * seq_len / hidden) * bytes_per_element / 2
    return int(n_layer * per_layer + 2 * seq_len * vocab_size * bytes_per_element)


def _saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward in one forward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            if st.data_ptr() not in param_ptrs:
                seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    del loss
    return sum(seen.values())


def estimate_memory(
    model: ModelOrFactory,
    seq_len: int,
    device: Union[str, torch.device, DeviceInfo] = "cpu",
    vocab_size: Optional[int] = None,
    optimizer_bytes_per_param: Optional[int] = None,
    extra_bytes_per_param: int = DEFAULT_EXTRA_BYTES_PER_PARAM,
    activation_safety: float = DEFAULT_ACTIVATION_SAFETY,
) -> MemoryEstimate:
    """Estimate training memory (bytes) from two measured forward passes (batch 1 and 2).

    Activations: the tensors autograd saves for backward are counted (distinct storages, weights
    excluded) at batch 1 and 2; the difference is the per-sequence cost (times
    ``activation_safety``), the rest the batch-independent part. (``tracemalloc`` does not see
    torch's allocator, RSS is too noisy.) Static: weights + gradients (parameter bytes each) +
    optimizer state (default: 2 x parameter bytes, AdamW's two moments) + ``extra_bytes_per_param``.
    Raises ValueError for ``seq_len < 1`` or a missing vocab size.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    dev = _parse_device(device)
    m = _materialize(model, dev)
    vocab = _vocab_size(m, vocab_size)
    params = [p for p in m.parameters()]
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt_bytes = 2 * param_bytes if optimizer_bytes_per_param is None else optimizer_bytes_per_param * n_params
    gen = torch.Generator().manual_seed(0)
    was_training = m.training
    with torch.random.fork_rng(devices=[dev.index] if dev.type == "cuda" else []):
        m.train()
        try:
            a1 = _saved_activation_bytes(m, torch.randint(0, vocab, (1, seq_len), generator=gen).to(dev))
            a2 = _saved_activation_bytes(m, torch.randint(0, vocab, (2, seq_len), generator=gen).to(dev))
        finally:
            m.train(was_training)
    per_seq = max(a2 - a1, 1)
    fixed_act = max(a1 - per_seq, 0)
    static = 2 * param_bytes + opt_bytes + extra_bytes_per_param * n_params + fixed_act
    return MemoryEstimate(int(static), int(math.ceil(per_seq * activation_safety)), n_params)


def find_max_batch(
    model: ModelOrFactory,
    seq_len: int,
    device: Union[str, torch.device, DeviceInfo],
    memory_bytes: int,
    start: int = 1,
    limit: int = 1024,
    vocab_size: Optional[int] = None,
) -> int:
    """Largest batch (sequences of ``seq_len`` tokens) whose training step fits ``memory_bytes``.

    CUDA: real steps (forward, backward, lr=0 AdamW) at ``start``, doubling until one runs out of
    memory (``torch.cuda.OutOfMemoryError``, then freed) or its peak allocation exceeds
    ``memory_bytes``, then bisection between the last fit and the first failure. CPU: an estimate
    from :func:`estimate_memory` (measured per-sequence activations, analytic static part) against
    ``memory_bytes``. The result is in ``[start, limit]``.

    Raises ValueError when not even ``start`` sequences fit, for ``start < 1``, ``limit < start``
    or a non-positive ``memory_bytes``.
    """
    if start < 1 or limit < start:
        raise ValueError(f"need 1 <= start ({start}) <= limit ({limit})")
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} must be > 0")
    dev = _parse_device(device)
    m = _materialize(model, dev)
    if dev.type != "cuda":
        est = estimate_memory(m, seq_len, dev, vocab_size)
        best = min(est.max_batch(memory_bytes), limit)
        if best < start:
            raise ValueError(
                f"memory_bytes={memory_bytes} is below the estimate for batch {start}:"
                f" {est.bytes_for(start)} bytes ({est.static_bytes} static + {est.per_sequence_bytes}/sequence)"
            )
        return int(best)

    vocab = _vocab_size(m, vocab_size)
    gen = torch.Generator().manual_seed(0)
    with _Session(m, dev, None) as sess:

        def fits(b: int) -> bool:
            x = None
            try:
                torch.cuda.reset_peak_memory_stats(dev)
                x = torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev)
                sess.step(x)
                _sync(dev)
                return torch.cuda.max_memory_allocated(dev) <= memory_bytes
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not _is_oom(e):
                    raise
                return False
            finally:
                del x
                sess.opt.zero_grad(set_to_none=True)
                _free_after_oom(dev)

        if not fits(start):
            raise ValueError(f"not even batch {start} (seq_len {seq_len}) fits in {memory_bytes} bytes on {dev}")
        good = start
        bad = None
        while good < limit:
            nxt = min(good * 2, limit)
            if fits(nxt):
                good = nxt
            else:
                bad = nxt
                break
        if bad is not None:
            while bad - good > 1:
                mid = (good + bad) // 2
                if fits(mid):
                    good = mid
                else:
                    bad = mid
    return int(good)


# --------------------------------------------------------------------------------------------
# the minimum memory a method needs, and the start-up profile (issue 13)

#: vocabulary of the shipped tokenizer, which runs train with by default (``--vocab-size``)
SHIPPED_VOCAB_SIZE = 4096
#: copies of ``[P]`` fp32 the inner optimizer keeps (AdamW: two moments; Lion: one)
INNER_OPTIMIZER_STATE_COPIES = {"adamw": 2, "lion": 1}
#: copies of ``[P]`` fp32 held by each method's outer optimizer: Nesterov momentum (DiLoCo's outer
#: step) for the DiLoCo family, AdamW's two moments for the ``ddp`` baseline
OUTER_STATE_COPIES = {"geomesh": 1, "awb": 1, "css": 1, "diloco": 1, "ddp": 2}


@dataclass(frozen=True)
class MethodMemory:
    """The least memory (bytes) a peer of a method holds for a model of ``n_params`` parameters.

    fp32 throughout (4 bytes per element); activations, the exchange's buffers and the runtime are
    not included. ``weights``: the trained model ``[P]``; ``gradients``: its ``.grad`` ``[P]``;
    ``inner_optimizer``: the inner optimizer's state (AdamW: two moments, ``2P``; 0 for ``ddp``,
    which takes no inner step); ``global_weights``: the round's global weights ``[P]`` kept to form
    the pseudo-gradient; ``outer_state``: Nesterov momentum ``[P]`` (DiLoCo family) or AdamW's
    moments ``[2P]`` (``ddp``); ``error_feedback``: the compression residual ``[P]`` when enabled (sign-pushing
    methods only, ``method.COMPRESSED_METHODS``: fp32 pushes drop nothing, so they keep no residual).
    """

    method: str
    n_params: int
    weights: int
    gradients: int
    inner_optimizer: int
    global_weights: int
    outer_state: int
    error_feedback: int = 0

    @property
    def total(self) -> int:
        """Sum of the parts, bytes."""
        return (
            self.weights
            + self.gradients
            + self.inner_optimizer
            + self.global_weights
            + self.outer_state
            + self.error_feedback
        )


def method_min_memory(
    n_params: int,
    method: str = "geomesh",
    *,
    inner_optimizer: str = "adamw",
    error_feedback: bool = False,
    bytes_per_element: int = 4,
) -> MethodMemory:
    """The minimum memory of ``method`` for ``n_params`` parameters (see :class:`MethodMemory`).

    ``geomesh``/``diloco`` with AdamW: ``24 * P`` bytes (weights, gradients, 2 AdamW moments, global
    weights, outer momentum); ``ddp``: ``20 * P`` (no inner optimizer state, AdamW's two moments as
    the outer state). Raises ValueError for an unknown method or inner optimizer or ``n_params < 0``.
    """
    from geomesh_p2p.config.method import COMPRESSED_METHODS

    if method not in OUTER_STATE_COPIES:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(OUTER_STATE_COPIES)})")
    if inner_optimizer not in INNER_OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown inner optimizer {inner_optimizer!r}")
    if n_params < 0:
        raise ValueError(f"n_params={n_params} must be >= 0")
    p = int(n_params) * int(bytes_per_element)
    inner = 0 if method == "ddp" else INNER_OPTIMIZER_STATE_COPIES[inner_optimizer] * p
    return MethodMemory(
        method=method,
        n_params=int(n_params),
        weights=p,
        gradients=p,
        inner_optimizer=inner,
        global_weights=p,
        outer_state=OUTER_STATE_COPIES[method] * p,
        error_feedback=p if error_feedback and method in COMPRESSED_METHODS else 0,
    )


def preset_min_memory(
    preset: str, method: str = "geomesh", *, vocab_size: int = SHIPPED_VOCAB_SIZE, **kw: Any
) -> MethodMemory:
    """:func:`method_min_memory` for a model preset of :mod:`geomesh_p2p.model.training` at ``vocab_size``
    (the shipped tokenizer's 4096 by default), tied weights counted once. Counts the parameters
    without allocating them (:func:`geomesh_p2p.model.training.count_params`). Raises
    :class:`geomesh_p2p.model.training.ConfigError` for an unknown preset."""
    from geomesh_p2p.model.training import count_params

    return method_min_memory(count_params(preset, vocab_size=vocab_size), method, **kw)


def _rss_bytes() -> Optional[int]:
    """Resident set size of this process (bytes) from /proc/self/statm; None where unreadable."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


#: A memory probe runs a callable and returns (bytes in use just before, peak bytes while it ran).
MemoryProbe = Callable[[Callable[[], None]], "tuple[int, int]"]


#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations from this size (bytes) are mmapped by glibc once :func:`release_freed_memory` configured it,
#: so a freed tensor of this size or more goes back to the OS at once (a weight, gradient or optimizer slice
#: of a 100M model is 2-12 MiB: under glibc's dynamic threshold it lands in the heap and stays resident).
MMAP_THRESHOLD_BYTES = 1 << 20


def release_freed_memory(configure: bool = False) -> bool:
    """Give memory freed by tensors back to the OS (glibc's ``malloc_trim(0)``); True when it could.

    PyTorch's CPU allocator is glibc malloc. glibc raises its mmap threshold (up to 32 MiB) each time
    an mmapped block is freed, after which blocks below it come from the heap, and a freed heap block
    stays in the process's RSS until a trim: call this where big blocks were just freed (after the
    start-up profile, after a round's gradients are freed), off the event loop. ``malloc_trim(0)``
    returns every whole free page of the heap, not only its top. ``configure=True`` also fixes the
    threshold at :data:`MMAP_THRESHOLD_BYTES` (and the trim threshold at twice it), so every block from
    that size on is mmapped and unmapped when freed: not for a training process, where every step then
    maps and faults in its activations and gradients afresh (the tiny preset's inner steps ran 1.5-3x
    slower in a 4-peer swarm on 2 cores). Other C libraries (musl, macOS): nothing happens, False.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim, mallopt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return False
    if configure:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)
    trim(0)
    return True


def rss_probe(fn: Callable[[], None], interval_s: float = 0.002) -> tuple[int, int]:
    """Run ``fn`` and return ``(RSS before, peak RSS while it ran)`` of this process, bytes.

    The peak is sampled from /proc/self/statm every ``interval_s`` by a helper thread (a training
    step holds its activations for tens of milliseconds, far longer than the interval). The kernel's
    VmHWM is not reset (``clear_refs``), so an outside observer's peak RSS stays meaningful.
    Raises OSError where /proc/self/statm is unreadable.
    """
    import threading

    before = _rss_bytes()
    if before is None:
        raise OSError("/proc/self/statm is not readable: cannot measure RSS on this system")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            v = _rss_bytes()
            if v is not None and v > peak[0]:
                peak[0] = v

    t = threading.Thread(target=sample, name="rss-probe", daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    after = _rss_bytes() or before
    return before, max(peak[0], after)


def _cuda_probe(dev: torch.device) -> MemoryProbe:
    def probe(fn: Callable[[], None]) -> tuple[int, int]:
        _sync(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        _sync(dev)
        return int(before), int(torch.cuda.max_memory_allocated(dev))

    return probe


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
) -> TrainingProfile:
    """Start-up profile within a memory budget: the largest batch that fits, and tokens/s per batch.

    Never runs a step whose predicted peak exceeds ``memory_bytes``. Order:

    1. Static check, before any step: memory in use now + gradients (``P`` x parameter bytes) +
       optimizer state (``2P``, AdamW) + ``extra_bytes`` (default on CPU: ``8P`` bytes, the global
       weights and the outer momentum the node holds besides; 0 on CUDA, where those live in host
       memory) must fit, else ValueError.
    2. One step at batch 1 under ``memory_probe`` (CPU: :func:`rss_probe`, the process's RSS; CUDA:
       the allocator's peak). Its growth minus gradients and optimizer state is taken as the cost
       of one sequence (a linear extrapolation that over-counts the batch-independent part: safe).
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

    Raises:
        ProfileStopped: ``should_stop()`` said True; the model's weights and mode are restored.
        ValueError: bad arguments, or the budget is below the static memory or batch 1.
        OSError: the default CPU probe cannot read /proc/self/statm.
        torch.cuda.OutOfMemoryError: at the step at batch 1.
    """
    import logging

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
    dev = _parse_device(device)
    m = _materialize(model, dev)
    vocab = _vocab_size(m, vocab_size)
    params = [p for p in m.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in m.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_opt = 3 * param_bytes  # gradients + AdamW's two moments, allocated by the first step
    if extra_bytes is None:
        extra_bytes = DEFAULT_EXTRA_BYTES_PER_PARAM * n_params if dev.type == "cpu" else 0
    probe = memory_probe or (_cuda_probe(dev) if dev.type == "cuda" else rss_probe)
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
    with _Session(m, dev, optimizer_factory, amp=amp) as sess:

        def run_step(b: int) -> float:
            if should_stop is not None and should_stop():
                raise ProfileStopped(f"profile stopped after {steps_run[0]} step(s): stop requested")
            steps_run[0] += 1
            return _timed_step(sess, torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev), dev, speed_factor)

        # 1. static part, checked before any step
        base_probe_before = None
        before0, _ = probe(lambda: None)
        static = int(before0 + grad_opt + extra_bytes)
        if static >= memory_bytes:
            raise ValueError(
                f"memory budget {memory_bytes / gib:.2f} GiB is below what training this model needs before any "
                f"activation: {static / gib:.2f} GiB ({before0 / gib:.2f} in use + {grad_opt / gib:.2f} gradients and "
                f"AdamW state + {extra_bytes / gib:.2f} global weights and outer state)"
            )
        # 2. one step at batch 1: its growth gives the cost of a sequence
        dt1 = [0.0]
        base_probe_before, peak1 = probe(lambda: dt1.__setitem__(0, run_step(1)))
        static = int(base_probe_before + grad_opt + extra_bytes)
        per_seq = max(1, int(peak1 - base_probe_before - grad_opt))
        peaks[1] = int(peak1)

        def max_fit() -> int:
            return int(min(limit, max(0, (memory_bytes - static) // per_seq)))

        if max_fit() < 1:
            raise ValueError(
                f"memory budget {memory_bytes / gib:.2f} GiB is below the predicted peak of one sequence of "
                f"{seq_len} tokens: {(static + per_seq) / gib:.2f} GiB (measured step peak {peak1 / gib:.2f} GiB "
                f"+ {extra_bytes / gib:.2f} GiB global weights and outer state)"
            )
        log.info(
            "profile: %d parameters, seq_len %d, budget %.2f GiB: batch 1 step %.2fs, measured peak %.2f GiB "
            "(+ %.2f GiB global weights and outer state); predicted %.0f MiB per sequence, max batch %d",
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
                if not _is_oom(e):
                    raise
                # A GPU shared with another process: b does not fit after all; neither does anything larger.
                _free_after_oom(dev)
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


# --------------------------------------------------------------------------------------------
# bandwidth and re-profiling


def measure_codec(
    numel: int = 1 << 20,
    *,
    block_size: int = 2048,
    push_encoding: str = "sign",
    rule: str = "mean",
    weight_cap: Optional[float] = None,
    min_agreement: Optional[float] = None,
    clip_k: Optional[float] = 4.0,
    contributors: int = 3,
    repeats: int = 1,
) -> float:
    """Seconds per element of one pass of the collective's CPU work on this machine (float, > 0).

    Runs the real code of a relay round on a part of ``numel`` elements with ``contributors``
    throwaway identities: each encodes and signs its contribution
    (:func:`geomesh_p2p.exchange.messages.contribution_bytes`), the owner checks them
    (``check_contribution``) and builds its result (``build_result``), a reader verifies and
    aggregates them under the run's ``rule`` (``read_result``: the robust rules decode and vote on
    every contribution, ~20x the cost of ``"mean"``). The best of ``repeats`` total times over the
    ``2 x contributors`` element passes made (encode each, read each). The planner multiplies it by
    the model's size and the passes of a round (:func:`geomesh_p2p.plan.planner.exchange_cpu_s`).
    Default size: ~0.1-0.5 s (robust rules) on one CPU thread.

    Raises ValueError for ``numel < 1``, ``contributors < 1`` or ``repeats < 1``.
    """
    from geomesh_p2p.exchange import messages
    from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner, _pid_bytes
    from geomesh_p2p.net.identity import Identity, Verifier

    if numel < 1 or repeats < 1 or contributors < 1:
        raise ValueError(f"numel={numel}, contributors={contributors} and repeats={repeats} must be >= 1")
    idents = [Identity.generate() for _ in range(contributors)]
    pids = [str(i.peer_id) for i in idents]
    now = time.time()
    spec = CollectiveSpec(
        run_id="codec-probe",
        round=0,
        participants={p: 1 for p in pids},
        numel=numel,
        deadline=now + 600,
        pull_deadline=now + 600,
        owners=(PartOwner(peer_id=pids[0], address="127.0.0.1:1", start=0, end=numel),),
        mode="relay",
        push_encoding=push_encoding,
        block_size=block_size,
        rule=rule,
        weight_cap=weight_cap,
        min_agreement=min_agreement,
        clip_k=clip_k,
    )
    verifier = Verifier("codec-probe")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen)
    # Correlated contributions, as honest pseudo-gradients of one round are (the agreement filter keeps them).
    deltas = [(base + 0.5 * torch.randn(numel, generator=gen)) * 1e-3 for _ in range(contributors)]
    out = torch.empty(numel, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        checked = []
        for ident, pid, d in zip(idents, pids, deltas):
            signed = messages.contribution_bytes(ident, spec, 0, d, 1)
            checked.append(messages.check_contribution(verifier, spec, None, signed, pid)[1])
        checked.sort(key=lambda c: _pid_bytes(c.sender))
        res = messages.build_result(idents[0], spec, 0, spec.owners[0], "all pushed", checked)
        messages.read_result(verifier, spec, 0, res, out=out)
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-6) / (2 * contributors * numel)


class ThroughputEMA:
    """Exponential moving averages of a peer's throughput and link speeds, updated every round.

    ``alpha`` is the weight of a new observation: ``v <- alpha * x + (1 - alpha) * v`` (the first
    observation of a quantity is taken as is). ``update(batch, tokens, seconds)`` folds in an
    observed ``tokens / seconds`` for that micro-batch size; with ``rescale_others`` (default) the
    other batch sizes' figures are scaled by the same ratio (a device that got slower is slower at
    every batch size). ``update_link(bytes, seconds, direction)`` does the same for the upload
    ('up') or download ('down') bandwidth, bytes/s. :meth:`apply` writes the figures into a
    :class:`PeerRecord`.
    """

    def __init__(
        self,
        alpha: float = 0.3,
        tokens_per_s: Optional[Mapping[int, float]] = None,
        upload_bps: Optional[float] = None,
        download_bps: Optional[float] = None,
        rescale_others: bool = True,
    ):
        if not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.alpha = float(alpha)
        self.rescale_others = rescale_others
        self._tps: dict[int, float] = {}
        for b, v in (tokens_per_s or {}).items():
            if int(b) < 1 or not (math.isfinite(v) and v > 0):
                raise ValueError(f"tokens_per_s[{b}]={v}: batch must be >= 1 and throughput > 0")
            self._tps[int(b)] = float(v)
        self._link: dict[str, Optional[float]] = {"up": None, "down": None}
        for direction, bps in (("up", upload_bps), ("down", download_bps)):
            if bps is not None:
                if not (math.isfinite(bps) and bps > 0):
                    raise ValueError(f"{direction}load_bps={bps} must be > 0")
                self._link[direction] = float(bps)

    def _ema(self, old: Optional[float], x: float, alpha: Optional[float] = None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        return x if old is None else a * x + (1.0 - a) * old

    def update(
        self, batch: int, tokens: int, seconds: float, alpha: Optional[float] = None, max_growth: Optional[float] = None
    ) -> float:
        """Fold in ``tokens`` trained in ``seconds`` at micro-batch ``batch``; returns the new tokens/s.

        ``alpha`` overrides the weight of this observation (1.0: replace, e.g. a start-up profile
        by the first measurement taken in the swarm). ``max_growth`` (>= 1): the new figure is at
        most that many times the previous one for ``batch`` (or, when ``batch`` is new, the best
        figure known), e.g. :data:`MAX_TPS_GROWTH_PER_UPDATE`. Raises ValueError for ``batch < 1``,
        ``tokens <= 0``, ``seconds <= 0``, ``alpha`` outside (0, 1] or ``max_growth < 1``.
        """
        if alpha is not None and not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        if max_growth is not None and not max_growth >= 1:
            raise ValueError(f"max_growth={max_growth} must be >= 1")
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"tokens={tokens} and seconds={seconds} must be > 0")
        old = self._tps.get(batch)
        new = self._ema(old, tokens / seconds, alpha)
        ref = old if old is not None else max(self._tps.values(), default=None)
        if max_growth is not None and ref is not None:
            new = min(new, ref * max_growth)
        if old is not None and self.rescale_others:
            ratio = new / old
            for b in self._tps:
                if b != batch:
                    self._tps[b] *= ratio
        self._tps[batch] = new
        return new

    def update_link(self, nbytes: int, seconds: float, direction: str, alpha: Optional[float] = None) -> float:
        """Fold in a transfer of ``nbytes`` in ``seconds``; ``direction`` 'up'/'upload' or
        'down'/'download'; ``alpha`` as in :meth:`update`. Returns the new bytes/s. Raises
        ValueError for a bad direction, ``nbytes <= 0``, ``seconds <= 0`` or a bad ``alpha``."""
        if alpha is not None and not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        key = {"up": "up", "upload": "up", "down": "down", "download": "down"}.get(direction)
        if key is None:
            raise ValueError(f"direction={direction!r}: expected 'up' or 'down'")
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"nbytes={nbytes} and seconds={seconds} must be > 0")
        new = self._link[key] = self._ema(self._link[key], nbytes / seconds, alpha)
        return new

    @property
    def tokens_per_s(self) -> dict[int, float]:
        return dict(sorted(self._tps.items()))

    @property
    def upload_bps(self) -> Optional[float]:
        return self._link["up"]

    @property
    def download_bps(self) -> Optional[float]:
        return self._link["down"]

    def record_fields(self) -> dict[str, Any]:
        """The known figures as PeerRecord fields (tokens_per_s, upload_bps, download_bps)."""
        out: dict[str, Any] = {}
        if self._tps:
            out["tokens_per_s"] = self.tokens_per_s
        if self.upload_bps is not None:
            out["upload_bps"] = self.upload_bps
        if self.download_bps is not None:
            out["download_bps"] = self.download_bps
        return out

    def apply(self, record: PeerRecord) -> PeerRecord:
        """A copy of ``record`` with the current figures (validated; timestamp unchanged)."""
        return PeerRecord.model_validate({**record.model_dump(), **self.record_fields()})


# --------------------------------------------------------------------------------------------
# full profile


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
    ``preset`` of :func:`geomesh_p2p.model.training.build_model` at ``vocab_size`` (default
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
        from geomesh_p2p.model.training import build_model  # only for the by-name convenience

        # The vocabulary a run trains with by default (the shipped tokenizer's), not the preset's own
        # (gpt2-124m's 50257 would measure a model 40% larger than the one `join` trains).
        vocab_size = SHIPPED_VOCAB_SIZE if vocab_size is None else vocab_size
        model_factory = build_model(preset, vocab_size=vocab_size)
    elif model_factory is None:  # excluded above; restated so the type checker sees it
        raise ValueError("give exactly one of model_factory and preset")
    model = _materialize(model_factory, dev)
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
