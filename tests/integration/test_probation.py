"""Probation for new identities (issue 12, the planning half; geomesh_p2p/trust/probation.py): a burst of
identities that never take part gets one probation slot (no part, bounded budget, outside the quorum),
owners do not wait for them, a no-show is not planned again for a while, and they never lead.
Unit tests with fake records; tests/test_sybil.py runs the attack with processes."""

from __future__ import annotations

import asyncio
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.exchange import CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.plan.planner import check_plan, make_plan
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from tests.rules_util import make_rules
from geomesh_p2p.round import LEADER_WAIT_CANDIDATES, PlanStore, leader_order, obtain_plan, takeover_delay
from geomesh_p2p.trust.standing import Standing, attest_key

from tests.unit.test_round import MemoryDHT

pytestmark = pytest.mark.timeout(60)
RUN = RunConfig(seq_len=32, window_s=5.0)


def _rec(ident, port, *, tps=1000.0, standing=None, round=5) -> PeerRecord:
    return peer_record(
        ident,
        address=f"127.0.0.1:{port}",
        tokens_per_s={4: tps * 0.6, 8: tps},
        round=round,
        weights_digest="d",
        standing=standing or {},
    )


def _swarm(n_honest=3, n_sybils=30, delivered=5):
    """Honest records (they trained rounds 0..delivered-1 together) and Sybil records claiming 20x."""
    hon = [Identity.generate() for _ in range(n_honest)]
    syb = [Identity.generate() for _ in range(n_sybils)]
    vouch = {attest_key(str(i.peer_id)): 32 for i in syb}  # Sybils vouch for each other
    honest = [
        _rec(i, 7000 + k, standing={attest_key(str(o.peer_id)): delivered for o in hon if o is not i})
        for k, i in enumerate(hon)
    ]
    sybils = [_rec(i, 9000, tps=20_000.0, standing=vouch) for i in syb]
    return hon, honest, sybils


def _node(me: str, *, round=5, credited=(), standing=None) -> NodeRoundPolicy:
    """The round rules of peer ``me`` at ``round`` (a 200k-parameter model), its ledger crediting ``credited``."""
    if standing is None:
        standing = Standing()
        for r, ids in credited:
            standing.credit(r, ids)
    return make_rules(RUN, NodeConfig(), me=me, round=round, digest="d", numel=200_000, standing=standing)


def _trained_node(honest, me=None, rounds=5):
    ids = [r.peer_id for r in honest]
    return _node(me or ids[0], round=rounds, credited=[(r, ids) for r in range(rounds)])


# ------------------------------------------------------------------------------------ probation selection
def test_thirty_new_identities_get_one_probation_slot_no_part_and_a_bounded_budget():
    _, honest, sybils = _swarm()
    node = _trained_node(honest)
    plan = node.planning.build_plan(honest + sybils, honest[0].peer_id)
    assert len(plan.participants()) == 4, len(plan.participants())  # before probation: 33
    assert set(plan.established()) == {r.peer_id for r in honest}
    [sybil] = plan.probation()
    a = plan.assignment(sybil)
    assert not a.owns_part and sybil not in [o[0] for o in plan.owners()]
    est_budgets = [plan.assignment(r.peer_id).token_budget for r in honest]
    assert a.token_budget <= pb.PROBATION_BUDGET_FACTOR * statistics.median_low(est_budgets)
    # Every honest peer (same ledger) picks the same Sybil, and follows the plan.
    for other in honest[1:]:
        o = _trained_node(honest, me=other.peer_id)
        assert o.planning.build_plan(honest + sybils, other.peer_id).probation() == [sybil]
        live = {r.peer_id: r for r in honest + sybils}
        o.state.numel = plan.numel
        assert o.planning.plan_problem(plan, live) is None
    # Another round, another slot (a Sybil cannot pick its slot; rendezvous hash per round).
    picks = {
        pb.select_probation("run", r, node.planning.standing_view(honest), [s.peer_id for s in sybils], 1)[0]
        for r in range(20)
    }
    assert len(picks) > 5


def test_more_established_peers_open_more_slots_and_a_newcomer_that_delivered_keeps_its_slot():
    assert [pb.probation_slots(n) for n in (0, 1, 3, 4, 7, 8, 40)] == [1, 1, 1, 1, 1, 2, 10]
    _, honest, sybils = _swarm()
    newcomer = _rec(Identity.generate(), 7100)
    ids = [r.peer_id for r in honest]
    # the newcomer delivered in round 4 only: standing 1 < 3, but ahead of 30 zero-standing identities
    node = _node(ids[0], credited=[(r, ids + ([newcomer.peer_id] if r == 4 else [])) for r in range(5)])
    for _ in range(3):
        plan = node.planning.build_plan(honest + sybils + [newcomer], ids[0])
        assert plan.probation() == [newcomer.peer_id]
        node.state.round += 1


def test_a_fresh_swarm_plans_everyone_established_exactly_as_before():
    ids = [Identity.generate() for _ in range(3)]
    recs = [_rec(i, 7000 + k, round=0) for k, i in enumerate(ids)]
    node = _node(recs[0].peer_id, round=0)  # nobody has standing yet
    node.planning.run_cfg = RunConfig(seq_len=32, window_s=5.0)
    plan = node.planning.build_plan(recs, recs[0].peer_id)
    assert plan.probation() == [] and len(plan.participants()) == 3
    cfg = node.planning.plan_config(3)
    plain = make_plan(
        recs,
        cfg,
        run_id=RUN.run_id,
        round=0,
        leader=recs[0].peer_id,
        numel=node.state.numel,
        start_time=plan.created_at,
        start_digest="d",
    )
    assert [a.model_dump() for a in plain.assignments] == [a.model_dump() for a in plan.assignments]
    # round 1: those who delivered round 0 are established (threshold min(K, ceil(r / 2)) = 1), a late joiner is not
    late = _rec(Identity.generate(), 7200, round=1)
    node = _node(recs[0].peer_id, round=1, credited=[(0, [r.peer_id for r in recs])])
    assert node.planning.build_plan(recs + [late], recs[0].peer_id).probation() == [late.peer_id]


def test_a_view_fills_missed_rounds_from_attestations_of_peers_it_saw_deliver():
    _, honest, sybils = _swarm()
    assert [pb.threshold(r) for r in range(8)] == [0, 1, 1, 2, 2, 3, 3, 3]
    # a late joiner with an empty ledger: the honest peers vouch for each other, nobody for it
    me = Identity.generate()
    view = pb.StandingView(Standing(), honest + sybils + [_rec(me, 7300)], round=5, me=str(me.peer_id))
    assert all(view.established(r.peer_id) for r in honest)
    assert not view.established(str(me.peer_id))
    assert view.plausible(sybils[0].peer_id)  # it missed everything: lenient as a follower
    # once it delivered one round with the honest peers, Sybil attestations no longer count
    s = Standing()
    s.credit(5, [r.peer_id for r in honest] + [str(me.peer_id)])
    view = pb.StandingView(s, honest + sybils, round=6, me=str(me.peer_id))
    assert all(view.established(r.peer_id) for r in honest)
    assert not any(view.established(x.peer_id) for x in sybils)
    assert not view.established(str(me.peer_id))  # its ledger: 1 < 3, and nobody it saw deliver vouches more
    # a peer that restarted: the peers it trained with vouch for the rounds it delivered before (as in their
    # view, so it leads when they expect it to); identities it never saw deliver cannot do that
    known = [r.model_copy(update={"standing": {**r.standing, attest_key(str(me.peer_id)): 3}}) for r in honest]
    assert pb.StandingView(s, known + sybils, round=6, me=str(me.peer_id)).established(str(me.peer_id))
    liars = [x.model_copy(update={"standing": {attest_key(str(me.peer_id)): 32}}) for x in sybils]
    assert not pb.StandingView(s, honest + liars, round=6, me=str(me.peer_id)).established(str(me.peer_id))
    assert pb.StandingView(Standing(), honest + liars, round=6, me=str(me.peer_id)).score(str(me.peer_id)) == 0


# ------------------------------------------------------------------------------------ plan checks
def test_followers_refuse_a_probation_leader_and_sybils_planned_as_established():
    hon, honest, sybils = _swarm()
    node = _trained_node(honest)
    live = {r.peer_id: r for r in honest + sybils}
    # a Sybil leading, even with an honest-looking plan
    rogue = _trained_node(honest)
    rogue.state.me = sybils[0].peer_id
    plan = rogue.planning.build_plan(honest + sybils, sybils[0].peer_id)
    reason = node.planning.plan_problem(plan, live)
    assert reason is not None and "probation" in reason, reason
    # an honest leader whose view was fooled: Sybils planned as established
    fooled = _node(honest[1].peer_id)  # empty ledger, sees Sybil vouches
    fooled.state.standing = Standing()
    plan = fooled.planning.build_plan(honest + sybils[:3], honest[1].peer_id)
    reason = node.planning.plan_problem(plan, live)
    assert reason is not None and "as established" in reason, reason
    # too many on probation for the established ones, whatever the view
    cfg = node.planning.plan_config(5)
    plan = make_plan(
        honest + sybils[:2],
        cfg,
        run_id=RUN.run_id,
        round=5,
        leader=honest[0].peer_id,
        numel=node.state.numel,
        start_time=time.time(),
        start_digest="d",
        probation=[s.peer_id for s in sybils[:2]],
    )
    reason = check_plan(plan, live, cfg, now=time.time())
    assert reason is not None and "at most 1 may join" in reason, reason


def test_a_late_joiner_follows_the_honest_plan():
    _, honest, sybils = _swarm()
    plan = _trained_node(honest).planning.build_plan(honest + sybils, honest[0].peer_id)
    joiner = _node(str(Identity.generate().peer_id))
    live = {r.peer_id: r for r in honest + sybils}
    assert joiner.planning.plan_problem(plan, live) is None


# ------------------------------------------------------------------------------------ quorum and early close
def _spec(pids, probation=(), quorum=0.5):
    owners = [PartOwner(pids[0], "127.0.0.1:1", 0, 4096)]
    return CollectiveSpec(
        "r",
        1,
        {p: 100 for p in pids},
        owners,
        4096,
        time.time() + 5,
        time.time() + 6,
        mode="relay",
        quorum=quorum,
        probation=probation,
    )


def test_the_quorum_counts_established_participants_and_their_contributions_only():
    pids = [str(Identity.generate().peer_id) for _ in range(4)]
    plain = _spec(pids)
    assert plain.quorum_count() == 2
    spec = _spec(pids, probation=[pids[3]])
    assert spec.established() == sorted(pids[:3]) or set(spec.established()) == set(pids[:3])
    assert spec.quorum_count() == 2  # ceil(0.5 x 3)
    assert not spec.quorum_met([pids[0], pids[3]])  # a probation contribution does not make the quorum
    assert spec.quorum_met([pids[0], pids[1]])
    assert CollectiveSpec.from_dict(spec.to_dict()).spec_id == spec.spec_id
    assert spec.spec_id != plain.spec_id
    with pytest.raises(ValueError):
        _spec(pids, probation=pids)  # somebody must be established
    # thirty no-shows on probation cannot make a part miss its quorum (before: 33 x 0.5 = 17 needed)
    many = pids[:3] + [str(Identity.generate().peer_id) for _ in range(30)]
    assert _spec(many, probation=many[3:]).quorum_count() == 2


async def test_owners_close_parts_a_grace_after_the_established_pushed_not_at_the_deadline(swarms):
    sw = await swarms(3, n_clients=1)  # the client is on probation and never pushes
    pids = sw.pids
    spec = sw.spec(
        3 * 2048, mode="relay", deadline_s=8.0, pull_s=2.0, rule="meanmed", quorum=0.5, probation=[pids[3]], grace_s=0.3
    )
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(spec.numel, generator=g) for _ in range(3)]
    with events.capture("part_closed") as closed:
        results = await asyncio.gather(*[sw.services[k].all_reduce(spec, deltas[k], tokens=100) for k in range(3)])
    # every part closed a grace after the established pushed (before: at the 8 s deadline, for the no-show)
    assert sorted((e["round"], e["part"], e["reason"], tuple(e["absent"])) for e in closed) == [
        (spec.round, j, "established pushed", (pids[3],)) for j in range(len(spec.owners))
    ]
    for res in results:
        assert res.missing_parts == []
        assert all({p for p, _ in who} == set(pids[:3]) for who in res.contributors.values())
    assert len({bytes(r.aggregate.numpy()) for r in results}) == 1


# ------------------------------------------------------------------------------------ no-shows
def test_a_planned_peer_that_contributed_nothing_is_not_planned_for_a_while():
    _, honest, sybils = _swarm(n_sybils=2)
    node = _trained_node(honest)
    plan = node.planning.build_plan(honest + sybils, honest[0].peer_id)
    [sybil] = plan.probation()
    ar = SimpleNamespace(contributors={0: [(r.peer_id, 100) for r in honest]})
    node.penalties.note_no_shows(plan, ar)
    node.state.round += 1
    nxt = node.planning.build_plan(honest + sybils, honest[0].peer_id)
    assert sybil not in nxt.participants() and len(nxt.participants()) == 4  # the other Sybil's turn
    node.state.round += pb.PROBATION_NOSHOW_PENALTY_ROUNDS
    assert (
        sybil
        in node.planning.build_plan(
            [*honest, next(s for s in sybils if s.peer_id == sybil)], honest[0].peer_id
        ).participants()
    )
    # an established no-show: shorter, and it is no leader candidate meanwhile
    node = _trained_node(honest)
    ar = SimpleNamespace(contributors={0: [(r.peer_id, 100) for r in honest[:2]]})
    node.penalties.note_no_shows(node.planning.build_plan(honest, honest[0].peer_id), ar)
    assert node.penalties.noshows() == {honest[2].peer_id: 5 + pb.NOSHOW_PENALTY_ROUNDS}
    node.state.round = 6
    assert honest[2].peer_id not in node.planning.build_plan(honest, honest[0].peer_id).participants()
    assert honest[2].peer_id not in pb.leader_candidates(
        node.planning.standing_view(honest), [r.peer_id for r in honest], node.penalties.noshows()
    )
    # nothing is concluded from a round without any part result
    node = _trained_node(honest)
    node.penalties.note_no_shows(node.planning.build_plan(honest, honest[0].peer_id), SimpleNamespace(contributors={}))
    assert node.penalties.noshows() == {}


# ------------------------------------------------------------------------------------ leader candidates
def test_leader_candidates_are_the_established_members():
    _, honest, sybils = _swarm()
    node = _trained_node(honest)
    ids = [r.peer_id for r in honest + sybils]
    assert set(pb.leader_candidates(node.planning.standing_view(honest + sybils), ids)) == {r.peer_id for r in honest}
    fresh = _node(honest[0].peer_id, round=0)
    assert set(pb.leader_candidates(fresh.planning.standing_view(honest), [r.peer_id for r in honest])) == {
        r.peer_id for r in honest
    }


def test_takeover_delay_is_bounded_whatever_the_number_of_candidates():
    T = 4.0
    assert [takeover_delay(i, T, 0.5) for i in range(3)] == [0.0, 4.0, 8.0]
    assert takeover_delay(3, T, 0.5) == 8.5
    assert max(takeover_delay(i, T, 0.5) for i in range(1000)) == (LEADER_WAIT_CANDIDATES + 1) * T


async def test_silent_better_ranked_candidates_cost_a_bounded_wait_and_non_candidates_never_publish():
    from geomesh_p2p.plan.awb import plan_round
    from geomesh_p2p.plan.schema import PlanConfig

    cfg = PlanConfig(seq_len=64, target_batch=8, window_s=5.0, payload_bytes=10_000)
    ids = [Identity.generate() for _ in range(12)]
    members = [_rec(i, 7000 + k) for k, i in enumerate(ids)]
    pool = [m.peer_id for m in members]
    order = leader_order("r", 3, pool)
    live = next(i for i in ids if str(i.peer_id) == order[-1])  # the worst-ranked of 12 candidates
    sybil = next(i for i in ids if str(i.peer_id) == order[0])  # best-ranked, but not a candidate

    def planner(ms, leader):
        return plan_round(ms, cfg, run_id="r", round=3, leader=leader, numel=1000, start_time=time.time() + 1)

    dht = MemoryDHT()
    T = 0.4
    silent_candidates = pool  # every other candidate is silent (never runs obtain_plan)
    with events.capture("plan_takeover") as takeovers:
        plan = await obtain_plan(
            PlanStore(dht.view(), live, "r"),
            3,
            members,
            planner,
            plan_timeout_s=T,
            settle_s=0.05,
            candidates=silent_candidates,
        )
    assert plan.leader == str(live.peer_id)
    # the 12th candidate waited a bounded delay, not one plan timeout per silent candidate (before: 11 x T)
    [t] = takeovers
    assert (t["peer"], t["turn"]) == (str(live.peer_id), 11)
    assert t["delay_s"] == takeover_delay(11, T, 0.05) <= (LEADER_WAIT_CANDIDATES + 1) * T < 11 * T
    assert t["after_s"] >= t["delay_s"]
    # a non-candidate never publishes, even when it ranks first and nobody else does
    dht2 = MemoryDHT()
    got = await obtain_plan(
        PlanStore(dht2.view(), sybil, "r"),
        3,
        members,
        planner,
        plan_timeout_s=0.1,
        settle_s=0.05,
        candidates=[p for p in pool if p != str(sybil.peer_id)],
        give_up_s=0.5,
    )
    assert got is None and dht2.data == {}


def test_a_newcomer_that_downloaded_a_lone_peers_state_follows_it_and_sees_it_established():
    """A young swarm (docs/admission.md, "A young swarm"): ``a`` trained rounds 0-5 alone; ``b`` downloaded
    its state. ``a``'s record attests its own 6 rounds, so ``b`` sees it established as ``a`` sees itself,
    and ``b`` (on probation in both views) names only ``a`` as leader: before, ``b`` saw nobody established,
    ranked itself among the candidates and led a plan ``a`` refused (two lineages)."""
    a, b = Identity.generate(), Identity.generate()
    pa, pb_ = str(a.peer_id), str(b.peer_id)
    lone = Standing()
    for r in range(6):
        lone.credit(r, [pa])
    assert lone.attestations(exclude=pa) == {} and lone.attestations(exclude=pa, own=True) == {attest_key(pa): 6}
    recs = [_rec(a, 7000, round=6, standing=lone.attestations(exclude=pa, own=True)), _rec(b, 7001, round=6)]
    newcomer = _node(pb_, round=6)
    view = newcomer.planning.standing_view(recs)
    assert (view.score(pa), view.established(pa), view.score(pb_), view.established(pb_)) == (6, True, 0, False)
    assert newcomer.leader_candidates(recs, {r.peer_id: r for r in recs})[1] == [pa]
    # the leader's view agrees: b on probation, a the only candidate; b follows a's plan
    leader = _node(pa, round=6, standing=lone)
    assert leader.leader_candidates(recs, {r.peer_id: r for r in recs})[1] == [pa]
    plan = leader.planning.build_plan(recs, pa)
    assert plan.probation() == [pb_]
    assert newcomer.planning.plan_problem(plan, {r.peer_id: r for r in recs}) is None
    # without a's own attestation b still never ranks itself: it sees nobody established and follows
    bare = [recs[0].model_copy(update={"standing": {}}), recs[1]]
    assert not any(newcomer.planning.standing_view(bare).established(p) for p in (pa, pb_))
    assert newcomer.leader_candidates(bare, {r.peer_id: r for r in bare})[1] == [pa]
    # a lone member still leads (nobody else could)
    assert newcomer.leader_candidates(bare[1:], {pb_: bare[1]})[1] == [pb_]


def test_own_attestations_never_establish_an_identity_this_node_did_not_see_deliver():
    """The own entry is read only from trusted records and only for missed rounds: Sybils that never
    delivered with a trained peer gain nothing by attesting themselves 32 rounds."""
    hon, honest, sybils = _swarm()
    selfish = [x.model_copy(update={"standing": {**x.standing, attest_key(x.peer_id): 32}}) for x in sybils]
    node = _trained_node(honest)
    # it applied round 4 (its delivered-work evidence): a peer without it leaves itself out of its candidates
    node.profile.supported_tps = (4, {r.peer_id: 1000.0 for r in honest})
    view = node.planning.standing_view(honest + selfish)
    assert not any(view.established(x.peer_id) or view.plausible(x.peer_id) for x in selfish)
    assert node.leader_candidates(honest + selfish, {r.peer_id: r for r in honest + selfish})[1] == sorted(
        r.peer_id for r in honest
    )


def test_one_established_attestor_alone_cannot_vouch_identities_into_a_late_joiners_established_set():
    """Red team, session 34: a node that missed rounds reads attestations from the peers it saw deliver; with the
    highest attestation counted, one established attacker's record attesting ``ATTEST_TOP`` identities that never
    delivered made all of them established (leader candidates) in a late joiner's view. Now a standing counts when
    ``ATTESTORS`` (2) trusted attestors vouch for it: the honest peers, who attest each other, stay established;
    the attacker's 16 stay on probation."""
    from geomesh_p2p.trust.standing import ATTEST_TOP, attest_key

    honest = [str(Identity.generate().peer_id) for _ in range(3)]
    attacker = str(Identity.generate().peer_id)
    sybils = [str(Identity.generate().peer_id) for _ in range(ATTEST_TOP)]
    ledger = Standing()
    for r in range(20, 30):  # joined at round 20: 10 rounds credited, 20 of the window missed
        ledger.credit(r, honest + [attacker])
    everyone = {attest_key(p): 30 for p in honest + [attacker]}
    recs = [SimpleNamespace(peer_id=p, standing=everyone) for p in honest]
    recs.append(SimpleNamespace(peer_id=attacker, standing={**everyone, **{attest_key(p): 32 for p in sybils}}))
    recs += [SimpleNamespace(peer_id=p, standing={}) for p in sybils]
    view = pb.StandingView(ledger, recs, round=30, me=honest[0])
    assert (view.threshold, view.credited, view.missed, pb.ATTESTORS) == (3, 10, 20, 2)
    est, probation = pb.split(view, honest + [attacker] + sybils)
    assert est == sorted(honest + [attacker]) and probation == sorted(sybils)
    assert [view.attested(p) for p in sybils] == [0] * ATTEST_TOP
    assert view.attested(honest[1]) == 30  # 4 attestors at 30
    # a second attestor vouching for the same identities is what it takes (two colluding established peers)
    recs[0] = SimpleNamespace(peer_id=honest[0], standing={**everyone, attest_key(sybils[0]): 32})
    view = pb.StandingView(ledger, recs, round=30, me=honest[1])
    assert view.established(sybils[0]) and not view.established(sybils[1])


@pytest.mark.parametrize("method", ["diloco", "awb"])
def test_a_two_rank_newcomer_on_probation_gets_a_per_device_budget_every_follower_accepts(method):
    """Stop 62's CI failure (session 53): a 2-rank newcomer joined a uniform (diloco, H=2) swarm in round 1; its
    2 steps of its two devices' batch were 2x the established median, over the per-peer probation bound, and no
    leader can plan fewer steps: every follower, the leader too, refused every honest plan and round 1 never ended.
    The bound is per device now, as the median cap (probation_limit), in the planner and in the check alike."""
    ids = [Identity.generate() for _ in range(2)]
    honest = [_rec(i, 7000 + k) for k, i in enumerate(ids)]
    two = _rec(Identity.generate(), 7100, tps=2000.0).model_copy(update={"ranks": 2, "max_batch": 16})
    run = RunConfig(seq_len=32, window_s=5.0, method=method, uniform_inner_steps=2)
    pids = [r.peer_id for r in honest]
    nodes = [_node(p, credited=[(r, pids) for r in range(5)]) for p in pids]
    for n in nodes:
        n.planning.run_cfg = run
    plan = nodes[0].planning.build_plan(honest + [two], pids[0])
    assert plan.probation() == [two.peer_id]
    a = plan.assignment(two.peer_id)
    median = statistics.median_low([plan.assignment(p).token_budget for p in pids])
    assert a.token_budget <= pb.PROBATION_BUDGET_FACTOR * 2 * median
    if method == "diloco":  # H=2 for all, the 2-rank peer trains both devices' rows: exactly 2x
        assert a.token_budget == 2 * median, (a.token_budget, median)
    live = {r.peer_id: r for r in honest + [two]}
    for n in nodes:
        n.state.numel = plan.numel
        assert n.planning.plan_problem(plan, live) is None
    # the same plan for a one-rank newcomer (its record without ranks) stays refused, by every follower alike
    one = {**live, two.peer_id: two.model_copy(update={"ranks": 1})}
    if a.token_budget > 1.5 * median:
        reasons = {n.planning.plan_problem(plan, one) for n in nodes}
        assert len(reasons) == 1 and None not in reasons, reasons
