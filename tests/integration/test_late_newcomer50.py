"""A late newcomer on probation gets less work, not a bench, when it delivered the round before (session 50).

The e2e young swarm (``tests/e2e/test_young_swarm.py``) failed once under load: both newcomers pushed after the parts
closed once each during their probation, round 4 and round 8, each after a delivered round, and each was benched
``PROBATION_NOSHOW_PENALTY_ROUNDS`` (10) as an identity that never delivers is, so no round held all three peers within
the test's bound. Now ``Penalties._mark_late`` graces a probation no-show in ``delivered_before`` that holds no mark as
it graces an established one: marked late, planned at its late ceiling within the probation budget cap, no leader. An
identity that never delivered and a second miss while marked are benched 10 rounds as before. Round rules with fake
records and part results (test_late_peer.py's helpers): exact rounds, budgets and reasons, no timing."""

from __future__ import annotations

import pytest

from geomesh_p2p.plan.bounds import LATE_RATE_SHARE
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.trust.standing import Standing
from tests.integration.test_late_peer import RUN, R, _ar, _budget, _next_round, _records
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)


def _newcomer_node(recs: list[PeerRecord], me: str, delivered_before: bool) -> NodeRoundPolicy:
    """Peer ``me``'s rules at round ``R``: ids 0-2 delivered in rounds 0..R-1 (established), ``recs[3]`` (the newcomer)
    in round R-1 only when ``delivered_before`` (standing 1, or 0: on probation either way, threshold 3); the delivered
    rates of round R-1 as every peer that applied it holds them."""
    ids = [x.peer_id for x in recs]
    standing = Standing()
    for r in range(R):
        standing.credit(r, ids if (r == R - 1 and delivered_before) else ids[:3])
    node = make_rules(RUN, me=me, round=R, digest="d", numel=200_000, standing=standing, marks_from=0)
    node.profile.supported_tps = (R - 1, {p: 1000.0 for p in (ids if delivered_before else ids[:3])})
    return node


def _probation_of(plan, pid: str) -> bool:
    return next(a.probation for a in plan.assignments if a.peer_id == pid)


def test_a_newcomer_late_after_a_delivered_round_is_graced_and_planned_at_its_ceiling():
    recs = _records()
    ids = [x.peer_id for x in recs]
    new = ids[3]
    live = {x.peer_id: x for x in recs}
    leader, follower, itself = (_newcomer_node(recs, p, True) for p in (ids[0], ids[1], new))
    plan = leader.planning.build_plan(recs, ids[0])
    assert plan.participants() == sorted(ids) and plan.probation() == [new]  # its one probation slot (3 established)
    a = next(a for a in plan.assignments if a.peer_id == new)
    ceiling = LATE_RATE_SHARE * a.token_budget / a.predicted_compute_s
    for node in (leader, follower, itself):  # every peer, the newcomer too, computes the same marks
        _next_round(node, plan, _ar(plan, {new}))
        assert node.penalties.noshows() == {}  # not benched: it delivered in round R-1
        assert node.penalties.late_marks() == {new: (R + pb.LATE_MARK_ROUNDS, pytest.approx(ceiling))}
        assert new in node.penalties.unled()
    nxt = leader.planning.build_plan(recs, ids[0])
    assert nxt.participants() == plan.participants() and nxt.probation() == [new]  # back at once, still on probation
    c = next(a for a in nxt.assignments if a.peer_id == new)
    assert 0 < c.token_budget <= ceiling * c.predicted_compute_s * (1 + 1e-9)  # at its late ceiling
    assert c.token_budget <= LATE_RATE_SHARE * _budget(plan, new) + 1
    assert c.part_end == c.part_start  # owns no part
    assert all(_budget(nxt, p) == _budget(plan, p) for p in ids[:3])  # the established peers' work as it was
    # a follower holding the same marks accepts the plan that brings it back at its ceiling
    assert follower.plan_problem(nxt, live) is None
    assert itself.plan_problem(nxt, live) is None
    # a second miss while marked benches it PROBATION_NOSHOW_PENALTY_ROUNDS, and the mark outlasts the bench
    for node in (leader, follower, itself):
        _next_round(node, nxt, _ar(nxt, {new}))
        assert node.penalties.noshows() == {new: R + 1 + pb.PROBATION_NOSHOW_PENALTY_ROUNDS}
        until, again = node.penalties.late_marks()[new]
        assert until == R + 1 + pb.PROBATION_NOSHOW_PENALTY_ROUNDS + pb.LATE_MARK_ROUNDS
        assert again <= LATE_RATE_SHARE * ceiling * (1 + 1e-9)
    assert new not in leader.planning.build_plan(recs, ids[0]).participants()


def test_a_newcomer_that_never_delivered_is_benched_ten_rounds_as_before():
    recs = _records()
    ids = [x.peer_id for x in recs]
    new = ids[3]
    leader, follower = (_newcomer_node(recs, p, False) for p in (ids[0], ids[1]))
    plan = leader.planning.build_plan(recs, ids[0])
    assert plan.probation() == [new] and _probation_of(plan, new)
    for node in (leader, follower):
        _next_round(node, plan, _ar(plan, {new}))
        assert node.penalties.noshows() == {new: R + pb.PROBATION_NOSHOW_PENALTY_ROUNDS}
        assert node.penalties.late_marks()[new][0] == R + pb.PROBATION_NOSHOW_PENALTY_ROUNDS + pb.LATE_MARK_ROUNDS
    nxt = leader.planning.build_plan(recs, ids[0])
    assert nxt.participants() == sorted(ids[:3]) and nxt.probation() == []
    # a follower holding the same bench follows the plan without it
    assert follower.plan_problem(nxt, {x.peer_id: x for x in recs}) is None


def test_a_newcomer_delivering_every_other_round_is_graced_once_per_mark():
    """Deliver, miss (graced), deliver, miss: the second miss falls within the mark and benches it; no second grace
    until the bench and the mark are over, and its budget never grows past its ceiling meanwhile."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    new = ids[3]
    node = _newcomer_node(recs, ids[0], True)
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {new}))  # round R: late, graced
    ceiling = node.penalties.late_ceilings()[new]
    plan = node.planning.build_plan(recs, ids[0])
    c = next(a for a in plan.assignments if a.peer_id == new)
    assert c.token_budget <= ceiling * c.predicted_compute_s * (1 + 1e-9)
    _next_round(node, plan, _ar(plan, set()))  # round R + 1: delivers at its ceiling
    assert node.penalties.noshows() == {}
    plan = node.planning.build_plan(recs, ids[0])
    c = next(a for a in plan.assignments if a.peer_id == new)
    assert c.probation and c.token_budget <= ceiling * c.predicted_compute_s * (1 + 1e-9)  # still within the mark
    _next_round(node, plan, _ar(plan, {new}))  # round R + 2: late again, marked: benched
    assert node.penalties.noshows() == {new: R + 2 + pb.PROBATION_NOSHOW_PENALTY_ROUNDS}
