"""StateSync._watch_busy_donors (docs/round.md, "Donors busy with their own round"): the donors'
busy windows read from the plans while a sync runs. Review: the horizon cap was re-read from "now" every
refresh, so a rogue plan with a far exchange deadline (which every follower refuses) kept its participants
"busy" for as long as it stayed in the DHT, and, ranked first, hid the round's real plan."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.round.rules import RoundState, StateSync
from geomesh_p2p.plan.agree import leader_rank
from geomesh_p2p.round.rules import plan_horizon_s

pytestmark = pytest.mark.timeout(20)
RUN = "busy-test"


def _plan(leader: str, round: int, train: float, exchange: float, donors: list[str]):
    return SimpleNamespace(
        run_id=RUN,
        round=round,
        leader=leader,
        train_deadline=train,
        exchange_deadline=exchange,
        assignments=[SimpleNamespace(peer_id=d, address=f"127.0.0.1:{7000 + k}") for k, d in enumerate(donors)],
    )


async def test_a_plan_with_deadlines_followers_refuse_marks_no_donor_busy_nor_hides_the_real_one():
    rogue, honest = sorted(["leader-a", "leader-b"], key=lambda p: leader_rank(RUN, 4, p))  # rogue ranks first
    now = swarm_time()
    window = 10.0
    plans = {
        4: [
            _plan(rogue, 4, now + 1.0, now + 10**6, ["d1", "d2"]),  # exchange a million seconds out
            _plan(honest, 4, now + 2.0, now + 6.0, ["d2"]),
        ]
    }
    stop = asyncio.Event()
    reads = []

    async def read(rnd, accept=None, seen=None, leaders=None):
        reads.append(rnd)
        if len(reads) == 2:  # both rounds read once: the watcher ends after this pass
            stop.set()
        return plans.get(rnd, [])

    async def peers(include_leaving=False):
        return []

    node = StateSync(
        SimpleNamespace(run_id=RUN, window_s=window),
        RoundState(round=4),
        stop,
        peers=peers,
        plans=lambda: SimpleNamespace(read=read),  # type: ignore[arg-type,return-value]
    )
    busy: dict[str, float] = {}
    await asyncio.wait_for(node._watch_busy_donors(busy), 10)
    assert reads == [4, 5]
    # the honest plan's donor is busy until its exchange deadline; the rogue's other donor is not busy at all
    assert busy == {"127.0.0.1:7000": now + 6.0}
    assert now + 6.0 < now + plan_horizon_s(window)
