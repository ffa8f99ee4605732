"""Penalty marks are each peer's history of the rounds it applied (session 50). A peer that joined by download,
restarted without ``--resume``, re-synced, was planned out or killed mid-round lacks some: as leader it planned
itself or others as the rest refuse (a late-marked leader's own budget, a part to a barred owner), as follower it
refused honest plans it could not check (a twice-late peer back at a quarter of its rate). The rules now track which
rounds a peer applied (``Penalties.applied``) and whose marks on itself it knows (``own_known``): it leads only
holding the marks its plan must agree with (``lead_gap``), and as follower it sets no low end it cannot know
(``follower_late``). Round rules with fake records and part results (test_late_peer.py's helpers): exact rounds,
budgets and reasons, no timing."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.planner import make_plan
from geomesh_p2p.round.rules import OWNER_PENALTY_ROUNDS, Penalties, RoundState
from geomesh_p2p.round.rules.penalties import MARK_SPAN_ROUNDS
from geomesh_p2p.trust import probation as pb
from tests.integration.test_late_peer import RUN, R, _ar, _budget, _next_round, _node, _records

pytestmark = pytest.mark.timeout(60)
ME = "Me" * 22


def _pen(round: int) -> Penalties:
    return Penalties(RoundState(me=ME, round=round))


def test_the_span_a_mark_can_reach_and_the_runs_of_rounds_applied():
    assert MARK_SPAN_ROUNDS == pb.PROBATION_NOSHOW_PENALTY_ROUNDS + pb.LATE_MARK_ROUNDS == 18
    fresh = _pen(0)  # a swarm's first round: no mark exists before it
    assert fresh.holds(0) and fresh.lead_gap(0) is None
    fresh.note_applied(0)
    assert fresh.holds(1) and fresh.lead_gap(1) is None
    joiner = _pen(20)  # joined by download at round 20
    assert not joiner.holds(20) and not joiner.holds(20, own=True)
    assert joiner.lead_gap(20) == "it knows the marks the others took on it in no round, not in each of rounds 2-19"
    for m in range(20, 20 + MARK_SPAN_ROUNDS):
        joiner.note_applied(m)
    assert (joiner.applied, joiner.own_known) == ((20, 37), (20, 37))
    assert not joiner.holds(37) and joiner.holds(38) and joiner.lead_gap(38) is None
    assert not joiner.holds(39)  # round 38 not applied (yet): its marks are unknown here


def test_a_round_seen_but_not_applied_breaks_the_marks_on_others_not_those_on_itself():
    """Planned out of (or sitting out) round 30, this peer knows nobody marked it (or took the marks itself), but
    not whom the others marked: it may not lead for OWNER_PENALTY_ROUNDS rounds (a part to an owner they bar would be
    refused), and it checks plans without the low ends for MARK_SPAN_ROUNDS rounds."""
    pen = _pen(31)
    pen.held_since(0)
    pen.applied = pen.owners_known = (0, 29)  # round 30: planned out, then re-synced to round 31
    pen.note_own_known(30)
    assert pen.holds(31, own=True) and not pen.holds(31, OWNER_PENALTY_ROUNDS)
    assert pen.lead_gap(31) == "it applied rounds 0-29 only, not each of rounds 26-30 (owner penalties)"
    for m in range(31, 31 + OWNER_PENALTY_ROUNDS):
        pen.note_applied(m)
    assert pen.lead_gap(36) is None and not pen.holds(36)
    for m in range(36, 31 + MARK_SPAN_ROUNDS):
        pen.note_applied(m)
    assert pen.holds(31 + MARK_SPAN_ROUNDS)


def test_the_driver_hooks_note_what_this_peer_saw():
    """``after_exchange`` notes the round applied, ``planned_out`` the round whose own marks are known, a stalled
    round (``note_own_failures(stalled=True)``) the same; a re-sync to another lineage cuts both runs."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    node = _node(recs, ids[0])
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, set()))
    assert (node.penalties.applied, node.penalties.own_known) == ((0, R), (0, R))
    node.planned_out(R + 1, plan.model_copy(update={"round": R + 1}))
    assert (node.penalties.applied, node.penalties.own_known) == ((0, R), (0, R + 1))
    stalled = plan.model_copy(update={"round": R + 2})
    node.note_own_failures(SimpleNamespace(round=R + 2, owners=[]), stalled, _ar(stalled, set()), stalled=True)
    assert node.penalties.own_known == (0, R + 2)
    assert node.forget_marks_since(R) == []  # it applied round R, and the swarm did not confirm its state since
    assert (node.penalties.applied, node.penalties.own_known) == ((0, R - 1), (0, R - 1))
    # planned out of round R + 5, then re-synced to a state it did not make (the driver's forget_blame): the own
    # marks of that round are known, as nobody marked it; only applied rounds of the dropped lineage go
    node.penalties.applied = node.penalties.own_known = (0, R + 4)
    node.planned_out(R + 5, plan.model_copy(update={"round": R + 5}))
    assert node.forget_marks_since(R + 5) == []
    assert (node.penalties.applied, node.penalties.own_known) == ((0, R + 4), (0, R + 5))


def test_the_runs_survive_a_checkpoint_and_an_older_one_counts_as_whole():
    pen = _pen(40)
    pen.applied, pen.own_known = (22, 39), (12, 39)
    back = _pen(40)
    back.restore(json.loads(json.dumps(pen.to_meta())))
    assert (back.applied, back.own_known) == ((22, 39), (12, 39))
    old = _pen(40)  # a checkpoint of 0.17 holds no runs: the marks it holds are all it had, as before
    old.restore({"owner": {}, "noshow": {}, "late": {}})
    assert (old.applied, old.own_known) == ((0, 39), (0, 39)) and old.lead_gap(40) is None
    edited = _pen(40)  # runs past the checkpoint's round, or malformed: none
    edited.restore({"applied": [0, 40], "own_known": [3, "39"]})
    assert (edited.applied, edited.own_known) == (None, None)
    assert _pen(40).to_meta()["applied"] is None


def test_a_follower_without_the_span_keeps_a_low_end_at_each_delivered_rate():
    """Without the history a follower drops no low end below a participant's delivered rate: an honest leader holding
    every mark plans it at no less (its ceiling is at least the rate of the plan it delivered). A leader planning a
    peer that delivered at 1000 tokens/s at a quarter of it is refused by full followers and this one alike."""
    recs = _records()
    ids = [x.peer_id for x in recs]
    live = {x.peer_id: x for x in recs}
    joiner = _node(recs, ids[1], marks_from=None)
    joiner.penalties.note_applied(R - 1)
    full = _node(recs, ids[1])
    cfg = full.planning.plan_config(4)
    supported = {p: 1000.0 for p in ids}
    kw = dict(
        run_id=RUN.run_id, round=R, leader=ids[0], numel=200_000, start_digest="d", supported_tokens_per_s=supported
    )
    low = make_plan(recs, cfg, start_time=swarm_time(), late_tokens_per_s={ids[2]: 250.0}, **kw)
    honest = make_plan(recs, cfg, start_time=swarm_time(), **kw)
    assert [_budget(low, p) for p in ids] == [4864, 4864, 1024, 4864]
    seen = joiner.penalties.follower_late(R, low.participants(), supported)
    assert (dict(seen), seen.blind) == ({p: 1000.0 for p in ids}, frozenset())
    for node in (joiner, full):
        assert node.plan_problem(honest, live) is None
        assert node.plan_problem(low, live) == (
            f"{ids[2][:10]} gets 4 inner steps (1024 tokens), under the 2304 its record at 1/2 of its tokens/s and its "
            f"delivered work fit in the {low.window_s:.3g} s window, and no cap of the plan explains fewer"
        )


def test_the_no_shows_left_out_are_named(caplog):
    recs = _records()
    ids = [x.peer_id for x in recs]
    node = _node(recs, ids[0])
    node.profile.supported_tps = (R - 1, {p: 1000.0 for p in ids[:3]})  # ids[3] delivered nothing the round before
    plan = node.planning.build_plan(recs, ids[0])
    _next_round(node, plan, _ar(plan, {ids[3]}))
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        node.planning.build_plan(recs, ids[0])
    assert f"0 of 0 on probation; 1 no-show(s) left out ({ids[3][:10]})" in caplog.text


def test_one_line_says_why_this_peer_leads_nothing(caplog):
    recs = _records()
    ids = [x.peer_id for x in recs]
    live = {x.peer_id: x for x in recs}
    node = _node(recs, ids[0], marks_from=None)
    node.penalties.note_applied(R - 1)  # joined at round R - 1
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        for _ in range(3):
            assert node.leader_candidates(recs, live)[1] == sorted(ids[1:])
    said = [r.getMessage() for r in caplog.records if "no leader candidate" in r.getMessage()]
    assert said == [
        f"round {R}: this peer is no leader candidate: it knows the marks the others took on it in rounds {R - 1}-"
        f"{R - 1} only, not in each of rounds 0-{R - 1} (its plan could break a mark the others hold)"
    ]
    alone = _node(recs[:1], ids[0], marks_from=None)  # the only candidate it sees: it leads (the last resort's case)
    assert alone.leader_candidates(recs[:1], {ids[0]: recs[0]})[1] == [ids[0]]


def test_a_peer_killed_mid_round_and_resumed_behind_the_swarm_does_not_lead_on_its_checkpoint():
    """Killed in round 40 (its checkpoint: round 40's start, every round before applied), resumed when the swarm was
    at round 42: the others marked it in round 40 (a no-show), and it cannot know. Before it led as soon as its turn
    came, with no mark of itself; now it is no candidate of its own until it knows its marks of 18 rounds again."""
    before = _pen(40)
    before.held_since(0)
    resumed = _pen(40)
    resumed.restore(json.loads(json.dumps(before.to_meta())))
    assert resumed.lead_gap(40) is None  # resumed where the swarm is: it goes on as before its stop
    resumed.state.round = 42  # the swarm was ahead: caught up by download
    resumed.note_applied(42)
    assert resumed.lead_gap(43) == (
        "it knows the marks the others took on it in rounds 42-42 only, not in each of rounds 25-42"
    )
    for m in range(43, 42 + MARK_SPAN_ROUNDS):
        resumed.note_applied(m)
    assert resumed.lead_gap(42 + MARK_SPAN_ROUNDS) is None
