"""Peer records spread over shard keys (issue 25: the busiest DHT node).

With one key ``<run>/peers`` every record of the run lives on the same ``PEER_RECORD_REPLICAS`` = 8 nodes (the
nodes nearest that key), and every store and every read of a record reaches them: the busiest node serves
about ``N x (stores + 2 sampled reads)`` requests a round, 3,333 at N = 1,024 in the model (docs/scale.md),
where the issue asks for O(N/k log N). A run with ``record_shards`` = S > 1 (a :class:`RunConfig` field, the
same at every peer) keeps peer ``p``'s record under ``<run>/peers/<S>/<shard(p)>`` instead: S keys whose nearest
nodes are S different sets, each holding about N/S records, so each holder serves ~1/S of the stores and of the
sampled reads (a light follower samples the participants of one shard at a time: one read, as before).

* :func:`record_shard` -- a peer's shard: the top ``log2 S`` bits of SHA-256(PeerID). Hierarchical: a peer's
  shard at 2S is ``2 x`` or ``2 x + 1`` its shard at S, so a swarm that doubles S splits every shard in two.
  An identity costs proof of work (docs/admission.md), so grinding identities into one shard costs S x that.
* :func:`records_key` -- the key of a shard (``<run>/peers`` itself at S = 1: a run at the default stores and
  reads exactly what releases before 0.6.0 did, so they train together).
* :func:`shards_of` -- the shards a read of some PeerIDs must ask (each asked once).

S is in the key, so two runs' layouts never mix, and a record found under a shard that is not its PeerID's is
dropped by the reader (:func:`~geomesh_p2p.dht.announce.live_peers`).
"""

from __future__ import annotations

import hashlib
from typing import Collection, Iterable

__all__ = ["MAX_RECORD_SHARDS", "check_shards", "record_shard", "records_key", "shards_of", "in_shard"]

#: Most shards a run may ask (each full read asks every shard: 256 lookups at N = 1,024 would cost the
#: full-view peers more than the hot key did).
MAX_RECORD_SHARDS = 256


def check_shards(shards: int) -> int:
    """``shards`` when it is a power of two in ``1..MAX_RECORD_SHARDS``; raises ValueError naming it otherwise
    (a power of two keeps the shards hierarchical: :func:`record_shard`)."""
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise ValueError(f"record_shards must be an integer, not {type(shards).__name__}")
    if not 1 <= shards <= MAX_RECORD_SHARDS or shards & (shards - 1):
        raise ValueError(f"record_shards must be a power of two from 1 to {MAX_RECORD_SHARDS}, not {shards}")
    return shards


def record_shard(peer_id: str, shards: int) -> int:
    """The shard (``0 .. shards - 1``) of ``peer_id``'s (base58 PeerID) record: the top ``log2(shards)`` bits of
    SHA-256 of its UTF-8 bytes; 0 when ``shards`` is 1. Raises ValueError for a ``shards`` that is not a power of
    two in ``1..MAX_RECORD_SHARDS``."""
    check_shards(shards)
    if shards == 1:
        return 0
    top = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")
    return top >> (64 - (shards.bit_length() - 1))


def records_key(run_id: str, shard: int = 0, shards: int = 1) -> str:
    """The DHT key holding the records of shard ``shard`` of ``shards``: ``<run>/peers`` when ``shards`` is 1,
    else ``<run>/peers/<shards>/<shard>``. Raises ValueError for a shard outside ``0 .. shards - 1``."""
    check_shards(shards)
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
    return f"{run_id}/peers" if shards == 1 else f"{run_id}/peers/{shards}/{shard}"


def shards_of(peer_ids: Iterable[str], shards: int) -> dict[int, list[str]]:
    """``peer_ids`` grouped by their shard (shard -> PeerIDs in the order given), the shards in ascending order."""
    out: dict[int, list[str]] = {}
    for p in peer_ids:
        out.setdefault(record_shard(p, shards), []).append(p)
    return dict(sorted(out.items()))


def in_shard(peer_ids: Collection[str], shard: int, shards: int) -> list[str]:
    """Those of ``peer_ids`` whose records live in ``shard`` (order kept)."""
    return [p for p in peer_ids if record_shard(p, shards) == shard]
