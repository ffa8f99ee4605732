"""A peer left out of round r - 1's plan leads nothing in round r (session 29, ``round/planning.last_round_leaders``).

The backdoor benchmark's second pair of session 29 (``/tmp/p29/before2``): every honest peer excluded the poisoner by
round 5 and the honest leaders left it out of rounds 6-11 and 13, but it won the rendezvous rank of rounds 12 and 14,
published plans naming itself, and every follower followed them (a verdict of verified work never makes a follower
refuse a plan). With the rule, the followers that obtained round 11's plan ignore its round-12 plan as absent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.plan.agree import choose_plan, leader_rank
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round.planning import last_round_leaders, lead_problem

pytestmark = pytest.mark.timeout(20)
RUN = "excluded-leader-test"


class _Plan(SimpleNamespace):
    def participants(self) -> list[str]:
        return sorted(self.peers)


def _ids(r: int) -> tuple[str, list[str]]:
    """(the poisoner, the honest peers) with the poisoner ranked first for round ``r``: the draw of pair 2's round 12."""
    ids = sorted((f"peer-{k}" for k in range(12)), key=lambda p: leader_rank(RUN, r, p))
    return ids[0], ids[1:4]


def test_a_leader_left_out_of_the_last_rounds_plan_is_ignored_and_the_honest_plan_is_followed():
    a0, honest = _ids(12)
    round_11 = _Plan(run_id=RUN, round=11, leader=honest[0], peers=honest)  # an honest leader left a0 out
    candidates = honest  # the honest view: a0 is no member there (excluded), or is, when not held yet
    took = last_round_leaders(round_11, 12, candidates + [a0])
    assert took == frozenset(honest[1:])  # round 11's leader hands round 12 on (no self-succession)
    theirs = _Plan(run_id=RUN, round=12, leader=a0, peers=[a0, *honest])
    ours = _Plan(
        run_id=RUN, round=12, leader=sorted(honest[1:], key=lambda p: leader_rank(RUN, 12, p))[0], peers=honest
    )
    assert choose_plan(RUN, 12, [theirs, ours]) is theirs  # before: the lowest rank won, a0 planned itself in
    why = lead_problem(theirs, took)
    assert isinstance(why, ContentRefusal) and a0[:10] in why  # every follower that obtained round 11's plan
    assert lead_problem(ours, took) is None
    accepted = [p for p in (theirs, ours) if lead_problem(p, took) is None]
    assert choose_plan(RUN, 12, accepted) is ours


def test_no_rule_without_the_last_rounds_plan_or_when_no_candidate_was_in_it():
    a0, honest = _ids(12)
    assert last_round_leaders(None, 12, honest) is None  # a fresh peer, or one that obtained no plan
    old = _Plan(run_id=RUN, round=10, leader=honest[0], peers=honest)
    assert last_round_leaders(old, 12, honest) is None  # caught up over several rounds: another round's plan
    alone = _Plan(run_id=RUN, round=11, leader=a0, peers=[a0])
    assert last_round_leaders(alone, 12, honest) is None  # none of the candidates took part: anyone may lead
    assert lead_problem(_Plan(run_id=RUN, round=12, leader=a0, peers=[a0]), None) is None


def test_the_last_rounds_leader_leads_the_next_round_only_when_no_other_candidate_took_part():
    """Session 30's backdoor run: every honest peer held the verdict against the poisoner by round 5, but it led
    round 6 (planned into round 5 before the verdicts) and won round 7's rank as well, so it planned itself into
    both; out from round 8. Now round 6's leader may not lead round 7 while another participant of round 6 can."""
    a0, honest = _ids(7)
    round_6 = _Plan(run_id=RUN, round=6, leader=a0, peers=[a0, *honest])  # it led round 6 and planned itself in
    took = last_round_leaders(round_6, 7, [a0, *honest])
    assert took == frozenset(honest)
    theirs = _Plan(run_id=RUN, round=7, leader=a0, peers=[a0, *honest])
    ours = _Plan(run_id=RUN, round=7, leader=sorted(honest, key=lambda p: leader_rank(RUN, 7, p))[0], peers=honest)
    assert choose_plan(RUN, 7, [theirs, ours]) is theirs  # ranked first: before, every follower followed it
    why = lead_problem(theirs, took)
    assert isinstance(why, ContentRefusal) and a0[:10] in why and "led it" in why
    assert [p for p in (theirs, ours) if lead_problem(p, took) is None] == [ours]
    # the same plan seen from a peer whose only live candidate is the last leader: it may lead again (a swarm of one
    # that was led by it, or the others gone), else the round would have no leader at all
    assert last_round_leaders(round_6, 7, [a0]) == frozenset([a0, *honest])
    assert lead_problem(theirs, last_round_leaders(round_6, 7, [a0])) is None
    # a light follower's candidates drop it alike (round/light.py): the established participants but the leader
    two = _Plan(run_id=RUN, round=6, leader=honest[0], peers=[honest[0]])
    assert last_round_leaders(two, 7, [honest[0]]) == frozenset([honest[0]])
