"""Issue 29 #2 (hivemind#482): a plan lives as long as its round, whatever the window.

Plans were stored for a fixed 120 s while followers accept deadlines up to 4 x window + 120 s ahead: with a
5-minute window the plan vanished from the DHT mid-round, and with it from the status page and from a
joiner's busy-donor map (and a peer reading late found no plan and published a last-resort one). Here a
plan with a 5-minute window is stored over real DHT nodes on 127.0.0.1, every node's clock (and swarm
time) is moved 200 s on, and the plan is still read by another node's PlanStore, the status page's
watcher and a syncing peer's busy-donor watch; once its round is over (+ the readers' staleness margin)
the DHT drops it. What this does not cover (the issue's process test): peers training a 5-minute window
as OS processes with a joiner arriving mid-round.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.net import swarm_time as clock
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.plan.agree import PLAN_STALE_AFTER_S, PLAN_TTL_FLOOR_S, PlanStore, plan_expiration, plan_key
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round.rules import RoundState, StateSync
from geomesh_p2p.round.rules.state_sync import SYNC_CALL_TIMEOUT_S, sync_call_timeout_s
from geomesh_p2p.status.swarm import SUMMARY_TTL_S, SwarmWatcher, summary_ttl_s
from geomesh_p2p.trust.verify_task import VerifyConfig, evidence_lifetime_s
from tests.dht_helpers import RUN, start_swarm, stop_all
from tests.plan_util import big_plan

pytestmark = pytest.mark.timeout(90)

WINDOW_S = 300.0


def _five_minute_plan(leader: str, round: int) -> RoundPlan:
    """A valid plan of 4 peers whose window is 5 minutes: training ends 301 s from now, the exchange 331 s."""
    now = clock.swarm_time()
    d = big_plan(4, run_id=RUN, round=round, leader=leader).model_dump()
    d.update(window_s=WINDOW_S, created_at=now + 1, train_deadline=now + 1 + WINDOW_S, exchange_deadline=now + 331)
    return RoundPlan.model_validate(d)


def test_a_plans_lifetime_covers_its_round_and_keeps_the_floor_for_short_ones():
    now = 1_000_000.0
    d = big_plan(2, run_id=RUN, round=1).model_dump()
    d.update(window_s=WINDOW_S, created_at=now, train_deadline=now + WINDOW_S, exchange_deadline=now + 330)
    long_plan = RoundPlan.model_validate(d)
    assert plan_expiration(long_plan, now) == now + 330 + PLAN_STALE_AFTER_S  # was now + 120: mid-round
    d.update(window_s=6.0, train_deadline=now + 6, exchange_deadline=now + 10)
    short = RoundPlan.model_validate(d)
    assert plan_expiration(short, now) == now + PLAN_TTL_FLOOR_S  # short windows: as before
    d.update(window_s=30_000.0, train_deadline=now + 30_000, exchange_deadline=now + 90_000)
    huge = RoundPlan.model_validate(d)
    assert plan_expiration(huge, now) < now + 24 * 3600  # never past what the DHT stores
    # --plan-ttl-floor-s (the process test's short floor): the floor moves, a long round's lifetime does not
    assert NodeConfig().plan_ttl_floor_s == PLAN_TTL_FLOOR_S == 120.0
    assert plan_expiration(short, now, floor_s=60.0) == now + 60.0
    assert plan_expiration(short, now, floor_s=20.0) == now + 10 + PLAN_STALE_AFTER_S  # its round's end, then
    assert plan_expiration(long_plan, now, floor_s=20.0) == now + 330 + PLAN_STALE_AFTER_S


def test_evidence_and_round_summaries_live_as_long_as_the_rounds_they_serve():
    cfg = VerifyConfig()  # participants keep a round re-checkable for recheck_rounds = 12 rounds (3 before session 16)
    assert evidence_lifetime_s(cfg, 10.0) == cfg.evidence_ttl_s == 900.0  # short rounds: as before
    assert evidence_lifetime_s(cfg, None) == 900.0
    assert evidence_lifetime_s(cfg, 330.0) == 2 * (12 + 1) * 330.0  # 5-minute rounds: 143 minutes, not 15
    rows = [SimpleNamespace(round_s=8.0), SimpleNamespace(round_s=12.0)]
    assert summary_ttl_s(rows) == SUMMARY_TTL_S == 900.0
    assert summary_ttl_s([*rows, SimpleNamespace(round_s=1200.0)]) == 3 * 1200.0  # 20-minute rounds
    assert summary_ttl_s([]) == 900.0
    # a joiner's state calls outlast a donor's busy round (its plan's exchange deadline, within the horizon)
    assert sync_call_timeout_s(6.0) == 4 * 6.0 + 120.0 and SYNC_CALL_TIMEOUT_S == 120.0
    assert sync_call_timeout_s(WINDOW_S) == 4 * WINDOW_S + 120.0  # 22 minutes, not 2


async def test_a_5_minute_plan_is_still_read_200_s_into_its_round_by_the_dht_status_page_and_a_joiner():
    shift = [0.0]  # every node's wall clock, and this process's swarm time, moved on by this many seconds
    nodes = await start_swarm(3, clock=lambda: time.time() + shift[0])
    try:
        leader = nodes[0].transport.identity
        lid = str(leader.peer_id)
        plan = _five_minute_plan(lid, round=4)
        assert await PlanStore(nodes[0], leader, RUN).publish(plan)

        shift[0] = 200.0  # mid-round: training ends at +301 s
        clock.set_offset(200.0)
        assert nodes[1].now() - time.time() == pytest.approx(200.0, abs=1.0)
        held = await nodes[2].get(plan_key(RUN, 4))
        assert set(held) == {lid} and held[lid].expiration_time == pytest.approx(plan.exchange_deadline + 30.0)
        # a follower reading late finds the plan (and publishes no last-resort plan of its own)
        assert await PlanStore(nodes[1], Identity.generate(), RUN).read(4) == [plan]
        # the status page shows it
        assert await SwarmWatcher(nodes[2], RUN)._plan(4, {lid}) == plan

        # a joiner syncing to round 4 sees the plan's participants as busy donors until its exchange deadline
        stop = asyncio.Event()
        store = PlanStore(nodes[1], Identity.generate(), RUN)
        reads: list[int] = []
        real_read = store.read

        async def read(rnd, accept=None, seen=None, leaders=None):
            reads.append(rnd)
            if len(reads) == 2:  # rounds 4 and 5 read once: the watch ends after this pass
                stop.set()
            return await real_read(rnd, accept, seen, leaders)

        store.read = read  # type: ignore[method-assign]

        async def peers(include_leaving=False):
            return [SimpleNamespace(peer_id=lid, address="127.0.0.1:7001")]

        sync = StateSync(
            SimpleNamespace(run_id=RUN, window_s=WINDOW_S),  # type: ignore[arg-type]
            RoundState(round=4),
            stop,
            peers=peers,  # type: ignore[arg-type]
            plans=lambda: store,
        )
        busy: dict[str, float] = {}
        await asyncio.wait_for(sync._watch_busy_donors(busy), 30)
        assert reads == [4, 5]
        owners = [a.address for a in plan.assignments if a.address]
        assert len(owners) == 4 and busy == {a: plan.exchange_deadline for a in owners}

        # once its round is over (exchange deadline + the readers' 30 s), the plan is gone from the DHT
        shift[0] = plan.exchange_deadline + PLAN_STALE_AFTER_S + 5.0 - time.time()
        clock.set_offset(shift[0])
        assert await nodes[2].get(plan_key(RUN, 4)) == {}
        assert await PlanStore(nodes[1], Identity.generate(), RUN).read(4) == []
    finally:
        clock.set_offset(0.0)
        await stop_all(nodes)
