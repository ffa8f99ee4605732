"""Attacks on light followers (issue 25, docs/round.md "Light followers") found by the red-team review, and
what now stops them.

1. A plan the full-view peers refuse by a ContentRefusal (planner.check_plan: a wrong ``accum_steps`` for one
   participant) is bypassed by them (the next leader takes over). A light follower that did not sample that
   participant accepted it: the round ran on two plans and ended on two digests. Now every participant whose
   assignment the plan alone cannot check (``planner.records_needed``: an accumulation other than a
   one-device peer's) is in the light follower's sample, so it refuses the plan and takes the full path.
2. A plan stored under ``<run>/plan/<r>`` by an outsider identity (no record, never a participant) that ranks
   first sent every light follower to the full path, every round it was published. Now such a plan is ignored
   unless its leader has a live record (one subkey read): the light followers follow the swarm's plan.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round import leader_order
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import RUN, FakePeer, _leader_of, _peers
from geomesh_p2p.net.identity import Identity

pytestmark = pytest.mark.timeout(60)

ROGUE_ROUND = 2


class Peer(FakePeer):
    rogue: str = ""
    bad: str = ""  # the participant whose figures the rogue plan gets wrong (a ContentRefusal in a full check)

    def _is_rogue(self, plan):
        return plan.round == ROGUE_ROUND and plan.leader == Peer.rogue

    def plan_problem(self, plan, live):
        if self._is_rogue(plan) and self.me != Peer.rogue:
            # what planner.check_plan says for a wrong accum_steps: a ContentRefusal (ignored as absent)
            return ContentRefusal(f"{Peer.bad[:10]} accumulates 2 micro-batches of 32; target batch 32 means 1")
        return super().plan_problem(plan, live)

    def records_needed(self, plan):
        # planner.records_needed: the participant whose accumulation is not a one-device peer's
        return [Peer.bad] if self._is_rogue(plan) else []

    def sampled_plan_problem(self, plan, sampled, sample):
        if self._is_rogue(plan) and Peer.bad in sample:
            return ContentRefusal("accum")
        return super().sampled_plan_problem(plan, sampled, sample)

    def driver(self, **kw):
        drv = super().driver(**kw)
        drv.cfg = dataclasses.replace(drv.cfg, light_sample=1)  # the leader's record only
        return drv


async def test_a_rogue_plan_full_view_peers_ignore_as_a_content_refusal_is_not_followed_by_light_followers():
    peers = _peers(5, cls=Peer)
    ids = [p.me for p in peers]
    last = _leader_of(ids, ROGUE_ROUND - 1)  # round 1's leader leads no round 2 (no self-succession)
    order = leader_order(RUN, ROGUE_ROUND, [i for i in ids if i != last])
    Peer.rogue = order[0]  # the best-ranked leader of round 2 (a full-view peer)
    Peer.bad = order[-1]  # a light follower the rogue plan lies about (unsampled: the sample is the leader)
    with events.capture("light_fallback") as fallbacks:
        await asyncio.wait_for(
            asyncio.gather(*[p.driver(rounds=4, min_peers=5, full_view_peers=2).run() for p in peers]), 40
        )
    honest = [p for p in peers if p.me != Peer.rogue]  # the rogue follows its own plan, whatever the others do
    leaders = {p.me[:10]: p.drv.history[ROGUE_ROUND].leader for p in honest}
    # every honest peer followed the plan of the leader that took over (one plan, one digest per round)
    assert set(leaders.values()) == {order[1][:10]}, leaders
    for r in range(4):
        assert len({p.drv.history[r].digest for p in honest}) == 1, r
    # the light followers of round 2 checked the lied-about participant's record and took the full path
    light2 = set(order[2:])
    assert {e["peer"] for e in fallbacks if e["round"] == ROGUE_ROUND} == light2
    assert all("accum" in e["reason"] for e in fallbacks if e["round"] == ROGUE_ROUND)


async def test_a_sybil_plan_sends_every_light_follower_to_the_full_path():
    from geomesh_p2p.plan.agree import leader_rank
    from geomesh_p2p.round import PlanStore

    peers = _peers(5)
    swarm = peers[0].swarm
    ids = [p.me for p in peers]
    best = min(leader_rank(RUN, 2, i) for i in ids)
    while True:  # an outsider identity (no record, never a participant) ranked before every peer for round 2
        sybil = Identity.generate()
        if leader_rank(RUN, 2, str(sybil.peer_id)) < best:
            break
    published = []

    def publish_sybil():
        if published or not any(p.round == 2 for p in peers):
            return
        src = next(p for p in peers if p.round == 2)
        plan = src.make_plan(list(swarm.records.values()), str(sybil.peer_id))
        published.append(asyncio.ensure_future(PlanStore(swarm.dht, sybil, RUN).publish(plan)))

    for p in peers:
        p.hooks["agree"] = publish_sybil
    with events.capture("light_fallback") as fallbacks:
        await asyncio.wait_for(
            asyncio.gather(*[p.driver(rounds=3, min_peers=5, full_view_peers=2).run() for p in peers]), 40
        )
    last = _leader_of(ids, 1)
    light2 = set(leader_order(RUN, 2, [i for i in ids if i != last])[2:])
    assert published and await published[0]
    assert len({p.digest for p in peers}) == 1
    # a light follower should not be sent to the full path by a plan nobody in the swarm follows
    assert not [e for e in fallbacks if e["round"] == 2], light2
