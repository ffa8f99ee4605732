"""Aggregation rules for one part of the pseudo-gradient: the plain token-weighted mean and robust rules.

Pure tensor code (no I/O): the collective, relay readers, re-encoding owners and the simulator all call
these, so every peer computes the same bits from the same contributions.

Rules (``RULES``):

* ``mean`` -- the token-weighted mean ``sum_i n_i * decode_i / sum_i n_i`` with per-block scale clipping at
  ``clip_k x`` the median scale (the first version's rule; GeoMesh arXiv 2609.18388, "Compressed sign
  synchronization"). One contributor with a large weight steers it: see docs/security.md.
* ``vote`` -- a sign majority vote weighted by *bounded* token weights, with the median block scale as the
  magnitude (signSGD with majority vote, Bernstein et al., ICLR 2019, "signSGD with majority vote is
  communication efficient and fault tolerant", section 4; the median scale plays the role of the server's
  step size). A minority cannot reverse a coordinate on which the honest contributors agree, and its
  scales cannot move the magnitude beyond the honest range (the median).
* ``meanmed`` -- the bounded-weight mean of the signs times the median block scale (a bounded-influence
  mean: a contributor moves a coordinate by at most ``2 w_i`` of the median scale).

Bounded weights (``bounded_weights``): token counts are first capped by the plan (``min(claimed, cap)``),
then by ``weight_cap x`` the median of the contributors' capped counts, so no contributor's weight exceeds
``weight_cap x`` a typical one, whatever its plan or record says.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from typing import Any, Optional, Sequence

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.codec.sign import _run_parallel

RULES = ("mean", "vote", "meanmed")
ROBUST_RULES = ("vote", "meanmed")

__all__ = [
    "RULES",
    "ROBUST_RULES",
    "bounded_weights",
    "median_rows",
    "token_weighted_mean",
    "aggregate_part",
    "support_counts",
]


def median_rows(x: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of ``x`` [C, K] fp32 -> [K] fp32; for even C the mean of the two middle values
    (``(lo + hi) * 0.5``, two IEEE roundings: the same bits on every device)."""
    srt = torch.sort(x, dim=0).values
    c = srt.shape[0]
    if c % 2 == 1:
        return srt[c // 2].clone()
    return (srt[c // 2 - 1] + srt[c // 2]) * torch.tensor(0.5, dtype=torch.float32)


def _median_int(values: Sequence[int]) -> int:
    """Median of positive integers (the lower middle's mean rounded down for an even count); 0 if none."""
    pos = sorted(int(n) for n in values if int(n) > 0)
    if not pos:
        return 0
    c = len(pos)
    return pos[c // 2] if c % 2 == 1 else (pos[c // 2 - 1] + pos[c // 2]) // 2


def _cap(tokens: Sequence[int], bound: int) -> list[int]:
    return [min(max(0, int(n)), bound) for n in tokens]


def median_active(x: torch.Tensor) -> torch.Tensor:
    """Per column of ``x`` [C, K] fp32 (>= 0), the median of its positive entries (0 where none): a
    contributor whose block scale is 0 abstains from the block's magnitude too. Even counts take
    ``(lo + hi) * 0.5`` (two IEEE roundings), as :func:`median_rows`."""
    active = x > 0
    cnt = active.sum(dim=0)  # [K]
    inf = torch.tensor(float("inf"), dtype=torch.float32)
    srt = torch.sort(torch.where(active, x, inf), dim=0).values
    hi_i = (cnt // 2).clamp(max=x.shape[0] - 1)
    lo_i = ((cnt - 1) // 2).clamp(min=0)
    hi = srt.gather(0, hi_i.unsqueeze(0)).squeeze(0)
    lo = srt.gather(0, lo_i.unsqueeze(0)).squeeze(0)
    odd = torch.where(cnt % 2 == 1, hi, (lo + hi) * torch.tensor(0.5, dtype=torch.float32))
    return torch.where(cnt > 0, odd, torch.zeros((), dtype=torch.float32))


def bounded_weights(tokens: Sequence[int], weight_cap: Optional[float]) -> list[int]:
    """Token counts ``tokens`` (already capped by the plan) bounded to ``weight_cap x`` their median.

    Integer arithmetic only (the median of an even count is rounded down), so every peer gets the same
    list. ``weight_cap=None`` leaves them unchanged. Zero counts stay zero and do not enter the median.

    Raises:
        ValueError: ``weight_cap`` is not > 0.
    """
    toks = [max(0, int(n)) for n in tokens]
    if weight_cap is None:
        return toks
    if not weight_cap > 0:
        raise ValueError(f"weight_cap must be > 0, got {weight_cap}")
    med = _median_int(toks)
    if med == 0:
        return toks
    return _cap(toks, max(1, int(med * float(weight_cap))))


def token_weighted_mean(
    items: Sequence[tuple[int, Any]],
    numel: int,
    *,
    clip_k: Optional[float],
    encoding: str = "sign",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The ``mean`` rule of one part: ``sum_i n_i * decode_i / sum_i n_i``, computed one fixed way.

    Args:
        items: ``(tokens, packet)`` in the fixed order (ascending raw PeerID). ``tokens`` already
            capped (``min(claimed, cap)``). ``packet``: a :class:`compression.SignPacket` of
            ``numel`` elements (``encoding="sign"``) or an fp32 tensor [numel] (``"fp32"``).
        numel: elements of the part.
        clip_k: scale clipping factor, or None.
        encoding: ``"sign"`` or ``"fp32"``.
        out: optional contiguous fp32 tensor [numel] to accumulate into (overwritten; e.g. the
            part's slice of the round's aggregate), so no other full-size tensor is kept.

    Returns:
        fp32 tensor [numel] (``out`` if given); all zeros when no item has tokens > 0.

    The exact rule (each step one IEEE fp32 rounding; the same on every peer, so relay peers and
    a reencode owner get the same bits):

    1. Items with ``tokens == 0`` are dropped. ``N = sum(tokens)`` (exact integer).
    2. Sign only, if ``clip_k`` is set: per block b, ``med_b`` = :func:`median_rows` of the items'
       scales; ``cap_b = med_b * fp32(clip_k)``; ``s'_ib = min(s_ib, cap_b)``.
    3. ``w_i = fp32(n_i / N)`` (the quotient in float64, then rounded to fp32).
    4. Sign: ``c_ib = s'_ib * w_i`` and ``x_i = decode(SignPacket(signs_i, scales=c_i))`` =
       ``+-c_ib`` exactly. fp32: ``x_i = v_i * w_i``.
    5. ``acc = 0``; for each item in order: ``acc = acc + x_i``.

    Memory: ``acc`` (or ``out``) plus one scratch tensor [numel] for ``x_i``; every step is an
    unfused elementwise op into them (the same IEEE roundings as ``acc = acc + x_i``).
    """
    active = [(int(n), p) for n, p in items if int(n) > 0]
    if out is None:
        acc = torch.zeros(numel, dtype=torch.float32)
    else:
        if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp32 tensor of {numel} elements")
        acc = out.zero_()
    if not active:
        return acc
    total = sum(n for n, _ in active)
    x = torch.empty(numel, dtype=torch.float32)  # the one scratch buffer: x_i, then acc += x_i
    if encoding == "fp32":
        for n, v in active:
            torch.mul(v, torch.tensor(n / total, dtype=torch.float32), out=x)
            acc.add_(x)
        return acc
    cap = None
    if clip_k is not None:
        med = median_rows(torch.stack([p.scales for _, p in active]))
        cap = med * torch.tensor(clip_k, dtype=torch.float32)
    for n, p in active:
        s = p.scales if cap is None else torch.minimum(p.scales, cap)
        c_i = s * torch.tensor(n / total, dtype=torch.float32)
        acc.add_(compression.decode(compression.SignPacket(p.numel, p.block_size, n, p.signs, c_i), out=x))
    return acc


# ---------------------------------------------------------------------------------------------------------
# vote / meanmed over sign packets
#
# The rule (step by step in _robust_sign's docstring) is defined by the fp32 operations of its first
# implementation (kept verbatim as the reference in tests/unit/test_robust_agg_equiv.py): per element
# ``v = ((0 + x_1) + x_2) + ...`` with ``x_i = (+-1) * (w_i or 0)``, then ``v / W_b`` where ``W_b > 0``, then
# ``v * m_b`` (or ``sign(v) * m_b``). Both paths below do exactly these roundings, in this order, so the
# output is bit-identical (signed zeros included); only where they are computed changes:
#
# * pattern-table path (C <= _TABLE_MAX_ITEMS contributions, the usual case): every block has one pattern of
#   voting contributors (scale > 0) and every element one pattern of C sign bits, so ``v`` of an element is a
#   function of (block pattern, sign pattern): a table of at most 2^C x 2^C values, computed with the same
#   fp32 ops on the table. Per element the work is: gather the C sign bits into one byte (8 elements per
#   int64 word, one table lookup per packed byte and contribution), one bincount (the agreement filter's
#   integer counts, for every contributor at once, from a histogram of the patterns) and one gather of the
#   final value times the block's magnitude, in block-aligned chunks that stay in cache.
# * streaming path (more contributions): each contribution decoded into one preallocated buffer and added in
#   place; the agreement counts from uint8 views (its unpacked sign bits against the consensus's).

_TABLE_MAX_ITEMS = 8  # pattern bytes: one uint8 per element
_GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: smaller CPU ops run inline (see _segments)

_BYTE_SPREAD: Optional[torch.Tensor] = None  # int64 [256]: bit j of b -> byte j (value 0/1)
_BIT_UNPACK: Optional[torch.Tensor] = None  # uint8 [256, 8]: bit j of b


def _byte_spread() -> torch.Tensor:
    global _BYTE_SPREAD
    if _BYTE_SPREAD is None:
        bits = (torch.arange(256, dtype=torch.int64)[:, None] >> torch.arange(8)) & 1
        _BYTE_SPREAD = (bits << (8 * torch.arange(8))).sum(dim=1)
    return _BYTE_SPREAD


def _bit_unpack() -> torch.Tensor:
    global _BIT_UNPACK
    if _BIT_UNPACK is None:
        _BIT_UNPACK = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8).contiguous()
    return _BIT_UNPACK


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _weights(chosen: Sequence[tuple[int, Any]], t: int, weight_cap: Optional[float]) -> tuple[list[int], int]:
    """Bounded integer weights of ``chosen`` (``min(n_i, weight_cap x t)``) and their sum."""
    toks = [n for n, _ in chosen] if weight_cap is None else _cap([n for n, _ in chosen], max(1, int(t * weight_cap)))
    return toks, sum(toks)


def _active_weights(toks: Sequence[int], total: int, chosen: Sequence[tuple[int, Any]]) -> list[torch.Tensor]:
    """Per item its per-block weight ``w_i a_ib``: ``fp32(n_i / N)`` where its scale is > 0, else 0."""
    zero = torch.zeros((), dtype=torch.float32)
    return [torch.where(p.scales > 0, _f32(n / total), zero) for n, (_, p) in zip(toks, chosen)]


def _wsum(was: Sequence[torch.Tensor]) -> torch.Tensor:
    """``W_b = sum_i w_i a_ib`` in order (one fp32 rounding per addition)."""
    wsum = torch.zeros_like(was[0])
    for wa in was:
        wsum = wsum + wa
    return wsum


def _blockwise(x: torch.Tensor, per_block: torch.Tensor, block: int, op: str) -> None:
    """In place ``x[e] op= per_block[e // block]`` for a segment ``x`` that starts on a block boundary."""
    n = x.numel()
    nfull = n // block
    if nfull:
        getattr(x[: nfull * block].view(nfull, block), op)(per_block[:nfull, None])
    if nfull * block < n:
        getattr(x[nfull * block :], op)(per_block[nfull])


def _segments(numel: int, block: int) -> tuple[list[int], int]:
    """Segment bounds for the table path's per-element passes, and worker threads.

    Segments start on a block and byte boundary and hold fewer than ``_GRAIN`` elements when the block
    allows, so every torch op on one runs inline in its thread (no OpenMP team and barrier per op: on
    shared, loaded cores a per-op barrier costs a scheduler time slice), and its buffers stay in cache;
    the segments are spread over the codec's small thread pool (torch ops release the GIL)."""
    align = 8 * block // math.gcd(8, block)
    chunk = (_GRAIN - 1) // align * align if align < _GRAIN else align
    bounds = list(range(0, numel, chunk)) + [numel]
    nseg = len(bounds) - 1
    workers = max(1, min(torch.get_num_threads(), nseg // 4))
    return bounds, workers


def _keep_mask(n_both: Sequence[int], n_agree: Sequence[int], min_agreement: float) -> list[bool]:
    return [n == 0 or a >= min_agreement * n for n, a in zip(n_both, n_agree)]


def _table_support(hist: torch.Tensor, act_k: torch.Tensor, c: int, sel: Sequence[int]) -> tuple[list[int], list[int]]:
    """The support counts (:func:`_robust_sign` step 3b) of the items ``sel`` on the table path: ``hist``
    [npat, 2^C] int64 counts of (block pattern, sign pattern), ``act_k`` [C, npat] bool (item i votes in block
    pattern k). Per item i of ``sel``: the sum over its voting elements of ``|m|`` and of ``|m|`` where its sign is
    the sign of ``m``, ``m`` = the vote margin of the *other* items of ``sel`` (+1 per one voting +, -1 per one
    voting -)."""
    ns = hist.shape[1]
    bit = (torch.arange(ns)[None, :] >> torch.arange(c)[:, None]) & 1  # [C, ns]: 1 = negative
    act = act_k.to(torch.int64)  # [C, npat]
    vote = act[:, :, None] * (1 - 2 * bit)[:, None, :]  # [C, npat, ns]: item i's vote (0 where it abstains)
    margin = vote[list(sel)].sum(dim=0)  # [npat, ns]
    n_w, n_agree = [], []
    for i in sel:
        m = margin - vote[i]
        w = m.abs() * act[i][:, None]
        n_w.append(int((hist * w).sum()))
        n_agree.append(int((hist * w * (vote[i] * m > 0)).sum()))
    return n_w, n_agree


def _random_like(n: int, a: int, others: int, z2: Fraction) -> bool:
    """Whether support counts ``a`` of ``n`` (:func:`_table_support`) are within ``sqrt(z2)`` standard deviations of
    what signs drawn at random give: ``2a - n < sqrt(z2 x Q)``, with ``Q = sum m^2`` bounded by ``others x n``
    (``|m| <= others``), so the test is exact in integers and errs toward "random". Signs independent of the
    others' margins side with it on half of ``sum |m|`` on average, with variance ``Q / 4``."""
    d = 2 * a - n
    return d < 0 or d * d < z2 * others * n


def _support_keep(keep: list[bool], counts, min_support: float, support_z: Optional[float] = None) -> list[bool]:
    """The support filter (:func:`_robust_sign` step 3b) over the items ``keep`` leaves in: while more than two
    remain, the one of lowest support (ties: the lowest index) is dropped if below ``min_support`` (or, with
    ``support_z``, when its support is no better than random signs': :func:`_random_like`), and the
    others' supports are measured again without it. One at a time, because a dropped item must not weigh in the
    margins the rest are judged by (with 2 honest items and 1 stealthy flip, the flip halves an honest item's
    "others"). ``counts(sel)`` -> the support counts of the items ``sel``. Exact: integer counts compared as
    fractions."""
    sel = [i for i, k in enumerate(keep) if k]
    z2 = Fraction(support_z) ** 2 if support_z is not None else None
    while len(sel) > 2:
        n_w, n_agree = counts(sel)
        low = [
            (Fraction(a, n), i)
            for i, n, a in zip(sel, n_w, n_agree)
            if n > 0 and (a < min_support * n or (z2 is not None and _random_like(n, a, len(sel) - 1, z2)))
        ]
        if not low:
            break
        sel.remove(min(low)[1])
    return [i in sel for i in range(len(keep))]


_VOTE_LUT: Optional[torch.Tensor] = None  # fp32 [256, 8]: bit j of b -> -1.0 if set (negative) else +1.0


def _vote_lut() -> torch.Tensor:
    global _VOTE_LUT
    if _VOTE_LUT is None:
        _VOTE_LUT = (1.0 - 2.0 * _bit_unpack().to(torch.float32)).contiguous()
    return _VOTE_LUT


def _block_sums(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``x`` [n] (the chunk starts on a block boundary), the sum -> [ceil(n / block)]."""
    n = x.numel()
    nfull = n // block
    parts = [x[: nfull * block].view(nfull, block).sum(dim=1)] if nfull else []
    if nfull * block < n:
        parts.append(x[nfull * block :].sum().reshape(1))
    return torch.cat(parts)


def _stream_support(pos, was, numel: int, block: int, sel: Sequence[int]) -> tuple[list[int], list[int]]:
    """The support counts of :func:`_table_support` for the items ``sel`` of any number, from the packed sign
    bits (``was[i]`` [nb] fp32: item i's per-block weight, 0 where it abstains).

    With M the margin of all of ``sel`` at an element and v in {-1, 0, +1} an item's vote, the others' margin is
    ``m = M - v``, so an item's counts are ``sum |m| = sum_{v=+1} |M - 1| + sum_{v=-1} |M + 1|`` and ``sum of |m|
    where v m > 0 = sum_{v=+1} relu(M - 1) + sum_{v=-1} relu(-M - 1)``. Per chunk of whole blocks and bytes: the
    votes V [C, n] (fp32 +-1 / 0: a table lookup per packed byte, times the block's 0/1), M their sum, the four
    functions of M as F [n, 4], and ``V @ F`` (fp32: integers whose sums stay below 2^24 in a chunk, so exact in any
    order), accumulated in float64; ``sum_{v=+-1} f = (|v| . f +- v . f) / 2`` with ``|v| . f`` from per-block sums
    of f (|v| is the block's 0/1). Every value is an integer below 2^53: exact."""
    c = len(sel)
    lut = _vote_lut()
    align = 8 * block // math.gcd(8, block)
    # chunks under torch's grain, and every op on one row of one: it runs inline in this thread (no OpenMP team
    # and barrier per op, which on shared loaded cores costs a time slice: see _segments)
    chunk = (_GRAIN - 1) // align * align if align < _GRAIN else align
    chunk = max(align, min(chunk, (1 << 24) // (c + 1) // align * align))  # fp32 sums below 2^24 (below)
    dots = torch.zeros(c, 4, dtype=torch.float64)  # v . f
    absd = torch.zeros(c, 4, dtype=torch.float64)  # |v| . f
    active = [(was[i] != 0).to(torch.float32) for i in sel]
    votes = torch.empty(c, min(chunk, numel), dtype=torch.float32)
    f = torch.empty(4, min(chunk, numel), dtype=torch.float32)
    total = torch.empty(min(chunk, numel), dtype=torch.float32)
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        n = hi - lo
        b0, nb = lo // block, (n + block - 1) // block
        vs, fs, tot = votes[:, :n], f[:, :n], total[:n]
        tot.zero_()
        for j, i in enumerate(sel):
            signs = pos[i][1].signs[lo // 8 : (hi + 7) // 8].to(torch.int32)
            v = vs[j]
            v.copy_(torch.index_select(lut, 0, signs).reshape(-1)[:n])
            _blockwise(v, active[j][b0:], block, "mul_")
            tot.add_(v)  # exact: integers of at most C
        fs[0].copy_(tot).sub_(1).abs_()
        fs[1].copy_(tot).add_(1).abs_()
        fs[2].copy_(tot).sub_(1).clamp_(min=0)
        fs[3].copy_(tot).neg_().sub_(1).clamp_(min=0)
        # fp32 products of integers whose sums stay below 2^24 (chunk x (C + 1)): exact in any order
        dots += (vs @ fs.T).to(torch.float64)
        sums = torch.stack([_block_sums(fs[k], block) for k in range(4)], dim=1).to(torch.float64)  # [nb, 4]
        for j in range(c):
            absd[j] += active[j][b0 : b0 + nb].to(torch.float64) @ sums
    plus = ((absd + dots) / 2).round().to(torch.int64).tolist()
    minus = ((absd - dots) / 2).round().to(torch.int64).tolist()
    n_w = [p[0] + q[1] for p, q in zip(plus, minus)]
    agree = [p[2] + q[3] for p, q in zip(plus, minus)]
    return n_w, agree


def support_counts(packets: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The support filter's integer counts of one part's sign packets (all of ``numel`` elements and one block
    size; :func:`_robust_sign` step 3b, every packet in, unweighted): per packet, ``sum |m|`` over its voting
    elements and the part of it where its sign is ``m``'s, ``m`` = the other packets' vote margin. The same
    numbers the aggregation decides on in its first pass, for the record (``trust/agreement.py``). Blocking: one
    pass over the bits. Raises ValueError for packets of different sizes or blocks."""
    if not packets:
        return [], []
    numel, block = packets[0].numel, packets[0].block_size
    if any(p.numel != numel or p.block_size != block for p in packets):
        raise ValueError("every packet must have the same numel and block size")
    pos = [(1, p) for p in packets]
    was = [(p.scales > 0).to(torch.float32) for p in packets]
    return _stream_support(pos, was, numel, block, list(range(len(packets))))


def _table_path(
    pos, numel, block, rule, weight_cap, min_agreement, t_all, res, min_support=None, support_z=None
) -> list[bool]:
    """vote / meanmed of ``pos`` (C <= 8 items, same numel and block) into ``res``; returns the keep mask."""
    c = len(pos)
    ns = 1 << c
    # Block patterns: bit i set where item i's scale is > 0; distinct ones numbered by ``inv``.
    active = torch.stack([p.scales > 0 for _, p in pos])  # [C, nb] bool
    apat = (active.to(torch.int64) << torch.arange(c)[:, None]).sum(dim=0)
    uniq, inv = torch.unique(apat, return_inverse=True)
    npat = uniq.numel()
    act_k = ((uniq[None, :] >> torch.arange(c)[:, None]) & 1).bool()  # [C, npat]: item i votes in pattern k
    # Sign patterns: byte e of ``words`` = sum_i bit_i(e) << i (8 elements per int64, little-endian bytes).
    words = torch.empty((numel + 7) // 8, dtype=torch.int64)
    pat = words.view(torch.uint8)[:numel]
    spreads = [_byte_spread() << i for i in range(c)]
    signs = [p.signs for _, p in pos]
    multi = npat > 1
    offs = (inv * ns).to(torch.int32) if multi else None
    bounds, workers = _segments(numel, block)
    filt = (min_agreement is not None or min_support is not None) and c > 2
    hists: list[torch.Tensor] = []

    def keys(key: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        k = key[: hi - lo]
        k.copy_(pat[lo:hi])
        if offs is not None:  # multi
            _blockwise(k, offs[lo // block :], block, "add_")
        return k

    def patterns(a: int, b: int) -> None:
        n = bounds[1] - bounds[0]
        tmp = torch.empty((n + 7) // 8, dtype=torch.int64)
        sidx = torch.empty((n + 7) // 8, dtype=torch.int32)
        key = torch.empty(n, dtype=torch.int32)
        hist = torch.zeros(npat * ns, dtype=torch.int64) if filt else None
        for j in range(a, b):
            lo, hi = bounds[j], bounds[j + 1]
            blo, bhi = lo // 8, (hi + 7) // 8
            w = words[blo:bhi]
            for i in range(c):
                si = sidx[: bhi - blo]
                si.copy_(signs[i][blo:bhi])
                if i == 0:
                    torch.index_select(spreads[0], 0, si, out=w)
                else:
                    t = tmp[: bhi - blo]
                    torch.index_select(spreads[i], 0, si, out=t)
                    w.add_(t)
            if hist is not None:  # filt
                hist += torch.bincount(keys(key, lo, hi), minlength=npat * ns)
        if hist is not None:
            hists.append(hist)

    _run_parallel(patterns, len(bounds) - 1, workers)

    # Per (block pattern, sign pattern) the bits of ``x_i`` and of ``v``, as the reference computes them.
    signf = 1.0 - 2.0 * ((torch.arange(ns)[None, :] >> torch.arange(c)[:, None]) & 1).to(torch.float32)  # [C, ns]

    def table(sel: list[int], t: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        chosen = [pos[i] for i in sel]
        toks, total = _weights(chosen, t, weight_cap)
        zero = torch.zeros((), dtype=torch.float32)
        xs = []
        v = torch.zeros(npat, ns, dtype=torch.float32)
        wsum = torch.zeros(npat, dtype=torch.float32)
        for n, i in zip(toks, sel):
            wa = torch.where(act_k[i], _f32(n / total), zero)  # [npat]
            x = signf[i][None, :] * wa[:, None]  # decode: (+-1) * scale
            xs.append(x)
            v = v + x
            wsum = wsum + wa
        den = wsum[:, None].expand(npat, ns)
        v = torch.where(den > 0, v / torch.where(den > 0, den, torch.ones((), dtype=torch.float32)), v)
        return v, xs

    sel = list(range(c))
    v, xs = table(sel, t_all)
    keep = [True] * c
    if filt:
        hist = torch.stack(hists).sum(dim=0).view(npat, ns)
        if min_agreement is not None:
            cons = torch.sign(v)
            n_both, n_agree = [], []
            for x in xs:
                both = (x != 0) & (cons != 0)
                n_both.append(int(hist[both].sum()))
                n_agree.append(int(hist[both & ((x > 0) == (cons > 0))].sum()))
            keep = _keep_mask(n_both, n_agree, min_agreement)
        if min_support is not None:
            keep = _support_keep(keep, lambda sel: _table_support(hist, act_k, c, sel), min_support, support_z)
        if not all(keep) and any(keep):
            sel = [i for i in range(c) if keep[i]]
            v, _ = table(sel, min(t_all, _median_int([pos[i][0] for i in sel])))
        else:
            keep = [True] * c
    m_all = median_active(torch.stack([p.scales for _, p in pos]))
    med = m_all if all(keep) else torch.minimum(m_all, median_active(torch.stack([pos[i][1].scales for i in sel])))
    val = (torch.sign(v) if rule == "vote" else v).reshape(-1)

    def gather(a: int, b: int) -> None:
        key = torch.empty(bounds[1] - bounds[0], dtype=torch.int32)
        for j in range(a, b):
            lo, hi = bounds[j], bounds[j + 1]
            seg = res[lo:hi]
            torch.index_select(val, 0, keys(key, lo, hi), out=seg)
            _blockwise(seg, med[lo // block :], block, "mul_")

    _run_parallel(gather, len(bounds) - 1, workers)
    return keep


def _stream_path(
    pos, numel, block, rule, weight_cap, min_agreement, t_all, res, min_support=None, support_z=None
) -> list[bool]:
    """vote / meanmed of ``pos`` (any count) into ``res``, one decoded contribution at a time."""
    x = torch.empty(numel, dtype=torch.float32)

    def combine(sel: list[int], t: int) -> list[torch.Tensor]:
        chosen = [pos[i] for i in sel]
        toks, total = _weights(chosen, t, weight_cap)
        was = _active_weights(toks, total, chosen)
        v = res.zero_()
        for wa, (_, p) in zip(was, chosen):
            v.add_(compression.decode(compression.SignPacket(numel, block, 0, p.signs, wa), out=x))
        wsum = _wsum(was)
        # v / W_b where W_b > 0, else v: a division by 1 is exact, so one in-place division does both.
        _blockwise(v, torch.where(wsum > 0, wsum, torch.ones((), dtype=torch.float32)), block, "div_")
        return was

    c = len(pos)
    sel = list(range(c))
    was = combine(sel, t_all)
    keep = [True] * c
    if (min_agreement is not None or min_support is not None) and c > 2:
        if min_agreement is not None:
            # x_i != 0 exactly where w_i a_ib != 0 (a whole block); x_i > 0 where moreover its sign bit is 0.
            cons_nz = torch.ne(res, 0).view(torch.uint8)
            cons_neg = torch.lt(res, 0).view(torch.uint8)
            nz_blocks = torch.zeros(len(was[0]), dtype=torch.int64)
            nfull = numel // block
            if nfull:
                nz_blocks[:nfull] = cons_nz[: nfull * block].view(nfull, block).sum(dim=1, dtype=torch.int64)
            if nfull * block < numel:
                nz_blocks[nfull:] = cons_nz[nfull * block :].sum(dtype=torch.int64)
            unpack = _bit_unpack()
            bits = torch.empty((numel + 7) // 8 * 8, dtype=torch.uint8)
            mism = torch.empty(numel, dtype=torch.uint8)
            n_both, n_agree = [], []
            for wa, (_, p) in zip(was, pos):
                votes = wa != 0
                n = int(nz_blocks[votes].sum())
                torch.index_select(unpack, 0, p.signs.to(torch.int32), out=bits.view(-1, 8))
                torch.bitwise_xor(bits[:numel], cons_neg, out=mism)
                mism.bitwise_and_(cons_nz)
                if bool(votes.all()):
                    bad = int(mism.sum(dtype=torch.int64))
                else:
                    per = torch.zeros(len(wa), dtype=torch.int64)
                    if nfull:
                        per[:nfull] = mism[: nfull * block].view(nfull, block).sum(dim=1, dtype=torch.int64)
                    if nfull * block < numel:
                        per[nfull:] = mism[nfull * block :].sum(dtype=torch.int64)
                    bad = int(per[votes].sum())
                n_both.append(n)
                n_agree.append(n - bad)
            del bits, mism, cons_nz, cons_neg
            keep = _keep_mask(n_both, n_agree, min_agreement)
        if min_support is not None:
            keep = _support_keep(keep, lambda sel: _stream_support(pos, was, numel, block, sel), min_support, support_z)
        if not all(keep) and any(keep):
            sel = [i for i in range(c) if keep[i]]
            combine(sel, min(t_all, _median_int([pos[i][0] for i in sel])))
        else:
            keep = [True] * c
    m_all = median_active(torch.stack([p.scales for _, p in pos]))
    med = m_all if all(keep) else torch.minimum(m_all, median_active(torch.stack([pos[i][1].scales for i in sel])))
    if rule == "vote":
        torch.sign(res, out=res)
    _blockwise(res, med, block, "mul_")
    return keep


def _robust_sign(
    items: Sequence[tuple[int, Any]],
    numel: int,
    rule: str,
    weight_cap: Optional[float],
    min_agreement: Optional[float],
    dropped: Optional[list] = None,
    out: Optional[torch.Tensor] = None,
    min_support: Optional[float] = None,
    support_z: Optional[float] = None,
) -> torch.Tensor:
    """``vote`` / ``meanmed`` over sign packets (tokens capped by the plan), in the given order.

    1. Items with 0 tokens are left out. Over the C others: ``T`` = median token count, ``M_b`` = median
       of the positive block scales (:func:`median_active`; a zero block abstains). A minority cannot
       move either beyond the honest range.
    2. Weights ``n'_i = min(n_i, weight_cap x T)`` (integers); ``w_i = fp32(n'_i / sum n')``.
       ``v = sum_i w_i * a_ib * sign_i`` accumulated in order (exact ``+-w_i`` terms, one rounding per
       addition), where ``a_ib = 0`` if the item's scale in block b is 0 (a zero contribution abstains),
       then divided by ``W_b = sum_i w_i * a_ib`` (same order): the mean over the items that vote there.
    3. Agreement filter (``min_agreement``, C > 2): an item whose signs match ``sign(v)`` on fewer than
       ``min_agreement`` of the elements where both are non-zero (integer counts: exact) is dropped and
       step 2 runs again over the kept ones, with ``T = min(T, median of the kept)``. Honest pseudo-
       gradients of one round agree with each other (> 0.5); a flipped one is anti-correlated. If every
       item would be dropped, none is.
    3b. Support filter (``min_support``, C > 2; issue 28's stealthy flip): an item is also dropped when, over
       the elements where it votes, its signs side with the *others'* vote margin ``m`` (+1 per other item
       voting + there, -1 per one voting -; unweighted) on less than ``min_support`` of ``sum |m|`` (integer
       counts: exact). Weighting by ``|m|`` counts most the elements where the others agree most, i.e. where
       the true update is largest; an honest item of few inner steps is noisy evenly, so it still sides with
       them there (measured: docs/security.md "Stealthy attacks"), while one that flipped its largest
       coordinates opposes them exactly there. With ``min_support = 0.5`` the rule reads: dropped when its
       signs are anti-correlated with the others' summed votes. Over the items step 3 keeps, one at a time:
       while more than two remain, the lowest below ``min_support`` is dropped and the rest measured again
       without it (:func:`_support_keep`). With ``support_z`` (issue 28's noise senders, session 31), an item is
       also "below" when its support is within ``support_z`` standard deviations of what random signs give
       (:func:`_random_like`: ``2a - n < support_z sqrt((C' - 1) n)``, C' the items measured, integers): a noise
       contribution sides with the others on half of ``sum |m|`` whatever ``min_support`` is, and passed the
       filters at 0.5, while honest work sides with them by tens of such deviations over any part of
       thousands of elements. Then one re-run of step 2 over the items both filters keep.
    4. Magnitude ``m_b = min(M_b, median of the kept items' scales)``: ``vote`` -> ``sign(v) * m_b`` (ties
       give 0); ``meanmed`` -> ``v * m_b``. So ``|out| <= M_b``: bounded by the honest scales whenever the
       honest items are a strict majority, whatever the rest send.

    ``out``: optional contiguous fp32 tensor [numel] written in place (and returned). The bits are those of
    the first implementation (see the comment above ``_TABLE_MAX_ITEMS``).
    """
    if out is None:
        res = torch.empty(numel, dtype=torch.float32)
    else:
        if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp32 tensor of {numel} elements")
        res = out.view(-1)
    pos = [(int(n), p) for n, p in items if int(n) > 0]
    if not pos:
        res.zero_()
        return res if out is None else out
    block = pos[0][1].block_size
    for _, p in pos:
        if p.numel != numel or p.block_size != block:
            raise ValueError(f"every packet must hold {numel} elements in blocks of {block}")
    t_all = _median_int([n for n, _ in pos])
    table = len(pos) <= _TABLE_MAX_ITEMS and numel > 0 and sys.byteorder == "little"
    keep = (_table_path if table else _stream_path)(
        pos, numel, block, rule, weight_cap, min_agreement, t_all, res, min_support, support_z
    )
    if not all(keep) and dropped is not None:
        gone = {id(p) for (_, p), k in zip(pos, keep) if not k}
        dropped.extend(i for i, (_, p) in enumerate(items) if id(p) in gone)
    return res if out is None else out


def aggregate_part(
    items: Sequence[tuple[int, Any]],
    numel: int,
    *,
    rule: str = "vote",
    encoding: str = "sign",
    clip_k: Optional[float] = 4.0,
    weight_cap: Optional[float] = 1.0,
    min_agreement: Optional[float] = 0.5,
    dropped: Optional[list] = None,
    out: Optional[torch.Tensor] = None,
    min_support: Optional[float] = None,
    support_z: Optional[float] = None,
) -> torch.Tensor:
    """The aggregate of one part under ``rule``: what every peer applies for that range.

    Args:
        items: ``(tokens, packet)`` in the fixed order (ascending raw PeerID); ``tokens`` already capped
            by the plan. Packets: :class:`compression.SignPacket` [numel] (``encoding="sign"``) or fp32
            tensors [numel] (``"fp32"``).
        numel: elements of the part.
        rule: one of :data:`RULES`. Robust rules need sign packets; with fp32 packets they fall back to
            the bounded-weight mean (the fp32 baselines are not Byzantine-robust: docs/security.md).
        clip_k: scale clipping of the ``mean`` rule (None = off).
        weight_cap: bound on each weight as a multiple of the median weight (None = off); applied by
            every rule.
        min_agreement: robust rules: the agreement filter's threshold (None = off).
        min_support: robust rules: the support filter's threshold (:func:`_robust_sign` step 3b; None = off).
        support_z: with ``min_support``: the support filter also drops an item whose support is within this many
            standard deviations of random signs' (:func:`_random_like`; None = off).
        dropped: if a list is given, the indices (into ``items``) of the items the agreement or support
            filter dropped are appended to it (the same on every peer: the collective leaves them out of the
            part's contributors, so a peer dropped in every part counts as having delivered nothing).
        out: optional contiguous fp32 tensor [numel] the result is written into (see
            :func:`token_weighted_mean`).

    Returns:
        fp32 tensor [numel] (``out`` if given; zeros when no item has weight).

    Raises:
        ValueError: an unknown rule.
    """
    if rule not in RULES:
        raise ValueError(f"aggregation rule must be one of {RULES}, got {rule!r}")
    if rule == "mean" or encoding == "fp32":
        weights = bounded_weights([n for n, _ in items], weight_cap)
        return token_weighted_mean(
            [(w, p) for w, (_, p) in zip(weights, items)], numel, clip_k=clip_k, encoding=encoding, out=out
        )
    return _robust_sign(items, numel, rule, weight_cap, min_agreement, dropped, out, min_support, support_z)
