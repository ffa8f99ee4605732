"""The two-peer leader livelock of the real-process benchmark (docs/realswarm.md, rs7): after the
established peers left, the two remaining ones each waited for the other's plan for minutes, because each
left itself out of its own leader candidates (one not established in its own view, the other marked a
no-show by itself). In-process: two round drivers with the in-memory fakes of tests/unit/test_round_driver.py
and the node's real round rules for leader candidates, planning and plan checks (standing views, no-show
marks, probation marking), built from the ledgers the rs7 logs show."""

from __future__ import annotations

import asyncio

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.round.policy import NodeRoundPolicy
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust.standing import Standing
from tests.records_util import peer_record
from tests.rules_util import make_rules
from tests.unit.test_round_driver import NUMEL, PEER_INDEX, PEERS, FakePeer, Swarm

pytestmark = pytest.mark.timeout(60)
RUN = RunConfig(seq_len=16, window_s=5.0, run_id="driver-test")


class RulesPeer(FakePeer):
    """A fake peer whose leader candidates, plans and plan checks are the node's (NodeRoundPolicy, the node's
    round rules, with this peer's ledger and no-show marks); its records attest its ledger as a node's do."""

    def __init__(self, swarm: Swarm, ident: Identity, standing: Standing, noshow: dict[str, int]):
        super().__init__(swarm, ident)
        # the round rules only: no transport, no model
        self.rules = make_rules(RUN, NodeConfig(), me=self.me, numel=NUMEL, standing=standing, noshow_penalty=noshow)

    def _sync_rules(self) -> NodeRoundPolicy:
        self.rules.state.round, self.rules.state.digest = self.round, self.digest
        return self.rules

    def record(self) -> PeerRecord:
        return peer_record(
            self.me,
            address=f"127.0.0.1:{7000 + PEER_INDEX[self.me]}",
            tokens_per_s={8: 2000.0},
            round=self.round,
            weights_digest=None if self.syncing else self.digest,
            leaving=self.leaving,
            standing=self.rules.state.standing.attestations(exclude=self.me, own=True),
        )

    def leader_candidates(self, members, live):
        return self._sync_rules().leader_candidates(members, live)

    def make_plan(self, members, leader):
        return self._sync_rules().make_plan(members, leader)

    def plan_problem(self, plan, live):
        return self._sync_rules().plan_problem(plan, live)


def _rs7_pair() -> tuple[RulesPeer, RulesPeer, list[str]]:
    """The two peers left at round 5 of rs7, with the ledgers their logs show: both delivered round 0 with
    the two peers that then left (P0, P1); ``p3`` also credited round 2 (P0 and P1 delivered, it did not:
    it marked itself a no-show on probation until round 12); ``p2`` was planned out of every round after 0
    and caught up by outer updates (nothing credited). Both hold the same round-5 state."""
    p0, p1 = (str(Identity.generate().peer_id) for _ in range(2))
    swarm = Swarm()
    ids = [Identity.generate(), Identity.generate()]
    l2, l3 = Standing(), Standing()
    l2.credit(0, [p0, p1, str(ids[0].peer_id), str(ids[1].peer_id)])
    l3.credit(0, [p0, p1, str(ids[0].peer_id), str(ids[1].peer_id)])
    l3.credit(2, [p0, p1])
    p2 = RulesPeer(swarm, ids[0], l2, {})
    p3 = RulesPeer(swarm, ids[1], l3, {str(ids[1].peer_id): 2 + pb.PROBATION_NOSHOW_PENALTY_ROUNDS})
    for k, p in enumerate((p2, p3)):
        PEERS[p.me], PEER_INDEX[p.me] = p, k
        p.theta.fill_(0.5)  # the same round-5 state on both
        p.commit(5)
        swarm.records[p.me] = p.record()
    return p2, p3, [p0, p1]


def test_the_rs7_views_leave_each_peer_deferring_to_the_other():
    """The election as the logs show it: each peer's only leader candidate is the other."""
    p2, p3, _ = _rs7_pair()
    recs = [p2.record(), p3.record()]
    live = {r.peer_id: r for r in recs}
    assert p2.leader_candidates(recs, live)[1] == [p3.me]  # p2: nobody established, itself left out
    assert p3.leader_candidates(recs, live)[1] == [p2.me]  # p3: marked itself a no-show
    # ... and each would follow the other's plan: the livelock is in the election, not in the checks
    assert p3.plan_problem(p2.make_plan(recs, p2.me), live) is None
    assert p2.plan_problem(p3.make_plan(recs, p3.me), live) is None


async def test_two_peers_that_each_defer_to_the_other_plan_and_train_a_round_in_two_attempts():
    """Before: both drivers logged "no plan appeared; retrying" until stopped (rs7: 6 minutes). Now, after one
    attempt without any plan each becomes the last resort; one plan is published and followed by both, and
    round 5 is trained in the second plan attempt at the latest (counted, not timed: a loaded machine stretches
    each attempt, not their number)."""
    p2, p3, _ = _rs7_pair()
    drivers = [p.driver(rounds=6, min_peers=2) for p in (p2, p3)]
    with events.capture("plan_last_resort") as resorts, events.capture("plan_takeover") as takeovers:
        # a hang guard only (the livelock never ends): the attempts are counted below
        await asyncio.wait_for(asyncio.gather(*[d.run() for d in drivers]), 20)
    rows = [d.history for d in drivers]
    assert [[r.round for r in h] for h in rows] == [[5], [5]]
    assert rows[0][0].leader == rows[1][0].leader and rows[0][0].peers == 2
    assert all(r.inner_steps_done > 0 and r.contributors == 2 for h in rows for r in h)
    assert p2.digest == p3.digest and p2.round == p3.round == 6
    # a peer that took the last resort said so once, naming the one it deferred to (both do, unless one
    # followed the other's plan before its own first attempt ended)
    pairs = {(p2.me, (p3.me,)), (p3.me, (p2.me,))}
    assert resorts and {(e["peer"], tuple(e["candidates"])) for e in resorts} <= pairs
    assert len(resorts) == len({e["peer"] for e in resorts})
    assert any(e["last_resort"] for e in takeovers if e["round"] == 5)
    # bounded: one attempt without a plan, then the one the last resort leads (or a first attempt that
    # followed the other's plan); the livelock was an unbounded number of attempts
    assert 1 <= p2.agreements <= 2 and 1 <= p3.agreements <= 2, (p2.agreements, p3.agreements)
