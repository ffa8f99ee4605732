"""Issue 12, the planning half: a bootstrap and 3 honest peers train (OS processes); once they have
trained clean rounds, ONE extra process announces 30 identities as fast GPUs that never take part
(tests/sybil_util.py: valid proof of work, the honest round and digest copied, vouching for each other).

Before probation (this test on HEAD 507e517, 2 shared cores) they were planned in at once (19, then 33
participants), owned most parts, every part waited for them until the deadline and every take-over
waited for each of them: honest rounds went from 3.3 s to a median of 25 s and eval perplexity from 485
to 6,469 in 4 rounds. Now (median 4.6-4.7 s, perplexity 312-315; docs/admission.md, "Probation"): at
most one of them joins a round, on probation (no part, bounded weight, outside the quorum), owners
close parts a short grace after the established peers pushed, a no-show is not planned again for a
while, and they never lead. The test takes ~70-80 s on 2 shared cores.

Asserted for the honest peers: all exit 0 after every round, digests equal after every round, every part closed
once the honest peers pushed (never at the exchange deadline), at most one Sybil left out a round and never the same
one twice (the round times are printed, not asserted), no Sybil ever contributes to
an aggregate, eval perplexity falls further once they are there, and the Sybils were really in view (an honest leader logged them on probation).
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.swarm_util import FAST, RUN_ID, ProcSwarm

POW_BITS = FAST[FAST.index("--pow-bits") + 1]
ROUNDS = 7
N_SYBILS = 30
#: the Sybil process starts with the honest peers but announces nothing before this round
SYBIL_FROM_ROUND = 3

pytestmark = pytest.mark.timeout(240)


def _peer_id(swarm: ProcSwarm, name: str) -> str:
    from geomesh_p2p.net.identity import Identity

    return str(Identity.load_or_create(swarm.dir / f"{name}.key").peer_id)


def test_thirty_sybil_identities_that_never_take_part_do_not_slow_or_split_the_honest_peers(swarm):
    honest = ["h0", "h1", "h2"]
    swarm.bootstrap("boot")  # port 0: it binds a free port and prints it
    entry = swarm.address("boot")
    for n in honest:
        # the default 8 evaluation batches (FAST's 2 shortened the rounds to 2-3 s: a CI run in which the Sybil
        # process, re-announcing 30 records 8 at a time, never caught up with the honest round, so no leader saw one)
        swarm.peer(n, "--rounds", str(ROUNDS), "--min-peers", "3", "--eval-batches", "8", bootstrap=entry)
    swarm._spawn(
        "sybil",
        [
            sys.executable,
            "-m",
            "tests.sybil_util",
            "--bootstrap",
            entry,
            "--run-id",
            RUN_ID,
            "--pow-bits",
            POW_BITS,
            "--n",
            str(N_SYBILS),
            "--from-round",
            str(SYBIL_FROM_ROUND),
        ],
    )
    swarm.wait_for(lambda: "sybil: announced" in swarm.text("sybil"), 150, "the Sybils to announce")
    t_sybil = time.time()
    codes = swarm.wait_exit(honest, 180)
    logs = "\n".join(f"--- {n}\n{swarm.text(n)[-2500:]}" for n in honest)
    assert codes == {n: 0 for n in honest}, f"{codes}\n{logs}"
    rows = {n: swarm.rows(n) for n in honest}
    # every honest peer trained every round, or was planned out of it by the no-part penalty of a push the load made
    # late (f24960e, fe9f50e: it re-syncs); one that skipped or forked a round fails (rows count honest + probation)
    out = {n: swarm.planned_out(n) for n in honest}
    assert all(sorted({x["round"] for x in rows[n]} ^ out[n]) == list(range(ROUNDS)) for n in honest), (out, logs)
    by_round = {r: [x for n in honest for x in rows[n] if x["round"] == r] for r in range(ROUNDS)}
    for r, xs in by_round.items():
        assert len(xs) >= 2 and len({x["digest"] for x in xs}) == 1, f"honest digests differ after round {r}\n{logs}"

    # Round times as h0 logged them: clean = rounds 1.. that ended before the Sybils were announced
    # (round 0 includes the start-up gather); attacked = rounds that started after.
    h = rows["h0"]
    clean = [x["round_s"] for x in h if 1 <= x["round"] and x["time"] <= t_sybil]
    attacked = [x["round_s"] for x in h if x["time"] - x["round_s"] >= t_sybil]
    print(f"\nround_s clean {clean}, with {N_SYBILS} Sybils {attacked}")
    print("eval_ppl", {x["round"]: round(x["eval_ppl"], 1) for x in h}, "steps", [x.get("steps") for x in h])
    assert clean and len(attacked) >= 3, (clean, attacked, logs)
    # What a Sybil costs the honest peers is counted, not timed (a wall-time bound of 3x the clean rounds failed
    # CI at stop 55 with nothing wrong: one clean round of 0.95 s against 3.1-4.6 s at load): every part of every
    # round closed once the honest peers had pushed (all of them, or the established ones + the probation grace),
    # never at the exchange deadline; each attacked round left out at most one Sybil, never the same one twice
    # (a no-show is not planned again for a while). Before probation every part waited for them to the deadline.
    # A part closed at the deadline without an honest peer is the load's (that peer's push came late: the no-part
    # penalty plans it out, as above), not the Sybils': it is allowed only with an honest peer among its absent.
    closed = [e for n in honest for e in swarm.events(n, "part_closed")]
    ids = {_peer_id(swarm, n) for n in honest}
    assert closed and all(e["reason"] in ("all pushed", "established pushed") or ids & set(e["absent"])
                          for e in closed), [(e["round"], e["reason"], e["absent"]) for e in closed]  # fmt: skip
    absent = {}
    for e in closed:  # the Sybils left out of each round
        absent.setdefault(e["round"], set()).update(set(e["absent"]) - ids)
    assert all(len(a) <= 1 for a in absent.values()), absent
    no_shows = [p for a in absent.values() for p in a]
    assert len(no_shows) == len(set(no_shows)), absent

    # The Sybils were in view and got (at most) a probation slot, never a part or the lead.
    text = "".join(swarm.text(n) for n in honest)
    assert "on probation" in text, logs + "\n--- sybil\n" + swarm.text("sybil")[-1500:]
    every = [x for xs in by_round.values() for x in xs]
    assert all(x["peers"] <= 4 for x in every), [x["peers"] for x in every]

    # No Sybil ever contributed: every aggregate is the honest peers' alone (the weights are what 3 honest
    # peers make), and training went on with the Sybils around: a perplexity below the last one before them.
    assert all(x["contributors"] <= len(honest) for x in every), [x["contributors"] for x in every]
    ppl = {r: max(x["eval_ppl"] for x in xs) for r, xs in by_round.items()}  # the worst honest one of each round
    first_attacked = min(x["round"] for x in h if x["time"] - x["round_s"] >= t_sybil)
    # (not the last round's alone: the tiny model's outer Nesterov at 2-3 inner steps a round can overshoot
    # one round under load, with or without Sybils; docs/security.md, "Probation")
    assert min(ppl[r] for r in range(first_attacked, ROUNDS)) < ppl[first_attacked - 1] < ppl[0], ppl
