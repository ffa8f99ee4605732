"""Fresh user 52b (3 peers resumed one after the other): p1 held an owner bar on p2 that p3, resumed later, did not;
p1's plan left p2 client-only and split the vector between p1 and p3 by bandwidth, and p3 refused it: "owns 847360 of
937472 elements, over the 626688 bound (2x a fair share among 3 owners)" (a follower counts every participant whose
record has an address as a possible owner, less its own bars only: below 4 possible owners the leader's bars are not
its call). 17 s rounds, p3 sat out rounds 10-14.

Now the leader caps each part at the bound of a follower that holds none of its bars (``share_among``:
``plan.bounds.follower_owner_count``), where its owners can hold the vector at that cap. Exact part sizes and the
follower's verdict, at the trial's sizes."""

from __future__ import annotations

import pytest

from geomesh_p2p.plan import planner
from geomesh_p2p.plan.bounds import follower_owner_count
from geomesh_p2p.schema.partition import max_owner_units, part_sizes
from tests.records_util import peer_record
from tests.rules_util import make_rules

pytestmark = pytest.mark.timeout(60)

P1, P2, P3 = "5ptqAY6dCm" * 4, "AxyjYG4rbQ" * 4, "AjNxfNtVYb" * 4
NUMEL = 937472
ALIGN = 2048
UNITS = -(-NUMEL // ALIGN)  # 458


def test_part_sizes_meet_a_fair_share_among_more_peers_than_own_a_part_where_the_owners_can():
    # two owners, one 9x the other's bandwidth: by bandwidth the first gets most, capped at 2x its half (all of it)
    free = part_sizes(NUMEL, [9e7, 0.0, 1e7], align=ALIGN)
    assert free[0] > max_owner_units(UNITS, 3) * ALIGN and sum(free) == NUMEL
    # among 3 (the follower's count) the cap is ceil(2 x 458 / 3) = 306 units: the excess goes to the other owner
    capped = part_sizes(NUMEL, [9e7, 0.0, 1e7], align=ALIGN, share_among=3)
    assert capped == [306 * ALIGN, 0, NUMEL - 306 * ALIGN]
    # among 5 the cap (184 units) cannot hold 458 units with 2 owners: the owners' own cap, as without it
    assert part_sizes(NUMEL, [9e7, 0.0, 1e7], align=ALIGN, share_among=5) == free
    # fewer than the owners changes nothing
    assert part_sizes(NUMEL, [9e7, 0.0, 1e7], align=ALIGN, share_among=1) == free


def test_follower_owner_count_is_the_checks_count():
    # below 4 possible owners only the follower's own bars shrink it; from 4 a minority left out is the leader's call
    assert [follower_owner_count(3, u) for u in (0, 1, 2)] == [3, 3, 3]
    assert [follower_owner_count(3, 1, mine) for mine in (0, 1)] == [3, 2]
    assert [follower_owner_count(5, u) for u in (0, 1, 2, 3)] == [5, 4, 3, 3]
    assert follower_owner_count(1, 1, 1) == 1


def _live():
    fast = dict(upload_bps=9e7, download_bps=9e7)
    return {
        P1: peer_record(P1, address="127.0.0.1:1", round=29, weights_digest="d29", **fast),
        P2: peer_record(P2, address="127.0.0.1:2", round=29, weights_digest="d29"),
        P3: peer_record(P3, address="127.0.0.1:3", round=29, weights_digest="d29"),
    }


def test_a_leaders_plan_without_a_peer_it_bars_passes_a_follower_that_holds_no_bar():
    live = _live()
    leader = make_rules(me=P1, round=29, digest="d29", numel=NUMEL, owner_penalty={P2: 32})
    plan = leader.planning.build_plan(list(live.values()), P1)
    owned = {pid: end - start for pid, start, end in plan.owners()}
    assert set(owned) == {P1, P3} and plan.assignment(P2).address is None  # p2 barred: client-only
    cap = max_owner_units(UNITS, 3) * ALIGN
    assert owned[P1] == cap and owned[P3] == NUMEL - cap, owned  # by bandwidth p1 would own ~90 %
    cfg = leader.planning.plan_config(len(plan.assignments))
    # a follower holding no bar: every participant of its records is a possible owner (3)
    assert planner.check_plan(plan, live, cfg, now=plan.created_at, barred=()) is None
    # and one holding the leader's bar counts 2: accepted too
    assert planner.check_plan(plan, live, cfg, now=plan.created_at, barred=[P2]) is None
    # the same plan with the bandwidth split (before: the trial's refusal) is refused by the follower without the bar
    free = part_sizes(NUMEL, [9e7, 0.0, 1e7], align=ALIGN)
    spans = dict(zip((P1, P2, P3), [(0, free[0]), (free[0], free[0]), (free[0], NUMEL)]))
    before = plan.model_copy(
        update={
            "assignments": [
                a.model_copy(update={"part_start": spans[a.peer_id][0], "part_end": spans[a.peer_id][1]})
                for a in plan.assignments
            ]
        }
    )
    assert planner.check_plan(before, live, cfg, now=plan.created_at, barred=()) == (
        f"{P1[:10]} owns {free[0]} of {NUMEL} elements, over the {cap} bound (2x a fair share among 3 owners)"
    )
