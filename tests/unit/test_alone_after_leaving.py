"""A round gathered with others, every one of whom announced leaving before the plan was made, is not trained
alone (``planning.left_alone_in_plan``, event ``round_alone_skipped``). A fresh-user trial, session 37: three peers
stopped at once; one had gathered the other two just before their leaving records, took over as leader with a plan
of itself alone, trained the round by itself and resumed later on a state of a lineage of one. Driven with the
in-memory fakes of tests/unit/test_round_driver.py."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import leader_order
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import PEER_INDEX, PEERS, RUN, FakePeer, Swarm

pytestmark = pytest.mark.timeout(60)


def _pair() -> tuple[FakePeer, FakePeer]:
    """Peer ``a`` (driven) and ``b`` (a record only), in step at round 0, ``b`` the better-ranked leader of round 0:
    ``a`` waits for its plan before taking over, and reads ``b``'s leaving record meanwhile."""
    swarm = Swarm()
    while True:
        a, b = FakePeer(swarm, Identity.generate()), FakePeer(swarm, Identity.generate())
        if leader_order(RUN, 0, [a.me, b.me])[0] == b.me:
            break
    for k, p in enumerate((a, b)):
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        swarm.records[p.me] = p.record()
    return a, b


@pytest.mark.parametrize("min_peers", [2, 1])
async def test_a_plan_of_this_peer_alone_after_the_others_left_is_not_trained(min_peers):
    a, b = _pair()

    def b_leaves():  # after the gather that counted b in step, before any plan of the round
        b.leaving = True
        a.swarm.records[b.me] = b.record()

    a.hooks["agree"] = b_leaves
    drv = a.driver(rounds=1, min_peers=min_peers, wait_peers_s=5.0)
    drv.cfg.plan_timeout_s = 2.0  # a's turn to take over comes well after its first read of b's leaving record
    with events.capture("round_alone_skipped") as skipped, events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(), 45)
    if min_peers == 1:  # --min-peers 1 asks to train on alone: it does
        assert skipped == [] and [(r.round, r.peers) for r in drv.history] == [(0, 1)]
        return
    # not trained alone; the next gather finds every other peer gone and ends the run on the state the swarm
    # ended with (this peer's: b left at round 0 with the same digest)
    [e] = skipped
    assert (e["peer"], e["round"], e["leader"], e["left"]) == (a.me, 0, a.me, [b.me])
    assert drv.history == [] and a.round == 0
    [end] = ended
    assert (end["cause"], end["synced"], drv.ended is not None) == ("others_left", True, True)
