"""Fresh user 52: round r - 1's leader and the peers that leave themselves out for a gap (``Penalties.lead_gap``:
resumed, restarted, joined) must take the same level of who may lead round r (``round.planning.ungapped_leaders``).

The trial (3 peers, one killed and resumed, one newcomer): p1 led every odd round 11-25. In each even round p1
counted the gapped peers as candidates, so no self-succession barred it, while each gapped peer, not counting
itself, let p1 lead and deferred to it (or to the other gapped ones): no plan in a whole attempt, then a gapped peer
took over as the last resort ("no plan from 1 better-ranked leader(s) after 4.0s; taking over"), every even round
12-26. Whole drivers with fake ports (``test_round_driver.FakePeer``): the gapped peers announce ``lead_from`` in
their records and leave themselves out of their own candidates, as ``NodeRoundPolicy`` does. Counts of events and
the leaders followed, no timing."""

from __future__ import annotations

import pytest

from geomesh_p2p.round.planning import ungapped_leaders
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import FakePeer, _peers, _run_all

pytestmark = pytest.mark.timeout(60)
ROUNDS = 6
GAP = 18  # MARK_SPAN_ROUNDS: a resumed peer's gap outlasts the run


class GappedPeer(FakePeer):
    """A fake peer that, when ``gapped``, leaves itself out of its own leader candidates (while another remains, as
    ``NodeRoundPolicy.leader_candidates``) and announces the gap in its record (``node.training.record_state``)."""

    gapped = False

    def record(self) -> PeerRecord:
        rec = super().record()
        if not self.gapped:
            return rec
        self.announced_lead_from, self.announced_round = self.round + GAP, self.round
        return rec.model_copy(update={"lead_from": self.round + GAP})

    def leader_candidates(self, members, live):
        ids = [m.peer_id for m in members]
        if self.gapped and self.me in ids and len(ids) >= 2:
            ids.remove(self.me)
        return list(members), ids


@pytest.mark.parametrize("n_gapped", [1, 3])
async def test_the_last_leader_leads_again_when_every_other_candidate_announced_a_gap(n_gapped: int):
    """One holder H and ``n_gapped`` gapped peers (1: round 12's two peers; 3: round 20's four). Before: every round
    after one H led had no plan in a whole attempt and a gapped last resort (``plan_last_resort``, ``plan_takeover``
    after its turn), every other round. Now H leads every round, nobody waits a turn."""
    peers = _peers(1 + n_gapped, cls=GappedPeer)
    for p in peers[1:]:
        p.gapped = True
        p.swarm.records[p.me] = p.record()  # its record announced the gap from the start
    holder = peers[0].me
    with events.capture("plan_last_resort") as resorts, events.capture("plan_takeover") as takeovers:
        await _run_all(peers, rounds=ROUNDS, min_peers=len(peers), full_view_peers=0)
    assert [e["round"] for e in resorts] == []  # before: rounds 1, 3, 5 (every other round), at each gapped peer
    assert takeovers == []
    for r in range(ROUNDS):
        assert {p.drv.history[r].leader for p in peers} == {holder[:10]}  # one plan a round, all in it
        assert all(p.drv.history[r].peers == len(peers) for p in peers)
    assert len({p.digest for p in peers}) == 1


async def test_a_gapped_peer_is_still_followed_where_another_holder_can_lead():
    """Two holders and a gapped peer: no self-succession holds as before (the other holder leads after each)."""
    peers = _peers(3, cls=GappedPeer)
    peers[2].gapped = True
    peers[2].swarm.records[peers[2].me] = peers[2].record()
    with events.capture("plan_last_resort") as resorts:
        await _run_all(peers, rounds=4, min_peers=3, full_view_peers=0)
    assert resorts == []
    led = [peers[0].drv.history[r].leader for r in range(4)]
    assert all(a != b for a, b in zip(led, led[1:]))  # the last leader never leads again: the other holder can
    assert set(led) <= {peers[0].me[:10], peers[1].me[:10]}
    assert all({p.drv.history[r].leader for p in peers} == {led[r]} for r in range(4))


@pytest.mark.parametrize("n", [2, 4])
def test_every_view_lets_the_last_leader_lead_where_every_other_candidate_announced_a_gap(n: int):
    """The rule itself: round r - 1's plan led by H, the others gapped (2: round 12, p1 and p2; 4: round 20). H counts
    every peer as a candidate, each gapped peer the others (itself left out). Before, over the candidates as they
    are: H's view barred H (no self-succession); with 2 the gapped view let H lead and deferred to it (the views
    disagree), with 4 each gapped view barred H and deferred to the other gapped ones: no candidate that publishes
    in any view either way. Over the candidates less the announced gaps every view lets H lead."""
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.round.planning import last_round_leaders
    from tests.unit.test_round import _planner, _record

    idents = [Identity.generate() for _ in range(n)]
    ids = [str(i.peer_id) for i in idents]
    h, gapped = ids[0], set(ids[1:])
    plan = _planner(19)([_record(i, 1.0) for i in idents], h)
    assert plan.leader == h and set(plan.participants()) == set(ids)
    views = {h: ids, **{g: [i for i in ids if i != g] for g in gapped}}
    before = {p: h in (last_round_leaders(plan, 20, c) or set(ids)) for p, c in views.items()}
    assert before == {h: False, **{g: n == 2 for g in gapped}}
    for p, c in views.items():  # each gapped peer's own announced gap counts in its own view (gaps_of)
        assert ungapped_leaders(plan, 20, c, set(gapped)) == frozenset(ids), p
    # one of them without a gap (a candidate in every view, its own included) bars the last leader everywhere
    a = ids[1]
    views[a] = ids
    for p, c in views.items():
        assert h not in (ungapped_leaders(plan, 20, c, gapped - {a}) or set()), p
    # no gap read at all: last_round_leaders as it is
    assert ungapped_leaders(plan, 20, ids, set()) == last_round_leaders(plan, 20, ids)


def test_a_record_announces_one_gap_a_round():
    """``node.training.record_state``: a gap announced in round R's record stays in the records re-stored in round R
    after it closed (the owner vote), so every read of round R takes the same level; round R + 1's record names none."""
    from types import SimpleNamespace

    from geomesh_p2p.node.training import record_state
    from tests.integration.test_lead_gap51 import _swarm
    from tests.integration.test_late_peer import R, _node

    _, recs = _swarm()
    policy = _node(recs, recs[0].peer_id, marks_from=0)  # holds every mark: no gap of its own
    node = SimpleNamespace(resync=SimpleNamespace(syncing=False), round=R, digest="d", penalties=policy.penalties)
    node.policy = policy
    assert record_state(node)["lead_from"] is None
    policy.announced_lead_from = R + 3  # round R's first record announced a gap, closed since
    assert record_state(node)["lead_from"] == R + 3 and policy.announced_lead_from == R + 3
    policy.announced_round = R - 1  # announced in an earlier round's record: not kept
    assert record_state(node)["lead_from"] is None and policy.announced_lead_from is None
