"""Values bigger than one DHT value: an owner-signed head, plus owner-signed chunks under their own keys
(issue 25). Used by the plan (:mod:`geomesh_p2p.plan.wire`) and the verified-work evidence
(:mod:`geomesh_p2p.trust.evidence`); each picks its own :class:`ChunkFormat` (magic, names in the
reasons, limits) and encodes / decodes its own body (this module only moves and checks bytes).

A DHT value is at most 64 KiB (``RecordLimits.max_value_bytes``). For a ``body`` (bytes, usually
compressed by the caller) and a format whose magic is ``M`` (e.g. ``b"gmplan/2"``):

* the **head**, the value stored under the caller's key (subkey and owner chosen by the caller), is
  ``M + b"I" + body`` when that fits in ``fmt.value_bytes`` (one store, one get: a small value pays
  nothing extra), else ``M + b"H" +`` JSON ``{"sha256": <hex of the body>, "size": <body bytes>,
  "chunk_bytes": C, "chunks": [<hex of each chunk>]}``;
* chunk i is ``body[i*C : (i+1)*C]``, stored under :func:`chunk_key` (``<key>/part/<first 16 hex of
  the body's sha256>/<i>``, same subkey, same owner): each chunk has its own key, so chunks land on
  different DHT nodes, and a value republished with other content (another hash) never mixes its
  chunks with the first one's;
* or, for a head whose JSON also says ``"layout": 2`` (``split(..., stable=True)``; a value under a key
  ``<prefix>/<round>``, the plan of a run with record shards S > 1), under :func:`stable_chunk_key`
  (``<prefix>/parts/<round % 2>/<i>``, same subkey, same owner): the same keys round after round, so a
  reader asks the holders it found once (``DHTNode.get(..., cached=True)``: one Find per chunk, no
  lookup) instead of a lookup per chunk (~7 calls at N = 1,024; issue 25, session 26). The owner's slot
  there holds its latest chunk i: a holder that missed a newer store answers an older one, which does not
  match the head's hash. The writer also stores every chunk under :func:`chunk_key` (and only those stores
  decide whether the value was stored: the stable copies are a shortcut), so a reader whose stable read
  fails reads the chunk there, as before; readers of the releases before it look there too.

Writers: :func:`split` then :func:`store_chunked` (chunks first, with bounded concurrency and a deadline
each, then the head, so a reader that sees the head finds the chunks); :func:`store_many` is the bounded
concurrent store for any list of values. Readers: :class:`ChunkedReader` fetches the chunks a head lists
in parallel (a deadline each), checks each chunk's owner, size and hash against the head and the whole
against the head's hash, only then hands the body to the caller's decoder (in a worker thread above a
size), and remembers the last results (by owner and head bytes) so repeated polls fetch and decode once.
:func:`decompress_capped` is the zlib inflate with an output cap (a zlib bomb is refused).

Errors: :func:`split` and :func:`parse_head` raise ValueError with a one-line reason;
:meth:`ChunkedReader.load` raises :class:`ChunksPending` (a chunk missing, late, not the owner's, or not
matching: retry on the next read) or ValueError (the head or the decoded body is malformed).

Units: bytes, seconds; hashes are lowercase hex SHA-256.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generic, Iterable, Optional, TypeVar
from geomesh_p2p.util.untrusted import json_loads

log = logging.getLogger(__name__)

__all__ = [
    "VALUE_BYTES",
    "MAX_CHUNKS",
    "ChunkFormat",
    "ChunkedValue",
    "ChunksPending",
    "ChunkedReader",
    "Head",
    "StoreOutcome",
    "chunk_key",
    "decompress_capped",
    "parse_head",
    "sha256_hex",
    "split",
    "store_chunked",
    "store_many",
]

#: Largest value stored by this module: well under the DHT's 64 KiB (``RecordLimits.max_value_bytes``),
#: room left for the record's framing (key, subkey, owner key, signature). Bytes.
VALUE_BYTES = 60_000
#: Default limit of chunks per head: 64 x 60,000 B = 3.8 MB of body.
MAX_CHUNKS = 64
#: Default concurrency of the stores of one writer (chunks, or the values of :func:`store_many`).
STORE_CONCURRENCY = 16


class ChunksPending(Exception):
    """A head was read but its body cannot be assembled yet: a chunk missing, not read in time, not
    signed by the head's owner, or not matching the head's hashes. ``str(e)`` is the one-line reason;
    the next read retries (as for a value not yet visible)."""


@dataclass(frozen=True)
class ChunkFormat:
    """How one kind of value is framed. ``magic``: prefix of every head (the inline form adds ``b"I"``,
    the chunked head ``b"H"``); ``what`` / ``owner_role`` name the value and its signer in the reasons
    (``"plan"`` / ``"leader"``); ``version``: the wire version the magic stands for (in the reason a
    foreign value is refused with); ``value_bytes``: largest head or chunk, bytes (<= ``VALUE_BYTES``
    unless the DHT allows more); ``max_chunks``: a body needing, or a head listing, more is refused;
    ``inline_bytes``: largest inline value (None: ``value_bytes``), smaller for a value many peers read through
    a quorum of holders (the plan): each holder's answer carries an inline body, a head only its hashes, and the
    chunks are read from one holder each (readers accept either form at any size)."""

    magic: bytes
    what: str = "value"
    owner_role: str = "owner"
    version: int = 1
    value_bytes: int = VALUE_BYTES
    max_chunks: int = MAX_CHUNKS
    inline_bytes: Optional[int] = None

    @property
    def inline(self) -> bytes:
        return self.magic + b"I"

    @property
    def head_prefix(self) -> bytes:
        return self.magic + b"H"


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ChunkedValue:
    """A body ready to store: ``head`` (the value under the caller's key) and ``chunks`` (chunk i's
    bytes; empty when the head holds the body). ``sha256``: hex of the body; ``body_bytes``: its size;
    ``stable``: the chunks go under :func:`stable_chunk_key` too (the head says so)."""

    head: bytes
    chunks: list[bytes]
    sha256: str
    body_bytes: int
    stable: bool = False


def split(body: bytes, fmt: ChunkFormat, stable: bool = False) -> ChunkedValue:
    """Frame ``body`` as a head and chunks of at most ``fmt.value_bytes`` each (module doc); ``stable``: a
    chunked head says ``"layout": 2`` (chunks under :func:`stable_chunk_key`). Deterministic. Raises
    ValueError when it needs more than ``fmt.max_chunks`` chunks."""
    digest = sha256_hex(body)
    cb = fmt.value_bytes
    inline_max = cb if fmt.inline_bytes is None else min(cb, fmt.inline_bytes)
    if len(fmt.inline) + len(body) <= inline_max:
        return ChunkedValue(fmt.inline + body, [], digest, len(body))  # inline: no chunks, no layout
    chunks = [body[i : i + cb] for i in range(0, len(body), cb)]
    if len(chunks) > fmt.max_chunks:
        raise ValueError(f"{fmt.what} of {len(body)} bytes needs {len(chunks)} chunks, over {fmt.max_chunks}")
    head: dict[str, Any] = {
        "sha256": digest,
        "size": len(body),
        "chunk_bytes": cb,
        "chunks": [sha256_hex(c) for c in chunks],
    }
    if stable:
        head["layout"] = STABLE_LAYOUT
    framed = fmt.head_prefix + json.dumps(head, separators=(",", ":")).encode()
    return ChunkedValue(framed, chunks, digest, len(body), stable)


def chunk_key(key: str, sha256: str, index: int) -> str:
    """DHT key of chunk ``index`` of the body hashing to ``sha256`` whose head is under ``key``."""
    return f"{key}/part/{sha256[:16]}/{index}"


#: A head's ``layout`` for chunks under :func:`stable_chunk_key` (absent: :func:`chunk_key`).
STABLE_LAYOUT = 2


def stable_chunk_key(key: str, index: int) -> str:
    """DHT key of chunk ``index`` of a stable-layout value whose head is under ``key`` = ``<prefix>/<round>``:
    ``<prefix>/parts/<round % 2>/<index>`` (two sets of keys, so that a leader of rounds r and r + 1 does not
    replace round r's chunks while round r is read). Raises ValueError when ``key`` does not end in a round."""
    prefix, _, last = key.rpartition("/")
    if not prefix or not last.isdigit():
        raise ValueError(f"a stable chunk layout needs a key ending in /<round>, not {key!r}")
    return f"{prefix}/parts/{int(last) % 2}/{index}"


@dataclass(frozen=True)
class Head:
    """A parsed head: ``body`` when the value is inline, else the hashes and sizes of its chunks."""

    body: Optional[bytes] = None
    sha256: str = ""
    size: int = 0
    chunk_bytes: int = 0
    chunks: list[str] = field(default_factory=list)
    #: chunks under :func:`stable_chunk_key` (the head's ``"layout": 2``), else under :func:`chunk_key`
    stable: bool = False

    def chunk_size(self, i: int) -> int:
        """Bytes chunk ``i`` must have."""
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)


def _hex(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def parse_head(value: bytes, fmt: ChunkFormat) -> Head:
    """Parse a head value of format ``fmt``. Raises ValueError with the reason: not this format's magic, a
    head that is no JSON object with sha256/size/chunk_bytes/chunks (other keys are ignored), sizes, hashes or
    a chunk count that do not fit together, chunks over ``fmt.value_bytes``, or more than ``fmt.max_chunks``."""
    if value.startswith(fmt.inline):
        return Head(body=value[len(fmt.inline) :])
    w = fmt.what
    if not value.startswith(fmt.head_prefix):
        a = "an" if w[:1] in "aeiou" else "a"
        raise ValueError(f"not {a} {w} of wire version {fmt.version} (starts {value[: len(fmt.inline)]!r})")
    d = json_loads(value[len(fmt.head_prefix) :], f"{w} head")
    # Keys of a newer patch release are ignored (docs/compat.md): the head is a signed DHT value, as received.
    if not isinstance(d, dict) or not {"sha256", "size", "chunk_bytes", "chunks"} <= set(d):
        raise ValueError(f"{w} head must have sha256, size, chunk_bytes, chunks")
    size, cb, chunks = d["size"], d["chunk_bytes"], d["chunks"]
    if not (isinstance(size, int) and isinstance(cb, int) and size > 0 and 0 < cb <= fmt.value_bytes):
        raise ValueError(f"{w} head: bad size {size!r} or chunk_bytes {cb!r}")
    if not isinstance(chunks, list) or not all(_hex(c) for c in chunks) or not _hex(d["sha256"]):
        raise ValueError(f"{w} head: hashes must be 64 lowercase hex digits")
    if len(chunks) > fmt.max_chunks:
        raise ValueError(f"{w} head lists {len(chunks)} chunks, over the limit of {fmt.max_chunks}")
    if len(chunks) != -(-size // cb):
        raise ValueError(f"{w} head: {len(chunks)} chunks do not hold {size} bytes in chunks of {cb}")
    stable = d.get("layout") == STABLE_LAYOUT
    return Head(sha256=d["sha256"], size=size, chunk_bytes=cb, chunks=chunks, stable=stable)


def decompress_capped(data: bytes, max_bytes: int, what: str = "value") -> bytes:
    """zlib-inflate ``data`` to at most ``max_bytes`` bytes. Raises ValueError: not zlib, more than
    ``max_bytes`` once inflated (a zlib bomb: never inflated past the cap), truncated or trailing bytes."""
    z = zlib.decompressobj()
    try:
        text = z.decompress(data, max_bytes + 1)
    except zlib.error as e:
        raise ValueError(f"{what} body does not decompress: {e}") from None
    if len(text) > max_bytes or z.unconsumed_tail:
        raise ValueError(f"{what} body decompresses to more than {max_bytes} bytes")
    if not z.eof or z.unused_data:
        raise ValueError(f"{what} body is truncated or has trailing bytes")
    return text


# -- writing -------------------------------------------------------------------------------------------


async def store_many(
    dht,
    items: Iterable[tuple[str, Optional[str], bytes]],
    *,
    owner,
    expiration_time: float,
    timeout_s: Optional[float] = None,
    concurrency: int = STORE_CONCURRENCY,
) -> list[bool]:
    """Store each ``(key, subkey, value)`` signed by ``owner`` (an Identity), at most ``concurrency`` at
    once, each within ``timeout_s`` seconds (None: the DHT's own RPC deadlines only). Returns, in order,
    whether each was stored; a store that timed out or raised counts as not stored (logged at DEBUG),
    so one bad value does not stop the others. ``dht``: has ``async store(key, value, expiration_time,
    subkey=, owner=) -> bool``."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(key: str, subkey: Optional[str], value: bytes) -> bool:
        async with sem:
            try:
                coro = dht.store(key, value, expiration_time=expiration_time, subkey=subkey, owner=owner)
                return bool(await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s)))
            except asyncio.TimeoutError:
                log.debug("store of %s/%s: no answer within %.3gs", key, subkey, timeout_s)
            except Exception as e:  # a refusal (RecordError) or a transport error: this value only
                log.debug("store of %s/%s failed: %r", key, subkey, e)
            return False

    return list(await asyncio.gather(*(one(k, sk, v) for k, sk, v in items)))


@dataclass(frozen=True)
class StoreOutcome:
    """What :func:`store_chunked` did: ``head_stored`` (the head was stored somewhere; never tried when a
    chunk failed), ``chunks_failed`` of ``chunks`` stored nowhere."""

    head_stored: bool
    chunks_failed: int
    chunks: int

    @property
    def ok(self) -> bool:
        return self.head_stored and not self.chunks_failed


async def store_chunked(
    dht,
    key: str,
    value: ChunkedValue,
    *,
    subkey: Optional[str],
    owner,
    expiration_time: float,
    timeout_s: Optional[float] = None,
    concurrency: int = STORE_CONCURRENCY,
) -> StoreOutcome:
    """Store ``value``'s chunks (:func:`store_many`: bounded concurrency, ``timeout_s`` each) under
    :func:`chunk_key` (and, for a head of the stable layout, also under :func:`stable_chunk_key`), then,
    only if all were stored under :func:`chunk_key`, its head under ``key``; all under ``subkey``, signed by
    ``owner``. A stable copy stored nowhere is logged at DEBUG only (its readers fall back to :func:`chunk_key`).
    A head store that times out counts as not stored; one that raises propagates (as the caller's own store would)."""
    if value.chunks:
        n = len(value.chunks)
        items = [(chunk_key(key, value.sha256, i), subkey, c) for i, c in enumerate(value.chunks)]
        if value.stable:
            items += [(stable_chunk_key(key, i), subkey, c) for i, c in enumerate(value.chunks)]
        stored = await store_many(
            dht,
            items,
            owner=owner,
            expiration_time=expiration_time,
            timeout_s=timeout_s,
            concurrency=concurrency,
        )
        if not all(stored[n:]):
            log.debug("%d of %d stable chunk copies of %s were stored nowhere", stored[n:].count(False), n, key)
        if not all(stored[:n]):
            return StoreOutcome(False, stored[:n].count(False), n)
    coro = dht.store(key, value.head, expiration_time=expiration_time, subkey=subkey, owner=owner)
    try:
        ok = await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))
    except asyncio.TimeoutError:
        log.debug("store of the head %s/%s: no answer within %.3gs", key, subkey, timeout_s)
        ok = False
    return StoreOutcome(bool(ok), 0, len(value.chunks))


# -- reading -------------------------------------------------------------------------------------------

T = TypeVar("T")


class ChunkedReader(Generic[T]):
    """Assembles values from heads of format ``fmt`` read under a key, decodes them with ``decode``
    (bytes -> T; raises ValueError when malformed), and remembers the last ``cache_size`` results (by
    owner and head bytes), so repeated polls fetch and decode each value once.

    :param dht: has ``async get(key, latest=True, subkeys=None) -> {subkey: (value, expiration, owner)}``.
    :param chunk_timeout_s: deadline of each chunk's get, seconds.
    :param thread_above_bytes: bodies bigger than this are decoded in a worker thread, not on the loop.
    """

    def __init__(
        self,
        dht,
        fmt: ChunkFormat,
        decode: Callable[[bytes], T],
        chunk_timeout_s: float = 5.0,
        cache_size: int = 16,
        thread_above_bytes: int = 16 << 10,
    ):
        self.dht, self.fmt, self.decode = dht, fmt, decode
        self.chunk_timeout_s, self.cache_size, self.thread_above_bytes = chunk_timeout_s, cache_size, thread_above_bytes
        self._cache: OrderedDict[tuple[str, str], T] = OrderedDict()

    async def load(self, key: str, owner: str, value: bytes) -> T:
        """The decoded body of head ``value`` stored under ``key`` by ``owner`` (the record's owner and
        subkey, which the caller has checked; its chunks must be under the same subkey, signed by the
        same owner). Raises ValueError when the head or the decoded body is malformed (``decode``'s own
        errors), :class:`ChunksPending` when a chunk is missing, late or does not match."""
        ck = (owner, sha256_hex(value))
        hit = self._cache.get(ck)
        if hit is not None:
            self._cache.move_to_end(ck)
            return hit
        body = await self.body(key, owner, value)
        if len(body) > self.thread_above_bytes:
            out = await asyncio.to_thread(self.decode, body)
        else:
            out = self.decode(body)
        self._cache[ck] = out
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out

    async def body(self, key: str, owner: str, value: bytes) -> bytes:
        """The body of head ``value`` (inline, or its chunks fetched in parallel and checked); not cached,
        not decoded. Raises as :meth:`load`."""
        head = parse_head(value, self.fmt)
        if head.body is not None:
            return head.body
        parts = await asyncio.gather(*(self._chunk(key, owner, head, i) for i in range(len(head.chunks))))
        body = b"".join(parts)
        if sha256_hex(body) != head.sha256:  # each chunk matched its hash: only a head inconsistent in itself
            raise ChunksPending(f"the {len(head.chunks)} chunks do not hash to the head's sha256")
        return body

    async def _chunk(self, key: str, owner: str, head: Head, i: int) -> bytes:
        if head.stable:
            return await self._stable_chunk(key, owner, head, i)
        n = len(head.chunks)
        try:
            # One holder's copy is enough: the key names the body's hash and the slot is the owner's (a record
            # under it is signed by the owner, the DHT checked that), so every copy is the same bytes; a node
            # asked for the owner's subkey only answers with it, and one that withholds it is passed over.
            found = await asyncio.wait_for(
                self.dht.get(chunk_key(key, head.sha256, i), latest=False, subkeys=[owner]), self.chunk_timeout_s
            )
        except asyncio.TimeoutError:
            raise ChunksPending(f"chunk {i + 1}/{n} not read within {self.chunk_timeout_s:g}s") from None
        entry = (found or {}).get(owner)
        if entry is None:
            raise ChunksPending(f"chunk {i + 1}/{n} not found")
        data, _expiration, signer = entry
        if signer is None or str(signer) != owner:
            raise ChunksPending(f"chunk {i + 1}/{n} is not signed by the {self.fmt.owner_role}")
        if len(data) != head.chunk_size(i) or sha256_hex(data) != head.chunks[i]:
            raise ChunksPending(f"chunk {i + 1}/{n} does not match the head's hash")
        return data

    def _check(self, found: Optional[dict], owner: str, head: Head, i: int) -> Optional[str]:
        """Why the entry of ``owner`` in ``found`` is not chunk ``i`` of ``head`` (None: it is)."""
        n = len(head.chunks)
        entry = (found or {}).get(owner)
        if entry is None:
            return f"chunk {i + 1}/{n} not found"
        data, _expiration, signer = entry
        if signer is None or str(signer) != owner:
            return f"chunk {i + 1}/{n} is not signed by the {self.fmt.owner_role}"
        if len(data) != head.chunk_size(i) or sha256_hex(data) != head.chunks[i]:
            return f"chunk {i + 1}/{n} does not match the head's hash"
        return None

    async def _stable_chunk(self, key: str, owner: str, head: Head, i: int) -> bytes:
        """Chunk ``i`` of a stable-layout head: from one holder the last lookup of its key found, drawn at random
        (``DHTNode.get(..., quorum=1, cached=True)``); a copy that is missing or not the head's (an older chunk of
        the owner's slot, a lagging holder) drops those holders, and the chunk is read under :func:`chunk_key`
        (the key of its hash, where the writer always stores it: a lookup, as before session 26). Raises
        :class:`ChunksPending` as :meth:`load`."""
        ckey = stable_chunk_key(key, i)
        try:
            got = await asyncio.wait_for(
                self.dht.get(ckey, latest=True, subkeys=[owner], quorum=1, cached=True), self.chunk_timeout_s
            )
            if self._check(got, owner, head, i) is None:
                return got[owner][0]
        except asyncio.TimeoutError:
            pass  # the key of its hash, below, with a deadline of its own
        forget = getattr(self.dht, "forget_read_targets", None)
        if callable(forget):
            forget(ckey)
        return await self._chunk(key, owner, replace(head, stable=False), i)
