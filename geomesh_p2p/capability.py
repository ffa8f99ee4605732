"""Measuring a device for the planner: memory, tokens/s per batch size, link bandwidth.

DESIGN.md, "capability" and "Round r" step 7. A peer profiles itself at start-up (``profile``,
shown by ``geomesh-peer profile``) and announces the result in its
:class:`~geomesh_p2p.records.PeerRecord`; during the run :class:`ThroughputEMA` folds each round's
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

from geomesh_p2p.records import PeerRecord

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


class _Session:
    """Model in train mode, an optimizer, forked RNG; restores the model's state on exit."""

    def __init__(self, model: torch.nn.Module, dev: torch.device, optimizer_factory: Optional[OptimizerFactory],
                 amp: bool = False):
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
        if self.dev.type == "cuda":  # (a full gc costs ~1 s with transformers loaded: only where it frees device memory)
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
    (as :class:`geomesh_p2p.training.InnerTrainer` trains there); ignored on CPU.

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
                    t0 = time.perf_counter()
                    sess.step(x)
                    _sync(dev)
                    dt = time.perf_counter() - t0
                    if speed_factor < 1:
                        time.sleep(dt * (1.0 / speed_factor - 1.0))
                        dt = time.perf_counter() - t0
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
# bandwidth and re-profiling


def measure_bandwidth(transfers: Iterable[tuple[int, float]], latency_s: float = 0.0) -> float:
    """Bandwidth in bytes/s from observed transfers ``(bytes, seconds)``.

    ``sum(bytes) / sum(max(seconds - latency_s, 1e-9))``: the total over the total, so large
    transfers dominate; ``latency_s`` (a per-transfer fixed cost, e.g. a measured RTT) is taken
    out of each duration. Raises ValueError for no transfers, negative bytes, non-positive or
    non-finite seconds, a negative latency or zero bytes in total.
    """
    if latency_s < 0 or not math.isfinite(latency_s):
        raise ValueError(f"latency_s={latency_s} must be >= 0")
    total_bytes, total_s, n = 0, 0.0, 0
    for nbytes, seconds in transfers:
        if nbytes < 0:
            raise ValueError(f"transfer of {nbytes} bytes: bytes must be >= 0")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"transfer took {seconds} s: seconds must be > 0")
        total_bytes += nbytes
        total_s += max(seconds - latency_s, 1e-9)
        n += 1
    if n == 0:
        raise ValueError("no transfers to measure bandwidth from")
    if total_bytes == 0:
        raise ValueError("transfers moved 0 bytes: no bandwidth to infer")
    return total_bytes / total_s


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
        for direction, v in (("up", upload_bps), ("down", download_bps)):
            if v is not None:
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"{direction}load_bps={v} must be > 0")
                self._link[direction] = float(v)

    def _ema(self, old: Optional[float], x: float, alpha: Optional[float] = None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        return x if old is None else a * x + (1.0 - a) * old

    def update(self, batch: int, tokens: int, seconds: float, alpha: Optional[float] = None,
               max_growth: Optional[float] = None) -> float:
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
        self._link[key] = self._ema(self._link[key], nbytes / seconds, alpha)
        return self._link[key]

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
    steps: int = 3,
    warmup: int = 1,
    speed_factor: float = 1.0,
    max_measured_batch: int = 64,
    limit: int = 1024,
) -> dict[str, Any]:
    """Profile this machine for a model: device, max batch, tokens/s per batch, stated bandwidth.

    The model is ``model_factory`` (a module or a callable building one) or, by name, a
    ``preset`` of :func:`geomesh_p2p.training.build_model` (with ``vocab_size`` if given).
    ``memory_budget_bytes``: the training memory budget on a CPU (default: a share of
    MemAvailable), a cap on the free memory on a GPU.

    Returns a JSON-serialisable dict: ``device`` {kind, name, memory_bytes, index}, ``seq_len``,
    ``n_params``, ``max_batch``, ``tokens_per_s`` {batch: tokens/s} (for ``batch_sizes`` up to
    ``max_batch``; default: powers of two up to ``min(max_batch, max_measured_batch)``),
    ``bandwidth`` ({upload_bps, download_bps} in bytes/s as stated by flags, or None: links are
    measured during the run), ``speed_factor``. Raises ValueError for neither or both of
    ``model_factory``/``preset``, a non-positive bandwidth or budget, and as
    :func:`detect_device`, :func:`find_max_batch` and :func:`measure_throughput` do; RuntimeError
    when no batch size could be measured.
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
        from geomesh_p2p.training import build_model  # only for the by-name convenience

        model_factory = build_model(preset, vocab_size=vocab_size)
    model = _materialize(model_factory, dev)
    n_params = sum(p.numel() for p in model.parameters())
    max_batch = find_max_batch(model, seq_len, dev, info.memory_bytes, limit=limit, vocab_size=vocab_size)
    sizes = sorted(set(batch_sizes)) if batch_sizes is not None else default_batch_sizes(max_batch, max_measured_batch)
    if not sizes:
        raise ValueError("batch_sizes is empty")
    sizes = [b for b in sizes if b <= max_batch] or [max_batch]
    tps = measure_throughput(
        model, seq_len, sizes, dev, vocab_size, steps=steps, warmup=warmup, speed_factor=speed_factor
    )
    if not tps:
        raise RuntimeError(f"no batch size of {sizes} could be measured on {info.name}")
    bandwidth = None
    if upload_bps is not None or download_bps is not None:
        bandwidth = {"upload_bps": upload_bps, "download_bps": download_bps}
    return {
        "device": asdict(info),
        "seq_len": seq_len,
        "n_params": n_params,
        "max_batch": max_batch,
        "tokens_per_s": tps,
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
        how = (f"measured against {bw['measured_against']}, RTT {1000 * bw.get('rtt_s', 0.0):.1f} ms"
               if bw.get("measured_against") else "stated")
        # Mbit/s, the unit of the --upload-mbps / --download-mbps flags
        mbit = lambda v: "-" if not v else f"{v * 8 / 1e6:,.1f} Mbit/s"  # noqa: E731
        lines.append(
            f"bandwidth   up {mbit(up)}, down {mbit(down)} ({how})"
            if (up or down)
            else "bandwidth   not stated"
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
