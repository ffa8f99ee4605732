"""Red team 51c, in-process: a young swarm of two fresh newcomers and one established peer that stays live and never
publishes a plan (a rogue announcing its record, or a peer whose own view leaves it out). split51
(``planning.established_resorts``) left the newcomers out of the last resorts while that peer was established in
their view (its own record's attestation, the only one a fresh joiner reads), so no plan appeared at any attempt
while its record lived. Now (``planning.NEWCOMER_RESORT_MISSES``) a newcomer publishes from the third attempt with no
plan at all. Two round drivers with the in-memory fakes of tests/unit/test_round_driver.py and the node's round
rules (tests/integration/test_leader_livelock.py); the silent peer is a record only. Counted, not timed."""

from __future__ import annotations


import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.round.planning import NEWCOMER_RESORT_MISSES
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.driver_util import run_bounded
from tests.integration.test_leader_livelock import RulesPeer
from tests.unit.test_round_driver import PEER_INDEX, PEERS, Swarm

pytestmark = pytest.mark.timeout(60)


class Peer(RulesPeer):
    """:class:`RulesPeer` whose last resorts are the node's too (``planning.established_resorts`` asks the policy)."""

    def standing_established_ids(self, records, peer_ids=None):
        return self._sync_rules().standing_established_ids(records, peer_ids)


async def test_newcomers_lead_past_a_live_established_peer_that_never_publishes():
    swarm = Swarm()
    ix, i1, i2 = (Identity.generate() for _ in range(3))
    lx = Standing()
    for t in range(20):
        lx.credit(t, [str(ix.peer_id)])  # it trained rounds 0-19 alone
    silent = Peer(swarm, ix, lx, {})
    n1, n2 = Peer(swarm, i1, Standing(), {}), Peer(swarm, i2, Standing(), {})
    for k, p in enumerate((silent, n1, n2)):
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        p.theta.fill_(0.5)  # the state the newcomers downloaded
        p.commit(20)
        swarm.records[p.me] = p.record()
    recs = list(swarm.records.values())
    live = {r.peer_id: r for r in recs}
    assert n1.leader_candidates(recs, live)[1] == [silent.me]  # established in a fresh joiner's view
    drivers = [p.driver(rounds=21, min_peers=2) for p in (n1, n2)]
    with events.capture("plan_takeover") as takeovers:
        # a hang guard only (before: no plan at any attempt while the silent peer's record lived)
        await run_bounded(drivers, 20)
    led = [e for e in takeovers if e["round"] == 20 and e.get("last_resort")]
    assert led and {e["peer"] for e in led} <= {n1.me, n2.me}
    # one plan leader for the round at both newcomers, in a bounded number of attempts
    assert max(n1.agreements, n2.agreements) <= NEWCOMER_RESORT_MISSES + 2, (n1.agreements, n2.agreements)
