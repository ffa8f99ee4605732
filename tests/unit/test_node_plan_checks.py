"""A peer refuses plans it must not follow (rogue or broken leader), before choosing among plans."""

from __future__ import annotations

import time

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(30)


def _rec(ident, addr):
    return peer_record(ident, address=addr, round=2, weights_digest="d")


@pytest.fixture
def node_and_plan():
    run = RunConfig(seq_len=32, window_s=5.0)
    ids = [Identity.generate() for _ in range(2)]
    recs = [_rec(ids[0], "127.0.0.1:1001"), _rec(ids[1], "127.0.0.1:1002")]
    node = make_rules(run, NodeConfig(), me=str(ids[0].peer_id), numel=5000).planning
    cfg = PlanConfig(seq_len=32, target_batch=8, window_s=5.0, payload_bytes=1000, mode=run.mode, method=run.method)
    plan = plan_round(
        recs,
        cfg,
        run_id=run.run_id,
        round=2,
        leader=recs[1].peer_id,
        numel=5000,
        start_time=time.time() + 1,
        start_digest="d",
    )
    return node, plan, {r.peer_id: r for r in recs}


def test_a_sane_plan_is_accepted(node_and_plan):
    node, plan, live = node_and_plan
    assert node.plan_problem(plan, live) is None


def test_rogue_or_broken_plans_are_refused(node_and_plan):
    node, plan, live = node_and_plan
    rogue = Identity.generate()
    cases = {
        "parameters": plan.model_copy(update={"numel": 7048}),
        "not a live peer": plan.model_copy(update={"leader": str(rogue.peer_id)}),
        "unreasonably far": plan.model_copy(update={"exchange_deadline": time.time() + 3600}),
    }
    moved = [
        a.model_copy(update={"address": "10.9.9.9:1"}) if a.part_end > a.part_start else a for a in plan.assignments
    ]
    cases["its record says"] = plan.model_copy(update={"assignments": moved})
    for expected, bad in cases.items():
        reason = node.plan_problem(bad, live)
        assert reason is not None and expected in reason, (expected, reason)


def _leader_plan_with_third_record(update: dict):
    """The plan a leader's ``PlanRules.build_plan`` makes (6 s window, 10**6 parameters, round 0) over three
    fresh records, the third one's fields replaced by ``update``; returns ``(plan, records)``."""
    ids = [Identity.generate() for _ in range(3)]
    recs = [_rec(i, f"127.0.0.1:{7000 + k}") for k, i in enumerate(ids)]
    recs[2] = recs[2].model_copy(update=update)
    node = make_rules(RunConfig(window_s=6.0), NodeConfig(), numel=1_000_000, round=0, digest="d").planning
    return node.build_plan(recs, recs[0].peer_id), recs


def test_a_peer_too_slow_for_half_the_window_is_planned_out():
    """A record announcing 2 B/s would stretch the window to days (and every peer would refuse that
    plan); the leader plans the round without it instead."""
    plan, recs = _leader_plan_with_third_record({"upload_bps": 2.0, "download_bps": 2.0})
    assert sorted(plan.participants()) == sorted([recs[0].peer_id, recs[1].peer_id])
    assert plan.train_deadline - time.time() < 10.0


def test_one_record_alone_cannot_drag_a_peer_to_a_far_round():
    """StateSync.swarm_round: the round most other peers announce (more than half of them), so a single forged
    or unreachable record claiming round 10**15 is not taken as 'the swarm is ahead'."""
    node = make_rules(me="me").sync
    ids = [Identity.generate() for _ in range(3)]
    honest = [_rec(i, f"127.0.0.1:{7100 + k}").model_copy(update={"round": 5}) for k, i in enumerate(ids[:2])]
    forged = _rec(ids[2], "127.0.0.1:7199").model_copy(update={"round": 10**15})
    assert node.swarm_round(honest + [forged]) == 5
    assert node.swarm_round([honest[0], forged]) is None  # one each: no majority, nobody to follow
    assert node.swarm_round([forged]) == 10**15  # a single other peer is followed (a 2-peer swarm)
    syncing = honest[1].model_copy(update={"weights_digest": None, "round": 9})
    assert node.swarm_round([honest[0], syncing]) == 5  # peers without a digest are not counted


def test_records_refuse_values_that_would_break_the_planner():
    from pydantic import ValidationError

    base = _rec(Identity.generate(), "127.0.0.1:7000").model_dump()
    for field, value in [
        ("tokens_per_s", {4: 1e-300}),
        ("max_batch", 10**30),
        ("timestamp", 1e300),
        ("upload_bps", 1e-300),
        ("memory_bytes", 10**30),
    ]:
        with pytest.raises(ValidationError):
            PeerRecord.model_validate({**base, field: value})


def test_a_peer_too_slow_to_train_one_sequence_in_half_the_window_is_planned_out():
    plan, recs = _leader_plan_with_third_record({"tokens_per_s": {8: 2.0}})  # 32 s for one 64-token sequence
    assert sorted(plan.participants()) == sorted([recs[0].peer_id, recs[1].peer_id])
