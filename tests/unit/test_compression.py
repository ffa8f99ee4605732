"""Tests of the CSS codec (geomesh_p2p.exchange.codec): sign packets, int8/fp16 packets, error feedback."""

from __future__ import annotations

import importlib.util
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomesh_p2p.exchange.codec as C
from geomesh_p2p.exchange.codec import (
    DEFAULT_BLOCK_SIZE,
    CodecError,
    ErrorFeedback,
    Fp16Packet,
    Int8Packet,
    SignPacket,
    decode,
    decode_any,
    encode,
    encode_as,
    encode_fp16,
    encode_int8,
    packet_from_bytes,
)
from geomesh_p2p.exchange.codec import sign as sign_mod

HEADER = 32
pytestmark = pytest.mark.timeout(60)


def ceil_div(a, b):
    return -(-a // b)


def naive_reference(v: torch.Tensor, B: int):
    """Element by element, in float64: packed sign bytes (little-endian bit order, 1 = v < 0)
    and per-block mean |v|."""
    x = v.double().tolist()
    P = len(x)
    signs = [0] * ceil_div(P, 8)
    for i, val in enumerate(x):
        if val < 0:
            signs[i // 8] |= 1 << (i % 8)
    scales = []
    for b in range(ceil_div(P, B)):
        blk = x[b * B : (b + 1) * B]
        scales.append(sum(abs(t) for t in blk) / len(blk))
    return signs, scales


def vector_reference(v: torch.Tensor, B: int):
    """The same in numpy (for sizes a Python loop would take too long on)."""
    a = v.numpy()
    signs = np.packbits(a < 0, bitorder="little")
    P = a.size
    if P == 0:
        return signs, np.zeros(0)
    starts = np.arange(0, P, B)
    sums = np.add.reduceat(np.abs(a.astype(np.float64)), starts)
    counts = np.diff(np.append(starts, P))
    return signs, sums / counts


def expected_decode(p: SignPacket) -> torch.Tensor:
    bits = np.unpackbits(p.signs.numpy(), bitorder="little")[: p.numel]
    sign = torch.from_numpy(1.0 - 2.0 * bits.astype(np.float32))
    scale = torch.from_numpy(np.repeat(p.scales.numpy(), p.block_size)[: p.numel])
    return scale * sign


def assert_matches_reference(v, p, B, signs_ref, scales_ref):
    assert p.numel == v.numel() and p.block_size == B
    assert p.signs.dtype == torch.uint8 and p.signs.shape == (ceil_div(v.numel(), 8),)
    assert p.scales.dtype == torch.float32 and p.scales.shape == (ceil_div(v.numel(), B),)
    assert p.signs.tolist() == list(np.asarray(signs_ref).tolist())
    # fp32 block sums: relative error grows like log2(B) roundings (cascade / vector summation).
    rtol = 1e-6 + 4 * 2.0**-23 * math.log2(B + 1)
    np.testing.assert_allclose(p.scales.numpy(), np.asarray(scales_ref, dtype=np.float64), rtol=rtol, atol=0)


# --------------------------------------------------------------------------- sign codec


@pytest.mark.parametrize("P,B", [(1000, 64), (1000, 7), (777, 2048), (2049, 2048), (4096, 8), (333, 1), (50, 3)])
def test_sign_encode_matches_naive_float64_reference(P, B):
    g = torch.Generator().manual_seed(P * 31 + B)
    v = torch.randn(P, generator=g) * 3
    v[::11] = 0.0
    p = encode(v, B, tokens=17)
    assert p.tokens == 17
    assert_matches_reference(v, p, B, *naive_reference(v, B))


@pytest.mark.parametrize(
    "P,B",
    [
        (300_007, 2048),  # chunked fast path on worker threads, plus a generic tail
        (2 * 32760 + 5, 24),  # lcm(8, B) = 24 chunks
        (200_001, 5),  # lcm(8, B) = 40
        (100_003, 40_000),  # lcm(8, B) >= 32768: OpenMP path
        (2_000_000 + 3, 1 << 20),  # lcm(8, B) > 2**19
    ],
)
def test_sign_encode_matches_reference_all_paths(P, B):
    g = torch.Generator().manual_seed(P)
    v = torch.randn(P, generator=g)
    v[::97] = 0.0
    v[5::97] = -0.0
    p = encode(v, B)
    assert_matches_reference(v, p, B, *vector_reference(v, B))
    d = decode(p)
    assert d.dtype == torch.float32 and d.shape == (P,)
    assert torch.equal(d, expected_decode(p))


def test_decode_is_scale_times_sign_bitwise():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(70_001, generator=g) * 1e-3
    p = encode(v, 256)
    d = decode(p)
    assert torch.equal(d, expected_decode(p))
    assert torch.equal(d.abs(), torch.from_numpy(np.repeat(p.scales.numpy(), 256)[:70_001]))
    assert torch.equal(torch.signbit(d), v < 0)


def test_sign_of_zero_and_bit_order():
    # +0.0 and -0.0 encode as '+' (bit 0); element 8k + j is bit j of byte k.
    v = torch.tensor([-1.0, 0.0, -0.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, -3.0])
    p = encode(v, 4)
    assert p.signs.tolist() == [0b0000_0001, 0b0000_0010]
    d = decode(p)
    assert d[1].item() == p.scales[0].item() and not torch.signbit(d[1])
    assert d[2].item() == p.scales[0].item() and not torch.signbit(d[2])
    # Subnormals keep their sign.
    tiny = torch.tensor([-1e-45, 1e-45, -1e-40, 0.0, -0.0, -1.0, 1.0, 0.0])
    assert encode(tiny, 8).signs.tolist() == [0b0010_0101]
    big = torch.zeros(300_000)
    big[1::3] = -1e-45
    big[2::3] = -0.0
    p = encode(big)
    signs_ref, scales_ref = vector_reference(big, 2048)
    assert p.signs.tolist() == signs_ref.tolist()
    np.testing.assert_allclose(p.scales.numpy(), scales_ref, rtol=0, atol=1.5e-45)  # means underflow
    # An all-zero block: scale 0, decodes to +0.0.
    z = decode(encode(torch.tensor([0.0, -0.0, 0.0]), 2))
    assert z.tolist() == [0.0, 0.0, 0.0] and not torch.signbit(z).any()


def test_empty_and_single_element():
    p = encode(torch.empty(0))
    assert p.numel == 0 and p.signs.numel() == 0 and p.scales.numel() == 0
    assert p.nbytes() == HEADER == len(p.to_bytes())
    assert decode(p).shape == (0,)
    assert SignPacket.from_bytes(p.to_bytes()).numel == 0

    for x in (-2.5, 0.0, 7.0):
        p = encode(torch.tensor([x]), tokens=3)
        assert p.signs.tolist() == [1 if x < 0 else 0]
        assert p.scales.tolist() == [abs(x)]
        assert decode(p).tolist() == [x]
        assert p.nbytes() == HEADER + 1 + 4
        q = SignPacket.from_bytes(p.to_bytes())
        assert q.tokens == 3 and decode(q).tolist() == [x]


@pytest.mark.parametrize("P,B", [(0, 2048), (1, 2048), (8, 8), (9, 8), (2047, 2048), (2049, 2048), (10_000, 3)])
def test_exact_byte_sizes(P, B):
    p = encode(torch.randn(P), B)
    expected = HEADER + ceil_div(P, 8) + 4 * ceil_div(P, B)
    assert p.nbytes() == expected == len(p.to_bytes())
    assert C.sign_payload_nbytes(P, B) == expected - HEADER


def test_compression_ratio_at_default_block():
    # GPT-2 small: 124M fp32 elements.
    P = 124_000_000
    nbytes = HEADER + C.sign_payload_nbytes(P, DEFAULT_BLOCK_SIZE)
    assert 4 * P / nbytes >= 31.0
    p = encode(torch.randn(1 << 20))
    assert 4 * p.numel / p.nbytes() >= 31.0


def test_header_layout_is_documented_little_endian():
    p = encode(torch.randn(1001), 100, tokens=2**40 + 5)
    data = p.to_bytes()
    magic, version, kind, flags, numel, bsize, reserved, tokens = struct.unpack_from("<4sBBHQIIQ", data)
    assert (magic, version, kind, flags, numel, bsize, reserved, tokens) == (b"GMSC", 1, 1, 0, 1001, 100, 0, 2**40 + 5)
    nb = ceil_div(1001, 100)
    assert np.array_equal(np.frombuffer(data, "<f4", nb, HEADER), p.scales.numpy())
    assert data[HEADER + 4 * nb :] == bytes(p.signs.tolist())


def test_roundtrip_bytes_bitwise():
    g = torch.Generator().manual_seed(5)
    v = torch.randn(123_457, generator=g)
    p = encode(v, 512, tokens=99)
    data = p.to_bytes()
    for buf in (data, bytearray(data), memoryview(data)):
        q = SignPacket.from_bytes(buf)
        assert (q.numel, q.block_size, q.tokens) == (p.numel, p.block_size, p.tokens)
        assert torch.equal(q.signs, p.signs) and torch.equal(q.scales, p.scales)
        assert q.to_bytes() == data
        assert torch.equal(decode(q), decode(p))
    q = packet_from_bytes(data)
    assert isinstance(q, SignPacket) and q.to_bytes() == data


def test_encode_is_deterministic_and_independent_of_workers(monkeypatch):
    g = torch.Generator().manual_seed(9)
    v = torch.randn(500_000, generator=g)
    a = encode(v).to_bytes()
    assert encode(v).to_bytes() == a
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert encode(v).to_bytes() == a
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert encode(v).to_bytes() == a


def test_generic_path_agrees_with_chunked_path(monkeypatch):
    g = torch.Generator().manual_seed(10)
    v = torch.randn(300_000, generator=g)
    fast = encode(v)
    monkeypatch.setattr(sign_mod, "_MAX_ALIGN", 1)  # forces one unchunked segment
    slow = encode(v)
    assert fast.to_bytes() == slow.to_bytes()
    assert torch.equal(decode(fast), expected_decode(fast))
    assert torch.equal(decode(slow), expected_decode(slow))


def test_input_dtypes_and_shapes():
    g = torch.Generator().manual_seed(11)
    m = torch.randn(37, 53, generator=g)
    p = encode(m, 64)
    assert p.numel == 37 * 53
    assert p.to_bytes() == encode(m.reshape(-1), 64).to_bytes()
    assert encode(m.t(), 64).to_bytes() == encode(m.t().contiguous().reshape(-1), 64).to_bytes()  # non-contiguous
    assert encode(m.double(), 64).to_bytes() == p.to_bytes()
    assert encode(m.bfloat16(), 64).numel == 37 * 53
    with pytest.raises(CodecError):
        encode(torch.arange(10))
    with pytest.raises(CodecError):
        encode([1.0, 2.0])  # type: ignore[arg-type]
    for bad in (0, -1, 2**32, 2.0, True):
        with pytest.raises(CodecError):
            encode(m, bad)
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(CodecError):
            encode(m, 64, tokens=bad)


def test_decode_into_out_and_device_checks():
    v = torch.randn(10_000)
    p = encode(v, 100)
    out = torch.full((10_000,), float("nan"))
    res = decode(p, out=out)
    assert res is out and torch.equal(out, expected_decode(p))
    assert torch.equal(decode(p, device="cpu"), out)
    for bad in (torch.empty(9_999), torch.empty(10_000, dtype=torch.float64), torch.empty(20_000)[::2]):
        with pytest.raises(CodecError):
            decode(p, out=bad)
    with pytest.raises(CodecError):
        decode(encode_int8(v))  # type: ignore[arg-type]


def test_large_finite_values_do_not_overflow_scales():
    v = torch.full((4096,), 3.0e38)
    v[1::2] *= -1
    p = encode(v, 2048)
    assert torch.isfinite(p.scales).all()
    torch.testing.assert_close(p.scales, torch.full((2,), 3.0e38), rtol=1e-6, atol=0)
    assert torch.equal(torch.signbit(decode(p)), v < 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 12_345, 299_999])
def test_non_finite_input_raises(bad, where):
    v = torch.randn(300_000)
    v[where] = bad
    with pytest.raises(CodecError, match="non-finite"):
        encode(v)
    with pytest.raises(CodecError, match="non-finite"):
        encode_int8(v)
    with pytest.raises(CodecError, match="non-finite"):
        encode_fp16(v)


# --------------------------------------------------------------------------- malformed bytes


def _sign_bytes(P=1000, B=100, tokens=4):
    return encode(torch.randn(P), B, tokens).to_bytes()


def _mutate(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


@pytest.mark.parametrize(
    "mutation, match",
    [
        (lambda d: d[:10], "truncated"),
        (lambda d: b"", "truncated"),
        (lambda d: d[:-1], "wrong sign packet length"),
        (lambda d: d + b"\0", "wrong sign packet length"),
        (lambda d: d[:HEADER], "wrong sign packet length"),
        (lambda d: _mutate(d, 0, b"XXXX"), "magic"),
        (lambda d: _mutate(d, 4, b"\x02"), "version"),
        (lambda d: _mutate(d, 5, b"\x09"), "kind"),
        (lambda d: _mutate(d, 5, b"\x02"), "kind"),  # claims int8
        (lambda d: _mutate(d, 6, b"\x01"), "flags"),
        (lambda d: _mutate(d, 20, b"\x01"), "reserved"),
        (lambda d: _mutate(d, 8, struct.pack("<Q", 1001)), "length"),  # wrong P
        (lambda d: _mutate(d, 8, struct.pack("<Q", 2**63)), "length"),  # absurd P
        (lambda d: _mutate(d, 16, struct.pack("<I", 0)), "block_size 0"),
        (lambda d: _mutate(d, 16, struct.pack("<I", 99)), "length"),  # wrong B
        (lambda d: _mutate(d, HEADER + 4, struct.pack("<f", float("nan"))), "NaN or Inf"),
        (lambda d: _mutate(d, HEADER + 4, struct.pack("<f", float("inf"))), "NaN or Inf"),
        (lambda d: _mutate(d, HEADER + 4, struct.pack("<f", -1.0)), "non-negative"),
        (lambda d: _mutate(d, HEADER + 4, struct.pack("<f", -0.0)), "non-negative"),
    ],
)
def test_malformed_sign_bytes_raise(mutation, match):
    data = mutation(_sign_bytes())
    with pytest.raises(CodecError, match=match):
        SignPacket.from_bytes(data)
    with pytest.raises(CodecError):
        packet_from_bytes(data)


def test_nonzero_padding_bits_rejected():
    data = _sign_bytes(P=1001, B=100)  # 1001 % 8 = 1: 7 padding bits in the last byte
    last = data[-1]
    assert last >> 1 == 0
    with pytest.raises(CodecError, match="padding"):
        SignPacket.from_bytes(data[:-1] + bytes([last | 0x80]))


def test_non_bytes_rejected():
    with pytest.raises(CodecError):
        SignPacket.from_bytes("GMSC")  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        packet_from_bytes(None)  # type: ignore[arg-type]


def test_constructor_validates():
    p = encode(torch.randn(100), 10)
    with pytest.raises(CodecError):
        SignPacket(100, 10, 0, p.signs[:-1], p.scales)
    with pytest.raises(CodecError):
        SignPacket(100, 10, 0, p.signs.to(torch.int16), p.scales)
    with pytest.raises(CodecError):
        SignPacket(100, 10, 0, p.signs, p.scales.double())
    with pytest.raises(CodecError):
        SignPacket(100, 10, -1, p.signs, p.scales)
    with pytest.raises(CodecError):
        SignPacket(100, 10, 0, p.signs, torch.full((10,), float("nan")))
    ok = SignPacket(100, 10, 5, p.signs.clone(), p.scales.clamp(max=0.1))  # e.g. an aggregator's cap
    assert decode(ok).abs().max() <= 0.1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.integers(0, 199), st.binary(min_size=1, max_size=8))
def test_fuzzed_bytes_only_raise_codec_error(junk, pos, patch):
    """Random or randomly patched packets either parse or raise CodecError, nothing else."""
    base = [_FUZZ_SIGN, _FUZZ_INT8, _FUZZ_FP16]
    for data in [junk, *(_mutate(b, pos % len(b), patch) for b in base)]:
        try:
            p = packet_from_bytes(data)
        except CodecError:
            continue
        assert p.to_bytes() == bytes(data)
        decode_any(p)


_FUZZ_SIGN = encode(torch.randn(37), 5).to_bytes()
_FUZZ_INT8 = encode_int8(torch.randn(37), 5).to_bytes()
_FUZZ_FP16 = encode_fp16(torch.randn(37)).to_bytes()


# --------------------------------------------------------------------------- property test


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    P=st.integers(0, 5000),
    B=st.one_of(st.integers(1, 300), st.sampled_from([2048, 4096, 1 << 20])),
    tokens=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**32 - 1),
    zero_every=st.integers(0, 5),
    scale_exp=st.integers(-30, 30),
)
def test_property_roundtrip(P, B, tokens, seed, zero_every, scale_exp):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(P) * 2.0**scale_exp).astype(np.float32)
    if zero_every:
        a[:: zero_every + 1] = 0.0
    v = torch.from_numpy(a)
    p = encode(v, B, tokens)
    data = p.to_bytes()
    assert len(data) == p.nbytes() == HEADER + ceil_div(P, 8) + 4 * ceil_div(P, B)
    q = packet_from_bytes(data)
    assert isinstance(q, SignPacket) and q.to_bytes() == data and q.tokens == tokens
    assert torch.equal(q.signs, p.signs) and torch.equal(q.scales, p.scales)
    assert_matches_reference(v, p, B, *vector_reference(v, B))
    assert torch.equal(decode(q), expected_decode(p))
    kinds = ["int8"]
    if P == 0 or float(v.abs().max()) < 65504:
        kinds.append("fp16")
    else:
        with pytest.raises(CodecError, match="fp16 range"):
            encode_fp16(v)
    for kind in kinds:
        r = encode_as(kind, v, B, tokens)
        assert packet_from_bytes(r.to_bytes()).to_bytes() == r.to_bytes()


# --------------------------------------------------------------------------- int8 / fp16


@pytest.mark.parametrize("P,B", [(0, 64), (1, 64), (1000, 64), (100_001, 2048), (777, 1)])
def test_int8_roundtrip_error_bound(P, B):
    g = torch.Generator().manual_seed(P + B)
    v = torch.randn(P, generator=g) * torch.rand(P, generator=g) * 10
    v[::13] = 0.0
    p = encode_int8(v, B, tokens=8)
    assert p.q.dtype == torch.int8 and p.q.shape == (P,)
    assert p.nbytes() == HEADER + 4 * ceil_div(P, B) + P == len(p.to_bytes())
    assert int(p.q.min()) >= -127 if P else True
    q = Int8Packet.from_bytes(p.to_bytes())
    assert q.to_bytes() == p.to_bytes() and q.tokens == 8
    d = decode_any(q)
    assert torch.equal(d, decode_any(p))
    if P:
        scale = torch.from_numpy(np.repeat(p.scales.numpy(), B)[:P])
        assert (d - v).abs().le(scale * (0.5 + 1e-5)).all()
        # absmax of every block is hit exactly (q = +-127)
        absmax = torch.from_numpy(np.maximum.reduceat(np.abs(v.numpy()), np.arange(0, P, B)))
        torch.testing.assert_close(p.scales * 127, absmax, rtol=1e-6, atol=0)
        assert torch.equal(d, p.q.float() * scale)


def test_int8_malformed():
    data = encode_int8(torch.randn(100), 10).to_bytes()
    with pytest.raises(CodecError, match="-127"):
        Int8Packet.from_bytes(data[:-1] + b"\x80")
    with pytest.raises(CodecError, match="length"):
        Int8Packet.from_bytes(data[:-1])
    with pytest.raises(CodecError, match="kind"):
        SignPacket.from_bytes(data)
    with pytest.raises(CodecError, match="NaN"):
        Int8Packet.from_bytes(_mutate(data, HEADER, struct.pack("<f", float("nan"))))


@pytest.mark.parametrize("P", [0, 1, 1000, 65_537])
def test_fp16_roundtrip_error_bound(P):
    g = torch.Generator().manual_seed(P)
    v = torch.randn(P, generator=g) * 100
    p = encode_fp16(v, tokens=1)
    assert p.values.dtype == torch.float16 and p.nbytes() == HEADER + 2 * P == len(p.to_bytes())
    q = Fp16Packet.from_bytes(p.to_bytes())
    assert q.to_bytes() == p.to_bytes() and q.tokens == 1 and q.block_size == 0
    d = decode_any(q)
    assert d.dtype == torch.float32 and torch.equal(d, v.half().float())
    assert (d - v).abs().le(v.abs() * 2.0**-11 + 2.0**-24).all()


def test_fp16_range_and_malformed():
    with pytest.raises(CodecError, match="fp16 range"):
        encode_fp16(torch.tensor([1.0, 70_000.0]))
    data = encode_fp16(torch.randn(10)).to_bytes()
    with pytest.raises(CodecError, match="NaN or Inf"):
        Fp16Packet.from_bytes(data[:-2] + struct.pack("<e", float("inf")))
    with pytest.raises(CodecError, match="block_size"):
        Fp16Packet.from_bytes(_mutate(data, 16, struct.pack("<I", 4)))
    with pytest.raises(CodecError, match="length"):
        Fp16Packet.from_bytes(data + b"\0\0")


def test_dispatch_helpers():
    v = torch.randn(5000)
    for kind, cls in (("sign", SignPacket), ("int8", Int8Packet), ("fp16", Fp16Packet)):
        p = encode_as(kind, v, 256, 42)
        assert isinstance(p, cls) and p.tokens == 42 and C.packet_kind(p) == kind
        q = packet_from_bytes(p.to_bytes())
        assert type(q) is cls
        out = torch.empty(5000)
        assert decode_any(q, out=out) is out
        assert torch.equal(out, decode_any(p))
    errs = [(decode_any(encode_as(k, v, 256)) - v).norm() for k in ("sign", "int8", "fp16")]
    assert errs[0] > errs[1] > errs[2]
    with pytest.raises(CodecError):
        encode_as("int4", v, 256, 0)
    with pytest.raises(CodecError):
        decode_any(object())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- error feedback


def _student_t2(P, g):
    z = torch.randn(P, generator=g)
    chi2 = (torch.randn(2, P, generator=g) ** 2).sum(0)
    return (z / torch.sqrt(chi2 / 2)).clamp(-50, 50)


def _cauchy(P, g):
    u = torch.rand(P, generator=g)
    return torch.tan(math.pi * (u - 0.5)).clamp(-100, 100)


@pytest.mark.parametrize("dist", ["gauss", "student_t2", "cauchy"])
def test_error_feedback_bounded_and_tracks_sum(dist):
    P, B, T = 4096, 256, 200
    g = torch.Generator().manual_seed(123)
    sample = {
        "gauss": lambda: torch.randn(P, generator=g),
        "student_t2": lambda: _student_t2(P, g),
        "cauchy": lambda: _cauchy(P, g),
    }[dist]
    ef = ErrorFeedback(P, B)
    assert ef.residual.shape == (P,) and not ef.residual.any()
    true = torch.zeros(P, dtype=torch.float64)
    with_ef = torch.zeros(P, dtype=torch.float64)
    without = torch.zeros(P, dtype=torch.float64)
    max_d = max_e = 0.0
    sq_d = 0.0
    for _ in range(T):
        d = sample()
        p = ef.encode(d, tokens=10)
        assert isinstance(p, SignPacket) and p.tokens == 10 and p.block_size == B
        true += d.double()
        with_ef += decode(p).double()
        without += decode(encode(d, B)).double()
        max_d = max(max_d, float(d.abs().max()))
        sq_d += float((d.double() ** 2).sum())
        max_e = max(max_e, float(ef.residual.abs().max()))
        rms_d = math.sqrt(sq_d / (P * (_ + 1)))
        assert float(ef.residual.double().pow(2).mean().sqrt()) <= 4 * rms_d
    # Bounded: the residual never exceeds a few times the largest input element.
    assert max_e <= 4 * max_d
    # Telescoping: sum of decoded packets = sum of inputs - final residual.
    torch.testing.assert_close(with_ef + ef.residual.double(), true, rtol=0, atol=1e-6 * T * max_d)
    # EF tracks the true sum far better than plain sign compression.
    err_ef = float((with_ef - true).norm())
    err_plain = float((without - true).norm())
    assert err_ef < 0.5 * err_plain


def test_error_feedback_first_step_and_reset():
    v = torch.randn(1000)
    ef = ErrorFeedback(1000, 100)
    p = ef.encode(v, 5)
    assert p.to_bytes() == encode(v, 100, 5).to_bytes()
    assert torch.equal(ef.residual, v - decode(p))
    ef.reset()
    assert not ef.residual.any()
    with pytest.raises(CodecError):
        ef.encode(torch.randn(999), 1)


def test_error_feedback_non_finite_leaves_residual_unchanged():
    ef = ErrorFeedback(1000, 100)
    ef.encode(torch.randn(1000), 1)
    before = ef.residual.clone()
    bad = torch.randn(1000)
    bad[3] = float("nan")
    with pytest.raises(CodecError):
        ef.encode(bad, 1)
    assert torch.equal(ef.residual, before)


# --------------------------------------------------------------------------- benchmark smoke test


def test_benchmark_script_runs(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "codec.py"
    spec = importlib.util.spec_from_file_location("codec_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    md = tmp_path / "bench.md"
    assert mod.main(["--numel", "200000", "--repeats", "2", "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "x torch.clone" in text and "--numel 200000" in text
