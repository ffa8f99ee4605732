"""A follower's unseen rates survive a restart (issue 28, session 39): the rates the last plan gave the participants
that no part this follower read listed (``Reprofiler.unseen_rates``, it missed a part) are saved with the
checkpoint's delivered-work evidence (``Reprofiler.delivered_meta``, ``node_verdicts``) and restored by ``--resume``
(``restore_delivered``), so the resumed follower makes the plan check's decision it made before. Before, it bounded
those peers at the newcomer seed again and refused the honest plan (session 38's false refusal)."""

from __future__ import annotations

import json

import pytest

from geomesh_p2p.node.checkpoints import node_verdicts
from geomesh_p2p.plan.planner import check_plan, make_plan
from geomesh_p2p.round.rules.profiling import MAX_RESTORED_RATES
from tests.integration.test_plan_bounds import KW, T0, by_id
from tests.integration.test_plan_views_redteam37 import NUMEL, fast_p0
from tests.integration.test_under_plan_redteam36 import delivered
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

R = KW["round"]  # the round the plan is for; the checkpoint holds the state round R - 1 made
ME = "follower-f"
NEWCOMER_REFUSAL = (
    "token budget 2424832 for p0 exceeds the 1010971 its delivered work supports in 4.97 s "
    "(a newcomer: the median delivered rate)"
)


def _decision(rules, plan, recs, cfg):
    """This follower's plan check of round ``R`` from the evidence its rules hold (``PlanRules.delivered_evidence``
    and ``unseen_evidence``, what ``plan_problem`` passes as ``supported`` and ``unseen``)."""
    p = rules.planning
    return check_plan(plan, by_id(recs), cfg, now=T0, supported=p.delivered_evidence(R), unseen=p.unseen_evidence(R))


def _checkpointed(rules) -> dict:
    """``node_verdicts`` of a node holding ``rules``, through JSON as the checkpoint's meta is written and read."""
    return json.loads(json.dumps(node_verdicts(rules)))


def _setup():
    """F2's swarm (p0 4x the others); the follower missed the part listing p0 in round R - 1: its delivered map lacks
    p0, its unseen map holds p0's planned rate. The honest leader's plan of round R (with p0's rate)."""
    recs, cfg = fast_p0()
    sup = delivered(recs)
    plan = make_plan(recs, cfg, numel=NUMEL, supported_tokens_per_s=sup, **KW)
    before = make_rules(me=ME, round=R)
    before.profile.supported_tps = (R - 1, {p: v for p, v in sup.items() if p != "p0"})
    before.profile.unseen_tps = (R - 1, {"p0": sup["p0"]})
    return recs, cfg, plan, before


def test_a_resumed_follower_makes_the_plan_check_decision_it_made_before_the_restart():
    recs, cfg, plan, before = _setup()
    assert _decision(before, plan, recs, cfg) is None  # before the restart: followed
    meta = _checkpointed(before)
    assert meta["delivered"]["unseen"] == {"p0": before.profile.unseen_tps[1]["p0"]}

    # what a resumed follower decided before session 39: the delivered rates back, p0 bounded at the newcomer seed
    old = make_rules(me=ME, round=R)
    assert old.profile.restore_delivered({k: v for k, v in meta["delivered"].items() if k != "unseen"}, R)
    assert _decision(old, plan, recs, cfg) == NEWCOMER_REFUSAL

    resumed = make_rules(me=ME, round=R)  # a fresh process from the checkpoint of round R's state
    assert resumed.profile.restore_delivered(meta["delivered"], R)
    assert resumed.profile.unseen_tps == before.profile.unseen_tps
    assert resumed.profile.supported_tps == before.profile.supported_tps
    assert _decision(resumed, plan, recs, cfg) is None


def test_a_checkpoint_without_unseen_rates_still_loads():
    """A checkpoint of the release before (no ``unseen``), or of a round in which this follower read every part
    (none to save): the delivered rates are restored, no unseen one, and the decision is the one before session 39
    (p0 at the newcomer seed: refused with the exact reason)."""
    recs, cfg, plan, before = _setup()
    before.profile.unseen_tps = (R - 1, {})
    meta = _checkpointed(before)
    assert "unseen" not in meta["delivered"]
    resumed = make_rules(me=ME, round=R)
    assert resumed.profile.restore_delivered(meta["delivered"], R)
    assert resumed.profile.unseen_tps is None and resumed.planning.delivered_evidence(R) is not None
    assert _decision(resumed, plan, recs, cfg) == NEWCOMER_REFUSAL


@pytest.mark.parametrize(
    "unseen",
    [
        {"p0": float("nan")},
        {"p0": -1.0},
        {"p0": True},
        {"p" * 65: 1.0},
        {f"p{k}": 1.0 for k in range(MAX_RESTORED_RATES + 1)},
        [1.0],
        "junk",
        None,
    ],
)
def test_an_edited_unseen_map_is_dropped_alone(unseen):
    """A malformed ``unseen`` never ends the node nor drops the delivered rates: it is ignored (seed bound)."""
    recs, cfg, plan, before = _setup()
    meta = _checkpointed(before)["delivered"]
    meta["unseen"] = unseen
    resumed = make_rules(me=ME, round=R)
    assert resumed.profile.restore_delivered(meta, R)
    assert resumed.profile.unseen_tps is None
    assert _decision(resumed, plan, recs, cfg) == NEWCOMER_REFUSAL


def test_unseen_rates_of_another_round_are_not_saved():
    """Unseen rates of an older round than the delivered ones (a round applied without a missed part since) are not
    the evidence of the state's round: not saved."""
    _, _, _, before = _setup()
    before.profile.unseen_tps = (R - 2, {"p0": 1.0})
    assert "unseen" not in _checkpointed(before)["delivered"]
