"""Verified work's private model without a resident copy of the weights (issue 27).

The verifier re-runs a contributor's batches on a model of its own. A whole deep copy held the model's
weights (4P bytes) for the whole run, besides the node's model; a check then loaded the round's start
weights into it, so the kept file's pages, the copy and the check's gradients were resident together.

A *hollow* copy (:func:`hollow_copy`) has the model's modules and buffers but parameters of 0 elements.
While a check runs its parameters are views of the round's start weights (:func:`load_for_check`: the kept
weights' copy-on-write file mapping, read, never written), and between checks they are released
(:func:`release_`). A check then holds the start weights once (the file's pages), plus the gradients of its
gradient passes or, for the loss-gain test's second pass, private copies of the parameters its contribution
moves (:func:`sub_flat_`). A model that is not hollow (the GPU path: device memory, not the host's) is loaded
by copy as before.
"""

from __future__ import annotations

import copy
import math
from typing import Iterable

import torch

from geomesh_p2p.model.build import load_flat_
from geomesh_p2p.model.memory import release_freed_memory

__all__ = ["hollow_copy", "is_hollow", "load_for_check", "release_", "sub_flat_"]

#: attribute of a hollow copy: the parameters' shapes in ``named_parameters`` order
_SHAPES = "_geomesh_hollow_shapes"


def hollow_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters hold 0 elements (tied parameters stay one object; buffers
    are copied). The weights are never copied, so making it costs no ``[P]``, even transiently.
    Raises ValueError for a model whose parameters are not fp32 CPU tensors (copy it whole instead)."""
    named = list(model.named_parameters())
    bad = [n for n, p in named if p.device.type != "cpu" or p.dtype != torch.float32]
    if bad:
        raise ValueError(f"a hollow copy needs fp32 CPU parameters; not: {', '.join(bad[:3])}")
    memo: dict = {}
    for p in model.parameters():  # every parameter object once (tied weights share it)
        memo[id(p)] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
    out = copy.deepcopy(model, memo)
    object.__setattr__(out, _SHAPES, [tuple(p.shape) for _, p in named])
    return out


def is_hollow(model) -> bool:
    """True for a copy made by :func:`hollow_copy`."""
    return getattr(model, _SHAPES, None) is not None


def load_for_check(model, theta: torch.Tensor) -> None:
    """The weights ``theta`` (flat, layout of :func:`~geomesh_p2p.model.build.flat_params`) into a check's
    model: a hollow model's parameters become views of ``theta`` (no copy; ``theta`` must then stay unchanged
    while they are in use, and is never written through them: see :func:`sub_flat_`), after a private fp32
    copy when ``theta`` is not a contiguous fp32 CPU tensor; any other model is loaded by copy
    (:func:`~geomesh_p2p.model.build.load_flat_`). Raises ValueError on a size mismatch."""
    shapes = getattr(model, _SHAPES, None)
    if shapes is None:
        load_flat_(model, theta)
        return
    flat = theta.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.to("cpu", torch.float32).contiguous()
    total = sum(math.prod(s) for s in shapes)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {total}")
    off, had_private = 0, False
    lo, hi = flat.data_ptr(), flat.data_ptr() + 4 * flat.numel()
    for (_, p), shape in zip(model.named_parameters(), shapes):
        n = math.prod(shape)
        had_private = had_private or (p.numel() > 0 and not lo <= p.data_ptr() < hi)
        p.data = flat[off : off + n].view(shape)
        p.grad = None
        off += n
    if had_private:
        # the private copies of the loss-gain test (:func:`sub_flat_`) are freed now: back to the OS before the
        # gradient passes allocate (glibc keeps freed heap blocks resident until a trim)
        release_freed_memory()


def release_(model) -> None:
    """A hollow model's parameters (and gradients) back to 0 elements: it holds no weights between checks.
    Nothing for another model."""
    if not is_hollow(model):
        return
    for _, p in model.named_parameters():
        p.grad = None
        p.data = torch.empty(0, dtype=p.dtype)


def sub_flat_(model, parts: Iterable[tuple[int, torch.Tensor]]) -> None:
    """Subtract flat pieces from the model's parameters in place: for each ``(start, v)`` (fp32, any device),
    the flat elements ``[start, start + v.numel())`` (layout of :func:`~geomesh_p2p.model.build.flat_params`)
    minus ``v``. Bitwise what loading ``flat - d`` gives (``d`` the pieces, zero elsewhere) when the parameters
    hold ``flat`` in fp32: the same single fp32 subtraction per element. A hollow model's parameters are views
    of weights it must not write: each parameter a piece touches is first replaced by a private copy (only
    those parameters: the pieces' size, not the model's). ``parts`` may be a generator (one piece decoded at a
    time). Raises ValueError for a piece outside the model or a parameter that is not fp32."""
    named = [p for _, p in model.named_parameters()]
    offsets, off = [], 0
    for p in named:
        offsets.append(off)
        off += p.numel()
    total = off
    hollow = is_hollow(model)
    private: set[int] = set()
    with torch.no_grad():
        for start, v in parts:
            v = v.reshape(-1)
            end = start + v.numel()
            if start < 0 or end > total:
                raise ValueError(f"piece [{start}, {end}) outside the model's {total} elements")
            for k, p in enumerate(named):
                lo, hi = offsets[k], offsets[k] + p.numel()
                a, b = max(start, lo), min(end, hi)
                if a >= b:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"parameter {k} is {p.dtype}, not fp32")
                if hollow and k not in private:
                    p.data = p.data.clone()
                    private.add(k)
                p.data.view(-1)[a - lo : b - lo].sub_(v[a - start : b - start].to(p.device, torch.float32))
