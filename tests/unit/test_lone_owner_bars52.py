"""Fresh user 52 (3 peers, the whole swarm restarted): p1 resumed first and ran round 27 with p2 before p2 was ready;
"round 27: part 1 of AxyjYG4rbQ had no valid result; it owns no part for the next 5 rounds" at p1 only (p2 and p3
synced past round 27 and never held that bar). p1 then refused the plans of rounds 29-32, "it gives a part to
AxyjYG4rbQ, whose part had no valid result in a recent round", while p2 and p3 followed them: 4 rounds sat out.

Now an owner bar refuses a plan only where the swarm shares it (``Penalties.shared_bars``: the leader's record or a
majority of the voters' ``owner_bars`` name it); one held alone is followed past with one INFO line, and this peer's
own plans still leave the barred peer client-only. Rules level with the trial's ids and rounds; counts and values."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from geomesh_p2p.round.rules import OWNER_PENALTY_ROUNDS
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

P1, P2, P3 = "5ptqAY6dCm" * 4, "AxyjYG4rbQ" * 4, "AjNxfNtVYb" * 4
NUMEL = 937472
REFUSAL = "whose part had no valid result in a recent round"
ADDR = {P1: "127.0.0.1:1", P2: "127.0.0.1:2", P3: "127.0.0.1:3"}


def _plan(round: int, leader: str, owners: list[tuple[str, int, int]], participants: list[str]):
    """A plan stub of ``round`` by ``leader``: ``owners`` (peer id, start, end) spans, ``participants`` train."""
    return SimpleNamespace(
        round=round,
        leader=leader,
        numel=NUMEL,
        participants=lambda: list(participants),
        probation=lambda: [],
        owners=lambda: list(owners),
    )


def _p1_at_29(me: str = P1):
    """p1's rules (or those of another honest peer ``me`` that did the same) after round 27 as it ran it (leader, p2
    owning part 1, p3 not planned: still catching up), then round 28 (no token anywhere: inconclusive), at round 29."""
    plan27 = _plan(27, me, [(me, 0, 468480), (P2, 468480, NUMEL)], [me, P2])
    spec = SimpleNamespace(round=27, owners=[SimpleNamespace(peer_id=p) for p, _, _ in plan27.owners()])
    ar = SimpleNamespace(missing_parts=[1], contributors={0: [(me, 38 * 16 * 128)]})
    p1 = make_rules(me=me, round=27, digest="d27")
    # its checkpoint's evidence: both delivered round 26, so p2 is marked late (no leader candidate), not benched
    p1.profile.supported_tps = (26, {me: 5000.0, P2: 5000.0, P3: 5000.0})
    p1.after_exchange(spec, plan27, ar)
    p1.state.round = 29
    return p1


def _records(bars2=None, bars3=None, bars1="held", p1=None):
    """Live records of round 29 (digest d29): p2's and p3's ``owner_bars`` (None: they hold not every bar: both
    synced past round 27), p1's as its penalties announce them."""
    own = p1.penalties.owner_bars() if bars1 == "held" else bars1
    return {
        P1: peer_record(P1, address="127.0.0.1:1", round=29, weights_digest="d29", owner_bars=own),
        P2: peer_record(P2, address="127.0.0.1:2", round=29, weights_digest="d29", owner_bars=bars2),
        P3: peer_record(P3, address="127.0.0.1:3", round=29, weights_digest="d29", owner_bars=bars3),
    }


PLAN29 = _plan(29, P2, [(P1, 0, 364544), (P2, 364544, 651264), (P3, 651264, NUMEL)], [P1, P2, P3])
# what the follower's address check reads (each owner at the address its record announces)
PLAN29.assignments = [
    SimpleNamespace(peer_id=p, address=ADDR[p], part_start=a, part_end=b) for p, a, b in PLAN29.owners()
]


def test_a_bar_held_alone_is_followed_past_with_one_info_line(caplog, monkeypatch):
    p1 = _p1_at_29()
    assert p1.penalties.barred() == [P2] and p1.penalties.owner[P2] == 27 + OWNER_PENALTY_ROUNDS
    assert P2 in p1.penalties.unled() and P2 not in p1.penalties.noshows()  # "not as a leader for the next 8 rounds"
    live = _records(p1=p1)
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer.round")
    # the follower's whole check, its other parts passed (settings, steps, probation, budgets: not this test's)
    monkeypatch.setattr(type(p1.planning), "_settings_problem", lambda self, plan: None)
    monkeypatch.setattr(type(p1.planning), "_steps_problem", lambda self, plan: None)
    monkeypatch.setattr("geomesh_p2p.trust.probation.marking_problem", lambda *a, **k: None)
    monkeypatch.setattr("geomesh_p2p.plan.planner.check_plan", lambda *a, **k: None)
    # before: "refusing the plan of round 29 from AxyjYG4rbQ: it gives a part to AxyjYG4rbQ, whose part had no ..."
    assert p1.plan_problem(PLAN29, live) is None
    assert p1.plan_problem(PLAN29, live) is None  # the next attempt reads the same plan: no new line
    lines = [r.getMessage() for r in caplog.records if "view only" in r.getMessage()]
    assert lines == [
        f"round 29: following the plan of leader {P2[:10]} although it gives a part to {P2[:10]}, whose part had no "
        f"valid result in this peer's view only ({P2[:10]}: 1 of 2 voters hold that bar; the leader's record names "
        "none): a bar held alone bars them from this peer's own plans only"
    ]
    # its own plans still leave p2 client-only (a leader leaves out the peers it bars)
    members = [live[p] for p in (P1, P2, P3)]
    assert [(m.peer_id, m.address) for m in p1.penalties.without_parts(members)] == [
        (P1, "127.0.0.1:1"),
        (P2, None),
        (P3, "127.0.0.1:3"),
    ]
    # no records read (a caller without them): the bar refuses as before
    assert (p1.planning._penalty_problem(PLAN29) or "").endswith(REFUSAL)


def test_a_bar_a_majority_of_the_voters_or_the_leader_names_still_refuses():
    p1 = _p1_at_29()
    until = 27 + OWNER_PENALTY_ROUNDS
    # p3 holds it too: 2 of 2 voters (p2, late-marked here, is no leader candidate: no voter)
    why = p1.planning._penalty_problem(PLAN29, _records(bars3={P2: until}, p1=p1))
    assert why == f"it gives a part to {P2[:10]}, {REFUSAL} (2 of 2 voters hold that bar)"
    # the leader's own record names the bar it broke (a leader p3 giving p2 a part)
    by3 = _plan(29, P3, PLAN29.owners(), [P1, P2, P3])
    assert p1.planning._penalty_problem(by3, _records(bars3={P2: until}, bars1=None, p1=p1)) is not None
    by3_alone = p1.planning._penalty_problem(by3, _records(bars3={P3: until}, bars1=None, p1=p1))
    assert by3_alone is None  # p3 names another bar, not p2's: still this peer's alone
    # a bar ended before this round names nothing
    assert p1.planning._penalty_problem(PLAN29, _records(bars3={P2: 28}, p1=p1)) is None


def test_a_rogue_minority_that_leaves_the_bar_out_of_its_records_does_not_get_the_failed_owner_a_part():
    """4 voters (p2, late-marked here, is none): this peer and 2 honest holders name the bar, the rogue leader
    names none; its plan giving its partner p2 a part is refused, as before session 52."""
    p1 = _p1_at_29()
    until = 27 + OWNER_PENALTY_ROUNDS
    h1, h2, rogue = "Honest1xyz" * 4, "Honest2xyz" * 4, "Rogue0xyzw" * 4
    live = _records(bars3={}, p1=p1)
    for pid, bars in ((h1, {P2: until}), (h2, {P2: until}), (rogue, {})):
        live[pid] = peer_record(
            pid, address=f"127.0.0.1:{len(live) + 1}", round=29, weights_digest="d29", owner_bars=bars
        )
    live.pop(P3)
    plan = _plan(29, rogue, [(rogue, 0, 468480), (P2, 468480, NUMEL)], [rogue, P2, P1, h1, h2])
    assert (
        p1.planning._penalty_problem(plan, live)
        == f"it gives a part to {P2[:10]}, {REFUSAL} (3 of 4 voters hold that bar)"
    )
    # with one honest holder less (it names none: not synced), the bar is not the majority's: followed
    live[h2] = live[h2].model_copy(update={"owner_bars": None})
    assert p1.planning._penalty_problem(plan, live) is None
