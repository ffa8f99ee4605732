"""The run id's rule: every DHT key the project builds from it must be a key a node stores.

A node refuses a record whose key is over :data:`MAX_KEY_BYTES` (UTF-8) or, for a key that says ``/owner:``, does
not name a PeerID after its last ``/owner:`` (:class:`geomesh_p2p.dht.records.RecordLimits`,
:func:`~geomesh_p2p.dht.records.required_owner`). A run id too long for its keys was accepted by both CLIs, and
the peer then never announced ("key of 606 bytes is over the limit of 512", red team, session 28).
:func:`check_run_id` refuses such a run id at parse time; both CLIs' ``--run-id`` flags and the config models
use it.

The longest key built from a run id ``R`` (tests/unit/test_run_id.py builds every one with the real builders) is a
screening evidence's contributions key (:func:`geomesh_p2p.trust.evidence.contributions_key`)::

    R/evidence/<round>/screen/<PeerID>/contributions/<shard>/owner:<PeerID>

with each number at most :data:`MAX_NUMBER_DIGITS` digits (any int64) and each PeerID at most
:data:`PEER_ID_CHARS` characters. Pure data: imports no other layer.
"""

from __future__ import annotations

__all__ = ["MAX_KEY_BYTES", "MAX_RUN_ID_BYTES", "OWNER_MARK", "check_run_id", "longest_key_suffix"]

#: Longest DHT key (UTF-8 bytes) a node stores (``RecordLimits.max_key_bytes``).
MAX_KEY_BYTES = 512
#: What makes a key owned by the PeerID after it (``geomesh_p2p.dht.records``).
OWNER_MARK = "/owner:"
#: Most characters of a base58 PeerID (32 bytes: 43 or 44 characters).
PEER_ID_CHARS = 44
#: Most digits of a number in a key (a round, a shard, a chunk index): 2**63 - 1 has 19.
MAX_NUMBER_DIGITS = 19


def longest_key_suffix() -> str:
    """The longest text any key builder appends to the run id, with placeholders of the longest lengths (each
    number ``9`` x :data:`MAX_NUMBER_DIGITS`, each PeerID ``P`` x :data:`PEER_ID_CHARS`)."""
    n, pid = "9" * MAX_NUMBER_DIGITS, "P" * PEER_ID_CHARS
    return f"/evidence/{n}/screen/{pid}/contributions/{n}{OWNER_MARK}{pid}"


#: Longest run id (UTF-8 bytes) whose every key fits :data:`MAX_KEY_BYTES`: 346.
MAX_RUN_ID_BYTES = MAX_KEY_BYTES - len(longest_key_suffix())


def check_run_id(run_id: str) -> str:
    """``run_id`` when every DHT key built from it is one a node stores; raises ValueError (one line, without the
    flag's name) when it is empty or blank, not UTF-8 text (a byte argv could not decode), over
    :data:`MAX_RUN_ID_BYTES` bytes of UTF-8, or holds ``/owner:`` (every key of the run would then name an owner,
    and a node refuses a key whose owner is not a PeerID)."""
    if not run_id.strip():
        raise ValueError("must not be empty")
    try:
        size = len(run_id.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"is not UTF-8 text (character {e.start + 1} is an undecodable byte)") from None
    if size > MAX_RUN_ID_BYTES:
        raise ValueError(
            f"is {size} bytes long, over the maximum of {MAX_RUN_ID_BYTES} bytes (UTF-8): the run's longest DHT key "
            f"must fit {MAX_KEY_BYTES} bytes"
        )
    if OWNER_MARK in run_id:
        raise ValueError(f"must not contain {OWNER_MARK!r} (it marks the owner of a DHT key)")
    return run_id
