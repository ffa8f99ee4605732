"""A young swarm converges (docs/admission.md, "A young swarm"): three peers started a few seconds apart
with ``--min-peers 1`` (the README's first run). The first trains alone while the others profile; each
later peer downloads its state and follows its plans until it has delivered, so all three end on one
lineage (equal digests, ``peers 3``) within a bounded number of rounds, instead of three lineages that
refuse each other's plans as "on probation" (before: merged only after ~30 rounds).
"""

from __future__ import annotations

import pytest


ROUNDS = 18
#: rounds as long as when BOUND was measured: c starts after a's third round and must join before ROUNDS (with
#: the shared FAST flags' shorter rounds, a and b reached round 15 first under a 3-worker load)
SLOW = ("--window-s", "2.5")
#: rounds after the last peer's first round by which the three must train together with equal digests
BOUND = 8

pytestmark = pytest.mark.timeout(300)


def test_three_peers_started_apart_with_min_peers_one_form_one_swarm(swarm):
    swarm.bootstrap("boot")  # port 0: it binds a free port and prints it
    entry = swarm.address("boot")
    names = ["a", "b", "c"]
    swarm.peer("a", "--rounds", str(ROUNDS), "--min-peers", "1", *SLOW, bootstrap=entry)
    # a trains alone before b starts; c starts once a trained another round (a few seconds apart)
    swarm.wait_for(lambda: len(swarm.rows("a")) >= 1, 120, "a's first round")
    swarm.peer("b", "--rounds", str(ROUNDS), "--min-peers", "1", *SLOW, bootstrap=entry)
    swarm.wait_for(lambda: len(swarm.rows("a")) >= 3, 120, "a's third round")
    swarm.peer("c", "--rounds", str(ROUNDS), "--min-peers", "1", *SLOW, bootstrap=entry)
    codes = swarm.wait_exit(names, 240)
    logs = "\n".join(f"--- {n}\n{swarm.text(n)[-3000:]}" for n in names)
    assert codes == {n: 0 for n in names}, f"{codes}\n{logs}"
    rows = {n: {x["round"]: x for x in swarm.rows(n)} for n in names}
    assert all(rows[n] for n in names), logs
    start = max(min(rows[n]) for n in names)  # the last peer's first round
    together = [
        r
        for r in range(start, ROUNDS)
        if all(r in rows[n] and rows[n][r]["peers"] == 3 for n in names)
        and len({rows[n][r]["digest"] for n in names}) == 1
    ]
    assert together and together[0] <= start + BOUND, (start, together, logs)
    # from then on one lineage: every round all three trained has one digest
    for r in range(together[0], ROUNDS):
        digests = {rows[n][r]["digest"] for n in names if r in rows[n]}
        assert len(digests) == 1, (r, {n: rows[n].get(r, {}).get("digest") for n in names}, logs)
    assert rows["a"][ROUNDS - 1]["digest"] == rows["b"][ROUNDS - 1]["digest"] == rows["c"][ROUNDS - 1]["digest"], logs
    text = "".join(swarm.text(n) for n in names)
    assert "0 of the 0 rounds" not in text, logs
