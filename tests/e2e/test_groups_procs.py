"""All-reduce groups in a swarm of peer processes (issue 26, docs/collective.md "All-reduce groups").

Nine tiny-model peers, ``--mode reencode --group-size 3``: every round is three groups of three (the fewest a
grouped round has: ``exchange.groups.MIN_GROUPS`` of ``MIN_GROUP_MEMBERS``), a group reduce-scatter, a cross-group
all-reduce of each slice through its leader and a group all-gather. What must hold: every round ends on one digest
with all nine peers counted as contributors (the leaders' signed member lists), every peer logged the grouped
exchange, and no peer logged an ERROR or a traceback. (Until session 25 these were six peers in two groups of
three; two groups are no longer grouped.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

N = 9
ROUNDS = 3


def test_a_leader_killed_in_the_grouped_exchange_leaves_the_survivors_on_one_digest(swarm):
    """A slice's leader is SIGKILLed as its round-1 grouped exchange starts: the survivors finish that round on one
    digest (the slice it led is missing for all of them, or served from a copy) and train on without it."""
    names = [f"k{i}" for i in range(N)]
    swarm.start_peers(names, "--min-peers", str(N), "--rounds", "5", "--mode", "reencode", "--group-size", "3")

    def leader_in_round_1():
        return next(
            (n for n in names if "round 1: grouped exchange" in swarm.text(n) and _leads(swarm.text(n), 1)), None
        )

    swarm.wait_for(lambda: leader_in_round_1() is not None, 200, "a leader's round-1 grouped exchange")
    victim = leader_in_round_1()
    swarm.kill(victim)
    rest = [n for n in names if n != victim]
    codes = swarm.wait_exit(rest, 240)
    assert codes == {n: 0 for n in rest}, {n: swarm.text(n)[-2000:] for n, c in codes.items() if c != 0}
    digests = swarm.digests_by_round(rest)
    assert max(digests) == 4 and all(len(d) == 1 for d in digests.values()), {r: sorted(d) for r, d in digests.items()}
    # after the round it died in, it is planned by nobody
    assert all(swarm.rows(n)[-1]["peers"] == N - 1 for n in rest)
    for n in rest:
        assert "Traceback" not in swarm.text(n)


def _leads(text: str, r: int) -> bool:
    return any(f"round {r}: grouped exchange" in line and "leads it" in line for line in text.splitlines())


def test_eager_peers_with_a_client_only_member_keep_one_digest_in_groups(swarm):
    """Nine peers in three groups of three, among them ``--eager`` (the exchange's ``in_place=False`` path; the
    killed-leader test below runs the in-place one) and a ``--client-only`` peer (red team: it owns no slice; the
    owners are dealt over the groups first): one digest every round, all nine counted as contributors, no ERROR or
    traceback."""
    names = [f"e{i}" for i in range(N)]
    swarm.start_peers(
        names,
        "--min-peers",
        str(N),
        "--rounds",
        str(ROUNDS),
        "--mode",
        "reencode",
        "--group-size",
        "3",
        "--eager",
        each=lambda i, n: ("--client-only",) if i == N - 1 else (),
    )
    codes = swarm.wait_exit(names, 260)
    assert codes == {n: 0 for n in names}, {n: swarm.text(n)[-2000:] for n, c in codes.items() if c != 0}
    digests = swarm.digests_by_round(names)
    assert max(digests) == ROUNDS - 1, sorted(digests)
    assert all(len(d) == 1 for d in digests.values()), {r: sorted(d) for r, d in digests.items()}
    full = [x for n in names for x in swarm.rows(n) if x["peers"] == N]
    assert full and all(x["contributors"] == N and x["missing_parts"] == 0 for x in full), [
        (x["round"], x["peers"], x["contributors"], x["missing_parts"]) for x in full
    ]
    for n in names:
        text = swarm.text(n)
        assert "grouped exchange: 3 groups" in text, text[-2000:]
        assert "Traceback" not in text and " E " not in text, text[-3000:]
