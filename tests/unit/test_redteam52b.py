"""Red team 52b: session 52's merges attacked. A) resort52: round r - 1's leader is a last resort from
``LEADER_RESORT_MISSES`` attempts with no plan, a newcomer one attempt later while it is a live established member
(``round.planning.last_round_leaders`` / ``newcomer_resort_misses``). B) joiner52: a peer's own ``unled_until`` counts
for a joiner only where more than half of its voters back it (``PeerRecord.unled_marks``, ``Penalties.backed_unled``).
Exact outcomes by rule, plans over the in-memory DHT (tests/unit/test_round.py), no timing (docs/security.md
"Red team 52b")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import SETTLE_S, PlanStore, choose_plan, leader_rank, obtain_plan, takeover_delay
from geomesh_p2p.round.planning import (
    LEADER_RESORT_MISSES,
    last_resort,
    last_round_leaders,
    lead_problem,
    newcomer_resort_misses,
    plan_tiers,
)
from tests.integration.test_last_leader_resort52 import _driver
from tests.unit.test_redteam47 import _round2_plan
from tests.unit.test_round import RUN, MemoryDHT, _planner, _record

pytestmark = pytest.mark.timeout(30)


# -- A: resort52 ---------------------------------------------------------------------------------------------------


async def _split_one_miss_apart(tiered: bool) -> dict[str, str]:
    """Round 3. The rogue L led round 2 over L, X, Y, Z and named the honest established X accused; its colluder Y
    (round 3's only first-level candidate) stays live and silent; Z is a newcomer. L ranks before X in round 3's
    order. X, at its second attempt with no plan (one miss: the accused may lead), published its last-resort plan; L
    published its own once X's was out (an honest L does not: it read a member's plan; the race of two honest ones
    ends the same). Followers: Z at its second attempt (one miss) and Z at its third (``LEADER_RESORT_MISSES``), as
    ``planning.agree`` composes ``accept`` (and, ``tiered``, the tiers of round 2's plan). Returns the leader each
    follows (its first 1 letter: "L" or "X")."""
    while True:
        ident = {k: Identity.generate() for k in "LXYZ"}
        pid = {k: str(i.peer_id) for k, i in ident.items()}
        if leader_rank(RUN, 3, pid["L"]) < leader_rank(RUN, 3, pid["X"]):
            break
    name = {p: k for k, p in pid.items()}
    prev = _round2_plan(ident, pid, "L", [pid["X"]], "LXYZ")
    members = [_record(ident[k], 1.0) for k in "LXYZ"]
    dht = MemoryDHT()
    for k in "XL":
        assert await PlanStore(dht.view(), ident[k], RUN).publish(_planner(3)(members, pid[k]))
    est = [pid[k] for k in "LXY"]
    out = {}
    for missed in (1, LEADER_RESORT_MISSES):
        may_lead = last_round_leaders(prev, 3, est, missed=missed)
        plan = await obtain_plan(
            PlanStore(dht.view(), ident["Z"], RUN),
            3,
            members,
            _planner(3),
            plan_timeout_s=0.3,
            settle_s=0.0,  # both plans are stored: decide at the first read
            candidates=[pid["Y"]],
            accept=lambda p, m=may_lead: lead_problem(p, m),  # type: ignore[misc]
            **({"tiers": plan_tiers(prev, 3)} if tiered else {}),
        )
        assert plan is not None
        out[f"missed {missed}"] = name[plan.leader]
    return out


async def test_peers_one_miss_apart_follow_one_plan_when_the_rogue_last_leader_publishes_beside_the_accused():
    """Before (rank alone): the peer at its third attempt accepts L's plan and follows it (better ranked), the peer at
    its second refuses it as content and follows X's: the accused X and its followers on one state, L and the later
    peers on another. Now the tiers of round 2's plan (L's level after X's) come first: both follow X's."""
    assert await _split_one_miss_apart(tiered=False) == {"missed 1": "X", "missed 2": "L"}  # the fork, by rank
    assert await _split_one_miss_apart(tiered=True) == {"missed 1": "X", "missed 2": "X"}


def test_the_tiers_are_the_levels_of_round_r_minus_1s_plan():
    """Tier 0 the first level, 1 the accused, 2 the last leader; none for another round's plan; ``choose_plan`` and
    the last resorts' stagger compare it first (so an honest last leader's turn is after the accused's too)."""
    prev = SimpleNamespace(round=2, leader="L", accused=["X"], participants=lambda: ["L", "X", "Y", "Z"])
    assert plan_tiers(prev, 3) == {"Y": 0, "Z": 0, "X": 1, "L": 2}  # type: ignore[arg-type]
    assert plan_tiers(prev, 4) == {} and plan_tiers(None, 3) == {}  # type: ignore[arg-type]
    plans = [SimpleNamespace(round=3, run_id=RUN, leader=p) for p in "LX"]
    assert choose_plan(RUN, 3, plans, {"X": 1, "L": 2}).leader == "X"  # type: ignore[arg-type, union-attr]


def test_a_rogue_last_leader_with_a_silent_colluder_leads_at_its_third_attempt_only_without_an_honest_established():
    """L (rogue, led round 2), Y its colluder (round 3's only candidate, live, silent). With an honest established X in
    round 2's plan (accused or not) X is a last resort from the second attempt: L, from the third, reads X's plan and
    would only be followed by nobody (tiers). With newcomers only beside them (Z), L leads round 3 at its third
    attempt (its list [L]; Z waits a fourth): the self-succession a colluder buys, at two whole attempts a round,
    and for round 4 L is barred again (it led round 3) while Y is a candidate."""
    prev = SimpleNamespace(round=2, leader="L", accused=[], participants=lambda: ["L", "Y", "Z"])
    members = [SimpleNamespace(peer_id=p) for p in "LYZ"]
    est, cands = {"L", "Y"}, ["Y"]
    levels = {m: last_round_leaders(prev, 3, ["L", "Y"], missed=m) for m in (1, 2, 3)}
    assert levels[1] == frozenset("YZ") and levels[2] == frozenset("LYZ")

    def resort(me: str, m: int) -> list[str]:
        return last_resort(_driver(me, m, prev, est), 3, members, cands, levels[m])  # type: ignore[arg-type]

    assert [resort("L", m) for m in (1, 2)] == [[], ["L"]]
    assert [resort("Z", m) for m in (1, 2, 3)] == [[], [], ["L", "Z"]]
    mine = SimpleNamespace(round=3, leader="L", accused=[], participants=lambda: ["L", "Y", "Z"])
    assert last_round_leaders(mine, 4, ["L", "Y"]) == frozenset("YZ")  # type: ignore[arg-type]
    # with an honest established X in round 2's plan: X is the last resort of the second attempt
    prev_x = SimpleNamespace(round=2, leader="L", accused=["X"], participants=lambda: ["L", "X", "Y", "Z"])
    members_x = [SimpleNamespace(peer_id=p) for p in "LXYZ"]
    at1 = last_round_leaders(prev_x, 3, ["L", "X", "Y"], missed=1)
    drv = _driver("X", 1, prev_x, {"L", "X", "Y"})
    assert last_resort(drv, 3, members_x, cands, at1) == ["X"]  # type: ignore[arg-type]


def test_a_newcomer_beside_a_live_silent_last_leader_still_publishes_at_its_fourth_attempt():
    """Red team 51c's liveness case with session 52's tier: L led round 2, is established, live and publishes nothing
    (rogue, or its own view leaves it out); Y, the only candidate, is silent too. The newcomer Z is a last resort from
    its fourth attempt (3 misses), not never; where the silent established peer is no barred last leader, from its
    third (``NEWCOMER_RESORT_MISSES``)."""
    prev = SimpleNamespace(round=2, leader="L", accused=[], participants=lambda: ["L", "Y", "Z"])
    members = [SimpleNamespace(peer_id=p) for p in "LYZ"]
    levels = {m: last_round_leaders(prev, 3, ["L", "Y"], missed=m) for m in range(1, 6)}
    got = [last_resort(_driver("Z", m, prev, {"L", "Y"}), 3, members, ["Y"], levels[m]) for m in range(1, 6)]
    assert got == [[], [], ["L", "Z"], ["L", "Z"], ["L", "Z"]]  # type: ignore[comparison-overlap]
    other = SimpleNamespace(round=2, leader="W", accused=[], participants=lambda: ["W", "Y", "Z"])
    assert newcomer_resort_misses(_driver("Z", 1, other, {"L", "Y"}), 3, members, ["Y"]) == 2  # type: ignore[arg-type]


def _first_attempt(me: str, prev, est: set[str], members: str, cands: list[str]) -> int:
    """The first attempt (1-based) at which ``me`` is a last resort of round 3 (``last_resort`` non-empty)."""
    ms = [SimpleNamespace(peer_id=p) for p in members]
    for m in range(1, 8):
        may = last_round_leaders(prev, 3, sorted(est), missed=m)
        if last_resort(_driver(me, m, prev, est), 3, ms, cands, may):  # type: ignore[arg-type]
            return m + 1
    raise AssertionError("never a last resort")


def test_the_plan_wait_an_honest_round_can_cost():
    """Counted in attempts (``plan_timeout_s`` T = 8 s, one candidate Y, stalled with its record live): an attempt with
    no plan waits the candidate's turn and 2 T (``obtain_plan``'s ``give_up_s``), a last resort publishes T after the
    candidate's turn. The accused X beside it (red team 47): attempt 2, 3 T. Only round 2's leader L established
    (issue 28): attempt 3, 5 T = 40 s (before session 52: no plan while Y's record lived). The newcomer Z beside a
    silent L: attempt 4, 7 T = 56 s."""
    t = 8.0
    first = {
        "accused": _first_attempt(
            "X",
            SimpleNamespace(round=2, leader="L", accused=["X"], participants=lambda: list("LXYZ")),
            set("LXY"),
            "LXYZ",
            ["Y"],
        ),
        "last leader": _first_attempt(
            "L",
            SimpleNamespace(round=2, leader="L", accused=[], participants=lambda: list("LYZ")),
            set("LY"),
            "LYZ",
            ["Y"],
        ),
        "newcomer": _first_attempt(
            "Z",
            SimpleNamespace(round=2, leader="L", accused=[], participants=lambda: list("LYZ")),
            set("LY"),
            "LYZ",
            ["Y"],
        ),
    }
    assert first == {"accused": 2, "last leader": 3, "newcomer": 4}
    empty, resort_at = takeover_delay(0, t, SETTLE_S) + 2 * t, takeover_delay(0, t, SETTLE_S) + t
    assert {k: (a - 1) * empty + resort_at for k, a in first.items()} == {
        "accused": 24.0,
        "last leader": 40.0,
        "newcomer": 56.0,
    }
