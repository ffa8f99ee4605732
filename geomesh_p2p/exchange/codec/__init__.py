"""Codec of GeoMesh's Compressed Sign Synchronization (CSS, arXiv 2609.18388).

* :func:`encode` / :func:`decode` / :class:`SignPacket`: 1 sign bit per element plus one fp32
  scale (mean |v|) per block of B elements and the sender's token count; ~31.5x smaller than
  fp32 at B = 2048.
* :func:`encode_int8` / :func:`encode_fp16`: denser encodings for re-encoded aggregates.
* :func:`packet_from_bytes` / :func:`decode_any` / :func:`encode_as`: kind-generic helpers.
* :class:`ErrorFeedback`: EF-SGD residual (Karimireddy et al. 2019), off by default.

Wire format: a 32-byte little-endian header (magic ``GMSC``, version, kind byte, P u64,
B u32, tokens u64; see ``_format``) and a kind-specific payload. No pickle anywhere.
All decodes are one exact fp32 multiply (or an exact widening), bit-identical on every
device. Every refusal (NaN/Inf input, malformed bytes, wrong sizes) raises :class:`CodecError`.
"""

from __future__ import annotations

import torch

from geomesh_p2p.exchange.codec._format import (
    DEFAULT_BLOCK_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_FP16,
    KIND_INT8,
    KIND_SIGN,
    MAGIC,
    CodecError,
    unpack_header,
)
from geomesh_p2p.exchange.codec.dense import Fp16Packet, Int8Packet, decode_fp16, decode_int8, encode_fp16, encode_int8
from geomesh_p2p.exchange.codec.feedback import ErrorFeedback
from geomesh_p2p.exchange.codec.sign import SignPacket, decode, encode, sign_payload_nbytes, slice_packet

Packet = SignPacket | Int8Packet | Fp16Packet
KINDS = ("sign", "int8", "fp16")

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HEADER_SIZE",
    "MAGIC",
    "FORMAT_VERSION",
    "KINDS",
    "Packet",
    "CodecError",
    "SignPacket",
    "Int8Packet",
    "Fp16Packet",
    "ErrorFeedback",
    "encode",
    "decode",
    "encode_int8",
    "decode_int8",
    "encode_fp16",
    "decode_fp16",
    "encode_as",
    "decode_any",
    "packet_from_bytes",
    "packet_kind",
    "sign_payload_nbytes",
    "slice_packet",
]


def packet_kind(packet) -> str:
    """ "sign", "int8" or "fp16" for a packet object; CodecError otherwise."""
    if isinstance(packet, SignPacket):
        return "sign"
    if isinstance(packet, Int8Packet):
        return "int8"
    if isinstance(packet, Fp16Packet):
        return "fp16"
    raise CodecError(f"not a codec packet: {type(packet).__name__}")


def encode_as(kind: str, v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, tokens: int = 0) -> Packet:
    """Encode ``v`` as ``kind`` in {"sign", "int8", "fp16"} (fp16 ignores block_size).
    Raises CodecError for an unknown kind or whatever the chosen encoder raises."""
    if kind == "sign":
        return encode(v, block_size, tokens)
    if kind == "int8":
        return encode_int8(v, block_size, tokens)
    if kind == "fp16":
        return encode_fp16(v, tokens)
    raise CodecError(f"unknown encoding kind {kind!r}; expected one of {KINDS}")


def decode_any(packet: Packet, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode any packet to an fp32 tensor [P] (on ``device``, default CPU, or into ``out``);
    CodecError for an object that is not a codec packet."""
    if isinstance(packet, SignPacket):
        return decode(packet, device=device, out=out)
    if isinstance(packet, Int8Packet):
        return decode_int8(packet, device=device, out=out)
    if isinstance(packet, Fp16Packet):
        return decode_fp16(packet, device=device, out=out)
    raise CodecError(f"not a codec packet: {type(packet).__name__}")


def packet_from_bytes(data: bytes) -> Packet:
    """Parse bytes of any kind, dispatching on the header's kind byte (offset 5).
    Raises CodecError for anything malformed."""
    kind = unpack_header(data)[0]
    if kind == KIND_SIGN:
        return SignPacket.from_bytes(data)
    if kind == KIND_INT8:
        return Int8Packet.from_bytes(data)
    assert kind == KIND_FP16
    return Fp16Packet.from_bytes(data)
