"""geomesh_p2p.dht.traverse: hivemind's lookup, owning its tasks (issue 14 #10, "Task was destroyed but
it is pending!"): a cancelled or early-ended lookup leaves no task pending; results as hivemind's."""

from __future__ import annotations

import asyncio
import random

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.traverse import traverse_dht as hivemind_traverse

from geomesh_p2p.dht.traverse import traverse_dht
from tests.wait_util import until

pytestmark = pytest.mark.timeout(30)


def _graph(n: int, degree: int, seed: int) -> tuple[list[DHTID], dict]:
    rng = random.Random(seed)
    ids = [DHTID.generate(source=f"n{k}".encode()) for k in range(n)]
    edges = {i: rng.sample(ids, degree) for i in ids}
    return ids, edges


def _neighbors(edges, gate=None, calls=None):
    async def get_neighbors(peer, queries):
        if calls is not None:
            calls.append(peer)
        if gate is not None:
            await gate.wait()
        else:
            await asyncio.sleep(0)
        return {q: (tuple(edges[peer]), False) for q in queries}
    return get_neighbors


async def test_same_nearest_nodes_as_hivemind():
    ids, edges = _graph(200, 8, seed=1)
    queries = [DHTID.generate(source=f"q{k}".encode()) for k in range(5)]
    kw = dict(queries=queries, initial_nodes=ids[:3], beam_size=8, num_workers=1, queries_per_call=2)
    ours, visited = await traverse_dht(get_neighbors=_neighbors(edges), **kw)
    theirs, visited_h = await hivemind_traverse(get_neighbors=_neighbors(edges), **kw)
    assert ours == theirs and visited == visited_h
    assert all(len(v) == 8 for v in ours.values())


async def test_a_cancelled_lookup_leaves_no_task_pending():
    ids, edges = _graph(50, 6, seed=2)
    gate = asyncio.Event()  # every find call hangs: the lookup is cancelled mid-flight
    calls: list = []
    before = asyncio.all_tasks()
    lookup = asyncio.ensure_future(traverse_dht(
        [ids[0]], ids[1:4], beam_size=4, num_workers=3, queries_per_call=1,
        get_neighbors=_neighbors(edges, gate, calls)))
    await until(lambda: len(calls) == 3, 5.0, "three find calls in flight")
    lookup.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lookup
    assert asyncio.all_tasks() - before == set()  # hivemind's left workers and waiters pending


async def test_calls_in_flight_when_a_lookup_ends_early_are_handed_over():
    ids, edges = _graph(50, 6, seed=3)
    slow = asyncio.Event()
    stop_at = ids[1]

    async def get_neighbors(peer, queries):
        if peer != stop_at:
            await slow.wait()  # still in flight when the lookup ends
        return {q: (tuple(edges[peer]), peer == stop_at) for q in queries}

    adopted: list = []
    before = asyncio.all_tasks()
    await traverse_dht([ids[0]], ids[1:4], beam_size=4, num_workers=3, queries_per_call=1,
                       get_neighbors=get_neighbors, await_all_tasks=False, adopt=adopted.append)
    assert len(adopted) == 1 and len(adopted[0]) == 2 and not any(t.done() for t in adopted[0])
    assert asyncio.all_tasks() - before == adopted[0]  # the workers and their waiters are gone
    slow.set()
    await asyncio.gather(*adopted[0])
