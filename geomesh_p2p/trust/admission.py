"""Admission of identities (DESIGN.md "Identity and trust"; issue 12, "Admission").

Open runs: an identity costs work. Its PeerRecord carries ``pow_nonce``, a nonce such that

    SHA-256(POW_DOMAIN || len(run_id) || run_id || PeerID || nonce as 8 little-endian bytes)

starts with at least ``RunConfig.pow_bits`` zero bits. PeerID = SHA-256(Ed25519 public key), so the
work is bound to the key (a nonce cannot be moved to another identity) and to the run (nor to another
run). Making one identity takes 2**pow_bits hashes on average; checking a record takes one hash.
The nonce is computed once per (identity, run) and cached next to the key file
(:func:`pow_cache_path`).

What this buys and what it does not: at the default 22 bits an identity costs a few seconds of one
CPU core in Python (measured: docs/security.md, "Admission"); an attacker with an
optimised native or GPU miner pays ~100-10,000x less per identity. PoW only bounds the *rate* of new
identities; votes that matter count standing (delivered rounds, :mod:`geomesh_p2p.trust.standing`), which
no amount of hashing buys.

Private runs: ``--allow-peers FILE`` (one base58 PeerID or public key per line). The transport's
:class:`~geomesh_p2p.net.identity.Verifier` then refuses every RPC from another identity with
PERMISSION_DENIED (DHT stores and finds, collective pushes and pulls, state downloads, probes), and
:class:`Admission` ignores records of identities outside the list.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import base58

from geomesh_p2p.config.models import DEFAULT_POW_BITS, MAX_POW_BITS  # noqa: F401  (kept importable from here)
from geomesh_p2p.net.identity import PUBLIC_KEY_BYTES, Identity, PeerID
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry.logonce import LogOnce

log = logging.getLogger(__name__)

POW_DOMAIN = b"geomesh-p2p/pow/v1\x00"
MAX_NONCE = (1 << 64) - 1


# ---------------------------------------------------------------------------------------- proof of work
def _prefix(run_id: str, peer_id: bytes):
    rb = run_id.encode()
    h = hashlib.sha256(POW_DOMAIN)
    h.update(struct.pack("<I", len(rb)) + rb)
    h.update(bytes(peer_id))
    return h


def pow_digest(run_id: str, peer_id: bytes, nonce: int) -> bytes:
    """The 32-byte hash whose leading zero bits are the work of ``nonce``."""
    h = _prefix(run_id, peer_id)
    h.update(struct.pack("<Q", nonce))
    return h.digest()


def leading_zero_bits(digest: bytes) -> int:
    """Number of leading zero bits of ``digest`` (256 for all zeros)."""
    return len(digest) * 8 - int.from_bytes(digest, "big").bit_length()


def check_pow(run_id: str, peer_id: bytes, nonce: Optional[int], bits: int) -> bool:
    """True when ``nonce`` proves ``bits`` of work for ``peer_id`` in ``run_id`` (one hash). ``bits`` <= 0: True."""
    if bits <= 0:
        return True
    if nonce is None or not 0 <= nonce <= MAX_NONCE:
        return False
    return leading_zero_bits(pow_digest(run_id, peer_id, nonce)) >= bits


def solve_pow(
    run_id: str, peer_id: bytes, bits: int, *, start: int = 0, should_stop: Optional[Callable[[], bool]] = None
) -> Optional[int]:
    """The first nonce >= ``start`` proving ``bits`` of work (2**bits hashes on average).

    ``should_stop`` is polled every 2**16 tries; returns None when it says stop.
    """
    if not 0 <= bits <= MAX_POW_BITS:
        raise ValueError(f"pow_bits must be in [0, {MAX_POW_BITS}], got {bits}")
    if bits == 0:
        return start
    prefix = _prefix(run_id, peer_id)
    copy = prefix.copy
    limit = 1 << (64 - bits)  # the first 8 bytes, big-endian, must be below this
    pack = struct.Struct("<Q").pack
    nonce = start
    while nonce <= MAX_NONCE:
        end = min(nonce + (1 << 16), MAX_NONCE + 1)
        for n in range(nonce, end):
            h = copy()
            h.update(pack(n))
            if int.from_bytes(h.digest()[:8], "big") < limit:
                return n
        nonce = end
        if should_stop is not None and should_stop():
            return None
    raise RuntimeError("no nonce found in the 64-bit range")  # 2**-2**(64-bits): never for bits <= 40


def pow_cache_path(key_path: str | os.PathLike) -> Path:
    """Where the nonces of the key at ``key_path`` are cached: ``<key file>.pow`` (JSON)."""
    p = Path(key_path).expanduser()
    return p.with_name(p.name + ".pow")


def load_or_solve_pow(
    identity: Identity,
    run_id: str,
    bits: int,
    cache: Optional[str | os.PathLike] = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> tuple[Optional[int], float, bool]:
    """This identity's nonce for ``run_id`` at ``bits`` or more: from ``cache`` when it holds a valid one,
    else computed (and cached). Returns (nonce, seconds spent, came from the cache); the nonce is None
    when ``should_stop`` said stop before it was found.

    The cache is JSON ``{"peer_id": ..., "runs": {run_id: nonce}}``; one of another key, unreadable or
    holding a nonce too weak for ``bits`` is ignored (and rewritten). A cache that cannot be written
    is logged, not fatal.
    """
    pid = bytes(identity.peer_id)
    data: dict = {}
    path = Path(cache).expanduser() if cache is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("peer_id") != str(identity.peer_id):
                data = {}
        except (OSError, ValueError):
            data = {}
        nonce = (data.get("runs") or {}).get(run_id) if isinstance(data.get("runs"), dict) else None
        if isinstance(nonce, int) and check_pow(run_id, pid, nonce, bits):
            return nonce, 0.0, True
    t0 = time.perf_counter()
    nonce = solve_pow(run_id, pid, bits, should_stop=should_stop)
    took = time.perf_counter() - t0
    if nonce is not None and path is not None:
        runs: dict = data["runs"] if isinstance(data.get("runs"), dict) else {}
        runs[run_id] = nonce
        try:
            tmp = path.with_name(path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"peer_id": str(identity.peer_id), "runs": runs}, f)
            os.replace(tmp, path)
        except OSError as e:
            log.info(
                "could not cache the proof of work in %s (%s); it is recomputed at the next start", path, e.strerror
            )
    return nonce, took, False


def pow_done_line(bits: int, took: float, cached: bool, cache: Optional[str | os.PathLike]) -> str:
    """The log line of :func:`load_or_solve_pow`'s outcome: reused from ``cache`` (``cached``), or computed in
    ``took`` seconds and saved in ``cache`` for later starts. "done in 0.0s (cached in FILE)" was printed for a
    nonce just computed (a new key; fast at low ``--pow-bits`` or by luck) and read as if it came from the cache
    (fresh-user trial). Durations under 10 s get two decimals."""
    if cached:
        return f"proof of work ({bits} bits) reused from {cache}, computed at an earlier start of this key"
    text = (
        f"proof of work ({bits} bits) computed in {took:.2f}s"
        if took < 10
        else f"proof of work ({bits} bits) computed in {took:.0f}s"
    )
    return text + (f"; saved in {cache} for later starts of this key" if cache else "")


def discard_new_identity(identity: Identity) -> Optional[Path]:
    """A failed start: remove the key file this process created for ``identity`` and the proof of work cached
    beside it (:meth:`Identity.discard_created`; nothing once its creation was said, :meth:`Identity.keep_created`).
    The cache goes only when it names this identity: a key born in this process, so only this process wrote it.
    Returns the key's path when it was removed, else None."""
    new = identity.created
    if new is None or new.kept:
        return None
    cache = pow_cache_path(new.absolute)
    try:
        if json.loads(cache.read_text()).get("peer_id") == str(identity.peer_id):
            cache.unlink()
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not this identity's JSON object: left
        pass
    return identity.discard_created()


# ---------------------------------------------------------------------------------------- allow-lists
def read_allow_file(path: str | os.PathLike) -> list[str]:
    """Entries of an ``--allow-peers`` file: one base58 PeerID or Ed25519 public key per line; blank lines
    and ``#`` comments are skipped. Raises ValueError (one line, with file and line number)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read allow-list {p}: {e.strerror}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if entry.lower().startswith("peerid:"):  # the line geomesh-bootstrap / `geomesh-peer identity` print
            entry = entry[7:].strip()
        try:
            raw = base58.b58decode(entry)
        except ValueError:
            raw = b""
        if len(raw) != PUBLIC_KEY_BYTES:
            raise ValueError(f"allow-list {p} line {i}: {entry[:60]!r} is not a base58 PeerID or public key")
        out.append(entry)
    if not out:
        raise ValueError(f"allow-list {p} names no peer")
    return out


# ---------------------------------------------------------------------------------------- records
def run_record_store_check(
    run_id: str, pow_bits: int
) -> Callable[[str, Optional[str], bytes, PeerID, Optional[int]], Optional[str]]:
    """A DHT node's store check (:class:`~geomesh_p2p.dht.state.DHTNodeState`'s ``store_check``) for the signed
    records of run ``run_id``. Returns the refusal's one-line reason, or None. Keys outside the run pass.

    * Under ``<run>/peers`` or one of its shard keys (``<run>/peers/<S>/<i>``): a PeerRecord (the schema readers
      apply) naming its signer, under its signer's PeerID subkey, with proof of work for ``pow_bits`` bits.
    * Under any other key of the run (plan heads and chunks, proofs, evidence, the status page's rounds; session
      30): the record's own ``pow_nonce`` (``SignedRecord.pow_nonce``, 0.10.0) must be its owner's proof of work for
      ``pow_bits`` bits.

    ``pow_bits`` 0 asks no work. Why at store time (red team, session 28): readers dropped junk, but storage holds
    at most ``RecordLimits.max_subkeys_per_key`` (2,048) subkeys per key and refuses new ones when full, so 2,046
    junk records signed by throwaway keys (no work), stored for 24 h, locked every newcomer out of the run's records
    key; the same junk under ``<run>/plan/<r>`` would have kept round r's leaders from storing their plans. Now
    each slot under a run key costs an identity's proof of work (2**pow_bits hashes). Cost: one JSON parse per
    store of a peer record, one SHA-256 per new (peer, nonce) (:class:`Admission`'s cache)."""
    base = f"{run_id}/peers"
    work = Admission(run_id, pow_bits)  # its check of the work, and its cache of records already checked

    def check(
        key: str, subkey: Optional[str], value: bytes, owner: PeerID, pow_nonce: Optional[int] = None
    ) -> Optional[str]:
        if not key.startswith(run_id + "/"):
            return None
        who = owner.to_string()
        if key != base and not key.startswith(base + "/"):
            if pow_bits <= 0:
                return None
            if work.problem(_Claim(who, pow_nonce)) is None:
                return None
            what = "no proof of work" if pow_nonce is None else "an invalid proof of work"
            return f"a record under run key {key[:60]!r} carries {what} (this node asks {pow_bits} bits for run {run_id!r})"
        if subkey != who:
            return "a peer record is stored under its signer's PeerID subkey"
        try:
            rec = PeerRecord.from_bytes(value)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            return f"not a PeerRecord ({str(e).splitlines()[0][:120]})"
        if rec.peer_id != who:
            return f"the record names peer {rec.peer_id[:10]}, its signer is {who[:10]}"
        if work.problem(rec) is not None:
            return f"no valid proof of work (this node asks {pow_bits} bits for a peer record of run {run_id!r})"
        return None

    return check


#: The name of session 28 (peer records only); the check now covers every run key.
peer_record_store_check = run_record_store_check


@dataclass(frozen=True)
class _Claim:
    """What :meth:`Admission.problem` reads of a record: the signer's PeerID and its proof-of-work nonce."""

    peer_id: str
    pow_nonce: Optional[int]


class Admission:
    """Which PeerRecords count: valid proof of work for ``pow_bits`` and, in a private run, on ``allow``.

    :meth:`problem` says why a record does not count (None: it does); :meth:`filter` keeps the ones
    that do and logs each dropped (peer, reason) once at debug level.
    """

    def __init__(
        self, run_id: str, pow_bits: int = 0, allow: Optional[Callable[[PeerID], bool]] = None, log_capacity: int = 4096
    ):
        self.run_id, self.pow_bits, self.allow = run_id, pow_bits, allow
        self._dropped_log = LogOnce(log, capacity=log_capacity)  # keys (peer, reason)
        self._capacity = log_capacity
        self._ok: "OrderedDict[tuple, None]" = OrderedDict()  # (peer, nonce) already checked: no rehash

    def problem(self, rec) -> Optional[str]:
        try:
            pid = PeerID.from_string(rec.peer_id)
        except ValueError:
            return "its peer id is not a base58 PeerID"
        if self.allow is not None and not self.allow(pid):
            return "not on this run's allow-list (--allow-peers)"
        if self.pow_bits > 0:
            key = (rec.peer_id, rec.pow_nonce)
            if key in self._ok:
                return None
            if rec.pow_nonce is None:
                return f"no proof of work (this run asks {self.pow_bits} bits)"
            if not check_pow(self.run_id, bytes(pid), rec.pow_nonce, self.pow_bits):
                return f"invalid proof of work (this run asks {self.pow_bits} bits)"
            self._ok[key] = None
            if len(self._ok) > self._capacity:
                self._ok.popitem(last=False)
        return None

    def filter(self, records: Iterable) -> list:
        out = []
        for rec in records:
            why = self.problem(rec)
            if why is None:
                out.append(rec)
                continue
            self._dropped_log(
                (rec.peer_id, why),
                logging.DEBUG,
                "ignoring the record of %s: %s",
                rec.peer_id[:10],
                why,
                event="record_not_admitted",
                peer=rec.peer_id,
                reason=why,
            )
        return out
