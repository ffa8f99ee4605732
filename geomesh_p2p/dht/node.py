"""A Kademlia DHT node whose RPCs (ping, store, find) run over the project's gRPC transport.

Kademlia: Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information System Based on the XOR
Metric" (IPTPS 2002). Semantics follow hivemind's ``hivemind.dht.node.DHTNode`` (batched store and
find, values with expiration times, subkey dictionaries, newest expiration wins), and the
transport-free parts are hivemind's own: ``DHTID`` and ``RoutingTable`` (hivemind.dht.routing),
``traverse_dht`` (hivemind.dht.traverse, run in a geomesh_p2p.util.aio.TaskScope that owns its tasks),
``DHTLocalStorage`` (hivemind.dht.storage) and the ``Blacklist`` of unresponsive peers
(hivemind.dht.node). No libp2p daemon is started.

Differences from hivemind:

* every RPC is a signed envelope (geomesh_p2p.net.transport): the sender's PeerID is authenticated, and a
  node's DHTID is SHA-1 of its PeerID (checked), so nobody picks its place in the key space;
* values are :mod:`signed records <geomesh_p2p.dht.records>` with owner rules, checked on store and
  again by the reader on find (a lying node cannot forge, alter or revive a record);
* replies from a node are accepted only when signed by the PeerID its contact says;
* a node that calls us enters the routing table only after it answered a ping at the address it
  claims (so signed pings naming fake addresses cannot fill the table or Find answers), and at most
  ``max_contacts_per_ip`` identities per IP and ``max_contacts_per_subnet`` per /24 (IPv6: /48) are
  admitted (loopback exempt unless ``limit_loopback``); replacement lists are bounded (k per bucket);
* storage is bounded by :class:`~geomesh_p2p.dht.quota.StorageQuota` (per owner, per key, unsigned,
  total); values under the run's keys must be signed; an unsigned value lives at most
  ``RecordLimits.max_unsigned_ttl_s`` from when it was stored (a holder's republish does not extend
  it; its publisher's does), so a flood of them spreads at most that long, within every node's quota.

The node's parts, one module each (each class derives from the one before): :mod:`~geomesh_p2p.dht.state`
(constructor state, value types, errors), :mod:`~geomesh_p2p.dht.storage` (local records),
:mod:`~geomesh_p2p.dht.contacts` (routing table upkeep), :mod:`~geomesh_p2p.dht.protocol` (RPC handlers and
calls), :mod:`~geomesh_p2p.dht.lookup` (iterative search), :mod:`~geomesh_p2p.dht.join` (join, clock,
reachability, refresh); this module: :class:`DHTNode` (store, get, republish, shutdown).

Usage::

    node = DHTNode(transport, k=20, alpha=3)   # registers DHT handlers: before transport.start()
    await transport.start()
    await node.join(["host:port", ...])        # DHTJoinError when no bootstrap answers
    await node.store("run/key", b"value", node.now() + 60)  # swarm time (see now())
    found = await node.get("run/key")          # {None: DHTValue(b"value", exp, None)}
    await node.shutdown()                      # then transport.stop() (the caller owns it)

Units: seconds and unix seconds for time, bytes for sizes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Any, Collection, Dict, List, Optional, Sequence

from hivemind.dht.routing import DHTID

from geomesh_p2p.dht.records import RecordError, SignedRecord, VerifiedRecord, key_id_of, make_record, verify_record
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.dht.state import Contact, DHTValue, LookupStats, is_peer_records_key
from geomesh_p2p.dht.join import DHTJoin

# The node's parts log under this name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")


class _Merge:
    """Best record per slot seen during a get: signed beats unsigned, then the latest expiration."""

    def __init__(self) -> None:
        self.best: Dict[Optional[str], VerifiedRecord] = {}

    def add(self, vr: VerifiedRecord) -> None:
        cur = self.best.get(vr.subkey)
        if cur is None or (vr.signed, vr.expiration_time) > (cur.signed, cur.expiration_time):
            self.best[vr.subkey] = vr

    def result(self, now: float) -> Dict[Optional[str], DHTValue]:
        return {
            sk: DHTValue(vr.value, vr.expiration_time, vr.owner)
            for sk, vr in self.best.items()
            if vr.expiration_time > now
        }


class _Targets:
    """The store targets of one key, cached from a lookup: node ids nearest first (None = this node), their
    contacts, and the stores that used them."""

    __slots__ = ("ids", "contacts", "uses")

    def __init__(self, ids: List[Optional[DHTID]], contacts: Dict[DHTID, Contact]) -> None:
        self.ids, self.contacts, self.uses = ids, contacts, 0


class _ReadTargets(_Targets):
    """A read's cached holders (:meth:`DHTNode.get`), and how long a reused read waits for them: twice the
    lookup that found them (at least :data:`MIN_READ_WAIT_S`, at most the RPC deadline). A reused read that waits
    longer than the lookup it saves is worse than that lookup: a holder that answered the lookup first and then
    answers just before the deadline would otherwise make each of the next reads wait for it (red team, session 22).
    ``spread``: each reused read asks its quorum drawn at random among ``ids`` (a value every reader reads from one
    holder: its reads spread over the key's nodes), else the first that answered. ``seen``: a full read's records of
    its last read (subkey -> expiration time, unix seconds), which the next cached read must find again."""

    __slots__ = ("wait_s", "spread", "seen")

    def __init__(
        self, ids: List[Optional[DHTID]], contacts: Dict[DHTID, Contact], wait_s: float, spread: bool = False
    ) -> None:
        super().__init__(ids, contacts)
        self.wait_s, self.spread = wait_s, spread
        self.seen: Optional[Dict[Optional[str], float]] = None


#: Keys whose store targets a node remembers (least recently stored first out).
MAX_CACHED_TARGETS = 64
#: The least a reused read waits for its cached holders before it drops them and looks the key up (a lookup of a
#: few milliseconds, on one host, would otherwise make one scheduling hiccup a lookup).
MIN_READ_WAIT_S = 0.1


#: A store counts at most this many RPC timeouts in ``store_times`` (:meth:`DHTNode.recent_store_s`): its lookup's
#: rounds and its stores, each bounded by the timeout (30 s at the default 3 s; stores under load took seconds, and
#: plans settle by them: a cap below what a loaded swarm's stores take would split its rounds again, issue 25).
STORE_TIME_CAP_RPCS = 10


class DHTNode(DHTJoin):
    """One Kademlia node over a :class:`~geomesh_p2p.net.transport.Transport` (k=20, alpha=3 by default).

    :param transport: not yet started (the constructor registers the DHT handlers on it), unless it
        is client-only. The caller owns it: :meth:`shutdown` does not stop it.
    :param k: bucket size and lookup beam width (Kademlia's k).
    :param alpha: concurrent find calls per lookup (Kademlia's alpha; traverse_dht's num_workers).
    :param num_replicas: nodes a value is stored on, default k.
    :param peer_record_replicas: nodes a peer record (``<run>/peers``, :func:`~geomesh_p2p.dht.state.is_peer_records_key`)
        is stored on, default ``PEER_RECORD_REPLICAS`` (8), at most ``num_replicas`` (:meth:`replicas_for`).
    :param store_target_reuse: a store of a peer record reuses the targets of the last lookup of its key until
        this many stores used them (default ``STORE_TARGET_REUSE``, 4; 1 = look up every time); a target that
        fails drops them and the store looks the key up again at once.
    :param depth_modulo: hivemind RoutingTable's b: split a full bucket not holding our own id when
        its depth is not a multiple of this.
    :param rpc_timeout_s: deadline of every DHT call, seconds.
    :param refresh_period_s: refresh buckets not used for this long (random-id lookup); re-dial the
        bootstrap nodes when the routing table is empty. Seconds.
    :param republish_period_s: every period (±10%), re-store every held record expiring later than
        ``2 * rpc_timeout_s`` from now on the current k nearest nodes, unless it was received or
        republished within the period (Kademlia's hourly republish, scaled). Records this node
        published itself are republished until they expire, even on a client-only node.
    :param limits: record and request limits (see :class:`~geomesh_p2p.dht.records.RecordLimits`).
    :param blacklist_s: skip a node that did not answer for this long (doubling on repeats).
    :param max_failures: drop a node from the routing table after this many failed calls in a row
        (at once when a replacement is waiting in its bucket).
    :param join_attempts, join_backoff_s: :meth:`join` retries, with backoff doubling from this
        (±20% jitter), capped at 8 s.
    :param refused_window_s: seconds :meth:`join` retries bootstraps that refuse every connection (nothing
        listens there: a mistyped port, a bootstrap still starting) before it gives up, whatever ``join_attempts``.
    :param storage_size: max keys held (earliest expiring evicted first); None = unbounded.
    :param quota: bytes held per owner, per key, unsigned and in total (see :mod:`~geomesh_p2p.dht.quota`).
    :param max_contacts_per_ip, max_contacts_per_subnet: identities admitted into the routing table
        (replacements included) per IP and per /24 (IPv6 /48; private and loopback addresses: no
        subnet limit); 0 = no limit.
    :param limit_loopback: apply the per-IP limit to loopback addresses too (a local swarm shares one).
    :param max_contact_checks: ping-backs of unknown callers in flight (more callers: not admitted now;
        they are when they call again).
    :param bootstrap_refresh_s: ping every bootstrap address this often (default: the refresh period,
        at most 15 s; 0 = never), even while other nodes are known: a bootstrap that restarted with an
        empty routing table learns of this node again (it pings it back and adds it), so newcomers
        joining through it find the swarm (issue 14 #2). Seconds.
    :param max_clock_skew_s: :meth:`join` measures this node's clock against its bootstraps' (ping
        replies carry the responder's time; offset = their time - the midpoint of the call) and raises
        :class:`ClockSkewError` beyond this many seconds (half the envelope's 120 s window, which also
        covers time in flight). Within it, every record expiry this node writes or judges is in swarm
        time, :meth:`now` (= this clock + the measured offset), so a skewed peer agrees with the others.
        After join the offset is re-measured at every bootstrap ping and followed, however large: a step of
        this machine's clock is corrected at once (``steady_clock``), a jump it does not explain once
        ``CLOCK_CONFIRMATIONS`` measurements agree (issue 29 #3; one WARNING line).
    :param clock: this machine's wall clock, unix seconds (a test passes a skewed one).
    :param steady_clock: a clock that steps of ``clock`` do not move, seconds (default with the default
        ``clock``: :func:`geomesh_p2p.net.swarm_time.steady_clock`; with an injected ``clock``: none, steps
        are then not watched). A step of ``clock`` against it corrects :attr:`clock_offset_s` at once.
    :param check_reachability: during :meth:`join`, ask the bootstraps to dial this node back at its
        advertised address; when none can, the node advertises no address (client-only) and logs a
        warning (:attr:`reachability`, :attr:`advertised_address`).
    """

    def __init__(self, transport: Transport, **kwargs: Any) -> None:
        super().__init__(transport, **kwargs)
        #: Seconds each of this node's last stores took (lookup + replicas, a value of a chunked plan included):
        #: the plan agreement settles at least as long as the slowest of them (:meth:`recent_store_s`).
        self.store_times: collections.deque = collections.deque(maxlen=32)
        #: Per key whose stores reuse their targets (peer records): the nodes the last lookup found, nearest
        #: first (None = this node), their contacts and how many stores used them (:meth:`_replicate`).
        self._targets: "collections.OrderedDict[DHTID, _Targets]" = collections.OrderedDict()
        #: Lookups made by stores, and stores that reused cached targets instead (counters, since start).
        self.store_lookups = 0
        self.store_reuses = 0
        #: Per peer-records key a sampled read asked: the holders that answered its last lookup with records, in
        #: the order they answered, their contacts and the reads that reused them (:meth:`get`).
        self._read_targets: "collections.OrderedDict[DHTID, _ReadTargets]" = collections.OrderedDict()
        #: Reads that looked their key up to fill or renew the cache, and those that asked cached holders alone
        #: (sampled reads, full reads with ``cached``, chunk reads with ``cached``; counters).
        self.read_lookups = 0
        self.read_reuses = 0
        #: Cached full reads that missed a record the previous read found, and looked those records up (counter).
        self.read_rechecks = 0
        self._serve()

    def recent_store_s(self) -> float:
        """The longest of this node's last 32 stores, in seconds (0.0 before the first), each counted at most
        ``STORE_TIME_CAP_RPCS`` x ``rpc_timeout_s``."""
        return max(self.store_times, default=0.0)

    @classmethod
    async def create(cls, transport: Transport, *, bootstrap: Sequence[str] = (), **kwargs) -> "DHTNode":
        """Make a node, start ``transport`` if it is not started yet, and :meth:`join` ``bootstrap``.

        Raises DHTJoinError (see :meth:`join`), OSError when the port cannot be bound.
        """
        node = cls(transport, **kwargs)
        if not transport.config.client_only and transport.address is None:
            await transport.start()
        await node.join(bootstrap)
        return node

    # ------------------------------------------------------------------ public API: store / get
    def _check_own(self, rec: SignedRecord) -> VerifiedRecord:
        return verify_record(rec, run_id=self.run_id, now=self.now(), limits=self.limits)

    async def store(
        self,
        key: str,
        value: bytes,
        expiration_time: float,
        subkey: Optional[str] = None,
        owner: Optional[Identity] = None,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) on the key's :meth:`replicas_for` nearest nodes (k; 8 for
        the run's peer records) until ``expiration_time`` (unix seconds). Signed by ``owner`` when given; an
        owner-named key or subkey requires it. A peer record's store reuses the nodes of the key's last lookup
        (``store_target_reuse``, see :meth:`_replicate`).

        Returns True when at least one node (this one included, when it serves) accepted it; False when
        none did (unreachable, or each holds a newer value or refused it: reasons are logged).
        Raises RecordError at once when the record breaks a rule (size, lifetime, owner, unsigned under
        a run key). Nodes keep an unsigned value at most ``limits.max_unsigned_ttl_s``; its publisher
        re-stores it every ``republish_period_s``.
        This node republishes the record until it expires (see ``republish_period_s``).
        """
        mine = owner is not None and owner.public_key_bytes == self.identity.public_key_bytes
        rec = make_record(
            key,
            value,
            expiration_time,
            subkey=subkey,
            owner=owner,
            run_id=self.run_id,
            pow_nonce=self.pow_nonce if mine else None,
        )
        vr = self._check_own(rec)
        self._published[(vr.key_id, vr.subkey)] = rec
        t0 = time.monotonic()
        ok = await self._replicate({vr.key_id: [rec]}, reuse_targets=True)
        # at most what a store's RPCs can take (a lookup's rounds and the stores, each under the rpc timeout): a longer
        # one is this process paused or its loop stalled, not the network (red team 54b: one 600 s SIGSTOP mid-store
        # made the next 32 records live 2,400 s and plans settle 600 s)
        self.store_times.append(min(time.monotonic() - t0, STORE_TIME_CAP_RPCS * self.rpc_timeout_s))
        return ok[vr.key_id][0]

    async def store_record(self, rec: SignedRecord) -> bool:
        """Store a record built elsewhere (e.g. by :func:`~geomesh_p2p.dht.records.make_record`); see :meth:`store`."""
        vr = self._check_own(rec)
        self._published[(vr.key_id, vr.subkey)] = rec
        ok = await self._replicate({vr.key_id: [rec]}, reuse_targets=True)
        return ok[vr.key_id][0]

    async def _replicate(
        self, by_key: Dict[DHTID, List[SignedRecord]], *, reuse_targets: bool = False
    ) -> Dict[DHTID, List[bool]]:
        """Store each key's records on its :meth:`replicas_for` nearest nodes (this one included when it serves);
        an unreachable target is replaced by the next nearest. Returns, per key, per record: accepted by at
        least one node.

        ``reuse_targets`` (:meth:`store`: this node's own records): the targets of a peer-records key
        (:func:`~geomesh_p2p.dht.state.is_peer_records_key`) are remembered, and the next stores of that key go
        to the same nodes without a lookup until ``store_target_reuse`` stores used them. Its peers re-store
        their records every round and each lookup cost ~k + log N Find calls (issue 25, session 16). A cached
        target that does not answer drops the cache: the store looks the key up again at once and completes its
        replicas on the nodes found (skipping those that answered)."""
        key_ids = list(by_key)
        reusable = {q for q in key_ids if reuse_targets and is_peer_records_key(by_key[q][0].key, self.run_id)}
        cached: Dict[DHTID, _Targets] = {}
        for q in reusable:
            t = self._targets.get(q)
            if t is not None and t.uses < self.store_target_reuse:
                cached[q] = t
        result: Dict[DHTID, List[bool]] = {q: [False] * len(by_key[q]) for q in key_ids}
        fresh = [q for q in key_ids if q not in cached]
        nearest: Dict[DHTID, List[DHTID]] = {}
        contacts: Dict[DHTID, Contact] = {}
        if fresh:
            nearest, contacts = await self._traverse(fresh, beam=max(self.k, self.num_replicas))
            self.store_lookups += 1

        def ordered(q: DHTID, ids: List[DHTID]) -> List[Optional[DHTID]]:
            out: List[Optional[DHTID]] = list(ids)
            if self.serving:
                out.append(None)  # None = this node
            out.sort(key=lambda nid: q.xor_distance(self.node_id if nid is None else nid))
            return out

        async def store_key(q: DHTID) -> None:
            records = by_key[q]
            want = self.replicas_for(records[0].key)
            reasons: List[str] = []
            answered: List[Optional[DHTID]] = []
            tried: set = set()
            failed = [False]

            async def fill(candidates: List[Optional[DHTID]], known: Dict[DHTID, Contact]) -> None:
                """Store on ``candidates`` in order until ``want`` nodes answered."""
                todo = [c for c in candidates if c not in tried]
                while todo and len(answered) < want:
                    batch = todo[: want - len(answered)]
                    todo = todo[len(batch) :]
                    tried.update(batch)
                    outs = await asyncio.gather(*(self._store_at(nid, known, records) for nid in batch))
                    for nid, out in zip(batch, outs):
                        if out is None:
                            failed[0] = True
                            continue
                        answered.append(nid)
                        for i, o in enumerate(out):
                            if o.stored:
                                result[q][i] = True
                            elif o.reason:
                                reasons.append(o.reason)

            t = cached.get(q)
            known = contacts
            if t is not None:
                t.uses += 1
                self.store_reuses += 1
                await fill(list(t.ids), t.contacts)
                if failed[0]:
                    # a cached target left or lags: forget them, look again, complete the replicas there
                    self._targets.pop(q, None)
                    found, seen = await self._traverse([q], beam=max(self.k, self.num_replicas))
                    self.store_lookups += 1
                    known = {**t.contacts, **seen}  # those that answered keep their place in the new cache
                    await fill(ordered(q, found.get(q, [])), known)
                    t = None
            else:
                await fill(ordered(q, nearest.get(q, [])), known)
            if q in reusable and t is None and answered:
                self._targets[q] = _Targets(list(answered), {nid: known[nid] for nid in answered if nid is not None})
                self._targets[q].uses = 1
                self._targets.move_to_end(q)
                while len(self._targets) > MAX_CACHED_TARGETS:
                    self._targets.popitem(last=False)
            if not all(result[q]) and reasons:
                self._once(logging.INFO, f"store {records[0].key!r}", f"not stored everywhere: {reasons[0]}")

        await asyncio.gather(*(store_key(q) for q in key_ids))
        return result

    async def _store_at(self, nid: Optional[DHTID], contacts: Dict[DHTID, Contact], records: List[SignedRecord]):
        if nid is None:
            return [self._store_local(r, from_peer=None) for r in records]
        return await self._send_records(contacts[nid], records)

    async def get(
        self,
        key: str,
        latest: bool = True,
        *,
        stats: Optional[LookupStats] = None,
        subkeys: Optional[Collection[str]] = None,
        quorum: Optional[int] = None,
        cached: bool = False,
    ) -> Dict[Optional[str], DHTValue]:
        """Find ``key``: ``{subkey or None: DHTValue(value, expiration_time, owner)}``, ``{}`` if absent.

        ``latest=True`` asks the k nearest nodes until ``read_quorum`` of them (None: all) have answered with
        records of the key, and keeps, per subkey, the signed record with the latest expiration (an unsigned
        one only when no signed one exists); ``latest=False`` stops at
        the first node that has any value (faster; a dictionary may then be partial). Every record is
        verified (signature, owner rule, expiry, size, key) before it is returned.

        ``subkeys`` (at most ``limits.max_keys_per_find``): only the records under these subkeys are asked for
        and returned (a read of a few peers' records costs a few records per node, not the key's N; issue 25).
        A node holding none of them does not count towards the quorum.

        ``quorum``: this read's quorum instead of the node's ``read_quorum`` (at least 1), e.g. a light follower's
        sampled read, which tolerates a stale record (it then takes the full path) and asks fewer holders; its quorum
        counts remote holders only (this node's records still merge: one of them, which any node may store here, made
        the first remote holder decide every other record asked). Such a
        read of a peer-records key (:func:`~geomesh_p2p.dht.state.is_peer_records_key`) asks the holders that
        answered the last lookup of the key, without a lookup, until ``read_target_reuse`` reads used them; a
        holder that fails or holds none of the records asked drops them and the read looks the key up (issue 25:
        a lookup's hops before the holders, ~6 at N = 1,024, were most of a light follower's DHT calls). A reused
        read waits for its cached holders at most twice as long as the lookup that found them took
        (:class:`_ReadTargets`), then drops them and looks the key up.

        ``cached`` (issue 25, session 26; a run with record shards S > 1 sets it, :func:`~geomesh_p2p.dht.announce.live_peers`):
        a full read (``latest``, the node's quorum, no ``subkeys``) of a peer-records key asks the holders its last
        lookup found, ``full_read_reuse`` reads in all. It decides from a record's absence, so a record that the
        previous read of the key returned and that has not expired, missing from the cached holders' answers, is
        looked up (a lookup of those subkeys, which only holders of them end) before the read returns without it;
        records stored since on other nodes than the cached holders are seen by the next lookup at the latest (stores
        reach the key's 8 nearest nodes, the cached holders are among them unless they changed). With an explicit
        ``quorum``, a read of any other key (a plan chunk: :mod:`~geomesh_p2p.dht.chunked`, whose reader checks every
        byte against the head's hash) asks ``quorum`` of the key's nearest nodes (those the last lookup found) drawn
        at random, ``read_target_reuse`` reads in all; :meth:`forget_read_targets` drops them.
        """
        wanted = set(subkeys) if subkeys else None
        sampled = quorum is not None  # a read that tolerates a stale record: it may ask cached holders
        if wanted is not None and len(wanted) > self.limits.max_keys_per_find:
            raise ValueError(f"{len(wanted)} subkeys asked, at most {self.limits.max_keys_per_find} per find")
        key_id = key_id_of(key)
        stats = stats if stats is not None else LookupStats()
        merge = _Merge()
        now = self.now()
        for rec in self._local_records(key_id):
            if wanted is not None and (not rec.HasField("subkey") or rec.subkey not in wanted):
                continue
            try:
                merge.add(verify_record(rec, run_id=self.run_id, now=now, limits=self.limits, expected_key_id=key_id))
                stats.found_hop = 0
            except RecordError:
                pass
        if merge.best and not latest:
            return merge.result(now)
        # nodes that answered with records (this one's store included, except in a sampled read: holding one of the
        # records asked, e.g. one any node stored on it, made the first remote holder decide every other record alone;
        # red team, session 22)
        answered = [1 if merge.best and not sampled else 0]
        # a key stored on fewer nodes than the quorum (peer records on a small replica count) ends at all of them
        wanted_quorum = self.read_quorum if quorum is None else max(1, int(quorum))
        quorum = None if wanted_quorum is None else min(wanted_quorum, self.replicas_for(key))

        def on_records(q: DHTID, records: List[VerifiedRecord], hop: int) -> bool:
            for vr in records:
                merge.add(vr)
            if stats.found_hop is None:
                stats.found_hop = hop
            answered[0] += 1
            return not latest or (quorum is not None and answered[0] >= quorum)

        peer_key = is_peer_records_key(key, self.run_id)
        full = cached and latest and not sampled and wanted is None and peer_key  # guarded against absence
        spread = cached and latest and sampled and not peer_key  # e.g. a plan chunk: any holder's copy is checked
        reuse = latest and quorum is not None and ((sampled and peer_key) or full or spread)
        local = answered[0]
        limit = self.full_read_reuse if full else self.read_target_reuse
        prev = self._read_targets.get(key_id)
        seen = dict(prev.seen) if full and prev is not None and prev.seen is not None else {}
        if reuse and quorum is not None and await self._read_cached(key_id, wanted, quorum, local, merge, stats, limit):
            result = merge.result(self.now())
            if not full:
                return result
            return await self._recheck(key, key_id, seen, result, merge, stats)
        holders: Dict[DHTID, List[DHTID]] = {}
        t0 = time.perf_counter()
        nearest, contacts = await self._traverse(
            [key_id],
            beam=self.k,
            on_records=on_records,
            stats=stats,
            await_all=False,
            subkeys=wanted,
            holders=holders if reuse else None,
        )
        if reuse:
            self.read_lookups += 1
            found = list(holders.get(key_id, ()))  # a copy: finds still in flight append to the lookup's list
            if spread:  # the key's nearest nodes (all hold it once stored): the holders that answered first, then them
                found += [nid for nid in nearest.get(key_id, [])[: self.replicas_for(key)] if nid not in found]
            if quorum is not None and len(found) >= max(1, quorum - local):
                wait_s = min(self.rpc_timeout_s, max(MIN_READ_WAIT_S, 2 * (time.perf_counter() - t0)))
                t = _ReadTargets(list(found), {nid: contacts[nid] for nid in found if nid in contacts}, wait_s, spread)
                t.uses = 1  # the lookup's read counts, as a store's does
                result = merge.result(self.now())
                if full:
                    t.seen = {sk: v.expiration_time for sk, v in result.items()}
                self._read_targets[key_id] = t
                self._read_targets.move_to_end(key_id)
                while len(self._read_targets) > MAX_CACHED_TARGETS:
                    self._read_targets.popitem(last=False)
                return result
        return merge.result(self.now())

    async def _recheck(
        self,
        key: str,
        key_id: DHTID,
        seen: Dict[Optional[str], float],
        result: Dict[Optional[str], DHTValue],
        merge: _Merge,
        stats: LookupStats,
    ) -> Dict[Optional[str], DHTValue]:
        """A cached full read's guard (:meth:`get`, ``cached``): the records the previous read of ``key`` found
        (``seen``: subkey -> expiration) that have not expired and are missing from ``result`` are looked up (only
        holders of one of them end that lookup, at the read's quorum, or the key's k nearest nodes all answered) and
        merged. Returns the read's result; the cache is dropped when any was missing (the next full read looks the key
        up)."""
        now = self.now()
        missing = {sk for sk, exp in seen.items() if exp > now and sk not in result}
        t = self._read_targets.get(key_id)
        if not missing:
            if t is not None:
                t.seen = {sk: v.expiration_time for sk, v in result.items()}
            return result
        self._read_targets.pop(key_id, None)  # what the cached holders answered is not taken as anyone's absence
        self.read_rechecks += 1
        self.read_lookups += 1
        quorum = min(self.read_quorum or self.k, self.replicas_for(key))
        answered = [0]

        def on_records(q: DHTID, records: List[VerifiedRecord], hop: int) -> bool:
            for vr in records:
                merge.add(vr)
            answered[0] += 1
            return answered[0] >= quorum

        named = {sk for sk in missing if sk is not None}
        # more than a find may name (or an unnamed record): a full lookup read
        subkeys = named if len(named) == len(missing) and len(named) <= self.limits.max_keys_per_find else None
        await self._traverse(
            [key_id], beam=self.k, on_records=on_records, stats=stats, await_all=False, subkeys=subkeys
        )
        return merge.result(self.now())

    def forget_read_targets(self, key: str) -> None:
        """Drop the holders cached for ``key``'s reads (:meth:`get`): the next read looks the key up. A reader whose
        cached holder answered with a copy it cannot use (a chunk that does not match its head) calls it."""
        self._read_targets.pop(key_id_of(key), None)

    async def _read_cached(
        self,
        key_id: DHTID,
        wanted: Optional[set],
        quorum: int,
        local: int,
        merge: _Merge,
        stats: LookupStats,
        limit: int,
    ) -> bool:
        """A sampled read from ``key_id``'s cached holders (:meth:`get`): asks them, nearest-answering first and
        in parallel, until ``quorum`` nodes (``local``: this node's own store counted) answered with records.
        True when the quorum was met. A holder that fails or answers with none of the records asked drops the
        cache: a spare cached holder completes this read, else the caller looks the key up (records found meanwhile
        stay in ``merge``), and the next read looks it up in either case. ``limit``: reads the cache serves in all."""
        t = self._read_targets.get(key_id)
        if t is None or t.uses >= limit:
            self._read_targets.pop(key_id, None)
            return False
        t.uses += 1
        need = quorum - local
        todo = [nid for nid in t.ids if nid is not None and nid in t.contacts]
        if t.spread:
            random.shuffle(todo)
        answered, good = 0, True
        while need > answered and todo:
            batch, todo = todo[: need - answered], todo[need - answered :]
            stats.rpcs += len(batch)
            calls = [asyncio.ensure_future(self._find(t.contacts[nid], [key_id], subkeys=wanted)) for nid in batch]
            try:
                done, pending = await asyncio.wait(calls, timeout=t.wait_s)
            except BaseException:
                for c in calls:
                    c.cancel()
                self._adopt_calls(set(calls))
                raise
            if pending:  # slower than the lookup it saves: not waited for (they finish, unread, in the background)
                self._adopt_calls(set(pending))
            for call in calls:
                reply = None
                if call in done:
                    if call.exception() is not None:  # as a lookup's worker: a failed call, never a failed read
                        log.error("find failed unexpectedly: %r", call.exception())
                    else:
                        reply = call.result()
                records = reply.get(key_id, ([], {}))[0] if reply is not None else []
                if not records:
                    good = False  # left, lags or lost the records: the next read looks the key up
                    continue
                for vr in records:
                    merge.add(vr)
                answered += 1
                if stats.found_hop is None:
                    stats.found_hop = 1
        if not good or answered < need:
            self._read_targets.pop(key_id, None)
        if answered >= need:
            self.read_reuses += 1
            return True
        return False

    # ------------------------------------------------------------------ republish
    async def republish_once(self) -> int:
        """Re-store held and self-published records on their current nearest nodes (see class doc).
        Returns the number of records sent."""
        now = self.now()
        margin = 2 * self.rpc_timeout_s
        for slot, rec in list(self._published.items()):
            if rec.expiration_time <= now + margin:
                del self._published[slot]
        for slot, t in list(self._fresh.items()):
            if t < now - 2 * self.republish_period_s:
                del self._fresh[slot]
        by_key: Dict[DHTID, Dict[Optional[str], SignedRecord]] = {}
        for key_id, slot, rec in self._held_records(min_remaining_s=margin):
            if self._fresh.get(slot, 0.0) > now - self.republish_period_s * 0.9:
                continue
            by_key.setdefault(key_id, {})[slot[1]] = rec
        for (key_id, subkey), rec in self._published.items():
            by_key.setdefault(key_id, {})[subkey] = rec  # own records always, newest version
        if not by_key:
            return 0
        payload = {q: list(recs.values()) for q, recs in by_key.items()}
        n = sum(len(v) for v in payload.values())
        keys = list(payload)
        for i in range(0, len(keys), self.limits.max_keys_per_find):
            part = {q: payload[q] for q in keys[i : i + self.limits.max_keys_per_find]}
            await self._replicate(part)
        for q, recs in payload.items():
            for rec in recs:
                self._fresh[(q, rec.subkey if rec.HasField("subkey") else None)] = self.now()
        self.stats.republished += n
        return n

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        """Stop refresh/republish and every task of this node; answer DHT calls with UNAVAILABLE.
        Does not stop the transport (other services may share it)."""
        self._alive = False
        await self.tasks.close()
