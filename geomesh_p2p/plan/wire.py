"""The signed plan's wire form in the DHT (issue 25): compact, and in chunks when one value cannot hold it.

Version 1 stored the plan's JSON as one DHT value: 1.6 KB at 4 peers, 33 KB at 100, 65.8 KB at 200, over
the DHT's 64 KiB value limit (``RecordLimits.max_value_bytes``), so a swarm of ~200 could not store its
plan at all. Version 2 (``PLAN_WIRE_VERSION``):

* the **body** is the plan's JSON with the assignments as columns (``{"peer_id": [...], "address": [...],
  ...}``: each field name once instead of once per peer), zlib-compressed (level 9): 0.73 KB at 4 peers,
  82 KB at 1,024 (docs/round.md, "The plan's size on the wire"). Parsing gives back a plan equal to the
  one encoded (floats are written as Python's shortest repr, exact);
* the **head**, the value under ``<run>/plan/<r>`` with subkey = the leader's PeerID, signed by the
  leader as an owner record (as in version 1), is ``b"gmplan/2I" + body`` when the body fits in
  ``PLAN_VALUE_BYTES`` (one store, one get: a small swarm pays nothing extra), else ``b"gmplan/2H" +``
  JSON ``{"sha256": <hex of the body>, "size": <body bytes>, "chunk_bytes": C, "chunks": [<hex of
  each chunk>]}``;
* chunk i is the body's bytes ``[i*C, (i+1)*C)``, stored under :func:`chunk_key`
  (``<run>/plan/<r>/part/<first 16 hex of the body's sha256>/<i>``, subkey = leader, owner-signed): each
  chunk has its own key, so chunks land on different DHT nodes, and a plan republished with other
  content (another hash) never mixes its chunks with the first one's.

A reader fetches the head, then the chunks in parallel (each get with a deadline), checks each chunk's
owner and hash against the head and the whole against the plan hash, and only then decompresses (at most
``MAX_PLAN_JSON_BYTES``) and parses. A chunk missing or not matching raises :class:`PlanPending`: that
leader's plan is not valid yet (the next read retries, as for a plan not yet visible).

Units: bytes; hashes are lowercase hex SHA-256.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan

#: Version of the plan's wire form (1: the plan's JSON as one value; 2: this module's head + chunks).
PLAN_WIRE_VERSION = 2
_MAGIC = b"gmplan/2"
_INLINE = _MAGIC + b"I"
_HEAD = _MAGIC + b"H"

#: Largest value this module stores: well under the DHT's 64 KiB (``RecordLimits.max_value_bytes``),
#: room left for the record's framing (as ``trust.evidence.MAX_VALUE_BYTES``). Bytes.
PLAN_VALUE_BYTES = 60_000
#: A head listing more chunks is refused: 64 x 60,000 B = 3.8 MB of compressed plan (~47,000 peers).
MAX_PLAN_CHUNKS = 64
#: A body decompressing to more is refused (a zlib bomb from a leader). Bytes; columnar JSON is about
#: 166 B per peer, so this holds ~100,000 peers.
MAX_PLAN_JSON_BYTES = 16 << 20
#: Plans bigger than this (peers) are encoded in a worker thread, not on the event loop (~20 ms at 1,024).
THREAD_ABOVE_PEERS = 128
#: Bodies bigger than this (bytes) are decoded in a worker thread (~10 ms per 80 KB).
THREAD_ABOVE_BYTES = 16 << 10

_FIELDS = tuple(PeerAssignment.model_fields)


class PlanPending(Exception):
    """A head was read but its plan cannot be assembled yet (a chunk missing, unreadable in time, not
    signed by the leader, or not matching the head's hashes). ``str(e)`` is the one-line reason."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_body(plan: RoundPlan) -> bytes:
    """The plan's compact body: columnar JSON, zlib level 9. Deterministic for equal plans."""
    d = plan.model_dump(mode="json")
    rows = d.pop("assignments")
    d["assignments"] = {k: [r[k] for r in rows] for k in _FIELDS}
    return zlib.compress(json.dumps(d, separators=(",", ":"), allow_nan=False).encode(), 9)


def decode_body(body: bytes) -> RoundPlan:
    """Parse a body made by :func:`encode_body`. Raises ValueError (``zlib.error``'s message, a body over
    ``MAX_PLAN_JSON_BYTES`` once decompressed, columns that are no lists of one length) or
    pydantic.ValidationError (a ValueError) when the plan is not valid."""
    z = zlib.decompressobj()
    try:
        text = z.decompress(body, MAX_PLAN_JSON_BYTES + 1)
    except zlib.error as e:
        raise ValueError(f"plan body does not decompress: {e}") from None
    if len(text) > MAX_PLAN_JSON_BYTES or z.unconsumed_tail:
        raise ValueError(f"plan body decompresses to more than {MAX_PLAN_JSON_BYTES} bytes")
    if not z.eof or z.unused_data:
        raise ValueError("plan body is truncated or has trailing bytes")
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"plan body is no JSON: {e}") from None
    cols = d.get("assignments") if isinstance(d, dict) else None
    if not isinstance(cols, dict) or not cols or not all(isinstance(v, list) for v in cols.values()):
        raise ValueError("plan body: assignments must be a non-empty mapping of field -> list")
    n = {len(v) for v in cols.values()}
    if len(n) != 1:
        raise ValueError(f"plan body: assignment columns of different lengths {sorted(n)}")
    names = list(cols)
    d["assignments"] = [dict(zip(names, row)) for row in zip(*cols.values())]
    return RoundPlan.model_validate(d)


@dataclass(frozen=True)
class PlanWire:
    """A plan ready to store: ``head`` (the value under the plan key) and ``chunks`` (chunk i's bytes;
    empty when the head holds the body). ``sha256``: hex of the body."""

    head: bytes
    chunks: list[bytes]
    sha256: str
    body_bytes: int


def split_plan(plan: RoundPlan, value_bytes: int = PLAN_VALUE_BYTES) -> PlanWire:
    """Encode ``plan`` into a head and chunks of at most ``value_bytes`` each (see the module doc).
    Raises ValueError when it needs more than ``MAX_PLAN_CHUNKS`` chunks. CPU: ~20 ms at 1,024 peers."""
    body = encode_body(plan)
    digest = _sha(body)
    if len(_INLINE) + len(body) <= value_bytes:
        return PlanWire(_INLINE + body, [], digest, len(body))
    chunks = [body[i : i + value_bytes] for i in range(0, len(body), value_bytes)]
    if len(chunks) > MAX_PLAN_CHUNKS:
        raise ValueError(f"plan of {len(body)} bytes needs {len(chunks)} chunks, over {MAX_PLAN_CHUNKS}")
    head = {"sha256": digest, "size": len(body), "chunk_bytes": value_bytes, "chunks": [_sha(c) for c in chunks]}
    return PlanWire(_HEAD + json.dumps(head, separators=(",", ":")).encode(), chunks, digest, len(body))


def chunk_key(plan_key: str, sha256: str, index: int) -> str:
    """DHT key of chunk ``index`` of the plan whose body hashes to ``sha256``, under ``plan_key``."""
    return f"{plan_key}/part/{sha256[:16]}/{index}"


@dataclass(frozen=True)
class PlanHead:
    """A parsed head: ``body`` when the plan is inline, else the hashes and sizes of its chunks."""

    body: Optional[bytes] = None
    sha256: str = ""
    size: int = 0
    chunk_bytes: int = 0
    chunks: list[str] = field(default_factory=list)

    def chunk_size(self, i: int) -> int:
        """Bytes chunk ``i`` must have."""
        return min(self.chunk_bytes, self.size - i * self.chunk_bytes)


def _hex(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def parse_head(value: bytes) -> PlanHead:
    """Parse a head value. Raises ValueError with the reason (not a version-2 plan, a head whose sizes,
    hashes or chunk count do not fit together, or more than ``MAX_PLAN_CHUNKS`` chunks)."""
    if value.startswith(_INLINE):
        return PlanHead(body=value[len(_INLINE) :])
    if not value.startswith(_HEAD):
        raise ValueError(f"not a plan of wire version {PLAN_WIRE_VERSION} (starts {value[:9]!r})")
    try:
        d = json.loads(value[len(_HEAD) :])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"plan head is no JSON: {e}") from None
    if not isinstance(d, dict) or set(d) != {"sha256", "size", "chunk_bytes", "chunks"}:
        raise ValueError("plan head must have exactly sha256, size, chunk_bytes, chunks")
    size, cb, chunks = d["size"], d["chunk_bytes"], d["chunks"]
    if not (isinstance(size, int) and isinstance(cb, int) and size > 0 and 0 < cb <= PLAN_VALUE_BYTES):
        raise ValueError(f"plan head: bad size {size!r} or chunk_bytes {cb!r}")
    if not isinstance(chunks, list) or not all(_hex(c) for c in chunks) or not _hex(d["sha256"]):
        raise ValueError("plan head: hashes must be 64 lowercase hex digits")
    if len(chunks) > MAX_PLAN_CHUNKS:
        raise ValueError(f"plan head lists {len(chunks)} chunks, over the limit of {MAX_PLAN_CHUNKS}")
    if len(chunks) != -(-size // cb):
        raise ValueError(f"plan head: {len(chunks)} chunks do not hold {size} bytes in chunks of {cb}")
    return PlanHead(sha256=d["sha256"], size=size, chunk_bytes=cb, chunks=chunks)


async def _decode(body: bytes) -> RoundPlan:
    if len(body) > THREAD_ABOVE_BYTES:
        return await asyncio.to_thread(decode_body, body)
    return decode_body(body)


class PlanReader:
    """Assembles plans from heads read under a plan key; remembers the last ``cache_size`` plans it
    assembled (by leader and head bytes), so the polls of one round fetch and parse each plan once.

    :param dht: has ``async get(key, latest=True) -> {subkey: (value, expiration, owner)}``.
    :param chunk_timeout_s: deadline of each chunk's get, seconds.
    """

    def __init__(self, dht, chunk_timeout_s: float = 5.0, cache_size: int = 16):
        self.dht, self.chunk_timeout_s, self.cache_size = dht, chunk_timeout_s, cache_size
        self._cache: OrderedDict[tuple[str, str], RoundPlan] = OrderedDict()

    async def load(self, plan_key: str, leader: str, value: bytes) -> RoundPlan:
        """The plan of head ``value`` stored under ``plan_key`` by ``leader`` (the record's owner and
        subkey, which the caller has checked). Raises ValueError (pydantic's ValidationError included)
        when the head or the assembled plan is malformed, :class:`PlanPending` when a chunk is missing or
        does not match. Does not check who the plan names as leader (the caller does)."""
        ck = (leader, _sha(value))
        hit = self._cache.get(ck)
        if hit is not None:
            self._cache.move_to_end(ck)
            return hit
        head = parse_head(value)
        body = head.body if head.body is not None else await self._assemble(plan_key, leader, head)
        plan = await _decode(body)
        self._cache[ck] = plan
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return plan

    async def _assemble(self, plan_key: str, leader: str, head: PlanHead) -> bytes:
        parts = await asyncio.gather(*(self._chunk(plan_key, leader, head, i) for i in range(len(head.chunks))))
        body = b"".join(parts)
        if _sha(body) != head.sha256:  # each chunk matched its hash: only a head inconsistent in itself
            raise PlanPending(f"the {len(head.chunks)} chunks do not hash to the head's sha256")
        return body

    async def _chunk(self, plan_key: str, leader: str, head: PlanHead, i: int) -> bytes:
        n = len(head.chunks)
        try:
            found = await asyncio.wait_for(
                self.dht.get(chunk_key(plan_key, head.sha256, i), latest=True), self.chunk_timeout_s
            )
        except asyncio.TimeoutError:
            raise PlanPending(f"chunk {i + 1}/{n} not read within {self.chunk_timeout_s:g}s") from None
        entry = (found or {}).get(leader)
        if entry is None:
            raise PlanPending(f"chunk {i + 1}/{n} not found")
        data, _expiration, owner = entry
        if owner is None or str(owner) != leader:
            raise PlanPending(f"chunk {i + 1}/{n} is not signed by the leader")
        if len(data) != head.chunk_size(i) or _sha(data) != head.chunks[i]:
            raise PlanPending(f"chunk {i + 1}/{n} does not match the head's hash")
        return data
