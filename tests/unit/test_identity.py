"""Identity: key files (mode 0600, refused when others can read them), PeerIDs, envelopes."""

from __future__ import annotations

import hashlib
import os
import stat

import grpc
import pytest

from geomesh_p2p.net.identity import EnvelopeError, Identity, IdentityError, PeerID, Verifier, canonical_header

pytestmark = pytest.mark.timeout(30)


def test_key_file_created_0600_and_reused(tmp_path):
    path = tmp_path / "sub" / "node.key"
    a = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 32
    b = Identity.load_or_create(path)
    assert a.peer_id == b.peer_id
    assert len(bytes(a.peer_id)) == 32
    assert PeerID.from_string(str(a.peer_id)) == a.peer_id
    assert str(a.peer_id).startswith(a.peer_id.short()) and len(a.peer_id.short()) == 10


def test_key_readable_by_others_refused_with_fix(tmp_path):
    path = tmp_path / "node.key"
    Identity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError) as ei:
        Identity.load_or_create(path)
    assert f"chmod 600 {path}" in str(ei.value)
    assert "\n" not in str(ei.value)


def test_corrupt_key_and_bad_paths(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="corrupt: expected a 32-byte Ed25519 key, found 9 bytes"):
        Identity.load_or_create(bad)
    with pytest.raises(IdentityError, match="is a folder"):
        Identity.load_or_create(tmp_path)


def test_envelope_binds_every_field():
    ident = Identity.generate()
    v = Verifier("run", max_skew_s=10)
    msg = ident.sign_message(run_id="run", round=3, kind="k", payload=b"p")
    ok = v.verify(msg, kind="k", check_replay=False)
    assert (ok.sender, ok.round, ok.payload, ok.kind) == (ident.peer_id, 3, b"p", "k")
    # Any change to a signed header field breaks the signature.
    for field, value in [
        ("round", 4),
        ("kind", "k2"),
        ("timestamp", msg.envelope.timestamp + 1),
        ("nonce", os.urandom(16)),
    ]:
        m = type(msg)()
        m.CopyFrom(msg)
        setattr(m.envelope, field, value)
        with pytest.raises(EnvelopeError) as ei:
            v.verify(m, check_replay=False)
        assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED, field


def test_replay_cache_is_bounded_and_expires():
    now = [1000.0]
    v = Verifier("run", max_skew_s=5, replay_cache_size=3, clock=lambda: now[0])
    ident = Identity.generate()
    msgs = []
    for _ in range(5):
        m = ident.sign_message(run_id="run", round=0, kind="k", payload=b"")
        m.envelope.timestamp = now[0]
        m.envelope.signature = ident.sign(canonical_header(m.envelope))
        msgs.append(m)
        v.verify(m)
    assert len(v._seen) == 3  # bounded
    with pytest.raises(EnvelopeError) as ei:
        v.verify(msgs[-1])
    assert ei.value.code == grpc.StatusCode.ALREADY_EXISTS
    now[0] += 11  # past 2 x skew: entries expire, and the old message fails the skew check instead
    with pytest.raises(EnvelopeError) as ei:
        v.verify(msgs[-1])
    assert ei.value.code == grpc.StatusCode.OUT_OF_RANGE
    fresh = ident.sign_message(run_id="run", round=0, kind="k", payload=b"")
    fresh.envelope.timestamp = now[0]
    fresh.envelope.signature = ident.sign(canonical_header(fresh.envelope))
    v.verify(fresh)
    assert len(v._seen) == 1  # the expired entries were pruned


def test_non_finite_timestamp_refused():
    ident = Identity.generate()
    v = Verifier("run", max_skew_s=10)
    for ts in (float("nan"), float("inf")):
        m = ident.sign_message(run_id="run", round=0, kind="k", payload=b"")
        m.envelope.timestamp = ts
        m.envelope.signature = ident.sign(canonical_header(m.envelope))
        with pytest.raises(EnvelopeError) as ei:
            v.verify(m)
        assert ei.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_verify_reads_and_hashes_the_payload_once(monkeypatch):
    """Issue 17: ``Verifier.verify`` read a protobuf payload three times (each read of a upb bytes field
    is a copy) and the envelope's payload hash is computed once per message."""
    import geomesh_p2p.net.identity as identity_mod

    ident = Identity.generate()
    payload = os.urandom(4096)
    hashed = []
    real = identity_mod.payload_hash
    monkeypatch.setattr(identity_mod, "payload_hash", lambda p: hashed.append(len(p)) or real(p))
    msg = ident.sign_message(run_id="run", round=1, kind="k", payload=payload)
    assert hashed == [4096]  # signing: one hash of the payload

    class Counting:  # what verify reads of a SignedMessage, counting payload reads
        reads = 0

        def HasField(self, name):  # noqa: N802
            return msg.HasField(name)

        envelope = msg.envelope

        @property
        def payload(self):
            Counting.reads += 1
            return msg.payload

    ok = Verifier("run").verify(Counting(), kind="k")
    assert ok.payload == payload and Counting.reads == 1 and hashed == [4096, 4096]
    # a precomputed hash (e.g. from a worker thread) is signed as is: no second hash
    pre = hashlib.sha256(payload).digest()
    m2 = ident.sign_message(run_id="run", round=1, kind="k", payload=payload, payload_sha256=pre)
    assert m2.envelope.payload_sha256 == pre and len(hashed) == 2
    assert Verifier("run").verify(m2, kind="k").payload == payload
    with pytest.raises(ValueError, match="32 bytes"):
        ident.sign_message(run_id="run", round=1, kind="k", payload=payload, payload_sha256=b"x")


# ---- issue 29 #6: a key mounted read-only as a Docker/Kubernetes secret --------------------------------------
def _secret_dir(tmp_path, mode=0o444):
    """A key file with ``mode`` in a folder of mode 0555, as a secret volume shows it (restored in teardown)."""
    d = tmp_path / "secrets"
    d.mkdir()
    key = d / "node.key"
    ident = Identity.load_or_create(key)
    os.chmod(key, mode)
    os.chmod(d, 0o555)
    return ident, key, d


def test_key_on_a_read_only_mount_accepted(tmp_path, monkeypatch):
    from geomesh_p2p.net import identity as identity_mod

    ident, key, d = _secret_dir(tmp_path)
    try:
        monkeypatch.setattr(identity_mod, "read_only_mount", lambda p: p == key)  # statvfs's ST_RDONLY there
        assert Identity.load_or_create(key).peer_id == ident.peer_id
    finally:
        os.chmod(d, 0o755)


def test_key_readable_by_others_on_a_writable_mount_still_refused(tmp_path):
    ident, key, d = _secret_dir(tmp_path)
    try:  # 0444 in a 0555 folder, but owned by this user on a writable file system: chmod 600 works here
        with pytest.raises(IdentityError) as ei:
            Identity.load_or_create(key)
        msg = str(ei.value)
        assert f"chmod 600 {key}" in msg and "mode 444" in msg and "read-only" in msg and "\n" not in msg
    finally:
        os.chmod(d, 0o755)


def test_key_permission_policy_table(tmp_path):
    from geomesh_p2p.net.identity import key_permission_problem as problem

    p = tmp_path / "k"
    me = 10001
    # (mode, owner, my uid, read-only mount, folder writable by me) -> accepted?
    cases = [
        ((0o600, me, me, False, True), True),
        ((0o400, me, me, False, True), True),
        ((0o644, me, me, False, True), False),  # the usual mistake: refused with chmod 600
        ((0o444, me, me, False, False), False),  # read-only bits, but mine: chmod 600 is possible
        ((0o444, 0, me, True, False), True),  # Docker secret: /run/secrets, root, mode 0444, read-only tmpfs
        ((0o644, 0, me, True, False), True),  # Kubernetes secret: defaultMode 0644, read-only volume
        ((0o440, 0, me, False, False), True),  # root's file for a group, in a folder this user cannot write
        ((0o440, 0, me, False, True), False),  # ... but in a folder it can write: refused
        ((0o444, 0, me, False, False), False),  # readable by every local user (red team): refused
        ((0o444, 0, 0, False, True), False),  # running as root: it could chmod it
        ((0o666, me, me, False, True), False),  # writable by others: refused
        ((0o664, 0, me, False, False), False),  # ... even when root provisioned it on a writable file system
        ((0o666, 0, me, True, False), True),  # nobody can write a read-only mount
    ]
    for args, accepted in cases:
        got = problem(p, *args)
        assert (got is None) == accepted, (oct(args[0]), args[1:], got)
    assert "chmod 600" in problem(p, 0o644, me, me, False, True)
    assert "its owner must" in problem(p, 0o644, 0, me, False, True)  # not ours: chmod would fail
    assert "writable by other users" in problem(p, 0o666, me, me, False, True)
