"""An agreement test that tightens with training (issue 28; geomesh_p2p/trust/agreement.py), on synthetic
sign-compressed contributions aggregated by the real rule (meanmed + the 0.5 filter).

Each round has a true update ``g`` (log-normal magnitudes, random signs) and honest contributions ``g + s x
noise`` (``s`` within +-15% of ``sigma`` x mean |g|: peers of one H and batch); the red team's stealthy flip
trains the same way, then flips the sign of its 45% largest-magnitude coordinates. As ``sigma`` falls (the
model trains and the honest updates agree more) every agreement rises, the flip's above 0.5, so the fixed
filter keeps it; the relative threshold follows the honest median and flags it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import geomesh_p2p.trust.agreement as A
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import aggregate_part
from geomesh_p2p.trust.agreement import MAD_SCALE, relative_threshold, sign_agreements, signs_of

pytestmark = pytest.mark.timeout(120)

P = 1 << 15
PARTS = [(0, P // 2), (P // 2, P)]


def _round(seed: int, honest: int, stealthy: int, sigma: float, spread: float = 0.3):
    """(agreements, the part-wise aggregate) of one synthetic round; honest peers are "h<i>", flippers "z<i>"."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(P, generator=g))
    truth = mag * torch.where(torch.rand(P, generator=g) < 0.5, -1.0, 1.0)
    contributions = {}
    for i in range(honest + stealthy):
        s = sigma * (1 + spread * (torch.rand(1, generator=g).item() - 0.5))
        v = truth + s * float(mag.mean()) * torch.randn(P, generator=g)
        name = f"h{i}" if i < honest else f"z{i}"
        if name.startswith("z"):
            top = v.abs().topk(int(0.45 * P)).indices
            v[top] = -v[top]
        contributions[name] = {j: compression.encode(v[a:b].contiguous(), 2048, 1000) for j, (a, b) in enumerate(PARTS)}
    aggregate = torch.zeros(P)
    for j, (a, b) in enumerate(PARTS):
        items = [(1000, contributions[n][j]) for n in sorted(contributions)]
        aggregate[a:b] = aggregate_part(items, b - a, rule="meanmed")
    return sign_agreements(contributions, aggregate, PARTS), aggregate


@pytest.mark.parametrize("honest, stealthy", [(3, 1), (5, 2)])
def test_the_stealthy_flip_passes_the_fixed_filter_and_fails_the_relative_one(honest, stealthy):
    flagged = missed = false = 0
    for sigma in (1.0, 2.0, 3.0):  # honest agreement from ~0.9 down to ~0.7 (the flip's from ~0.4 up to ~0.6+)
        for seed in range(6):
            agreements, _ = _round(seed, honest, stealthy, sigma)
            test = relative_threshold(agreements)
            assert test.relative and test.threshold > 0.6
            flips = {p for p in agreements if p.startswith("z")}
            flagged += len(flips & set(test.outliers))
            missed += len(flips - set(test.outliers))
            false += len(set(test.outliers) - flips)
            if sigma >= 2.0:  # the model has trained: the flip agrees on more than half, the fixed filter keeps it
                assert all(agreements[p] > 0.5 for p in flips), agreements
    assert false == 0  # no honest contributor flagged in 18 rounds
    assert missed == 0 and flagged == 18 * stealthy


def test_honest_rounds_flag_nobody_at_one_h_and_rarely_with_a_wide_spread():
    false = 0
    for sigma in (1.0, 2.0, 3.0):
        for seed in range(10):
            agreements, _ = _round(100 + seed, 4, 0, sigma)
            false += len(relative_threshold(agreements).outliers)
    assert false == 0  # 120 honest contributions, peers of one H and batch
    # honest noise spread 0.25x..1.75x (peers of different H and batch): a few flags, why it is advisory
    wide = sum(len(relative_threshold(_round(200 + s, 7, 0, 1.0, spread=1.5)[0]).outliers) for s in range(10))
    assert wide <= 3  # of 70 (measured: 1-2 per 140 over sigma 1..3)


def test_the_threshold_and_its_guards():
    a = {"a": 0.80, "b": 0.82, "c": 0.84, "d": 0.86, "z": 0.70}
    t = relative_threshold(a)
    assert t.median == 0.82 and t.mad == pytest.approx(0.02) and t.relative
    assert t.threshold == pytest.approx(0.82 - (3.5 / MAD_SCALE) * 0.02) and t.outliers == ("z",)
    assert t.as_dict() == {"median": 0.82, "mad": 0.02, "threshold": 0.7162, "outliers": ["z"], "relative": True}
    # identical honest agreements: the MAD floor, not any difference at all, sets the threshold
    same = relative_threshold({"a": 0.8, "b": 0.8, "c": 0.8, "z": 0.76})
    assert same.threshold == pytest.approx(0.8 - (3.5 / MAD_SCALE) * 0.01) and same.outliers == ()
    # never below the fixed floor; no relative test under min_contributors
    low = relative_threshold({"a": 0.5, "b": 0.6, "c": 0.7, "d": 0.55, "z": 0.45})
    assert low.threshold == 0.5 and low.outliers == ("z",)
    few = relative_threshold({"a": 0.9, "b": 0.9, "z": 0.6})
    assert not few.relative and few.threshold == 0.5 and few.outliers == ()
    assert relative_threshold({}).outliers == ()
    with pytest.raises(ValueError):
        relative_threshold({"a": 1.5})
    with pytest.raises(ValueError):
        relative_threshold(a, z=0)


def test_agreements_count_only_elements_where_both_are_nonzero():
    agg = torch.tensor([1.0, -1.0, 0.0, 2.0, -3.0, 1.0, 1.0, -1.0])
    parts = [(0, 4), (4, 8)]
    mine = torch.tensor([1.0, 1.0, 5.0, 2.0, -1.0, -1.0, 0.0, 0.0])  # part 1's last block is all zero
    packets = {"p": {j: compression.encode(mine[a:b].contiguous(), 2, 10) for j, (a, b) in enumerate(parts)}}
    # part 0: elements 0, 1, 3 both non-zero (2 agree); part 1: elements 4, 5 (1 agrees); 6, 7 abstain
    assert sign_agreements(packets, agg, parts) == {"p": 3 / 5}
    assert sign_agreements({"q": {0: torch.ones(4)}}, agg, parts) == {}  # fp32 pushes are skipped


def noisy_contributions(truth, parts, g, block: int, tokens: int, n: int = 4) -> dict:
    """``n`` contributors ``h0..``, each ``truth`` plus unit Gaussian noise (drawn from ``g``), sign-encoded per part."""
    return {
        f"h{i}": {
            j: compression.encode((truth[a:b] + torch.randn(b - a, generator=g)).contiguous(), block, tokens)
            for j, (a, b) in enumerate(parts)
        }
        for i in range(n)
    }


def test_the_aggregates_signs_give_the_same_agreements():
    """Issue 27 (session 39): verified work measures on :func:`signs_of` and lets the aggregate go (session 42: two
    bitmaps, P/4 bytes, instead of int8 signs, P bytes)."""
    g = torch.Generator().manual_seed(5)
    truth = torch.randn(P, generator=g)
    contributions = noisy_contributions(truth, PARTS, g, 2048, 1000)
    aggregate = truth.clone()
    aggregate[::7] = 0.0  # zeros are left out of both counts
    signs = signs_of(aggregate, chunk=1000)
    assert signs.numel() == P and signs.nonzero.dtype == signs.positive.dtype == torch.uint8
    assert signs.nonzero.numel() == signs.positive.numel() == -(-P // 8)
    assert torch.equal(signs.span(0, P).float(), torch.sign(aggregate))
    assert sign_agreements(contributions, signs, PARTS) == sign_agreements(contributions, aggregate, PARTS)


def test_sign_agreements_a_slice_at_a_time_count_what_the_whole_decode_counts(monkeypatch):
    """Issue 27 (session 41): the measurement decodes a slice at a time; the same integer counts as decoding each
    part whole (the code before), on slices that cut blocks and bytes, with zero blocks and zero aggregate elements."""

    g = torch.Generator().manual_seed(9)
    truth = torch.randn(P, generator=g)
    contributions = {}
    for i in range(3):
        v = truth + torch.randn(P, generator=g)
        v[4096:6144] = 0.0  # a whole block of zeros: scale 0, signs 0
        contributions[f"h{i}"] = {
            j: compression.encode(v[a:b].contiguous(), 2048, 1000) for j, (a, b) in enumerate(PARTS)
        }
    aggregate = truth.clone()
    aggregate[::5] = 0.0

    want = decoded_counts(contributions, aggregate, PARTS)
    assert 0.6 < min(want.values()) and max(want.values()) < 0.95
    for slice_ in (1000, 2048, 1 << 22):
        monkeypatch.setattr(A, "_SLICE", slice_)
        assert sign_agreements(contributions, aggregate, PARTS) == want
        assert sign_agreements(contributions, signs_of(aggregate), PARTS) == want


def test_packed_signs_spans_are_the_signs_at_any_offset_and_size():
    """Issue 27 (session 42): :class:`PackedSigns` keeps 2 bits an element; any span (cutting bytes, an odd length,
    a chunk that is not a multiple of 8) reads back ``torch.sign`` exactly, the bytes are the little-endian bit
    order, and a span outside is refused."""
    g = torch.Generator().manual_seed(11)
    for n in (1, 7, 8, 13, 1001):
        v = torch.randn(n, generator=g)
        v[::3] = 0.0
        for chunk in (1, 8, 13, 4096):
            packed = signs_of(v, chunk=chunk)
            assert torch.equal(packed.span(0, n), torch.sign(v).to(torch.int8))
            for a, b in ((0, 0), (1, n), (n // 2, n), (n // 3, n - n // 3)):
                if a <= b:
                    assert torch.equal(packed.span(a, b), torch.sign(v[a:b]).to(torch.int8)), (n, chunk, a, b)
    exact = signs_of(torch.tensor([0.0, 1.0, -1.0, 2.0, 0.0, 0.0, 0.0, 3.0, -5.0]))
    assert exact.nonzero.tolist() == [0b10001110, 0b1] and exact.positive.tolist() == [0b10001010, 0b0]
    with pytest.raises(ValueError, match="span"):
        exact.span(3, 10)


def test_packed_signs_read_a_nan_as_torch_sign_does():
    """Red team 42: a part of the aggregate may hold a NaN (the outer step skips such a part:
    ``optim.outer_step_per_part``); ``torch.sign`` reads it as 0, so the fp32 path leaves it out of both counts. The
    bitmaps read it as -1 (non-zero, not positive): other counts than the fp32 path's."""
    agg = torch.tensor([float("nan"), 1.0, -1.0, float("nan"), -0.0, float("inf"), -float("inf"), 2.0] * 2)
    mine = torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0] * 2)
    packets = {"p": {0: compression.encode(mine, 4, 10)}}
    assert torch.equal(signs_of(agg).span(0, agg.numel()), torch.sign(agg).to(torch.int8))
    want = sign_agreements(packets, agg, [(0, 16)])
    assert want == {"p": 6 / 10}  # the NaNs and -0.0 abstain; +-inf count as their signs
    assert sign_agreements(packets, signs_of(agg, chunk=3), [(0, 16)]) == want


# Issue 27 (session 44): the agreement counted on the packed bits (agreement._packed_counts) against the decode.


def decoded_counts(contributions, aggregate, part_ranges):
    """The definition: decode each part whole and count (the code before session 41's slices)."""
    out = {}
    for sender in sorted(contributions):
        both = agree = 0
        for j, packet in sorted(contributions[sender].items()):
            s, e = part_ranges[j]
            mine, ref = torch.sign(compression.decode(packet)), torch.sign(aggregate[s:e])
            live = (mine != 0) & (ref != 0)
            both += int(live.sum())
            agree += int((live & (mine == ref)).sum())
        if both:
            out[sender] = agree / both
    return out


@pytest.mark.parametrize("seed", range(6))
def test_packed_counts_are_the_decoded_counts(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    total = int(rng.integers(200, 5000))
    cuts = sorted({0, total, *(int(c) for c in rng.integers(1, total, size=int(rng.integers(1, 4))))})
    parts = list(zip(cuts[:-1], cuts[1:]))
    block = int(rng.choice([8, 16, 64, 2048]))
    truth = torch.randn(total, generator=g)
    aggregate = truth.clone()
    aggregate[:: int(rng.integers(3, 9))] = 0.0
    aggregate[int(rng.integers(0, total))] = float("nan")
    aggregate[int(rng.integers(0, total))] = float("inf")
    contributions = {}
    for i in range(3):
        v = truth + torch.randn(total, generator=g)
        z = int(rng.integers(0, total))
        v[z : z + 2 * block] = 0.0  # a whole block or two of zeros: scale 0
        contributions[f"h{i}"] = {
            j: compression.encode(v[a:b].contiguous(), block, 10 + i) for j, (a, b) in enumerate(parts)
        }
    want = decoded_counts(contributions, aggregate, parts)
    assert want and all(0.0 < x < 1.0 for x in want.values())
    calls = []
    real = A._packed_counts
    monkeypatch.setattr(A, "_packed_counts", lambda *a: calls.append(a[2]) or real(*a))
    for slice_ in (8, 24, 1 << 22):  # slices that cut parts into many pieces, and one whole
        monkeypatch.setattr(A, "_SLICE", slice_)
        assert sign_agreements(contributions, signs_of(aggregate, chunk=37), parts) == want, (
            seed,
            slice_,
            parts,
            block,
        )
    assert sorted(set(calls)) == [a for a, _ in parts]  # every part took the packed path


def test_a_block_size_not_a_multiple_of_8_is_decoded(monkeypatch):
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(301, generator=g)
    packets = {
        "p": {0: compression.encode((truth + torch.randn(301, generator=g))[:151].contiguous(), 3, 1)},
        "q": {1: compression.encode(truth[151:].contiguous(), 12, 1)},
    }
    calls = []
    real = A._packed_counts
    monkeypatch.setattr(A, "_packed_counts", lambda *a: calls.append(a[0].block_size) or real(*a))
    parts = [(0, 151), (151, 301)]
    assert sign_agreements(packets, signs_of(truth), parts) == decoded_counts(packets, truth, parts)
    assert calls == []  # B = 3 decodes; B = 12 too (12 % 8 != 0)


def test_exact_counts_on_a_hand_made_part_off_a_byte():
    """A part starting at element 3 (not on a byte), blocks of 8, its second block all zero (scale 0: abstains)."""
    agg = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 1.0, 0.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 1.0, -1.0, 1.0])
    mine = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # elements 3..15
    packet = compression.encode(mine, 8, 1)
    # against agg[3:11] = + - + 0 - + + -: live everywhere but element 6 (7), the same sign at 3, 7 and 9 (3)
    assert A._packed_counts(packet, signs_of(agg), 3) == (7, 3)
    assert sign_agreements({"p": {0: packet}}, signs_of(agg), [(3, 16)]) == {"p": 3 / 7}
    assert decoded_counts({"p": {0: packet}}, agg, [(3, 16)]) == {"p": 3 / 7}


@pytest.mark.parametrize("block", [2048, 1 << 26, (1 << 32) - 8])
def test_a_huge_block_size_costs_no_block_sized_temporary(block):
    """Red team 44: the per-byte block mask was np.repeat of each block's flag B / 8 times, so a 100-element packet
    of one block at B = 2**32 - 8 (any multiple of 8 below 2**32 is a valid sign packet) made a 512 MiB
    temporary; now the mask is written into the window's own bytes. Same counts as the decode."""
    tracemalloc = pytest.importorskip("tracemalloc")
    g = torch.Generator().manual_seed(5)
    agg = torch.randn(200, generator=g)
    agg[60] = 0.0
    packet = compression.encode(torch.randn(100, generator=g), block, 1)
    signs = signs_of(agg)
    tracemalloc.start()
    try:
        got = A._packed_counts(packet, signs, 50)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # bytes: a few 13-byte windows and numpy's small objects, not B / 8
    want = decoded_counts({"p": {0: packet}}, agg, [(50, 150)])["p"]
    assert got[0] == 99 and got[1] / got[0] == want
