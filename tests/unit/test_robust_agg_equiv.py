"""The rewritten ``_robust_sign`` (geomesh_p2p.exchange.robust) gives the bits of the original, for every input.

``reference_robust_sign`` below is the implementation before the rewrite, kept verbatim as the reference
(benchmarks/robust_agg.py --reference times it too). The property tests compare outputs bit for bit (the
int32 view, so +0.0 / -0.0 count as different) and the ``dropped`` out-param, over random packets: various
sizes (with and without a partial last block and byte), block sizes, contribution counts (both the
pattern-table path and the streaming path), zero-scale blocks, zero and huge token counts, flipped
(adversarial) contributions, and both robust rules with and without the agreement filter.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geomesh_p2p.exchange import robust as aggregation
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import _cap, _median_int, aggregate_part, median_active


# ---------------------------------------------------------------------------------------------------------
# the reference: geomesh_p2p/exchange/robust.py before the rewrite (commit 7fd8730), unchanged


def _signed_weights(items: Sequence[tuple[int, Any]]) -> list[torch.Tensor]:
    total = sum(n for n, _ in items)
    zero = torch.zeros((), dtype=torch.float32)
    out = []
    for n, p in items:
        w = torch.where(p.scales > 0, torch.tensor(n / total, dtype=torch.float32), zero)
        out.append(compression.decode(compression.SignPacket(p.numel, p.block_size, n, p.signs, w)))
    return out


def reference_robust_sign(
    items: Sequence[tuple[int, Any]],
    numel: int,
    rule: str,
    weight_cap: Optional[float],
    min_agreement: Optional[float],
    dropped: Optional[list] = None,
) -> torch.Tensor:
    pos = [(int(n), p) for n, p in items if int(n) > 0]
    if not pos:
        return torch.zeros(numel, dtype=torch.float32)
    t_all = _median_int([n for n, _ in pos])
    m_all = median_active(torch.stack([p.scales for _, p in pos]))
    block = pos[0][1].block_size

    def combine(chosen, t):
        toks = (
            [n for n, _ in chosen] if weight_cap is None else _cap([n for n, _ in chosen], max(1, int(t * weight_cap)))
        )
        sw = _signed_weights([(w, p) for w, (_, p) in zip(toks, chosen)])
        v = torch.zeros(numel, dtype=torch.float32)
        for x in sw:
            v = v + x
        total = sum(toks)
        wsum = torch.zeros_like(chosen[0][1].scales)
        for n, (_, p) in zip(toks, chosen):
            wsum = wsum + torch.where(
                p.scales > 0, torch.tensor(n / total, dtype=torch.float32), torch.zeros((), dtype=torch.float32)
            )
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


# ---------------------------------------------------------------------------------------------------------


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype == torch.float32
        and a.shape == b.shape
        and torch.equal(a.view(torch.int32), b.view(torch.int32))
    )


def _check(items, numel, rule, weight_cap, min_agreement):
    d_new, d_ref = [], []
    new = aggregate_part(items, numel, rule=rule, weight_cap=weight_cap, min_agreement=min_agreement, dropped=d_new)
    ref = reference_robust_sign(items, numel, rule, weight_cap, min_agreement, d_ref)
    assert torch.equal(new, ref)
    assert _bits_equal(new, ref)
    assert d_new == d_ref
    out = torch.full((numel,), 7.0)
    d_out = []
    res = aggregate_part(
        items, numel, rule=rule, weight_cap=weight_cap, min_agreement=min_agreement, dropped=d_out, out=out
    )
    assert res is out and _bits_equal(out, ref) and d_out == d_ref
    return d_ref


@st.composite
def _case(draw, max_c=8):
    block = draw(st.sampled_from([1, 3, 4, 7, 8, 16, 33, 64]))
    numel = draw(st.integers(1, 600))
    c = draw(st.integers(1, max_c))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    nb = -(-numel // block)
    base = torch.randn(numel, generator=gen)
    noise = draw(st.sampled_from([0.0, 0.3, 1.0, 3.0]))
    items = []
    for i in range(c):
        v = base + noise * torch.randn(numel, generator=gen)
        if draw(st.booleans()) and draw(st.booleans()):
            v = -v  # an adversarial flip
        kind = draw(st.sampled_from(["plain", "plain", "zero_blocks", "all_zero", "ties"]))
        if kind == "zero_blocks" and nb:
            zb = torch.rand(nb, generator=gen) < 0.4
            v = v * (~zb).repeat_interleave(block)[:numel]
        elif kind == "all_zero":
            v = torch.zeros(numel)
        elif kind == "ties":
            v = torch.where(torch.rand(numel, generator=gen) < 0.5, 1.0, -1.0)  # equal scales, +-1 signs
        p = compression.encode(v, block, 0)
        if draw(st.booleans()):  # scale tampering: one block huge or zeroed after encoding
            scales = p.scales.clone()
            j = draw(st.integers(0, nb - 1))
            scales[j] = draw(st.sampled_from([0.0, 1e30, 1e-30, 3.0]))
            p = compression.SignPacket(numel, block, 0, p.signs, scales)
        tokens = draw(st.sampled_from([0, 1, 7, 100, 100, 100, 1000, 10**12]))
        items.append((tokens, p))
    rule = draw(st.sampled_from(["meanmed", "vote"]))
    weight_cap = draw(st.sampled_from([None, 1.0, 2.0, 0.5]))
    min_agreement = draw(st.sampled_from([None, 0.5, 0.5, 0.7, 0.3]))
    return items, numel, rule, weight_cap, min_agreement


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_robust_sign_bitwise_equal_to_reference(case):
    _check(*case)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case(max_c=13))
def test_robust_sign_bitwise_equal_streaming_path(case):
    # More contributors than the pattern table takes, and the table disabled: the streaming path.
    old = aggregation._TABLE_MAX_ITEMS
    try:
        aggregation._TABLE_MAX_ITEMS = 0
        _check(*case)
    finally:
        aggregation._TABLE_MAX_ITEMS = old


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case(max_c=13))
def test_robust_sign_bitwise_equal_many_items(case):
    _check(*case)


@pytest.mark.parametrize("flip", [0, 1, 2])
@pytest.mark.parametrize("c", [3, 5, 8, 9])
def test_larger_parts_with_flips_drop_the_same(flip, c):
    # Several worker chunks of the codec (numel >> 32768), a partial last block, flipped contributors.
    gen = torch.Generator().manual_seed(c * 10 + flip)
    numel, block = 200_003, 2048
    base = torch.randn(numel, generator=gen)
    items = []
    for i in range(c):
        v = base + 0.7 * torch.randn(numel, generator=gen)
        items.append((100 + i, compression.encode(-v if i < flip else v, block, 0)))
    for rule in ("meanmed", "vote"):
        dropped = _check(items, numel, rule, 1.0, 0.5)
        if 2 * flip < c:  # a flipped minority is what the filter drops
            assert dropped == list(range(flip))


def test_empty_and_no_weight():
    p = compression.encode(torch.randn(10), 4, 0)
    for items in ([], [(0, p), (0, p)]):
        _check(items, 10, "meanmed", 1.0, 0.5)


@pytest.mark.parametrize("c", [3, 6, 8, 10])
@pytest.mark.parametrize("block", [64, 100, 5000])
def test_larger_parts_with_zero_blocks_and_flips(c, block):
    # Many segments and several block patterns (zeroed blocks), a flipped contributor, a partial block.
    gen = torch.Generator().manual_seed(c * 1000 + block)
    numel = 150_001
    nb = -(-numel // block)
    base = torch.randn(numel, generator=gen)
    items = []
    for i in range(c):
        v = base + 0.7 * torch.randn(numel, generator=gen)
        if i % 2:
            v = v * (torch.rand(nb, generator=gen) > 0.3).repeat_interleave(block)[:numel]
        items.append((50 + 13 * i, compression.encode(-v if i == 1 else v, block, 0)))
    for rule in ("meanmed", "vote"):
        assert _check(items, numel, rule, 1.0, 0.5) == [1]
        _check(items, numel, rule, None, None)
