"""The identity of a global state (issue 27, "the digest at memory speed"): :func:`tree_digest`.

A state is one byte stream, the raw little-endian fp32 bytes of the weights followed by those of the outer
optimizer's state. Its digest (:data:`DIGEST_ALGO`) is a tree of BLAKE3 (0.12.0 on): the stream is cut into
:data:`DIGEST_CHUNK_BYTES` chunks (the last one shorter), each chunk is hashed on its own (worker threads: the
``blake3`` binding, like ``hashlib``, releases the GIL while it hashes a buffer this large), and the root is
BLAKE3 of ``b"geomesh-state-digest-v3"``, the stream's length and the chunk size (8-byte little-endian each)
and the chunk hashes in order; the digest is the root's first 32 hex characters (128 bits, as before). The
chunking is fixed, so the digest does not depend on the number of threads.

Why BLAKE3 (session 37, issue 27's "digest within 2x of a ``copy_``"): a cryptographic hash (a forged state must
not collide with the swarm's) at ~3.9 GB/s a core here with its SIMD kernels, against SHA-256's 1.3 GB/s with
SHA-NI and blake2b's 0.7 GB/s (``benchmarks/outer_step.py --digest-only``). From 0.3.0 to 0.11 the tree hashed
with SHA-256 (:data:`SHA256_TREE_ALGO`); before 0.3.0 the digest was blake2b over the whole stream in one thread
(:data:`LEGACY_DIGEST_ALGO`, :func:`legacy_digest`). Checkpoints name their algorithm (``digest_algo``; none:
blake2b) and are verified with it (:func:`geomesh_p2p.model.state.verify_checkpoint_digest`).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import blake3
import torch

__all__ = [
    "DIGEST_ALGO",
    "SHA256_TREE_ALGO",
    "LEGACY_DIGEST_ALGO",
    "DIGEST_CHUNK_BYTES",
    "tree_digest",
    "legacy_digest",
    "digest_workers",
]

#: The state digest's algorithm, as checkpoints record it (``digest_algo``).
DIGEST_ALGO = "blake3-tree-8MiB"
#: The digest of releases 0.3.0 to 0.11: the same tree with SHA-256 and the prefix ``geomesh-state-digest-v2``.
SHA256_TREE_ALGO = "sha256-tree-8MiB"
#: The digest of releases before 0.3.0: blake2b over the whole stream (checkpoints without ``digest_algo``).
LEGACY_DIGEST_ALGO = "blake2b"
#: Bytes per leaf of the tree: 2 Mi fp32 elements. Large enough that a leaf's hash dwarfs a task's overhead
#: (~2 ms of BLAKE3 a leaf) and that gpt2-124m's 712 MB state spreads over ~85 leaves.
DIGEST_CHUNK_BYTES = 8 << 20
#: algorithm -> (hash constructor, the root's domain prefix)
_TREES: dict[str, tuple[Callable, bytes]] = {
    DIGEST_ALGO: (blake3.blake3, b"geomesh-state-digest-v3"),
    SHA256_TREE_ALGO: (hashlib.sha256, b"geomesh-state-digest-v2"),
}


def digest_workers() -> int:
    """Threads a digest uses by default: torch's thread count (the peer's share of the host's cores, set by
    ``--threads`` or the peers on the host, geomesh_p2p.node.host), at least 1."""
    return max(1, int(torch.get_num_threads()))


def _leaves(views: Sequence[memoryview], chunk: int) -> list[list[memoryview]]:
    """The stream ``views`` (byte memoryviews, concatenated) cut into ``chunk``-byte leaves, each a list of the
    slices it spans (a leaf that straddles two views has two)."""
    leaves: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = chunk
    for v in views:
        pos, n = 0, len(v)
        while pos < n:
            take = min(room, n - pos)
            cur.append(v[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                leaves.append(cur)
                cur, room = [], chunk
    if cur:
        leaves.append(cur)
    return leaves


def tree_digest(
    views: Sequence[memoryview],
    workers: Optional[int] = None,
    chunk_bytes: int = DIGEST_CHUNK_BYTES,
    algo: str = DIGEST_ALGO,
) -> str:
    """``algo`` (:data:`DIGEST_ALGO`, or :data:`SHA256_TREE_ALGO` for checkpoints of 0.3.0-0.11) of the byte stream
    ``views`` (1-D byte memoryviews, concatenated; not copied): 32 hex chars. ``workers``: threads hashing the
    leaves (default :func:`digest_workers`; the value is the same for any count). ``chunk_bytes``: leaf size (the
    default is the algorithm's; another gives another digest, for tests). Raises ValueError for
    ``chunk_bytes < 1`` or an unknown ``algo``."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
    if algo not in _TREES:
        raise ValueError(f"unknown digest algorithm {algo!r} (known: {', '.join(_TREES)})")
    new, prefix = _TREES[algo]

    def hash_leaf(parts: list[memoryview]) -> bytes:
        h = new()
        for p in parts:
            h.update(p)
        return h.digest()

    views = [v.cast("B") if v.format != "B" else v for v in views]
    leaves = _leaves(views, chunk_bytes)
    n = max(1, int(workers if workers is not None else digest_workers()))
    if n == 1 or len(leaves) < 2:
        hashes = [hash_leaf(p) for p in leaves]
    else:
        with ThreadPoolExecutor(max_workers=min(n, len(leaves)), thread_name_prefix="digest") as pool:
            hashes = list(pool.map(hash_leaf, leaves))
    total = sum(len(v) for v in views)
    root = new(prefix)
    root.update(total.to_bytes(8, "little"))
    root.update(int(chunk_bytes).to_bytes(8, "little"))
    for h in hashes:
        root.update(h)
    return root.hexdigest()[:32]


def legacy_digest(views: Sequence[memoryview]) -> str:
    """:data:`LEGACY_DIGEST_ALGO`: blake2b (64-byte digest) over the stream ``views``, first 32 hex chars; the
    digest of releases before 0.3.0, kept to verify their checkpoints. One thread, ~0.66 GiB/s here."""
    h = hashlib.blake2b()
    for v in views:
        h.update(v)
    return h.hexdigest()[:32]
