"""Red team (session 22) of the cached read holders (``DHTNode._read_targets``, ``_read_cached``).

A sampled read (``get(..., quorum=Q)``) of a peer-records key remembers the holders that answered its lookup with
records and asks the first Q of them alone for the next ``READ_TARGET_REUSE - 1`` reads. These tests put a node that
misbehaves on purpose into that cache (it is the node nearest the key: the lookup asks it first and it answers
first) and check what a light follower's read then costs and returns.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, List, Optional

import pytest

from geomesh_p2p.dht import DHTNode, PeerAnnouncer, live_peers, peers_key
from geomesh_p2p.dht.records import key_id_of, node_id_of
from geomesh_p2p.dht.state import Contact
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.dht.protocol import dht_pb2
from tests.dht_helpers import RUN, start_node, stop_all, stop_node
from tests.integration.test_dht_announce import node_record
from tests.integration.test_dht_read_targets import _holds

pytestmark = pytest.mark.timeout(120)

Hook = Callable[["HookedNode", object, object], Awaitable[Optional[bytes]]]


class HookedNode(DHTNode):
    """A DHT node whose Find handler a test can wrap: ``find_hook(node, verified, context)`` returns the reply's
    bytes (or None: the honest reply); ``find_delay_s`` delays every honest reply."""

    find_hook: Optional[Hook] = None
    find_delay_s: float = 0.0

    async def _rpc_find(self, verified, context) -> bytes:
        if self.find_hook is not None:
            out = await self.find_hook(self, verified, context)
            if out is not None:
                return out
        if self.find_delay_s:
            await asyncio.sleep(self.find_delay_s)
        return await super()._rpc_find(verified, context)


async def start_hooked(bootstrap=(), **kw) -> HookedNode:
    node = await start_node(list(bootstrap), node_cls=HookedNode, **kw)
    assert isinstance(node, HookedNode)
    return node


def nearest_identity(key: str, tries: int = 256) -> Identity:
    """Of ``tries`` fresh identities, the one whose node id is nearest ``key``'s (a Sybil grinds its place)."""
    kid = int(key_id_of(key))
    return min((Identity.generate() for _ in range(tries)), key=lambda i: int(node_id_of(bytes(i.peer_id))) ^ kid)


async def evil_swarm(n_honest: int, writers: int, honest_delay_s: float = 0.05):
    """``n_honest`` honest nodes (each Find answered after ``honest_delay_s``: a real network's latency), one evil
    node nearest ``<run>/peers`` (it holds every record stored there and answers at once), ``writers`` honest nodes
    that announced, and a client-only reader (never a holder: no local record counts towards its quorum)."""
    key = peers_key(RUN)
    nodes: List[HookedNode] = [await start_hooked()]
    for i in range(n_honest - 1):
        nodes.append(await start_hooked([nodes[i // 2].address]))
    evil = await start_hooked([nodes[0].address], identity=nearest_identity(key))
    for n in nodes:
        n.find_delay_s = honest_delay_s
    for w in nodes[:writers]:
        assert await PeerAnnouncer(w, node_record(w), period_s=30, ttl_s=60.0).announce_once()
    reader = await start_hooked([nodes[0].address], client_only=True)
    await reader.ping(evil.address)
    return nodes, evil, reader


def log_finds(node: DHTNode, order: list, read: list) -> None:
    """Append ``("ask", who, read, node asked)`` to ``order`` as ``node`` starts each Find call, and ``("answer",
    ...)`` alike as the call ends; ``who`` is ``node``'s id, ``read`` the value of ``read[0]`` when the call started
    (the read it belongs to: a call left to finish in the background keeps its read's number)."""
    real = node._find

    def find(contact, *a, **kw):
        tag = (node.node_id, read[0], contact.node_id)
        order.append(("ask", *tag))

        async def call():
            try:
                return await real(contact, *a, **kw)
            finally:
                order.append(("answer", *tag))

        return call()

    node._find = find  # type: ignore[method-assign]


def _short(order: list, evil: DHTNode) -> list:
    """``order`` of log_finds for an assertion message: (kind, read, whether the slow holder was asked)."""
    return [(e[0], e[2], e[-1] == evil.node_id) for e in order]


async def test_a_slow_cached_holder_makes_every_reused_read_wait_for_it():
    """A holder that answered the lookup first is cached; from then on it answers each Find with the records asked,
    but just before the RPC deadline. The reused reads ask it (and one other cached holder) alone and wait for both:
    each takes ~``rpc_timeout_s`` for 7 reads, where a lookup read (the rule before, ``read_target_reuse=1``) is
    answered by the other holders first and never waits for it. A light follower's plan check and digest polls
    then each wait ~the RPC deadline (found before the fix: 1.6 s per read against ~0.1 s). Checked by order, not
    by time: every read returns before the slow holder's answer to it."""
    nodes, evil, reader = await evil_swarm(8, 4)
    before = await start_hooked([nodes[0].address], client_only=True, read_target_reuse=1)
    await before.ping(evil.address)
    try:
        seen: dict = {}

        async def slow_after_first(node, verified, context):  # a node's first Find is answered at once
            n = seen[verified.sender] = seen.get(verified.sender, 0) + 1
            if n > 1:
                await asyncio.sleep(0.8 * reader.rpc_timeout_s)  # answers, with every record, before the deadline
            return None

        evil.find_hook = slow_after_first
        key = peers_key(RUN)
        wanted = [w.peer_id.to_string() for w in nodes[:3]]
        order: list = []  # the Finds' "ask" and "answer" (log_finds), and ("read", who, read) as each read returns
        read = [0]
        for who in (reader, before):
            log_finds(who, order, read)

        async def one_read(who) -> None:
            read[0] += 1
            got = [r.peer_id for r in await live_peers(who, RUN, only=wanted, quorum=2)]
            assert sorted(got) == sorted(wanted)
            order.append(("read", who.node_id, read[0]))

        await one_read(reader)
        assert evil.node_id in reader._read_targets[key_id_of(key)].ids[:2], "the evil node was not cached"
        for _ in range(3):
            await one_read(reader)  # reads 2-4: the cache's
        for _ in range(4):
            await one_read(before)  # reads 5-8: lookup reads (the rule before)
        # the first reused read asked the slow holder (it was cached) ...
        assert ("ask", reader.node_id, 2, evil.node_id) in order, _short(order, evil)
        # ... and no read but each node's first (answered at once: the reader's caches it), reused or lookup, waited
        # for its answer: each returned first (fixed: the first reused read waits ~2 x the lookup for it, drops it
        # and looks up; the next two are one honest round trip each; before the fix each reused read waited ~0.8 x
        # rpc_timeout_s for it)
        firsts = (1, 5)  # the reader's first read, before's first
        waited = [
            n
            for k, (kind, who, n, *_) in enumerate(order)
            if kind == "read" and n not in firsts and ("answer", who, n, evil.node_id) in order[:k]
        ]
        assert waited == [], f"reads that waited for the slow holder: {waited} (order: {_short(order, evil)})"
    finally:
        await stop_all(nodes + [evil, reader, before])


async def _strip_records(node, verified, context) -> bytes:
    """The honest reply without its records (a holder that lags, or withholds)."""
    resp = dht_pb2.FindResponse.FromString(await DHTNode._rpc_find(node, verified, context))
    for result in resp.results:
        del result.records[:]
    return resp.SerializeToString()


async def test_one_holder_answering_both_passes_of_a_lookup_is_not_two_holders():
    """A lookup that saw a failure and ended without its quorum looks the key up again (``_traverse``'s second pass);
    a holder that answered the first pass answers the second too. It was counted twice towards the read's quorum
    (``on_records``) and cached twice (``holders``), so every reused read asked that one node twice and took it for a
    quorum of 2: one holder (which may serve a stale record) decided 7 more sampled reads alone, and no read looked
    for other holders again (found before the fix: cached ids ``[H, H]``, 2 Find calls to H per reused read)."""
    nodes = [await start_hooked()]
    for _ in range(3):
        nodes.append(await start_hooked([nodes[0].address]))
    holder, dead = nodes[0], nodes[3]
    reader = await start_hooked([nodes[0].address], client_only=True)
    try:
        assert await PeerAnnouncer(nodes[1], node_record(nodes[1]), period_s=30, ttl_s=60.0).announce_once()
        for n in nodes[1:3]:
            n.find_hook = _strip_records  # only ``holder`` answers with the record
        assert dead.node_id in {nid for nid, _ in reader.routing_table.get_nearest_neighbors(holder.node_id, 20)}
        await stop_node(dead)
        key, wanted = peers_key(RUN), [nodes[1].peer_id.to_string()]
        got = await live_peers(reader, RUN, only=wanted, quorum=2)
        assert [r.peer_id for r in got] == wanted
        cached = reader._read_targets.get(key_id_of(key))
        ids = list(cached.ids) if cached is not None else []
        assert len(ids) == len(set(ids)), f"one holder cached {ids.count(holder.node_id)} times: {ids}"
    finally:
        await stop_all([n for n in nodes if n._alive] + [reader])


async def _garbage(node, verified, context) -> bytes:
    return b"\xff\x00not a FindResponse\x07"


async def _no_results(node, verified, context) -> bytes:
    return dht_pb2.FindResponse().SerializeToString()


async def _forged(node, verified, context) -> bytes:
    resp = dht_pb2.FindResponse.FromString(await DHTNode._rpc_find(node, verified, context))
    for result in resp.results:
        for rec in result.records:
            rec.value = rec.value + b" "  # the signature no longer covers it
    return resp.SerializeToString()


async def _raises(node, verified, context) -> bytes:
    raise RuntimeError("evil handler blew up")


@pytest.mark.parametrize("hook", [_garbage, _no_results, _forged, _raises], ids=lambda h: h.__name__)
async def test_a_cached_holder_with_malformed_or_forged_replies_costs_a_lookup_never_a_record(hook):
    """The node cached first turns hostile: garbage bytes, a reply without the keys asked, forged records only, an
    error. The reused read refuses the reply (a reason counted or logged), drops the cache, looks the key up and
    finds every record asked from the honest holders; the reader keeps reading afterwards."""
    nodes, evil, reader = await evil_swarm(8, 4)
    try:
        kid = key_id_of(peers_key(RUN))
        wanted = sorted(w.peer_id.to_string() for w in nodes[:3])

        async def read() -> list:
            return sorted(r.peer_id for r in await live_peers(reader, RUN, only=wanted, quorum=2))

        assert await read() == wanted
        assert evil.node_id in reader._read_targets[kid].ids[:2], "the evil node was not cached"
        evil.find_hook = hook
        dropped0 = reader.stats.records_dropped_on_find
        assert await read() == wanted
        assert kid not in reader._read_targets or evil.node_id not in reader._read_targets[kid].ids
        if hook is _forged:
            assert reader.stats.records_dropped_on_find > dropped0
        for _ in range(3):
            assert await read() == wanted
        assert all(n._alive for n in nodes + [evil, reader])
    finally:
        await stop_all(nodes + [evil, reader])


async def test_an_unexpected_error_of_a_cached_find_is_a_failed_holder_not_a_failed_read(monkeypatch):
    """A lookup's worker takes any exception of ``_find`` for a failed call ("never let a worker die"); the reused
    read awaited its finds with a bare ``gather``, so the same exception failed the whole ``get`` and a light
    follower's plan check left the light path (found before the fix: RuntimeError out of ``live_peers``). Hardening:
    no reply is known to raise out of ``_find`` today."""
    nodes, evil, reader = await evil_swarm(8, 4)
    try:
        kid = key_id_of(peers_key(RUN))
        wanted = sorted(w.peer_id.to_string() for w in nodes[:3])
        assert sorted(r.peer_id for r in await live_peers(reader, RUN, only=wanted, quorum=2)) == wanted
        assert evil.node_id in reader._read_targets[kid].ids[:2], "the evil node was not cached"
        real_find = reader._find

        async def find(contact, key_ids, **kw):
            if contact.peer_id == evil.peer_id:
                raise RuntimeError("unexpected")
            return await real_find(contact, key_ids, **kw)

        monkeypatch.setattr(reader, "_find", find)
        assert sorted(r.peer_id for r in await live_peers(reader, RUN, only=wanted, quorum=2)) == wanted
    finally:
        await stop_all(nodes + [evil, reader])


async def test_a_reader_holding_one_record_asked_is_not_a_holder_of_the_others():
    """A sampled read counted the reader's own store as one of its quorum's holders once it held *any* record asked
    (one of ``light_sample`` peers' records, or a stale one any node may store on it), so a quorum-2 read asked one
    remote holder: the first to answer, or the first cached. One fast node near the key then decided every other
    record of the sample alone: here it serves a participant's older, still valid record (its old address), and
    the light follower reads that address where every full read and every honest holder has the new one (a plan
    naming the old address passes its check). Pre-existing (the lookup stopped at the same first answer), and the
    cache keeps that one holder for 7 more reads. Fixed: a sampled read's quorum counts remote holders only (the
    local records still merge)."""
    key = peers_key(RUN)
    nodes: List[HookedNode] = [await start_hooked()]
    for i in range(15):
        nodes.append(await start_hooked([nodes[i // 2].address]))
    evil = await start_hooked([nodes[0].address], identity=nearest_identity(key))
    try:
        for n in nodes:
            n.find_hook = None
            n.find_delay_s = 0.05
        writers = nodes[:4]
        for w in writers:
            assert await PeerAnnouncer(w, node_record(w), period_s=30, ttl_s=60.0).announce_once()
        reader = next(n for n in nodes[4:] if not _holds(n, key, writers[0].peer_id.to_string()))
        p, q = writers[0], writers[1]
        # the attacker stores p's current record (valid: any node may store it) on the reader, which held none
        p_rec = next(r for r in evil._local_records(key_id_of(key)) if r.subkey == p.peer_id.to_string())
        assert await evil._send_records(Contact(reader.peer_id, reader.address), [p_rec])
        assert _holds(reader, key, p.peer_id.to_string())
        qs = q.peer_id.to_string()
        old = next(r for r in evil._local_records(key_id_of(key)) if r.HasField("subkey") and r.subkey == qs)
        moved = "127.0.0.1:9"
        assert await PeerAnnouncer(q, node_record(q, address=moved), period_s=30, ttl_s=90.0).announce_once()

        async def stale_q(node, verified, context) -> bytes:
            resp = dht_pb2.FindResponse.FromString(await DHTNode._rpc_find(node, verified, context))
            for result in resp.results:
                for rec in result.records:
                    if rec.HasField("subkey") and rec.subkey == qs:
                        rec.CopyFrom(old)  # q's older record: validly signed, unexpired, the old address
            return resp.SerializeToString()

        evil.find_hook = stale_q
        await reader.ping(evil.address)
        wanted = [p.peer_id.to_string(), qs]
        full = {r.peer_id: r.address for r in await live_peers(reader, RUN, only=wanted)}
        assert full[qs] == moved
        for _ in range(3):
            sampled = {r.peer_id: r.address for r in await live_peers(reader, RUN, only=wanted, quorum=2)}
            assert sampled[qs] == moved, f"sampled read returned q's old address {sampled[qs]} (full read: {moved})"
    finally:
        await stop_all(nodes + [evil])
