"""A participant its round's plan names accused leads nothing in the next round (issue 28, session 47;
``RoundPlan.accused``, ``round/planning.next_leaders``).

Session 46's backdoor run p4 (``/tmp/floor46-p4``): h2 held a verdict against the poisoner a0 from round 3, h0 from
round 4; a0 led round 4 and planned itself in; h1, whose own screen of a0 was still running, led round 5 and planned
a0 in (a verdict it does not hold excludes nobody from its plans); a0 won round 6's rank and led it after all three
honest peers held verdicts: out from 7. Now h1's round-5 plan names a0 accused (it had read h2's and h0's published
evidence), so every peer that obtained that plan lets only h0 or h2 lead round 6, and a0's round-6 plan is a
``ContentRefusal`` (ignored as absent): the same at every such peer, never a refusal of a participant."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pydantic
import pytest

from geomesh_p2p.plan.agree import choose_plan, leader_order, leader_rank
from geomesh_p2p.plan.schema import ContentRefusal, PeerAssignment, RoundPlan, max_accused
from geomesh_p2p.plan.wire import decode_body, encode_body
from geomesh_p2p.round import light
from geomesh_p2p.round.planning import last_round_leaders, lead_problem, next_leaders
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.round.rules.verified import VerifiedWork
from geomesh_p2p.trust.verify_check import FAIL, MARGINAL
from geomesh_p2p.trust.standing import Standing
from geomesh_p2p.trust.verify_fetch import EvidenceExchange
from tests.rules_util import light_driver, make_rules

pytestmark = pytest.mark.timeout(20)
RUN = "accused-leader-test"


def _plan(r: int, leader: str, peers, accused=()) -> RoundPlan:
    """A valid plan of round ``r`` (one part per peer, 8 steps of 4 x 32 each) naming ``accused``."""
    ids = sorted(peers)
    rows = [
        PeerAssignment(
            peer_id=p,
            address="127.0.0.1:1",
            batch_size=4,
            micro_batch=4,
            accum_steps=1,
            inner_steps=8,
            token_budget=4 * 32 * 8,
            part_start=10 * i,
            part_end=10 * (i + 1),
            predicted_compute_s=1.0,
            predicted_comm_s=0.1,
            predicted_idle_s=0.0,
        )
        for i, p in enumerate(ids)
    ]
    return RoundPlan(
        run_id=RUN,
        round=r,
        leader=leader,
        method="geomesh",
        mode="accountable",
        numel=10 * len(ids),
        seq_len=32,
        window_s=3.0,
        train_deadline=1e9 + 3,
        exchange_deadline=1e9 + 6,
        start_digest="d" * 64,
        created_at=1e9,
        assignments=rows,
        accused=list(accused),
    )


def _p4(r: int) -> tuple[str, list[str]]:
    """(a0, [h0, h1, h2]) with a0 ranked first for round ``r`` among the four: p4's draw of round 6."""
    ids = sorted((f"peer-{k}" for k in range(12)), key=lambda p: leader_rank(RUN, r, p))
    return ids[0], ids[1:4]


def test_p4_the_accused_of_round_5s_plan_ranked_first_for_round_6_is_not_followed():
    a0, honest = _p4(6)
    h1 = honest[1]
    round_5 = _plan(5, h1, [a0, *honest], accused=[a0])  # h1 planned a0 in: no verdict of its own yet
    took = last_round_leaders(round_5, 6, [a0, *honest])
    assert took == frozenset(honest) - {h1}  # before: {a0, h0, h2} (it took part, and h1 led round 5)
    theirs = _plan(6, a0, [a0, *honest])  # a0, ranked first, plans itself in
    best = sorted(took, key=lambda p: leader_rank(RUN, 6, p))[0]
    ours = _plan(6, best, honest)  # h0 or h2, holding the verdict, leaves it out
    assert choose_plan(RUN, 6, [theirs, ours]) is theirs  # before: every follower followed a0's plan (out from 7)
    why = lead_problem(theirs, took)
    assert isinstance(why, ContentRefusal) and a0[:10] in why and "accused" in why
    assert lead_problem(ours, took) is None
    assert choose_plan(RUN, 6, [p for p in (theirs, ours) if lead_problem(p, took) is None]) is ours
    # a participant still: the plan that named it gave it its part; only the next round's lead is gone
    assert a0 in round_5.participants() and round_5.assignment(a0).owns_part
    # a light follower ranks its candidates alike (round/light.py)
    assert light._may_take_over(round_5) == sorted(took)


def test_a_rogue_leader_naming_honest_peers_costs_them_one_rounds_lead_and_never_leaves_no_candidate():
    a0, honest = _p4(6)
    h0, h1, h2 = honest
    rogue = _plan(5, a0, [a0, *honest], accused=[h0])  # a0 led round 5 and names an honest peer
    assert last_round_leaders(rogue, 6, [a0, *honest]) == frozenset([h1, h2])  # a0 itself: no self-succession
    # never a participant lost: round 6's honest plan names h0 as before, and h0 may lead round 7 again
    round_6 = _plan(6, h1, honest)
    assert lead_problem(round_6, last_round_leaders(rogue, 6, honest)) is None and h0 in round_6.participants()
    assert last_round_leaders(round_6, 7, honest) == frozenset([h0, h2])
    # a peer whose only candidates are the named ones takes them anyway, never the rogue leader, never nobody
    assert last_round_leaders(rogue, 6, [h0, a0]) == frozenset([h0, h1, h2])
    assert next_leaders(rogue) == [frozenset([h1, h2]), frozenset(honest), frozenset([a0, *honest])]
    # bounded: one name per plan (red team 47: targeted names); a plan naming more is malformed (ignored as absent
    # by every follower), as is one naming its leader, a non-participant, or an unsorted list
    for bad in ([h0, h1] if h0 < h1 else [h1, h0], [a0], ["peer-x"], sorted([h0, h1])[::-1]):
        with pytest.raises(pydantic.ValidationError):
            _plan(5, a0, [a0, *honest], accused=bad)
    assert [max_accused(n) for n in (1, 4, 19, 20, 256)] == [1, 1, 1, 1, 1]
    ids = sorted(f"p{i:02d}" for i in range(20))
    with pytest.raises(pydantic.ValidationError):  # two names at 20 peers: malformed since red team 47
        _plan(5, ids[0], ids, accused=ids[1:3])


def test_the_field_is_absent_while_empty_and_round_trips_on_the_wire():
    a0, honest = _p4(6)
    plain = _plan(5, honest[1], [a0, *honest])
    assert b'"accused"' not in plain.to_bytes() and b'"accused"' not in zlib.decompress(encode_body(plain))
    named = _plan(5, honest[1], [a0, *honest], accused=[a0])
    assert b'"accused":["' + a0.encode() in named.to_bytes()
    assert decode_body(encode_body(named)) == named and decode_body(encode_body(plain)) == plain


def _exchange(me: str, plans: dict, evidence: list, excluded=()) -> EvidenceExchange:
    """An :class:`EvidenceExchange` holding ``evidence`` (verifier, accused, round, outcome) as read by fetch."""
    ex = EvidenceExchange()
    ex.me, ex.excluded = me, {p: "why" for p in excluded}
    ex._kept = {r: SimpleNamespace(plan=p) for r, p in plans.items()}  # type: ignore[assignment]
    ex._pending_ev, ex._pending_round = {}, {}
    for i, (v, a, r, outcome) in enumerate(evidence):
        ex._pending_ev[f"h{i}"] = SimpleNamespace(verifier=v, accused=a, round=r, outcome=outcome)
        ex._pending_round[f"h{i}"] = r
    return ex


def test_the_leader_names_the_participants_unsettled_hard_evidence_accuses():
    a0, honest = _p4(6)
    h0, h1, h2 = honest
    round_2 = _plan(2, h0, [a0, *honest])
    ex = _exchange(
        h1,
        {2: round_2},
        [
            (h2, a0, 2, FAIL),  # p4: h2's screen, published in round 3
            (h0, a0, 2, FAIL),  # and h0's, round 4
            (a0, h0, 2, MARGINAL),  # a marginal one accuses nobody alone
            (a0, h1, 2, FAIL),  # about this peer itself: its own contribution is not named by itself
            ("outsider", h2, 2, FAIL),  # a verifier that had no part in the round
            (h0, a0, 9, FAIL),  # a round no longer kept
        ],
    )
    assert ex.pending_accused([a0, *honest]) == {a0: 2}
    assert _exchange(h1, {2: round_2}, [(h2, a0, 2, FAIL)], excluded=[a0]).pending_accused([a0]) == {}

    work = VerifiedWork(RoundState(me=h1))
    round_5 = _plan(5, h1, [a0, *honest])
    assert work.accused(round_5) == []  # no verifier built yet: nothing read
    work.verifier = ex  # type: ignore[assignment]
    assert work.accused(round_5) == [a0]
    # the cap: one name, the most accused first
    both = _exchange(h1, {2: round_2}, [(h2, a0, 2, FAIL), (h0, a0, 2, FAIL), (a0, h2, 2, FAIL)])
    work.verifier = both  # type: ignore[assignment]
    assert work.accused(round_5) == [a0]
    assert work.accused(_plan(5, a0, [a0, *honest])) == [h2]  # never the plan's leader


def test_a_light_follower_ranks_the_full_paths_candidates_without_the_accused():
    """``light.lead_order`` (the full-view slots) leaves out the accused of round R - 1's plan as the full path's
    candidates do: before, the accused ranked first held the only full-view slot of ``--full-view-peers 1`` while
    the full path refused its plan, and the peer the full path lets lead first ran light."""
    r, ids = 6, [f"peer{i:02d}" for i in range(6)]
    took = leader_order(RUN, r, ids[1:])  # ids[0] led round 5
    accused, second = took[0], took[1]
    standing = Standing()
    for k in range(r):
        standing.credit(k, ids)
    rules = make_rules(me=second, round=r, standing=standing)
    drv = light_driver(rules, me=second, ids=ids, leader=ids[0], run_id=RUN)
    drv._last_plan.accused = [accused]
    assert light.lead_order(drv, drv._last_plan, r) == took[1:]
    assert light.is_light(drv) is False  # the full-view peer: the full path's first candidate
    assert last_round_leaders(drv._last_plan, r, took) == frozenset(took[1:])


def test_the_leaders_plan_carries_the_names(monkeypatch):
    """``NodeRoundPolicy.make_plan``: the planner's plan with ``accused`` from verified work's unsettled evidence."""
    a0, honest = _p4(6)
    h0, h1, h2 = honest
    rules = make_rules(me=h1, round=5)
    monkeypatch.setattr(rules.planning, "make_plan", lambda members, leader: _plan(5, leader, [a0, *honest]))
    assert rules.make_plan([], h1).accused == []
    rules.verified.verifier = _exchange(h1, {2: _plan(2, h0, [a0, *honest])}, [(h2, a0, 2, FAIL)])  # type: ignore[assignment]
    plan = rules.make_plan([], h1)
    assert plan.accused == [a0] and a0 in plan.participants()
    assert RoundPlan.from_bytes(plan.to_bytes()) == plan  # valid as sent
