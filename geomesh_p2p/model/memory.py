"""Memory: what training a model needs and what this process holds (bytes).

The peak of a training step as a function of the batch (:class:`MemoryEstimate`,
:func:`estimate_memory`, :func:`find_max_batch`), the least memory a method needs for a model
(:func:`method_min_memory`, :func:`preset_min_memory`; issue 13), memory probes (:func:`rss_probe`
on the CPU, the allocator's peak on CUDA) and :func:`release_freed_memory` (glibc's
``malloc_trim``), which the inner trainer calls after each round.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from geomesh_p2p.config.method import COMPRESSED_METHODS
from geomesh_p2p.util.malloc import _glibc
from geomesh_p2p.util.malloc import limit_malloc_arenas  # noqa: F401  (re-exported: callers import it from here)
from geomesh_p2p.util.procstat import status_bytes
from geomesh_p2p.model.build import count_params
from geomesh_p2p.model.device import (
    DeviceInfo,
    MeasureSession,
    ModelOrFactory,
    free_after_oom,
    is_oom,
    materialize,
    model_vocab_size,
    parse_device,
    sync_device,
)

#: fp32 bytes per parameter kept besides weights, grads and optimizer state: the global weights
#: copy and the outer (Nesterov) momentum (DESIGN.md "Round r" step 5)
DEFAULT_EXTRA_BYTES_PER_PARAM = 8


#: headroom on measured activation memory for what autograd does not save: the gradient of the
#: logits and of one layer's activations during backward, allocator fragmentation
DEFAULT_ACTIVATION_SAFETY = 1.5


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
    dev = parse_device(device)
    m = materialize(model, dev)
    vocab = model_vocab_size(m, vocab_size)
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
    dev = parse_device(device)
    m = materialize(model, dev)
    if dev.type != "cuda":
        est = estimate_memory(m, seq_len, dev, vocab_size)
        best = min(est.max_batch(memory_bytes), limit)
        if best < start:
            raise ValueError(
                f"memory_bytes={memory_bytes} is below the estimate for batch {start}:"
                f" {est.bytes_for(start)} bytes ({est.static_bytes} static + {est.per_sequence_bytes}/sequence)"
            )
        return int(best)

    vocab = model_vocab_size(m, vocab_size)
    gen = torch.Generator().manual_seed(0)
    with MeasureSession(m, dev, None) as sess:

        def fits(b: int) -> bool:
            x = None
            try:
                torch.cuda.reset_peak_memory_stats(dev)
                x = torch.randint(0, vocab, (b, seq_len), generator=gen).to(dev)
                sess.step(x)
                sync_device(dev)
                return torch.cuda.max_memory_allocated(dev) <= memory_bytes
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                return False
            finally:
                del x
                sess.opt.zero_grad(set_to_none=True)
                free_after_oom(dev)

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
    without allocating them (:func:`geomesh_p2p.model.build.count_params`). Raises
    :class:`geomesh_p2p.model.build.ConfigError` for an unknown preset."""
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


def release_freed_memory() -> bool:
    """Give memory freed by tensors back to the OS (glibc's ``malloc_trim(0)``); True when it could.

    PyTorch's CPU allocator is glibc malloc. glibc raises its mmap threshold (up to 32 MiB) each time
    an mmapped block is freed, after which blocks below it come from the heap, and a freed heap block
    stays in the process's RSS until a trim: call this where big blocks were just freed (after the
    start-up profile, after a round's gradients are freed), off the event loop. ``malloc_trim(0)``
    returns every whole free page of the heap, not only its top. A fixed mmap threshold instead is
    :func:`geomesh_p2p.util.malloc.set_mmap_threshold` (``join --mmap-threshold-mib``). Other C libraries
    (musl, macOS): nothing happens, False.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def rss_probe(fn: Callable[[], None], interval_s: float = 0.002) -> tuple[int, int]:
    """Run ``fn`` and return ``(RSS before, peak RSS while it ran)`` of this process, bytes.

    The peak is sampled from /proc/self/statm every ``interval_s`` by a helper thread (a training
    step holds its activations for tens of milliseconds, far longer than the interval). The kernel's
    VmHWM is not reset (``clear_refs``), so an outside observer's peak RSS stays meaningful.
    Raises OSError where /proc/self/statm is unreadable.
    """
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


def cuda_probe(dev: torch.device) -> MemoryProbe:
    def probe(fn: Callable[[], None]) -> tuple[int, int]:
        sync_device(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        sync_device(dev)
        return int(before), int(torch.cuda.max_memory_allocated(dev))

    return probe


def process_peaks() -> dict[str, int]:
    """This process's peak memory so far, bytes: ``rss_peak_bytes`` (the kernel's VmHWM from
    /proc/self/status; absent where unreadable) and, once CUDA is initialised, ``device_peak_bytes``
    (``torch.cuda.max_memory_allocated`` of the current device since its last reset: the start-up
    profile resets it, so after the first round it is the rounds' peak). Cheap (one small file read):
    the round row carries it (issue 27's peak against the method's minimum)."""
    out = {"rss_peak_bytes": v for v in status_bytes("VmHWM").values()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out
