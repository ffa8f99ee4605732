"""Red team 51c on split51 (``round.planning.established_resorts`` in ``last_resort``;
``recover_last_plan`` + ``NodeRoundPolicy.note_recovered_plan``).

Findings (worst first):

1. Fixed here (``planning.NEWCOMER_RESORT_MISSES``): a young swarm of newcomers and one established peer that stays
   live and publishes nothing (a rogue, or one whose own view leaves it out) had no plan at all, for ever: every
   newcomer saw that peer established (its own record's attestation, the only one a fresh joiner has) and left
   itself out of the last resorts at every attempt. Now a newcomer is a last resort from the third attempt of a
   round and state with no plan at all; the established last resorts still publish alone in the second (fresh user
   51's round 20 is unchanged).
2. Fixed here (``planning.vouched``): one rogue voter's reference, where the honest voters at this peer's round and
   state name no plan (a joint restart, red team 48), made a peer take the marks of a forged round r - 1 plan naming
   it: a bench and an owner bar the honest peers never took (before split51 a forged recovered plan moved only one
   round's leader rule). Now the marks are taken only when more than half of the voters name that plan.

Counts and values, no timings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh_p2p.round.planning import NEWCOMER_RESORT_MISSES, last_resort
from tests.rules_util import make_rules
from tests.unit.test_recovered_sat_out51 import _ledger

pytestmark = pytest.mark.timeout(60)

X, N1, N2 = "Xr0gueEst" + "x" * 31, "NewcomerA" + "a" * 31, "NewcomerB" + "b" * 31


def _young_swarm():
    """X trained rounds 0-19 alone (established, its own record attests it), N1 and N2 joined at round 20 (fresh:
    no ledger, their records attest nothing). Returns (records, rules of N1, rules of X)."""
    lx = _ledger([(t, [X]) for t in range(20)])
    recs = [SimpleNamespace(peer_id=X, standing=lx.attestations(exclude=X, own=True), address="127.0.0.1:1")]
    recs += [SimpleNamespace(peer_id=p, standing=None, address="127.0.0.1:1") for p in (N1, N2)]
    return recs, make_rules(me=N1, round=20, marks_from=None), make_rules(me=X, round=20, standing=lx)


def _drv(rules, me, misses):
    return SimpleNamespace(me=me, state=SimpleNamespace(digest="d20"), _plan_misses=(20, "d20", misses), policy=rules)


def test_a_live_established_peer_that_never_publishes_holds_the_newcomers_out_for_one_attempt_only():
    recs, n1, x = _young_swarm()
    live = {r.peer_id: r for r in recs}
    members, cands = n1.leader_candidates(recs, live)
    assert cands == [X]  # the newcomer defers to X, established in its view by X's own attestation
    assert x.leader_candidates(recs, live)[1] == [X]  # an honest X leads in the first attempt: nobody gets here
    assert last_resort(_drv(n1, N1, 1), 20, members, cands) == []  # split51: X may publish as the last resort
    # X published nothing in a whole escalated attempt either: the newcomers are last resorts (before: [] for ever
    # while X's record lived, a rogue X announcing on held the swarm with no plan at all)
    for misses in range(NEWCOMER_RESORT_MISSES, NEWCOMER_RESORT_MISSES + 20):
        assert last_resort(_drv(n1, N1, misses), 20, members, cands) == sorted([N1, N2])


def test_a_crashed_established_peer_no_longer_holds_the_newcomers_once_its_record_is_gone():
    recs, n1, _ = _young_swarm()
    left = [r for r in recs if r.peer_id != X]
    members, cands = n1.leader_candidates(left, {r.peer_id: r for r in left})
    # nobody established in view: every member may lead (a young swarm); N1 leaves itself out (its own standing)
    assert cands == [N2]
    assert last_resort(_drv(n1, N1, 1), 20, members, cands) == [N1]


def test_the_established_last_resort_alone_publishes_in_the_second_attempt_round_20_unchanged():
    """Fresh user 51's round 20: p4 (on probation) is no last resort in the second attempt, where p3 publishes."""
    from tests.unit.test_recovered_sat_out51 import P1, P3, P4, _records

    full = [(t, [P1, P3] + ([P4] if t >= 18 else [])) for t in range(20)]
    ledgers = {
        P1: _ledger(full),
        P3: _ledger([x for x in full if not 8 <= x[0] <= 12]),
        P4: _ledger([x for x in full if x[0] >= 18]),
    }
    p3, p4 = (make_rules(me=p, round=20, standing=ledgers[p]) for p in (P3, P4))
    recs = _records(ledgers)
    assert last_resort(_drv(p3, P3, 1), 20, recs, [P1]) == [P3]  # type: ignore[arg-type]
    assert last_resort(_drv(p4, P4, 1), 20, recs, [P3]) == []  # type: ignore[arg-type]
    # only when p3 (and p1) published nothing in that attempt too
    assert last_resort(_drv(p4, P4, NEWCOMER_RESORT_MISSES), 20, recs, [P3]) == sorted([P1, P4])  # type: ignore[arg-type]


async def test_one_rogue_voters_forged_plan_does_not_bench_an_honest_peer():
    """The plan is taken (red team 48's rule: most voters name none, the one readable reference counts) but its
    marks only when more than half of the voters name it (``planning.vouched``); both voters naming it: taken."""
    from geomesh_p2p.plan.agree import PlanStore
    from geomesh_p2p.round.last_plan import plan_ref
    from geomesh_p2p.round.planning import recover_last_plan
    from tests.unit.test_last_plan import _peers
    from tests.unit.test_last_plan import _plan as real_plan
    from tests.unit.test_round import RUN, MemoryDHT, _record

    for both in (False, True):
        ident, pid = _peers("RHA")
        dht = MemoryDHT()
        forged = real_plan(ident, pid, "R", "RHA", round=2)  # R signs a round 2 plan naming A, start digest d0
        assert await PlanStore(dht.view(), ident["R"], RUN).publish(forged)
        rules = make_rules(me=pid["A"], round=2, digest="d1")  # A applied rounds 0-1 (it holds its own marks)
        rules.state.round = 3
        drv = SimpleNamespace(
            _plan_seen=None,
            plans=SimpleNamespace(plan_of=PlanStore(dht.view(), ident["A"], RUN).read_exact),
            state=SimpleNamespace(digest="d1"),
            me=pid["A"],
            policy=rules,
        )
        rogue = _record(ident["R"], 1.0).model_copy(update={"last_plan": plan_ref(forged), "weights_digest": "d1"})
        named = {"last_plan": plan_ref(forged)} if both else {}  # not both: H resumed, it names no plan
        honest = _record(ident["H"], 1.0).model_copy(update={"weights_digest": "d1", **named})
        live = {x.peer_id: x for x in (rogue, honest)}
        assert await recover_last_plan(drv, 3, live, [pid["R"], pid["H"]]) is None  # type: ignore[arg-type]
        assert drv._plan_seen.to_bytes() == forged.to_bytes()  # the leader rule is red team 48's, as before
        assert (pid["A"] in rules.penalties.unled()) is both and (pid["A"] in rules.penalties.barred()) is both
