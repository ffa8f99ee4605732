"""Error feedback for the sign codec (optional; off by default in the product).

EF-SGD (Karimireddy, Rebjock, Stich, Jaggi 2019, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes"): the sender keeps what compression dropped and adds it to the
next message, so nothing is lost for good: ``sum_t decode(p_t) = sum_t delta_t - e_T``.

GeoMesh's design measurements ("Measured before building", DESIGN.md) found EF under a
Nesterov outer step hurt on a small model, hence it is an option, not the default.
"""

from __future__ import annotations

import torch

from geomesh_p2p.exchange.codec._format import (
    DEFAULT_BLOCK_SIZE,
    CodecError,
    as_flat_fp32,
    check_block_size,
    check_numel,
    raise_non_finite,
)
from geomesh_p2p.exchange.codec.sign import SignPacket, decode, encode
from geomesh_p2p.util.atomic import atomic_write

__all__ = ["ErrorFeedback", "PushFeedback", "RESIDUAL_FILE"]


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
        self.residual = torch.zeros(
            self.numel, dtype=torch.float32, device=torch.device("cpu") if device is None else device
        )

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


#: File of the peer's error-feedback residual in its ``--checkpoint-dir`` (next to ``ckpt-*.safetensors``).
RESIDUAL_FILE = "error-feedback.safetensors"


class PushFeedback:
    """Error feedback of a real peer's sign pushes (the collective encodes part by part).

    The rule is :class:`ErrorFeedback`'s, applied per part range of the round's plan: with
    ``v = delta + e``, the peer pushes ``v`` (the collective encodes ``v[s:e]`` of each part) and keeps
    ``e[s:e] = v[s:e] - decode(encode(v[s:e]))``. With parts aligned to the codec block (the sign
    methods' ``part_align``), the packets equal the simulator's whole-vector ``ErrorFeedback.encode``
    bit for bit. All methods are blocking (tensor math or file I/O over ``[P]``): call them in a
    worker thread.

    Attributes:
        numel: P.
        block_size: B of the sign codec (the run's ``block_size``).
        residual: fp32 CPU tensor [P], the error carried to the next round (0 at start).
        round: the round whose push last updated the residual (-1: never).
    """

    def __init__(self, numel: int, block_size: int = DEFAULT_BLOCK_SIZE):
        self.numel = check_numel(numel)
        self.block_size = check_block_size(block_size)
        self.residual = torch.zeros(self.numel, dtype=torch.float32)
        self.round = -1

    def reset(self) -> None:
        """Forget the residual (e = 0), e.g. after a re-sync to another lineage of the global state."""
        self.residual.zero_()
        self.round = -1

    def apply(self, delta: torch.Tensor, tokens: int, ranges, round: int = 0) -> torch.Tensor:
        """The vector to push this round: ``delta + e`` (fp32 CPU [P]); updates ``e`` for each part.

        Args:
            delta: this peer's pseudo-gradient, float tensor with P elements (any shape, CPU or CUDA);
                not modified (the result is a new [P] buffer).
            tokens: tokens trained this round. 0: the push abstains (the receivers do not count it), so
                ``delta`` is returned as it is and the residual is kept for a round that counts.
            ranges: the parts' ``(start, end)`` element ranges, as the collective encodes them
                (``[(o.start, o.end) for o in spec.owners]``); together they cover ``[0, P)``.
            round: the round of this push (kept in :attr:`round`).

        Raises:
            CodecError: wrong size, ranges not covering ``[0, P)``, or NaN/Inf in ``delta + e``; the
                residual is then unchanged.
        """
        if int(tokens) <= 0:
            return delta
        d = as_flat_fp32(delta, "delta")
        if d.numel() != self.numel:
            raise CodecError(f"delta has {d.numel()} elements, the error feedback holds {self.numel}")
        spans = sorted((int(s), int(e)) for s, e in ranges)
        if (
            not spans
            or spans[0][0] != 0
            or spans[-1][1] != self.numel
            or any(a[1] != b[0] for a, b in zip(spans, spans[1:]))
        ):
            raise CodecError(f"part ranges {spans[:4]}... do not cover [0, {self.numel})")
        v = d.to("cpu").add(self.residual)
        # Checked before the residual is touched (encode would raise only part-way through the parts).
        raise_non_finite(v, "delta + residual")
        for s, e in spans:
            # e[s:e] = v[s:e] - decode(encode(v[s:e])), decoded into the residual itself (no third [P]
            # buffer), in the order ErrorFeedback.encode uses: the same fp32 arithmetic, bit for bit.
            decode(encode(v[s:e], self.block_size, int(tokens)), out=self.residual[s:e])
            torch.sub(v[s:e], self.residual[s:e], out=self.residual[s:e])
        self.round = int(round)
        return v

    # ---------------------------------------------------------------- checkpoint
    def save(self, directory, *, state_round: int, digest: str) -> None:
        """Write the residual to ``directory/error-feedback.safetensors`` (atomic), tagged with the global
        state it goes with (``state_round``, ``digest``: the checkpoint written next to it).

        Raises:
            OSError: the directory cannot be written.
        """
        from pathlib import Path

        from safetensors.torch import save_file

        meta = {
            "round": str(int(state_round)),
            "digest": str(digest),
            "block_size": str(self.block_size),
            "pushed_round": str(self.round),
        }
        atomic_write(
            Path(directory) / RESIDUAL_FILE, lambda tmp: save_file({"residual": self.residual}, tmp, metadata=meta)
        )

    def load(self, directory, *, state_round: int, digest: str) -> str:
        """Take the residual saved with the global state (``state_round``, ``digest``) the peer resumes from.

        Returns: "loaded", "missing" (no file), or why it was not taken ("another state: ..." when it was
        saved with another state, "unreadable: ..."); the residual is zero unless "loaded".
        """
        from pathlib import Path

        from safetensors import safe_open

        self.reset()
        path = Path(directory) / RESIDUAL_FILE
        if not path.exists():
            return "missing"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                r = f.get_tensor("residual")
        except Exception as e:  # a corrupt file costs the residual only, never the resume
            return f"unreadable: {type(e).__name__}: {e}"
        if meta.get("digest") != str(digest) or meta.get("round") != str(int(state_round)):
            return (
                f"another state: saved at round {meta.get('round')} digest {str(meta.get('digest'))[:8]}, "
                f"resuming round {state_round} digest {str(digest)[:8]}"
            )
        if r.dtype != torch.float32 or r.numel() != self.numel or meta.get("block_size") != str(self.block_size):
            return f"unreadable: {r.numel()} {r.dtype} elements, block {meta.get('block_size')}"
        if not bool(torch.isfinite(r).all()):
            return "unreadable: non-finite values"
        self.residual.copy_(r.reshape(-1))
        self.round = int(meta.get("pushed_round", "-1"))
        return "loaded"
