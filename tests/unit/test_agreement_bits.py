"""Issue 27 (session 44): :func:`sign_agreements` counts a sign packet against :class:`PackedSigns` on the packed
bits (``agreement._packed_counts``): the same integer counts as decoding to fp32, at any part offset (on a byte or
not), any length, block sizes that are multiples of 8 (others take the decode), zero blocks and zero, NaN or
infinite aggregate elements; and its temporaries are bytes, not fp32 slices."""

import numpy as np
import pytest
import torch

import geomesh_p2p.trust.agreement as A
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust.agreement import sign_agreements, signs_of

pytestmark = pytest.mark.timeout(120)


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
