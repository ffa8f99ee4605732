"""The state digest at memory speed (issue 27): a tree of SHA-256 over 8 MiB leaves hashed on threads
(geomesh_p2p.model.digest), the same value for any thread count, the GlobalState's buffer hash equal to
``digest(theta, momentum)``; checkpoints record the algorithm, and those of releases before 0.3.0 (blake2b, no
``digest_algo``) are still read, verified with blake2b, and take the new digest."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from geomesh_p2p.model.digest import DIGEST_ALGO, DIGEST_CHUNK_BYTES, legacy_digest, tree_digest
from geomesh_p2p.model.export import ExportError, load_checkpoint
from geomesh_p2p.model.state import (
    CheckpointError,
    GlobalState,
    digest,
    load_latest_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(60)


def reference(data: bytes, chunk: int = DIGEST_CHUNK_BYTES) -> str:
    """The algorithm as docs/real-size.md states it, written independently of the code under test."""
    leaves = b"".join(hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    head = b"geomesh-state-digest-v2" + len(data).to_bytes(8, "little") + chunk.to_bytes(8, "little")
    return hashlib.sha256(head + leaves).hexdigest()[:32]


def le(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4").tobytes()


def test_tree_digest_is_the_stated_algorithm_for_any_thread_count():
    g = torch.Generator().manual_seed(0)
    # 5 Mi + 3 elements of theta and as many of momentum: 40 MiB + 24 B, 6 leaves, one across the boundary
    theta = torch.randn(5 * 2**20 + 3, generator=g)
    mom = torch.randn(theta.numel(), generator=g)
    want = reference(le(theta) + le(mom))
    assert DIGEST_ALGO == "sha256-tree-8MiB"
    assert [digest(theta, mom, workers=w) for w in (1, 2, 3, 8)] == [want] * 4
    gs = GlobalState(theta.numel(), k=1)
    gs.load(0, theta, mom)
    assert gs.digest == gs.compute_digest() == want  # the buffer's hash is digest(theta, momentum)
    # small leaves: many leaves, and leaves that straddle the two views
    views = [memoryview(le(theta[:1000])), memoryview(le(mom[:777]))]
    for chunk in (1, 7, 4096):
        data = le(theta[:1000]) + le(mom[:777])
        assert tree_digest(views, workers=3, chunk_bytes=chunk) == reference(data, chunk)
    assert digest(theta[:0]) == reference(b"")
    with pytest.raises(ValueError):
        tree_digest(views, chunk_bytes=0)


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
    record["digest_algo"] = "blake3-tree"
    meta.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="its digest is 'blake3-tree', which this release does not know"):
        load_latest_checkpoint(tmp_path)
    with pytest.raises(ExportError, match="written by a newer release"):
        load_checkpoint(tmp_path)
