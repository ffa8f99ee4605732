"""Leader election when the members' views differ (docs/round.md, "Leader election when nobody leads"):
the candidates each member computes from its own standing view and no-show marks can leave every member
deferring to another (rs7: two peers, each the other's only candidate). The election of the rs7 logs, and
obtain_plan's last resort: after every candidate's turn with no plan at all, a deferring member publishes,
and all follow one plan; it never publishes where a plan (even one it refuses) or a candidate's exists."""

from __future__ import annotations

import asyncio
import time

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanRefused
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round import PlanStore, leader_order, obtain_plan, takeover_delay
from geomesh_p2p.trust.standing import Standing
from tests.records_util import peer_record
from tests.unit.test_round import RUN, MemoryDHT, _planner, _record

pytestmark = pytest.mark.timeout(30)
T = 0.3  # plan timeout of these tests (seconds)


def test_the_rs7_views_each_name_only_the_other_peer():
    """The two peers left at round 5 of rs7 (their ledgers as the logs show them): p2 delivered round 0
    only; p3 delivered round 0 and saw round 2 delivered by the two peers that then left, and marked
    itself a no-show. Nobody is established in either view (threshold 3), so both fall back to the
    bootstrap rule, and each leaves itself out: p2 is not established, p3 is barred."""
    p0, p1, p2, p3 = (str(Identity.generate().peer_id) for _ in range(4))
    l2, l3 = Standing(), Standing()
    for ledger in (l2, l3):
        ledger.credit(0, [p0, p1, p2, p3])
    l3.credit(2, [p0, p1])
    r2 = _record_of(p2, l2)
    r3 = _record_of(p3, l3)
    v2 = pb.StandingView(l2, [r2, r3], round=5, me=p2)
    v3 = pb.StandingView(l3, [r2, r3], round=5, me=p3)
    assert [v.established(p) for v in (v2, v3) for p in (p2, p3)] == [False] * 4
    assert pb.leader_candidates(v2, [p2, p3]) == [p3]
    assert pb.leader_candidates(v3, [p2, p3], barred={p3: 12}) == [p2]


def _record_of(peer_id: str, ledger: Standing):
    return peer_record(
        peer_id,
        address="127.0.0.1:1",
        round=5,
        weights_digest="d0",
        standing=ledger.attestations(exclude=peer_id, own=True),
    )


def _obtain(dht, ident, members, **kw):
    """``obtain_plan`` of round 3 for ``ident`` over ``dht``, with this file's planner, plan timeout and settle."""
    return obtain_plan(
        PlanStore(dht.view(), ident, RUN), 3, members, _planner(3), plan_timeout_s=T, settle_s=0.05, **kw
    )


def _pair():
    ids = [Identity.generate(), Identity.generate()]
    return ids, [_record(i, 1.0) for i in ids]


async def test_two_members_that_defer_to_each_other_publish_as_last_resort_and_follow_one_plan():
    ids, members = _pair()
    a, b = (str(i.peer_id) for i in ids)
    dht = MemoryDHT()

    async def attempt(ident, other, last_resort):
        return await _obtain(
            dht,
            ident,
            members,
            candidates=[other],
            last_resort=last_resort,
        )

    # without a last resort: nobody publishes (the livelock of one attempt)
    assert await asyncio.gather(attempt(ids[0], b, ()), attempt(ids[1], a, ())) == [None, None]
    assert dht.data == {}
    t0 = time.monotonic()
    # each names both no-candidate members as last resorts (the driver's _last_resort): ranked among
    # themselves, a stagger apart, so the first publishes and the second follows it
    with events.capture("plan_takeover") as takeovers:
        got = await asyncio.gather(attempt(ids[0], b, [a, b]), attempt(ids[1], a, [a, b]))
    took = time.monotonic() - t0
    assert got[0] is not None and got[0].to_bytes() == got[1].to_bytes()
    # (on a loaded machine the first's loop may wake after the second's turn: then the second leads)
    assert got[0].leader in (a, b)
    # the leader took over as the last resort at its turn: one plan timeout after the (only) candidate's turn,
    # then a stagger per last resort ranked before it (the turn planned, not a time measured)
    turn = takeover_delay(0, T, 0.05) + T + leader_order(RUN, 3, [a, b]).index(got[0].leader) * 0.05
    led = [e for e in takeovers if e["peer"] == got[0].leader]
    assert [(e["round"], e["turn"], e["last_resort"]) for e in led] == [(3, 1, True)], takeovers
    assert led[0]["delay_s"] == pytest.approx(turn) and led[0]["after_s"] >= turn
    assert takeover_delay(0, T, 0.05) + T <= took  # never before that turn (a lower bound holds under load)


async def test_a_last_resort_waits_for_a_candidate_that_publishes_in_its_turn():
    """The young-swarm rule holds: a candidate that publishes within its turns is followed, and the last
    resort publishes nothing of its own."""
    ids = [Identity.generate() for _ in range(3)]
    members = [_record(i, 1.0) for i in ids]
    pids = [str(i.peer_id) for i in ids]
    order = leader_order(RUN, 3, pids[:2])
    newcomer = ids[2]
    dht = MemoryDHT()

    async def candidate(pid):  # the second candidate publishes at its turn (the first is silent)
        ident = next(i for i in ids if str(i.peer_id) == pid)
        return await _obtain(
            dht,
            ident,
            members,
            candidates=order,
        )

    follower = _obtain(
        dht,
        newcomer,
        members,
        candidates=order,
        last_resort=[pids[2]],
    )
    led, followed = await asyncio.gather(candidate(order[1]), follower)
    assert led.leader == followed.leader == order[1]
    assert set(dht.data[next(iter(dht.data))]) == {order[1]}  # the newcomer published nothing


async def test_a_last_resort_never_publishes_when_a_plan_it_refuses_exists():
    """A plan this member refuses means a leader it does not accept is there: its own plan would split
    the round, so it waits and then sits the round out (PlanRefused: others may follow the plan of its
    candidate, issue 25) instead."""
    ids, members = _pair()
    a, b = (str(i.peer_id) for i in ids)
    dht = MemoryDHT()
    await PlanStore(dht.view(), ids[1], RUN).publish(_planner(3)(members, b))
    with pytest.raises(PlanRefused) as ei:
        await _obtain(
            dht,
            ids[0],
            members,
            candidates=[b],
            last_resort=[a],
            accept=lambda plan: "refused by this test",
        )
    assert (ei.value.plan.leader, ei.value.reason) == (b, "refused by this test")
    assert set(dht.data[next(iter(dht.data))]) == {b}


async def test_a_refused_plan_of_a_non_member_does_not_hold_the_last_resort():
    """Any identity can sign a plan: one nobody accepts, from outside the members, must not stop the last
    resort (review: a Sybil publishing such a plan every round brought the livelock back)."""
    ids, members = _pair()
    a, b = (str(i.peer_id) for i in ids)
    sybil = Identity.generate()
    dht = MemoryDHT()
    forged = _planner(3)(members + [_record(sybil, 1.0)], str(sybil.peer_id))
    assert await PlanStore(dht.view(), sybil, RUN).publish(forged)
    got = await _obtain(
        dht,
        ids[0],
        members,
        candidates=[b],
        last_resort=[a],
        accept=lambda plan: "not a live member" if plan.leader == str(sybil.peer_id) else None,
    )
    assert got is not None and got.leader == a
    assert set(dht.data[next(iter(dht.data))]) == {a, str(sybil.peer_id)}


async def test_two_last_resorts_that_refuse_each_other_do_not_both_lead():
    """Ranked a stagger apart, the second last resort sees the first's plan before its turn: it refuses it
    but does not publish its own beside it (review: at the same instant both led, and the round split)."""
    ids, members = _pair()
    a, b = (str(i.peer_id) for i in ids)
    dht = MemoryDHT()

    async def attempt(ident, other):
        return await _obtain(
            dht,
            ident,
            members,
            stagger_s=1.0,
            candidates=[other],
            last_resort=[a, b],
            accept=lambda plan, mine=str(ident.peer_id): None if plan.leader == mine else "refused by this test",
        )

    got = await asyncio.gather(attempt(ids[0], b), attempt(ids[1], a), return_exceptions=True)
    first = leader_order(RUN, 3, [a, b])[0]
    # the second refuses a plan of its own candidate, which others may follow: it sits the round out
    # (PlanRefused, issue 25) rather than follow or publish another
    assert [p.leader if isinstance(p, RoundPlan) else type(p).__name__ for p in got] == [
        first if pid == first else "PlanRefused" for pid in (a, b)
    ]
    assert set(dht.data[next(iter(dht.data))]) == {first}


def test_a_peer_without_the_last_rounds_delivered_evidence_does_not_lead():
    """Fresh-user trial (session 29): a peer restarted with --resume caught up by outer updates and led at once; its
    plan, made from the records alone, gave it a budget its delivered work did not support in the eyes of the two
    peers that applied the last round, both refused, and the round was lost. A peer that did not apply round r - 1
    now leaves itself out of its own leader candidates (AWB methods), while another candidate remains."""
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from tests.rules_util import make_rules

    ids = [str(Identity.generate().peer_id) for _ in range(3)]
    recs = [peer_record(p, address=f"127.0.0.1:{7001 + k}", round=5, weights_digest="d") for k, p in enumerate(ids)]
    live = {r.peer_id: r for r in recs}

    def candidates(run: RunConfig, evidence) -> list:
        rules = make_rules(run, NodeConfig(), me=ids[0], round=5, digest="d")
        for r in range(5):  # all three delivered rounds 0-4 in its ledger: established
            rules.state.standing.credit(r, ids)
        rules.profile.supported_tps = evidence
        return rules.leader_candidates(recs, live)[1]

    awb = RunConfig()
    assert ids[0] in candidates(awb, (4, {p: 1000.0 for p in ids}))  # it applied round 4: it may lead round 5
    assert ids[0] not in candidates(awb, None) and len(candidates(awb, None)) == 2  # resumed: the others lead
    assert ids[0] not in candidates(awb, (3, {p: 1000.0 for p in ids}))  # evidence of an older round only
    css = RunConfig(method="css")  # the same steps for everyone: no budget to refuse, it may lead
    assert ids[0] in candidates(css, None)
