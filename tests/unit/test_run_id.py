"""The run id's rule (geomesh_p2p/schema/run_id.py) against every DHT key the project builds from a run id: at
the longest run id it takes, with the longest numbers (int64) and PeerIDs (44 characters), every key fits a node's
limit and the longest one fills it exactly, so one byte more would be refused (red team, session 28: a 600-character
run id passed both CLIs and the peer never announced)."""

from __future__ import annotations

import time

import pytest

from geomesh_p2p.dht.announce import peers_key
from geomesh_p2p.dht.chunked import chunk_key, stable_chunk_key
from geomesh_p2p.dht.progress import progress_key
from geomesh_p2p.dht.records import DEFAULT_LIMITS, OWNER_MARK, make_record, verify_record
from geomesh_p2p.net.identity import Identity, PeerID
from geomesh_p2p.plan.agree import plan_key
from geomesh_p2p.schema.run_id import MAX_KEY_BYTES, MAX_RUN_ID_BYTES, PEER_ID_CHARS, check_run_id
from geomesh_p2p.schema.shards import MAX_RECORD_SHARDS, records_key
from geomesh_p2p.status.swarm import rounds_key
from geomesh_p2p.trust.evidence import contributions_key, evidence_key, screen_evidence_key
from geomesh_p2p.trust.fraud import proofs_key

pytestmark = pytest.mark.timeout(60)

BIG = 2**63 - 1  # the largest round, slot, shard or chunk index a key holds


def _keys(run: str, pid: str) -> list[str]:
    """Every key built from ``run``, with the longest numbers and ``pid`` as each PeerID."""
    heads = [plan_key(run, BIG), proofs_key(run, BIG), evidence_key(run, BIG), screen_evidence_key(run, BIG, pid)]
    keys = [peers_key(run), records_key(run), records_key(run, MAX_RECORD_SHARDS - 1, MAX_RECORD_SHARDS)]
    keys += [progress_key(run), rounds_key(run), *heads]
    keys += [contributions_key(run, BIG, pid, BIG), contributions_key(run, BIG, pid, BIG, screen_of=pid)]
    for head in heads:  # the chunked values: their chunks (the stable layout: under a key ending in a round)
        keys += [chunk_key(head, "f" * 64, BIG)] + ([stable_chunk_key(head, BIG)] if head[-1].isdigit() else [])
    return keys


def test_every_key_of_the_longest_run_id_fits_and_the_longest_fills_the_limit():
    assert MAX_KEY_BYTES == DEFAULT_LIMITS.max_key_bytes == 512
    longest = PeerID(b"\xff" * 32).to_string()
    assert len(longest) == PEER_ID_CHARS == 44  # the longest base58 of 32 bytes
    run = check_run_id("r" * MAX_RUN_ID_BYTES)
    sizes = [len(k.encode()) for k in _keys(run, longest)]
    assert max(sizes) == MAX_KEY_BYTES  # the bound is the builders' own, not a guess with slack
    with pytest.raises(ValueError, match="^is 347 bytes long, over the maximum of 346 bytes"):
        check_run_id("r" * (MAX_RUN_ID_BYTES + 1))


def test_a_node_stores_the_longest_key_of_the_longest_run_id():
    """The longest key (a screening evidence's contributions, owned by the verifier) passes a node's checks."""
    me = Identity.generate()
    run = "r" * MAX_RUN_ID_BYTES
    key = contributions_key(run, BIG, me.peer_id.to_string(), BIG, screen_of=PeerID(b"\xff" * 32).to_string())
    assert OWNER_MARK in key and len(key.encode()) <= MAX_KEY_BYTES
    now = time.time()
    rec = make_record(key, b"v", now + 60, subkey="0", owner=me, run_id=run)
    assert verify_record(rec, run_id=run, now=now).owner == me.peer_id


@pytest.mark.parametrize(
    "run_id, why",
    [
        ("", "must not be empty"),
        ("  ", "must not be empty"),
        ("x/owner:y", "must not contain '/owner:' (it marks the owner of a DHT key)"),
        ("x\udc80", "is not UTF-8 text (character 2 is an undecodable byte)"),
    ],
)
def test_run_ids_refused_whatever_their_length(run_id, why):
    with pytest.raises(ValueError) as e:
        check_run_id(run_id)
    assert str(e.value) == why


def test_run_ids_taken():
    for run_id in ("geomesh-demo", "my run/2", "é" * (MAX_RUN_ID_BYTES // 2), "x/owner"):
        assert check_run_id(run_id) == run_id
