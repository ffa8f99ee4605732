"""A leader every other peer of its plan excludes is followed by none of them (session 45, ``verdicts.swarm_excluded``).

Session 45's backdoor run 12 (``/tmp/floor45/run12``): all three honest peers held confirmed verdicts against the
poisoner from round 4-5 (two on their own screens confirmed by each other's evidence, the third on a re-check of
the first's), yet it led round 6 and planned itself in (out from round 7). Round 5's leader could not lead round 6
(no self-succession), the poisoner was a participant of round 5 (planned in by a leader whose verdict came while it
planned), and it won round 6's rendezvous rank over the two honest candidates. Each honest peer left it out of its
own candidates and its first candidate published a plan without it, but a verdict of verified work never makes a
follower refuse a plan (a refusal while another honest peer had not confirmed split the swarm, sessions 19 and
28), so every follower took the best-ranked plan: the poisoner's. Now a record announces its settled exclusions
(``PeerRecord.excludes``) and a plan whose other participants all announce its leader is ignored as absent by
every follower. Run 4's round 5 (two of the three honest peers held the verdict, the third not yet) keeps the
poisoner's plan followed by all: ignoring it at the two would have split them from the third."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round import PlanStore, leader_order, obtain_plan
from geomesh_p2p.round.rules.verified import VerifiedWork
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust.standing import attest_key
from geomesh_p2p.trust.verdicts import Verdicts, swarm_excluded
from tests.unit.test_round import RUN, MemoryDHT, _planner, _record

pytestmark = pytest.mark.timeout(30)
T = 0.3  # plan timeout (s)
WHY = "round 2: no loss gain on its own batches: t 0.35 < 1.5"


def _swarm():
    """The poisoner ranked first for round 3 and three honest peers: (poisoner, [honest]) identities."""
    ids = [Identity.generate() for _ in range(4)]
    order = leader_order(RUN, 3, [str(i.peer_id) for i in ids])
    ids.sort(key=lambda i: order.index(str(i.peer_id)))
    return ids[0], ids[1:]


def _work(me: str, accused: str, held: str) -> VerifiedWork:
    """A peer's verified work holding ``held`` ("settled": confirmed by another verifier's evidence, "lone": its
    own check alone, "none") against ``accused``."""
    vw = VerifiedWork(SimpleNamespace(me=me))
    if held != "none":
        vw.verdicts()._exclude(accused, WHY, 2, lone=True)
    if held == "settled":
        vw.verdicts()._exclude(accused, WHY, 3, lone=False)  # another verifier's evidence re-checked here
    return vw


async def _round(held: list[str], rule: bool = True):
    """Round 3 with the poisoner ranked first: each honest peer holds ``held[k]`` against it (its records
    announce what :meth:`VerifiedWork.announced` gives); the holders leave it out of their members and leader
    candidates (``RoundPolicy.leader_candidates``), a peer without a verdict keeps it. Returns (the poisoner's id,
    the honest ids, the plan each honest peer follows)."""
    bad, honest = _swarm()
    a0 = str(bad.peer_id)
    works = [_work(str(h.peer_id), a0, k) for h, k in zip(honest, held)]
    records = [_record(bad, 1.0)] + [
        _record(h, 1.0).model_copy(update={"excludes": vw.announced(3)}) for h, vw in zip(honest, works)
    ]
    view = {r.peer_id: r for r in records}
    dht = MemoryDHT()

    def follow(ident: Identity, vw: VerifiedWork | None):
        me = str(ident.peer_id)
        members = records if vw is None else vw.members(records)
        return obtain_plan(
            PlanStore(dht.view(), ident, RUN),
            3,
            members,
            _planner(3),
            plan_timeout_s=T,
            settle_s=0.05,
            # the follower's accept: the swarm's verdict on the leader (NodeRoundPolicy.plan_problem's first check)
            accept=(lambda p: vw.swarm_problem(p, view)) if vw is not None and rule else None,
            candidates=[m.peer_id for m in members if m.peer_id == me or m.peer_id in view],
        )

    # the poisoner runs the protocol but follows its own plan whatever the records say (accept=None)
    got = await asyncio.gather(follow(bad, None), *(follow(h, vw) for h, vw in zip(honest, works)))
    return a0, [str(h.peer_id) for h in honest], got[1:]


async def test_run_12_every_honest_peer_holds_the_verdict_and_follows_the_next_candidates_plan():
    a0, honest, before = await _round(["settled"] * 3, rule=False)
    # the case of the logs: every holder followed the poisoner's best-ranked plan, which names it
    assert {p.leader for p in before} == {a0} and all(a0 in p.participants() for p in before)
    a0, honest, got = await _round(["settled"] * 3)
    assert len({p.to_bytes() for p in got}) == 1  # one plan for the three: no fork
    assert got[0].leader == honest[0]  # the best-ranked honest candidate's (the next in the leader order)
    assert sorted(got[0].participants()) == sorted(honest)  # without the poisoner: out from this round


async def test_run_4_a_peer_without_the_verdict_keeps_everyone_on_the_best_ranked_plan():
    """Run 4's round 5: two honest peers held confirmed verdicts, the third had not concluded its own screen.
    Ignoring the poisoner's plan at the two would have left the third on it with the poisoner (a fork): all three
    follow it, as before, and the exclusion waits for the third's verdict."""
    a0, honest, got = await _round(["settled", "settled", "none"])
    assert len({p.to_bytes() for p in got}) == 1
    assert got[0].leader == a0 and sorted(got[0].participants()) == sorted([a0, *honest])


async def test_a_lone_verdict_is_not_announced_and_moves_nobody():
    """Verdicts held alone (each honest peer's own check, not confirmed by another's evidence) are never announced:
    their holders keep following the swarm's plan (issue 28, "verdicts that cannot fork")."""
    a0, honest, got = await _round(["lone", "lone", "lone"])
    assert len({p.to_bytes() for p in got}) == 1 and got[0].leader == a0
    a0, honest, got = await _round(["settled", "settled", "lone"])
    assert len({p.to_bytes() for p in got}) == 1 and got[0].leader == a0


def test_the_rule_reads_records_of_the_plans_round_naming_the_leader_only():
    bad, honest = _swarm()
    a0, ids = str(bad.peer_id), [str(h.peer_id) for h in honest]
    plan = _planner(3)([_record(bad, 1.0)] + [_record(h, 1.0) for h in honest], a0)
    every = {p: _record(h, 1.0).model_copy(update={"excludes": [attest_key(a0)]}) for p, h in zip(ids, honest)}
    why = swarm_excluded(plan, every)
    assert why is not None and a0[:10] in why and "(3," in why
    vw = VerifiedWork(SimpleNamespace(me=ids[0]))
    assert isinstance(vw.swarm_problem(plan, every), ContentRefusal)  # ignored as absent by every follower
    stale = dict(every)
    stale[ids[2]] = every[ids[2]].model_copy(update={"round": 2})  # a record of another round: not read yet
    assert swarm_excluded(plan, stale) is None
    missing = {p: r for p, r in every.items() if p != ids[2]}
    assert swarm_excluded(plan, missing) is None
    other = dict(every)
    other[ids[2]] = every[ids[2]].model_copy(update={"excludes": [attest_key(ids[0])]})  # excludes someone else
    assert swarm_excluded(plan, other) is None
    honest_plan = _planner(3)([_record(h, 1.0) for h in honest], ids[0])
    assert swarm_excluded(honest_plan, every) is None  # its leader is excluded by nobody
    alone = _planner(3)([_record(bad, 1.0)], a0)
    assert swarm_excluded(alone, every) is None  # no other participant: nothing to read


def test_a_record_announces_settled_verdicts_only_fixed_for_its_round():
    v = Verdicts("me")
    v._exclude("lone-peer-aaaaaaaaaaaaaaaa", WHY, 2, lone=True)
    v._exclude("confirmed-bbbbbbbbbbbbbbbbbbb", WHY, 2, lone=True)
    v._exclude("confirmed-bbbbbbbbbbbbbbbbbbb", WHY, 3, lone=False)
    v.exclude_proven("proven-cccccccccccccccccccccc", "a forged part", 4)
    assert v.announced() == sorted(
        [attest_key("confirmed-bbbbbbbbbbbbbbbbbbb"), attest_key("proven-cccccccccccccccccccccc")]
    )
    assert v.announced(limit=1) == [attest_key("proven-cccccccccccccccccccccc")]  # the newest verdict
    vw = VerifiedWork(SimpleNamespace(me="me"))
    assert vw.announced(5) == []
    vw.verdicts()._exclude("late-dddddddddddddddddddddddd", WHY, 5, lone=False)
    assert vw.announced(5) == []  # the round's records announce one list: the verdict from the next round on
    assert vw.announced(6) == [attest_key("late-dddddddddddddddddddddddd")]


def test_the_records_field_is_left_out_when_empty_and_bounded():
    ident = Identity.generate()
    plain = _record(ident, 1.0)
    assert b"excludes" not in plain.to_bytes()  # a record without verdicts is what the previous version wrote
    held = plain.model_copy(update={"excludes": ["abcdefghijklmnop"]})
    assert PeerRecord.from_bytes(held.to_bytes()).excludes == ["abcdefghijklmnop"]
    with pytest.raises(ValueError):
        PeerRecord.model_validate({**plain.model_dump(), "excludes": ["x" * 16] * 65})
    with pytest.raises(ValueError):
        PeerRecord.model_validate({**plain.model_dump(), "excludes": [""]})
