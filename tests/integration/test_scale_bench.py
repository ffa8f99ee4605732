"""benchmarks/scale_peers.py (issue 25) at small N, in seconds: the sim tier's plan grows with the
participants as the real planner makes it, and the in-process tier counts real DHT calls per method
class on real nodes; the sim tier's model agrees with them on the RPC count."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest

from benchmarks.scale_peers import K, WhatIf, inproc_row, lineage, sim_row, table
from geomesh_p2p.dht.records import DEFAULT_LIMITS

pytestmark = pytest.mark.timeout(120)


def test_sim_tier_plan_grows_per_participant_and_counts_every_message():
    a, b = sim_row(4, reads=3, round_s=8.0), sim_row(8, reads=3, round_s=8.0)
    per_peer = (b["plan_bytes"] - a["plan_bytes"]) / 4
    # an assignment of the real plan: PeerID, address, batch, steps, part bounds, predictions (~300 bytes)
    assert 200 < per_peer < 500
    assert a["plan_fits"] and b["plan_fits"] and b["plan_bytes"] < DEFAULT_LIMITS.max_value_bytes
    assert b["exchange_rpcs"] == 14  # push to and pull from each of the 7 other owners
    # reencode with --group-size auto: one group of 8 (auto groups from 111 peers), the same 14 calls
    assert (b["group_size_auto"], b["exchange_rpcs_auto"]) == (0, 14.0)
    assert 0 < b["exchange_bytes_auto"] < b["exchange_bytes"]  # one re-encoded result per part, not every input
    # session 16 (the default model, as built): 1 store a round on the 7 other nodes (8 replicas), a lookup of 7
    # nodes for 1 store in 4 (cached targets); 3 reads and 1 plan read of a lookup each
    assert b["lookup_rpcs"] == 7 and b["dht_rpcs"] == 1 * (7 / 4 + 7) + 3 * 7 + 7
    # sessions 14-15: 4 announces (8 s / 2 s), each a lookup of 7 nodes + 7 stores
    old = sim_row(8, reads=3, round_s=8.0, model="light", what_if=WhatIf(K, 1.0))
    assert old["dht_rpcs"] == 4 * (7 + 7) + 3 * 7 + 7
    # a Find reply holds every record: 4 more records, each a PeerRecord plus its key, subkey, owner key
    # and signature (and the standing entries grow from 3 to 7 per record)
    assert b["record_bytes"] < (b["find_reply_bytes"] - a["find_reply_bytes"]) / 4 < 1.5 * b["record_bytes"]
    assert b["dht_bytes"] > 2 * a["dht_bytes"]  # O(N) replies, more of them: superlinear (issue 25)


async def test_inproc_tier_counts_real_dht_calls_and_matches_the_models_rpcs():
    # 4 rounds: one cycle of cached store targets (the warm-up's lookup, 3 stores without, then a lookup)
    row = await inproc_row(6, rounds=4, reads=2, round_s=4.0, timeout_s=10.0)
    assert row["records_seen_min"] == 6  # every read saw every peer's record
    assert row["plan_reads_ok"] == row["plan_reads"] == 4 * 6
    assert row["dht_rpcs"] > 0 and row["busiest_served"] >= row["median_served"] > 0
    # one lookup per peer in 4 rounds, and the leader's plan store each round (a key of its own each round)
    assert row["store_lookups"] == (6 + 4) / 6 / 4
    # 6 nodes <= k: every node holds the key and serves every other peer's lookups (1 in 4), stores and reads
    assert row["busiest_served"] == pytest.approx((6 - 1) * (1 / 4 + 1 + 2 + 1), abs=2)
    model = await asyncio.to_thread(sim_row, 6, 2, 4.0)
    # the model's calls per peer per round: 1 store x (5 / 4 + 5) + 2 reads x 5 + 1 plan read x 5 = 21.25
    assert model["dht_rpcs"] == 21.25
    assert row["dht_rpcs"] == pytest.approx(model["dht_rpcs"], rel=0.15)
    assert row["dht_bytes"] == pytest.approx(model["dht_bytes"], rel=0.35)
    assert model["busiest_served"] == (6 - 1) * (1 / 4 + 1 + 2 + 1)
    assert "| inproc | 6 |" in table([row])


#: the model tier's swarm here: 256 peers, 4 lookup hops (1,024 until session 48: 6 hops; 512 until session 50: 5 hops,
#: 12.9 CPU-s a plan against 3.3 here; the same formula: the sim's cost grows faster than its size)
SIM_N = 256


@pytest.mark.timeout(300)  # two SIM_N-peer plans (~3 s of CPU each, ~20 s on loaded cores)
async def test_light_followers_cached_read_holders_cut_their_calls_in_both_tiers():
    """Session 22: a light follower's sampled reads ask the holders their last lookup found (``read_target_reuse``
    8; 32 since session 26) instead of looking the key up each time. In-process (12 nodes, 4 full-view, 2 rounds):
    the same reads find every record asked with fewer DHT calls than with a lookup every read (``read_reuse`` 1), and
    the nodes count reused reads. In the model at SIM_N peers: a sampled read costs (h + Qs + alpha - 1) / 32 + 31/32 x
    Qs calls."""
    rows = {}
    for reuse in (1, 8):
        rows[reuse] = await inproc_row(
            12, rounds=2, reads=1, round_s=4.0, timeout_s=10.0, full_view=4, read_reuse=reuse
        )
        assert rows[reuse]["sampled_reads_complete"] == "32/32"  # 8 light followers x 2 checks x 2 rounds
    assert rows[1]["read_reuses"] == 0 and rows[8]["read_reuses"] > 0
    assert rows[8]["dht_rpcs"] < rows[1]["dht_rpcs"]
    a, b = (
        await asyncio.to_thread(sim_row, SIM_N, 3, 8.0, what_if=WhatIf(read_reuse=1)),
        await asyncio.to_thread(sim_row, SIM_N, 3, 8.0, what_if=WhatIf(read_reuse=32)),
    )
    hops = math.ceil(math.log2(SIM_N / 20))  # L = 20 + ceil(log2(N / 20)): h = L - 20
    looked = hops + 2 + 3 - 1  # the quorum 2 + alpha - 1 more
    saved = 2 * (looked - (looked / 32 + 31 / 32 * 2))
    assert a["lookup_rpcs"] == 20 + hops and a["dht_rpcs_light_peer"] - b["dht_rpcs_light_peer"] == pytest.approx(saved)
    assert hops == 4 and "R=1" in table([a]) and "R=" not in table([b])


def test_sim_models_cached_full_reads_and_stable_plan_chunks():
    """Session 26, at 64 peers with S = 4 (L = 20 + 2 = 22: 2 hops; a plan of 64 is one chunk): a full read of a key
    costs (h + Q + alpha - 1) / 8 + 7/8 x Q calls (F = 8), and the plan's chunk (h + alpha) / 32 + 31/32 calls
    (stable parts, R = 32) where it was h + 1."""
    base = WhatIf(record_shards=4, read_reuse=32)
    a = sim_row(64, 3, 8.0, what_if=base)
    b = sim_row(64, 3, 8.0, what_if=WhatIf(record_shards=4, read_reuse=32, full_read_reuse=8, stable_parts=True))
    assert a["lookup_rpcs"] == 22 and a["plan_chunks"] == 1
    read, cached = 2 + 5 + 2, 5
    full_saved = 3 * 4 * (read - (read / 8 + 7 / 8 * cached))
    chunk_saved = (2 + 1) - ((2 + 3) / 32 + 31 / 32)
    assert a["dht_rpcs_light_peer"] - b["dht_rpcs_light_peer"] == pytest.approx(chunk_saved)
    assert a["dht_rpcs"] - b["dht_rpcs"] == pytest.approx(8 / 64 * full_saved + chunk_saved)
    assert "F=8 stable-parts" in table([b])


def test_the_proc_tiers_lineage_tells_rows_behind_from_rows_apart():
    """Session 28's three 32-process runs: a row on an earlier round's majority digest is behind (its round applied
    nothing), a row on any other digest is apart (a state off the line)."""
    votes = {
        0: Counter({"a": 32}),
        1: Counter({"b": 29, "a": 3}),  # 3 applied nothing of round 1: behind
        2: Counter({"c": 31, "x": 1}),  # one applied a subset of round 2's parts: apart
        3: Counter({"d": 30, "b": 1, "c": 1}),  # b: two rounds behind
    }
    assert lineage(votes) == (5, 1)
    assert lineage({0: Counter({"a": 8}), 1: Counter({"b": 8})}) == (0, 0)
