"""Issue 14 #11: a 2+2 partition heals; the side whose state loses the vote re-syncs to the other's and
says so in one WARNING line (rounds trained since the fork, the peers of its side, the tokens discarded,
the rule that picked the survivor). Driven with the in-memory fakes of tests/test_round_driver.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.round import DhtPlanAgreement, PlanStore
from geomesh_p2p.round.driver import SURVIVOR_RULE
from tests.unit.test_round_driver import PEERS, RUN, Swarm, _peers

pytestmark = pytest.mark.timeout(60)


def _move(peers, swarm: Swarm) -> None:
    """Put ``peers`` on ``swarm`` (records, plans, exchange) with the drivers they have (and their lineage)."""
    for p in peers:
        p.swarm = swarm
        swarm.records[p.me] = p.record()
        p.drv.plans = DhtPlanAgreement(PlanStore(swarm.dht, p.ident, RUN))


async def _run(peers, rounds: int) -> None:
    for p in peers:
        p.leaving = p.drv.leaving = False
        p.drv.cfg.rounds = rounds
    await asyncio.wait_for(asyncio.gather(*[p.drv.run() for p in peers]), 30)


def _side_by_majority(p):
    """The fakes' vote: the round most other peers announce with a digest (the later one on a tie)."""

    def vote(records):
        rounds = [r.round for r in records if r.peer_id != p.me and r.weights_digest]
        return max(set(rounds), key=lambda x: (rounds.count(x), x)) if rounds else None

    return vote


async def test_the_losing_side_of_a_healed_partition_logs_what_it_discards(caplog):
    swarm = Swarm()
    peers = _peers(4, swarm)
    for p in peers:
        p.driver(rounds=1, min_peers=4)
    await _run(peers, 1)  # round 0 together
    a, b = peers[:2], peers[2:]
    _move(a, Swarm())
    _move(b, Swarm())
    await _run(a, 4)  # partitioned: side A trains rounds 1-3, side B rounds 1-2
    await _run(b, 3)
    assert {p.round for p in a} == {4} and {p.round for p in b} == {3} and a[0].digest != b[0].digest
    assert all(p.drv.history[0].peers == 4 for p in peers) and all(
        row.peers == 2 for p in peers for row in p.drv.history[1:]
    )
    for p in peers:
        p.leaving = False  # they ran their rounds: still live, not leaving
    healed = Swarm()  # the partition heals: everyone sees everyone's records
    _move(a + b, healed)
    loser = b[0]
    loser.swarm_round = _side_by_majority(loser)
    with (
        caplog.at_level(logging.WARNING, logger="geomesh_p2p.node.peer.round"),
        events.capture("partition_lost") as lost,
    ):
        assert await loser.drv.behind()
        await loser.drv.resync("the swarm is at a later round")
    assert (loser.round, loser.digest) == (4, a[0].digest) and PEERS[a[0].me].digest == a[0].digest
    # what it discards, from the round history of both peers of its side
    own = sum(row.tokens for row in loser.drv.history[1:])
    side = own + sum(row.tokens for row in b[1].drv.history[1:])
    assert own > 0 and side == 2 * own
    facts = [
        (e["peer"], e["round"], e["digest"], e["discarded_rounds"], e["side"], e["tokens"], e["own_tokens"])
        for e in lost
    ]
    assert facts == [(loser.me, 4, a[0].digest, [1, 2], sorted(p.me for p in b), side, own)]
    # one WARNING line, and it tells the reader the rule that picked the surviving side
    assert len([r for r in caplog.records if r.name == "geomesh_p2p.node.peer.round"]) == 1
    assert lost[0]["level"] == "WARNING" and lost[0]["message"].endswith(f"Rule: {SURVIVOR_RULE}")
    assert [e.round for e in loser.drv.lineage] == [0]  # the discarded rounds are forgotten
    # the winning side re-syncs to nothing; a catch-up along its own lineage logs nothing either
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="geomesh_p2p.node.peer.round"),
        events.capture("partition_lost") as lost,
    ):
        await loser.drv.resync("again")
    assert [r for r in caplog.records if r.name == "geomesh_p2p.node.peer.round"] == [] and lost == []


async def test_a_joining_peer_discards_nothing_and_logs_no_partition(caplog):
    swarm = Swarm()
    veteran, joiner = _peers(2, swarm)
    veteran.driver(rounds=2)
    await _run([veteran], 2)
    joiner.driver()
    with (
        caplog.at_level(logging.WARNING, logger="geomesh_p2p.node.peer.round"),
        events.capture("partition_lost") as lost,
    ):
        await joiner.drv.resync("joining")
    assert (joiner.round, joiner.digest) == (2, veteran.digest)
    assert [r for r in caplog.records if r.name == "geomesh_p2p.node.peer.round"] == [] and lost == []
