"""Red team (session 38) of ``gather.planned_with_leavers``, ``RoundDriver._planned_after_stop`` with only leavers
left, and ``light.is_light`` ranking among the established participants. Driven with the in-memory fakes of
tests/unit/test_round_driver.py (plan_timeout_s 0.3 there)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanStore, leader_order
from geomesh_p2p.round import DhtPlanAgreement, light
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.probation import may_lead
from tests.unit.test_alone_after_leaving import _pair
from tests.unit.test_round_driver import PEER_INDEX, PEERS, RUN, FakePeer, Swarm

pytestmark = pytest.mark.timeout(60)


class Asking(DhtPlanAgreement):
    """The agreement, recording every ``names`` ask as (round, wait_s, among, answer)."""

    def __init__(self, store):
        super().__init__(store)
        self.asked: list[tuple] = []

    async def names(self, round, peer_id, wait_s, poll_s=0.25, among=()):
        got = await super().names(round, peer_id, wait_s, poll_s, among)
        self.asked.append((round, wait_s, tuple(among), got))
        return got


async def test_a_fake_leaver_each_round_costs_a_lone_peer_no_plan_timeout():
    """FIXED. A leaving record re-announced at the lone peer's round and digest each round (no plan, never live) made
    the lone --min-peers 1 peer wait the full plan_timeout_s in every round's gather (asked (0, 0.3) and (1, 0.3),
    both False). Now a leaver this peer never saw take part (not in its last applied plan, never read live in step at
    this round) gets one read, no wait."""
    a, b = _pair()
    agreement = Asking(PlanStore(a.swarm.dht, a.ident, RUN))
    drv = a.driver(rounds=2, min_peers=1, plans=agreement)

    def b_leaves_at_a_state():  # the attacker's record follows a's round and digest, leaving
        b.round, b.digest, b.leaving = a.round, a.digest, True
        a.swarm.records[b.me] = b.record()

    a.hooks["peers"] = b_leaves_at_a_state
    with events.capture("planned_with_leavers") as said:
        await asyncio.wait_for(drv.run(), 45)
    assert said == [] and [r.round for r in drv.history] == [0, 1]  # it followed nothing of the attacker's
    waited = [w for _, w, _, _ in agreement.asked if w > 0]
    assert waited == [], agreement.asked


async def test_a_leaver_read_live_in_step_at_this_round_is_waited_for_once():
    """The other side of the fix: a leaver this peer's gather read live in step at its round (a leader that may still
    be publishing the round's plan as it stops) gets the plan timeout, once per round and state."""
    a, b = _pair()
    agreement = Asking(PlanStore(a.swarm.dht, a.ident, RUN))
    drv = a.driver(rounds=1, min_peers=1, plans=agreement)
    drv._in_step_seen = ((a.round, a.digest), {b.me})  # an earlier read of this round's gather saw b live in step
    b.round, b.digest, b.leaving = a.round, a.digest, True
    a.swarm.records[b.me] = b.record()
    await asyncio.wait_for(drv.gather(set(), first=False), 30)
    await asyncio.wait_for(drv.gather(set(), first=False), 30)
    assert [(r, w, among) for r, w, among, _ in agreement.asked] == [(0, 0.3, (b.me,))]


async def test_a_plan_of_a_leaver_this_peer_never_saw_take_part_is_not_asked_for():
    """FIXED. The attacker signs a plan naming the lone peer and itself (one the checks refuse) and leaves; it never
    took part with this peer. Before, the gather returned it as a member (``planned_with_leavers``) and the lone peer
    refused its plan and sat round 0 out to the plan's end (40 s here), every round the attacker repeats it. Now
    only leavers this peer knows took part with it (its last applied plan, or read live in step at this round) count:
    none here, so the lone peer (--min-peers 1) plans and trains round 0 itself at once."""
    a, b = _pair()
    await PlanStore(a.swarm.dht, b.ident, RUN).publish(b.make_plan([a.record(), b.record()], b.me))
    b.leaving = True
    a.swarm.records[b.me] = b.record()
    checks = a.plan_problem
    a.plan_problem = lambda plan, live: "refused by the checks" if plan.leader == b.me else checks(plan, live)
    drv = a.driver(rounds=1, min_peers=1)
    with events.capture("planned_with_leavers") as said, events.capture("plan_refused") as refused:
        await asyncio.wait_for(drv.run(), 45)
    assert said == [] and refused == []
    assert drv._last_plan is not None and drv._last_plan.leader == a.me
    assert [(h.round, h.peers) for h in drv.history] == [(0, 1)]


async def test_a_leavers_plan_is_not_followed_before_this_peers_own_turn_to_lead():
    """Leader rules: this peer ranks first for round 0; the attacker's plan naming both, signed and left, is not
    followed ahead of this peer's own plan (it leads round 0 itself, alone with --min-peers 1)."""
    a, b = _pair_any()
    while leader_order(RUN, 0, [a.me, b.me])[0] != a.me:
        a, b = _pair_any()
    await PlanStore(a.swarm.dht, b.ident, RUN).publish(b.make_plan([a.record(), b.record()], b.me))
    b.leaving = True
    a.swarm.records[b.me] = b.record()
    drv = a.driver(rounds=1, min_peers=1)
    await asyncio.wait_for(drv.run(), 45)
    assert drv._last_plan is not None and drv._last_plan.leader == a.me
    assert [(h.round, h.peers) for h in drv.history] == [(0, 1)]


async def test_a_leavers_plan_whose_parts_never_come_ends_the_round_with_this_peers_own_update():
    """b planned round 0 with a, then left without sending anything: a follows the plan, its exchange misses b's
    part (the fake waits its exchange timeout) and the round ends: a trained round 0 with the plan of 2 and is at
    round 1, no hang."""
    a, b = _pair()
    await PlanStore(a.swarm.dht, b.ident, RUN).publish(b.make_plan([a.record(), b.record()], b.me))
    b.leaving = True
    a.swarm.records[b.me] = b.record()
    drv = a.driver(rounds=1, min_peers=2, wait_peers_s=5.0)
    drv._in_step_seen = ((a.round, a.digest), {b.me})  # a read b live in step before it left
    with events.capture("planned_with_leavers") as said:
        await asyncio.wait_for(drv.run(), 45)
    assert [e["leavers"] for e in said] == [[b.me]]
    assert [(h.round, h.peers) for h in drv.history] == [(0, 2)] and a.round == 1


def _pair_any() -> tuple[FakePeer, FakePeer]:
    """Two fresh peers in step at round 0 in a new swarm, ``a`` first whatever their rank."""
    swarm = Swarm()
    a, b = FakePeer(swarm, Identity.generate()), FakePeer(swarm, Identity.generate())
    for k, p in enumerate((a, b)):
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        swarm.records[p.me] = p.record()
    return a, b


def _light_drv(me: str, took_plan, established: set[str], full_view_peers: int = 1):
    """A driver stand-in for :func:`light.is_light` at round ``plan.round + 1``, its ledger holding ``established``."""
    return SimpleNamespace(
        cfg=SimpleNamespace(full_view_peers=full_view_peers, eager=False),
        _last_plan=took_plan,
        state=SimpleNamespace(round=took_plan.round + 1, syncing=False),
        _light_ok_round=took_plan.round + 1,
        _light_fallback_round=-1,
        stop=asyncio.Event(),
        leaving=False,
        me=me,
        policy=SimpleNamespace(
            may_lead_ids=lambda recs, ids: may_lead(
                SimpleNamespace(established_ids=lambda xs: frozenset(p for p in xs if p in established)), ids
            )
        ),
    )


@pytest.mark.parametrize("est", ["none", "one", "all_but_each_self"])
def test_with_one_ledger_some_participant_reads_the_full_view(est):
    """Every peer's ledger the same (they applied the same rounds): whatever it holds established among the last
    plan's participants (nobody: the ``or took`` fallback; one; everyone but the peer asking, as if its own peer
    were not established), at least one participant other than the leader is a full-view peer, and the
    top-ranked established one (the full path's leader) is never light."""
    a, b = _pair()
    c, d = _pair()
    peers = [a, b, c, d]
    plan = a.make_plan([p.record() for p in peers], a.me)
    took = [p for p in plan.participants() if p != plan.leader]
    for me in took:
        if est == "none":
            held: set[str] = set()
        elif est == "one":
            held = {took[-1]}
        else:
            held = set(took) - {me}
        # the ledger is the same at every peer only for "none" and "one"; the last case is each peer's view of
        # the others, where a peer never counts itself
        lights = {p: light.is_light(_light_drv(p, plan, held)) for p in took}
        if est != "all_but_each_self":
            assert not all(lights.values()), (est, lights)
            top = leader_order(RUN, plan.round + 1, [p for p in took if p in held] or took)[0]
            assert lights[top] is False
