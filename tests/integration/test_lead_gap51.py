"""A peer that leaves itself out of the leader candidates for the marks it lacks (``Penalties.lead_gap``) announces
the first round it may lead again (``PeerRecord.lead_from``, ``Penalties.lead_from``); the others take the next
candidate's turn at once instead of waiting a whole plan timeout for its plan (fresh user 51, finding 3: after a
restart, re-sync or join, ``plan_takeover`` in up to 18 rounds of a healthy 3-peer swarm, 4-8 s each). The leader
order, the candidates and the plans accepted are unchanged: a peer announcing a gap that publishes anyway is still
followed. Round rules with fake records (test_late_peer.py's helpers) and the plan agreement over an in-memory DHT:
counts of take-over events and the plans followed, no timing."""

from __future__ import annotations

import asyncio
import json

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanStore, leader_order, obtain_plan
from geomesh_p2p.round.planning import announced_gaps
from geomesh_p2p.round.rules.penalties import MARK_SPAN_ROUNDS, OWNER_PENALTY_ROUNDS
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from tests.integration.test_late_peer import RUN, R, _node
from tests.records_util import peer_record
from tests.unit.test_round import MemoryDHT

pytestmark = pytest.mark.timeout(60)
T = 1.0  # plan timeout, s: the wait a gapped first-ranked candidate cost (only counts are asserted)


def _swarm() -> tuple[list[Identity], list[PeerRecord]]:
    """Three peers whose round-R leader order ranks the third (the gapped one, G) first."""
    while True:
        idents = [Identity.generate() for _ in range(3)]
        ids = [str(i.peer_id) for i in idents]
        if leader_order(RUN.run_id, R, ids)[0] == ids[2]:
            break
    recs = [
        peer_record(i, address=f"127.0.0.1:{7000 + k}", tokens_per_s={4: 600.0, 8: 1000.0}, round=R, weights_digest="d")
        for k, i in enumerate(idents)
    ]
    return idents, recs


def _with_gap(rec: PeerRecord, lead_from: int) -> PeerRecord:
    """``rec`` announcing ``lead_from``, round-tripped on the wire."""
    return PeerRecord.from_bytes(json.dumps({**json.loads(rec.to_bytes()), "lead_from": lead_from}).encode())


async def _round(announce: bool, rogue_publishes: bool = False) -> tuple[list, list[dict], list[str]]:
    """Round R agreed by the three peers, G having restarted without its history (it holds no mark: lead_gap).
    ``announce``: G's record carries its ``lead_from`` (else: as before this change). Returns the leaders followed
    (per peer), the ``plan_takeover`` events, and the peer ids (A, B, G)."""
    idents, recs = _swarm()
    ids = [x.peer_id for x in recs]
    g = ids[2]
    nodes = {p: _node(recs, p, marks_from=None if p == g else 0) for p in ids}
    gap_end = nodes[g].penalties.lead_from(R)
    assert nodes[g].penalties.lead_gap(R) is not None and gap_end == R + MARK_SPAN_ROUNDS
    members = recs[:2] + [_with_gap(recs[2], gap_end) if announce else recs[2]]
    live = {x.peer_id: x for x in members}
    dht = MemoryDHT()
    if rogue_publishes:  # G publishes although it announced a gap: still ranked first, so followed
        assert await PlanStore(dht.view(), idents[2], RUN.run_id).publish(nodes[g].make_plan(members, g))

    async def agree(k: int):
        p, node = ids[k], nodes[ids[k]]
        cands = node.leader_candidates(members, live)[1]
        assert (g in cands) == (p != g)  # G leaves itself out; the others rank it as before
        got = await obtain_plan(
            PlanStore(dht.view(), idents[k], RUN.run_id),
            R,
            members,
            node.make_plan,
            plan_timeout_s=T,
            settle_s=0.05,
            poll_s=0.05,
            accept=lambda plan: node.plan_problem(plan, live),
            candidates=cands,
            gapped=announced_gaps(live, cands, R, p),
        )
        return None if got is None else got.leader

    with events.capture("plan_takeover") as takeovers:
        led = await asyncio.gather(*(agree(k) for k in range(3)))
    return list(led), list(takeovers), ids


async def test_the_next_candidate_leads_without_the_gapped_peers_wait():
    led, takeovers, ids = await _round(announce=False)
    nxt = leader_order(RUN.run_id, R, ids)[1]
    assert led == [nxt] * 3
    assert [(e["peer"], e["turn"]) for e in takeovers] == [(nxt, 1)]  # before: one whole plan timeout waited
    led, takeovers, ids = await _round(announce=True)
    nxt = leader_order(RUN.run_id, R, ids)[1]
    assert led == [nxt] * 3 and takeovers == []  # after: its turn at once, the same leader followed by all


async def test_a_peer_announcing_a_gap_that_publishes_anyway_is_still_followed():
    led, takeovers, ids = await _round(announce=True, rogue_publishes=True)
    assert led == [ids[2]] * 3 and takeovers == []  # the order is unchanged: nothing gained, nothing split


def test_lead_from_is_the_first_round_lead_gap_lets_it_lead():
    """Every run shape (own marks, owner penalties, applied): applying each round from R on, ``lead_gap`` first
    returns None at ``lead_from(R)`` exactly (R itself: None, no gap)."""
    _, recs = _swarm()
    shapes = [None, (0, R - 1), (0, R - 2), (2, R - 1), (R - 1, R - 1), (1, R - 3)]
    for own in shapes:
        for owners in shapes:
            for applied in shapes:
                pen = _node(recs, recs[0].peer_id).penalties
                pen.state.round = R
                pen.own_known, pen.owners_known, pen.applied = own, owners, applied
                announced = pen.lead_from(R)
                r = R
                while pen.lead_gap(r) is not None:
                    assert pen.lead_from(r) is not None and pen.lead_from(r) > r
                    pen.note_applied(r)
                    r += 1
                    assert r <= R + MARK_SPAN_ROUNDS + OWNER_PENALTY_ROUNDS
                assert (announced, pen.lead_from(r)) == (None if r == R else r, None), (own, owners, applied)


def test_the_field_is_absent_at_its_default():
    _, recs = _swarm()
    assert b"lead_from" not in recs[0].to_bytes()
    assert _with_gap(recs[0], R + 18).lead_from == R + 18


def test_the_record_announces_the_gap_in_sync_only():
    """``node.training.record_state``: the gapped peer names ``lead_from`` (its own marks' run restarts at R: R + 18),
    a holder names none, a syncing peer none; without delivered evidence of round R - 1 (resumed) a method of per-peer
    budgets leaves it out of round R too (``NodeRoundPolicy.leader_candidates``), so it names R + 1."""
    from types import SimpleNamespace

    from geomesh_p2p.config.method import MethodRule
    from geomesh_p2p.node.training import record_state

    _, recs = _swarm()
    for marks_from, syncing, want in ((None, False, R + MARK_SPAN_ROUNDS), (0, False, None), (None, True, None)):
        policy = _node(recs, recs[0].peer_id, marks_from=marks_from)
        node = SimpleNamespace(
            resync=SimpleNamespace(syncing=syncing), round=R, digest="d", penalties=policy.penalties, policy=policy
        )
        assert record_state(node)["lead_from"] == want
        assert policy.announced_lead_from == want  # what it keeps to (test_lead_gap51_red: the gap kept)
    policy.profile.supported_tps = None
    policy.penalties.held_since(0)
    assert policy.lead_from(R) == (R + 1 if MethodRule.from_run(RUN).balanced else None)
