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

**Momentum clip** (``momentum_clip`` c > 0; the run config's ``outer_momentum_clip``, on for the sign-compressed
methods): after ``buf ← μ·buf + g`` every element of the momentum is clamped to ``±c·M_b``, ``M_b = max |g|``
over its block ``b`` of ``block_size`` consecutive elements (blocks counted from the start of the vector
stepped: a part's start in :func:`outer_step_per_part`, which for compressed methods is a multiple of the
codec block, so the blocks are the codec's). ``max`` and clamping are exact in any order, ``c·M_b`` is one
fp32 multiply per block: the clip adds no rounding that could differ between machines. Why: with few inner
steps per round (H = 2-3 in the e2e swarms, against DiLoCo's H = 500) the outer Nesterov step at lr 0.7,
μ 0.9 moves ~``η/(1-μ)`` = 7x one round's pseudo-gradient once the momentum has built up; when the
pseudo-gradients shrink (the loss leaves a plateau) the stale momentum overshoots and eval perplexity jumps
for a round (measured in process, benchmarks/outer_stability.py: 630 -> 6228 in round 8 with the sign codec,
615 -> 9103 with an fp32 mean; none with μ = 0). Bounding the state that carries stale steps by the
current step's scale is the update clipping of Adafactor (Shazeer & Stern 2018, arXiv 1804.04235, section 6)
and StableAdamW (Wortsman et al. 2023, arXiv 2304.13013), which fix loss spikes caused by stale optimizer
state; here the scale is the block's largest aggregate element, exact. With the sign codec an element of
the aggregate is ``±m_b`` or a fraction of it, so c = 2 keeps about two rounds of momentum where the signs
persist.
"""

from __future__ import annotations

import bisect
import copy
import math
from typing import Any, Sequence

import torch

__all__ = [
    "OuterNesterov",
    "SyncAdamW",
    "block_bounds",
    "clamp_blocks",
    "eager_args",
    "eager_start",
    "outer_step_per_part",
]


class OuterNesterov:
    """DiLoCo outer optimizer over a flat fp32 CPU parameter vector.

    Args:
        lr: outer learning rate η (DiLoCo: 0.7).
        momentum: Nesterov momentum μ (DiLoCo: 0.9).
        momentum_clip: c of the momentum clip (module doc): the momentum is clamped to ``±c·max|g|`` of
            its block after each update; 0 (the default) = off, the plain DiLoCo step.
        block_size: elements per block of the momentum clip (the codec's block).

    The momentum buffer (fp32 CPU ``[P]``) is created as zeros on the first
    :meth:`step`; :attr:`steps` counts applied steps.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, momentum_clip: float = 0.0, block_size: int = 2048):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        if not (momentum_clip >= 0 and math.isfinite(momentum_clip)) or block_size < 1:
            raise ValueError(f"need momentum_clip >= 0 and block_size >= 1, got {momentum_clip}, {block_size}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        #: c of the momentum clip (module doc); 0 = off
        self.momentum_clip = float(momentum_clip)
        #: elements per block of the momentum clip's bound
        self.block_size = int(block_size)
        self.buf: torch.Tensor | None = None
        self.steps = 0

    @staticmethod
    def _check(name: str, t: torch.Tensor) -> None:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )

    #: fp32 elements of optimizer state per parameter (the momentum buffer): state is ``[P]``.
    state_factor = 1

    @torch.no_grad()
    def step(self, theta: torch.Tensor, aggregate: torch.Tensor, round: int | None = None) -> None:
        """Apply one outer step to ``theta`` in place.

        Args:
            theta: global weights, fp32 CPU ``[P]`` (modified in place).
            aggregate: averaged pseudo-gradient ``θ_global − θ_local``, fp32 CPU ``[P]``
                (not modified).
            round: unused (the same signature as :meth:`SyncAdamW.step`).

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
        torch.add(buf, g, out=buf)  # buf = buf + g
        if self.momentum_clip > 0:
            clamp_blocks(buf, block_bounds(g, self.block_size, self.momentum_clip), 0, self.block_size)
        upd = torch.mul(buf, self.momentum)  # upd = μ·buf
        torch.add(g, upd, out=upd)  # upd = g + upd
        torch.mul(upd, self.lr, out=upd)  # upd = η·upd
        torch.sub(theta, upd, out=theta)  # θ = θ − upd
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """``{"lr", "momentum", "steps", "buf"}``; ``buf`` is the fp32 tensor (or None)."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "steps": self.steps,
            "buf": None if self.buf is None else self.buf.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; ``buf`` is copied to a contiguous fp32 CPU tensor."""
        self.lr = float(state.get("lr", self.lr))
        self.momentum = float(state.get("momentum", self.momentum))
        self.steps = int(state.get("steps", 0))
        buf = state.get("buf")
        self.buf = (
            None
            if buf is None
            else (buf.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous().clone())
        )


#: elements of the aggregate :func:`block_maxima` reads at a time (1 MiB): the chunk stays in a core's L2 cache
#: between its ``amax`` (which reads it from memory) and its ``amin``
BOUNDS_CHUNK = 1 << 18


def block_bounds(g: torch.Tensor, block_size: int, c: float) -> torch.Tensor:
    """``c·max|g|`` of each block of ``block_size`` consecutive elements of ``g`` (the last may be shorter):
    fp32 ``[ceil(n / B)]``. ``max`` is exact whatever the order of its reduction, and ``c·M`` one fp32
    multiply: the same bits on every machine. A NaN in a block gives a NaN bound. Reads
    :data:`BOUNDS_CHUNK` elements (whole blocks) at a time: ``|g|`` of a whole part was a ``[n]`` fp32 temporary
    beside the outer step (178 MB at ``gpt2-124m``'s half; issue 27, session 44), the same maxima."""
    return torch.mul(block_maxima(g, block_size), float(c))


def block_maxima(g: torch.Tensor, block_size: int) -> torch.Tensor:
    """``max|g|`` of each block of :func:`block_bounds` (NaN for a block with a NaN), fp32 ``[ceil(n / B)]``: one
    read pass of ``g`` from memory, :data:`BOUNDS_CHUNK` elements at a time: each block's ``amax`` and ``amin``
    (two reductions over a chunk in cache, nothing written but the ``[n / B]`` results; ``abs`` into a temporary
    then ``amax`` cost ~1.3x more, issue 27 session 46), then ``|max(amax, -amin)|``: the same value as
    ``amax(|g|)`` (``max``, ``min`` and negation are exact), ``+0`` for a block of zeros (the outer ``abs``:
    ``amax`` of ``-0`` is ``-0``). A block with a NaN (rare: its part is not stepped) is measured again as
    ``amax(|g|)``, so its NaN's bits are those of sessions 44-45 too."""
    n = g.numel()
    nfull = n // block_size
    out = torch.empty(-(-n // block_size), dtype=torch.float32)
    lo = torch.empty(nfull, dtype=torch.float32)
    step = max(1, BOUNDS_CHUNK // block_size) * block_size
    for a in range(0, nfull * block_size, step):
        b = min(nfull * block_size, a + step)
        v, k0, k1 = g[a:b].view((b - a) // block_size, block_size), a // block_size, b // block_size
        torch.amax(v, dim=1, out=out[k0:k1])
        torch.amin(v, dim=1, out=lo[k0:k1])
    torch.maximum(out[:nfull], torch.neg(lo, out=lo), out=out[:nfull])
    torch.abs(out[:nfull], out=out[:nfull])
    for k in torch.isnan(out[:nfull]).nonzero().flatten().tolist():  # rare: the part is not stepped
        v = g[k * block_size : (k + 1) * block_size].view(1, block_size)
        torch.amax(torch.abs(v), dim=1, out=out[k : k + 1])  # amax(|g|)'s own NaN bits
    if nfull * block_size < n:
        out[nfull] = torch.abs(g[nfull * block_size :]).amax()
    return out


def clamp_blocks(x: torch.Tensor, bounds: torch.Tensor, offset: int, block_size: int) -> None:
    """In place ``x[i] = min(max(x[i], -b), b)`` with ``b = bounds[(offset + i) // block_size]``: ``x`` holds the
    elements ``[offset, offset + len(x))`` of a vector whose blocks :func:`block_bounds` measured; a block whose
    bound is 0 is set to ``+0``. Exact (min / max round nothing), so any split of the vector into pieces, any thread
    count and any vector width give the same bits."""
    _clamp(x, bounds.unsqueeze(1), torch.neg(bounds).unsqueeze(1), offset, block_size, zero_blocks(bounds))


def zero_blocks(bounds: torch.Tensor) -> list[int]:
    """Sorted indices of the blocks whose bound is 0 (``bounds``: fp32 ``[n_blocks]``, :func:`block_bounds`)."""
    return torch.eq(bounds, 0).nonzero().flatten().tolist()


def _clamp(
    x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, offset: int, block_size: int, zeros: Sequence[int] = ()
) -> None:
    """:func:`clamp_blocks` with the bounds ``hi`` = ``bounds[:, None]``, ``lo`` = ``-bounds[:, None]`` and the
    bound-0 blocks ``zeros`` (:func:`zero_blocks`) made once (the fused step clamps a part block after block): a head
    to the next block start, the whole blocks as one ``[m, B]`` view and a tail, ``minimum`` then ``maximum`` on
    each, then every element of a bound-0 block set to ``+0``.

    Why the last (issue 27, session 46): ``minimum`` / ``maximum`` of ``-0`` and ``+0`` may return either, and
    torch's CPU kernels return one or the other by whether an element falls in their vectorised loop or its scalar
    tail, i.e. by thread count, vector width and where a piece starts: 1 and 3 threads differed in 14 of 131,072
    elements of such a block, so two honest peers' momentum, and their state digests, could differ. Off a zero
    bound the two kernels never compare signed zeros with each other (``|b| > 0``): the same bits everywhere."""
    n = x.numel()
    i = 0
    head = min(n, (-offset) % block_size)
    if head:
        k = offset // block_size
        torch.minimum(x[:head], hi[k, 0], out=x[:head])
        torch.maximum(x[:head], lo[k, 0], out=x[:head])
        i = head
    k = (offset + i) // block_size
    m = (n - i) // block_size
    if m:
        v = x[i : i + m * block_size].view(m, block_size)
        torch.minimum(v, hi[k : k + m], out=v)
        torch.maximum(v, lo[k : k + m], out=v)
        i += m * block_size
    if i < n:
        torch.minimum(x[i:], hi[k + m, 0], out=x[i:])
        torch.maximum(x[i:], lo[k + m, 0], out=x[i:])
    if zeros:
        first, end = offset // block_size, (offset + n - 1) // block_size
        for z in zeros[bisect.bisect_left(zeros, first) : bisect.bisect_right(zeros, end)]:
            x[max(0, z * block_size - offset) : min(n, (z + 1) * block_size - offset)].zero_()


def eager_args(outer) -> dict[str, Any]:
    """The keyword arguments of :func:`eager_start` that ``outer`` (an :class:`OuterNesterov`) steps with: lr,
    momentum, momentum clip and its block size. Raises TypeError for another optimizer (SyncAdamW: ddp has no
    eager updates)."""
    if not isinstance(outer, OuterNesterov):
        raise TypeError(f"eager updates need the outer Nesterov optimizer, not {type(outer).__name__}")
    return {
        "lr": outer.lr,
        "momentum": outer.momentum,
        "momentum_clip": outer.momentum_clip,
        "block_size": outer.block_size,
    }


def eager_start(
    theta: torch.Tensor,
    momentum_buf: torch.Tensor,
    delta: torch.Tensor,
    weight: float,
    *,
    lr: float,
    momentum: float,
    momentum_clip: float = 0.0,
    block_size: int = 2048,
) -> torch.Tensor:
    """Eager updates (docs/eager.md): the start weights of a peer's next round,
    ``x = O(θ, v; w·Δ)``: one :class:`OuterNesterov` step of copies of the global weights ``θ`` and
    momentum ``v`` by this peer's own pseudo-gradient ``Δ`` scaled by its token weight ``w``. The same
    six fp32 kernels as the outer step (the share ``w·Δ`` is one more, rounded once), so it is
    bit-identical to the simulator's ``Simulator._eager_starts`` for the same inputs.

    Args:
        theta, momentum_buf, delta: fp32 CPU ``[P]`` (not modified).
        weight: ``w``, a Python float (rounded to fp32 once by the multiply).
        lr, momentum: the run's outer lr and Nesterov momentum.
        momentum_clip, block_size: the outer optimizer's momentum clip (:class:`OuterNesterov`).

    Returns:
        A new fp32 CPU ``[P]`` tensor. Peak memory: three more ``[P]`` (the result, the momentum copy,
        the share) while it runs, the result after.

    Raises:
        ValueError: dtype / device / shape as :meth:`OuterNesterov.step`.
    """
    o = OuterNesterov(lr=lr, momentum=momentum, momentum_clip=momentum_clip, block_size=block_size)
    OuterNesterov._check("momentum_buf", momentum_buf)
    o.buf = momentum_buf.clone()
    x = theta.clone()
    o.step(x, (delta * float(weight)).contiguous())
    return x


class SyncAdamW:
    """AdamW over the swarm's averaged gradient, for the ``ddp`` baseline (a sync every step).

    DDP semantics (Li et al. 2020, "PyTorch Distributed"; DiLoCo's data-parallel baseline): every
    peer computes the gradient of its own batch, the swarm averages the gradients (token-weighted
    fp32 mean), and every peer applies the *same* optimizer step to the *same* global weights. As
    with :class:`OuterNesterov`, the update is separate elementwise fp32 kernels (no fused
    ``addcdiv_``/``lerp_``, no reduction, hence no gradient clipping), so the result is
    bit-identical on every peer and the state can be digested, checkpointed and sent to a late
    joiner. Loshchilov & Hutter 2019 (decoupled weight decay)::

        m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²
        θ ← θ − η_t·λ·mask·θ          θ ← θ − η_t·(m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)

    with ``t = round + 1`` (every round is one step, so the step count is the round number and
    needs no state of its own) and ``η_t = lr_at(round)`` (warm-up + cosine, the inner schedule).

    Args:
        lr_at: ``round -> learning rate`` (a Python float).
        betas, eps, weight_decay: AdamW's (DiLoCo's inner settings: (0.9, 0.95), 1e-8, 0.1).
        decay_mask: fp32 CPU ``[P]`` of 0/1: which elements get weight decay (matrices, not
            biases or norms, like the inner optimizer); None decays none.

    State: :attr:`buf` = ``[m; v]``, fp32 CPU ``[2P]`` (zeros until the first step).
    """

    state_factor = 2

    def __init__(
        self,
        lr_at,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        decay_mask: torch.Tensor | None = None,
    ):
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"need 0 <= betas < 1, eps > 0, weight_decay >= 0; got {betas}, {eps}, {weight_decay}")
        self.lr_at = lr_at
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decay_mask = decay_mask
        self.buf: torch.Tensor | None = None
        self.steps = 0

    @torch.no_grad()
    def step(self, theta: torch.Tensor, aggregate: torch.Tensor, round: int | None = None) -> None:
        """Apply the AdamW step of round ``round`` (0-based) to ``theta`` in place.

        Args:
            theta: global weights, fp32 CPU ``[P]`` (modified in place).
            aggregate: the swarm's mean gradient, fp32 CPU ``[P]`` (not modified).
            round: the round being finished; ``None`` uses the count of steps applied here.

        Raises:
            ValueError: wrong dtype / device / shape; a state or mask of the wrong size.
        """
        OuterNesterov._check("theta", theta)
        OuterNesterov._check("aggregate", aggregate)
        p = theta.numel()
        if aggregate.numel() != p:
            raise ValueError(f"theta {p} and aggregate {aggregate.numel()} elements differ")
        if self.buf is None:
            self.buf = torch.zeros(2 * p, dtype=torch.float32)
        elif self.buf.numel() != 2 * p:
            raise ValueError(f"AdamW state has {self.buf.numel()} elements, expected 2 x {p}")
        if self.decay_mask is not None and self.decay_mask.numel() != p:
            raise ValueError(f"decay mask has {self.decay_mask.numel()} elements, theta {p}")
        t = (self.steps if round is None else int(round)) + 1
        lr = float(self.lr_at(t - 1))
        m, v, g = self.buf[:p], self.buf[p:], aggregate
        torch.mul(m, self.beta1, out=m)
        tmp = torch.mul(g, 1.0 - self.beta1)
        torch.add(m, tmp, out=m)  # m = β1·m + (1−β1)·g
        torch.mul(v, self.beta2, out=v)
        torch.mul(g, g, out=tmp)
        torch.mul(tmp, 1.0 - self.beta2, out=tmp)
        torch.add(v, tmp, out=v)  # v = β2·v + (1−β2)·g²
        if self.weight_decay > 0 and self.decay_mask is not None:
            torch.mul(theta, lr * self.weight_decay, out=tmp)
            torch.mul(tmp, self.decay_mask, out=tmp)  # exact: the mask is 0 or 1
            torch.sub(theta, tmp, out=theta)  # θ = θ − η·λ·mask·θ
        denom = torch.div(v, 1.0 - self.beta2**t)
        torch.sqrt(denom, out=denom)  # IEEE sqrt: correctly rounded everywhere
        torch.add(denom, self.eps, out=denom)
        torch.div(m, 1.0 - self.beta1**t, out=tmp)
        torch.div(tmp, denom, out=tmp)
        torch.mul(tmp, lr, out=tmp)
        torch.sub(theta, tmp, out=theta)  # θ = θ − η·m̂/(sqrt(v̂)+ε)
        self.steps = t


#: Elements per block of the fused Nesterov step (:func:`_nesterov_fused`): 512 Ki fp32 = 2 MiB per array, so a
#: block's weights, momentum, aggregate and scratch (8 MiB) stay in cache between its 6-8 kernels. Issue 27, session
#: 46, one thread at P = 89M: 128 Ki took ~10 % longer (4x the calls, ~1 µs each, 8 a block); 1 Mi no faster.
FUSED_BLOCK = 1 << 19
#: Inputs bounded by this (and the outer lr below :data:`FUSED_MAX_LR`) cannot make the Nesterov step overflow
#: fp32 (max 3.4e38): |new momentum| <= 2T, |update| <= lr x 3T, |new weight| <= T + 3 lr T.
FUSED_BOUND = 1e30
FUSED_MAX_LR = 1e6


def _abs_max(t: torch.Tensor) -> float:
    """max |t| in one read pass (NaN when t holds a NaN, inf for an inf; 0 for an empty tensor). ``aminmax``:
    ~10x faster on one CPU thread than ``vector_norm(inf)`` or ``isfinite().all()`` (vectorised, no temporary)."""
    if not t.numel():
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(t))
    if math.isnan(lo) or math.isnan(hi):
        return math.nan
    return max(-lo, hi)


def _max_of(maxima: torch.Tensor) -> float:
    """The largest of :func:`block_maxima` (NaN when one is NaN; 0 for none): the part's :func:`_abs_max`."""
    return float(maxima.max()) if maxima.numel() else 0.0


def _state_bound(outer, theta: torch.Tensor) -> float:
    """A bound of max |θ|, |momentum| over the whole vectors: the one the fused step recorded after its last
    write (:func:`_bound_after`) when neither tensor changed since (torch's in-place version counters) and it
    is still under :data:`FUSED_BOUND`, else measured (two read passes: the first step, after a state load or
    any other write, or every ~150 rounds when the recorded bound has grown past :data:`FUSED_BOUND`)."""
    buf = outer.buf
    key = (theta.data_ptr(), theta._version, buf.data_ptr(), buf._version)
    cached = getattr(outer, "_fused_bound", None)
    if cached is not None and cached[0] == key and cached[1] <= FUSED_BOUND:
        return cached[1]
    return max(_abs_max(theta), _abs_max(buf))


def _scalar(x: float) -> torch.Tensor:
    """``x`` as a 0-dim fp32 tensor: a kernel rounds a Python float operand to fp32 once, so the products are the same
    bits; a tensor skips wrapping the float anew on each call (~5 µs a kernel, 4 of them per block)."""
    return torch.tensor(float(x), dtype=torch.float32)


def _nesterov_fused(
    outer: OuterNesterov, theta, aggregate, spans: Sequence[tuple[int, int]], part_start: int = 0, bounds=None
) -> None:
    """One :meth:`OuterNesterov.step` on the elements of ``spans`` of ``theta`` / ``outer.buf``, block by block
    (:data:`FUSED_BLOCK`): every kernel of a block works in cache, so the step reads θ, the momentum and the
    aggregate once from memory and writes θ and the momentum once (5 passes over the state, against 4 for a
    ``copy_`` of θ and the momentum; the whole-vector step makes ~14 and the per-part one ~21 with its copies).
    The same kernels in the same order as :meth:`OuterNesterov.step`: bitwise equal. The caller checked that no
    value can overflow. ``bounds``: the momentum clip's per-block bounds of the part that starts at
    ``part_start`` (:func:`block_bounds` of its aggregate), or None (no clip).

    In cache a block costs its kernels' array streams (~150 GB/s here): ``μ·buf`` is written over the momentum
    itself (r/w 1 array; the scratch copy of sessions 39-45 held the same value and cost r 1, w 1 more), μ and η
    are fp32 0-dim tensors (:func:`_scalar`), the clip's ``±bounds`` and bound-0 blocks are found once a part
    (:func:`_clamp`). Kernels a block: ``buf·μ``, ``+g`` (the clip's ``minimum``, ``maximum``), ``buf·μ -> u``,
    ``g+u``, ``u·η``, ``θ-u``."""
    buf = outer.buf
    assert buf is not None
    mu, lr = _scalar(outer.momentum), _scalar(outer.lr)
    upd = torch.empty(FUSED_BLOCK, dtype=torch.float32)
    if bounds is not None:
        hi, lo, zeros = bounds.unsqueeze(1), torch.neg(bounds).unsqueeze(1), zero_blocks(bounds)
    for s, e in spans:
        for a in range(s, e, FUSED_BLOCK):
            z = min(e, a + FUSED_BLOCK)
            g, b, th, u = aggregate[a:z], buf[a:z], theta[a:z], upd[: z - a]
            torch.mul(b, mu, out=b)  # buf = μ·buf
            torch.add(b, g, out=b)  # buf = buf + g
            if bounds is not None:
                _clamp(b, hi, lo, a - part_start, outer.block_size, zeros)
            torch.mul(b, mu, out=u)  # u = μ·buf
            torch.add(g, u, out=u)  # u = g + u
            torch.mul(u, lr, out=u)  # u = η·u
            torch.sub(th, u, out=th)  # θ = θ − u


def _bound_after(outer: OuterNesterov, state_bound: float, g_max: float) -> float:
    """An upper bound of max |θ|, |momentum| after a Nesterov step from state bounded by ``state_bound`` with
    an aggregate bounded by ``g_max``: |b'| <= μB + G, |θ'| <= B + η(G + μ|b'|). No pass over the data: the
    bound only grows (~1.6x a round at η 0.7, μ 0.9), and once past :data:`FUSED_BOUND` it is measured again."""
    mu, lr = outer.momentum, outer.lr
    b_new = mu * state_bound + g_max
    return max(b_new, state_bound + lr * (g_max + mu * b_new))


def _minus(s: int, e: int, idle: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[s, e)`` less the ``idle`` ranges, as sorted disjoint spans."""
    spans = [(s, e)]
    for i0, i1 in sorted(idle):
        out = []
        for a, b in spans:
            if i1 <= a or i0 >= b:
                out.append((a, b))
                continue
            if a < i0:
                out.append((a, i0))
            if i1 < b:
                out.append((i1, b))
        spans = out
    return spans


def outer_step_per_part(
    outer,
    theta: torch.Tensor,
    aggregate: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    r: int,
    idle: Sequence[tuple[int, int]] = (),
) -> tuple[list, set]:
    """Apply ``outer``'s step (OuterNesterov / SyncAdamW: element-wise) part by part, in place.

    Each part ``[s, e)`` of ``ranges`` steps on a private copy of its slices of ``theta`` and of the k
    optimizer-state slices (``outer.buf``: k consecutive [P] slices, Nesterov momentum or AdamW m then v),
    written back only when every new value is finite; a part whose aggregate is not finite is not stepped.
    Elements in ``idle`` ranges keep weights and state. Peak extra memory is (1 + k) x the largest part
    (not (1 + k) x P: 1.2 GB at 150M parameters). Bitwise equal to one whole-vector step on the parts
    that step (the ops are element-wise).

    An :class:`OuterNesterov` part whose aggregate, weights and momentum are all within
    :data:`FUSED_BOUND` cannot overflow: it is stepped in place, block by block in cache
    (:func:`_nesterov_fused`, no copies; issue 27: the per-part step took 21x a ``copy_`` of the state at
    89M parameters, the fused one ~1.5x), bitwise equal to the copy-and-check path below, which the other
    parts and optimizers take.

    Args:
        theta: [P] fp32 CPU global weights (modified in place).
        aggregate: [P] fp32 CPU, not modified.
    Returns:
        (parts skipped, sorted; the subset of them skipped for a non-finite aggregate).
    """
    p = theta.numel()
    if outer.buf is None:
        outer.buf = torch.zeros(p * int(getattr(outer, "state_factor", 1)), dtype=torch.float32)
    buf = outer.buf
    k = buf.numel() // p if p else 0
    steps_after = None
    bad, bad_in = [], set()
    fused = type(outer) is OuterNesterov and k == 1 and outer.lr < FUSED_MAX_LR
    state_bound = _state_bound(outer, theta) if fused else float("inf")
    written = 0.0  # a bound of the values the fused step wrote
    clip = fused and outer.momentum_clip > 0
    for s, e in ranges:
        # With the momentum clip the part's max |g| is the max of its block maxima, which the clip needs anyway:
        # one read pass of the aggregate fewer (issue 27, session 45), the same value (NaN and inf included)
        maxima = block_maxima(aggregate[s:e], outer.block_size) if clip else None
        g_max = _abs_max(aggregate[s:e]) if maxima is None else _max_of(maxima)
        if not g_max == g_max or g_max == float("inf"):  # a NaN or an inf in the part's aggregate
            bad.append((s, e))
            bad_in.add((s, e))
            continue
        if fused and g_max <= FUSED_BOUND and state_bound <= FUSED_BOUND:
            bounds = None if maxima is None else torch.mul(maxima, float(outer.momentum_clip))  # = block_bounds
            _nesterov_fused(outer, theta, aggregate, _minus(s, e, idle), s, bounds)
            written = max(written, _bound_after(outer, state_bound, g_max))
            steps_after = outer.steps + 1
            continue
        part = copy.copy(outer)  # shares lr / momentum / schedule; its buffer is this part's own copy
        part.buf = torch.cat([buf[j * p + s : j * p + e] for j in range(k)]) if k else None
        if getattr(outer, "decay_mask", None) is not None:
            part.decay_mask = outer.decay_mask[s:e]
        new = theta[s:e].clone()
        part.step(new, aggregate[s:e].contiguous(), round=r)
        steps_after = part.steps
        if not bool(torch.isfinite(new).all()) or (part.buf is not None and not bool(torch.isfinite(part.buf).all())):
            bad.append((s, e))
            continue
        n = e - s
        for i0, i1 in idle:  # idle elements keep their values
            a0, a1 = max(i0, s), min(i1, e)
            if a0 < a1:
                new[a0 - s : a1 - s] = theta[a0:a1]
                for j in range(k):
                    part.buf[j * n + a0 - s : j * n + a1 - s] = buf[j * p + a0 : j * p + a1]
        theta[s:e] = new
        for j in range(k):
            buf[j * p + s : j * p + e] = part.buf[j * n : (j + 1) * n]
    if steps_after is None:  # no part stepped: the step count still advances, as a whole-vector step would
        part = copy.copy(outer)
        part.buf = torch.zeros(0) if k else None
        if getattr(outer, "decay_mask", None) is not None:
            part.decay_mask = outer.decay_mask[:0]
        part.step(theta[:0].clone(), aggregate[:0].contiguous(), round=r)
        steps_after = part.steps
    outer.steps = steps_after
    if fused:
        # Elements outside the stepped parts kept their values (bounded by state_bound); the parts stepped
        # are bounded by what was written: the next step skips the two read passes while nothing else wrote.
        outer._fused_bound = (
            (theta.data_ptr(), theta._version, buf.data_ptr(), buf._version),
            max(written, state_bound),
        )
    return sorted(bad), bad_in
