"""Accountable mode's commitment of a part result to its inputs: the compact input list (pure, no I/O).

An owner's accountable :class:`PartResult` lists every contribution it accepted, in the aggregate's
order (raw PeerID), as one fixed 29-byte record each (``inputs``, field 14):

====== ======= =========================================================================
bytes  type    meaning
====== ======= =========================================================================
4      uint32  the sender's index in :func:`participant_order` (the spec's participants by raw PeerID)
8      uint64  tokens used (the claim capped by the plan, 0 below its floor: ``CollectiveSpec.counted_tokens``)
1      uint8   flags: 1 = dropped by the robust rule's agreement filter (delivered nothing here)
16     bytes   SHA-256 of the contribution's SignedMessage bytes, first 16 bytes
====== ======= =========================================================================

29 bytes per contributor (vs a 38-byte PeerID + token pair of the reencode list), read by every reader
of the part. 16 hash bytes keep second preimages out of reach (2^128 work), and a receipt carries the full
SHA-256. BTARD ("Secure Distributed Training at Scale", Gorbunov et al., ICML 2022): the aggregator
commits to the inputs it used, so a drop is provable and a recomputation can be checked bit for bit.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from geomesh_p2p.net.identity import PeerID

__all__ = [
    "DIGEST_BYTES",
    "FLAG_DROPPED",
    "RECORD_BYTES",
    "InputEntry",
    "InputsError",
    "contribution_digest",
    "decode_inputs",
    "encode_inputs",
    "participant_order",
    "rank_by_seed",
]

_RECORD = struct.Struct("<IQB16s")
RECORD_BYTES = _RECORD.size  # 29
DIGEST_BYTES = 16
FLAG_DROPPED = 1


class InputsError(ValueError):
    """An input list is malformed (one-line reason)."""


@dataclass(frozen=True)
class InputEntry:
    """One input of an accountable part result.

    Attributes:
        index: the sender's index in :func:`participant_order` of the round's spec.
        tokens: tokens used (after the plan's cap).
        dropped: True when the agreement filter left it out of the aggregate.
        digest: SHA-256 of the contribution's SignedMessage bytes, first :data:`DIGEST_BYTES` bytes.
    """

    index: int
    tokens: int
    dropped: bool
    digest: bytes


def participant_order(participants: Iterable[str]) -> list[str]:
    """The participants (base58 PeerIDs: a spec's ``participants`` mapping or any iterable of them)
    sorted by raw PeerID bytes: the index space of :class:`InputEntry`."""
    return sorted(participants, key=lambda p: bytes(PeerID.from_string(p)))


def rank_by_seed(seed: bytes, candidates: Iterable[str], k: int) -> list[str]:
    """The first ``k`` of ``candidates`` (base58 PeerIDs) ranked by SHA-256(``seed`` || raw PeerID), lowest first: a
    draw every peer with the same seed repeats (the accountable validators, a slice owner's hand-off checkers).
    ``k`` above the candidates gives them all, ``k`` <= 0 none."""
    ranked = sorted(candidates, key=lambda p: hashlib.sha256(seed + bytes(PeerID.from_string(p))).digest())
    return ranked[: max(0, int(k))]


def contribution_digest(signed: Union[bytes, bytearray, memoryview]) -> bytes:
    """SHA-256 (32 bytes) of a contribution's SignedMessage bytes (hashes the whole part: a worker thread)."""
    return hashlib.sha256(signed).digest()


def encode_inputs(entries: Sequence[InputEntry]) -> bytes:
    """The ``inputs`` field: :data:`RECORD_BYTES` bytes per entry, in the given order.

    Raises InputsError for an index or token count out of range or a digest of another length."""
    out = []
    for e in entries:
        if len(e.digest) < DIGEST_BYTES or not (0 <= e.index < 1 << 32) or not (0 <= e.tokens < 1 << 64):
            raise InputsError(f"input entry out of range: index {e.index}, tokens {e.tokens}")
        out.append(_RECORD.pack(e.index, e.tokens, FLAG_DROPPED if e.dropped else 0, bytes(e.digest[:DIGEST_BYTES])))
    return b"".join(out)


def decode_inputs(data: Union[bytes, memoryview], n_participants: int) -> list[InputEntry]:
    """The entries of an ``inputs`` field; each index below ``n_participants`` and strictly ascending
    (the aggregate's order, every sender once).

    Raises InputsError: a length not a multiple of :data:`RECORD_BYTES`, an index out of range or out of
    order, unknown flags."""
    raw = bytes(data)
    if len(raw) % RECORD_BYTES:
        raise InputsError(f"input list of {len(raw)} bytes is not a whole number of {RECORD_BYTES}-byte records")
    out: list[InputEntry] = []
    last = -1
    for index, tokens, flags, digest in _RECORD.iter_unpack(raw):
        if index >= n_participants:
            raise InputsError(f"input index {index} is beyond the round's {n_participants} participants")
        if index <= last:
            raise InputsError("input list is not in the aggregate's order (ascending participant index, each once)")
        if flags & ~FLAG_DROPPED:
            raise InputsError(f"input flags {flags:#x} are unknown")
        out.append(InputEntry(index, tokens, bool(flags & FLAG_DROPPED), digest))
        last = index
    return out
