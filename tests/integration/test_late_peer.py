"""A late peer gets less work, a free rider is still benched (session 49; trust/probation.py, "A late peer").

An honest but slow peer whose pushes reach the owners after the parts closed is, for every other peer, in no part's
contributors: a no-show. Benched for it, it came back with the same budget and was late again (rows per round
4,3,3,2,3,2 in a 4-peer run). Now an established no-show that delivered the round before and holds no late mark stays
planned at half the rate its plan gave it, for ``LATE_MARK_ROUNDS`` rounds, and is no leader candidate meanwhile; a
miss while marked or after a round without delivered work benches it as before (on probation too, since session 50:
test_late_newcomer50.py). Unit tests of the
round rules with fake records and part results (counts and budgets, no timing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.bounds import LATE_RATE_SHARE, evidence_ceiling_range, evidence_ceilings, late_ceiling
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.planner import check_plan, make_plan
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.round.rules import Penalties, Reprofiler, RoundState
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.trust.standing import Standing
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)
RUN = RunConfig(seq_len=32, window_s=5.0)
R = 5  # the round the scenarios start at (every peer delivered in rounds 0..4)


def _records(n: int = 4) -> list[PeerRecord]:
    ids = [Identity.generate() for _ in range(n)]
    return [
        peer_record(i, address=f"127.0.0.1:{7000 + k}", tokens_per_s={4: 600.0, 8: 1000.0}, round=R, weights_digest="d")
        for k, i in enumerate(ids)
    ]


def _node(recs: list[PeerRecord], me: str, marks_from: int | None = 0) -> NodeRoundPolicy:
    """Peer ``me``'s round rules at round ``R``: it credited every peer in rounds 0..R-1 and holds the rates their
    round R-1 deliveries support (every peer delivered at its record's rate); it applied rounds ``marks_from``..R-1
    (None: none, a peer that joined or restarted without ``--resume``)."""
    standing = Standing()
    for r in range(R):
        standing.credit(r, [x.peer_id for x in recs])
    node = make_rules(
        RUN, NodeConfig(), me=me, round=R, digest="d", numel=200_000, standing=standing, marks_from=marks_from
    )
    node.profile.supported_tps = (R - 1, {x.peer_id: 1000.0 for x in recs})
    return node


def _spec(r: int) -> SimpleNamespace:
    return SimpleNamespace(round=r, owners=[])


def _ar(plan, absent: set[str]) -> SimpleNamespace:
    """The part results of ``plan``'s round: one part, every participant but ``absent`` listed with its budget."""
    return SimpleNamespace(
        contributors={0: [(a.peer_id, a.token_budget) for a in plan.assignments if a.peer_id not in absent]},
        missing_parts=[],
    )


def _next_round(node: NodeRoundPolicy, plan, ar) -> None:
    """What a peer does between rounds for these rules: the exchange's penalties, then the delivered rates."""
    node.after_exchange(_spec(plan.round), plan, ar)
    node.profile.supported_tps = (plan.round, Reprofiler.delivered_rates(plan, ar))
    node.state.round = plan.round + 1


def _budget(plan, pid: str) -> int:
    return next(a.token_budget for a in plan.assignments if a.peer_id == pid)


def test_a_late_peer_stays_planned_with_half_its_rate_and_does_not_lead():
    recs = _records()
    ids = [x.peer_id for x in recs]
    slow = ids[3]
    leader, follower = _node(recs, ids[0]), _node(recs, ids[1])
    plan = leader.planning.build_plan(recs, ids[0])
    assert len(plan.participants()) == 4
    before = _budget(plan, slow)
    for node in (leader, follower):
        _next_round(node, plan, _ar(plan, {slow}))
        assert node.penalties.noshows() == {}  # not benched: it delivered in round R-1
        [(until, ceiling)] = node.penalties.late_marks().values()
        assert until == R + pb.LATE_MARK_ROUNDS
        a = next(a for a in plan.assignments if a.peer_id == slow)
        assert ceiling == pytest.approx(LATE_RATE_SHARE * a.token_budget / a.predicted_compute_s)
        _, cands = node.leader_candidates(recs, {x.peer_id: x for x in recs})
        assert slow not in cands and len(cands) == 3
    nxt = leader.planning.build_plan(recs, ids[0])
    assert nxt.participants() == plan.participants()  # still planned
    assert 0 < _budget(nxt, slow) <= LATE_RATE_SHARE * before
    assert all(_budget(nxt, p) == _budget(plan, p) for p in ids[:3])  # the others' work is as it was
    # a follower holding the same marks accepts the smaller budget
    assert follower.plan_problem(nxt, {x.peer_id: x for x in recs}) is None
    # delivering at the smaller budget keeps it planned there while the mark lasts
    _next_round(leader, nxt, _ar(nxt, set()))
    assert _budget(leader.planning.build_plan(recs, ids[0]), slow) <= LATE_RATE_SHARE * before


def test_a_second_miss_while_marked_benches_and_the_mark_outlasts_the_bench():
    recs = _records()
    ids = [x.peer_id for x in recs]
    slow = ids[3]
    node = _node(recs, ids[0])
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {slow}))
    first = node.penalties.late_ceilings()[slow]
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {slow}))
    assert node.penalties.noshows() == {slow: R + 1 + pb.NOSHOW_PENALTY_ROUNDS}
    until, ceiling = node.penalties.late_marks()[slow]
    assert until == R + 1 + pb.NOSHOW_PENALTY_ROUNDS + pb.LATE_MARK_ROUNDS
    assert ceiling <= LATE_RATE_SHARE * first * (1 + 1e-9)  # planned at the ceiling and late again: halved
    assert slow not in node.planning.build_plan(recs, ids[0]).participants()
    # back after the bench: still marked (a miss now benches at once), at the halved ceiling
    node.state.round = R + 2 + pb.NOSHOW_PENALTY_ROUNDS
    back = node.planning.build_plan(recs, ids[0])
    assert slow in back.participants()
    assert node.penalties.late_ceilings() == {slow: ceiling}


def test_a_free_rider_a_probation_peer_and_a_peer_without_evidence_are_benched_as_before():
    recs = _records()
    ids = [x.peer_id for x in recs]
    node = _node(recs, ids[0])
    node.profile.supported_tps = (R - 1, {p: 1000.0 for p in ids[:3]})  # ids[3] delivered nothing in round R-1
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {ids[3]}))
    assert node.penalties.noshows() == {ids[3]: R + pb.NOSHOW_PENALTY_ROUNDS}
    assert ids[3] not in node.planning.build_plan(recs, ids[0]).participants()
    # the rules alone: no evidence of the round before (this peer did not apply it), or on probation
    pen = Penalties(RoundState(me=ids[0], round=R, digest="d", numel=1, standing=Standing(), history=[]))
    pen.note_no_shows(plan, _ar(plan, {ids[2]}))
    assert set(pen.noshows()) == {ids[2]} and set(pen.late_marks()) == {ids[2]}
    marked = SimpleNamespace(
        round=R, participants=plan.participants, probation=lambda: [ids[1]], assignments=plan.assignments
    )
    pen.note_no_shows(marked, _ar(plan, {ids[1]}), delivered_before=ids[2:])
    assert pen.noshows()[ids[1]] == R + pb.PROBATION_NOSHOW_PENALTY_ROUNDS
    # on probation but delivered the round before: graced as an established peer (session 50, test_late_newcomer50)
    newcomer = SimpleNamespace(
        round=R, participants=plan.participants, probation=lambda: [ids[3]], assignments=plan.assignments
    )
    pen.note_no_shows(newcomer, _ar(plan, {ids[3]}), delivered_before=ids)
    assert ids[3] not in pen.noshows() and ids[3] in pen.late_marks()


def test_this_peer_late_takes_on_the_mark_not_the_bench():
    recs = _records()
    ids = [x.peer_id for x in recs]
    node = _node(recs, ids[3])
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {ids[3]}))
    assert node.penalties.noshows() == {} and set(node.penalties.late_marks()) == {ids[3]}
    _, cands = node.leader_candidates(recs, {x.peer_id: x for x in recs})
    assert ids[3] not in cands


def test_late_ceilings_lower_the_leaders_ceiling_and_the_followers_low_end_only():
    rates = {"a": 100.0, "b": 200.0, "c": 300.0}
    late = {"c": 50.0, "d": 10.0}
    assert evidence_ceilings(["a", "c", "d"], rates, late) == {"a": 200.0, "c": 50.0, "d": 10.0}
    plain = evidence_ceiling_range(["a", "c", "d"], rates)
    ranges = evidence_ceiling_range(["a", "c", "d"], rates, None, late)
    assert ranges["a"] == plain["a"]
    assert ranges["c"] == (50.0, plain["c"][1]) and ranges["d"] == (10.0, plain["d"][1])
    assert late_ceiling(400.0) == 200.0 and late_ceiling(400.0, held=150.0) == 150.0


def test_a_plan_at_the_late_ceiling_needs_the_followers_marks():
    """The follower-side half: a budget at a quarter of the peer's rate (twice late) is an under-plan for a follower
    that holds no mark, and within bounds for one that holds it."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    node = _node(recs, ids[0])
    cfg = node.planning.plan_config(4)
    live = {x.peer_id: x for x in recs}
    supported = {p: 1000.0 for p in ids}
    late = {ids[3]: 250.0}
    kw = dict(run_id=RUN.run_id, round=R, leader=ids[0], numel=200_000, start_digest="d")
    plan = make_plan(recs, cfg, start_time=swarm_time(), supported_tokens_per_s=supported, late_tokens_per_s=late, **kw)
    full = make_plan(recs, cfg, start_time=swarm_time(), supported_tokens_per_s=supported, **kw)
    assert _budget(plan, ids[3]) <= 0.25 * _budget(full, ids[3]) + 256
    assert check_plan(plan, live, cfg, now=swarm_time(), supported=supported, late=late) is None
    assert check_plan(plan, live, cfg, now=swarm_time(), supported=supported) is not None


def test_late_marks_survive_a_checkpoint_and_malformed_ones_are_dropped():
    state = RoundState(me="me", round=R, digest="d", numel=1, standing=Standing(), history=[])
    pen = Penalties(state)
    pen.late = {"peerA": (R + 3, 123.5), "peerB": (R + 1, 0.0), "me": (R + 9, 1.0)}
    meta = pen.to_meta()
    back = Penalties(state)
    back.restore({**meta, "late": {**meta["late"], "x": [1, float("nan")], "y": [1.5, 3.0], "z": [1, 10**400]}})
    # this peer's own mark too, within its longest span from the checkpoint's round (own49: the others keep theirs)
    assert back.late == pen.late
