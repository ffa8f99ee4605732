"""Node identity: Ed25519 keys, PeerIDs and signed envelopes (DESIGN.md, "Identity and trust").

* A node's key lives in a file (raw 32-byte Ed25519 private key, PEM-free) created with mode 0600
  and reused across restarts. A key file that others can read is refused, unless the platform mounted it
  read-only as a secret (:func:`key_permission_problem`); one that others can write, always.
* PeerID = SHA-256 of the raw 32-byte public key. Printed as base58 (``PeerID.to_string``), short
  form = its first 10 characters.
* A signed envelope binds run id, round, sender, timestamp, nonce, payload SHA-256 and a ``kind``
  (the RPC it belongs to, so a signed Ping cannot be replayed as a Store).
* :class:`Verifier` checks all of that plus a clock-skew window, a bounded replay cache, a payload
  size limit and an optional allow-list, and raises :class:`EnvelopeError` with a gRPC status code
  and a reason.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import secrets
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import base58
import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.wire import envelope_pb2

PUBLIC_KEY_BYTES = 32
PEER_ID_BYTES = 32
NONCE_BYTES = 16
SIGNATURE_BYTES = 64
_DOMAIN = b"geomesh-p2p/envelope/v1\x00"


class IdentityError(Exception):
    """A key file is missing, unreadable, corrupt or too permissive. ``str()`` is a one-line message."""


class PeerID(bytes):
    """32-byte SHA-256 of an Ed25519 public key. ``str()`` gives the base58 form."""

    def __new__(cls, value: bytes) -> "PeerID":
        if len(value) != PEER_ID_BYTES:
            raise ValueError(f"PeerID must be {PEER_ID_BYTES} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_public_key(cls, public_key: bytes) -> "PeerID":
        """PeerID of a raw 32-byte Ed25519 public key."""
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_string(cls, text: str) -> "PeerID":
        """Parse the base58 form; raises ValueError on bad text."""
        return cls(base58.b58decode(text))

    def to_string(self) -> str:
        return base58.b58encode(bytes(self)).decode()

    def short(self) -> str:
        """First 10 base58 characters: enough to tell peers apart in logs."""
        return self.to_string()[:10]

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"PeerID({self.short()}…)"


def read_only_mount(path: Path) -> bool:
    """True when ``path`` lies on a file system mounted read-only (``statvfs``'s ``ST_RDONLY``): a Docker or
    Kubernetes secret, a ``:ro`` bind mount. False when it cannot be told."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def key_permission_problem(
    path: Path, mode: int, owner_uid: int, my_uid: int, on_read_only_mount: bool, dir_writable: bool
) -> Optional[str]:
    """Why the key file at ``path`` (permission bits ``mode``, owned by ``owner_uid``; this process runs as
    ``my_uid``; ``dir_writable``: this process may write its folder) must not be used, or None. The policy
    (docs/docker.md, "The identity key as a secret"):

    * on a read-only mount (a Docker or Kubernetes secret, a ``:ro`` bind mount): accepted whatever its mode
      bits, since nobody can change it there, ``chmod`` is impossible and inside the container there are no
      other users to read it;
    * writable by group or others: refused (anyone could swap the key);
    * readable by others: refused (any local user could copy the identity: red team);
    * readable by its group: refused, unless root owns it while this process is not root and cannot write its
      folder (a secret the platform provisioned for a service group: only its owner can fix it).

    The message is one line naming the file, its mode and a fix that is possible where the file is.
    """
    if on_read_only_mount:
        return None
    mine = my_uid in (0, owner_uid)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        fix = f"fix it with: chmod 600 {path}" if mine else "its owner must make it mode 0600 or 0400"
        return f"identity file {path} is writable by other users (mode {mode:o}); {fix}"
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    if owner_uid == 0 and not mine and not dir_writable and not mode & stat.S_IRWXO:
        return None
    fix = f"fix it with: chmod 600 {path}" if mine else "its owner must make it mode 0600 or 0400"
    return (
        f"identity file {path} is accessible by other users (mode {mode:o}); {fix} "
        f"(a key mounted read-only, as Docker and Kubernetes mount secrets, is accepted as it is)"
    )


@dataclass
class CreatedKeyFile:
    """A key file :meth:`Identity.load_or_create` created in this process (it did not exist): said in one line
    once the program's start-up succeeded (:meth:`Identity.keep_created`), removed when it failed
    (:meth:`Identity.discard_created`). A mistyped ``--identity`` made a new identity silently, and a start that
    failed left it behind for the next try to use (fresh-user trial, session 32)."""

    path: Path  #: as given (``~`` expanded): what the line names
    absolute: Path  #: what is removed, whatever the working folder is by then
    folders: tuple[Path, ...]  #: the parent folders created with it, innermost first (removed when left empty)
    dev_ino: tuple[int, int]  #: the file's device and inode: only this very file is ever removed
    kept: bool = False


def _missing_parents(p: Path) -> tuple[Path, ...]:
    """The parent folders of ``p`` that do not exist (``mkdir(parents=True)`` creates them), innermost first."""
    out = []
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        out.append(parent)
        parent = parent.parent
    return tuple(out)


class Identity:
    """An Ed25519 key pair and its PeerID."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key_bytes)
        #: the key file this process created for it (:meth:`load_or_create`), None when loaded or never stored
        self.created: Optional[CreatedKeyFile] = None

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> "Identity":
        """Load the key at ``path``, or create it (mode 0600, parent folders 0700) when absent; a created one is
        recorded in ``created`` (:meth:`keep_created`, :meth:`discard_created`).

        Raises IdentityError (one line) when the file is readable by group/others (except a secret
        mounted read-only: :func:`key_permission_problem`), writable by them, unreadable, not a 32-byte
        Ed25519 key, or the path is a folder.
        """
        p = Path(path).expanduser()
        if p.is_dir():
            raise IdentityError(f"identity path {p} is a folder, expected a key file")
        if not p.exists():
            try:
                folders = _missing_parents(p)
                p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                ident = cls.generate()
                raw = ident._private_key.private_bytes(
                    serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
                )
                # O_EXCL: never overwrite a key that appeared meanwhile; 0600 from birth, no chmod race.
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    st = os.fstat(f.fileno())
                    f.write(raw)
                ident.created = CreatedKeyFile(p, p.absolute(), folders, (st.st_dev, st.st_ino))
                return ident
            except OSError as e:
                raise IdentityError(f"cannot create identity file {p}: {e.strerror}") from None
        try:
            st = p.stat()
            problem = key_permission_problem(
                p, stat.S_IMODE(st.st_mode), st.st_uid, os.geteuid(), read_only_mount(p), os.access(p.parent, os.W_OK)
            )
            if problem:
                raise IdentityError(problem)
            raw = p.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity file {p}: {e.strerror}") from None
        if len(raw) != 32:
            raise IdentityError(f"identity file {p} is corrupt: expected a 32-byte Ed25519 key, found {len(raw)} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def keep_created(self) -> Optional[str]:
        """The program started (it serves): the key file :meth:`load_or_create` created in this process stays.
        Returns the one line that says so, to print once start-up succeeded (never before: a start that fails
        prints one line, its error); None when the key was loaded, or kept already."""
        new = self.created
        if new is None or new.kept:
            return None
        new.kept = True
        return (
            f"created a new identity at {new.path} (peer id {self.peer_id.short()}…); "
            "pass the same --identity to keep it"
        )

    def discard_created(self) -> Optional[Path]:
        """The program's start-up failed: remove the key file :meth:`load_or_create` created in this process, and
        the parent folders it created for it when they are left empty, so that a failed start leaves nothing
        behind (the next try would take that identity silently). Never a key it loaded, one kept
        (:meth:`keep_created`), nor a file that replaced it at that path. Returns the path removed, or None.
        A file that cannot be removed is left (this runs on the way out of a failed start)."""
        new = self.created
        if new is None or new.kept:
            return None
        self.created = None
        try:
            st = new.absolute.lstat()
            if (st.st_dev, st.st_ino) != new.dev_ino:
                return None
            new.absolute.unlink()
        except OSError:
            return None
        for folder in new.folders:
            try:
                folder.rmdir()  # only when empty: anything else written there meanwhile stays
            except OSError:
                break
        return new.path

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``data``."""
        return self._private_key.sign(data)

    def sign_message(
        self, *, run_id: str, round: int, kind: str, payload: bytes, payload_sha256: Optional[bytes] = None
    ) -> envelope_pb2.SignedMessage:
        """Wrap ``payload`` in a signed envelope bound to run, round, kind, now and a fresh nonce.

        The signature covers the envelope header (:func:`canonical_header`), which holds the payload's
        SHA-256: the payload is hashed once (``payload_sha256``, 32 bytes, when the caller hashed it
        already, e.g. in a worker thread; see :func:`payload_hash`), never signed whole. Synchronous:
        hashing runs at ~1-2 GB/s, so callers on an event loop sign payloads over ~1 MiB in a thread.

        Raises:
            ValueError: ``payload_sha256`` is not 32 bytes.
        """
        if payload_sha256 is None:
            payload_sha256 = payload_hash(payload)
        env = self.sign_envelope(run_id=run_id, round=round, kind=kind, payload_sha256=payload_sha256)
        return envelope_pb2.SignedMessage(envelope=env, payload=payload)

    def sign_envelope(self, *, run_id: str, round: int, kind: str, payload_sha256: bytes) -> envelope_pb2.Envelope:
        """The signed envelope of a payload whose SHA-256 is ``payload_sha256`` (32 bytes), bound to run,
        round, kind, now and a fresh nonce: :meth:`sign_message` without the payload (the transport
        encodes the message itself, with no copy of the envelope into a SignedMessage).

        Raises:
            ValueError: ``payload_sha256`` is not 32 bytes.
        """
        if len(payload_sha256) != 32:
            raise ValueError(f"payload_sha256 must be 32 bytes, got {len(payload_sha256)}")
        env = envelope_pb2.Envelope(
            run_id=run_id,
            round=round,
            sender=bytes(self.peer_id),
            public_key=self.public_key_bytes,
            timestamp=swarm_time(),  # swarm time, as receivers judge it (issue 29 #3: a stepped clock)
            nonce=secrets.token_bytes(NONCE_BYTES),
            payload_sha256=payload_sha256,
            kind=kind,
        )
        env.signature = self.sign(canonical_header(env))
        return env


def payload_hash(payload: bytes) -> bytes:
    """SHA-256 (32 bytes) of an envelope's payload: what the envelope signs in place of the payload.
    ``hashlib`` releases the GIL on large buffers, so it may run in a worker thread."""
    return hashlib.sha256(payload).digest()


# Parsed public keys and PeerIDs of the peers met, by raw key: every verified message needs both, and a
# node talks to the same few hundred peers again and again. Bounded LRUs; both values are immutable.
@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(raw)


@functools.lru_cache(maxsize=4096)
def _peer_id_of_key(public_key: bytes) -> "PeerID":
    return PeerID.from_public_key(public_key)


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key`` (raw 32 bytes)."""
    try:
        _public_key(bytes(public_key)).verify(signature, data)
        return True
    except (InvalidSignature, ValueError):
        return False


_U32 = struct.Struct("<I").pack  # a length prefix of canonical_header


def canonical_header(env: envelope_pb2.Envelope) -> bytes:
    """The exact bytes an envelope signature covers (length-prefixed fields, little-endian numbers).

    Independent of protobuf serialization, which is not canonical.
    """
    run_id, sender, public_key = env.run_id.encode(), env.sender, env.public_key
    nonce, digest, kind = env.nonce, env.payload_sha256, env.kind.encode()
    return b"".join(
        (
            _DOMAIN,
            _U32(len(run_id)),
            run_id,
            struct.pack("<Q", env.round),
            _U32(len(sender)),
            sender,
            _U32(len(public_key)),
            public_key,
            struct.pack("<d", env.timestamp),
            _U32(len(nonce)),
            nonce,
            _U32(len(digest)),
            digest,
            _U32(len(kind)),
            kind,
        )
    )


class EnvelopeError(Exception):
    """A message was refused. ``code`` is the gRPC status to answer with, ``reason`` says why."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Verified:
    """What a verified envelope tells: who sent what, for which round, when."""

    sender: PeerID
    public_key: bytes
    run_id: str
    round: int
    kind: str
    timestamp: float
    payload: bytes


class Verifier:
    """Checks signed envelopes; thread-safe.

    Checks, in order (each failure an :class:`EnvelopeError` with the status in brackets):
    malformed fields [INVALID_ARGUMENT], payload over ``max_payload_bytes`` [RESOURCE_EXHAUSTED],
    another run id [FAILED_PRECONDITION], wrong kind [INVALID_ARGUMENT], sender != SHA-256(public key)
    or bad signature [UNAUTHENTICATED], payload hash mismatch (tampered) [DATA_LOSS], timestamp outside
    ``max_skew_s`` [OUT_OF_RANGE], sender not allowed [PERMISSION_DENIED], nonce already seen
    [ALREADY_EXISTS]. The nonce is recorded only after every other check passed, so a forged copy
    cannot burn a legitimate nonce.

    Replay cache: (sender, nonce) pairs, kept for 2 x ``max_skew_s`` (older messages fail the skew
    check anyway) and at most ``replay_cache_size`` entries (oldest evicted first).

    ``clock``: unix seconds the timestamps are judged against; default swarm time
    (:func:`geomesh_p2p.net.swarm_time.swarm_time`), which signers stamp too, so a machine whose clock was
    stepped or is off keeps its calls accepted (issue 29 #3).
    """

    def __init__(
        self,
        run_id: str,
        *,
        max_skew_s: float = 30.0,
        replay_cache_size: int = 200_000,
        max_payload_bytes: int = 64 << 20,
        allow: Optional[Callable[[PeerID], bool]] = None,
        clock: Callable[[], float] = swarm_time,
    ):
        self.run_id = run_id
        self.max_skew_s = max_skew_s
        self.replay_cache_size = replay_cache_size
        self.max_payload_bytes = max_payload_bytes
        self.allow = allow
        self.clock = clock
        self._seen: "OrderedDict[bytes, float]" = OrderedDict()
        self._lock = threading.Lock()

    def verify(
        self,
        msg: envelope_pb2.SignedMessage,
        *,
        kind: Optional[str] = None,
        max_payload_bytes: Optional[int] = None,
        check_replay: bool = True,
    ) -> Verified:
        """Verify ``msg``; return what it says, or raise EnvelopeError. ``kind`` = expected kind.

        Reads ``msg.payload`` once (protobuf's upb returns a fresh copy on every read) and hashes it
        once. Synchronous: a payload over ~1 MiB should be verified in a worker thread
        (``asyncio.to_thread``) when the caller is on an event loop, as the transport does.
        """
        env = msg.envelope
        payload = msg.payload  # one read: each read of a protobuf bytes field is a copy
        limit = self.max_payload_bytes if max_payload_bytes is None else max_payload_bytes
        if not msg.HasField("envelope"):
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "message has no envelope")
        if (
            len(env.public_key) != PUBLIC_KEY_BYTES
            or len(env.sender) != PEER_ID_BYTES
            or len(env.nonce) != NONCE_BYTES
            or len(env.signature) != SIGNATURE_BYTES
            or len(env.payload_sha256) != 32
        ):
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "malformed envelope: a field has the wrong length")
        if len(payload) > limit:
            raise EnvelopeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"payload of {len(payload)} bytes is over the limit of {limit}"
            )
        if env.run_id != self.run_id:
            raise EnvelopeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"message is for run {env.run_id!r}, this node serves {self.run_id!r}",
            )
        if kind is not None and env.kind != kind:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, f"envelope kind {env.kind!r} does not match {kind!r}")
        if _peer_id_of_key(env.public_key) != env.sender:
            raise EnvelopeError(grpc.StatusCode.UNAUTHENTICATED, "sender PeerID does not match its public key")
        if not verify_signature(env.public_key, env.signature, canonical_header(env)):
            raise EnvelopeError(grpc.StatusCode.UNAUTHENTICATED, "bad signature")
        if payload_hash(payload) != env.payload_sha256:
            raise EnvelopeError(grpc.StatusCode.DATA_LOSS, "payload does not match its signed SHA-256 (tampered)")
        now = self.clock()
        if not math.isfinite(env.timestamp) or abs(now - env.timestamp) > self.max_skew_s:
            raise EnvelopeError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"timestamp is {env.timestamp - now:+.1f}s from this node's clock (allowed ±{self.max_skew_s:.0f}s)",
            )
        sender = PeerID(env.sender)
        if self.allow is not None and not self.allow(sender):
            raise EnvelopeError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"sender {sender.short()} is not allowed (not on this node's allow-list, --allow-peers)",
            )
        if check_replay:
            self._check_nonce(env.sender + env.nonce, now)
        return Verified(sender, bytes(env.public_key), env.run_id, env.round, env.kind, env.timestamp, payload)

    def _check_nonce(self, key: bytes, now: float) -> None:
        with self._lock:
            horizon = now - 2 * self.max_skew_s
            while self._seen:
                oldest_key, t = next(iter(self._seen.items()))
                if t >= horizon and len(self._seen) < self.replay_cache_size:
                    break
                self._seen.popitem(last=False)
            if key in self._seen:
                raise EnvelopeError(grpc.StatusCode.ALREADY_EXISTS, "nonce already seen (replayed message)")
            self._seen[key] = now


def allow_list(public_keys_or_ids: Iterable[str], *, also: Iterable[PeerID] = ()) -> Callable[[PeerID], bool]:
    """An ``allow`` callback for :class:`Verifier` (private runs) from base58 PeerIDs or raw Ed25519 public
    keys (both are 32 bytes: each entry admits the PeerID it is and the PeerID of the key it is; a
    stranger would need a key whose SHA-256 is a listed value). ``also``: PeerIDs admitted besides
    (this node's own). Raises ValueError on an entry that is not 32 bytes of base58."""
    allowed = set(also)
    for s in public_keys_or_ids:
        raw = base58.b58decode(s.strip())
        if len(raw) != PEER_ID_BYTES:
            raise ValueError(f"allow-list entry {s[:60]!r} is not a base58 PeerID or public key")
        allowed.add(PeerID(raw))
        allowed.add(PeerID.from_public_key(raw))
    return lambda pid: pid in allowed
