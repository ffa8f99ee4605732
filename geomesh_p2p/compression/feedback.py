"""Error feedback for the sign codec (optional; off by default in the product).

EF-SGD (Karimireddy, Rebjock, Stich, Jaggi 2019, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes"): the sender keeps what compression dropped and adds it to the
next message, so nothing is lost for good: ``sum_t decode(p_t) = sum_t delta_t - e_T``.

GeoMesh's design measurements ("Measured before building", DESIGN.md) found EF under a
Nesterov outer step hurt on a small model, hence it is an option, not the default.
"""

from __future__ import annotations

import torch

from ._format import DEFAULT_BLOCK_SIZE, CodecError, as_flat_fp32, check_block_size, check_numel
from .sign import SignPacket, decode, encode

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Worker-side error-feedback state for one vector of ``numel`` elements.

    Attributes:
        numel: P.
        block_size: B used for every packet.
        residual: fp32 tensor [P], the error e carried to the next round (starts at 0). It
            lives on the device of the last ``delta`` passed to :meth:`encode` (CPU at first).
    """

    def __init__(self, numel: int, block_size: int = DEFAULT_BLOCK_SIZE, device=None):
        self.numel = check_numel(numel)
        self.block_size = check_block_size(block_size)
        self.residual = torch.zeros(self.numel, dtype=torch.float32,
                                    device=torch.device("cpu") if device is None else device)

    def reset(self) -> None:
        """Forget the residual (e = 0), e.g. after a re-sync of the global weights."""
        self.residual.zero_()

    def encode(self, delta: torch.Tensor, tokens: int) -> SignPacket:
        """``v = delta + e; p = encode(v); e = v - decode(p)``; returns ``p``.

        Args:
            delta: float tensor with P elements (any shape, flattened), CPU or CUDA.
            tokens: n_i carried in the packet.

        Raises:
            CodecError: wrong size, or NaN/Inf in ``delta + e``; the residual is then unchanged.
        """
        d = as_flat_fp32(delta, "delta")
        if d.numel() != self.numel:
            raise CodecError(f"delta has {d.numel()} elements, ErrorFeedback holds {self.numel}")
        if self.residual.device != d.device:
            self.residual = self.residual.to(d.device)
        v = d + self.residual
        p = encode(v, self.block_size, tokens)
        # e = v - decode(p), written in place into the residual (decode first, then subtract).
        decode(p, out=self.residual)
        torch.sub(v, self.residual, out=self.residual)
        return p
