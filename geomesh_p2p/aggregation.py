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

from typing import Any, Optional, Sequence

import torch

from geomesh_p2p import compression

RULES = ("mean", "vote", "meanmed")
ROBUST_RULES = ("vote", "meanmed")

__all__ = ["RULES", "ROBUST_RULES", "bounded_weights", "median_rows", "token_weighted_mean", "aggregate_part"]


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
    items: Sequence[tuple[int, Any]], numel: int, *, clip_k: Optional[float], encoding: str = "sign",
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


def _signed_weights(items: Sequence[tuple[int, Any]]) -> list[torch.Tensor]:
    """Per item: its decoded signs times its weight ``fp32(n_i / N)``, ``+-w_i`` per element (0 where its
    block scale is 0)."""
    total = sum(n for n, _ in items)
    zero = torch.zeros((), dtype=torch.float32)
    out = []
    for n, p in items:
        w = torch.where(p.scales > 0, torch.tensor(n / total, dtype=torch.float32), zero)
        out.append(compression.decode(compression.SignPacket(p.numel, p.block_size, n, p.signs, w)))
    return out


def _robust_sign(items: Sequence[tuple[int, Any]], numel: int, rule: str, weight_cap: Optional[float],
                 min_agreement: Optional[float], dropped: Optional[list] = None) -> torch.Tensor:
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
    4. Magnitude ``m_b = min(M_b, median of the kept items' scales)``: ``vote`` -> ``sign(v) * m_b`` (ties
       give 0); ``meanmed`` -> ``v * m_b``. So ``|out| <= M_b``: bounded by the honest scales whenever the
       honest items are a strict majority, whatever the rest send.
    """
    pos = [(int(n), p) for n, p in items if int(n) > 0]
    if not pos:
        return torch.zeros(numel, dtype=torch.float32)
    t_all = _median_int([n for n, _ in pos])
    m_all = median_active(torch.stack([p.scales for _, p in pos]))
    block = pos[0][1].block_size

    def combine(chosen, t):
        toks = [n for n, _ in chosen] if weight_cap is None else _cap([n for n, _ in chosen], max(1, int(t * weight_cap)))
        sw = _signed_weights([(w, p) for w, (_, p) in zip(toks, chosen)])
        v = torch.zeros(numel, dtype=torch.float32)
        for x in sw:
            v = v + x
        # Normalise per block by the weight of the items that vote there (an abstaining zero block must
        # not shrink the others' update): sum_i w_i a_ib in the same order, one division per element.
        total = sum(toks)
        wsum = torch.zeros_like(chosen[0][1].scales)
        for n, (_, p) in zip(toks, chosen):
            wsum = wsum + torch.where(p.scales > 0, torch.tensor(n / total, dtype=torch.float32),
                                      torch.zeros((), dtype=torch.float32))
        den = wsum.repeat_interleave(block)[:numel]
        v = torch.where(den > 0, v / torch.where(den > 0, den, torch.ones((), dtype=torch.float32)), v)
        return v, sw

    v, sw = combine(pos, t_all)
    kept = pos
    if min_agreement is not None and len(pos) > 2:
        cons = torch.sign(v)
        keep = []
        for x in sw:
            both = (x != 0) & (cons != 0)
            n = int(both.sum())
            agree = int(((x > 0) == (cons > 0))[both].sum())
            keep.append(n == 0 or agree >= min_agreement * n)
        if not all(keep) and any(keep):
            kept = [item for item, k in zip(pos, keep) if k]
            if dropped is not None:
                gone = {id(p) for (_, p), k in zip(pos, keep) if not k}
                dropped.extend(i for i, (_, p) in enumerate(items) if id(p) in gone)
            v, _ = combine(kept, min(t_all, _median_int([n for n, _ in kept])))
    med = m_all if kept is pos else torch.minimum(m_all, median_active(torch.stack([p.scales for _, p in kept])))
    mag = med.repeat_interleave(block)[:numel]
    if rule == "vote":
        return torch.sign(v) * mag
    return v * mag


def aggregate_part(
    items: Sequence[tuple[int, Any]], numel: int, *, rule: str = "vote", encoding: str = "sign",
    clip_k: Optional[float] = 4.0, weight_cap: Optional[float] = 1.0, min_agreement: Optional[float] = 0.5,
    dropped: Optional[list] = None, out: Optional[torch.Tensor] = None,
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
        dropped: if a list is given, the indices (into ``items``) of the items the agreement filter
            dropped are appended to it (the same on every peer: the collective leaves them out of the
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
        return token_weighted_mean([(w, p) for w, (_, p) in zip(weights, items)], numel, clip_k=clip_k,
                                   encoding=encoding, out=out)
    res = _robust_sign(items, numel, rule, weight_cap, min_agreement, dropped)
    return res if out is None else out.copy_(res)
