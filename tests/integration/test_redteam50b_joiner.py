"""Red team 50b of joiner50 (``Penalties.announced_unled`` in ``policy.leader_candidates``): a rogue's word on itself.

A follower without the swarm's history takes the marks peers announce on themselves; a mark can only shrink its
candidates, so ``round.planning.last_round_leaders`` can only give it a later (larger) level than the holders'. A
rogue X that is the holders' only candidate of round r - 1's first level announces a mark it does not hold
(``unled_until``): the holders expect X's plan (they do not take the word), the joiner drops X, takes the level
with round r - 1's leader L and waits for L's plan only. Honest L knows it may not lead (not in the holders' level):
the joiner obtains no plan while the holders follow X's (a sit-out each round X arranges this); a colluding L
succeeding itself is followed by the joiner alone, X's by the holders: two plans in one round. Fixed in session 52:
a claim counts only where more than half of the voters back it (``Penalties.backed_unled``: the claimant's
``unled_until``, the others' ``unled_marks``), so X's word alone (1 of 2 voters) leaves the joiner the holders' level.

Round rules with fake records (test_late_peer.py's helpers) and the plan agreement over an in-memory DHT, as
tests/integration/test_joiner_leaders50.py."""

from __future__ import annotations

import pytest

from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.plan.agree import PlanStore
from geomesh_p2p.round.planning import last_round_leaders
from geomesh_p2p.trust.standing import Standing, attest_key
from tests.integration.test_joiner_leaders50 import _at, _follow_as, _peers
from tests.integration.test_late_peer import RUN, R, _ar, _next_round, _node
from tests.rules_util import make_rules
from tests.unit.test_round import MemoryDHT

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("leader_colludes", [False, True])
async def test_a_rogue_announcing_a_mark_on_itself_takes_the_joiner_off_the_holders_plan(leader_colludes):
    idents, recs = _peers(3)
    ids = [x.peer_id for x in recs]
    lead, x, j = ids
    holders = {p: _node(recs[:2], p) for p in (lead, x)}
    plan_r = holders[lead].planning.build_plan(recs[:2], lead)
    for node in holders.values():
        _next_round(node, plan_r, _ar(plan_r, set()))
    joiner = _node(recs[:2], j, marks_from=None)
    joiner.state.round = R + 1
    # X, a rogue, announces a mark it does not hold (no peer holds one on it)
    members = [_at(recs[0], R + 1), _at(recs[1], R + 1, unled_until=R + 5), _at(recs[2], R + 1)]
    live = {p.peer_id: p for p in members}
    assert holders[lead].penalties.unled() == set() and joiner.penalties.announced_unled(members) == {x}
    dht = MemoryDHT()
    rogue_plan = holders[x].planning.build_plan(members, x)
    assert await PlanStore(dht.view(), idents[1], RUN.run_id).publish(rogue_plan)
    if leader_colludes:  # L succeeding itself: the holders refuse it as content
        assert await PlanStore(dht.view(), idents[0], RUN.run_id).publish(
            holders[lead].planning.build_plan(members, lead)
        )
    followed, levels = {}, {}
    for p, node in [(lead, holders[lead]), (j, joiner)]:
        store = PlanStore(dht.view(), idents[ids.index(p)], RUN.run_id)
        levels[p], followed[p] = await _follow_as(node, store, plan_r, members, live, p)
    assert levels[lead] == frozenset({x})  # the holders' level: X only (L led round R)
    assert followed[lead] == x
    # wanted: the joiner's level and plan are the holders' whatever X says of itself
    assert (levels[j], followed[j]) == (levels[lead], x)


def test_an_out_of_range_unled_until_is_a_malformed_record_and_the_cap_bars_only_its_peer():
    """Negative, past 2**40 or not an integer: the record is refused by its schema (``dht.announce`` drops it with the
    field and reason, the reads go on); the cap itself bars only the peer announcing it, at any round."""
    from pydantic import ValidationError

    _, recs = _peers(2)
    for bad, why in ((-1, "greater than or equal to 0"), ((1 << 40) + 1, "less than or equal to"), ([3], "integer")):
        with pytest.raises(ValidationError, match=why):
            _at(recs[1], R + 1, unled_until=bad)
    joiner = _node(recs, recs[0].peer_id, marks_from=None)
    capped = _at(recs[1], R + 1, unled_until=1 << 40)
    assert capped.unled_until == 1 << 40
    assert joiner.penalties.announced_unled([_at(recs[0], R + 1), capped]) == {recs[1].peer_id}


@pytest.mark.xfail(
    strict=True,
    reason="session 52 (open): a fresh joiner reads the standing of the rounds it missed from the records' attestations, "
    "a record's entry for its own peer included; with two attestors (k = 2) a rogue X that leaves its own entry out "
    "is not established for the joiner, which drops X from its candidates and takes the level with round r-1's leader "
    "L, as with a self-announced unled_until",
)
def test_a_rogue_leaving_its_own_standing_entry_out_takes_a_fresh_joiner_off_the_holders_level():
    """The same kind through ``PeerRecord.standing`` (``trust.probation.StandingView.attested``: the k-th highest of
    the trusted attestations, ``ATTESTORS`` 2). The holders go by their own ledgers; a joiner that credited nothing
    counts X only where two records vouch for it, and X's own is one of the two."""
    _, recs = _peers(3)
    lead, x, j = (r.peer_id for r in recs)
    holders = {p: _node(recs[:2], p) for p in (lead, x)}
    plan_r = holders[lead].planning.build_plan(recs[:2], lead)
    for node in holders.values():
        _next_round(node, plan_r, _ar(plan_r, set()))
    said = {p: holders[p].state.standing.attestations(exclude=p, own=True) for p in (lead, x)}
    assert said[x] == {attest_key(lead): R, attest_key(x): R}  # what an honest X announces
    joiner = make_rules(RUN, NodeConfig(), me=j, round=R + 1, digest="d2", numel=200_000, standing=Standing())
    levels = {}
    for case, own in (("honest", said[x]), ("rogue", {attest_key(lead): R})):
        members = [_with(recs[0], said[lead]), _with(recs[1], own), _with(recs[2], {})]
        live = {m.peer_id: m for m in members}
        levels[case] = [
            last_round_leaders(plan_r, R + 1, node.leader_candidates(members, live)[1])
            for node in (holders[lead], joiner)
        ]
    assert levels["honest"] == [frozenset({x}), frozenset({x})]
    assert levels["rogue"] == [frozenset({x}), frozenset({x})]  # wanted: the holders' level whatever X says


def _with(rec, standing: dict):
    """``rec`` announced at round ``R + 1`` (digest d2) with ``standing`` as its attestations."""
    return rec.model_copy(update={"round": R + 1, "weights_digest": "d2", "standing": standing})
