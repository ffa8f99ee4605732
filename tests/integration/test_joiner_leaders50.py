"""Who may lead, for a follower that lacks the swarm's history (session 50, e2e slow-link joiner at load ~12).

``last_round_leaders`` takes the first level of ``next_leaders(round r - 1's plan)`` that holds one of this peer's
leader candidates, and the candidates leave out the peers it marks late or benched (``Penalties.unled``). The e2e
joiner held no mark: it counted the late-marked FsZb, a participant of round 16, as a candidate, took the level
{FsZb} and refused as content the plan of round 16's leader rPJ succeeding itself, which the two established peers
(both holding FsZb's mark, so no candidate but rPJ in any level) followed; it trained first 8 rounds after its
catch-up. Now each peer announces the marks it holds on itself (``PeerRecord.unled_until``), and a follower that
does not hold the marks of the round takes them (``Penalties.announced_unled``): its level is the holders' again. A
peer's word on itself only: a rogue leader of round r - 1 cannot make the joiner skip an honest candidate.

Round rules with fake records and part results (test_late_peer.py's helpers), and the plan agreement over an
in-memory DHT for the rogue's case: exact levels, reasons and plans followed, no timing."""

from __future__ import annotations

import json
import logging

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanStore, obtain_plan
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round.planning import last_round_leaders, lead_problem
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust import probation as pb
from tests.integration.test_late_peer import RUN, R, _node
from tests.integration.test_late_peer_redteam49 import _late_round
from tests.records_util import peer_record
from tests.unit.test_round import MemoryDHT

pytestmark = pytest.mark.timeout(60)


def _peers(n: int) -> tuple[list[Identity], list[PeerRecord]]:
    idents = [Identity.generate() for _ in range(n)]
    recs = [
        peer_record(i, address=f"127.0.0.1:{7000 + k}", tokens_per_s={4: 600.0, 8: 1000.0}, round=R, weights_digest="d")
        for k, i in enumerate(idents)
    ]
    return idents, recs


def _at(rec: PeerRecord, round: int, unled_until: int | None = None, unled_marks: dict | None = None) -> PeerRecord:
    """``rec`` announced at ``round`` (digest d2), with ``unled_until`` and ``unled_marks`` (the marks it holds on the
    others: what backs a peer's own word, session 52) when given (round-tripped on the wire)."""
    fields = {"round": round, "weights_digest": "d2", **({"unled_until": unled_until} if unled_until else {})}
    fields.update({"unled_marks": unled_marks} if unled_marks else {})
    return PeerRecord.from_bytes(json.dumps({**json.loads(rec.to_bytes()), **fields}).encode())


def test_the_slow_link_joiner_takes_the_holders_level_from_the_late_peers_own_record(caplog):
    """A (rPJ) leads round R with B (FsZb), whose pushes come late: A and B mark B late (graced: it delivered the
    round before). Round R + 1: A's only candidate is A, so the level is all of round R's participants and A succeeds
    itself. The joiner J downloaded round R + 1's state and took round R's plan from the records; without B's word
    it counted B and refused A's plan (the e2e line), with it it takes the holders' level and follows A."""
    _, recs = _peers(3)
    a, b, j = (x.peer_id for x in recs)
    holders = [_node(recs[:2], a), _node(recs[:2], b)]
    plan_r = holders[0].planning.build_plan(recs[:2], a)
    _late_round(holders, plan_r, b)
    mark = R + pb.LATE_MARK_ROUNDS
    assert [n.penalties.late_marks()[b][0] for n in holders] == [mark, mark]
    joiner = _node(recs[:2], j, marks_from=None)  # credits A and B (their attestations); holds no mark
    joiner.state.round = R + 1
    members = [_at(x, R + 1) for x in recs]
    plan_a = holders[0].planning.build_plan(members[:2], a)
    assert plan_a.round == R + 1 and sorted(plan_a.participants()) == sorted([a, b])
    for node in holders:
        live = {x.peer_id: x for x in members}
        cands = node.leader_candidates(members, live)[1]
        assert cands == [a]
        took = last_round_leaders(plan_r, R + 1, cands)
        assert took == frozenset({a, b}) and lead_problem(plan_a, took) is None
    # before: B's record says nothing (a 0.17 peer, or main), and the joiner's level is {B}
    silent = {x.peer_id: x for x in members}
    cands = joiner.leader_candidates(members, silent)[1]
    assert cands == sorted([a, b])
    took = last_round_leaders(plan_r, R + 1, cands)
    assert took == frozenset({b})
    assert lead_problem(plan_a, took) == ContentRefusal(
        f"its leader {a[:10]} may not lead: it had no part in the last round's plan, led it, or was named accused in it"
    )
    # now: B announces its mark and A the mark it holds on B (what backs B's word: session 52), the joiner takes it,
    # and its level is the holders'
    assert [n.penalties.unled_marks() for n in holders] == [{b: mark}, None]
    told = [_at(recs[0], R + 1, unled_marks={b: mark}), _at(recs[1], R + 1, unled_until=mark), members[2]]
    live = {x.peer_id: x for x in told}
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        for _ in range(2):
            cands = joiner.leader_candidates(told, live)[1]
            assert cands == [a]
    said = [r.getMessage() for r in caplog.records if "announce(s) a mark" in r.getMessage()]
    assert said == [
        f"round {R + 1}: this peer lacks the marks of the last rounds; {b[:10]} announce(s) a mark on itself: no "
        "leader candidate here either"
    ]
    took = last_round_leaders(plan_r, R + 1, cands)
    assert took == frozenset({a, b}) and lead_problem(plan_a, took) is None
    assert joiner.plan_problem(plan_a, live) is None
    # B's own plan (a last resort) is taken by the holders and the joiner alike: a late-marked leader is not refused
    plan_b = holders[1].planning.build_plan(members[:2], b)
    assert [holders[0].plan_problem(plan_b, live), joiner.plan_problem(plan_b, live)] == [None, None]
    assert [n.penalties.own_unled_until() for n in holders] == [None, mark]  # what each announces
    # a peer holding the marks goes by its own: a record's word changes nothing there
    assert holders[0].penalties.announced_unled(told) == set()
    assert joiner.penalties.announced_unled(told) == {b}
    joiner.penalties.held_since(0)
    assert joiner.penalties.announced_unled(told) == set()


def test_only_a_mark_in_force_counts_and_the_field_is_absent_without_one():
    _, recs = _peers(2)
    pen = _node(recs, recs[0].peer_id, marks_from=None).penalties
    assert pen.own_unled_until() is None
    assert b"unled_until" not in recs[0].to_bytes()
    me = recs[0].peer_id
    pen.noshow[me] = R + 3
    pen.late[me] = (R + 11, 100.0)
    assert pen.own_unled_until() == R + 11
    pen.state.round = R + 12  # both over: nothing to announce
    assert pen.own_unled_until() is None
    old = _at(recs[1], R, unled_until=R + 11)
    assert old.unled_until == R + 11 and pen.announced_unled([old]) == set()  # ended at round R + 12
    pen.state.round = R + 11
    assert pen.announced_unled([old]) == {recs[1].peer_id}


async def _follow(store: PlanStore, r: int, cands: list[str], accept, plan_timeout_s: float = 0.3):
    """What a follower that is no candidate obtains for round ``r`` (None: no plan it accepts appeared)."""

    def never(*_args):
        raise AssertionError("a follower does not lead here")

    return await obtain_plan(
        store, r, [], never, plan_timeout_s=plan_timeout_s, settle_s=0.05, poll_s=0.05, accept=accept, candidates=cands
    )


async def _follow_as(node, store: PlanStore, plan_r, members, live, me: str) -> tuple[frozenset, object]:
    """``node`` (peer ``me``) follows round ``R + 1`` as the driver would: its leader candidates, the level of
    ``plan_r`` (round R's plan) they give, the plans of that level's other candidates it accepts. Returns the level and
    the leader it followed (None: no plan)."""
    cands = node.leader_candidates(members, live)[1]
    took = last_round_leaders(plan_r, R + 1, cands)

    def accept(plan):
        return lead_problem(plan, took) or node.plan_problem(plan, live)

    got = await _follow(store, R + 1, [c for c in cands if c in took and c != me], accept)
    return took, (got.leader if got is not None else None)


@pytest.mark.parametrize("honest_publishes", [True, False])
async def test_a_rogue_succeeding_itself_does_not_take_the_joiner_away_from_the_honest_plan(honest_publishes):
    """L led round R with X and H; H was late in it (marked, and announces it). L publishes round R + 1's plan
    anyway (self-succession), X publishes its own. The holders take the level {X, H} (X is a candidate) and refuse
    L's plan as content; the joiner, holding no mark but reading H's, takes the same level: it follows X's plan
    whichever ranks first, and with X silent it follows none (no plan), never L's alone. H's word cannot change
    that, and L has no word on X's behalf (a record is signed by its peer)."""
    idents, recs = _peers(4)
    ids = [x.peer_id for x in recs]
    lead, x, h, j = ids
    nodes = {p: _node(recs[:3], p) for p in (lead, x, h)}
    plan_r = nodes[lead].planning.build_plan(recs[:3], lead)
    _late_round(list(nodes.values()), plan_r, h)
    mark = nodes[h].penalties.own_unled_until()
    assert mark == R + pb.LATE_MARK_ROUNDS
    joiner = _node(recs[:3], j, marks_from=None)
    joiner.state.round = R + 1
    assert nodes[x].penalties.unled_marks() == {h: mark}  # X's record backs H's word (session 52); L, the rogue, not
    members = [
        _at(recs[0], R + 1),
        _at(recs[1], R + 1, unled_marks={h: mark}),
        _at(recs[2], R + 1, unled_until=mark),
        _at(recs[3], R + 1),
    ]
    live = {p.peer_id: p for p in members}
    dht = MemoryDHT()
    rogue = nodes[lead].planning.build_plan(members[:3], lead)
    honest = nodes[x].planning.build_plan(members[:3], x)
    assert await PlanStore(dht.view(), idents[0], RUN.run_id).publish(rogue)
    if honest_publishes:
        assert await PlanStore(dht.view(), idents[1], RUN.run_id).publish(honest)
    followed = {}
    for p, node in [(x, nodes[x]), (h, nodes[h]), (j, joiner)]:
        store = PlanStore(dht.view(), idents[ids.index(p)], RUN.run_id)
        took, followed[p] = await _follow_as(node, store, plan_r, members, live, p)
        assert took == frozenset({x, h}), p  # X is a candidate of each: L may not succeed itself
        assert lead_problem(rogue, took) is not None and lead_problem(honest, took) is None
    assert followed == ({x: x, h: x, j: x} if honest_publishes else {x: None, h: None, j: None})
