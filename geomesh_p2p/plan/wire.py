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

The head + chunks framing, the checks, the reasons and the reader's cache are
:mod:`geomesh_p2p.dht.chunked` (shared with the verified-work evidence); this module is the plan's
format (magic ``gmplan/2``, its limits) and its body (columnar JSON, zlib).

Units: bytes; hashes are lowercase hex SHA-256.
"""

from __future__ import annotations

import json
import zlib
from typing import Optional

from geomesh_p2p.dht import chunked
from geomesh_p2p.dht.chunked import ChunkedValue, ChunkFormat, ChunksPending, Head
from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan
from geomesh_p2p.util.untrusted import json_loads

#: Version of the plan's wire form (1: the plan's JSON as one value; 2: this module's head + chunks).
PLAN_WIRE_VERSION = 2
_MAGIC = b"gmplan/2"

#: Largest value this module stores: well under the DHT's 64 KiB (``RecordLimits.max_value_bytes``),
#: room left for the record's framing (``dht.chunked.VALUE_BYTES``). Bytes.
PLAN_VALUE_BYTES = chunked.VALUE_BYTES
#: Largest plan body stored inline (bytes; about 40 peers): a follower reads the plan's value from a quorum of
#: holders (up to 7 answers), so a larger body goes in chunks, each read from one holder, and the quorum answers
#: carry the head's hashes only. At 256 peers the inline 17 KB value cost a follower 389 KB a round; chunked, ~40
#: KB (docs/scale.md, session 18). Readers accept both forms at any size (a patch-level change).
PLAN_INLINE_BYTES = 4096
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

#: A head was read but its plan cannot be assembled yet (a chunk missing, unreadable in time, not signed
#: by the leader, or not matching the head's hashes). ``str(e)`` is the one-line reason.
PlanPending = ChunksPending
#: A plan ready to store: ``head``, ``chunks`` (empty when inline), ``sha256`` (hex of the body), ``body_bytes``.
PlanWire = ChunkedValue
#: A parsed head: ``body`` when the plan is inline, else the hashes and sizes of its chunks.
PlanHead = Head
chunk_key = chunked.chunk_key


def plan_format(value_bytes: int = PLAN_VALUE_BYTES) -> ChunkFormat:
    """The plan's framing (read at call time, so the limits above can be changed in tests)."""
    return ChunkFormat(
        magic=_MAGIC,
        what="plan",
        owner_role="leader",
        version=PLAN_WIRE_VERSION,
        value_bytes=value_bytes,
        inline_bytes=PLAN_INLINE_BYTES,
        max_chunks=MAX_PLAN_CHUNKS,
    )


def encode_body(plan: RoundPlan) -> bytes:
    """The plan's compact body: columnar JSON, zlib level 9. Deterministic for equal plans."""
    d = plan.model_dump(mode="json")
    for k in ("undo", "accused"):  # exact undo's list (RunConfig.undo_forged), the accused: absent while empty
        if not d.get(k):
            d.pop(k, None)
    rows = d.pop("assignments")
    d["assignments"] = {k: [r[k] for r in rows] for k in _FIELDS}
    return zlib.compress(json.dumps(d, separators=(",", ":"), allow_nan=False).encode(), 9)


def decode_body(body: bytes) -> RoundPlan:
    """Parse a body made by :func:`encode_body`. Raises ValueError (``zlib.error``'s message, a body over
    ``MAX_PLAN_JSON_BYTES`` once decompressed, columns that are no lists of one length) or
    pydantic.ValidationError (a ValueError) when the plan is not valid."""
    text = chunked.decompress_capped(body, MAX_PLAN_JSON_BYTES, "plan")
    d = json_loads(text, "plan body")
    cols = d.get("assignments") if isinstance(d, dict) else None
    if not isinstance(cols, dict) or not cols or not all(isinstance(v, list) for v in cols.values()):
        raise ValueError("plan body: assignments must be a non-empty mapping of field -> list")
    n = {len(v) for v in cols.values()}
    if len(n) != 1:
        raise ValueError(f"plan body: assignment columns of different lengths {sorted(n)}")
    names = list(cols)
    d["assignments"] = [dict(zip(names, row)) for row in zip(*cols.values())]
    return RoundPlan.model_validate(d)


def split_plan(plan: RoundPlan, value_bytes: int = PLAN_VALUE_BYTES, stable: bool = False) -> PlanWire:
    """Encode ``plan`` into a head and chunks of at most ``value_bytes`` each (see the module doc); ``stable``:
    chunks under the keys of :func:`geomesh_p2p.dht.chunked.stable_chunk_key` too (a run with record shards S > 1).
    Raises ValueError when it needs more than ``MAX_PLAN_CHUNKS`` chunks. CPU: ~20 ms at 1,024 peers."""
    return chunked.split(encode_body(plan), plan_format(value_bytes), stable=stable)


def parse_head(value: bytes) -> PlanHead:
    """Parse a head value. Raises ValueError with the reason (not a version-2 plan, a head whose sizes,
    hashes or chunk count do not fit together, or more than ``MAX_PLAN_CHUNKS`` chunks)."""
    return chunked.parse_head(value, plan_format())


class PlanReader(chunked.ChunkedReader[RoundPlan]):
    """Assembles plans from heads read under a plan key; remembers the last ``cache_size`` plans it
    assembled (by leader and head bytes), so the polls of one round fetch and parse each plan once.

    ``load(plan_key, leader, value) -> RoundPlan``: the plan of head ``value`` stored under ``plan_key``
    by ``leader`` (the record's owner and subkey, which the caller has checked). Raises ValueError
    (pydantic's ValidationError included) when the head or the assembled plan is malformed,
    :class:`PlanPending` when a chunk is missing or does not match. Does not check who the plan names as
    leader (the caller does).

    :param dht: has ``async get(key, latest=True, subkeys=None) -> {subkey: (value, expiration, owner)}``.
    :param chunk_timeout_s: deadline of each chunk's get, seconds.
    """

    def __init__(self, dht, chunk_timeout_s: float = 5.0, cache_size: int = 16, fmt: Optional[ChunkFormat] = None):
        super().__init__(
            dht,
            fmt or plan_format(),
            decode_body,
            chunk_timeout_s=chunk_timeout_s,
            cache_size=cache_size,
            thread_above_bytes=THREAD_ABOVE_BYTES,
        )
