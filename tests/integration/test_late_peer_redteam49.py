"""Red team of session 49's late-peer rule (trust/probation.py, "A late peer"): a late-marked leader's own plan, and
honest followers holding different late marks. The round rules with fake records and part results (test_late_peer.py's
helpers): counts and budgets, no timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.trust import probation as pb
from tests.integration.test_late_peer import R, _ar, _budget, _next_round, _node, _records

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


def test_a_late_peer_restarted_fresh_does_not_lead_and_a_rogue_ones_plan_is_not_refused():
    """A graced no-show is planned, not benched, so the no-show leader bar does not hold it: its own plan (restarted
    without its history, or rogue) gives it 2.1x the budget the honest leader gives it. The late peer restarted
    fresh, which holds no mark of itself, is no leader candidate of its own while it cannot know its marks
    (``Penalties.lead_gap``, session 50; refusing its plan alone forked the e2e killed-peer run in session 49: k2 led
    round 7 and followed its own plan). A rogue late peer's plan is still taken (open, bounded: no more than an
    unmarked peer's budget): refusing it splits the followers that joined since the mark off (red team 50,
    ``test_marks_redteam50``)."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    x = ids[3]
    live = {r.peer_id: r for r in recs}
    leader, follower, late = _node(recs, ids[0]), _node(recs, ids[1]), _node(recs, x)
    _late_round([leader, follower, late], leader.planning.build_plan(recs, ids[0]), x)
    assert x not in late.leader_candidates(recs, live)[1]  # with its history it holds its own mark (as before)
    # restarted without --resume: it downloaded round R + 1's state, then applied round R + 1 with the others
    fresh = _node(recs, x, marks_from=None)
    fresh.state.round = R + 1
    nxt = leader.planning.build_plan(recs, ids[0])
    assert [_budget(nxt, p) for p in ids] == [4864, 4864, 4864, 2304]  # x at its late ceiling
    for node in (leader, follower, fresh):
        _next_round(node, nxt, _ar(nxt, set()))
    assert fresh.penalties.late_marks() == {} and fresh.planning.delivered_evidence(R + 2) is not None
    assert fresh.penalties.lead_gap(R + 2) == (
        f"it knows the marks the others took on it in rounds {R + 1}-{R + 1} only, not in each of rounds 0-{R + 1}"
    )
    assert fresh.leader_candidates(recs, live)[1] == sorted(ids[:3])  # before: x among them, first in some rounds
    honest = leader.planning.build_plan(recs, ids[0])
    own = fresh.planning.build_plan(recs, x)  # what it would publish as a last resort (or a rogue's plan)
    assert [_budget(honest, p) for p in ids] == [4864, 4864, 4864, 2304]
    assert [_budget(own, p) for p in ids] == [4864, 4864, 4864, 4864]  # 2.1x its honest budget
    assert follower.plan_problem(honest, live) is None
    assert follower.plan_problem(own, live) is None  # every follower alike, with or without the mark
    assert fresh.plan_problem(honest, live) is None  # and it follows the honest plan that plans it low


def _skip_bench(node, rounds: int) -> None:
    """``rounds`` rounds applied by ``node`` that planned nobody it marks (the late peer's bench)."""
    for _ in range(rounds):
        node.penalties.note_applied(node.state.round)
        node.state.round += 1


def test_a_follower_without_the_marks_accepts_the_plan_after_a_second_miss():
    """Late marks are one peer's history: a follower that joined or re-synced during one held none and refused the
    honest plan that brings a twice-late peer back at a quarter of its rate (an under-plan in its view). Now a follower
    that did not apply every round a mark can come from sets no low end for a peer without a delivered rate
    (``Penalties.follower_late``; session 50)."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    x = ids[3]
    live = {r.peer_id: r for r in recs}
    leader, follower = _node(recs, ids[0]), _node(recs, ids[1])
    for _ in range(2):  # late twice: benched, marked at a quarter of its rate for 8 rounds past the bench
        _late_round([leader, follower], leader.planning.build_plan(recs, ids[0]), x)
    for node in (leader, follower):  # back after the bench; the others delivered the round before
        _skip_bench(node, pb.NOSHOW_PENALTY_ROUNDS + 1)
        node.profile.supported_tps = (node.state.round - 1, {p: 1000.0 for p in ids[:3]})
    plan = leader.planning.build_plan(recs, ids[0])
    assert plan.round == R + 3 + pb.NOSHOW_PENALTY_ROUNDS and x in plan.participants()
    assert [_budget(plan, p) for p in ids] == [4864, 4864, 4864, 1024]  # x at a quarter of its rate
    assert follower.plan_problem(plan, live) is None  # it holds the marks
    # a follower that joined (or re-synced) in the last round, which it applied with the others
    joiner = _node(recs, ids[1], marks_from=None)
    joiner.state.round = plan.round
    joiner.penalties.note_applied(plan.round - 1)
    joiner.profile.supported_tps = follower.profile.supported_tps
    seen = joiner.penalties.follower_late(
        plan.round, plan.participants(), joiner.planning.delivered_evidence(plan.round)
    )
    assert (dict(seen), seen.blind) == ({p: 1000.0 for p in ids[:3]}, frozenset({x}))
    assert joiner.plan_problem(plan, live) is None
    # the same view holding the whole span but no mark (as every follower did before): the under-plan refusal
    forgetful = _node(recs, ids[1])
    forgetful.state.round = plan.round
    forgetful.penalties.held_since(0)
    forgetful.profile.supported_tps = follower.profile.supported_tps
    assert (forgetful.plan_problem(plan, live) or "").startswith(f"{x[:10]} gets ")
