"""The compute device a peer trains on, and one measured training step on it.

:func:`detect_device` picks CUDA or the CPU and its memory budget for training (bytes);
:class:`MeasureSession` runs training steps on a live model for the measurements of
:mod:`geomesh_p2p.model.profile` and :mod:`geomesh_p2p.model.memory` without disturbing it: the
default optimizer is AdamW with ``lr=0`` (the same kernels run, the weights do not change),
gradients are cleared afterwards, the train/eval mode is restored and the global RNG state is
forked (dropout draws do not shift later training).
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional, Union

import torch

ModelOrFactory = Union[torch.nn.Module, Callable[[], torch.nn.Module]]


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


#: share of MemAvailable a CPU peer budgets for training when no budget is given
DEFAULT_CPU_MEMORY_FRACTION = 0.5


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


def parse_device(device: Union[str, torch.device, DeviceInfo]) -> torch.device:
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
    dev = parse_device(device)
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


def materialize(model: ModelOrFactory, dev: torch.device) -> torch.nn.Module:
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


def model_vocab_size(model: torch.nn.Module, vocab_size: Optional[int]) -> int:
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab_size or vocab_size < 1:
        raise ValueError("vocab_size is needed (model has no config.vocab_size)")
    return int(vocab_size)


def sync_device(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # lr=0: the full AdamW arithmetic runs, the weights stay bit-identical
    return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)


def timed_step(sess: "MeasureSession", x: torch.Tensor, dev: torch.device, speed_factor: float) -> float:
    """Seconds one training step on token ids ``x`` (int64 [batch, seq_len]) takes, device synchronised;
    ``speed_factor`` < 1 emulates a slower device by sleeping the difference (counted in the result)."""
    t0 = time.perf_counter()
    sess.step(x)
    sync_device(dev)
    dt = time.perf_counter() - t0
    if speed_factor < 1:
        time.sleep(dt * (1.0 / speed_factor - 1.0))
        dt = time.perf_counter() - t0
    return dt


class MeasureSession:
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

    def __enter__(self) -> "MeasureSession":
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


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device or the host running out of memory: ``torch.cuda.OutOfMemoryError``, a
    ``MemoryError``, or a RuntimeError saying "out of memory" (CUDA, MPS) or "can't allocate memory" (torch's
    CPU allocator)."""
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def free_after_oom(dev: torch.device) -> None:
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
