"""Accountable mode's proofs in the DHT (issue 26): an accuser publishes a self-contained proof against a part's
owner (:mod:`geomesh_p2p.exchange.accountable`: a drop, a forgery or an equivocation), every peer reads the
proofs of recent rounds, re-checks each from its bytes (:func:`~geomesh_p2p.exchange.accountable.verify_proof`)
and only then excludes the accused (BTARD's ACCUSE and ban, Gorbunov et al., ICML 2022).

Wire form: zlib of the proof's bytes, framed by :mod:`geomesh_p2p.dht.chunked` (magic ``gmpf/1``): inline
when it fits one DHT value, else a head plus chunks, under :func:`proofs_key` ``<run>/proofs/<slot>`` with
subkey = the accuser's PeerID (a slot only the accuser can write: the DHT's owner rule). ``slot`` is the round
in which the accuser publishes, not necessarily the round the proof is about (the proof says that): one record
per accuser and slot. A record holds one proof, or (session 26) a *bundle* of proofs against distinct owners
(:func:`bundle`: ``gmpb/1`` then each proof length-prefixed), so an accuser that k colluding owners all dropped
publishes the k proofs in one round, not one a round (any one proof excludes its owner); a reader that predates
bundles refuses such a record as malformed (single proofs are published as before). Readers read the slots of
the last rounds (:func:`read_proofs`). A proof whose compressed bytes need more than :data:`MAX_PROOF_CHUNKS` chunks
(~1.9 MB: a forgery proof holds a part's N signed inputs) is not published (:class:`ValueError`): the DHT's
quota per signer is 2 MiB. Such parts need smaller parts or a proof served by RPC (not built; docs/collective.md).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import dataclass
from typing import Iterable, Optional

from geomesh_p2p.dht import chunked
from geomesh_p2p.dht.chunked import ChunkedValue, ChunkFormat, ChunksPending
from geomesh_p2p.exchange import accountable
from geomesh_p2p.net.identity import Identity, PeerID
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = [
    "MAX_BUNDLE_PROOFS",
    "MAX_PROOF_CHUNKS",
    "ProofReader",
    "PublishedProof",
    "accused_of",
    "bundle",
    "encode_value",
    "proofs_key",
    "publish_proof",
    "read_proofs",
    "unbundle",
]

log = logging.getLogger(__name__)

_MAGIC = b"gmpf/1"
#: A proof needing (or a head listing) more chunks is not published (refused): 32 x 60,000 B of zlib.
MAX_PROOF_CHUNKS = 32
#: A proof inflating to more is refused (a zlib bomb from an accuser).
MAX_PROOF_INFLATED = 64 << 20
#: Deadline of each store and get, seconds.
STORE_TIMEOUT_S = 10.0
#: A bundle (one record) holds at most this many proofs; a record listing more is refused.
MAX_BUNDLE_PROOFS = 16
_BUNDLE = b"gmpb/1\0"


def bundle(proofs: list[bytes]) -> bytes:
    """One record's bytes for ``proofs`` (1 to :data:`MAX_BUNDLE_PROOFS`): a single proof as it is (what every
    reader reads), several as ``gmpb/1\\0`` then each as 4-byte little-endian length + bytes. Raises ValueError
    for none or too many."""
    if not 0 < len(proofs) <= MAX_BUNDLE_PROOFS:
        raise ValueError(f"a bundle holds 1 to {MAX_BUNDLE_PROOFS} proofs, got {len(proofs)}")
    if len(proofs) == 1:
        return bytes(proofs[0])
    return _BUNDLE + b"".join(len(p).to_bytes(4, "little") + bytes(p) for p in proofs)


def unbundle(data: bytes) -> list[bytes]:
    """The proofs of one record's bytes (:func:`bundle`'s inverse; a plain proof is a list of one, not checked
    here). Raises ValueError when a bundle is truncated, empty or lists more than :data:`MAX_BUNDLE_PROOFS`."""
    if not data.startswith(_BUNDLE):  # an AccountabilityProof's first byte is a field tag, never "g"
        return [data]
    out: list[bytes] = []
    i = len(_BUNDLE)
    while i < len(data):
        if len(out) == MAX_BUNDLE_PROOFS or i + 4 > len(data):
            raise ValueError("proof bundle lists too many proofs or is truncated")
        n = int.from_bytes(data[i : i + 4], "little")
        if n == 0 or i + 4 + n > len(data):
            raise ValueError("proof bundle is truncated or holds an empty proof")
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    if not out:
        raise ValueError("proof bundle is empty")
    return out


def accused_of(proof: bytes) -> str:
    """The base58 PeerID a proof accuses, read *without* checking it (the signer of its result, or of its
    cross contribution for a handoff proof, of its (first) level-1 commitment for a handoff-drop or -equivocation proof): for grouping proofs held here, never for a verdict. "" when the
    bytes do not parse."""
    try:
        p = collective_pb2.AccountabilityProof.FromString(proof)
        signed = {"handoff": p.contribution, "handoff-drop": p.commitment, "handoff-equivocation": p.commitment}.get(
            p.kind, p.result
        )
        return PeerID(envelope_pb2.SignedMessage.FromString(signed).envelope.sender).to_string()
    except Exception:  # noqa: BLE001  (any malformed bytes: no grouping, the proof stands alone)
        return ""


def proofs_key(run_id: str, slot: int) -> str:
    """DHT key of the accountability proofs published in round ``slot`` (subkey = the accuser's PeerID)."""
    return f"{run_id}/proofs/{int(slot)}"


def proof_format() -> ChunkFormat:
    """The proofs' framing in the DHT (:mod:`geomesh_p2p.dht.chunked`, magic ``gmpf/1``)."""
    return ChunkFormat(magic=_MAGIC, what="proof", owner_role="accuser", version=1, max_chunks=MAX_PROOF_CHUNKS)


def encode_value(proof: bytes) -> ChunkedValue:
    """Frame proof bytes for the DHT (zlib level 6). Raises ValueError over :data:`MAX_PROOF_CHUNKS` chunks."""
    return chunked.split(zlib.compress(proof, 6), proof_format())


def _decode(body: bytes) -> bytes:
    return chunked.decompress_capped(body, MAX_PROOF_INFLATED, "proof")


class ProofReader(chunked.ChunkedReader[bytes]):
    """Assembles the proof bytes of heads read under :func:`proofs_key` (not checked yet: the caller runs
    :func:`~geomesh_p2p.exchange.accountable.verify_proof`). Raises as :meth:`ChunkedReader.load`."""

    def __init__(self, dht, chunk_timeout_s: float = 5.0, cache_size: int = 16):
        super().__init__(dht, proof_format(), _decode, chunk_timeout_s=chunk_timeout_s, cache_size=cache_size)


async def publish_proof(
    dht,
    proof: bytes,
    identity: Identity,
    *,
    run_id: str,
    slot: int,
    expiration_time: float,
    timeout_s: float = STORE_TIMEOUT_S,
) -> bool:
    """Store ``proof`` (bytes that passed :func:`~geomesh_p2p.exchange.accountable.verify_proof`) signed by the
    accuser ``identity`` under :func:`proofs_key` of ``slot``, subkey = the accuser; True when the head (after
    every chunk) was stored. Raises ValueError when it is too large for the DHT (:data:`MAX_PROOF_CHUNKS`)."""
    value = await asyncio.to_thread(encode_value, proof)
    out = await chunked.store_chunked(
        dht,
        proofs_key(run_id, slot),
        value,
        subkey=identity.peer_id.to_string(),
        owner=identity,
        expiration_time=expiration_time,
        timeout_s=timeout_s,
    )
    return out.ok


@dataclass(frozen=True)
class PublishedProof:
    """A proof read from the DHT and re-checked here: ``verdict`` (what it proves), ``accuser`` (who stored
    it), ``proof`` (its bytes)."""

    verdict: accountable.ProofVerdict
    accuser: str
    proof: bytes


async def read_proofs(
    dht,
    reader: ProofReader,
    run_id: str,
    slots: Iterable[int],
    *,
    timeout_s: float = STORE_TIMEOUT_S,
    seen: Optional[set] = None,
) -> tuple[list[PublishedProof], list[str]]:
    """The proofs published in rounds ``slots``, each re-checked in a worker thread
    (:func:`~geomesh_p2p.exchange.accountable.verify_proof`); returns (the valid ones, one reason per record
    refused: not the accuser's, malformed, or proving nothing). Records whose chunks are not in yet are skipped
    (read again next time). A get that times out reads nothing for its round. ``seen``: SHA-256 hex of the
    records already decided (valid or refused), skipped and added to (a proof is re-checked once, not every
    read: a forgery proof costs a part's recomputation)."""
    valid: list[PublishedProof] = []
    refused: list[str] = []
    for r in slots:
        key = proofs_key(run_id, r)
        try:
            found = await asyncio.wait_for(dht.get(key), timeout_s) or {}
        except Exception as e:  # a timeout or a failed read: nothing of this round now, read again next time
            log.debug("proofs of round %d not read: %r", r, e)
            continue
        for subkey, entry in found.items():
            value, owner = entry[0], (entry[2] if len(entry) > 2 else None)
            accuser = str(subkey)
            h = chunked.sha256_hex(bytes(value))
            if seen is not None and h in seen:
                continue
            if _owner_id(owner) != accuser:
                refused.append(f"proof record {subkey} of round {r} is not signed by its accuser")
                continue
            try:
                proofs = unbundle(await reader.load(key, accuser, value))
            except ChunksPending:
                continue
            except Exception as e:  # noqa: BLE001  (as below: this record only)
                refused.append(f"proof {subkey} of round {r} refused: {_why(e)}")
                if seen is not None:
                    seen.add(h)
                continue
            for data in proofs:
                try:
                    verdict = await asyncio.to_thread(accountable.verify_proof, run_id, data)
                except Exception as e:  # noqa: BLE001
                    # Any failure of one proof refuses that proof only: an exception that escaped here (the red
                    # team's part=99 record: IndexError) lost every valid proof of the read, and marked them seen.
                    refused.append(f"proof {subkey} of round {r} refused: {_why(e)}")
                    continue
                valid.append(PublishedProof(verdict, accuser, data))
            if seen is not None:
                seen.add(h)
    return valid, refused


def _why(e: Exception) -> str:
    return (str(e) if isinstance(e, (ValueError, accountable.ProofError)) else f"{type(e).__name__}: {e}")[:300]


def _owner_id(owner) -> Optional[str]:
    """A record owner (a PeerID, its base58 string, or None when the DHT does not say) as base58."""
    if owner is None:
        return None
    return owner if isinstance(owner, str) else str(owner)
