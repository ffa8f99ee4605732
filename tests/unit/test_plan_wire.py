"""The plan's wire form (issue 25): the compact body round-trips exactly at 4 to 4,096 participants, a
plan too big for one DHT value goes in chunks the head lists by hash, and a reader refuses a missing,
forged or corrupted chunk with a reason (the plan is then not valid yet) and retries on the next read.
The DHT here is an in-memory stand-in with the store/get contract (owner = signer) that counts calls;
tests/integration/test_plan_chunks.py runs a 1,024-peer plan over real DHT nodes."""

from __future__ import annotations

import json
import logging
import time
import zlib

import pytest

from geomesh_p2p.dht.progress import SwarmProgress
from geomesh_p2p.dht.state import DHTValue
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanStore, plan_key
from geomesh_p2p.plan.wire import (
    MAX_PLAN_CHUNKS,
    MAX_PLAN_JSON_BYTES,
    PLAN_VALUE_BYTES,
    chunk_key,
    decode_body,
    parse_head,
    split_plan,
)
from geomesh_p2p.status.swarm import SwarmWatcher
from geomesh_p2p.telemetry import events
from geomesh_p2p.util.untrusted import json_loads
from tests.plan_util import big_plan

pytestmark = pytest.mark.timeout(60)
RUN = "wire-test"


class CountingDHT:
    """key -> subkey -> (value, expiration, owner PeerID); counts stores and gets."""

    def __init__(self):
        self.data: dict = {}
        self.stores = 0
        self.gets = 0

    async def store(self, key, value, expiration_time, subkey=None, owner=None):
        self.stores += 1
        self.data.setdefault(key, {})[subkey] = (value, expiration_time, owner.peer_id if owner else None)
        return True

    async def get(self, key, latest=True, subkeys=None, quorum=None):
        self.gets += 1
        return {sk: DHTValue(*v) for sk, v in self.data.get(key, {}).items()}  # as DHTNode.get


def _body(wire) -> bytes:
    return b"".join(wire.chunks) if wire.chunks else wire.head[len(b"gmplan/2I") :]


# 200 peers: a 17.6 KB body, one value until session 18; now one chunk (PLAN_INLINE_BYTES: a quorum read of the
# head carries its hashes only)
@pytest.mark.parametrize("n, chunks", [(4, 0), (200, 1), (1024, 2), (4096, 6)])
def test_encoding_round_trips_exactly_and_every_value_fits(n, chunks):
    plan = big_plan(n, seed=n)
    wire = split_plan(plan)
    assert len(wire.chunks) == chunks
    assert all(len(v) <= PLAN_VALUE_BYTES for v in [wire.head, *wire.chunks])
    back = decode_body(_body(wire))
    assert back == plan and back.to_bytes() == plan.to_bytes()
    head = parse_head(wire.head)
    if chunks:
        assert head.body is None and head.size == wire.body_bytes and len(head.chunks) == chunks
        assert len(wire.head) < 1000  # the head lists hashes only
    else:
        assert head.body == _body(wire)
    # compact: version 1's JSON 1.8 KB -> 0.74 KB at 4 peers, 70 KB -> 17.6 KB at 200, 359 KB -> 81 KB at 1,024
    assert wire.body_bytes < len(plan.to_bytes()) * (0.5 if n < 100 else 0.26)
    assert split_plan(plan).head == wire.head  # deterministic


def test_malformed_heads_and_bodies_are_refused_with_a_reason():
    plan = big_plan(1024)
    wire = split_plan(plan)
    with pytest.raises(ValueError, match="not a plan of wire version 2"):
        parse_head(plan.to_bytes())  # version 1: the JSON as it is
    head = json.loads(wire.head[9:])
    for change, reason in [
        ({"chunks": head["chunks"][:1]}, "do not hold"),
        ({"chunks": head["chunks"] * 40, "size": 80 * head["chunk_bytes"]}, "over the limit"),
        ({"sha256": "x" * 64}, "64 lowercase hex"),
        ({"chunk_bytes": 70_000}, "bad size"),
        ({"size": None}, "bad size"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_head(b"gmplan/2H" + json.dumps({**head, **change}).encode())
    missing = {k: v for k, v in head.items() if k != "chunks"}
    with pytest.raises(ValueError, match="must have sha256, size, chunk_bytes, chunks"):
        parse_head(b"gmplan/2H" + json.dumps(missing).encode())
    # a key of a newer patch is ignored (docs/compat.md, issue 29 #4); before, "exactly" these four
    assert parse_head(b"gmplan/2H" + json.dumps({**head, "extra": 1}).encode()) == parse_head(wire.head)
    assert MAX_PLAN_CHUNKS == 64
    with pytest.raises(ValueError, match="decompresses to more than"):
        decode_body(zlib.compress(b" " * (MAX_PLAN_JSON_BYTES + 10)))  # a zlib bomb: 16 KB -> 16 MiB
    with pytest.raises(ValueError, match="truncated"):
        decode_body(_body(wire)[:-5])
    cols = json.loads(zlib.decompress(_body(split_plan(big_plan(4)))))
    cols["assignments"]["peer_id"].pop()
    with pytest.raises(ValueError, match="different lengths"):
        decode_body(zlib.compress(json.dumps(cols).encode()))


async def test_small_plan_is_one_store_and_one_get_a_big_one_head_plus_chunks_read_once():
    leader = Identity.generate()
    dht = CountingDHT()
    small = big_plan(16, run_id=RUN, leader=str(leader.peer_id))
    store = PlanStore(dht, leader, RUN)
    assert await store.publish(small)
    assert (dht.stores, await store.read(3), dht.gets) == (1, [small], 1)
    big = big_plan(1024, run_id=RUN, round=4, leader=str(leader.peer_id))
    assert await PlanStore(dht, leader, RUN).publish(big)
    assert dht.stores == 1 + 3  # 2 chunks, then the head
    reader = PlanStore(dht, Identity.generate(), RUN)
    dht.gets = 0
    assert await reader.read(4) == [big]
    assert dht.gets == 3  # head + 2 chunks (in parallel)
    assert await reader.read(4) == [big]
    assert dht.gets == 4  # the next poll: the head only (same head bytes: the plan is remembered)


async def _published(n: int = 1024):
    leader = Identity.generate()
    dht = CountingDHT()
    plan = big_plan(n, run_id=RUN, round=5, leader=str(leader.peer_id))
    assert await PlanStore(dht, leader, RUN).publish(plan)
    wire = split_plan(plan)
    return dht, leader, plan, chunk_key(plan_key(RUN, 5), wire.sha256, 1)


async def test_missing_chunk_means_no_plan_yet_and_the_next_read_finds_it(caplog):
    dht, leader, plan, k1 = await _published()
    saved = dht.data.pop(k1)
    reader = PlanStore(dht, Identity.generate(), RUN)
    seen: set = set()
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.plan.agree"):
        assert await reader.read(5, seen=seen) == []
        assert await reader.read(5) == []
    assert seen == set()  # not a plan yet: not counted as a leader's signed plan
    lines = [r for r in caplog.records if "not usable yet" in r.getMessage()]
    assert len(lines) == 1 and "chunk 2/2 not found" in lines[0].getMessage()  # once, with the reason
    assert lines[0].levelno == logging.INFO and lines[0].exc_info is None
    dht.data[k1] = saved
    assert await reader.read(5) == [plan]


async def test_forged_or_corrupted_chunk_is_refused_with_a_reason(caplog):
    dht, leader, plan, k1 = await _published()
    value, exp, _owner = dht.data[k1][str(leader.peer_id)]
    forger = Identity.generate()
    reader = PlanStore(dht, Identity.generate(), RUN)
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.plan.agree"):
        # the right bytes, signed by another identity (a real DHT node refuses this store already)
        dht.data[k1][str(leader.peer_id)] = (value, exp, forger.peer_id)
        assert await reader.read(5) == []
        # the leader's signature, other bytes (one flipped)
        dht.data[k1][str(leader.peer_id)] = (value[:-1] + bytes([value[-1] ^ 1]), exp, leader.peer_id)
        assert await reader.read(5) == []
    msgs = [r.getMessage() for r in caplog.records if "not usable yet" in r.getMessage()]
    assert any("chunk 2/2 is not signed by the leader" in m for m in msgs)
    assert any("chunk 2/2 does not match the head's hash" in m for m in msgs)
    # a head that another identity stored under the leader's subkey is refused before any chunk is read
    head = dht.data[plan_key(RUN, 5)][str(leader.peer_id)]
    dht.data[plan_key(RUN, 5)][str(leader.peer_id)] = (head[0], head[1], forger.peer_id)
    dht.gets = 0
    assert await PlanStore(dht, Identity.generate(), RUN).read(5) == [] and dht.gets == 1


async def test_refusal_and_stale_rules_hold_for_a_chunked_plan():
    dht, leader, plan, _k1 = await _published()
    reader = PlanStore(dht, Identity.generate(), RUN)
    with events.capture("plan_refused") as refused:
        assert await reader.read(5, accept=lambda p: "rogue leader") == []
        assert await reader.read(5, accept=lambda p: "rogue leader") == []
    assert [(e["leader"], e["reason"]) for e in refused] == [(str(leader.peer_id), "rogue leader")]
    stale = PlanStore(dht, Identity.generate(), RUN, stale_after_s=-(plan.exchange_deadline - time.time()) - 1)
    assert await stale.read(5) == []  # its exchange deadline + stale_after_s has passed
    assert await reader.read(6) == []  # another round's key: nothing


async def test_the_status_page_reads_a_chunked_plan_of_a_known_leader_only():
    dht, leader, plan, _k1 = await _published()
    watcher = SwarmWatcher(dht, RUN)
    assert await watcher._plan(5, {str(leader.peer_id)}) == plan
    assert await watcher._plan(5, set()) is None  # a leader that is no admitted peer: not shown


async def test_a_plan_over_the_chunk_limit_is_not_published_and_does_not_raise(monkeypatch):
    leader = Identity.generate()
    dht = CountingDHT()
    monkeypatch.setattr("geomesh_p2p.plan.wire.MAX_PLAN_CHUNKS", 1)  # 1,024 peers need 2
    assert not await PlanStore(dht, leader, RUN).publish(big_plan(1024, run_id=RUN, leader=str(leader.peer_id)))
    assert dht.stores == 0


DEEP = b"[" * 100_000  # nested past the JSON parser's recursion limit: RecursionError, not ValueError, before


def test_json_nested_too_deeply_is_a_malformed_value_not_a_crash():
    """Review (session 10): ``json.loads`` of ``[[[[...`` raises RecursionError, which the parsers' ``except
    ValueError`` let through: one signed plan of 227 bytes (zlib) stopped every peer that read it. Every parser
    of a peer's JSON refuses it as malformed (ValueError), as a plan, a chunked head, evidence or progress."""

    with pytest.raises(ValueError, match="plan body is no JSON: nested too deeply"):
        decode_body(zlib.compress(DEEP))
    with pytest.raises(ValueError, match="plan head is no JSON: nested too deeply"):
        parse_head(b"gmplan/2H" + DEEP[:60_000])
    with pytest.raises(ValueError, match="swarm progress record is no JSON: nested too deeply"):
        SwarmProgress.from_bytes(DEEP)
    with pytest.raises(ValueError, match="x is no JSON: Exceeds the limit"):
        json_loads(b"[" + b"9" * 5000 + b"]", "x")  # Python's int digit limit: a ValueError, named
    with pytest.raises(ValueError, match="x is no JSON: .*utf-8"):
        json_loads(b"\x80abc", "x")
    assert json_loads(b'{"a": [1]}', "x") == {"a": [1]}


async def test_plans_under_subkeys_of_unknown_peers_are_left_unread(caplog):
    """Review (session 10): any identity can store a plan head under its own subkey, naming up to 64 chunks;
    a follower fetched every one (50 throwaway identities: 3,201 lookups, 11-13 s per read). With ``leaders``
    only the heads of those peers are parsed and their chunks fetched: one get (the key) for 20 foreign
    64-chunk heads, and the known leader's plan still read."""
    dht = CountingDHT()
    leader = Identity.generate()
    plan = big_plan(1024, run_id=RUN, round=5, leader=str(leader.peer_id))
    assert await PlanStore(dht, leader, RUN).publish(plan)
    head = json.loads(split_plan(plan).head[9:])
    foreign = {**head, "chunks": ["ab" * 32] * 64, "size": 64 * head["chunk_bytes"]}
    for _ in range(20):
        sybil = Identity.generate()
        dht.data[plan_key(RUN, 5)][str(sybil.peer_id)] = (b"gmplan/2H" + json.dumps(foreign).encode(), 0, sybil.peer_id)
    reader = PlanStore(dht, Identity.generate(), RUN)
    dht.gets = 0
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.plan.agree"):
        assert await reader.read(5, leaders={str(leader.peer_id)}) == [plan]
    assert dht.gets == 1 + 2  # the key, then the leader's 2 chunks; none of the 20 x 64 foreign chunks
    assert "round 5: 20 plan(s) under the subkeys of no known peer left unread" in caplog.text
    dht.gets = 0
    assert await reader.read(5) == [plan]  # without leaders (the status page, tests): every head is tried
    assert dht.gets == 1 + 20 * 64
