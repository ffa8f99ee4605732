"""Shared wire-format pieces of the codec: header, kinds, errors, argument checks.

Every packet starts with the same fixed 32-byte little-endian header (``struct`` format
``"<4sBBHQIIQ"``):

====== ===== ======================================================================
offset bytes field
====== ===== ======================================================================
0      4     magic ``b"GMSC"`` (GeoMesh Sign Codec)
4      1     format version, currently ``1``
5      1     kind: ``1`` sign, ``2`` int8, ``3`` fp16
6      2     flags, must be ``0``
8      8     P, number of fp32 elements encoded (u64)
16     4     B, block size in elements (u32); ``0`` for fp16 (which has no blocks)
20     4     reserved, must be ``0``
24     8     tokens the sender trained on, n_i (u64)
====== ===== ======================================================================

The payload follows immediately (at offset 32, so its fp32 part is 4-byte aligned). Its
layout depends on the kind; see :class:`SignPacket`, :class:`Int8Packet`, :class:`Fp16Packet`.
All multi-byte numbers in header and payload are little-endian. No pickle is involved.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

MAGIC = b"GMSC"
FORMAT_VERSION = 1
KIND_SIGN = 1
KIND_INT8 = 2
KIND_FP16 = 3
KIND_NAMES = {KIND_SIGN: "sign", KIND_INT8: "int8", KIND_FP16: "fp16"}

HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_SIZE = HEADER.size  # 32 bytes
assert HEADER_SIZE == 32

DEFAULT_BLOCK_SIZE = 2048
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


class CodecError(ValueError):
    """Raised for input the codec refuses: NaN/Inf values, malformed or truncated bytes,
    wrong sizes, dtypes or devices, out-of-range header fields."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(value, name: str, lo: int, hi: int, hi_text: str) -> int:
    """``value`` as a Python int; CodecError unless it is an int (or numpy integer, not a bool) in
    ``[lo, hi]`` (``hi_text``: how the message writes ``hi``)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CodecError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise CodecError(f"{name} must be in [{lo}, {hi_text}], got {value}")
    return value


def check_block_size(block_size) -> int:
    """``block_size`` (elements per block) as an int in [1, 2**32-1]; CodecError otherwise."""
    return _check_int(block_size, "block_size", 1, _U32_MAX, "2**32-1")


def check_tokens(tokens) -> int:
    """``tokens`` (a contribution's token count) as an int in [0, 2**64-1]; CodecError otherwise."""
    return _check_int(tokens, "tokens", 0, _U64_MAX, "2**64-1")


def check_numel(numel) -> int:
    """``numel`` (elements of the vector) as an int in [0, 2**64-1]; CodecError otherwise."""
    return _check_int(numel, "numel", 0, _U64_MAX, "2**64-1")


def as_flat_fp32(v: torch.Tensor, what: str = "input") -> torch.Tensor:
    """Return ``v`` as a contiguous 1-D float32 tensor on its own device (no copy if it
    already is one). Raises CodecError for non-tensors and non-floating dtypes."""
    if not isinstance(v, torch.Tensor):
        raise CodecError(f"{what} must be a torch.Tensor, got {type(v).__name__}")
    if not v.is_floating_point():
        raise CodecError(f"{what} must have a floating dtype, got {v.dtype}")
    v = v.detach()
    if v.dtype != torch.float32:
        v = v.to(torch.float32)
    return v.reshape(-1).contiguous()


def raise_non_finite(v: torch.Tensor, what: str = "input") -> None:
    """Raise CodecError describing the NaN/Inf values of ``v`` (1-D); return if there are none."""
    bad = ~torch.isfinite(v)
    count = int(bad.sum())
    if count == 0:
        return
    first = int(torch.nonzero(bad)[0, 0])
    n_nan = int(torch.isnan(v).sum())
    raise CodecError(
        f"{what} contains non-finite values ({n_nan} NaN, {count - n_nan} Inf among "
        f"{v.numel()} elements; first at index {first}); refusing to encode"
    )


def pack_header(kind: int, numel: int, block_size: int, tokens: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, numel, block_size, 0, tokens)


def unpack_header(data, expect_kind: int | None = None) -> tuple[int, int, int, int, memoryview]:
    """Parse and check the header. Returns ``(kind, numel, block_size, tokens, view)`` where
    ``view`` is a memoryview of the whole buffer. Raises CodecError on any problem."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    if len(view) < HEADER_SIZE:
        raise CodecError(f"truncated packet: {len(view)} bytes, the header alone is {HEADER_SIZE}")
    magic, version, kind, flags, numel, block_size, reserved, tokens = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a GeoMesh codec packet")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported codec format version {version} (this build reads {FORMAT_VERSION})")
    if kind not in KIND_NAMES:
        raise CodecError(f"unknown packet kind {kind}")
    if expect_kind is not None and kind != expect_kind:
        raise CodecError(f"packet kind is {KIND_NAMES[kind]!r}, expected {KIND_NAMES[expect_kind]!r}")
    if flags != 0 or reserved != 0:
        raise CodecError(f"non-zero flags/reserved header fields ({flags}, {reserved})")
    return kind, numel, block_size, tokens, view


def check_length(view: memoryview, expected: int, what: str) -> None:
    if len(view) != expected:
        raise CodecError(
            f"wrong {what} packet length: {len(view)} bytes, expected {expected} "
            f"(header {HEADER_SIZE} + payload {expected - HEADER_SIZE})"
        )


def read_array(view: memoryview, offset: int, dtype: str, count: int) -> torch.Tensor:
    """Copy ``count`` little-endian items of numpy ``dtype`` from ``view[offset:]`` into a
    fresh, writable CPU tensor."""
    arr = np.frombuffer(view, dtype=np.dtype(dtype), count=count, offset=offset)
    arr = arr.astype(arr.dtype.newbyteorder("="), copy=True)
    return torch.from_numpy(arr)


def tensor_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """Little-endian bytes of a CPU tensor, as numpy ``dtype`` (e.g. ``"<f4"``)."""
    return t.numpy().astype(np.dtype(dtype), copy=False).tobytes()


def check_cpu_tensor(t, name: str, dtype: torch.dtype, length: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise CodecError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise CodecError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dim() != 1 or t.numel() != length:
        raise CodecError(f"{name} must have shape [{length}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise CodecError(f"{name} must be contiguous")


def all_finite(t: torch.Tensor) -> bool:
    """True if every element of ``t`` (any shape, floating) is finite.

    Small CPU tensors are checked with numpy, single threaded (waking torch's OpenMP team costs
    milliseconds when the cores are busy). Large ones with one ``torch.aminmax`` pass: NaN
    propagates into both results and +-Inf becomes the max or the min, so both are finite exactly
    when every element is; unlike ``torch.isfinite(t).all()`` it writes no bool tensor (at 12.5M
    elements 2 ms against 205 ms, mostly the page faults of that fresh buffer; issue 17)."""
    if t.numel() == 0:
        return True
    if t.device.type == "cpu" and t.numel() < (1 << 20) and t.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(t.numpy()).all())
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_scales(scales: torch.Tensor, name: str = "scales") -> None:
    """Scales (CPU fp32) must be finite and carry no sign bit (>= +0.0)."""
    if scales.numel() == 0:
        return
    a = scales.numpy()
    if not np.isfinite(a).all():
        raise CodecError(f"{name} contain NaN or Inf")
    if np.signbit(a).any():
        raise CodecError(f"{name} must be non-negative (no sign bit set)")


def check_block_packet(packet, payload: str, dtype: torch.dtype, per_item: int) -> int:
    """Validate and normalise the fields shared by the blockwise packets (``SignPacket``,
    ``Int8Packet``): ``numel`` P, ``block_size`` B, ``tokens`` (set back as ints on the frozen
    dataclass), the payload tensor named ``payload`` (``dtype``, CPU, contiguous, ``ceil(P/per_item)``
    elements: 8 sign bits a byte, 1 int8 an element) and ``scales`` (float32 [ceil(P/B)], finite,
    no sign bit). Returns P. Raises CodecError on the first bad field, in that order."""
    numel = check_numel(packet.numel)
    block_size = check_block_size(packet.block_size)
    tokens = check_tokens(packet.tokens)
    object.__setattr__(packet, "numel", numel)
    object.__setattr__(packet, "block_size", block_size)
    object.__setattr__(packet, "tokens", tokens)
    check_cpu_tensor(getattr(packet, payload), payload, dtype, ceil_div(numel, per_item))
    check_cpu_tensor(packet.scales, "scales", torch.float32, ceil_div(numel, block_size))
    check_scales(packet.scales)
    return numel


def block_packet_bytes(kind: int, packet, payload: torch.Tensor, payload_dtype: str) -> bytes:
    """Serialise a blockwise packet: the 32-byte header, its fp32 LE ``scales``, then ``payload``
    as numpy ``payload_dtype`` (``"u1"`` signs, ``"i1"`` int8). ``32 + 4*ceil(P/B) + payload`` bytes."""
    return b"".join(
        (
            pack_header(kind, packet.numel, packet.block_size, packet.tokens),
            tensor_bytes(packet.scales, "<f4"),
            tensor_bytes(payload, payload_dtype),
        )
    )
