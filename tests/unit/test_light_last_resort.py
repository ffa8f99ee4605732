"""A light follower whose only live leader candidate is the last round's leader (session 49; CI's
``test_ctrl_c_peer_leaves_cleanly_and_the_others_plan_without_it``): c0 led round 0, c1 is a newcomer on probation
and c2 the only other established peer; c2 leaves after round 0. In round 1, c1 runs light (its full-view peer is
c2, ``--full-view-peers 1``) and c0 leads as the full path's last level of ``planning.next_leaders`` (no other
candidate is live). The light path bars c0 (no self-succession while c2, established in round 0's plan, may lead:
only a records read says c2 left), so it must hand the round to the full path as soon as c0's plan settled, not wait
the whole plan agreement out while c0 trains round 1 without it (a planned probation no-show is benched 10 rounds)."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.plan.agree import PlanRefused, leader_order
from geomesh_p2p.round import DhtPlanAgreement, PlanStore
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import RUN, FakePeer, _peers

pytestmark = pytest.mark.timeout(60)


class Newcomers(FakePeer):
    """A fake peer whose ledger holds the peers of ``PROBATION`` on probation: they lead nothing
    (``leader_candidates``, ``may_lead_ids``) and plans mark them (``RoundAssignment.probation``)."""

    PROBATION: frozenset = frozenset()

    def standing_established(self, records, peer_id):
        return peer_id not in self.PROBATION

    def leader_candidates(self, members, live):
        return list(members), [m.peer_id for m in members if m.peer_id not in self.PROBATION]


async def test_a_light_follower_hands_the_last_leaders_last_resort_plan_to_the_full_path_and_trains_in_it():
    peers = _peers(3, cls=Newcomers)
    newcomer = peers[0]
    Newcomers.PROBATION = frozenset({newcomer.me})
    c0_id = leader_order(RUN, 0, [p.me for p in peers[1:]])[0]  # round 0's leader: the better-ranked established
    c0 = next(p for p in peers if p.me == c0_id)
    c2 = next(p for p in peers[1:] if p is not c0)
    # Ctrl+C in round 0's exchange: its round is finished, and its leaving announced at once (the driver's stop
    # watcher), so every gather of round 1 reads it leaving (announced at its round's end instead, c0 may read it
    # live, wait an attempt for its plan, and publish only after the light path gave up: no plan to refuse)
    c2.hooks["exchange"] = c2.stop.set
    outcomes: list[str] = []  # what the light path's plan agreement of round 1 ended with

    class Watched(DhtPlanAgreement):
        async def agree(self, round, members, make_plan, **kw):
            light = not members and round == 1
            if light:
                # the e2e run's proportions: a plan timeout far longer than c0's way to its plan (0.3 s here, 7 s
                # there), so a light path that waits the agreement out comes too late for c0's plan, however loaded
                kw["plan_timeout_s"] = 10.0
            try:
                plan = await super().agree(round, members, make_plan, **kw)
            except PlanRefused as e:
                if light:
                    outcomes.append(f"refused {e.plan.leader}")
                raise
            if light:
                outcomes.append(f"plan of {plan.leader}" if plan is not None else "none")
            return plan

    def drv(p):
        plans = Watched(PlanStore(p.swarm.dht, p.ident, RUN)) if p is newcomer else None
        return p.driver(rounds=3, min_peers=2, full_view_peers=1, plans=plans).run()

    with events.capture("light_fallback") as fallbacks:
        await asyncio.wait_for(asyncio.gather(*[drv(p) for p in peers]), 45)

    assert [x.round for x in c2.drv.history] == [0] and c2.leaving
    assert [x.leader for x in c0.drv.history] == [c0.me[:10]] * 3  # the only one that may lead, every round
    # round 1 ran light at c1 until c0's plan came: c1 bars it (c2, established in round 0's plan, might lead) and
    # hands the round to the full path at once, instead of waiting the whole agreement out for a plan of c2's
    assert outcomes == [f"refused {c0.me}"]
    assert [(e["peer"], e["round"]) for e in fallbacks] == [(newcomer.me, 1)]
    assert fallbacks[0]["reason"].startswith(f"it refuses the best-ranked plan (its leader {c0.me[:10]} led round 0")
    # ... and the full path follows c0's plan: c1 trained round 1 in it, no planned no-show (planned_out: never)
    h1 = newcomer.drv.history[1]
    assert (h1.round, h1.leader, h1.digest_agree) == (1, c0.me[:10], True)
    assert not getattr(newcomer, "sat_out", []) and not getattr(c0, "sat_out", [])
    assert [x.round for x in newcomer.drv.history] == [0, 1, 2]
    assert newcomer.digest == c0.digest and newcomer.round == c0.round == 3
