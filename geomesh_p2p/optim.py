"""Outer optimizer: SGD with Nesterov momentum over the global weights (DiLoCo).

Source: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv 2311.08105): the outer optimizer is SGD with Nesterov momentum,
lr 0.7, momentum 0.9, applied to the averaged outer gradient
``Δ = θ_global − θ_local`` (a descent direction, like a gradient).

Update, with ``g`` the aggregate, ``μ`` the momentum and ``η`` the lr (PyTorch's
``SGD(nesterov=True, dampening=0)`` convention)::

    buf ← μ·buf + g
    θ   ← θ − η·(g + μ·buf)

Bit-identical on every machine: θ and buf are fp32 CPU tensors and the update is six
separate elementwise kernels, each rounding once (IEEE-754 single precision, round to
nearest even). There is no fused multiply-add, no ``alpha=`` argument, no ``addcmul_`` /
``lerp_`` (whose contraction into FMA differs between instruction sets and kernels), and
no reduction. ``μ`` and ``η`` enter as Python floats, which PyTorch rounds to fp32 once
for fp32 tensors.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OuterNesterov"]


class OuterNesterov:
    """DiLoCo outer optimizer over a flat fp32 CPU parameter vector.

    Args:
        lr: outer learning rate η (DiLoCo: 0.7).
        momentum: Nesterov momentum μ (DiLoCo: 0.9).

    The momentum buffer (fp32 CPU ``[P]``) is created as zeros on the first
    :meth:`step`; :attr:`steps` counts applied steps.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buf: torch.Tensor | None = None
        self.steps = 0

    @staticmethod
    def _check(name: str, t: torch.Tensor) -> None:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D fp32 CPU tensor, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")

    @torch.no_grad()
    def step(self, theta: torch.Tensor, aggregate: torch.Tensor) -> None:
        """Apply one outer step to ``theta`` in place.

        Args:
            theta: global weights, fp32 CPU ``[P]`` (modified in place).
            aggregate: averaged pseudo-gradient ``θ_global − θ_local``, fp32 CPU ``[P]``
                (not modified).

        Raises:
            ValueError: wrong dtype / device / shape, or a size different from the
                momentum buffer's.
        """
        self._check("theta", theta)
        self._check("aggregate", aggregate)
        if theta.shape != aggregate.shape:
            raise ValueError(f"theta {tuple(theta.shape)} and aggregate {tuple(aggregate.shape)} differ")
        if self.buf is None:
            self.buf = torch.zeros_like(theta)
        elif self.buf.shape != theta.shape:
            raise ValueError(f"momentum buffer has {self.buf.numel()} elements, theta {theta.numel()}")
        g = aggregate
        buf = self.buf
        torch.mul(buf, self.momentum, out=buf)  # buf = μ·buf
        torch.add(buf, g, out=buf)              # buf = buf + g
        upd = torch.mul(buf, self.momentum)     # upd = μ·buf
        torch.add(g, upd, out=upd)              # upd = g + upd
        torch.mul(upd, self.lr, out=upd)        # upd = η·upd
        torch.sub(theta, upd, out=theta)        # θ = θ − upd
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """``{"lr", "momentum", "steps", "buf"}``; ``buf`` is the fp32 tensor (or None)."""
        return {"lr": self.lr, "momentum": self.momentum, "steps": self.steps,
                "buf": None if self.buf is None else self.buf.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; ``buf`` is copied to a contiguous fp32 CPU tensor."""
        self.lr = float(state.get("lr", self.lr))
        self.momentum = float(state.get("momentum", self.momentum))
        self.steps = int(state.get("steps", 0))
        buf = state.get("buf")
        self.buf = None if buf is None else (
            buf.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous().clone())
