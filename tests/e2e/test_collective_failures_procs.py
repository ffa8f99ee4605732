"""The process-level tests of ``tests/integration/test_collective_failures.py`` (they start OS processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import numpy as np
import pytest
import torch
from geomesh_p2p.exchange import CollectiveSpec, PartOwner
from tests.collective_util import RUN, reference
from tests.integration.test_collective_failures import SLACK_S, swarm, timed, workers  # noqa: F401


@pytest.mark.timeout(150)  # cold Python+torch starts on a busy 2-core machine
async def test_processes_one_sigkilled_mid_round(workers, swarm, tmp_path):  # noqa: F811 (fixtures)
    """Three peers: this test process (owner of part 0) and two worker processes (owners of parts 1
    and 2). Worker 2 delivers part 0, then is SIGKILLed mid-round."""
    procs = await workers(2)
    sw = await swarm(1, 0)
    ready = [await p.read() for p in procs]
    pids = [sw.pids[0]] + [r["peer_id"] for r in ready]
    addresses = [sw.addresses[0]] + [r["address"] for r in ready]
    numel, B = 24_576, 1024
    owners = [PartOwner(pids[k], addresses[k], k * numel // 3, (k + 1) * numel // 3) for k in range(3)]
    now = time.time()
    spec = CollectiveSpec(
        RUN, 5, {p: 1000 for p in pids}, owners, numel, now + 3.0, now + 4.0, mode="relay", block_size=B
    )
    seeds, tokens = [101, 102, 103], [30, 20, 10]
    deltas = {p: torch.randn(numel, generator=torch.Generator().manual_seed(s)) for p, s in zip(pids, seeds)}
    for k, p in enumerate(procs, start=1):
        p.send(
            {
                "spec": spec.to_dict(),
                "seed": seeds[k],
                "tokens": tokens[k],
                "out": str(tmp_path / f"agg{k}.f32"),
                "stall_after_part": 0 if k == 2 else None,
            }
        )
    mine = asyncio.ensure_future(timed(sw.services[0].all_reduce(spec, deltas[pids[0]], tokens[0])))
    ev = await procs[1].read()
    assert ev == {"event": "delivered", "part": 0, "accepted": True}
    os.kill(procs[1].proc.pid, signal.SIGKILL)
    await procs[1].proc.wait()
    res, finished = await mine
    done = await procs[0].read()
    assert done["event"] == "done" and done["missing"] == [2] and res.missing_parts == [2]
    for t in (finished, done["finished_at"]):
        assert t <= spec.deadline + SLACK_S
    assert {str(j): [list(x) for x in c] for j, c in res.contributors.items()} == done["contributors"]
    contributors = {j: [p for p, _ in c] for j, c in res.contributors.items()}
    assert set(contributors[0]) == set(pids) and set(contributors[1]) == set(pids[:2])
    other = np.fromfile(tmp_path / "agg1.f32", dtype="<f4")
    assert res.aggregate.numpy().astype("<f4").tobytes() == other.tobytes()
    assert torch.equal(res.aggregate, reference(spec, deltas, dict(zip(pids, tokens)), contributors))
    procs[0].send("exit")
    await procs[0].proc.stdin.drain()
    assert await asyncio.wait_for(procs[0].proc.wait(), 20) == 0
