"""Fresh user 51 (3 peers + a kill-and-replace): a follower ignored as absent round 20's plan that the others ran
(its leader, a newcomer, on probation in its view and plausible in a resumed peer's), caught up past it by the outer
update, and took none of the marks the others gave it there (its part 0 had no result: owner bar; it contributed to
no part: late mark). At round 21 its check of the honest leader's plan counted itself a possible owner, 3 where the
leader counted 2, and refused it: ``2sAfTy27ad owns 894976 of 937472 elements, over the 626688 bound (2x a fair
share among 3 owners)``; it sat out again, then published plans nobody followed (rounds 22 and 26, nothing applied).

Now a peer that takes round r - 1's plan from its voters' records (``round.planning.recover_last_plan``) and is
named in it takes the marks of a peer that sat that plan out (``NodeRoundPolicy.note_recovered_plan``). Rules level
with the trial's figures; the driver's side over the in-memory DHT. Counts and values, no timings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.plan.planner import _ownership_problem
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

P1, P3, P4 = "8Xf7fTQBXz" * 4, "HpY6kk5aoA" * 4, "2sAfTy27ad" * 4
NUMEL, ALIGN = 937472, 2048


def _plan(round: int, leader: str, owners: list[tuple[str, int, int]], participants: list[str]):
    """A plan stub of ``round`` by ``leader``: ``owners`` (peer id, start, end) spans, ``participants`` train."""
    return SimpleNamespace(
        round=round,
        leader=leader,
        numel=NUMEL,
        start_digest=f"d{round}",
        participants=lambda: list(participants),
        probation=lambda: [],
        owners=lambda: list(owners),
    )


def _round20_and_holder():
    """Round 20's plan (p4 leads as the last resort, p1 owns part 0) and p3's rules after running it without p1."""
    plan20 = _plan(20, P4, [(P1, 0, 272384), (P3, 272384, 604160), (P4, 604160, NUMEL)], [P1, P3, P4])
    spec = SimpleNamespace(round=20, owners=[SimpleNamespace(peer_id=p) for p, _, _ in plan20.owners()])
    ar = SimpleNamespace(missing_parts=[0], contributors={1: [(P3, 23552), (P4, 23552)], 2: [(P3, 23552), (P4, 23552)]})
    p3 = make_rules(me=P3, round=20)
    p3.after_exchange(spec, plan20, ar)
    return plan20, p3


def test_a_follower_that_caught_up_past_a_plan_naming_it_checks_the_next_plan_as_its_leader_made_it():
    plan20, p3 = _round20_and_holder()
    p1 = make_rules(me=P1, round=20)  # it applied rounds 0-19, ignored round 20's plan, caught up to round 21
    p1.state.round = p3.state.round = 21
    assert sorted(p3.penalties.barred()) == [P1]  # "part 0 of 8Xf7fTQBXz had no valid result; it owns no part..."
    # round 21: p3's plan leaves p1 client-only and gives p4 most of the vector (its link was the fast one)
    plan21 = _plan(21, P3, [(P4, 0, 894976), (P3, 894976, NUMEL)], [P1, P3, P4])
    cfg, possible = SimpleNamespace(part_align=ALIGN), {P1, P3, P4}
    assert _ownership_problem(plan21, cfg, possible, p3.penalties.barred()) is None  # as its leader planned it
    # before: the follower held no bar on itself and counted 3 owners (the trial's refusal, figure for figure)
    assert _ownership_problem(plan21, cfg, possible, p1.penalties.barred()) == (
        f"{P4[:10]} owns 894976 of 937472 elements, over the 626688 bound (2x a fair share among 3 owners)"
    )
    assert not p1.penalties.holds(21, span=1, own=True)  # "knows the marks ... in rounds 0-19 only"

    assert p1.note_recovered_plan(plan20) is True
    assert _ownership_problem(plan21, cfg, possible, p1.penalties.barred()) is None
    assert p1.penalties.holds(21, span=1, own=True)
    for t in range(21, 30):  # the same owner bar and mark on p1 in both views, until they end
        p1.state.round = p3.state.round = t
        assert sorted(p1.penalties.barred()) == sorted(p3.penalties.barred())
        assert dict(p1.penalties.noshows()) == dict(p3.penalties.noshows())
        assert {p: c for p, c in p1.penalties.late_marks().items()} == dict(p3.penalties.late_marks())
    p1.state.round = 21
    assert P1 in p1.penalties.unled()  # no leader candidate in its own view either: no plan of its own to refuse
    assert p1.note_recovered_plan(plan20) is False  # taken once


def test_a_recovered_plan_that_does_not_name_this_peer_or_one_it_saw_marks_nothing():
    plan20, _ = _round20_and_holder()
    out = _plan(20, P4, [(P3, 0, 604160), (P4, 604160, NUMEL)], [P3, P4])
    p1 = make_rules(me=P1, round=20)
    p1.state.round = 21
    assert p1.note_recovered_plan(out) is False
    assert P1 not in p1.penalties.barred() and P1 not in p1.penalties.unled()
    seen = make_rules(me=P1, round=20)
    seen.planned_out(20, plan20)  # it saw the plan and sat it out: the wait_out path took its marks already
    seen.state.round = 21
    assert seen.note_recovered_plan(plan20) is False


async def test_the_driver_takes_the_marks_of_a_recovered_plan_naming_it_only_when_the_plan_moved_the_state():
    from geomesh_p2p.plan.agree import PlanStore
    from geomesh_p2p.round.last_plan import plan_ref
    from geomesh_p2p.round.planning import recover_last_plan
    from geomesh_p2p.telemetry import events
    from tests.unit.test_last_plan import _peers
    from tests.unit.test_last_plan import _plan as real_plan
    from tests.unit.test_round import RUN, MemoryDHT, _record

    for moved in (True, False):
        ident, pid = _peers("LXA")
        dht = MemoryDHT()
        plan = real_plan(ident, pid, "L", "LXA", round=2)  # start digest d0; A is planned
        assert pid["A"] in plan.participants()
        assert await PlanStore(dht.view(), ident["L"], RUN).publish(plan)
        digest = "d1" if moved else "d0"  # d0: the round applied nothing, nobody concluded anything
        rules = make_rules(me=pid["A"], round=2, digest=digest)
        rules.state.round = 3
        drv = SimpleNamespace(
            _plan_seen=None,
            plans=SimpleNamespace(plan_of=PlanStore(dht.view(), ident["A"], RUN).read_exact),
            state=SimpleNamespace(digest=digest),
            me=pid["A"],
            policy=rules,
        )
        recs = [
            _record(ident[k], 1.0).model_copy(update={"last_plan": plan_ref(plan), "weights_digest": digest})
            for k in "LX"
        ]
        live = {x.peer_id: x for x in recs}
        with events.capture("last_plan_recovered") as got:
            assert await recover_last_plan(drv, 3, live, [pid["L"], pid["X"]]) is None  # type: ignore[arg-type]
        assert len(got) == 1 and drv._plan_seen.to_bytes() == plan.to_bytes()
        assert getattr(drv, "_sat_out_taken", None) == (3 if moved else None)
        assert (pid["A"] in rules.penalties.unled()) is moved


def _ledger(rounds: list[tuple[int, list[str]]]):
    from geomesh_p2p.trust.standing import Standing

    s = Standing()
    for r, ids in rounds:
        s.credit(r, ids)
    return s


def _records(ledgers: dict) -> list:
    """The records of the peers of ``ledgers`` (peer id -> Standing), each attesting its ledger's standings."""
    return [
        SimpleNamespace(peer_id=p, standing=s.attestations(exclude=p, own=True), address="127.0.0.1:1")
        for p, s in ledgers.items()
    ]


def test_round_20_a_newcomer_on_probation_is_no_last_resort_while_an_established_peer_may_lead():
    """Round 20 of the trial, the first divergence. p1 held the whole standing window, p3 resumed at round 8 and
    rejoined at 12 (rounds 8-12 missed), p4 joined at 17 and delivered in 18 and 19. p1 led 19, so it may not lead
    20 while p3, who took part, may; p3 left itself out (``Penalties.lead_gap``: it cannot know the marks of rounds
    8-11 on itself); both non-candidates, p3 and p4, were last resorts, and p4's plan came first. p1 refused it
    (``on probation here (standing 2 of the 3 rounds needed to lead)``), p3 followed it (plausible: 2 + 5 missed).
    Now p4 publishes none while an established peer may lead, and p3's last-resort plan is one p1 accepts."""
    from geomesh_p2p.round.planning import last_resort
    from geomesh_p2p.trust.probation import marking_problem

    full = [(t, [P1, P3] + ([P4] if t >= 18 else [])) for t in range(20)]
    ledgers = {
        P1: _ledger(full),
        P3: _ledger([x for x in full if not 8 <= x[0] <= 12]),
        P4: _ledger([x for x in full if x[0] >= 18]),
    }
    p1, p3, p4 = (make_rules(me=p, round=20, standing=ledgers[p]) for p in (P1, P3, P4))
    recs = _records(ledgers)
    led_by_p4 = SimpleNamespace(leader=P4, participants=lambda: [P1, P3, P4], assignments=[])
    live = [P1, P3, P4]
    assert marking_problem(led_by_p4, p1.planning.standing_view(recs), live) == (
        f"its leader {P4[:10]} is on probation here (standing 2 of the 3 rounds needed to lead)"
    )
    assert marking_problem(led_by_p4, p3.planning.standing_view(recs), live) is None  # the divergence
    led_by_p3 = SimpleNamespace(leader=P3, participants=lambda: [P1, P3, P4], assignments=[])
    assert all(marking_problem(led_by_p3, x.planning.standing_view(recs), live) is None for x in (p1, p3, p4))

    def drv(rules, me):
        return SimpleNamespace(me=me, state=SimpleNamespace(digest="d20"), _plan_misses=(20, "d20", 1), policy=rules)

    # each peer's candidates as in its log: p3 defers to p1, p4 to p3 (p1, round 19's leader, defers to p3)
    assert last_resort(drv(p3, P3), 20, recs, [P1]) == [P3]  # type: ignore[arg-type]
    assert last_resort(drv(p4, P4), 20, recs, [P3]) == []  # type: ignore[arg-type]
    # before: p4 ranked itself a last resort in both views ([P3, P4] at p3, [P1, P4] at p4)
    assert p4.planning.standing_view(recs).established_ids(live) == {P1, P3}
    # nobody established in this view (no ledger, no attestation): every non-candidate member publishes, as before
    young = [SimpleNamespace(peer_id=p, standing=None, address="127.0.0.1:1") for p in live]
    assert last_resort(drv(make_rules(me=P4, round=20), P4), 20, young, [P3]) == sorted([P1, P4])  # type: ignore[arg-type]


def test_a_peer_that_was_not_with_the_swarm_the_round_before_takes_no_marks_from_a_recovered_plan():
    """Resumed, joined or re-synced just before the plan: its delivered evidence may not be the one the others grace
    a late peer by, so a bench taken here could be one they do not hold (it would refuse their plans naming it)."""
    plan20, _ = _round20_and_holder()
    back = make_rules(me=P1, round=20, marks_from=None)  # it knows none of its marks (a restart without history)
    back.state.round = 21
    assert back.note_recovered_plan(plan20) is False and P1 not in back.penalties.barred()
