"""All-reduce groups in a swarm of peer processes (issue 26, docs/collective.md "All-reduce groups").

Nine tiny-model peers, ``--mode reencode --group-size 3``: every round is three groups of three (the fewest a
grouped round has: ``exchange.groups.MIN_GROUPS`` of ``MIN_GROUP_MEMBERS``), a group reduce-scatter, a cross-group
all-reduce of each slice through its leader and a group all-gather. What must hold: every round ends on one digest
with all nine peers counted as contributors (the leaders' signed member lists), every peer logged the grouped
exchange, and no peer logged an ERROR or a traceback. (Until session 25 these were six peers in two groups of
three; two groups are no longer grouped.)

A slice leader killed mid-round was tested here too, with nine ``reencode`` peers, until session 36: the 16-peer
accountable test (tests/e2e/test_accountable_groups_procs.py) kills one the same way and keeps every assertion of
that test, so one process swarm of that kind is enough for the suite's 12 minutes. The in-process failure tests of
the grouped exchange (tests/integration/test_collective_groups*.py) cover the ``reencode`` path's dead leader.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

N = 9
ROUNDS = 3


def test_eager_peers_with_a_client_only_member_keep_one_digest_in_groups(swarm):
    """Nine peers in three groups of three, among them ``--eager`` (the exchange's ``in_place=False`` path; the
    killed-leader test of test_accountable_groups_procs.py runs the in-place one) and a ``--client-only`` peer (red team: it owns no slice; the
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
    # the rounds with every peer planned: every contribution counted, every part with its result, less a peer that
    # says its own push came after its part closed (the load's late push: the no-part penalty plans it out next,
    # f24960e; a contribution the grouped exchange lost is said by no peer, and fails this)
    full = [x for n in names for x in swarm.rows(n) if x["peers"] == N]
    late = {r: sum(f"round {r}: this peer contributed to no part the others applied" in swarm.text(n) for n in names)
            for r in range(ROUNDS)}  # fmt: skip
    assert full and all(x["contributors"] == N - late[x["round"]] and x["missing_parts"] == 0 for x in full), [
        (x["round"], x["peers"], x["contributors"], x["missing_parts"], late[x["round"]]) for x in full
    ]
    for n in names:
        text = swarm.text(n)
        assert "grouped exchange: 3 groups" in text, text[-2000:]
        assert "Traceback" not in text and " E " not in text, text[-3000:]
