"""An agreement test that tightens with training (issue 28): a threshold relative to the round's own
agreement distribution, not the fixed 0.5 of the aggregation's filter.

The aggregation's agreement filter (``exchange/robust.py``, docs/security.md "Aggregation a minority cannot
steer") drops a contributor whose signs agree with the consensus on fewer than 0.5 of the elements. That
separates a flipped update (anti-correlated) from an honest one, but not the red team's *stealthy* flip (it
trains honestly, then flips the 45% largest-magnitude coordinates): its agreement rose from 0.48 to 0.62 as
the model trained, above 0.5, while the honest contributors' agreement rose with it. What separates it is its
place in the round's distribution, not an absolute level.

:func:`sign_agreements` measures every contributor's sign agreement with the round's aggregate (integer counts
over the elements where both are non-zero, from the signed relay contributions every participant holds: the
same numbers everywhere). :func:`relative_threshold` turns them into a threshold with the modified z-score of
Iglewicz and Hoaglin (1993, "How to Detect and Handle Outliers", sec. 3.3): ``M_i = 0.6745 (median - a_i) /
MAD``; a contributor is a low outlier when ``M_i > z`` (3.5, their recommendation), i.e. when its agreement is
below ``median - (z / 0.6745) x MAD``. Median and MAD ignore a minority, so the attackers cannot move the
reference, and the threshold follows the honest spread as training tightens it. Guards: never below the fixed
``floor`` (0.5, what the filter already drops), a MAD floor (``min_mad``: honest contributors that agree
almost exactly would otherwise make any float difference an outlier), and no relative test under
``min_contributors`` (the median of two or three says little).

:func:`supports` records, per contributor, the statistic that decides instead (session 19): its share of the
other contributors' summed vote margin, the support filter the aggregation applies per part
(``exchange/robust.py``, ``min_support``; docs/security.md "Stealthy attacks: the support filter"). Unlike
agreement it does not grow with the steps a contribution holds: in the clean 4-peer process run the slowest honest
peer's support was 0.817-0.858 against the others' 0.821-0.871.

Advisory so far: the node records each round's figures (the row's ``extra["verify"]["agreement"]``) and logs
the outliers; it does not drop or exclude on them. In a clean 4-peer process run it flagged the slowest honest
peer (1-6 steps a round against 5-23) in every round: agreement grows with the steps a contribution holds, so
the statistic must be normalised by the claimed steps, and honest distributions measured (H = 5...100,
several batch sizes), before it may decide (docs/security.md, "An agreement test that tightens with training").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import support_counts
from geomesh_p2p.trust.check_model import decode_span

__all__ = ["AgreementTest", "PackedSigns", "signs_of", "sign_agreements", "supports", "relative_threshold", "MAD_SCALE"]

#: The modified z-score's constant: 0.6745 = the 0.75 quantile of the standard normal, so that
#: ``MAD / 0.6745`` estimates the standard deviation of normal data (Iglewicz and Hoaglin 1993).
MAD_SCALE = 0.6745

#: elements per slice of :func:`sign_agreements` (16 MiB of fp32)
_SLICE = 1 << 22

#: count sign packets on their packed bits against :class:`PackedSigns` (False: decode them, as before session
#: 44; ``benchmarks/agreement_bits.py`` runs both side by side)
_COUNT_PACKED = True


@dataclass(frozen=True)
class PackedSigns:
    """The signs of an fp32 ``[n]`` vector in two bitmaps of ``ceil(n / 8)`` uint8 each, element ``i`` at
    bit ``i % 8`` of byte ``i // 8`` (little-endian bit order, as the sign codec packs): ``nonzero`` (the element is
    not 0) and ``positive`` (it is > 0). A quarter of an int8 sign vector's bytes (P/4 against P: 22 MB against
    89 MB at ``gpt2-124m``): what :func:`sign_agreements` reads of the round's aggregate while the next round's
    inner steps run beside it (issue 27, session 42)."""

    n: int
    nonzero: torch.Tensor
    positive: torch.Tensor

    def numel(self) -> int:
        """The elements the signs are of (as ``Tensor.numel``)."""
        return self.n

    def span(self, start: int, end: int) -> torch.Tensor:
        """``torch.sign`` of elements ``[start, end)`` as int8 ``[end - start]`` (-1, 0, 1). Raises ValueError
        outside ``[0, n]``."""
        if not 0 <= start <= end <= self.n:
            raise ValueError(f"span [{start}, {end}) of {self.n} signs")
        lo, hi = start // 8, -(-end // 8)
        nz = _unpack(self.nonzero[lo:hi])[start - 8 * lo : end - 8 * lo]
        pos = _unpack(self.positive[lo:hi])[start - 8 * lo : end - 8 * lo]
        return (2 * pos.to(torch.int8) - 1) * nz.to(torch.int8)


def _unpack(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n]`` -> bool ``[8n]``, bit ``k`` of byte ``j`` at ``8j + k`` (the inverse of ``np.packbits(...,
    bitorder="little")``)."""
    return torch.from_numpy(np.unpackbits(b.numpy(), bitorder="little").view(np.bool_))


def _ref_signs(aggregate: torch.Tensor | PackedSigns, start: int, end: int) -> torch.Tensor:
    """The signs of elements ``[start, end)`` of an fp32 aggregate (read flat) or of its :class:`PackedSigns`."""
    if isinstance(aggregate, PackedSigns):
        return aggregate.span(start, end)
    return torch.sign(aggregate.reshape(-1)[start:end])


def signs_of(aggregate: torch.Tensor, chunk: int = 1 << 22) -> PackedSigns:
    """The signs of ``aggregate`` (fp32, any shape, read flat; a NaN reads 0, as ``torch.sign`` reads it) as
    :class:`PackedSigns`, made ``chunk`` elements at a time (rounded up to a multiple of 8; no fp32 ``[P]``
    temporary): all :func:`sign_agreements` reads of the aggregate, in a sixteenth of its bytes, so the round's aggregate need not be held while the
    agreement is measured (issue 27: session 39 held int8 signs, session 42 two bitmaps)."""
    flat = aggregate.detach().reshape(-1)
    n = flat.numel()
    chunk = max(8, -(-chunk // 8) * 8)  # whole bytes per chunk: only the last one is padded (with 0 bits)
    nonzero = np.empty(-(-n // 8), dtype=np.uint8)
    positive = np.empty_like(nonzero)
    for s in range(0, n, chunk):
        v = flat[s : s + chunk].cpu().numpy()  # a chunk at a time off a device, too
        lo, hi = s // 8, s // 8 + -(-v.size // 8)
        pos = v > 0
        positive[lo:hi] = np.packbits(pos, bitorder="little")
        # > 0 or < 0, not != 0: a NaN (a part the outer step skips) is no sign, as torch.sign reads it (red team 42)
        nonzero[lo:hi] = np.packbits(np.logical_or(pos, v < 0, out=pos), bitorder="little")
    return PackedSigns(n, torch.from_numpy(nonzero), torch.from_numpy(positive))


def _window_bits(bitmap: np.ndarray, start: int, m: int) -> np.ndarray:
    """Bits ``[start, start + m)`` of a little-endian bitmap as ``ceil(m / 8)`` uint8, bits past ``m`` zero (a copy
    when ``start`` is not on a byte: unpacked and packed again, ``m`` bytes of temporaries)."""
    lo, hi = start // 8, -(-(start + m) // 8)
    if start % 8:
        bits = np.unpackbits(bitmap[lo:hi], bitorder="little")[start % 8 : start % 8 + m]
        return np.packbits(bits, bitorder="little")
    out = bitmap[lo:hi].copy()
    if m % 8:
        out[-1] &= (1 << (m % 8)) - 1
    return out


def _spread(blocks: np.ndarray, k: int, size: int) -> np.ndarray:
    """bool ``[nb]`` -> uint8 ``[size]``: byte ``i`` is 255 where ``blocks[i // k]`` (``(nb - 1) k < size <= nb k``),
    else 0; no temporary larger than ``size`` bytes, whatever ``k``."""
    out = np.empty(size, dtype=np.uint8)
    whole = size // k
    out[: whole * k].reshape(whole, k)[:] = blocks[:whole, None].astype(np.uint8) * np.uint8(255)
    if whole * k < size:  # the last block ends inside this window's bytes
        out[whole * k :] = np.uint8(255) if blocks[whole] else np.uint8(0)
    return out


def _packed_counts(packet: Any, signs: PackedSigns, start: int) -> tuple[int, int]:
    """The (both non-zero, signs equal) counts of :func:`sign_agreements` for one sign packet (block size a
    multiple of 8) against elements ``[start, start + numel)`` of ``signs``, on the packed bits (issue 27, session
    44): an element of the packet is non-zero where its block's scale is > 0 (scales are finite and >= 0, so a
    decoded value is +-scale), negative where its bit is 1, so ``live = nonzero(aggregate) & scale > 0`` and
    ``agree = live & (positive(aggregate) xor bit)``, counted with popcounts over :data:`_SLICE` elements at a
    time. The same integers as decoding to fp32 (``tests/unit/test_agreement_relative.py``), with ``_SLICE / 8``-byte
    temporaries instead of a few fp32 slices, and without the decode's multiplies."""
    n, B = packet.numel, packet.block_size
    nz_all, pos_all = signs.nonzero.numpy(), signs.positive.numpy()
    bits_all, live_blocks = packet.signs.numpy(), (packet.scales > 0).numpy()
    both = agree = 0
    step = max(B, _SLICE // B * B)  # a whole number of blocks (and so of bytes) a slice
    for a in range(0, n, step):
        m = min(step, n - a)
        live = _window_bits(nz_all, start + a, m)
        # each block's scale > 0, spread over its B / 8 bytes (the last block may end inside its bytes: masked by
        # live, whose bits past m are 0), written into live.size bytes: np.repeat of the last block whole was a
        # B / 8-byte temporary for a short packet (512 MiB at B = 2**32 - 8: red team 44)
        live &= _spread(live_blocks[a // B : -(-(a + m) // B)], B // 8, live.size)
        both += int(np.bitwise_count(live).sum(dtype=np.int64))
        same = _window_bits(pos_all, start + a, m) ^ bits_all[a // 8 : a // 8 + live.size]
        agree += int(np.bitwise_count(live & same).sum(dtype=np.int64))
    return both, agree


def sign_agreements(
    contributions: Mapping[str, Mapping[int, Any]],
    aggregate: torch.Tensor | PackedSigns,
    part_ranges: Sequence[tuple[int, int]],
) -> dict[str, float]:
    """Each contributor's sign agreement with the round's aggregate: over the parts it sent (sign packets;
    other encodings are skipped), the elements where both its decoded value and ``aggregate`` (fp32 ``[P]``, or
    its :func:`signs_of`: the same figures) are non-zero, the share where their signs are equal. A contributor with
    no such element is left out. Integer counts, so the same inputs give the same figures on every machine.
    Against :class:`PackedSigns` (what verified work holds) a packet is counted on its packed bits
    (:func:`_packed_counts`, the same integers); against an fp32 aggregate, or a packet whose block size is not a
    multiple of 8, it is decoded :data:`_SLICE` elements at a time (:func:`~geomesh_p2p.trust.check_model.
    decode_span`, bitwise the whole decode's): its temporaries are a few slices, not a part's. Blocking (it reads
    every contribution): off the event loop."""
    total = aggregate.numel()

    out: dict[str, float] = {}
    for sender in sorted(contributions):
        both = agree = 0
        for j, packet in sorted(contributions[sender].items()):
            if not isinstance(packet, compression.SignPacket) or not 0 <= j < len(part_ranges):
                continue
            s, e = part_ranges[j]
            n = packet.numel
            if min(e, total) - min(s, total) != n:
                continue
            if _COUNT_PACKED and isinstance(aggregate, PackedSigns) and packet.block_size % 8 == 0:
                b_, a_ = _packed_counts(packet, aggregate, s)
                both, agree = both + b_, agree + a_
                continue
            # a slice at a time (issue 27, session 41): the whole part's decode, its signs and their masks were
            # ~1 GB of temporaries at gpt2-124m, the peak of a peer whose next inner steps ran beside them
            buf = torch.empty(min(n, _SLICE), dtype=torch.float32)
            for a in range(0, n, _SLICE):
                b = min(n, a + _SLICE)
                mine = torch.sign(decode_span(packet, a, b, buf[: b - a]))
                ref = _ref_signs(aggregate, s + a, s + b)
                live = (mine != 0) & (ref != 0)
                both += int(live.sum())
                agree += int((live & (mine == ref)).sum())
        if both:
            out[sender] = agree / both
    return out


def supports(
    contributions: Mapping[str, Mapping[int, Any]], part_ranges: Sequence[tuple[int, int]]
) -> dict[str, float]:
    """Each contributor's *support* over the parts it sent (sign packets only): the share of the other
    contributors' summed vote margin its signs side with, summed over the parts (integer counts, so the same
    figures everywhere): what the aggregation's support filter decides on per part (``min_support``,
    :func:`geomesh_p2p.exchange.robust.support_counts`), here over the round for the record. A contributor with no
    such element is left out. Blocking: off the event loop."""
    total: dict[str, list[int]] = {}
    for j in range(len(part_ranges)):
        senders = sorted(
            s
            for s in contributions
            if isinstance(contributions[s].get(j), compression.SignPacket)
            and contributions[s][j].numel == part_ranges[j][1] - part_ranges[j][0]
        )
        if len(senders) < 3:
            continue
        n_w, n_agree = support_counts([contributions[s][j] for s in senders])
        for s, n, a in zip(senders, n_w, n_agree):
            t = total.setdefault(s, [0, 0])
            t[0] += n
            t[1] += a
    return {s: a / n for s, (n, a) in sorted(total.items()) if n}


@dataclass(frozen=True)
class AgreementTest:
    """A round's relative agreement test: the median and MAD of the agreements, the threshold, and the low
    outliers (contributors below it, sorted by peer id). ``relative``: False when too few contributors for
    the relative test (the threshold is then ``floor``)."""

    median: float
    mad: float
    threshold: float
    outliers: tuple[str, ...]
    relative: bool

    def as_dict(self) -> dict:
        """JSON-able (the round row's ``extra["verify"]["agreement"]``)."""
        return {
            "median": round(self.median, 4),
            "mad": round(self.mad, 4),
            "threshold": round(self.threshold, 4),
            "outliers": [p[:10] for p in self.outliers],
            "relative": self.relative,
        }


def relative_threshold(
    agreements: Mapping[str, float],
    *,
    z: float = 3.5,
    floor: float = 0.5,
    min_mad: float = 0.01,
    min_contributors: int = 4,
) -> AgreementTest:
    """The relative agreement test of ``agreements`` (peer id -> share in [0, 1]; see the module docstring):
    threshold ``max(floor, median - (z / MAD_SCALE) x max(MAD, min_mad))``, outliers the peers strictly below
    it. Fewer than ``min_contributors`` agreements: threshold ``floor``. Pure and deterministic (plain floats,
    the statistics module's median). Raises ValueError for ``z <= 0``, a negative ``min_mad`` or an agreement
    outside [0, 1]."""
    if not z > 0 or not min_mad >= 0:
        raise ValueError(f"z={z} must be > 0 and min_mad={min_mad} >= 0")
    values = sorted(float(v) for v in agreements.values())
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError("agreements must lie in [0, 1]")
    if not values:
        return AgreementTest(0.0, 0.0, floor, (), False)
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    if len(values) < min_contributors:
        threshold, relative = floor, False
    else:
        threshold, relative = max(floor, med - (z / MAD_SCALE) * max(mad, min_mad)), True
    outliers = tuple(sorted(p for p, v in agreements.items() if float(v) < threshold))
    return AgreementTest(med, mad, threshold, outliers, relative)
