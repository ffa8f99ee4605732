"""Iterative Kademlia lookups (hivemind's ``traverse_dht`` with alpha workers, run in a
:class:`~geomesh_p2p.util.aio.TaskScope` that owns its tasks): the nearest live nodes to a set of ids,
and every verified record they return on the way.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

from hivemind.dht.routing import DHTID
from hivemind.dht.traverse import traverse_dht

from geomesh_p2p.util.aio import TaskScope, finish_or_cancel, runs
from geomesh_p2p.dht.records import VerifiedRecord
from geomesh_p2p.dht.state import Contact, LookupStats
from geomesh_p2p.dht.protocol import DHTProtocol

# The node was one module: its parts log under that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")


class DHTLookup(DHTProtocol):
    """Iterative lookups of a DHT node (see the module doc)."""

    def _initial(self, key_ids: Iterable[DHTID], beam: int) -> Dict[DHTID, Contact]:
        """Per key, the ``beam`` nearest known nodes that are not blacklisted (looking further out
        when the nearest are); the blacklisted ones only when no other node is known."""
        nodes: Dict[DHTID, Contact] = {}
        fallback: Dict[DHTID, Contact] = {}
        for key_id in key_ids:
            want = beam
            while True:
                got = self.routing_table.get_nearest_neighbors(key_id, want, exclude=self.node_id)
                usable = [(nid, c) for nid, c in got if c.peer_id not in self.blacklist]
                if len(usable) >= beam or len(got) < want:
                    break
                want *= 2
            nodes.update(usable[:beam])
            fallback.update(got[:beam])
        return nodes or fallback

    async def _traverse(
        self,
        key_ids: Sequence[DHTID],
        *,
        beam: int,
        on_records: Optional[Callable[[DHTID, List[VerifiedRecord], int], bool]] = None,
        stats: Optional[LookupStats] = None,
        await_all: bool = True,
        subkeys: Optional[Collection[str]] = None,
        holders: Optional[Dict[DHTID, List[DHTID]]] = None,
    ) -> Tuple[Dict[DHTID, List[DHTID]], Dict[DHTID, Contact]]:
        """Iterative Kademlia lookup of ``key_ids`` with hivemind's traverse_dht (alpha workers), in a
        TaskScope: no task of it is left pending when it returns or is cancelled.

        ``on_records(key_id, records, hop) -> stop`` sees every verified record returned; without it the
        lookup asks for nodes only (FindRequest.nodes_only: a store's lookup carries no records); ``subkeys``:
        the finds ask only for the records under these subkeys (FindRequest.subkeys); ``holders``: filled with the
        nodes that answered with records, per key, in the order they answered (a read's cached holders).
        Returns (nearest node ids per key, nearest-first, never self; contact of every node seen).
        """
        stats = stats if stats is not None else LookupStats()
        self.stats.lookups += 1
        t0 = time.perf_counter()
        failures = stats.failures
        stopped: set = set()
        answered: set = set()  # (key, node) pairs whose records were seen: a node answers once per key, both passes
        nearest, contacts = await self._traverse_once(
            key_ids, beam, on_records, stats, await_all, stopped, subkeys, holders, answered
        )
        if stats.failures > failures and len(stopped) < len(key_ids):
            # hivemind's traverse_dht keeps a silent node in the beam, so nodes behind it may have been
            # skipped; silent nodes are now out of the routing table and blacklisted: look again.
            again = [q for q in key_ids if q not in stopped]
            nearest2, contacts2 = await self._traverse_once(
                again, beam, on_records, stats, await_all, stopped, subkeys, holders, answered
            )
            nearest.update(nearest2)
            contacts.update(contacts2)
        stats.seconds += time.perf_counter() - t0
        return nearest, contacts

    async def _traverse_once(
        self, key_ids, beam, on_records, stats, await_all, stopped: set, subkeys=None, holders=None, answered=None
    ):
        answered = answered if answered is not None else set()
        contacts = self._initial(key_ids, beam)
        depth: Dict[DHTID, int] = {nid: 1 for nid in contacts}
        failed: set = set()

        async def get_neighbors(peer: DHTID, queries: Collection[DHTID]) -> Dict[DHTID, Tuple[Tuple[DHTID, ...], bool]]:
            queries = list(queries)
            hop = depth.get(peer, 1)
            stats.rpcs += 1
            stats.hops = max(stats.hops, hop)
            try:
                response = await self._find(contacts[peer], queries, nodes_only=on_records is None, subkeys=subkeys)
            except Exception as e:  # never let a worker die: it would end the whole lookup (an assert)
                log.exception("find failed unexpectedly: %r", e)
                response = None
            if response is None:
                stats.failures += 1
                failed.add(peer)
                return {q: ((), False) for q in queries}
            output = {}
            for q, (records, nearest) in response.items():
                for nid, c in nearest.items():
                    contacts.setdefault(nid, c)
                    depth.setdefault(nid, hop + 1)
                if records and (q, peer) in answered:
                    # the second pass asks again a node that answered the first: one holder is not two (it counted
                    # twice towards a read's quorum and was cached twice as a read's holder; red team, session 22)
                    records = []
                elif records:
                    answered.add((q, peer))
                if holders is not None and records:
                    holders.setdefault(q, []).append(peer)
                stop = on_records(q, records, hop) if (on_records is not None and records) else False
                if stop:
                    stopped.add(q)
                output[q] = tuple(nearest.keys()), stop
            return output

        # hivemind's traverse_dht leaves its workers and their waiters pending when it returns or is
        # cancelled ("Task was destroyed but it is pending!"): the scope cancels and awaits them, and hands
        # the find calls still in flight after an early end (await_all=False) to this node.
        async with TaskScope(adopt=self._adopt_calls, keep=runs(get_neighbors)):
            nearest, _visited = await traverse_dht(
                queries=list(key_ids),
                initial_nodes=list(contacts),
                beam_size=beam,
                num_workers=self.alpha,
                queries_per_call=max(1, min(int(len(key_ids) ** 0.5), 16)),
                get_neighbors=get_neighbors,
                visited_nodes={q: {self.node_id} for q in key_ids},
                await_all_tasks=await_all,
            )
        return {q: [n for n in ids if n not in failed] for q, ids in nearest.items()}, contacts

    def _adopt_calls(self, calls: set) -> None:
        """Own the find calls a lookup left in flight when it ended early (``get`` returns at the first
        record): they finish in the background (bounded by their RPC deadline) and are cancelled and
        awaited at :meth:`shutdown`, never left pending ("Task was destroyed but it is pending!")."""
        self.tasks.spawn(finish_or_cancel(calls), name="dht-lookup-tail")

    async def find_nearest_nodes(
        self, key_ids: Sequence[DHTID], k: Optional[int] = None, stats: Optional[LookupStats] = None
    ) -> Dict[DHTID, List[Tuple[DHTID, Contact]]]:
        """The ``k`` (default self.k) nearest live nodes to each id, nearest first, never this node."""
        k = k or self.k
        nearest, contacts = await self._traverse(list(key_ids), beam=max(k, self.k), stats=stats)
        return {q: [(nid, contacts[nid]) for nid in ids[:k]] for q, ids in nearest.items()}
