"""Every penalty a plan check refuses on is held alike by every honest peer, the marked peer included (fresh-user
trial, session 49): a peer that refused a plan naming it, or restarted from a checkpoint, did not hold the marks
the others gave it; 5 rounds later it led a plan giving itself a part that they still barred, they refused it,
their parts failed in turn, and the refusals came back every ``OWNER_PENALTY_ROUNDS`` rounds (rounds 58, 63, 68,
73; 8 of rounds 63-74 trained by one peer). Rules level: counts and values, no timings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from geomesh_p2p.round.rules import OWNER_PENALTY_ROUNDS, Penalties, RoundState
from geomesh_p2p.trust.probation import noshow_penalty_rounds
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

LEAD, REF, THIRD = "Lead" * 11, "Refuser" * 6, "Third" * 9


def _plan(round: int, leader: str, owners: list[str], participants: list[str]):
    """A plan of ``round`` by ``leader``: ``owners[j]`` owns part j (1000 elements each), ``participants`` train."""
    spans = [(pid, 1000 * j, 1000 * (j + 1)) for j, pid in enumerate(owners)]
    return SimpleNamespace(
        round=round,
        leader=leader,
        participants=lambda: list(participants),
        probation=lambda: [],
        owners=lambda: list(spans),
    )


def _views(rules, rounds):
    """round -> (peers barred from owning, no-show marks) in ``rules``' view at each of ``rounds``."""
    out = {}
    for t in rounds:
        rules.state.round = t
        out[t] = (sorted(rules.penalties.barred()), dict(rules.penalties.noshows()))
    return out


def test_a_peer_that_sits_out_a_plan_naming_it_holds_the_marks_the_others_give_it():
    r = 58
    plan = _plan(r, LEAD, owners=[REF, LEAD], participants=[LEAD, REF, THIRD])
    spec = SimpleNamespace(round=r, owners=[SimpleNamespace(peer_id=p) for p in (REF, LEAD)])
    # the two that ran the plan: the refuser's part 0 had no result, it contributed to no part
    ar = SimpleNamespace(missing_parts=[0], contributors={1: [(LEAD, 4096), (THIRD, 2048)]})
    ran = [make_rules(me=me, round=r) for me in (LEAD, THIRD)]
    for rules in ran:
        rules.after_exchange(spec, plan, ar)
    refuser = make_rules(me=REF, round=r)
    refuser.planned_out(r, plan)  # refusing the plan the others followed: it sits the round out

    later = range(r + 1, r + OWNER_PENALTY_ROUNDS + 4)
    want = _views(ran[0], later)
    assert want[r + OWNER_PENALTY_ROUNDS] == ([REF], {})  # barred through round 63, as the leader's log said
    assert want[r + OWNER_PENALTY_ROUNDS + 1] == ([], {})
    assert want[r + 1] == ([REF], {REF: r + noshow_penalty_rounds(False)})
    assert _views(ran[1], later) == want
    # before: the refuser held no mark on itself (([], {}) every round), led round 63 giving itself a part
    assert _views(refuser, later) == want

    # round 63: the refuser plans itself client-only, and the others' check refuses a plan that does not
    for rules in (*ran, refuser):
        rules.state.round = r + OWNER_PENALTY_ROUNDS
    own = _plan(r + OWNER_PENALTY_ROUNDS, REF, owners=[REF, LEAD], participants=[LEAD, REF, THIRD])
    assert "whose part had no valid result" in (ran[0].planning._penalty_problem(own) or "")
    members = [SimpleNamespace(peer_id=p, address=f"127.0.0.1:{i}", model_copy=None) for i, p in enumerate((LEAD, REF))]
    for m in members:
        m.model_copy = (lambda m: lambda update: SimpleNamespace(peer_id=m.peer_id, **update))(m)
    planned = refuser.penalties.without_parts(members)
    assert [(m.peer_id, m.address) for m in planned] == [(LEAD, "127.0.0.1:0"), (REF, None)]


def test_sitting_out_a_plan_that_names_another_peer_or_gives_this_one_no_part_marks_only_what_the_others_do():
    r = 10
    out = make_rules(me=REF, round=r)
    out.planned_out(r, _plan(r, LEAD, owners=[LEAD], participants=[LEAD, THIRD]))  # left out by the leader
    assert (out.penalties.owner, out.penalties.noshow) == ({}, {})
    client = make_rules(me=REF, round=r)
    client.planned_out(r, _plan(r, LEAD, owners=[LEAD], participants=[LEAD, REF]))  # client-only, sat out
    assert (client.penalties.owner, client.penalties.noshow) == ({}, {REF: r + noshow_penalty_rounds(False)})


def test_a_restart_keeps_the_marks_on_this_peer_that_the_others_keep():
    """--resume after ``--rounds`` ended while this peer was barred: the others restored their marks on it, it
    dropped its own (red team 13's guard against an edited file), and led plans they refused."""
    r = 61
    live = Penalties(RoundState(me=REF, round=r), owner={REF: 63, LEAD: 62}, noshow={REF: 61})
    other = Penalties(RoundState(me=LEAD, round=r), owner={REF: 63}, noshow={REF: 61})
    back = Penalties(RoundState(me=REF, round=r))
    back.restore(json.loads(json.dumps(live.to_meta())))  # as the checkpoint file holds it
    assert (back.owner, back.noshow) == ({REF: 63, LEAD: 62}, {REF: 61})
    assert REF in back.barred() and REF in other.barred()
    # an edited file cannot bar it for longer than a penalty taken at the checkpoint's round would
    edited = Penalties(RoundState(me=REF, round=r))
    edited.restore(
        {
            "owner": {REF: r + OWNER_PENALTY_ROUNDS + 1},
            "noshow": {REF: r + max(noshow_penalty_rounds(x) for x in (False, True)) + 1},
        }
    )
    assert (edited.owner, edited.noshow) == ({}, {})
