"""Light followers in a swarm of peer processes (issue 25, docs/round.md "Light followers").

Five tiny-model peers, ``--full-view-peers 1 --light-sample 2``: from round 1 on, the peer ranked first to
lead each round reads every record and the four others follow the signed plan, checking it and their digest
against two records each. What must hold: every round ends on one digest, light rounds happen, and a light
round's DHT traffic is smaller than a full one's (it reads 2 records where a full read returns 5, and it
skips the gather's and the plan check's reads).

The run spreads its records over two shard keys (``--record-shards 2``, issue 25): every full read asks both, a
light follower's sample one shard at a time; a peer announcing under a key the others do not read would never be
planned, so the digests and light rounds below also check that layout end to end.
"""

from __future__ import annotations

import statistics

import pytest

from geomesh_p2p.config.method import AUTO_ACCOUNTABLE_FROM

pytestmark = pytest.mark.timeout(240)

N = 5
ROUNDS = 4


def _dht_received(row: dict) -> int:
    return int(row["extra"]["traffic"].get("dht", {}).get("received", 0))


def test_light_followers_keep_one_digest_and_read_less_of_the_dht(swarm):
    names = [f"l{i}" for i in range(N)]
    swarm.start_peers(
        names,
        "--min-peers",
        str(N),
        "--rounds",
        str(ROUNDS),
        "--full-view-peers",
        "1",
        "--light-sample",
        "2",
        "--record-shards",
        "2",
    )
    codes = swarm.wait_exit(names, 200)
    rows = {n: swarm.rows(n) for n in names}
    assert codes == {n: 0 for n in names}, {n: swarm.text(n)[-2000:] for n, c in codes.items() if c != 0}
    digests: dict[int, set] = {}
    for n in names:
        for x in rows[n]:
            digests.setdefault(x["round"], set()).add(x["digest"])
    assert max(digests) == ROUNDS - 1, sorted(digests)
    assert all(len(d) == 1 for d in digests.values()), {r: sorted(d) for r, d in digests.items()}
    light = [x for n in names for x in rows[n] if x.get("extra", {}).get("light")]
    full = [x for n in names for x in rows[n][1:] if not x.get("extra", {}).get("light")]
    # round 0 follows no plan yet; rounds 1-3 have up to 4 light followers each (fewer when one fell back)
    assert 0 not in {x["round"] for x in light}
    assert len(light) >= ROUNDS - 1, [
        (n, [(x["round"], bool(x["extra"].get("light"))) for x in rows[n]]) for n in names
    ]
    assert full, "no full-view row after round 0"
    assert statistics.median(map(_dht_received, light)) < statistics.median(map(_dht_received, full)), (
        sorted(map(_dht_received, light)),
        sorted(map(_dht_received, full)),
    )
    # No --mode: the default (auto, since 0.7.0) runs the 5-participant rounds accountable: each of their rows carries
    # the validation figures (extra["accountable"], set once an accountable round was applied), and the validators'
    # re-checks found nothing. A round with a peer planned out (4 participants, a loaded machine) runs relay.
    figures = [x["extra"].get("accountable") for n in names for x in rows[n] if x["peers"] >= AUTO_ACCOUNTABLE_FROM]
    assert figures and None not in figures and sum(f.get("parts", 0) for f in figures) > 0, figures
    assert all(
        f.get("proofs", 0) + f.get("suspicions", 0) + f.get("unvalidatable", 0) + f.get("excluded", 0) == 0
        for f in figures
    ), figures
