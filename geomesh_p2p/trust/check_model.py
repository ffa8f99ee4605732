"""Verified work's private model without a resident copy of the weights (issue 27).

The verifier re-runs a contributor's batches on a model of its own. A whole deep copy held the model's
weights (4P bytes) for the whole run, besides the node's model; a check then loaded the round's start
weights into it, so the kept file's pages, the copy and the check's gradients were resident together.

A *hollow* copy (:func:`hollow_copy`) has the model's modules and buffers but parameters of 0 elements.
While a check runs its parameters are views of the round's start weights (:func:`load_for_check`: the kept
weights' copy-on-write file mapping, read, never written), and between checks they are released
(:func:`release_`). A check then holds the start weights once (the file's pages), plus the gradients of its
gradient passes or, for the loss-gain test's second pass, ``theta - d`` of one module at a time
(:func:`subtracted`: built just before each module's forward, dropped after it). :func:`sub_flat_` (private
copies of every parameter the contribution moves, up to a whole ``[P]``) remains for a model that is not hollow
(the GPU path: device memory, not the host's), which is loaded by copy as before.
"""

from __future__ import annotations

import copy
import math
import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Union

import torch

from geomesh_p2p.exchange.codec import SignPacket
from geomesh_p2p.exchange.codec import decode as decode_sign
from geomesh_p2p.model.build import load_flat_
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.model.optim import _abs_max
from geomesh_p2p.trust.kept_weights import file_map_range
from geomesh_p2p.util.pages import drop_file_pages

__all__ = [
    "Piece",
    "abs_max",
    "decode_span",
    "hollow_copy",
    "is_hollow",
    "load_for_check",
    "release_",
    "sub_flat_",
    "subtracted",
]

#: A piece of a contribution: ``(start, values)``, the flat elements ``[start, start + n)``; ``values`` fp32 ``[n]``
#: (any device), or the sign packet it decodes from (decoded a span at a time where it is needed)
Piece = tuple[int, Union[torch.Tensor, SignPacket]]

#: attribute of a hollow copy: the parameters' shapes in ``named_parameters`` order
_SHAPES = "_geomesh_hollow_shapes"
#: attribute of a hollow copy loaded from a kept map: the hooks that hand its pages back (:func:`_install_drops`)
_DROPS = "_geomesh_page_drops"
#: attribute of such a copy: the map's tensor, held while the hooks live
_DROPS_MAP = "_geomesh_page_drops_map"


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
    _remove_drops(model)
    mapped = file_map_range(theta)
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
    if mapped is not None and flat.data_ptr() == mapped[0]:
        _install_drops(model, flat, *mapped)
    if had_private:
        # the private copies of the loss-gain test (:func:`sub_flat_`) are freed now: back to the OS before the
        # gradient passes allocate (glibc keeps freed heap blocks resident until a trim)
        release_freed_memory()


#: elements per slice of :func:`abs_max` (16 MiB of fp32)
_SLICE = 1 << 22


def abs_max(theta: torch.Tensor) -> float:
    """``max |theta|`` (0.0 when empty; NaN when ``theta`` holds a NaN) without a ``[P]`` temporary of ``|theta|``:
    ``aminmax`` over slices of :data:`_SLICE` elements, the same value as over the whole. On a kept map
    (:func:`~geomesh_p2p.trust.kept_weights.file_map_range`) each slice's pages go back to the page cache once
    read, so the scan does not make the round's 4P bytes resident at once (issue 27, session 41)."""
    mapped = file_map_range(theta)
    flat = theta.detach().reshape(-1)
    out: Optional[float] = None
    for a in range(0, flat.numel(), _SLICE):
        s = flat[a : a + _SLICE]
        m = _abs_max(s)  # NaN for a slice with a NaN
        if mapped is not None:
            drop_file_pages(s.data_ptr(), 4 * s.numel(), *mapped)
        if m != m:
            # aminmax over the whole gave NaN too (a verdict's scale bound is NaN then, which fails every
            # contribution); Python's max() would skip it (red team 41)
            return m
        out = m if out is None else max(out, m)
    return 0.0 if out is None else out


def release_(model) -> None:
    """A hollow model's parameters (and gradients) back to 0 elements: it holds no weights between checks.
    Nothing for another model."""
    if not is_hollow(model):
        return
    _remove_drops(model)
    for _, p in model.named_parameters():
        p.grad = None
        p.data = torch.empty(0, dtype=p.dtype)


def _install_drops(model, flat: torch.Tensor, lo: int, hi: int) -> None:
    """Hand a hollow model's weight pages back to the page cache after each use (issue 27, session 41): after each
    module's forward call its parameters' pages, after each parameter's gradient is accumulated that parameter's.
    A pass then holds about one module's weights of the kept file's map at a time, not the round's 4P bytes, and
    reads the rest back from the page cache as it goes (minor faults). Only for a model whose parameters are views
    of a :class:`~geomesh_p2p.trust.kept_weights.KeptWeights` map ``[lo, hi)`` (never written: see
    :mod:`geomesh_p2p.util.pages`). The hooks hold ``flat`` (the map's tensor) until they are removed: were the
    map unmapped while they lived, its addresses could be anonymous memory by the next call, which a drop would
    zero (:func:`sub_flat_` can leave no parameter viewing it)."""

    # each parameter's bytes in the map, taken now: while :func:`subtracted` swaps a parameter for a private tensor
    # around a forward call, its build still read the map's pages, which go back all the same
    where = {id(p): (p.data_ptr(), 4 * p.numel()) for p in model.parameters() if p.numel()}
    # The hooks live in the modules' dicts, which copy.deepcopy copies (the closures shared): a copy of the model
    # would keep calling them after this model let go of the map, on addresses anonymous memory may hold by then
    # (red team 41). They drop only while ``flat`` lives, and hold it while they do.
    alive = weakref.ref(flat)

    def drop(ps) -> None:
        held = alive()
        if held is None:
            return
        for p in ps:
            at = where.get(id(p))
            if at is not None:
                drop_file_pages(at[0], at[1], lo, hi)
        del held

    handles = []
    for m in model.modules():
        ps = tuple(q for q in m._parameters.values() if q is not None)
        if ps:
            handles.append(m.register_forward_hook(lambda _m, _a, _o, ps=ps: drop(ps), always_call=True))
    for p in dict.fromkeys(model.parameters()):  # tied parameters once
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: drop((q,))))
    object.__setattr__(model, _DROPS, handles)
    object.__setattr__(model, _DROPS_MAP, flat)  # the mapping lives as long as the hooks (docstring)


def _remove_drops(model) -> None:
    """Remove :func:`_install_drops`' hooks, then let go of the map they kept alive (in that order)."""
    for h in getattr(model, _DROPS, ()):
        h.remove()
    object.__setattr__(model, _DROPS, ())
    object.__setattr__(model, _DROPS_MAP, None)


def sub_flat_(model, parts: Iterable[Piece]) -> None:
    """Subtract flat pieces from the model's parameters in place: for each ``(start, v)`` (fp32, any device, or a
    sign packet: decoded whole first),
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
            v = decode_sign(v) if isinstance(v, SignPacket) else v.reshape(-1)
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


def _piece_numel(v: Union[torch.Tensor, SignPacket]) -> int:
    return v.numel if isinstance(v, SignPacket) else v.numel()


def _window(p: SignPacket, start: int, end: int) -> SignPacket:
    """Elements ``[start, end)`` of ``p`` as a packet of views (no copy): ``start`` on a byte and block boundary,
    ``end`` too or ``p.numel`` (the last byte's padding bits are then ``p``'s own, zero)."""
    B = p.block_size
    return SignPacket(end - start, B, p.tokens, p.signs[start // 8 : -(-end // 8)], p.scales[start // B : -(-end // B)])


def decode_span(p: SignPacket, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
    """Decode elements ``[start, end)`` of sign packet ``p`` into ``out`` (fp32 CPU, contiguous, ``end - start``
    elements; returned): bitwise ``decode(p)[start:end]`` (each element is the one exact product ``(+-1.0) x
    scale`` of its bit and its block's scale, wherever a decode starts), for any ``start`` and ``end``. The part
    between the first and last multiples of ``lcm(8, B)`` is decoded straight into ``out``; the unaligned ends
    through one window of ``lcm(8, B)`` elements each (8 KiB at B = 2048). Raises ValueError outside ``p``."""
    if not 0 <= start <= end <= p.numel or out.numel() != end - start:
        raise ValueError(f"span [{start}, {end}) of a {p.numel}-element packet into {out.numel()} elements")
    L = math.lcm(8, p.block_size)
    mid_lo = min(-(-start // L) * L, end)
    mid_hi = max(end // L * L, mid_lo)
    if mid_hi > mid_lo:
        decode_sign(_window(p, mid_lo, mid_hi), out=out[mid_lo - start : mid_hi - start])
    for a, b in ((start, mid_lo), (mid_hi, end)):
        if a < b:  # within one window [w, w + L)
            w = a // L * L
            out[a - start : b - start].copy_(decode_sign(_window(p, w, min(w + L, p.numel)))[a - w : b - w])
    return out


@contextmanager
def subtracted(model, parts: Iterable[Piece]) -> Iterator[None]:
    """While inside, a hollow ``model`` loaded with ``theta`` (:func:`load_for_check`) computes as if loaded with
    ``theta - d``, ``d`` the pieces (zero elsewhere), without a ``[P]`` of either (issue 27): each module that
    owns a parameter a piece touches gets, just before each of its forward calls, a new fp32 tensor of that
    parameter (``theta``'s elements, minus the pieces' over their spans: one fp32 subtraction per element, as
    :func:`sub_flat_` does, so bitwise the same weights), and drops it right after the call. Extra memory: the
    parameters of the modules running at once (one leaf module in a transformer: the largest is the embedding
    matrix), not the model. A parameter shared by modules (tied embeddings) is built for each of their calls.
    Between the calls such a parameter holds 0 elements, so a model that read a moved parameter outside its own
    module's forward fails loudly instead of computing with ``theta``. Parameters no piece touches stay views
    of ``theta``. On exit, every parameter is ``theta``'s view again (whatever was raised).

    ``parts``: :data:`Piece` s, kept for the block (a sign packet is decoded a span at a time, at every forward
    call: ~2 passes over the moved elements per call on top of the forward's own work). ``theta`` must stay
    unchanged inside, and is never written. Costs per forward call one subtraction (and decode) over the moved
    elements. Raises ValueError for a model that is not hollow or not loaded, a piece outside the model,
    overlapping pieces, or a moved parameter that is not fp32."""
    if not is_hollow(model):
        raise ValueError("subtracted() needs a hollow model (hollow_copy); use sub_flat_ on a whole copy")
    named = [p for _, p in model.named_parameters()]
    shapes = getattr(model, _SHAPES)
    if [p.numel() for p in named] != [math.prod(s) for s in shapes]:
        raise ValueError("subtracted() needs a model loaded with load_for_check")
    offsets, off = [], 0
    for p in named:
        offsets.append(off)
        off += p.numel()
    total = off
    # per moved parameter k: its spans (lo, hi) in its own flat elements, with the piece and the piece's offset
    spans: dict[int, list[tuple[int, int, Union[torch.Tensor, SignPacket], int]]] = {}
    for start, v in parts:
        if not isinstance(v, SignPacket):
            v = v.reshape(-1)
        end = start + _piece_numel(v)
        if start < 0 or end > total:
            raise ValueError(f"piece [{start}, {end}) outside the model's {total} elements")
        for k, p in enumerate(named):
            lo, hi = offsets[k], offsets[k] + p.numel()
            a, b = max(start, lo), min(end, hi)
            if a < b:
                if p.dtype != torch.float32:
                    raise ValueError(f"parameter {k} is {p.dtype}, not fp32")
                spans.setdefault(k, []).append((a - lo, b - lo, v, a - start))
    for k, s in spans.items():
        s.sort(key=lambda x: x[0])
        if any(s[i][0] < s[i - 1][1] for i in range(1, len(s))):
            raise ValueError(f"overlapping pieces over parameter {k}")
    theta_of = {k: named[k].data for k in spans}  # the views of theta (load_for_check)

    def build(k: int) -> torch.Tensor:
        base = theta_of[k].reshape(-1)
        out = torch.empty(base.numel(), dtype=torch.float32)
        pos = 0
        for a, b, v, at in spans[k]:
            if pos < a:
                out[pos:a].copy_(base[pos:a])
            o = out[a:b]
            if isinstance(v, SignPacket):
                decode_span(v, at, at + b - a, o)
                torch.sub(base[a:b], o, out=o)  # theta - d, d decoded in place
            else:
                torch.sub(base[a:b], v[at : at + b - a].to("cpu", torch.float32), out=o)
            pos = b
        if pos < base.numel():
            out[pos:].copy_(base[pos:])
        return out.view(theta_of[k].shape)

    users = dict.fromkeys(spans, 0)  # live calls of the modules that use parameter k (re-entrant: counted)
    empty = torch.empty(0, dtype=torch.float32)

    def enter(ks: tuple[int, ...]) -> None:
        for k in ks:
            if users[k] == 0:
                named[k].data = build(k)
            users[k] += 1

    def leave(ks: tuple[int, ...]) -> None:
        for k in ks:
            users[k] -= 1
            if users[k] == 0:
                named[k].data = empty

    index = {id(named[k]): k for k in spans}
    handles = []
    try:
        for m in model.modules():
            ks = tuple(index[id(q)] for q in m._parameters.values() if q is not None and id(q) in index)
            if ks:
                handles.append(m.register_forward_pre_hook(lambda _m, _a, ks=ks: enter(ks)))
                handles.append(m.register_forward_hook(lambda _m, _a, _o, ks=ks: leave(ks), always_call=True))
        for k in spans:
            named[k].data = empty
        yield
    finally:
        for h in handles:
            h.remove()
        for k, t in theta_of.items():
            named[k].data = t
        if spans:
            release_freed_memory()  # the per-call tensors' heap blocks (glibc keeps them resident until a trim)
