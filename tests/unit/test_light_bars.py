"""A light follower ranks itself among the participants the full path lets lead (issue 28, session 39): the bars
of ``NodeRoundPolicy.leader_candidates`` (no-shows, verified work's exclusions) hold in ``light.is_light`` too, so a
barred peer ranked first does not hold a full-view slot while the full path's leader runs light."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.plan.agree import leader_order
from geomesh_p2p.round import light
from geomesh_p2p.trust.standing import Standing
from tests.rules_util import light_driver, make_rules

pytestmark = pytest.mark.timeout(60)

RUN = "light-bars"
R = 6  # the round asked about; rounds 0..R-1 credited every participant (established: threshold 3)
IDS = [f"peer{i:02d}" for i in range(6)]
LEADER = IDS[0]  # round R - 1's leader: no candidate while others took part (planning.last_round_leaders)
TOOK = IDS[1:]


def _drv(me: str, noshow: dict[str, int] | None = None, full_view_peers: int = 1):
    """A driver stand-in at round ``R`` whose policy is the node's (tests/rules_util.py), every participant of round
    ``R - 1``'s plan established in its ledger, ``noshow`` its no-show penalties (peer -> last round barred)."""
    standing = Standing()
    for r in range(R):
        standing.credit(r, IDS)
    rules = make_rules(me=me, round=R, standing=standing, noshow_penalty=noshow)
    drv = light_driver(rules, me=me, ids=IDS, leader=LEADER, run_id=RUN, full_view_peers=full_view_peers)
    return drv, rules


def test_a_barred_no_show_ranked_first_takes_no_full_view_slot():
    """The top-ranked participant crashed in round ``R - 1`` and every peer that applied it marked it a no-show
    (not planned, no leader candidate until round R + 1). Before: ``is_light`` ranked among every established
    participant, so with ``--full-view-peers 1`` the no-show held the only full-view slot and the second-ranked peer,
    the full path's first candidate, ran light: no peer published a plan for one plan attempt. Now the second-ranked
    peer is the full-view peer and the third still runs light; with the bar expired the first holds the slot again."""
    order = leader_order(RUN, R, TOOK)
    crashed, second, third = order[0], order[1], order[2]
    bars = {crashed: R + 1}

    drv, rules = _drv(second, bars)
    # the full path's candidates (the same members) leave the no-show out, and second leads first among them
    assert leader_order(RUN, R, rules.leader_candidates([SimpleNamespace(peer_id=p) for p in TOOK], {})[1])[0] == second
    assert light.is_light(drv) is False
    assert light.lead_order(drv, drv._last_plan, R) == [p for p in order if p != crashed]
    assert light.is_light(_drv(third, bars)[0]) is True

    # an unbarred established peer ranked first still takes the slot (a bar that expired, round R > R - 1)
    assert light.is_light(_drv(second, {crashed: R - 1})[0]) is True
    assert light.is_light(_drv(second)[0]) is True
    assert light.is_light(_drv(crashed)[0]) is False


def test_a_peer_verified_work_excludes_takes_no_full_view_slot():
    """Verified work's exclusions bar a peer from the full path's leader candidates (``verified.members``), so they
    bar it from the light ranking too: the peer ranked next is a full-view peer."""
    order = leader_order(RUN, R, TOOK)
    drv, rules = _drv(order[1])
    assert light.is_light(drv) is True
    rules.verified.verdicts().excluded[order[0]] = "test: failed a check"
    assert light.is_light(drv) is False
    # a verdict on this peer itself never drops it from its own ranking (as verified.members keeps it)
    drv, rules = _drv(order[0])
    rules.verified.verdicts().excluded[order[0]] = "test: an edited file"
    assert light.is_light(drv) is False
