"""A round gathered with others, every one of whom announced leaving before the plan was made, is not trained
alone (``planning.left_alone_in_plan``, event ``round_alone_skipped``). A fresh-user trial, session 37: three peers
stopped at once; one had gathered the other two just before their leaving records, took over as leader with a plan
of itself alone, trained the round by itself and resumed later on a state of a lineage of one. Driven with the
in-memory fakes of tests/unit/test_round_driver.py.

The other way round (session 38, CI): the others announced leaving *during* a round they had planned with this peer
while it was still gathering it. A leave at round r takes a peer out of the rounds after r, not out of r's plan:
the gather follows that plan (``gather.planned_with_leavers``) instead of ending the run ("the swarm ended") or
planning the round alone, and a peer stopped between rounds asks once whether it names it."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanStore, leader_order
from geomesh_p2p.round import DhtPlanAgreement
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


async def _b_planned_and_left(a: FakePeer, b: FakePeer, participants: list[FakePeer]) -> None:
    """``b`` publishes its signed plan of round 0 naming ``participants``, then announces leaving (its record at
    round 0 with the same digest as ``a``'s: it left during the round)."""
    await PlanStore(a.swarm.dht, b.ident, RUN).publish(b.make_plan([p.record() for p in participants], b.me))
    b.leaving = True
    a.swarm.records[b.me] = b.record()


@pytest.mark.parametrize("min_peers", [2, 1])
async def test_a_gather_finding_the_others_left_during_the_round_follows_their_plan_naming_it(min_peers):
    """Before: with ``--min-peers`` 2 the gather saw every other peer leaving and ended the run (``swarm_ended``,
    cause ``others_left``); with 1 it returned this peer alone, which planned the round by itself. Now both return
    the leaver with this peer (the plan agreement then follows b's plan), with one ``planned_with_leavers``."""
    a, b = _pair()
    await _b_planned_and_left(a, b, [a, b])
    drv = a.driver(min_peers=min_peers, wait_peers_s=5.0)
    drv._in_step_seen = ((a.round, a.digest), {b.me})  # an earlier read of the gather saw b live in step
    with events.capture("planned_with_leavers") as said, events.capture("swarm_ended") as ended:
        members = await asyncio.wait_for(drv.gather(set(), first=False), 30)
    assert members is not None and sorted(m.peer_id for m in members) == sorted([a.me, b.me])
    assert [(e["peer"], e["round"], e["leavers"]) for e in said] == [(a.me, 0, [b.me])]
    assert ended == [] and drv.ended is None


async def test_a_plan_without_this_peer_or_of_it_alone_is_no_reason_to_stay():
    """The plans of the round name this peer with none of the leavers (its own plan of itself alone), or leave it
    out: the gather asks once (one read: plans are there) and ends the run as before, on two reads."""
    for named in ("alone", "out"):
        a, b = _pair()
        if named == "alone":
            await PlanStore(a.swarm.dht, a.ident, RUN).publish(a.make_plan([a.record()], a.me))
        await _b_planned_and_left(a, b, [b])
        drv = a.driver(min_peers=2, wait_peers_s=5.0)
        with events.capture("planned_with_leavers") as said, events.capture("swarm_ended") as ended:
            assert await asyncio.wait_for(drv.gather(set(), first=False), 30) is None
        assert said == [] and [(e["cause"], e["synced"]) for e in ended] == [("others_left", True)], named


async def test_a_peer_stopped_between_rounds_asks_once_without_waiting_when_only_leavers_are_left():
    """Stopped between rounds with no live other peer: before, it left at once (``others`` were the live records
    only) although the peers that left during this round had planned it; now it reads their plans once (no wait:
    the session-34 rule against a wait on every Ctrl+C holds) and takes part when one names it. Leavers of another
    round planned nothing of this one: no read."""
    asked: list[tuple[int, float]] = []

    class Asking(DhtPlanAgreement):
        async def names(self, round, peer_id, wait_s, poll_s=0.25, among=()):
            asked.append((round, wait_s))
            return await super().names(round, peer_id, wait_s, poll_s, among)

    a, b = _pair()
    await _b_planned_and_left(a, b, [a, b])
    drv = a.driver(plans=Asking(PlanStore(a.swarm.dht, a.ident, RUN)))
    assert await drv._planned_after_stop() is True and asked == [(0, 0.0)]
    a, b = _pair()
    b.round = 1  # left after finishing round 0: no plan of round 0 of its is coming
    await _b_planned_and_left(a, b, [a, b])
    asked.clear()
    drv = a.driver(plans=Asking(PlanStore(a.swarm.dht, a.ident, RUN)))
    assert await drv._planned_after_stop() is False and asked == []
