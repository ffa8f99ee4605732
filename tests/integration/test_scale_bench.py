"""benchmarks/scale_peers.py (issue 25) at small N, in seconds: the sim tier's plan grows with the
participants as the real planner makes it, and the in-process tier counts real DHT calls per method
class on real nodes; the sim tier's model agrees with them on the RPC count."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.scale_peers import inproc_row, sim_row, table
from geomesh_p2p.dht.records import DEFAULT_LIMITS

pytestmark = pytest.mark.timeout(120)


def test_sim_tier_plan_grows_per_participant_and_counts_every_message():
    a, b = sim_row(4, reads=3, round_s=8.0), sim_row(8, reads=3, round_s=8.0)
    per_peer = (b["plan_bytes"] - a["plan_bytes"]) / 4
    # an assignment of the real plan: PeerID, address, batch, steps, part bounds, predictions (~300 bytes)
    assert 200 < per_peer < 500
    assert a["plan_fits"] and b["plan_fits"] and b["plan_bytes"] < DEFAULT_LIMITS.max_value_bytes
    assert b["exchange_rpcs"] == 14  # push to and pull from each of the 7 other owners
    # 4 announces (8 s / 2 s) of a lookup of 7 nodes + 7 stores, 3 reads and 1 plan read of a lookup each
    assert b["lookup_rpcs"] == 7 and b["dht_rpcs"] == 4 * (7 + 7) + 3 * 7 + 7
    # a Find reply holds every record: 4 more records, each a PeerRecord plus its key, subkey, owner key
    # and signature (and the standing entries grow from 3 to 7 per record)
    assert b["record_bytes"] < (b["find_reply_bytes"] - a["find_reply_bytes"]) / 4 < 1.5 * b["record_bytes"]
    assert b["dht_bytes"] > 2 * a["dht_bytes"]  # O(N) replies, more of them: superlinear (issue 25)


async def test_inproc_tier_counts_real_dht_calls_and_matches_the_models_rpcs():
    row = await inproc_row(6, rounds=1, reads=2, round_s=4.0, timeout_s=10.0)
    assert row["records_seen_min"] == 6  # every read saw every peer's record
    assert row["plan_reads_ok"] == row["plan_reads"] == 6
    assert row["dht_rpcs"] > 0 and row["busiest_served"] >= row["median_served"] > 0
    # 6 nodes <= k: every node holds the key and serves every other peer's lookups and stores of it
    assert row["busiest_served"] == pytest.approx((6 - 1) * (2 * 2 + 2 + 1), abs=2)
    model = await asyncio.to_thread(sim_row, 6, 2, 4.0)
    # the model's calls per peer per round: 2 announces x (5 + 5) + 2 reads x 5 + 1 plan read x 5 = 35
    assert model["dht_rpcs"] == 35
    assert row["dht_rpcs"] == pytest.approx(model["dht_rpcs"], rel=0.15)
    assert row["dht_bytes"] == pytest.approx(model["dht_bytes"], rel=0.35)
    assert model["busiest_served"] == (6 - 1) * (2 * 2 + 2 + 1)
    assert "| inproc | 6 |" in table([row])
