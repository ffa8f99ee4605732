"""Denser encodings for aggregates (CSS ``reencode`` mode): blockwise int8 and fp16.

An owner that re-encodes the token-weighted mean of a part may trade bytes for error:
sign (~1 bit/element, see ``sign``), int8 (8 bits + a scale per block) or fp16 (16 bits).
Both use the common 32-byte header of ``_format``:

* Int8 (kind 2): header, ``4 * ceil(P/B)`` bytes of fp32 LE scales (block absmax / 127),
  then ``P`` bytes of int8 values in [-127, 127]. Decodes to ``q * scale`` (one fp32
  multiply, exact for |q| <= 127 and bit-identical everywhere). Error per element
  <= scale / 2 = absmax / 254 (plus fp32 rounding of the division).
* Fp16 (kind 3): header (block_size field 0), then ``2 * P`` bytes of IEEE half LE.
  Decodes by exact widening to fp32. Relative error <= 2**-11 in the normal range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geomesh_p2p.config.method import encoded_nbytes

from geomesh_p2p.exchange.codec._format import (
    DEFAULT_BLOCK_SIZE,
    HEADER_SIZE,
    KIND_FP16,
    KIND_INT8,
    CodecError,
    all_finite,
    block_packet_bytes,
    as_flat_fp32,
    ceil_div,
    check_block_packet,
    check_block_size,
    check_cpu_tensor,
    check_length,
    check_numel,
    check_tokens,
    pack_header,
    raise_non_finite,
    read_array,
    tensor_bytes,
    unpack_header,
)

__all__ = ["Int8Packet", "Fp16Packet", "encode_int8", "encode_fp16", "decode_int8", "decode_fp16"]


def _check_out(out, P: int, device):
    if out is None:
        dev = torch.device("cpu") if device is None else torch.device(device)
        return torch.empty(P, dtype=torch.float32, device=dev)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise CodecError("out must be a float32 tensor")
    if out.numel() != P or not out.is_contiguous():
        raise CodecError(f"out must be contiguous with {P} elements, got shape {list(out.shape)}")
    if device is not None and torch.device(device).type != out.device.type:
        raise CodecError(f"out is on {out.device} but device={device} was requested")
    return out


@dataclass(frozen=True)
class Int8Packet:
    """Blockwise absmax int8 encoding of a vector.

    Attributes:
        numel: P, elements encoded.
        block_size: B, elements per scale.
        tokens: n_i, tokens behind the vector (>= 0).
        q: int8 CPU tensor [P], values in [-127, 127].
        scales: float32 CPU tensor [ceil(P/B)], block absmax / 127, finite and >= 0.

    Serialized size: ``32 + 4*ceil(P/B) + P`` bytes. Construction validates (CodecError).
    """

    numel: int
    block_size: int
    tokens: int
    q: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        numel = check_block_packet(self, "q", torch.int8, 1)
        if numel and bool((self.q == -128).any()):
            raise CodecError("int8 values must be in [-127, 127]")

    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes`: ``32 + 4*ceil(P/B) + P`` bytes."""
        return encoded_nbytes("int8", self.numel, self.block_size)  # the one codec-size formula

    def to_bytes(self) -> bytes:
        return block_packet_bytes(KIND_INT8, self, self.q, "i1")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Int8Packet":
        """Parse; CodecError for bad header, wrong length, bad scales or a -128 value."""
        _, numel, block_size, tokens, view = unpack_header(data, KIND_INT8)
        if block_size == 0:
            raise CodecError("int8 packet with block_size 0")
        nb = ceil_div(numel, block_size)
        check_length(view, HEADER_SIZE + 4 * nb + numel, "int8")
        scales = read_array(view, HEADER_SIZE, "<f4", nb)
        q = read_array(view, HEADER_SIZE + 4 * nb, "i1", numel)
        return cls(numel, block_size, tokens, q, scales)


@dataclass(frozen=True)
class Fp16Packet:
    """fp16 encoding of a vector.

    Attributes:
        numel: P, elements encoded.
        tokens: n_i, tokens behind the vector (>= 0).
        values: float16 CPU tensor [P], all finite.

    Serialized size: ``32 + 2*P`` bytes. Construction validates (CodecError).
    """

    numel: int
    tokens: int
    values: torch.Tensor

    def __post_init__(self):
        numel = check_numel(self.numel)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "tokens", check_tokens(self.tokens))
        check_cpu_tensor(self.values, "values", torch.float16, numel)
        if not all_finite(self.values):
            raise CodecError("fp16 values contain NaN or Inf")

    @property
    def block_size(self) -> int:
        return 0

    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes`: ``32 + 2*P`` bytes."""
        return encoded_nbytes("fp16", self.numel, 1)  # the one codec-size formula (no blocks)

    def to_bytes(self) -> bytes:
        return pack_header(KIND_FP16, self.numel, 0, self.tokens) + tensor_bytes(self.values, "<f2")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Fp16Packet":
        """Parse; CodecError for bad header, non-zero block_size, wrong length, NaN/Inf."""
        _, numel, block_size, tokens, view = unpack_header(data, KIND_FP16)
        if block_size != 0:
            raise CodecError(f"fp16 packet must have block_size 0, got {block_size}")
        check_length(view, HEADER_SIZE + 2 * numel, "fp16")
        return cls(numel, tokens, read_array(view, HEADER_SIZE, "<f2", numel))


def encode_int8(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, tokens: int = 0) -> Int8Packet:
    """Blockwise absmax int8: ``scale = max|v| / 127`` per block, ``q = round(v / scale)``.

    Args: v float tensor (any shape, flattened; CPU or CUDA), block_size B, tokens n_i.
    Returns: Int8Packet (CPU tensors). Raises CodecError for NaN/Inf input or bad arguments.
    """
    block_size = check_block_size(block_size)
    tokens = check_tokens(tokens)
    v = as_flat_fp32(v)
    P = v.numel()
    nb = ceil_div(P, block_size)
    nfull = P // block_size
    q = torch.empty(P, dtype=torch.int8, device=v.device)
    scales = torch.empty(nb, dtype=torch.float32, device=v.device)
    segs = []
    if nfull:
        segs.append(
            (
                v[: nfull * block_size].view(nfull, block_size),
                q[: nfull * block_size].view(nfull, block_size),
                scales[:nfull],
            )
        )
    if nfull < nb:
        segs.append((v[nfull * block_size :].view(1, -1), q[nfull * block_size :].view(1, -1), scales[nfull:]))
    for vv, qq, ss in segs:
        torch.amax(vv.abs(), dim=1, out=ss)
        if not all_finite(ss):
            raise_non_finite(v)
        ss.div_(127.0)
        safe = torch.where(ss > 0, ss, torch.ones_like(ss))
        qq.copy_(torch.round(vv / safe[:, None]).clamp_(-127, 127))
    return Int8Packet(P, block_size, tokens, q.cpu(), scales.cpu())


def encode_fp16(v: torch.Tensor, tokens: int = 0) -> Fp16Packet:
    """Round ``v`` to fp16 (round-to-nearest-even).

    Raises CodecError for NaN/Inf input, or finite values beyond the fp16 range (|v| > 65504
    after rounding), which would become Inf.
    """
    tokens = check_tokens(tokens)
    v = as_flat_fp32(v)
    h = v.to(torch.float16)
    if not all_finite(h):
        raise_non_finite(v)
        raise CodecError("input exceeds the fp16 range (|v| > 65504); use int8 or sign encoding")
    return Fp16Packet(v.numel(), tokens, h.cpu())


def decode_int8(p: Int8Packet, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [P]: ``q * scale`` per element (one exact multiply). Raises CodecError for a bad ``out``."""
    if not isinstance(p, Int8Packet):
        raise CodecError(f"decode_int8 expects an Int8Packet, got {type(p).__name__}")
    res = _check_out(out, p.numel, device)
    flat = res.view(-1)
    P, B = p.numel, p.block_size
    if P == 0:
        return res
    dev = flat.device
    flat.copy_(p.q.to(dev))
    scales = p.scales.to(dev)
    nfull = P // B
    if nfull:
        flat[: nfull * B].view(nfull, B).mul_(scales[:nfull, None])
    if nfull * B < P:
        flat[nfull * B :].mul_(scales[nfull])
    return res


def decode_fp16(p: Fp16Packet, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [P]: exact widening of the fp16 values. Raises CodecError for a bad ``out``."""
    if not isinstance(p, Fp16Packet):
        raise CodecError(f"decode_fp16 expects an Fp16Packet, got {type(p).__name__}")
    res = _check_out(out, p.numel, device)
    if p.numel:
        res.view(-1).copy_(p.values.to(res.device))
    return res
