"""Red team 51d against the announced lead gap (``PeerRecord.lead_from``, gap51): a gapped candidate's take-over
turn is given to the next candidate at once, so a gapped peer that publishes anyway (a rogue, or an honest one whose
gap closed early by its voters' owner bars, ``Penalties.take_owner_bars``) races the next candidate's plan with no
head start. Plan agreement over an in-memory DHT; the plans followed are asserted, never timings."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from geomesh_p2p.plan.agree import PlanStore, leader_order, obtain_plan
from geomesh_p2p.round.planning import announced_gaps
from tests.integration.test_lead_gap51 import _swarm, _with_gap
from tests.integration.test_late_peer import RUN, R, _node
from tests.unit.test_round import MemoryDHT

pytestmark = pytest.mark.timeout(60)
T = 2.0  # plan timeout, s: the head start a first-ranked candidate had over the next one before gap51


class _ThreadView:
    """A view of ``dht`` for a peer run on its own event loop (thread): the shared dict only (GIL-atomic updates),
    not the store condition, which belongs to the main loop."""

    def __init__(self, dht: MemoryDHT):
        self.dht = dht
        self.read = threading.Event()  # set at the first read: G read the round before anyone published

    async def store(self, key, value, expiration_time, subkey=None, owner=None):
        self.dht.data.setdefault(key, {})[subkey] = (value, expiration_time, owner.peer_id if owner else None)
        return True

    async def get(self, key, latest=True, subkeys=None, quorum=None):
        got = dict(self.dht.data.get(key, {}))
        self.read.set()
        return got


async def _race(announce: bool, planning_s: float) -> tuple[list, list[str]]:
    """Round R: G (ranked first) leads in its own view (its gap closed early: it took its voters' owner bars after
    its record announced ``lead_from``) and plans for ``planning_s`` seconds (a loaded CPU, a big swarm) on its own
    process (a thread here); A and B read G's record (``announce``: with its ``lead_from``, else without). Returns
    the leaders followed by (A, B, G) and the ids (A, B, G)."""
    idents, recs = _swarm()
    ids = [x.peer_id for x in recs]
    g = ids[2]
    nodes = {p: _node(recs, p, marks_from=0) for p in ids}  # G holds every mark by now (its own view)
    members = recs[:2] + [_with_gap(recs[2], R + 5) if announce else recs[2]]
    live = {x.peer_id: x for x in members}
    dht = MemoryDHT()

    def args(k: int) -> dict:
        p, node = ids[k], nodes[ids[k]]
        cands = node.leader_candidates(members, live)[1]
        assert g in cands
        return dict(
            plan_timeout_s=T,
            poll_s=0.05,
            accept=lambda plan: node.plan_problem(plan, live),
            candidates=cands,
            gapped=announced_gaps(live, cands, R, p),
        )

    def slow_plan(ms, leader):
        time.sleep(planning_s)  # G's own process: the others run on
        return nodes[g].make_plan(ms, leader)

    got_g: list = []
    view = _ThreadView(dht)

    def run_g() -> None:
        plan = asyncio.run(obtain_plan(PlanStore(view, idents[2], RUN.run_id), R, members, slow_plan, **args(2)))
        got_g.append(None if plan is None else plan.leader)

    thread = threading.Thread(target=run_g)
    thread.start()
    assert await asyncio.to_thread(view.read.wait, 30)

    async def agree(k: int):
        got = await obtain_plan(
            PlanStore(dht.view(), idents[k], RUN.run_id), R, members, nodes[ids[k]].make_plan, **args(k)
        )
        return None if got is None else got.leader

    led = list(await asyncio.gather(agree(0), agree(1)))
    await asyncio.to_thread(thread.join, 30)
    return led + got_g, ids


async def test_before_the_announcement_a_slow_first_candidate_is_followed_by_all():
    """Without the announced gap the next candidate waits a plan timeout: G's slow plan is stored before B's and
    every peer follows it."""
    led, ids = await _race(announce=False, planning_s=0.75 * T)
    assert led == [ids[2]] * 3


async def test_a_gapped_peer_whose_gap_closed_early_and_plans_slowly_splits_nothing():
    """Finding 1 (red team 51d): with the gap announced, B publishes at once; G, which read no plan before it
    planned, published after B's plan had started and its settle had ended (A and B on B's plan) and followed its
    own: two plans followed in one round. The defence: a leader reads the plans again after planning, and follows
    a worse-ranked one that started meanwhile instead of publishing (obtain_plan)."""
    led, ids = await _race(announce=True, planning_s=0.75 * T)
    nxt = leader_order(RUN.run_id, R, ids)[1]
    assert nxt == ids[1] or nxt == ids[0]
    assert len(set(led)) == 1, led


@pytest.mark.parametrize("seen", [(True, False), (False, True)])
@pytest.mark.parametrize("rogue_publishes", [False, True])
async def test_a_gap_flipped_between_reads_splits_nothing(seen: tuple[bool, bool], rogue_publishes: bool):
    """A rogue G (ranked first) flips its ``lead_from`` between reads: one of A and B reads a gap, the other none.
    G stays silent, or publishes at once: every peer follows one plan (G's when it published), none gives up."""
    idents, recs = _swarm()
    ids = [x.peer_id for x in recs]
    g = ids[2]
    nodes = {p: _node(recs, p, marks_from=0) for p in ids}
    views = [recs[:2] + [_with_gap(recs[2], R + 18) if s else recs[2]] for s in seen] + [recs]
    dht = MemoryDHT()
    if rogue_publishes:
        assert await PlanStore(dht.view(), idents[2], RUN.run_id).publish(nodes[g].make_plan(recs, g))

    async def agree(k: int):
        members = views[k]
        live, node = {x.peer_id: x for x in members}, nodes[ids[k]]
        cands = node.leader_candidates(members, live)[1]
        assert g in cands  # ranked first by all: silent, it costs a plan timeout where no gap is read
        got = await obtain_plan(
            PlanStore(dht.view(), idents[k], RUN.run_id),
            R,
            members,
            node.make_plan,
            plan_timeout_s=1.0,
            settle_s=0.05,
            poll_s=0.05,
            accept=lambda plan: node.plan_problem(plan, live),
            candidates=cands,
            gapped=announced_gaps(live, cands, R, ids[k]),
        )
        return None if got is None else got.leader

    led = await asyncio.gather(*(agree(k) for k in range(2 + rogue_publishes)))
    want = g if rogue_publishes else leader_order(RUN.run_id, R, ids)[1]
    assert list(led) == [want] * len(led)


def test_malformed_lead_from_values_gap_nothing_or_refuse_only_their_own_record():
    """Wire values of ``lead_from``: out of [0, 2**40] or of another type, the record itself is refused (only its
    sender's: an honest one names a round past its own, at most MARK_SPAN_ROUNDS + OWNER_PENALTY_ROUNDS ahead); a
    value coerced to an int (``true``, ``"7"``) is a round like any other, and one at or before the round gaps
    nothing. A record without the field (0.18.0) gaps nothing; the largest value gaps its sender only, which still
    ranks and is followed when it publishes (test_lead_gap51.py)."""
    import json

    from geomesh_p2p.schema.peer import PeerRecord

    _, recs = _swarm()
    raw = json.loads(recs[2].to_bytes())
    for bad in (-1, (1 << 40) + 1, [R + 1], 1.5, {"r": R + 1}):
        with pytest.raises(ValueError):
            PeerRecord.from_bytes(json.dumps({**raw, "lead_from": bad}).encode())
    ids = [x.peer_id for x in recs]
    for value, gapped in ((True, False), (str(R), False), (str(R + 1), True), (1 << 40, True), (None, False)):
        rec = PeerRecord.from_bytes(json.dumps({**raw, "lead_from": value}).encode())
        live = {x.peer_id: x for x in recs[:2] + [rec]}
        assert announced_gaps(live, ids, R, ids[0]) == ([ids[2]] if gapped else []), value
        assert announced_gaps(live, ids, R, ids[2]) == []  # its own announcement never shortens its own wait


def test_a_peer_keeps_to_the_gap_its_record_announced_when_the_gap_closed_since():
    """The root of finding 1: a peer whose record announced ``lead_from`` past this round leads nothing in it, also
    when its own rules let it lead by now (the owner vote closed the gap after the record was stored): the others
    gave its turn to the next candidate on the announcement. The round after, with the record announcing none, it
    is a candidate again."""
    _, recs = _swarm()
    ids = [x.peer_id for x in recs]
    g = _node(recs, ids[2], marks_from=0)  # holds every mark: no lead_gap of its own
    live = {x.peer_id: x for x in recs}
    assert ids[2] in g.leader_candidates(recs, live)[1]
    g.announced_lead_from = R + 1  # what node.training.record_state wrote into its round-R record
    assert ids[2] not in g.leader_candidates(recs, live)[1]
    for announced in (R, None):  # a gap ending at this round, or none: it may lead
        g.announced_lead_from = announced
        assert ids[2] in g.leader_candidates(recs, live)[1]
