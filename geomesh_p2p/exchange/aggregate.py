"""The collective's tensor code: the token-weighted mean (and the robust rules) of a part, and the
owner's aggregate encode / decode. Pure, synchronous, no I/O: the simulator imports it.

The rules themselves live in :mod:`geomesh_p2p.exchange.robust` (re-exported here: pure tensor code
that the simulator uses without the gRPC side). This module adds the bytes <-> tensor steps of
the exchange, written to keep memory flat on large (fp32) parts:

* fp32 bytes are read as a zero-copy view (:func:`fp32_view`) of the message's bytes, never
  ``bytes -> numpy -> tensor -> clone``;
* an aggregate is decoded straight into the caller's buffer (:func:`decode_aggregate` ``out=``,
  e.g. the part's slice of the round's aggregate), so no per-part full-size tensor is kept.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional, Union

import numpy as np
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.codec._format import all_finite
from geomesh_p2p.exchange.robust import RULES, aggregate_part, token_weighted_mean

__all__ = [
    "ScaleBoundError",
    "RULES",
    "aggregate_part",
    "token_weighted_mean",
    "fp32_to_bytes",
    "fp32_buffer",
    "fp32_view",
    "encode_aggregate",
    "aggregate_buffer",
    "decode_aggregate",
]

_LITTLE = sys.byteorder == "little"


def fp32_to_bytes(v: torch.Tensor) -> bytes:
    """fp32 tensor [n] -> its ``4 * n`` raw little-endian bytes (one copy: the bytes object)."""
    return v.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def fp32_buffer(v: torch.Tensor) -> memoryview:
    """fp32 tensor [n] (CPU, contiguous) -> a byte memoryview [4 n] of its raw little-endian values,
    *viewing* ``v`` (no copy; it keeps ``v`` alive). Big-endian hosts get a byte-swapped copy."""
    arr = v.detach().cpu().contiguous().numpy()
    if not _LITTLE:
        arr = arr.astype("<f4")
    return arr.data.cast("B")  # arr.data: the memoryview of arr's buffer (memoryview(arr))


def aggregate_buffer(kind: str, v: torch.Tensor, block_size: int, tokens: int) -> Union[bytes, memoryview]:
    """:func:`encode_aggregate` without the fp32 copy: fp32 gives :func:`fp32_buffer` (a view of ``v``)."""
    return fp32_buffer(v) if kind == "fp32" else encode_aggregate(kind, v, block_size, tokens)


def fp32_view(data: Union[bytes, memoryview], numel: int, *, check_finite: bool = True) -> torch.Tensor:
    """Raw little-endian fp32 bytes -> a read-only fp32 tensor [numel] that *views* ``data`` (no copy
    on little-endian hosts; it keeps ``data`` alive). Never write to it.

    Raises:
        compression.CodecError: ``len(data) != 4 * numel``, or (``check_finite``) NaN / Inf values.
    """
    if len(data) != 4 * numel:
        raise compression.CodecError(f"wrong fp32 length: {len(data)} bytes, expected {4 * numel}")
    arr = np.frombuffer(data, dtype="<f4")
    if not _LITTLE:
        arr = arr.astype(np.float32)  # a big-endian host needs the byte swap (a copy)
    with warnings.catch_warnings():
        # torch warns that the array is not writable: the view is only ever read.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    if check_finite and numel and not all_finite(t):
        raise compression.CodecError("fp32 values contain NaN or Inf")
    return t


def encode_aggregate(kind: str, v: torch.Tensor, block_size: int, tokens: int) -> bytes:
    """An owner's mean fp32 [n] as ``kind`` bytes ("fp32" raw, or a codec packet of ``tokens``).
    Raises compression.CodecError for an unknown kind or non-finite values."""
    if kind == "fp32":
        return fp32_to_bytes(v)
    return compression.encode_as(kind, v, block_size=block_size, tokens=tokens).to_bytes()


class ScaleBoundError(compression.CodecError):
    """A ``"sign"`` aggregate whose largest block scale is above the round's bound (``CollectiveSpec.max_scale``):
    no honest aggregate of the round's inner steps is that large, so every reader refuses it."""


def decode_aggregate(
    kind: str,
    data: Union[bytes, memoryview],
    numel: int,
    out: Optional[torch.Tensor] = None,
    max_scale: Optional[float] = None,
) -> torch.Tensor:
    """Owner's encoded mean -> fp32 [numel], written into ``out`` (contiguous fp32 [numel]) if given.

    ``max_scale``: for a ``"sign"`` aggregate, the largest block scale (mean ``|x|`` of a block) accepted, checked
    on the packet's scales before anything is decoded (None: no bound). Why: a forging owner's ``-20x`` aggregate
    stayed applied for the rounds until its proof (4 forgers of 16 cost 1.11x of the honest perplexity, issue 26);
    every reader computes the same bound from the plan, the run config and the start state, so every reader
    refuses the same results.

    Raises compression.CodecError on a wrong kind, length or non-finite values (``out`` may then
    hold partial values: the caller zeroes a refused part); :class:`ScaleBoundError` (one) above ``max_scale``.
    """
    if kind == "fp32":
        view = fp32_view(data, numel)
        return view.clone() if out is None else out.copy_(view)
    packet = compression.packet_from_bytes(bytes(data))  # a codec packet is small: copy a view
    if compression.packet_kind(packet) != kind:
        raise compression.CodecError(
            f"aggregate is a {compression.packet_kind(packet)} packet, the round asks for {kind}"
        )
    if packet.numel != numel:
        raise compression.CodecError(f"aggregate has {packet.numel} elements, the part has {numel}")
    if max_scale is not None and isinstance(packet, compression.SignPacket) and packet.scales.numel():
        top = float(packet.scales.abs().max())
        if not top <= max_scale:  # NaN too
            raise ScaleBoundError(
                f"aggregate block scale {top:.4g} is above the round's bound {max_scale:.4g} (no honest aggregate "
                "of the round's inner steps is that large)"
            )
    res = compression.decode_any(packet, out=out)
    if not all_finite(res):
        raise compression.CodecError("aggregate decodes to NaN or Inf")
    return res
