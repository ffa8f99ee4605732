"""Round r - 1's plan for a peer that did not obtain it (``round/last_plan.py``, red team 47b): the records'
references, the checked read of the plan they name, the vote, the doubt and the driver's use of it. The fork the
rule closes is in tests/unit/test_redteam47.py (``_lead_fork``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PlanDeferred, PlanStore, leader_order
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round.last_plan import KEEP_ROUNDS, parse_ref, plan_ref, record_ref, recover, remember
from geomesh_p2p.round.planning import doubt_problem, recover_last_plan
from geomesh_p2p.schema.peer import PeerRecord
from tests.unit.test_round import RUN, MemoryDHT, _planner, _record

pytestmark = pytest.mark.timeout(60)


def _peers(names: str) -> tuple[dict, dict]:
    ident = {k: Identity.generate() for k in names}
    return ident, {k: str(i.peer_id) for k, i in ident.items()}


def _plan(ident: dict, pid: dict, leader: str, names: str, round: int = 2, accused: tuple = ()) -> RoundPlan:
    plan = _planner(round)([_record(ident[k], 1.0) for k in names], pid[leader])
    return RoundPlan.model_validate({**plan.model_dump(), "accused": sorted(pid[a] for a in accused)})


def _named(ident: dict, refs: dict) -> list[PeerRecord]:
    """Records at round 3, digest d0, each naming ``refs[letter]`` (None: nothing)."""
    return [_record(ident[k], 1.0).model_copy(update={"last_plan": refs.get(k)}) for k in ident]


async def _published_real_and_shadow():
    """Peers L X Y B A; round 2's real plan (L leads, X accused) and Y's shadow of it, both stored in a fresh
    in-memory DHT: (ident, pid, dht, real, shadow)."""
    ident, pid = _peers("LXYBA")
    dht = MemoryDHT()
    real, shadow = _plan(ident, pid, "L", "LXYB", accused=("X",)), _plan(ident, pid, "Y", "LXYB")
    assert await PlanStore(dht.view(), ident["L"], RUN).publish(real)
    assert await PlanStore(dht.view(), ident["Y"], RUN).publish(shadow)
    return ident, pid, dht, real, shadow


def test_a_reference_names_the_leader_and_the_plans_bytes_hash_and_a_malformed_one_is_none():
    ident, pid = _peers("LX")
    plan = _plan(ident, pid, "L", "LX")
    ref = plan_ref(plan)
    leader, sha = parse_ref(ref) or ("", "")
    assert leader == pid["L"] and len(sha) == 64 and ref.endswith(sha)
    for bad in (None, 7, "", pid["L"], f"{pid['L']}/{sha[:-1]}", f"{pid['L']}/{sha.upper()}", f"a/b/{sha}", f"/{sha}"):
        assert parse_ref(bad) is None, bad


def test_the_record_field_round_trips_and_is_absent_while_none():
    ident, _ = _peers("L")
    rec = _record(ident["L"], 1.0)
    assert b"last_plan" not in rec.to_bytes()  # a record naming no plan is byte for byte a 0.15 record
    ref = plan_ref(_plan(ident, {"L": str(ident["L"].peer_id)}, "L", "L"))
    named = rec.model_copy(update={"last_plan": ref})
    assert PeerRecord.from_bytes(named.to_bytes()).last_plan == ref
    with pytest.raises(ValueError):
        PeerRecord.model_validate({**rec.model_dump(), "last_plan": "x" * 161})


def test_remember_keeps_the_last_rounds_and_the_record_names_the_plan_of_the_round_before():
    ident, pid = _peers("LX")
    drv = SimpleNamespace(_plan_seen=None)
    assert record_ref(drv, 3) is None and record_ref(None, 3) is None
    for r in range(1, 6):
        remember(drv, _plan(ident, pid, "L", "LX", round=r))
    assert drv._plan_seen.round == 5 and sorted(drv._plans_by_round) == list(range(6 - KEEP_ROUNDS, 6))
    assert record_ref(drv, 6) == plan_ref(drv._plans_by_round[5]) and record_ref(drv, 7) is None


async def test_the_exact_read_returns_the_referenced_plan_past_its_end_and_refuses_others_with_a_reason():
    ident, pid = _peers("LYA")
    dht = MemoryDHT()
    real = _plan(ident, pid, "L", "LYA")
    real = RoundPlan.model_validate({**real.model_dump(), "exchange_deadline": 1.0, "train_deadline": 0.5})
    assert await PlanStore(dht.view(), ident["L"], RUN).publish(real)
    store = PlanStore(dht.view(), ident["A"], RUN)
    assert await store.read(2) == []  # long past its round's end: no plan to follow ...
    leader, sha = parse_ref(plan_ref(real)) or ("", "")
    got, why = await store.read_exact(2, leader, sha)  # ... but the one that made the state is still read
    assert got is not None and got.to_bytes() == real.to_bytes() and why == ""
    other = _plan(ident, pid, "L", "LY")
    got, why = await store.read_exact(2, leader, parse_ref(plan_ref(other))[1])  # type: ignore[index]
    assert got is None and "hash differs" in why
    got, why = await store.read_exact(2, pid["Y"], sha)
    assert got is None and "no plan of round 2" in why
    got, why = await store.read_exact(3, leader, sha)
    assert got is None and "no plan of round 3" in why
    # Y stores, under its own subkey, a plan that names L as its leader: not signed by L
    forged = _plan(ident, pid, "L", "LY")
    assert await PlanStore(dht.view(), ident["Y"], RUN).publish(forged)
    got, why = await store.read_exact(2, pid["Y"], parse_ref(plan_ref(forged))[1])  # type: ignore[index]
    assert got is None and "names another leader" in why


async def test_the_vote_takes_the_majority_reference_and_counts_only_voters_at_this_round_and_digest():
    ident, pid, dht, real, shadow = await _published_real_and_shadow()
    read = PlanStore(dht.view(), ident["A"], RUN).read_exact
    voters = [pid[k] for k in "LXYB"]
    records = _named(ident, {"X": plan_ref(real), "B": plan_ref(real), "Y": plan_ref(shadow)})
    held = await recover(read, records, 3, "d0", voters)
    assert held is not None and held.plan is not None and held.plan.to_bytes() == real.to_bytes()
    assert "2 of 3 voters" in held.why
    # no voter names one: no rule (as before); nor do records of another round, digest, or of non-voters
    assert await recover(read, _named(ident, {}), 3, "d0", voters) is None
    assert await recover(read, records, 3, "d1", voters) is None
    assert await recover(read, records, 4, "d0", voters) is None
    assert await recover(read, records, 3, "d0", [pid["A"]]) is None
    # a tie: in doubt, both plans read
    records = _named(ident, {"X": plan_ref(real), "B": plan_ref(real), "Y": plan_ref(shadow), "L": plan_ref(shadow)})
    held = await recover(read, records, 3, "d0", voters)
    assert held is not None and held.plan is None and {q.leader for q in held.doubt} == {pid["L"], pid["Y"]}
    assert "no majority" in held.why
    # a tie where the real plan's reference cannot be read (its hash forged or the plan overwritten): the readable
    # shadow alone would clear L; nothing is cleared
    forged = f"{pid['L']}/{'0' * 64}"
    records = _named(ident, {"X": forged, "B": forged, "Y": plan_ref(shadow), "L": plan_ref(shadow)})
    held = await recover(read, records, 3, "d0", voters)
    assert held is not None and held.plan is None and held.doubt == () and "hash differs" in held.why


async def test_a_forged_majority_reference_leaves_the_peer_in_doubt_with_no_plan_and_it_follows_none():
    """Three voters name a plan of L's that L never stored (a forged hash): not taken, nor any other; the peer in
    doubt refuses every plan with the read's reason (it sits the round out where one ranks first)."""
    ident, pid = _peers("LXYBA")
    dht = MemoryDHT()
    real = _plan(ident, pid, "L", "LXYB")
    assert await PlanStore(dht.view(), ident["L"], RUN).publish(real)
    forged = f"{pid['L']}/{'0' * 64}"
    records = _named(ident, {"X": forged, "Y": forged, "B": forged, "L": plan_ref(real)})
    read = PlanStore(dht.view(), ident["A"], RUN).read_exact
    held = await recover(read, records, 3, "d0", [pid[k] for k in "LXYB"])
    assert held is not None and held.plan is None and not held.doubt and "hash differs" in held.why
    plan3 = _planner(3)([_record(ident[k], 1.0) for k in "XB"], pid["X"])
    reason = doubt_problem(plan3, held, 3, [pid[k] for k in "LXYB"])
    assert reason is not None and "cannot tell which it was" in reason and "hash differs" in reason


def test_in_doubt_a_plan_is_followed_only_when_every_plan_named_lets_its_leader_lead():
    ident, pid = _peers("LXYB")
    real, shadow = _plan(ident, pid, "L", "LXYB", accused=("X",)), _plan(ident, pid, "Y", "LXYB")
    held = SimpleNamespace(plan=None, doubt=(real, shadow), why="split")
    cands = [pid[k] for k in "LXYB"]

    def plan3(leader: str) -> RoundPlan:
        return _planner(3)([_record(ident[k], 1.0) for k in "LXYB"], pid[leader])

    assert doubt_problem(plan3("B"), held, 3, cands) is None  # a participant of both, leader and accused of none
    assert "may not lead under the plan of round 2 from" in (doubt_problem(plan3("L"), held, 3, cands) or "")
    assert doubt_problem(plan3("Y"), held, 3, cands) is not None  # led the shadow
    assert doubt_problem(plan3("X"), held, 3, cands) is not None  # accused in the real one
    assert doubt_problem(plan3("L"), None, 3, cands) is None  # no doubt: no objection here


async def test_the_driver_takes_the_named_plan_once_and_not_while_it_holds_round_r_minus_1s():
    ident, pid = _peers("LXBA")
    dht = MemoryDHT()
    real = _plan(ident, pid, "L", "LXB", accused=("X",))
    assert await PlanStore(dht.view(), ident["L"], RUN).publish(real)
    reads: list = []
    store = PlanStore(dht.view(), ident["A"], RUN)

    async def plan_of(round: int, leader: str, sha: str):
        reads.append((round, leader))
        return await store.read_exact(round, leader, sha)

    drv = SimpleNamespace(
        _plan_seen=_plan(ident, pid, "L", "LXB", round=1),
        plans=SimpleNamespace(plan_of=plan_of),
        state=SimpleNamespace(digest="d0"),
        me=pid["A"],
    )
    live = {r.peer_id: r for r in _named(ident, {"X": plan_ref(real), "B": plan_ref(real), "A": "ignored"})}
    cands = [pid[k] for k in "LXBA"]
    assert await recover_last_plan(drv, 3, live, cands) is None  # type: ignore[arg-type]
    assert drv._plan_seen.to_bytes() == real.to_bytes() and reads == [(2, pid["L"])]
    assert record_ref(drv, 3) == plan_ref(real)  # it names the plan it took from now on
    assert await recover_last_plan(drv, 3, live, cands) is None and len(reads) == 1  # type: ignore[arg-type]
    assert await recover_last_plan(drv, 0, live, cands) is None  # type: ignore[arg-type]
    # it obtained round 3's plan in an attempt that left its state at round 3: round 2's kept plan is the rule again
    remember(drv, _plan(ident, pid, "X", "LXB", round=3))
    assert await recover_last_plan(drv, 3, live, cands) is None and len(reads) == 1  # type: ignore[arg-type]
    assert drv._plan_seen.to_bytes() == real.to_bytes()
    # a plan agreement without plan_of (a test double): nothing read, no rule, as before
    bare = SimpleNamespace(_plan_seen=None, plans=SimpleNamespace(), state=drv.state, me=pid["A"])
    assert await recover_last_plan(bare, 3, live, cands) is None  # type: ignore[arg-type]
    assert bare._plan_seen is None


async def test_a_driver_in_doubt_warns_once_a_round_and_returns_the_doubt():
    ident, pid, dht, real, shadow = await _published_real_and_shadow()
    store = PlanStore(dht.view(), ident["A"], RUN)
    drv = SimpleNamespace(
        _plan_seen=None,
        plans=SimpleNamespace(plan_of=store.read_exact),
        state=SimpleNamespace(digest="d0"),
        me=pid["A"],
    )
    refs = {"X": plan_ref(real), "B": plan_ref(real), "Y": plan_ref(shadow), "L": plan_ref(shadow)}
    live = {r.peer_id: r for r in _named(ident, refs)}
    doubt = await recover_last_plan(drv, 3, live, [pid[k] for k in "LXYB"])  # type: ignore[arg-type]
    assert doubt is not None and doubt.plan is None and len(doubt.doubt) == 2
    assert drv._plan_seen is None and drv._doubt_said == 3


async def test_a_driver_that_sat_a_round_out_takes_its_plan_from_the_others_records_and_follows_theirs():
    """Three drivers over one in-memory DHT: C refuses round 0's plan (a view of its own) and leads none, sits the
    round out and re-syncs, so it holds no plan of round 0 when it agrees round 1. The others' records name round 0's plan
    (``PeerRecord.last_plan``); C takes it (one ``last_plan_recovered`` event naming round 0's leader) and follows
    the plan the others follow in round 1, with equal digests."""
    from geomesh_p2p.telemetry import events
    from tests.unit.test_round_driver import FakePeer, _peers, _run_all

    from tests.unit.test_round_driver import PEERS

    peers = _peers(3)
    a, b, c = (PEERS[p] for p in leader_order(RUN, 0, [p.me for p in peers]))

    def refuse_round0(plan, live):
        return "a view of its own (test)" if plan.round == 0 else FakePeer.plan_problem(c, plan, live)

    def defer_round0(members, leader):  # nor does C lead round 0 (under load its turn may come first)
        if c.round == 0:
            raise PlanDeferred("C leads nothing in round 0 (test)")
        return FakePeer.make_plan(c, members, leader)

    c.plan_problem = refuse_round0  # type: ignore[method-assign]
    c.make_plan = defer_round0  # type: ignore[method-assign]
    with events.capture("last_plan_recovered") as recovered:
        await _run_all(peers, rounds=2)
    assert 0 not in [row.round for row in c.drv.history]  # it sat round 0 out (refused, or behind: re-synced)
    leader0 = a.drv._plans_by_round[0].leader
    assert [(e["peer"], e["round"], e["leader"]) for e in recovered] == [(c.me, 1, leader0)]
    assert c.drv._plans_by_round[0].to_bytes() == a.drv._plans_by_round[0].to_bytes()
    assert len({p.drv._plans_by_round[1].to_bytes() for p in peers}) == 1
    assert c.drv.history[-1].round == 1 and c.drv.history[-1].leader == a.drv.history[-1].leader
    assert len({p.digest for p in peers}) == 1
