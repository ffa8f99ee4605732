"""Signed, owner-protected DHT records (DESIGN.md, "DHT" and "Identity and trust").

A DHT value travels as a :class:`~geomesh_p2p.wire.dht_pb2.SignedRecord`: key (clear text), optional
subkey, value bytes, expiration time (unix seconds) and, when signed, the owner's raw Ed25519 public
key and a signature over :func:`canonical_record_bytes` (which also binds the run id, so a record of
one swarm cannot be replayed into another).

Owner rule (who may write a slot ``(key, subkey)``):

* a key of the form ``<anything>/owner:<PeerID>`` is owned by that PeerID: every value and subkey
  under it must be signed by that peer's key;
* otherwise a subkey that *is* a base58 PeerID (canonical form, 32 bytes) is owned by that peer:
  ``<run>/peers`` subkey ``<PeerID>`` can only be written by that peer;
* any other slot is unowned: signed or unsigned records are accepted there, but a node never lets a
  record replace an unexpired *signed* record of a different signer (first signer holds the slot
  until its record expires). Use an owner-named subkey when squatting matters.
* under the run's own keys (``<run id>/...``) only signed records are accepted (``signed_run_keys``),
  on store and on find: every record there counts against its signer's storage quota
  (:mod:`geomesh_p2p.dht.quota`). Unsigned records elsewhere are stored with a short lifetime (a
  node caps their expiration at ``max_unsigned_ttl_s`` from now).

Limits (:class:`RecordLimits`): key and subkey length, value size (64 KiB), lifetime (24 h), records
per store call, keys per find call, subkeys per key. A record that breaks a rule raises
:class:`RecordError` with the gRPC status a node answers with and a one-line reason.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import base58
import grpc
from hivemind.dht.routing import DHTID

from geomesh_p2p.net.identity import (
    PEER_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    EnvelopeError,
    Identity,
    PeerID,
    verify_signature,
)
from geomesh_p2p.schema.run_id import MAX_KEY_BYTES
from geomesh_p2p.schema.run_id import OWNER_MARK as OWNER_MARK  # re-exported: the run id's rule is sized to it
from geomesh_p2p.wire import dht_pb2

SignedRecord = dht_pb2.SignedRecord

RECORD_DOMAIN = b"geomesh-p2p/dht-record/v1\x00"


@dataclass(frozen=True)
class RecordLimits:
    """Size and lifetime limits every node enforces on store and on find. Units: bytes, seconds."""

    max_key_bytes: int = MAX_KEY_BYTES  # the run id's rule (geomesh_p2p.schema.run_id) is sized to it
    max_subkey_bytes: int = 256
    max_value_bytes: int = 64 << 10
    max_ttl_s: float = 24 * 3600.0
    max_records_per_store: int = 64
    max_keys_per_find: int = 64
    max_subkeys_per_key: int = 2048
    signed_run_keys: bool = True  # values under "<run id>/..." must be signed
    max_unsigned_ttl_s: float = 60.0  # a node stores an unsigned value at most this long

    def max_store_payload(self) -> int:
        """Upper bound of a valid StoreRequest payload, bytes (the transport refuses bigger ones)."""
        per_record = self.max_key_bytes + self.max_subkey_bytes + self.max_value_bytes + 256
        return self.max_records_per_store * per_record + 4096


DEFAULT_LIMITS = RecordLimits()


class RecordError(EnvelopeError):
    """A record (or DHT request) was refused. ``code``: gRPC status; ``reason``: one line."""


@dataclass(frozen=True)
class VerifiedRecord:
    """A record that passed :func:`verify_record`. ``owner`` is the signer's PeerID (None: unsigned)."""

    key: str
    subkey: Optional[str]
    value: bytes
    expiration_time: float
    owner: Optional[PeerID]
    key_id: DHTID
    record: SignedRecord

    @property
    def signed(self) -> bool:
        return self.owner is not None


# Cached: every record checked and every RPC sent or answered hashes a key or a PeerID again, several
# times per lookup (SHA-1 + an int conversion each). Bounded LRUs; a DHTID is an immutable int.
@functools.lru_cache(maxsize=8192)
def key_id_of(key: str) -> DHTID:
    """DHTID of a key: SHA-1 of its UTF-8 bytes (hivemind's ``DHTID.generate(source=bytes)``)."""
    return DHTID.generate(source=key.encode())


@functools.lru_cache(maxsize=8192)
def node_id_of(peer_id: bytes) -> DHTID:
    """DHTID of a node: SHA-1 of its 32-byte PeerID, so a node cannot pick its place in the key space."""
    return DHTID.generate(source=bytes(peer_id))


def parse_peer_id(text: str) -> Optional[PeerID]:
    """The PeerID that ``text`` names in canonical base58, else None."""
    if not (40 <= len(text) <= 46):
        return None
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return None
    if len(raw) != PEER_ID_BYTES or base58.b58encode(raw).decode() != text:
        return None
    return PeerID(raw)


def owned_key(prefix: str, owner: PeerID) -> str:
    """``<prefix>/owner:<PeerID>``: a key only ``owner`` can write."""
    return f"{prefix}{OWNER_MARK}{owner.to_string()}"


def required_owner(key: str, subkey: Optional[str]) -> Optional[PeerID]:
    """The PeerID that must sign records of slot ``(key, subkey)``, or None for an unowned slot.

    Raises RecordError(INVALID_ARGUMENT) when the key says ``/owner:`` but names no valid PeerID.
    """
    if OWNER_MARK in key:
        text = key.rsplit(OWNER_MARK, 1)[1]
        pid = parse_peer_id(text)
        if pid is None:
            raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"key names a malformed owner {text[:60]!r}")
        return pid
    if subkey is not None:
        return parse_peer_id(subkey)
    return None


def _lp(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def canonical_record_bytes(
    run_id: str, key: str, subkey: Optional[str], value: bytes, expiration_time: float, owner_public_key: bytes
) -> bytes:
    """The exact bytes a record signature covers (length-prefixed, little-endian; not protobuf)."""
    return b"".join(
        [
            RECORD_DOMAIN,
            _lp(run_id.encode()),
            _lp(key.encode()),
            b"\x00" if subkey is None else b"\x01" + _lp(subkey.encode()),
            _lp(value),
            struct.pack("<d", expiration_time),
            _lp(owner_public_key),
        ]
    )


class _CheckedSignatures:
    """Record signatures already checked by this process: SHA-256 digests of (public key, signature,
    signed bytes), at most ``capacity`` (least recently used dropped first). Why: one record is checked
    many times (on store, on every find reply that carries it, and against this node's own copy on every
    ``get``), and an Ed25519 check costs ~0.1-0.3 ms here, while hashing a record costs ~1 us. Only valid
    signatures are remembered; a hit needs the exact same key, signature and signed bytes (a SHA-256
    collision otherwise), so nothing unchecked is ever accepted. Thread-safe."""

    def __init__(self, capacity: int = 8192):
        self.capacity = capacity
        self._seen: "OrderedDict[bytes, None]" = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(public_key: bytes, signature: bytes, data: bytes) -> bytes:
        # public key and signature have fixed lengths (checked before), so the concatenation is unambiguous
        return hashlib.sha256(public_key + signature + data).digest()

    def add(self, public_key: bytes, signature: bytes, data: bytes) -> None:
        """Remember a signature known to be valid (checked, or just made by its owner)."""
        self._remember(self._digest(public_key, signature, data))

    def _remember(self, d: bytes) -> None:
        with self._lock:
            self._seen[d] = None
            self._seen.move_to_end(d)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def check(self, public_key: bytes, signature: bytes, data: bytes) -> bool:
        """True when ``signature`` is ``public_key``'s valid Ed25519 signature of ``data`` (from memory
        when it was checked before)."""
        d = self._digest(public_key, signature, data)
        with self._lock:
            if d in self._seen:
                self._seen.move_to_end(d)
                return True
        if not verify_signature(public_key, signature, data):
            return False
        self._remember(d)
        return True


_checked = _CheckedSignatures()


def make_record(
    key: str,
    value: bytes,
    expiration_time: float,
    *,
    subkey: Optional[str] = None,
    owner: Optional[Identity] = None,
    run_id: str,
    pow_nonce: Optional[int] = None,
) -> SignedRecord:
    """Build a record; signed by ``owner`` when given (unsigned otherwise), carrying ``pow_nonce`` (the owner's
    proof of work for the run, :func:`geomesh_p2p.trust.admission.check_pow`) when both are given. Does not
    validate it."""
    rec = SignedRecord(key=key, value=bytes(value), expiration_time=float(expiration_time))
    if subkey is not None:
        rec.subkey = subkey
    if owner is not None and pow_nonce is not None:
        rec.pow_nonce = int(pow_nonce)
    if owner is not None:
        signed = canonical_record_bytes(run_id, key, subkey, rec.value, rec.expiration_time, owner.public_key_bytes)
        signature = owner.sign(signed)
        rec.owner_public_key = owner.public_key_bytes
        rec.signature = signature
        _checked.add(owner.public_key_bytes, signature, signed)  # made here: no need to check it again
    return rec


def verify_record(
    rec: SignedRecord,
    *,
    run_id: str,
    now: float,
    limits: RecordLimits = DEFAULT_LIMITS,
    expected_key_id: Optional[DHTID] = None,
) -> VerifiedRecord:
    """Check one record; return it verified or raise :class:`RecordError`.

    Checks (status in brackets): empty or oversized key/subkey [INVALID_ARGUMENT], value over
    ``max_value_bytes`` [RESOURCE_EXHAUSTED], non-finite expiration [INVALID_ARGUMENT], expired or
    beyond ``now + max_ttl_s`` [OUT_OF_RANGE], half-present or wrong-length signature fields
    [INVALID_ARGUMENT], bad signature [UNAUTHENTICATED], slot owned by another peer or unsigned,
    unsigned under a run key [PERMISSION_DENIED], key that does not hash to ``expected_key_id``
    [INVALID_ARGUMENT].
    """
    key = rec.key
    subkey = rec.subkey if rec.HasField("subkey") else None
    value = rec.value  # one read: each read of a protobuf bytes field is a copy
    if not key:
        raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "record has an empty key")
    if len(key.encode()) > limits.max_key_bytes:
        raise RecordError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"key of {len(key.encode())} bytes is over the limit of {limits.max_key_bytes}",
        )
    if subkey is not None and len(subkey.encode()) > limits.max_subkey_bytes:
        raise RecordError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"subkey of {len(subkey.encode())} bytes is over the limit of {limits.max_subkey_bytes}",
        )
    if len(value) > limits.max_value_bytes:
        raise RecordError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"value of {len(value)} bytes is over the limit of {limits.max_value_bytes}",
        )
    exp = rec.expiration_time
    if not math.isfinite(exp):
        raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, f"expiration time {exp} is not a finite number")
    if exp <= now:
        raise RecordError(grpc.StatusCode.OUT_OF_RANGE, f"record expired {now - exp:.1f}s ago")
    if exp > now + limits.max_ttl_s:
        raise RecordError(
            grpc.StatusCode.OUT_OF_RANGE,
            f"record expires in {exp - now:.0f}s, over the maximum lifetime of {limits.max_ttl_s:.0f}s",
        )
    pk, sig = rec.owner_public_key, rec.signature
    owner: Optional[PeerID] = None
    if pk or sig:
        if len(pk) != PUBLIC_KEY_BYTES or len(sig) != SIGNATURE_BYTES:
            raise RecordError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed record signature: owner key must be 32 bytes and signature 64",
            )
        if not _checked.check(pk, sig, canonical_record_bytes(run_id, key, subkey, value, exp, pk)):
            raise RecordError(grpc.StatusCode.UNAUTHENTICATED, "bad record signature (forged or altered record)")
        owner = PeerID.from_public_key(pk)
    if owner is None and limits.signed_run_keys and key.startswith(run_id + "/"):
        raise RecordError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"unsigned value under a key of run {run_id!r}: values under {run_id}/... must be signed",
        )
    need = required_owner(key, subkey)
    if need is not None and owner != need:
        what = "subkey" if OWNER_MARK not in key else "key"
        signer = f"signed by {owner.short()}" if owner is not None else "unsigned"
        raise RecordError(grpc.StatusCode.PERMISSION_DENIED, f"{what} is owned by {need.short()}; record is {signer}")
    key_id = key_id_of(key)
    if expected_key_id is not None and key_id != expected_key_id:
        raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, "record key does not hash to the DHT key asked for")
    return VerifiedRecord(key, subkey, value, exp, owner, key_id, rec)
