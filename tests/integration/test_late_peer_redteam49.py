"""Red team of session 49's late-peer rule (trust/probation.py, "A late peer"): a late-marked leader's own plan, and
honest followers holding different late marks. The round rules with fake records and part results (test_late_peer.py's
helpers): counts and budgets, no timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integration.test_late_peer import _budget, _next_round, _node, _records

pytestmark = pytest.mark.timeout(60)


def _late_round(nodes, plan, late: str) -> None:
    """Apply ``plan``'s round on ``nodes``: every part had a result, ``late``'s pushes came after they closed."""
    ar = SimpleNamespace(
        contributors={
            j: [(a.peer_id, a.token_budget) for a in plan.assignments if a.peer_id != late]
            for j in range(len(plan.owners()))
        },
        missing_parts=[],
    )
    for node in nodes:
        _next_round(node, plan, ar)


@pytest.mark.xfail(
    strict=True,
    reason="red team 49, open: refused as a plain reason (as a benched leader is), the e2e killed-peer run forked: "
    "k2 restarted fresh, held no mark of itself, led round 7 and followed its own plan (a zero update of its part "
    "for the others); a fix needs the late peer to know its own mark",
)
def test_a_late_marked_leader_is_refused():
    """A graced no-show is planned, not benched, so the no-show leader bar does not hold it: its own plan (restarted,
    its own mark is not restored; or rogue) gives it 2.1x the budget the honest leader gives it, and followers take
    it (never more than an unmarked peer gets: the mark's ceiling is escaped, no share is gained)."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    x = ids[3]
    live = {r.peer_id: r for r in recs}
    leader, follower, late = _node(recs, ids[0]), _node(recs, ids[1]), _node(recs, x)
    _late_round([leader, follower, late], leader.planning.build_plan(recs, ids[0]), x)
    honest = leader.planning.build_plan(recs, ids[0])
    late.penalties.late = {}  # restore() never brings back a peer's own mark
    own = late.planning.build_plan(recs, x)
    assert _budget(own, x) > 2 * _budget(honest, x)
    assert follower.plan_problem(honest, live) is None
    assert "marked late" in (follower.plan_problem(own, live) or "")


@pytest.mark.xfail(
    strict=True,
    reason="red team 49, open: late marks are one peer's history; a follower without them "
    "(joined or re-synced during the mark) refuses the honest plan at the halved ceiling",
)
def test_a_follower_without_the_marks_accepts_the_plan_after_a_second_miss():
    recs = _records()
    ids = [x.peer_id for x in recs]
    x = ids[3]
    live = {r.peer_id: r for r in recs}
    leader, follower = _node(recs, ids[0]), _node(recs, ids[1])
    for _ in range(2):  # late twice: benched, marked at a quarter of its rate for 8 rounds past the bench
        _late_round([leader, follower], leader.planning.build_plan(recs, ids[0]), x)
    for node in (leader, follower):  # back after the bench; the others delivered the round before
        node.state.round += 4
        node.profile.supported_tps = (node.state.round - 1, {p: 1000.0 for p in ids[:3]})
    plan = leader.planning.build_plan(recs, ids[0])
    assert x in plan.participants()
    assert follower.plan_problem(plan, live) is None  # it holds the marks
    follower.penalties.late, follower.penalties.noshow = {}, {}  # a peer that joined or re-synced meanwhile
    assert follower.plan_problem(plan, live) is None
