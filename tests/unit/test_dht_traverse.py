"""hivemind's ``traverse_dht`` run in a geomesh_p2p.util.aio.TaskScope, as the DHT node runs it (issue 14 #10,
"Task was destroyed but it is pending!"): same results as unscoped, a cancelled or early-ended lookup
leaves no task pending (hivemind alone does: checked), the calls still in flight are handed over."""

from __future__ import annotations

import asyncio
import random

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.traverse import traverse_dht

from geomesh_p2p.util.aio import TaskScope, cancel_and_wait, runs
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


async def scoped_traverse(*args, adopt=None, **kwargs):
    """hivemind's traverse_dht as geomesh_p2p.dht.node runs it: its find calls (``get_neighbors``)
    still in flight after an early end are handed to ``adopt``; every other task ends with the scope."""
    async with TaskScope(adopt=adopt, keep=runs(kwargs["get_neighbors"])):
        return await traverse_dht(*args, **kwargs)


@pytest.mark.parametrize("workers", [1, 3])
async def test_same_nearest_nodes_as_unscoped_hivemind(workers):
    ids, edges = _graph(200, 8, seed=1)
    queries = [DHTID.generate(source=f"q{k}".encode()) for k in range(5)]
    kw = dict(queries=queries, initial_nodes=ids[:3], beam_size=8, num_workers=workers, queries_per_call=2)
    before = asyncio.all_tasks()
    ours, visited = await scoped_traverse(get_neighbors=_neighbors(edges), **kw)
    assert asyncio.all_tasks() - before == set()
    theirs, visited_h = await traverse_dht(get_neighbors=_neighbors(edges), **kw)
    await cancel_and_wait(asyncio.all_tasks() - before)  # what hivemind left behind (workers > 1)
    assert ours == theirs and visited == visited_h
    assert all(len(v) == 8 for v in ours.values())


async def _cancel_mid_flight(lookup_fn) -> set:
    """Start a lookup whose three find calls hang, cancel it, and return the tasks it left."""
    ids, edges = _graph(50, 6, seed=2)
    gate = asyncio.Event()
    calls: list = []
    before = asyncio.all_tasks()
    lookup = asyncio.ensure_future(
        lookup_fn(
            [ids[0]],
            ids[1:4],
            beam_size=4,
            num_workers=3,
            queries_per_call=1,
            get_neighbors=_neighbors(edges, gate, calls),
        )
    )
    await until(lambda: len(calls) == 3, 5.0, "three find calls in flight")
    lookup.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lookup
    return asyncio.all_tasks() - before


async def test_a_cancelled_lookup_leaves_no_task_pending():
    assert await _cancel_mid_flight(scoped_traverse) == set()


async def test_unscoped_hivemind_leaves_tasks_pending_when_cancelled():
    # Why the scope: hivemind cancels its workers without awaiting them and never cancels its find
    # calls, nor the helpers waiting for the search's end.
    left = await _cancel_mid_flight(traverse_dht)
    try:
        assert left and not all(t.done() for t in left)
    finally:
        await cancel_and_wait(left)


def _stopped_early(ids, get_neighbors, **kw):
    """A lookup of ``ids[0]`` from ``ids[1:4]`` that does not wait for its calls in flight when it ends
    (``await_all_tasks=False``): 3 workers, one query a call."""
    return scoped_traverse(
        [ids[0]],
        ids[1:4],
        beam_size=4,
        num_workers=3,
        queries_per_call=1,
        get_neighbors=get_neighbors,
        await_all_tasks=False,
        **kw,
    )


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
    nearest, _ = await _stopped_early(ids, get_neighbors, adopt=adopted.append)
    assert set(nearest[ids[0]]) == set(ids[1:4])
    assert len(adopted) == 1 and len(adopted[0]) == 2 and not any(t.done() for t in adopted[0])
    assert all(runs(get_neighbors)(t) for t in adopted[0])
    assert asyncio.all_tasks() - before == adopted[0]  # the workers and their waiters are gone
    slow.set()
    replies = await asyncio.gather(*adopted[0])
    assert all(set(r) == {ids[0]} for r in replies)


async def test_without_adopt_the_calls_in_flight_are_cancelled():
    ids, edges = _graph(50, 6, seed=3)
    stop_at = ids[1]

    async def get_neighbors(peer, queries):
        if peer != stop_at:
            await asyncio.Event().wait()
        return {q: (tuple(edges[peer]), peer == stop_at) for q in queries}

    before = asyncio.all_tasks()
    await _stopped_early(ids, get_neighbors)
    assert asyncio.all_tasks() - before == set()
