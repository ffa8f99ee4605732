"""Issue 28 (session 52): a split of one round in tests/e2e/test_stalled_peer_procs.py at load ~20. Three peers,
``--min-peers 2``: p0 led round 2, p1 (established) was stopped during round 3 with its record live, p2 joined late
(trained round 2 only: on probation). Round 3's only leader candidate was p1. ``last_round_leaders`` barred p0
(round 2's leader: no self-succession) from leading, last resort included, while p1's record lived; p2 declined as
a last resort while an established peer could lead, then (``NEWCOMER_RESORT_MISSES``) published at its third attempt.
p0 refused that plan (its leader on probation there), led round 3 itself once p1's record lapsed, and the two applied
different round-3 states. Now round ``r - 1``'s leader is a last resort from the third attempt with no plan
(``planning.LEADER_RESORT_MISSES``), and a newcomer waits one attempt more while that leader is an established member:
p0 publishes, p2 follows. Two round drivers with the in-memory fakes and the node's round rules
(tests/integration/test_leader_livelock.py); the stopped p1 is a record only. Counted, not timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.schema import ContentRefusal, RoundPlan
from geomesh_p2p.round.planning import (
    LEADER_RESORT_MISSES,
    NEWCOMER_RESORT_MISSES,
    last_resort,
    last_round_leaders,
    lead_problem,
    newcomer_resort_misses,
)
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.driver_util import run_bounded
from tests.integration.test_silent_established_red51c import Peer
from tests.unit.test_round_driver import PEER_INDEX, PEERS, Swarm

pytestmark = pytest.mark.timeout(60)


def _ledger(p0: str, p1: str, p2: str) -> Standing:
    """Rounds 0-2 as every peer credited them: p0 and p1 trained all three, p2 round 2 only."""
    led = Standing()
    for t in range(3):
        led.credit(t, [p0, p1] + ([p2] if t == 2 else []))
    return led


def _three() -> tuple[Peer, Peer, Peer, RoundPlan]:
    """p0, p1, p2 at round 3's state, with round 2's plan (led by p0 over all three) as p0 and p2 obtained it."""
    swarm = Swarm()
    ids = [Identity.generate() for _ in range(3)]
    p0, p1, p2 = (str(i.peer_id) for i in ids)
    peers = tuple(Peer(swarm, i, _ledger(p0, p1, p2), {}) for i in ids)
    for k, p in enumerate(peers):
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        p.theta.fill_(0.5)  # round 3's state, the same at all three
        p.commit(2)
    recs = [p.record() for p in peers]
    prev = peers[0].make_plan(recs, p0)  # round 2's plan, led by p0
    assert prev.round == 2 and set(prev.participants()) == {p0, p1, p2}
    for p in peers:
        p.commit(3)
        rules = p._sync_rules()
        # each applied rounds 0-2 (p2 as the others: it took round 2's marks; its probation is its standing)
        rules.penalties.held_since(0)
        rules.planning.profile.supported_tps = (2, {q: 2000.0 for q in (p0, p1, p2)})
        swarm.records[p.me] = p.record()
    return peers[0], peers[1], peers[2], prev


def test_the_views_of_round_3():
    """The logs' views: p1 is the only candidate after the no-self-succession rule; p2 is on probation everywhere;
    p0's plan (once it may lead) passes p2's checks, p2's fails p0's (not as content)."""
    a, b, c, prev = _three()
    recs = list(a.swarm.records.values())
    live = {r.peer_id: r for r in recs}
    assert set(a.leader_candidates(recs, live)[1]) == {a.me, b.me}
    assert set(c.leader_candidates(recs, live)[1]) == {a.me, b.me}  # itself on probation
    assert c.plan_problem(a.make_plan(recs, a.me), live) is None
    assert "probation" in (a.plan_problem(c.make_plan(recs, c.me), live) or "")


async def test_the_last_leader_publishes_before_a_newcomer_while_the_only_candidate_is_stopped():
    """Before: p2 took over at its third attempt (``last_resort``: a late newcomer), p0 refused its plan and never
    led while p1's record lived (none lapses here): p2 trained round 3 on its own plan, p0 on none. Now p0, round 2's
    leader, is the last resort of its third attempt, p2 (on probation) publishes nothing and follows p0's plan: one
    leader, one state."""
    a, b, c, prev = _three()
    drivers = [p.driver(rounds=4, min_peers=2) for p in (a, c)]
    for d in drivers:
        d._plan_seen = prev  # both obtained round 2's plan
    with events.capture("plan_takeover") as takeovers, events.capture("plan_last_resort") as resorts:
        await run_bounded(drivers, 20)  # a hang guard only (before: p0 never led while p1's record lived)
    took_over = {(e["peer"], bool(e.get("last_resort"))) for e in takeovers if e["round"] == 3}
    assert took_over == {(a.me, True)}, [(p[:10], lr) for p, lr in took_over]  # p0 alone, as the last resort
    assert {e["peer"] for e in resorts if e["round"] == 3} == {a.me}
    rows = [[(r.round, r.leader) for r in d.history] for d in drivers]
    assert rows == [[(3, a.me[:10])], [(3, a.me[:10])]]  # the rows name a leader by its first 10 characters
    assert a.round == c.round == 4 and a.digest == c.digest
    # p0 leads no earlier than its third attempt (two without a plan: LEADER_RESORT_MISSES), one more where a loaded
    # machine stalled an attempt (PlanStalled counts no miss); p2 reads p0's plan in its third or fourth
    assert 3 <= a.agreements <= 4 and 3 <= c.agreements <= 4, (a.agreements, c.agreements)


def _driver(me: str, misses: int, prev, established: set[str]) -> SimpleNamespace:
    """What ``planning.last_resort`` reads of a driver at round 3: this peer, its state, its misses there, round 2's
    plan it obtained, and the standing (``established``) its policy reads."""
    return SimpleNamespace(
        me=me,
        state=SimpleNamespace(digest="d0"),
        _plan_misses=(3, "d0", misses),
        _plan_seen=prev,
        policy=SimpleNamespace(
            standing_established_ids=lambda recs, ids: frozenset(p for p in ids if p in established)
        ),
    )


def test_the_rogue_last_leader_comes_after_the_accused_and_before_the_newcomer():
    """Red team 47's shape with the session-52 tier: round 2's rogue leader L named the honest X accused, its colluder
    Y (round 3's only candidate) is silent, Z a newcomer. After one miss X is the last resort and L's plan is still
    refused as content; only after two does L (and X) lead as last resorts; Z waits a third. Exact lists, by rule."""
    prev = SimpleNamespace(round=2, leader="L", accused=["X"], participants=lambda: ["L", "X", "Y", "Z"])
    members = [SimpleNamespace(peer_id=p) for p in "LXYZ"]
    est, cands = {"L", "X", "Y"}, ["Y"]  # Y: the first level's candidate, kept after misses (its turns come first)
    assert last_round_leaders(prev, 3, ["L", "X", "Y"], missed=1) == frozenset("XYZ")
    assert last_round_leaders(prev, 3, ["L", "X", "Y"], missed=LEADER_RESORT_MISSES) == frozenset("LXYZ")
    levels = {m: last_round_leaders(prev, 3, ["L", "X", "Y"], missed=m) for m in (1, 2, 3)}

    def resort(me: str, m: int) -> list[str]:
        return last_resort(_driver(me, m, prev, est), 3, members, cands, levels[m])  # type: ignore[arg-type]

    assert (resort("L", 1), resort("X", 1), resort("Z", 1)) == ([], ["X"], [])
    assert (resort("L", 2), resort("X", 2), resort("Z", 2)) == (["L", "X"], ["L", "X"], [])
    assert resort("Z", 3) == ["L", "X", "Z"]  # a late newcomer: every last resort (red team 51c)
    assert newcomer_resort_misses(_driver("Z", 1, prev, est), 3, members, cands) == 3  # type: ignore[arg-type]
    rogue = SimpleNamespace(leader="L")
    assert isinstance(lead_problem(rogue, levels[1]), ContentRefusal)  # type: ignore[arg-type]
    assert lead_problem(rogue, levels[2]) is None  # type: ignore[arg-type]


def test_no_change_where_the_last_leader_is_no_established_member():
    """The newcomer's wait is red team 51c's (``NEWCOMER_RESORT_MISSES``) where round 2's leader is on probation in
    its view, gone from the members, a candidate (its turns came first), or no round 2 plan was obtained."""
    prev = SimpleNamespace(round=2, leader="L", accused=[], participants=lambda: ["L", "Y", "Z"])
    members = [SimpleNamespace(peer_id=p) for p in "LYZ"]

    def wait(est: set[str], ms=members, cands=("Y",), seen=prev) -> int:
        return newcomer_resort_misses(_driver("Z", 1, seen, est), 3, ms, list(cands))  # type: ignore[arg-type]

    assert wait({"L", "Y"}) == 3
    assert wait({"Y"}) == NEWCOMER_RESORT_MISSES  # L on probation here
    assert wait({"L", "Y"}, ms=members[1:]) == NEWCOMER_RESORT_MISSES  # L no member
    assert wait({"L", "Y"}, cands=("L",)) == NEWCOMER_RESORT_MISSES  # L the only candidate: it leads, no bar
    assert wait({"L", "Y"}, seen=None) == NEWCOMER_RESORT_MISSES  # no rule of round 2's plan
