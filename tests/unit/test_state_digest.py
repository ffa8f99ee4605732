"""The state digest at memory speed (issue 27): a tree of BLAKE3 over 8 MiB leaves hashed on threads
(geomesh_p2p.model.digest; SHA-256 from 0.3.0 to 0.11), the same value for any thread count, the GlobalState's
buffer hash equal to ``digest(theta, momentum)``; checkpoints record the algorithm, and those of earlier releases
(the SHA-256 tree; blake2b, no ``digest_algo``, before 0.3.0) are still read, verified with theirs, and take the
new digest."""

from __future__ import annotations

import hashlib
import json

import blake3
import pytest
import torch

from geomesh_p2p.model.digest import DIGEST_ALGO, DIGEST_CHUNK_BYTES, SHA256_TREE_ALGO, legacy_digest, tree_digest
from geomesh_p2p.model.export import ExportError, load_checkpoint
from geomesh_p2p.model.state import (
    CheckpointError,
    GlobalState,
    digest,
    load_latest_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(60)


def reference(data: bytes, chunk: int = DIGEST_CHUNK_BYTES, h=blake3.blake3, prefix=b"geomesh-state-digest-v3") -> str:
    """The algorithm as docs/real-size.md states it, written independently of the code under test (``h`` and
    ``prefix``: hashlib.sha256 and ``-v2`` for the tree of releases 0.3.0 to 0.11)."""
    leaves = b"".join(h(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    head = prefix + len(data).to_bytes(8, "little") + chunk.to_bytes(8, "little")
    return h(head + leaves).hexdigest()[:32]


def sha256_reference(data: bytes, chunk: int = DIGEST_CHUNK_BYTES) -> str:
    return reference(data, chunk, hashlib.sha256, b"geomesh-state-digest-v2")


def le(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4").tobytes()


def test_tree_digest_is_the_stated_algorithm_for_any_thread_count():
    g = torch.Generator().manual_seed(0)
    # 5 Mi + 3 elements of theta and as many of momentum: 40 MiB + 24 B, 6 leaves, one across the boundary
    theta = torch.randn(5 * 2**20 + 3, generator=g)
    mom = torch.randn(theta.numel(), generator=g)
    want = reference(le(theta) + le(mom))
    assert (DIGEST_ALGO, SHA256_TREE_ALGO) == ("blake3-tree-8MiB", "sha256-tree-8MiB")
    assert [digest(theta, mom, workers=w) for w in (1, 2, 3, 8)] == [want] * 4
    gs = GlobalState(theta.numel(), k=1)
    gs.load(0, theta, mom)
    assert gs.digest == gs.compute_digest() == want  # the buffer's hash is digest(theta, momentum)
    # small leaves: many leaves, and leaves that straddle the two views
    views = [memoryview(le(theta[:1000])), memoryview(le(mom[:777]))]
    for chunk in (1, 7, 4096):
        data = le(theta[:1000]) + le(mom[:777])
        assert tree_digest(views, workers=3, chunk_bytes=chunk) == reference(data, chunk)
        assert tree_digest(views, workers=2, chunk_bytes=chunk, algo=SHA256_TREE_ALGO) == sha256_reference(data, chunk)
    assert digest(theta[:0]) == reference(b"")
    assert tree_digest([memoryview(le(theta) + le(mom))], algo=SHA256_TREE_ALGO) == sha256_reference(
        le(theta) + le(mom)
    )
    with pytest.raises(ValueError):
        tree_digest(views, chunk_bytes=0)
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        tree_digest(views, algo="md5")


def test_every_bit_counts_and_the_layout_is_part_of_it():
    theta = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB: 2 leaves
    d = digest(theta)
    for i in (0, 2**21 - 1, 2**21, theta.numel() - 1):  # in each leaf and at the leaves' boundary
        flipped = theta.clone()
        flipped.view(torch.int32)[i] ^= 1
        assert digest(flipped) != d
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    # theta | momentum is one stream: where it splits is not part of the identity, its length is
    assert digest(theta[:10], theta[10:20]) == digest(theta[:20]) != digest(theta[:19])


def _legacy_checkpoint(tmp_path, theta, mom, rnd=4):
    """A checkpoint as a 0.2 release wrote it: blake2b digest, no ``digest_algo``."""
    meta = save_checkpoint(tmp_path, round=rnd, theta=theta, momentum=mom, meta={"run_config_hash": "abc"})
    record = json.loads(meta.read_text())
    del record["digest_algo"]
    record["digest"] = hashlib.blake2b(le(theta) + le(mom)).hexdigest()[:32]
    meta.write_text(json.dumps(record))
    return meta, record["digest"]


def test_a_checkpoint_of_the_previous_release_is_read_and_takes_the_new_digest(tmp_path):
    g = torch.Generator().manual_seed(1)
    theta, mom = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    meta, old = _legacy_checkpoint(tmp_path, theta, mom)
    assert legacy_digest([memoryview(le(theta)), memoryview(le(mom))]) == old
    rnd, th, mo, rec = load_latest_checkpoint(tmp_path)
    assert rnd == 4 and torch.equal(th, theta) and torch.equal(mo, mom)
    assert (rec["digest"], rec["legacy_digest"], rec["digest_algo"]) == (digest(theta, mom), old, DIGEST_ALGO)
    assert load_checkpoint(tmp_path)[3]["digest"] == digest(theta, mom)  # geomesh-peer export alike
    # a damaged legacy checkpoint is refused, naming the old algorithm
    record = json.loads(meta.read_text())
    record["digest"] = "0" * 32
    meta.write_text(json.dumps(record))
    with pytest.raises(
        CheckpointError, match=r"corrupt checkpoint .*: digest [0-9a-f]{32} != recorded 0{32} \(blake2b"
    ):
        load_latest_checkpoint(tmp_path)
    with pytest.raises(ExportError, match="damaged or altered file"):
        load_checkpoint(tmp_path)


def test_a_checkpoint_records_its_algorithm_and_an_unknown_one_is_refused(tmp_path):
    theta = torch.linspace(-1, 1, 4096)
    meta = save_checkpoint(tmp_path, round=2, theta=theta, momentum=None, meta={})
    record = json.loads(meta.read_text())
    assert (record["digest_algo"], record["digest"]) == (DIGEST_ALGO, digest(theta))
    assert load_latest_checkpoint(tmp_path)[3]["digest"] == digest(theta)
    record["digest_algo"] = "blake4-tree"
    meta.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="its digest is 'blake4-tree', which this release does not know"):
        load_latest_checkpoint(tmp_path)
    with pytest.raises(ExportError, match="written by a newer release"):
        load_checkpoint(tmp_path)


def test_a_checkpoint_of_0_3_to_0_11_is_verified_with_the_sha256_tree_and_takes_the_new_digest(tmp_path):
    """0.12.0 changed the tree's hash to BLAKE3 (session 37): a checkpoint that names ``sha256-tree-8MiB`` is checked
    with it, loads, and its state takes this release's digest; a damaged one is refused naming that algorithm."""
    g = torch.Generator().manual_seed(2)
    theta, mom = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    meta = save_checkpoint(tmp_path, round=3, theta=theta, momentum=mom, meta={"run_config_hash": "abc"})
    record = json.loads(meta.read_text())
    old = sha256_reference(le(theta) + le(mom))
    record.update(digest_algo=SHA256_TREE_ALGO, digest=old)
    meta.write_text(json.dumps(record))
    rnd, th, mo, rec = load_latest_checkpoint(tmp_path)
    assert rnd == 3 and torch.equal(th, theta) and torch.equal(mo, mom)
    assert (rec["digest"], rec["legacy_digest"], rec["digest_algo"]) == (digest(theta, mom), old, DIGEST_ALGO)
    assert digest(theta, mom) != old
    record["digest"] = "f" * 32
    meta.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"!= recorded f{32} \(the digest of releases 0.3.0 to 0.11\)"):
        load_latest_checkpoint(tmp_path)
