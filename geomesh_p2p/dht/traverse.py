"""Iterative multi-query Kademlia lookup that owns every task it starts.

Source: ``hivemind.dht.traverse.traverse_dht`` (hivemind 1.1.12, MIT licence, Copyright (c) 2020
Learning@home authors and collaborators): the same beam search, worker heuristics and results. What
differs (issue 14 #10, "Task was destroyed but it is pending!" 3-15 times per peer log):

* each worker's helper task that waits for the end of the search is cancelled and awaited as soon as
  the worker's own call returns (hivemind left it pending; a search that was cancelled never set its
  event, so those helpers were garbage-collected pending);
* workers still blocked waiting for another worker's result when the search ends, or when the lookup
  is cancelled, are cancelled and awaited before this function returns or re-raises (hivemind left
  them pending, or cancelled without awaiting);
* the calls still in flight when the search ends early (``await_all_tasks=False``) are handed to
  ``adopt`` (the caller owns them: a node cancels and awaits them at shutdown) instead of being left
  to run unowned; without ``adopt``, and on cancellation, they are cancelled and awaited here.

No ``found_callback`` (GeoMesh does not use it).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from typing import Awaitable, Callable, Collection, Dict, List, Optional, Set, Tuple

from hivemind.dht.routing import DHTID

from geomesh_p2p.aio import cancel_and_wait

__all__ = ["traverse_dht"]

ROOT = 0  # index of a heap's root

GetNeighbors = Callable[[DHTID, Collection[DHTID]], Awaitable[Dict[DHTID, Tuple[Tuple[DHTID, ...], bool]]]]


async def traverse_dht(
    queries: Collection[DHTID],
    initial_nodes: List[DHTID],
    beam_size: int,
    num_workers: int,
    queries_per_call: int,
    get_neighbors: GetNeighbors,
    await_all_tasks: bool = True,
    visited_nodes: Optional[Dict[DHTID, Set[DHTID]]] = None,
    adopt: Optional[Callable[[Set[asyncio.Task]], None]] = None,
) -> Tuple[Dict[DHTID, List[DHTID]], Dict[DHTID, Set[DHTID]]]:
    """Find the ``beam_size`` nearest nodes (XOR distance) to each of ``queries``, asking peers with
    ``get_neighbors(peer, queries) -> {query: (nearest node ids, should_stop)}``, ``num_workers`` calls
    at a time, up to ``queries_per_call`` queries per call (see hivemind's docstring of the same name).

    A query ends when ``should_stop`` is True for it or its beam is exhausted. ``get_neighbors`` must not
    raise (a raising call ends its worker, as in hivemind). ``visited_nodes``: per query, nodes never to
    ask nor return. ``await_all_tasks``: wait for the calls still in flight when every query has ended;
    otherwise return at once and pass those calls (a set of tasks, maybe empty: not called then) to
    ``adopt``, or cancel them when there is no ``adopt``.

    Returns ({query: up to beam_size nearest node ids, nearest first}, {query: nodes asked}). On
    return or cancellation no task started here is left pending, except those handed to ``adopt``.
    """
    if len(queries) == 0:
        return {}, dict(visited_nodes or {})

    unfinished_queries = set(queries)
    candidate_nodes: Dict[DHTID, List[Tuple[int, DHTID]]] = {}  # heap: unvisited, nearest first
    nearest_nodes: Dict[DHTID, List[Tuple[int, DHTID]]] = {}  # heap: top beam_size, farthest first
    known_nodes: Dict[DHTID, Set[DHTID]] = {}
    visited: Dict[DHTID, Set[DHTID]] = dict(visited_nodes or {})
    pending_tasks: Set[asyncio.Task] = set()  # get_neighbors calls in flight
    active_workers = Counter({q: 0 for q in queries})

    search_finished_event = asyncio.Event()
    heap_updated_event = asyncio.Event()
    heap_updated_event.set()

    for query in queries:
        distances = query.xor_distance(initial_nodes)
        candidate_nodes[query] = list(zip(distances, initial_nodes))
        nearest_nodes[query] = list(zip([-d for d in distances], initial_nodes))
        heapq.heapify(candidate_nodes[query])
        heapq.heapify(nearest_nodes[query])
        while len(nearest_nodes[query]) > beam_size:
            heapq.heappop(nearest_nodes[query])
        known_nodes[query] = set(initial_nodes)
        visited[query] = set(visited.get(query, ()))

    def upper_bound(query: DHTID):
        return -nearest_nodes[query][ROOT][0] if len(nearest_nodes[query]) >= beam_size else float("inf")

    def has_candidates(query: DHTID):
        return candidate_nodes[query] and candidate_nodes[query][ROOT][0] <= upper_bound(query)

    def heuristic_priority(heap_query: DHTID):
        # Expand the query with the fewest workers on it, then the nearest candidate.
        if has_candidates(heap_query):
            return active_workers[heap_query], candidate_nodes[heap_query][ROOT][0]
        return float("inf"), float("inf")

    def finish_search(query):
        unfinished_queries.remove(query)
        if len(unfinished_queries) == 0:
            search_finished_event.set()

    async def worker():
        while unfinished_queries:
            chosen_query: DHTID = min(unfinished_queries, key=heuristic_priority)
            if not has_candidates(chosen_query):
                if active_workers.most_common(1)[0][1] > 0:  # another worker may still add nodes
                    heap_updated_event.clear()
                    await heap_updated_event.wait()
                    continue
                for query in list(unfinished_queries):  # no hope of new nodes: every query ends now
                    finish_search(query)
                break

            chosen_distance, chosen_peer = heapq.heappop(candidate_nodes[chosen_query])
            if chosen_peer in visited[chosen_query] or chosen_distance > upper_bound(chosen_query):
                if chosen_distance > upper_bound(chosen_query) and active_workers[chosen_query] == 0:
                    finish_search(chosen_query)
                continue

            others = [q for q in unfinished_queries if q != chosen_query and chosen_peer not in visited[q]]
            queries_to_call = [chosen_query] + heapq.nsmallest(queries_per_call - 1, others,
                                                               key=chosen_peer.xor_distance)
            active_workers.update(queries_to_call)
            for q in queries_to_call:
                visited[q].add(chosen_peer)

            call = asyncio.ensure_future(get_neighbors(chosen_peer, queries_to_call))
            pending_tasks.add(call)
            finished = asyncio.ensure_future(search_finished_event.wait())
            try:
                await asyncio.wait([call, finished], return_when=asyncio.FIRST_COMPLETED)
            finally:  # the helper never outlives this wait (hivemind left it pending)
                await cancel_and_wait([finished])
            if search_finished_event.is_set():
                break  # the call stays in pending_tasks: awaited, adopted or cancelled below
            pending_tasks.discard(call)

            for query, (neighbors, should_stop) in call.result().items():
                if should_stop and query in unfinished_queries:
                    finish_search(query)
                if query not in unfinished_queries:
                    continue
                for neighbor in neighbors:
                    if neighbor not in known_nodes[query]:
                        known_nodes[query].add(neighbor)
                        distance = query.xor_distance(neighbor)
                        if distance <= upper_bound(query) or len(nearest_nodes[query]) < beam_size:
                            heapq.heappush(candidate_nodes[query], (distance, neighbor))
                            if len(nearest_nodes[query]) < beam_size:
                                heapq.heappush(nearest_nodes[query], (-distance, neighbor))
                            else:
                                heapq.heappushpop(nearest_nodes[query], (-distance, neighbor))
            active_workers.subtract(queries_to_call)
            heap_updated_event.set()

    workers = [asyncio.ensure_future(worker()) for _ in range(num_workers)]
    handed_over = False
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_COMPLETED)
        for w in done:
            w.result()  # a worker's error (a raising get_neighbors) is the lookup's
        if await_all_tasks:
            await asyncio.gather(*pending_tasks)
        elif adopt is not None:
            left = {t for t in pending_tasks if not t.done()}
            if left:
                adopt(left)
            handed_over = True
        return ({q: [peer for _, peer in heapq.nlargest(beam_size, nearest_nodes[q])] for q in queries},
                visited)
    finally:
        # Workers still blocked on another's result (or all of them, when cancelled) end here.
        await cancel_and_wait(workers)
        if not handed_over:
            await cancel_and_wait([t for t in pending_tasks if not t.done()])
