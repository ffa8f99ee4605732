"""How the protocol's own cost per peer grows with the swarm (issue 25): bytes and RPCs per peer per
round, the DHT apart from the exchange, requests served by the busiest DHT node, plan size, and (real
processes) round overhead and digests. Three tiers, each usable alone (``--tiers``), cheapest first:

1. ``sim``: the protocol at N = 8 ... 1,024 computed from the real code's messages, no network. The
   plan is the real planner's (:func:`geomesh_p2p.plan.awb.plan_round`) over N realistic signed-size
   PeerRecords (real Ed25519 PeerIDs, addresses, 16 standing entries), its size ``len(to_bytes())``
   against the DHT's 64 KiB value limit. Exchange bytes: :func:`geomesh_p2p.sim.link_time.exchange_bytes`
   of the plan's parts (relay mode, sign codec: the defaults; payload bytes, envelopes not counted);
   exchange RPCs 2 (N - 1) (push to and pull from every other owner, docs/collective.md). DHT: a MODEL
   of the membership traffic (docs/dht.md) whose message sizes are the real protobuf messages, signed
   records and envelopes at N: per round each peer stores its record once (``--dht-model rounds``, the
   default since session 16: on 8 nodes, with a nodes-only lookup of the key for 1 store in 4; the older
   models: ``round_s / announce_period_s`` stores, each a lookup and k Store calls), reads the records
   ``--reads`` times with ``latest=True`` (one lookup; light followers: 2 reads of a sample), plus one plan
   read (followers) or store (leader). Lookup RPCs are modelled as ``min(N - 1, k + ceil(log2(N / k)))``;
   the ``inproc`` tier measures them (20-21 at 32-128 nodes). The busiest node: each of the key's k
   nearest nodes serves every lookup and store of the key, ``(N - 1) * (2 * announces + reads)`` per round.
2. ``inproc``: N real DHT nodes (:class:`geomesh_p2p.dht.DHTNode` over gRPC on 127.0.0.1, one process)
   run the membership traffic of a round through the real calls (:class:`~geomesh_p2p.dht.announce.PeerAnnouncer`
   ``announce_once``, :func:`~geomesh_p2p.dht.announce.live_peers`, :class:`~geomesh_p2p.plan.agree.PlanStore`),
   as many as the sim tier models, all nodes at once; traffic read from each node's
   :class:`~geomesh_p2p.net.transport.TrafficStats`. No training, no exchange: it isolates the DHT.
3. ``proc``: real peer processes of the tiny model (one torch thread each) on 127.0.0.1 for a few
   rounds; every figure from their JSON round rows (``extra["traffic"]``: the cycle's bytes and calls
   per method class, DHT included). CPU heavy: N = 8, 16 by default.

Usage:
    python benchmarks/scale_peers.py --quick                    # < 1 minute: sim to 1,024, inproc 8/16
    python benchmarks/scale_peers.py --tiers sim,inproc         # sim 8..1,024, inproc 8..128
    python benchmarks/scale_peers.py --tiers proc --proc-n 8,16 # real processes (minutes)
    ... [--json out.json]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import asyncio
import json
import math
import shlex
import os
import random
import resource
import statistics
from collections import Counter
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from geomesh_p2p.dht import DHTNode  # noqa: E402
from geomesh_p2p.dht.announce import PeerAnnouncer, live_peers, peers_key  # noqa: E402
from geomesh_p2p.dht.records import DEFAULT_LIMITS, make_record  # noqa: E402
from geomesh_p2p.dht.state import (  # noqa: E402
    DEFAULT_READ_QUORUM,
    FULL_READ_TARGET_REUSE,
    PEER_RECORD_REPLICAS,
    READ_TARGET_REUSE,
    STORE_TARGET_REUSE,
)
from geomesh_p2p.net.identity import Identity  # noqa: E402
from geomesh_p2p.node.joining import SAMPLED_READ_QUORUM  # noqa: E402
from geomesh_p2p.net.methods import DHT_FIND, DHT_STORE  # noqa: E402
from geomesh_p2p.net.transport import Transport  # noqa: E402
from geomesh_p2p.net.transport_config import TransportConfig  # noqa: E402
from geomesh_p2p.plan.agree import PlanStore  # noqa: E402
from geomesh_p2p.round.light import draw_in_shards  # noqa: E402
from geomesh_p2p.plan.awb import plan_round  # noqa: E402
from geomesh_p2p.plan.schema import PlanConfig, RoundPlan  # noqa: E402
from geomesh_p2p.plan.wire import split_plan  # noqa: E402
from geomesh_p2p.schema.peer import PeerRecord  # noqa: E402
from geomesh_p2p.sim.link_time import exchange_bytes  # noqa: E402
from geomesh_p2p.sim.groups import exchange_traffic  # noqa: E402
from geomesh_p2p.exchange import CollectiveSpec, make_partition  # noqa: E402
from geomesh_p2p.exchange.groups import auto_group_size  # noqa: E402
from geomesh_p2p.wire import dht_pb2  # noqa: E402

RUN = "scale-bench"
K = 20  # the DHT's replication and lookup beam (dht/state.py default)
READ_QUORUM = DEFAULT_READ_QUORUM  # holders a latest read waits for (dht/state.py)
ALPHA = 3  # the DHT's parallel lookup workers (dht/state.py default)
TINY_NUMEL = 937_472  # elements of the tiny preset's flat vector (sim tier; the proc tier trains it)
BLOCK = 2048  # sign-codec block (RunConfig.block_size default)
ANNOUNCE_PERIOD_S = 2.0  # NodeConfig.announce_period_s default (before session 16: a store every period)
ANNOUNCES_PER_ROUND = 1  # since session 16: a record is stored once a round, at its end (dht/announce.py)
FULL_VIEW = 8  # NodeConfig.full_view_peers default: peers that read every record (the others: light followers)
SAMPLE = 8  # NodeConfig.light_sample default: records a light follower reads per check


# ------------------------------------------------------------------------------------------ records
def make_records(n: int, seed: int = 0) -> tuple[list[Identity], list[PeerRecord]]:
    """``n`` identities and the PeerRecords they would announce mid-run: real PeerIDs, 127.0.0.1
    addresses, a 64-hex digest and config hash, 16 standing entries + their own (ATTEST_TOP), a PoW
    nonce; throughput spread +-50 % so the planner has something to balance."""
    rnd = random.Random(seed)
    ids = [Identity.generate() for _ in range(n)]
    pids = [str(i.peer_id) for i in ids]
    recs = []
    for i, pid in enumerate(pids):
        f = 0.5 + rnd.random()
        others = rnd.sample(pids, min(16, n - 1) + 1)
        standing = {p[:16]: rnd.randint(1, 30) for p in others if p != pid}
        standing[pid[:16]] = 30
        recs.append(
            PeerRecord(
                peer_id=pid,
                address=f"127.0.0.1:{40000 + i}",
                device="cpu: x86_64 (1 thread)",
                memory_bytes=2 << 30,
                tokens_per_s={b: 900.0 * f * b / (b + 2) for b in (1, 2, 4, 8)},
                max_batch=8,
                upload_bps=2.5e6,
                download_bps=2.5e6,
                version="0.1.0",
                run_config_hash="a" * 64,
                round=12,
                weights_digest="b" * 64,
                pow_nonce=rnd.randrange(1 << 40),
                standing=standing,
            )
        )
    return ids, recs


def make_plan(records: list[PeerRecord], round: int = 12) -> RoundPlan:
    """The real AWB plan of ``records`` for the tiny model (defaults of RunConfig: seq 64, batch 8,
    window 6 s, relay sign payloads)."""
    n = len(records)
    payload = exchange_bytes(
        [TINY_NUMEL // n] * n, contribution="sign", aggregate="sign", mode="relay", block_size=BLOCK
    )
    cfg = PlanConfig(
        seq_len=64, target_batch=8, window_s=6.0, part_align=BLOCK, payload_bytes=int(max(payload.pull_down))
    )
    return plan_round(
        records, cfg, run_id=RUN, round=round, leader=records[0].peer_id, numel=TINY_NUMEL, start_time=time.time() + 5
    )


def grouped_exchange(ids: Sequence[Identity], numel: int) -> tuple[float, float, int]:
    """Per peer, mean over the ``len(ids)`` participants of a healthy ``reencode`` round with ``--group-size auto``
    (:func:`geomesh_p2p.exchange.groups.auto_group_size`; one group below 111): exchange calls made and payload bytes
    sent + received, counted from the round's real specs (:func:`geomesh_p2p.sim.groups.exchange_traffic`); and the
    group size (0: one group)."""
    pids = [str(i.peer_id) for i in ids]
    n = len(pids)
    owners = make_partition(numel, [(p, f"10.0.{k // 250}.{k % 250}:7000", None) for k, p in enumerate(pids)])
    spec = CollectiveSpec("sim", 1, {p: 10**6 for p in pids}, owners, numel, time.time() + 60, time.time() + 80)
    g = auto_group_size(None, n)
    t = exchange_traffic(spec, g)
    return (
        statistics.fmean(t.made.get(p, 0) for p in pids),
        statistics.fmean(t.sent.get(p, 0) + t.received.get(p, 0) for p in pids),
        g,
    )


# ------------------------------------------------------------------------------------------ tier 1
def _env_bytes(ident: Identity, payload: bytes, kind: str) -> int:
    """Bytes of ``payload`` in its signed envelope, as the transport counts them (request or reply)."""
    return ident.sign_message(run_id=RUN, round=0, kind=kind, payload=payload).ByteSize()


@dataclass(frozen=True)
class WhatIf:
    """Sim tier: the DHT's peer-record parameters, and one change that is modelled, not built (session 15's analysis
    of issue 25's 1.5x goal). ``record_replicas``: nodes a peer record's store reaches (built in session 16:
    ``PEER_RECORD_REPLICAS`` = 8; k = 20 before); ``lookup_share``: share of announcements that look the key's
    nodes up again (built: cached store targets, 1 / ``STORE_TARGET_REUSE`` = 0.25; 1.0 before); ``two_phase``
    (not built): a full read asks the quorum for an index (~60 B a record) and fetches each record once."""

    record_replicas: int = PEER_RECORD_REPLICAS
    lookup_share: float = 1.0 / STORE_TARGET_REUSE
    two_phase: bool = False
    #: holders a light follower's sampled read waits for (built in session 18: ``SAMPLED_READ_QUORUM`` = 2;
    #: the node's read quorum, 5, before)
    sampled_quorum: int = SAMPLED_READ_QUORUM
    #: the run's ``record_shards`` (built in session 19, default 1): records spread over this many keys
    record_shards: int = 1
    #: a light follower's sampled read of a key asks the holders its last lookup of that key found, without a
    #: lookup, this many times in all (built in session 22: 8; ``READ_TARGET_REUSE`` = 32 since session 26; 1: a
    #: lookup every read); also the reuse of a stable chunk key's holders (``stable_parts``)
    read_reuse: int = READ_TARGET_REUSE
    #: a full read of a sharded run (S > 1) asks the holders its key's last lookup found, this many reads in all
    #: (built in session 26: ``FULL_READ_TARGET_REUSE`` = 8 when S > 1; 1: a lookup every read, the rule before)
    full_read_reuse: int = 1
    #: a chunked plan's chunks under stable keys, each read from one cached holder (built in session 26 for S > 1;
    #: False: a lookup per chunk, the rule before)
    stable_parts: bool = False


def sim_row(
    n: int,
    reads: int,
    round_s: float,
    model: str = "rounds",
    full_view: int = FULL_VIEW,
    sample: int = SAMPLE,
    what_if: WhatIf = WhatIf(),
    announces_per_round: Optional[float] = None,
) -> dict[str, Any]:
    """Tier 1 at ``n`` peers: plan from the real planner; exchange from sim.link_time; DHT from the model
    described in the module docstring with real message sizes. Per peer per round: bytes are sent +
    received of the calls it makes and of those it serves (as the other tiers count them), RPCs are calls
    made. ``model`` "rounds" (session 16, the code as built): as "light", with each record stored
    ``announces_per_round`` times a round (default 1: at the round's end, dht/announce.py) on
    ``what_if.record_replicas`` nodes (8), a lookup of the key for ``what_if.lookup_share`` of them (cached store
    targets: 1 in 4); "light" (session 14, issue 25's light followers, docs/round.md): the first ``full_view``
    peers do ``reads`` full reads, the others 2 reads of ``sample`` records (the plan's check and the digest's),
    each record stored every 2 s (``round_s / ANNOUNCE_PERIOD_S`` a round); "after": every peer full-view;
    "before": main at def8ba8. For "light", "after" and "before" pass ``WhatIf(K, 1.0)`` for the code they
    describe (``main`` does)."""
    ids, recs = make_records(n)
    t = time.process_time()
    plan = make_plan(recs)
    plan_s = time.process_time() - t  # the leader's CPU seconds to plan (the partition's LP grows with n)
    plan_b = len(plan.to_bytes())
    me = ids[0]
    exp = time.time() + 8
    signed = [
        make_record(peers_key(RUN), r.to_bytes(), exp, subkey=r.peer_id, owner=ids[i], run_id=RUN)
        for i, r in enumerate(recs)
    ]
    info = dht_pb2.NodeInfo(node_id=b"x" * 20, address="127.0.0.1:40000", peer_id=b"p" * 32)
    held = min(n, DEFAULT_LIMITS.max_subkeys_per_key)
    find_req = _env_bytes(me, dht_pb2.FindRequest(sender=info, keys=[b"k" * 20]).SerializeToString(), DHT_FIND)
    res = dht_pb2.FindResult(key=b"k" * 20, records=signed[:held], nearest=[info] * K)
    find_rep = _env_bytes(me, dht_pb2.FindResponse(results=[res]).SerializeToString(), DHT_FIND + "+resp")
    store_req = _env_bytes(me, dht_pb2.StoreRequest(sender=info, records=signed[:1]).SerializeToString(), DHT_STORE)
    store_rep = _env_bytes(
        me, dht_pb2.StoreResponse(outcomes=[dht_pb2.StoreOutcome(stored=True)]).SerializeToString(), DHT_STORE + "+resp"
    )
    lookup = min(n - 1, K + math.ceil(math.log2(max(1.0, n / K))))
    replicas = min(n - 1, what_if.record_replicas)  # the other nodes a store reaches (this node keeps its own)
    if announces_per_round is not None:
        announces = announces_per_round
    else:
        announces = ANNOUNCES_PER_ROUND if model == "rounds" else round_s / ANNOUNCE_PERIOD_S
    share = what_if.lookup_share
    # Every node near the key holds all n records (k >= n, or the key's k nearest at larger n): each Find
    # of a lookup is answered with them; a lookup of n > k nodes also asks farther nodes (no records).
    holders = min(lookup, K)
    nodes_rep = find_rep - res.ByteSize() + 30  # a Find reply without records (the nearest nodes only)
    look_b = lookup * find_req + holders * find_rep + (lookup - holders) * nodes_rep
    wire = split_plan(plan)
    plan_value = plan_b if model == "before" else len(wire.head)
    plan_rep = nodes_rep + plan_value
    if model == "before":  # main at def8ba8: a store's lookup read every record; a read asked all k holders
        store_look_b, read_rpcs, read_b = look_b, lookup, look_b
    else:
        # a store's lookup asks for nodes only (FindRequest.nodes_only); a latest read ends once READ_QUORUM
        # holders answered (plus the alpha - 1 calls in flight then), after the hops to the key's neighbourhood
        store_look_b = lookup * (find_req + nodes_rep)
        hops = lookup - holders
        asked = min(holders, READ_QUORUM + ALPHA - 1)
        read_rpcs = hops + asked
        read_b = read_rpcs * find_req + asked * find_rep + hops * nodes_rep
        if what_if.two_phase:  # an index of the held records from the quorum, then each record once
            read_b = read_rpcs * find_req + asked * (nodes_rep + held * 60) + hops * nodes_rep
            read_b += (find_rep - nodes_rep) + held * 48
    # Record shards (session 19): a full read asks each of the S keys, each holding ~n/S records
    shards = what_if.record_shards if model == "rounds" else 1
    held_s = math.ceil(held / shards)
    full_read_rpcs, full_read_b = read_rpcs, read_b
    if shards > 1:
        res_s = dht_pb2.FindResult(key=b"k" * 20, records=signed[:held_s], nearest=[info] * K)
        find_rep_s = _env_bytes(me, dht_pb2.FindResponse(results=[res_s]).SerializeToString(), DHT_FIND + "+resp")
        # 1 full read of a key in full_read_reuse looks it up; the others ask the quorum's cached holders alone
        # (session 26; no churn assumed, so no record goes missing and the guard's lookup never runs)
        ff = 1.0 / max(1, what_if.full_read_reuse)
        q_full = min(holders, READ_QUORUM)
        full_read_rpcs = shards * (ff * read_rpcs + (1.0 - ff) * q_full)
        full_read_b = shards * (
            ff * (read_rpcs * find_req + asked * find_rep_s + hops * nodes_rep)
            + (1.0 - ff) * q_full * (find_req + find_rep_s)
        )
    # a light follower's sampled reads: the plan's check (its leader and sample - 1 others drawn uniformly: the keys of
    # the distinct shards among them) and the digest's (one shard: round.light.draw_in_shards)
    s_reads = 2.0 if shards == 1 else 1.0 + shards * (1.0 - (1.0 - 1.0 / shards) ** sample)
    # a chunked plan's chunks (plan/wire.py, past ~750 participants): each read once per round (PlanReader
    # caches the assembled plan), from the first holder of the leader's subkey (dht/chunked.py: every copy is
    # the same owner-signed bytes), after the lookup's hops
    hops_q = lookup - holders
    chunk_rpcs = len(wire.chunks) * (hops_q + 1) if model != "before" else 0
    chunk_b = (
        sum((hops_q + 1) * find_req + hops_q * nodes_rep + nodes_rep + len(c) + 300 for c in wire.chunks)
        if chunk_rpcs
        else 0
    )
    # stable chunk keys (session 26): 1 read in read_reuse looks the key up (quorum 1: the hops, then up to alpha
    # holders answer with the chunk), the others ask one cached holder drawn among the key's k nearest nodes
    fc = 1.0 / max(1, what_if.read_reuse)
    asked_c = min(holders, ALPHA)
    if what_if.stable_parts and chunk_rpcs:
        chunk_rpcs = len(wire.chunks) * (fc * (hops_q + asked_c) + (1.0 - fc))
        chunk_b = sum(
            fc * ((hops_q + asked_c) * find_req + hops_q * nodes_rep + asked_c * (nodes_rep + len(c) + 300))
            + (1.0 - fc) * (find_req + nodes_rep + len(c) + 300)
            for c in wire.chunks
        )
    full_rpcs = announces * (share * lookup + replicas) + reads * full_read_rpcs + read_rpcs + chunk_rpcs
    full_made = (
        announces * (share * store_look_b + replicas * (store_req + store_rep))
        + reads * full_read_b
        + read_rpcs * (find_req + plan_rep)
        + chunk_b
    )
    n_full = n if model not in ("light", "rounds") else min(n, full_view)
    light_rpcs, light_made = full_rpcs, full_made
    if n_full < n:
        # a light follower: the same announcements and plan read, and 2 subkey reads of `sample` records
        # (FindRequest.subkeys: each holder answers with those records only) instead of `reads` full reads
        s_res = dht_pb2.FindResult(key=b"k" * 20, records=signed[: min(sample, held_s)], nearest=[info] * K)
        s_rep = _env_bytes(me, dht_pb2.FindResponse(results=[s_res]).SerializeToString(), DHT_FIND + "+resp")
        s_req = find_req + sample * 48  # the subkeys asked: a base58 PeerID each
        hops = lookup - holders
        asked = min(holders, what_if.sampled_quorum + ALPHA - 1)
        # 1 read in read_reuse looks its key up (hops, then the holders until the quorum, alpha - 1 calls more in
        # flight); the others ask the quorum's cached holders alone (session 22; no churn assumed)
        f = 1.0 / max(1, what_if.read_reuse)
        q = min(holders, what_if.sampled_quorum)
        s_rpcs = f * (hops + asked) + (1.0 - f) * q
        s_read_b = f * ((hops + asked) * s_req + asked * s_rep + hops * nodes_rep) + (1.0 - f) * q * (s_req + s_rep)
        sampled_b = s_reads * s_read_b
        if shards > 1:
            # the plan check's sample spread over its s_reads - 1 keys: each read carries only its own records
            rec_b = signed[0].ByteSize()
            keys = s_reads - 1.0
            per = sample / keys
            looked = (hops + asked) * (find_req + per * 48) + hops * nodes_rep + asked * (nodes_rep + per * rec_b)
            cached_b = q * (find_req + per * 48 + nodes_rep + per * rec_b)
            plan_b_read = f * looked + (1.0 - f) * cached_b
            sampled_b = keys * plan_b_read + s_read_b
        light_rpcs = announces * (share * lookup + replicas) + s_reads * s_rpcs + read_rpcs + chunk_rpcs
        light_made = (
            announces * (share * store_look_b + replicas * (store_req + store_rep))
            + sampled_b
            + read_rpcs * (find_req + plan_rep)
            + chunk_b
        )
    # where a peer's bytes go (sent + received, x 2 as dht_b): its announcements, its reads of the records, the plan
    announce_b = announces * (share * store_look_b + replicas * (store_req + store_rep))
    plan_read_b = read_rpcs * (find_req + plan_rep) + chunk_b
    full_parts = {"announce": 2 * announce_b, "records": 2 * reads * full_read_b, "plan": 2 * plan_read_b}
    light_parts = (
        {"announce": 2 * announce_b, "records": 2 * (light_made - announce_b - plan_read_b), "plan": 2 * plan_read_b}
        if n_full < n
        else None
    )
    dht_rpcs = (n_full * full_rpcs + (n - n_full) * light_rpcs) / n
    made = (n_full * full_made + (n - n_full) * light_made) / n
    dht_b = 2 * made  # + the calls it serves: as many bytes as it makes, on average over a symmetric swarm
    xb = exchange_bytes(
        [a.part_end - a.part_start for a in plan.assignments],
        contribution="sign",
        aggregate="sign",
        mode="relay",
        block_size=BLOCK,
    )
    x_b = statistics.fmean(xb.sent(i) + xb.received(i) for i in range(n))
    g_rpcs, g_b, g_size = grouped_exchange(ids, TINY_NUMEL)
    # served by the busiest node: each of the peers key's k nearest nodes is asked by every lookup of the
    # key (a lookup ends by querying the k nearest, the same k for every peer) and the nearest replicas are
    # reached by every store: the hot key. The plan key has its own k nearest: the same nodes only while n - 1 <= k.
    # the other peers' reads: full-view peers make `reads` full reads, light followers 2 sampled ones
    others = n - 1
    full_others = min(n_full, others)
    # With S shards (others > k: the S keys' nearest nodes are S sets) a holder of one shard is reached by the
    # stores of its ~others/S writers, every full read (each asks every shard) and 1/S of the sampled reads.
    spread = shards if others > K else 1
    busiest = (
        math.ceil(others / spread) * announces * (share + 1)
        + (others if others <= K else 0)
        + full_others * reads
        + (others - full_others) * s_reads / spread
    )
    if what_if.stable_parts and wire.chunks and others > K:
        # a stable chunk key's nearest node: its share of the cached reads (one of k holders at random) and every
        # lookup read of the key (which ends at its nearest holders)
        busiest = max(busiest, others * ((1.0 - fc) / K + fc))
    return {
        "tier": "sim",
        "n": n,
        "dht_model": model,
        "announces_per_round": announces,
        "record_replicas": replicas,
        "store_lookup_share": share,
        "plan_bytes": plan_b,
        # stored at all: as one value before; after, its compact head (+ chunks, plan/wire.py) at every size
        "plan_fits": plan_b <= DEFAULT_LIMITS.max_value_bytes or model != "before",
        "plan_head_bytes": plan_value,
        "plan_cpu_s": plan_s,
        "record_bytes": len(recs[0].to_bytes()),
        "find_reply_bytes": find_rep,
        "lookup_rpcs": lookup,
        "dht_bytes": dht_b,
        "dht_rpcs": dht_rpcs,
        "exchange_bytes": x_b,
        "exchange_rpcs": 2 * (n - 1),
        # issue 26's exchange: reencode with --group-size auto (one group below 111 peers), from the real layout
        "exchange_bytes_auto": g_b,
        "exchange_rpcs_auto": g_rpcs,
        "group_size_auto": g_size,
        "busiest_served": busiest,
        "record_shards": shards,
        "read_reuse": what_if.read_reuse,
        "full_read_reuse": what_if.full_read_reuse,
        "stable_parts": what_if.stable_parts,
        "plan_chunks": len(wire.chunks),
        "full_view_peers": n_full,
        "dht_bytes_full_peer": 2 * full_made,
        "dht_bytes_light_peer": 2 * light_made if n_full < n else None,
        "dht_rpcs_light_peer": light_rpcs if n_full < n else None,
        "full_peer_parts": full_parts,
        "light_peer_parts": light_parts,
    }


# ------------------------------------------------------------------------------------------ tier 2
def _dht_counts(t: Transport) -> dict[str, int]:
    return t.stats.by_class().get("dht", {"sent": 0, "received": 0, "calls": 0, "served": 0})


def inproc_max_channels(n: int) -> int:
    """Client channels each of ``n`` in-process nodes keeps open (LRU closed first): a third of this process's
    descriptor limit shared by the nodes (each channel is two descriptors here, its client and server ends), at
    least 16. Real peers each have a process and a limit of their own; before session 27 every in-process node
    took the default (1,024, at most a quarter of the limit) and 128 nodes ran out of descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 20_000 if soft == resource.RLIM_INFINITY else int(soft)
    return max(16, limit // (3 * n))


async def inproc_row(
    n: int,
    rounds: int,
    reads: int,
    round_s: float,
    timeout_s: float,
    full_view: int = FULL_VIEW,
    sample: int = SAMPLE,
    announces_per_round: int = ANNOUNCES_PER_ROUND,
    sampled_quorum: int = SAMPLED_READ_QUORUM,
    shards: int = 1,
    read_reuse: int = READ_TARGET_REUSE,
) -> dict[str, Any]:
    """Tier 2 at ``n`` in-process DHT nodes (the DHT's defaults: peer records on 8 nodes, store targets reused 4
    times); each measured round: every node announces ``announces_per_round`` times (1: a record is stored once a
    round since session 16; ``round_s / ANNOUNCE_PERIOD_S`` before); the first ``full_view`` nodes read the records ``reads`` times
    (live_peers, latest), the others (light followers, ``full_view`` > 0) read ``sample`` records twice
    (live_peers with ``only``: the plan's check and the digest's); the leader (node 0) stores the real plan of
    the n records and every follower reads it once. ``full_view`` 0: every node reads every record. ``shards``: the
    run's ``record_shards`` (records under that many keys; a light follower's plan check reads the leader's record
    and others drawn uniformly, its digest check others drawn a shard at a time: ``round.light.draw_in_shards``).
    ``read_reuse``: the nodes' ``read_target_reuse`` (a sampled read's cached holders; 1: a lookup every read)."""
    ids, recs = make_records(n, seed=n)
    rnd = random.Random(n)
    nodes: list[DHTNode] = []
    channels = inproc_max_channels(n)
    t0 = time.perf_counter()
    for ident in ids:
        tcfg = TransportConfig(host="127.0.0.1", port=0, default_timeout_s=timeout_s, max_channels=channels)
        t = Transport(ident, RUN, tcfg)
        node = DHTNode(
            t, rpc_timeout_s=timeout_s, refresh_period_s=3600, republish_period_s=3600, read_target_reuse=read_reuse
        )
        await t.start()
        await node.join([rnd.choice(nodes).address] if nodes else [])
        nodes.append(node)
    build_s = time.perf_counter() - t0
    announcers = [
        PeerAnnouncer(node, rec, period_s=ANNOUNCE_PERIOD_S, ttl_s=3600.0, shards=shards)
        for node, rec in zip(nodes, recs)
    ]  # a long lifetime: the benchmark's rounds run faster or slower than real time, records must not lapse
    # S > 1: a chunked plan's chunks under stable keys too (node/peer.py does the same; session 26)
    stores = [PlanStore(node, ident, RUN, stable_parts=shards > 1) for node, ident in zip(nodes, ids)]
    plan = make_plan(recs, round=0)
    announces = announces_per_round
    seen: list[int] = []
    sampled: list[bool] = []  # a light follower's sampled read found every record it asked for
    plan_ok: list[bool] = []

    async def peer_round(i: int, r: int, published: asyncio.Event) -> None:
        for _ in range(announces):
            await announcers[i].announce_once()
        if full_view and i >= full_view:
            others = [x.peer_id for x in recs[1:] if x is not recs[i]]
            # the plan's check (its leader, node 0, and others), then the digest's (others only), as round/light.py
            for picked in (
                [recs[0].peer_id, *rnd.sample(others, sample - 1)],
                draw_in_shards(others, sample, shards),
            ):
                got = await live_peers(nodes[i], RUN, latest=True, only=picked, quorum=sampled_quorum, shards=shards)
                sampled.append(len(got) == len(picked))
            return await plan_read(i, r, published)
        for _ in range(reads):
            seen.append(len(await live_peers(nodes[i], RUN, latest=True, shards=shards)))
        await plan_read(i, r, published)

    async def plan_read(i: int, r: int, published: asyncio.Event) -> None:
        if i == 0:
            # a plan of its own each round (later deadlines: a later expiry, as a real leader's; the stable chunk
            # slot of round r - 2 is replaced by round r's only when it expires later)
            plan_ok.append(await stores[0].publish(make_plan(recs, round=r)))
            published.set()
        else:
            await published.wait()  # one read once the plan is there (real followers poll until it is)
            # the head and, for a chunked plan, its chunks (since session 26; the head only before)
            plan_ok.append(bool(await stores[i].read(r)))

    await asyncio.gather(*(a.announce_once() for a in announcers))  # warm-up: every record stored once
    before = [_dht_counts(x.transport) for x in nodes]
    lookups0 = sum(x.store_lookups for x in nodes)
    t1 = time.perf_counter()
    for r in range(rounds):
        published = asyncio.Event()
        await asyncio.gather(*(peer_round(i, r, published) for i in range(n)))
    wall = time.perf_counter() - t1
    after = [_dht_counts(x.transport) for x in nodes]
    lookups1 = sum(x.store_lookups for x in nodes)
    d = [{f: a[f] - b[f] for f in a} for a, b in zip(after, before)]
    await asyncio.gather(*(x.shutdown() for x in nodes))
    await asyncio.gather(*(x.transport.stop(grace=0) for x in nodes))
    return {
        "tier": "inproc",
        "n": n,
        "max_channels": channels,
        "record_shards": shards,
        "read_reuse": read_reuse,
        "read_lookups": sum(x.read_lookups for x in nodes) / n / rounds,
        "read_reuses": sum(x.read_reuses for x in nodes) / n / rounds,
        "read_rechecks": sum(x.read_rechecks for x in nodes),
        "rounds": rounds,
        "announces_per_round": announces,
        "store_lookups": (lookups1 - lookups0) / n / rounds,
        "build_s": build_s,
        "wall_s_per_round": wall / rounds,
        "plan_bytes": len(plan.to_bytes()),
        "plan_fits": len(plan.to_bytes()) <= DEFAULT_LIMITS.max_value_bytes,
        "dht_bytes": statistics.fmean(x["sent"] + x["received"] for x in d) / rounds,
        "dht_sent": statistics.fmean(x["sent"] for x in d) / rounds,
        "dht_rpcs": statistics.fmean(x["calls"] for x in d) / rounds,
        "busiest_served": max(x["served"] for x in d) / rounds,
        "median_served": statistics.median(x["served"] for x in d) / rounds,
        "records_seen_min": min(seen) if seen else 0,
        "full_view_peers": min(n, full_view) if full_view else n,
        "sampled_reads_complete": f"{sum(sampled)}/{len(sampled)}",
        "dht_bytes_full_peer": statistics.fmean(x["sent"] + x["received"] for x in d[: full_view or n]) / rounds,
        "dht_bytes_light_peer": (
            statistics.fmean(x["sent"] + x["received"] for x in d[full_view:]) / rounds
            if full_view and n > full_view
            else None
        ),
        "plan_reads_ok": sum(plan_ok),
        "plan_reads": len(plan_ok),
    }


# ------------------------------------------------------------------------------------------ tier 3
def proc_row(n: int, rounds: int, workdir: Path, timeout_s: float, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Tier 3: ``n`` peer processes (tests.swarm_util.ProcSwarm: tiny model, one torch thread, 127.0.0.1)
    until each wrote ``rounds`` rows or ``timeout_s``; figures from rows after each peer's first. ``extra``: more
    ``geomesh-peer join`` flags for every peer (``--proc-args``)."""
    from tests.swarm_util import ProcSwarm  # the tests' process helper (benchmarks may use it)

    names = [f"p{i}" for i in range(n)]
    swarm = ProcSwarm(workdir)
    t0 = time.time()
    try:
        # window 2.5 s: the tests' FAST flags had it when this tier's rows in docs/scale.md were measured
        swarm.start_peers(
            names,
            "--rounds",
            str(rounds),
            "--min-peers",
            str(n),
            "--wait-peers-s",
            "300",
            "--window-s",
            "2.5",
            "--speed-factor",
            "1",
            *extra,
        )
        deadline = time.time() + timeout_s

        def finished(x: str) -> bool:  # its last round's row is written, or it exited
            done = any(r.get("round") == rounds - 1 for r in swarm.rows(x))
            return done or swarm.procs[x].poll() is not None

        while time.time() < deadline and not all(finished(x) for x in names):
            time.sleep(2)
    finally:
        swarm.stop_all(grace_s=30)
    rows = {x: [r for r in swarm.rows(x) if "round" in r and "digest" in r] for x in names}
    use = [r for x in names for r in rows[x][1:] if isinstance(r.get("extra", {}).get("traffic"), dict)]
    by_round: dict[int, set] = {}
    votes: dict[int, Counter] = {}
    for x in names:
        for r in rows[x]:
            by_round.setdefault(r["round"], set()).add(r["digest"])
            votes.setdefault(r["round"], Counter())[r["digest"]] += 1
    behind, apart = lineage(votes)

    def mean(f) -> Optional[float]:
        xs = [f(r) for r in use]
        xs = [v for v in xs if v is not None]
        return statistics.fmean(xs) if xs else None

    def cls(r, c, f) -> int:
        return r["extra"]["traffic"].get(c, {}).get(f, 0)

    return {
        "tier": "proc",
        "n": n,
        "wall_s": time.time() - t0,
        "rows": sum(len(v) for v in rows.values()),
        "rows_used": len(use),
        "dht_bytes": mean(lambda r: cls(r, "dht", "sent") + cls(r, "dht", "received")),
        "dht_rpcs": mean(lambda r: cls(r, "dht", "calls")),
        "exchange_bytes": mean(lambda r: cls(r, "collective", "sent") + cls(r, "collective", "received")),
        "exchange_rpcs": mean(lambda r: cls(r, "collective", "calls")),
        "busiest_served": max(
            (statistics.fmean(cls(r, "dht", "served") for r in rows[x][1:]) for x in names if rows[x][1:]),
            default=None,
        ),
        "cycle_s": mean(lambda r: r.get("cycle_s")),
        "overhead_s": mean(lambda r: (r["cycle_s"] - r["compute_s"]) if r.get("cycle_s") else None),
        "peers_planned": mean(lambda r: r.get("peers")),
        "light_rows": sum(1 for r in use if r.get("extra", {}).get("light")),
        "dht_bytes_full_peer": _mean_of(
            [cls(r, "dht", "sent") + cls(r, "dht", "received") for r in use if not r.get("extra", {}).get("light")]
        ),
        "dht_bytes_light_peer": _mean_of(
            [cls(r, "dht", "sent") + cls(r, "dht", "received") for r in use if r.get("extra", {}).get("light")]
        ),
        "digests_per_round": max((len(v) for v in by_round.values()), default=0),
        "digests_equal": bool(by_round) and all(len(v) == 1 for v in by_round.values()),
        "rows_behind": behind,
        "rows_apart": apart,
    }


def lineage(votes: dict[int, Counter]) -> tuple[int, int]:
    """(rows behind, rows apart) of a run's round rows, ``votes``: round -> Counter of the digests peers wrote.
    One lineage means every row holds its round's majority digest or an earlier round's majority digest (a peer
    whose round applied nothing holds its start state: behind, and the digest check re-syncs it); a row with any
    other digest is apart, a state off the swarm's line (a fork, or a split the digest check repaired)."""
    line: set = set()
    behind = apart = 0
    for rnd in sorted(votes):
        major = votes[rnd].most_common(1)[0][0]
        for d, k in votes[rnd].items():
            if d != major:
                behind, apart = (behind + k, apart) if d in line else (behind, apart + k)
        line.add(major)
    return behind, apart


def _mean_of(xs: list) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


# ------------------------------------------------------------------------------------------ output
def _kb(x) -> str:
    return "-" if x is None else f"{x / 1e3:,.1f}"


def _n(x, fmt="{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
    """A markdown table of the rows of one or more tiers, ratios against each tier's smallest N."""
    head = (
        "| tier | N | DHT KB/peer/round (sent + received) | DHT RPCs/peer/round | x N0 (KB, RPCs) | exchange KB/peer/round "
        "(relay / reencode, auto groups) | exchange RPCs (relay / auto groups, G) | busiest DHT node served/round | "
        "plan KB (fits 64 KiB) | overhead s | digests | "
        "DHT KB: full-view / light peer |"
    )
    out = [head, "|" + "---|" * 12]
    base: dict[str, dict] = {}
    for r in rows:
        b = base.setdefault(r["tier"], r)
        ratio = "-"
        if r.get("dht_bytes") and b.get("dht_bytes") and r.get("dht_rpcs") and b.get("dht_rpcs"):
            ratio = f"{r['dht_bytes'] / b['dht_bytes']:.1f}x, {r['dht_rpcs'] / b['dht_rpcs']:.1f}x"
        plan = "-"
        if r.get("plan_bytes"):
            plan = f"{r['plan_bytes'] / 1e3:.1f} ({'yes' if r['plan_fits'] else 'NO'})"
            if "plan_cpu_s" in r:
                plan += f", planned in {r['plan_cpu_s']:.2f} s"
        auto_b = auto_c = ""
        if "exchange_rpcs_auto" in r:
            auto_b = f" / {_kb(r['exchange_bytes_auto'])}"
            auto_c = f" / {_n(r['exchange_rpcs_auto'], '{:,.1f}')}, G={r['group_size_auto'] or '-'}"
        dig = "-"
        if "digests_equal" in r:
            dig = "equal" if r["digests_equal"] else f"{r['digests_per_round']} in a round"
            if not r["digests_equal"] and "rows_apart" in r:
                dig += f": {r['rows_behind']} rows behind, {r['rows_apart']} apart"
        out.append(
            f"| {r['tier']}{' S=' + str(r['record_shards']) if r.get('record_shards', 1) > 1 else ''}"
            f"{' R=' + str(r['read_reuse']) if r.get('read_reuse', READ_TARGET_REUSE) != READ_TARGET_REUSE else ''}"
            f"{' F=' + str(r['full_read_reuse']) if r.get('full_read_reuse', 1) > 1 else ''}"
            f"{' stable-parts' if r.get('stable_parts') else ''}"
            f" | {r['n']} | "
            f"{_kb(r.get('dht_bytes'))} | {_n(r.get('dht_rpcs'))} | {ratio} | "
            f"{_kb(r.get('exchange_bytes'))}{auto_b} | {_n(r.get('exchange_rpcs'))}{auto_c} | "
            f"{_n(r.get('busiest_served'))} | "
            f"{plan} | {_n(r.get('overhead_s'), '{:.1f}')} | {dig} | "
            f"{_kb(r.get('dht_bytes_full_peer'))} / {_kb(r.get('dht_bytes_light_peer'))} |"
        )
    return "\n".join(out)


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", default="sim,inproc", help="sim, inproc, proc (default: %(default)s)")
    ap.add_argument("--sim-n", default="8,16,32,64,128,256,1024", help="sim tier sizes (default: %(default)s)")
    ap.add_argument("--inproc-n", default="8,16,32,64,128", help="inproc tier sizes (default: %(default)s)")
    ap.add_argument("--proc-n", default="8,16", help="proc tier sizes; 32 is possible (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="inproc: measured rounds per size (default: %(default)s)")
    ap.add_argument("--proc-logs", default="", help="proc: keep the peers' logs under this folder (default: deleted)")
    ap.add_argument("--proc-rounds", type=int, default=5, help="proc: rounds per peer (default: %(default)s)")
    ap.add_argument("--proc-timeout-s", type=float, default=600, help="proc: seconds per size (default: %(default)s)")
    ap.add_argument(
        "--proc-args",
        default="",
        help="proc: more geomesh-peer join flags for every peer, one string, e.g. '--mode reencode --group-size 4'",
    )
    ap.add_argument("--reads", type=int, default=3, help="peers() reads per peer per round (default: %(default)s)")
    ap.add_argument("--round-s", type=float, default=8.0, help="round length the announces follow (default: 8)")
    ap.add_argument("--rpc-timeout-s", type=float, default=30.0, help="inproc: DHT RPC deadline (default: 30)")
    ap.add_argument(
        "--dht-model",
        choices=("rounds", "light", "after", "before"),
        default="rounds",
        help="sim: the DHT protocol modelled: 'before' is main at def8ba8 (a store's lookup read every record, a "
        "read asked all k holders), 'after' the same with every peer a full-view peer (session 9-13), 'light' "
        "light followers past --full-view-peers, records stored every 2 s on k nodes (sessions 14-15), 'rounds' "
        "the current one: light followers, a record stored once a round on 8 nodes through cached targets "
        "(session 16) (default: %(default)s)",
    )
    ap.add_argument(
        "--full-view-peers",
        type=int,
        default=FULL_VIEW,
        help="sim, inproc: peers that read every record; the others are light followers; 0: all (default: %(default)s)",
    )
    ap.add_argument(
        "--light-sample",
        type=int,
        default=SAMPLE,
        help="records a light follower reads per check (default: %(default)s)",
    )
    ap.add_argument(
        "--record-replicas",
        type=int,
        default=None,
        help=f"sim: nodes a peer record reaches (default: {PEER_RECORD_REPLICAS} for --dht-model rounds, k = {K} else)",
    )
    ap.add_argument(
        "--store-lookup-share",
        type=float,
        default=None,
        help=f"sim: share of announcements that look the key's nodes up (default: 1/{STORE_TARGET_REUSE} for "
        "--dht-model rounds, cached targets; 1.0 else)",
    )
    ap.add_argument(
        "--announces-per-round",
        type=float,
        default=None,
        help="sim, inproc: record stores per peer per round (default: 1 for the sim's 'rounds' model and inproc; "
        "--round-s / 2 s for the sim's older models)",
    )
    ap.add_argument(
        "--two-phase-reads", action="store_true", help="sim, what-if: full reads fetch an index, then each record once"
    )
    ap.add_argument(
        "--sampled-quorum",
        type=int,
        default=None,
        help=f"sim, inproc: holders a light follower's sampled read waits for (default: {SAMPLED_READ_QUORUM}, "
        f"joining.SAMPLED_READ_QUORUM, for --dht-model rounds; {READ_QUORUM} else: the rule before session 18)",
    )
    ap.add_argument(
        "--record-shards",
        default="1",
        help="sim ('rounds' model), inproc: the run's record_shards, a comma list measured side by side, e.g. 1,16 "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--read-reuse",
        default=str(READ_TARGET_REUSE),
        help="sim ('rounds' model), inproc: reads of a key a light follower's sampled read makes from the holders its "
        "last lookup found (DHTNode's read_target_reuse; 1: a lookup every read, the rule before session 22), a comma "
        "list measured side by side, e.g. 1,8 (default: %(default)s)",
    )
    ap.add_argument(
        "--full-read-reuse",
        type=int,
        default=None,
        help=f"sim: full reads of a sharded run (S > 1) per lookup of a key (default: {FULL_READ_TARGET_REUSE}, "
        "DHTNode's full_read_reuse, when S > 1; 1 at S = 1; 1 is the rule before session 26)",
    )
    ap.add_argument(
        "--plan-parts",
        choices=("auto", "stable", "legacy"),
        default="auto",
        help="sim: a chunked plan's chunk keys: 'stable' (read from a cached holder, session 26), 'legacy' (a lookup "
        "per chunk, the rule before), 'auto' (stable when S > 1, as PlanStore in a peer) (default: %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="sim tier + inproc at 8, 16, one round (< 1 min)")
    ap.add_argument("--json", default=None, help="also write every row here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tiers, args.inproc_n, args.rounds = "sim,inproc", "8,16", 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = set(tiers) - {"sim", "inproc", "proc"}
    if unknown:
        ap.error(f"unknown tier(s) {sorted(unknown)}")
    rows: list[dict] = []
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; reads {args.reads}, round {args.round_s} s")
    shard_counts = _sizes(args.record_shards)
    reuses = _sizes(args.read_reuse)
    if "sim" in tiers:
        for n, shards, reuse in ((n, x, y) for n in _sizes(args.sim_n) for x in shard_counts for y in reuses):
            built = args.dht_model == "rounds"
            what_if = WhatIf(
                args.record_replicas if args.record_replicas is not None else (PEER_RECORD_REPLICAS if built else K),
                args.store_lookup_share
                if args.store_lookup_share is not None
                else (1.0 / STORE_TARGET_REUSE if built else 1.0),
                args.two_phase_reads,
                args.sampled_quorum
                if args.sampled_quorum is not None
                else (SAMPLED_READ_QUORUM if built else READ_QUORUM),
                shards,
                reuse if built else 1,
                (args.full_read_reuse or FULL_READ_TARGET_REUSE) if built and shards > 1 else 1,
                built and (args.plan_parts == "stable" or (args.plan_parts == "auto" and shards > 1)),
            )
            rows.append(
                sim_row(
                    n,
                    args.reads,
                    args.round_s,
                    args.dht_model,
                    args.full_view_peers,
                    args.light_sample,
                    what_if,
                    args.announces_per_round,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    if "inproc" in tiers:
        for n, shards, reuse in ((n, x, y) for n in _sizes(args.inproc_n) for x in shard_counts for y in reuses):
            rows.append(
                asyncio.run(
                    inproc_row(
                        n,
                        args.rounds,
                        args.reads,
                        args.round_s,
                        args.rpc_timeout_s,
                        args.full_view_peers,
                        args.light_sample,
                        int(args.announces_per_round or ANNOUNCES_PER_ROUND),
                        args.sampled_quorum or SAMPLED_READ_QUORUM,
                        shards,
                        reuse,
                    )
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    if "proc" in tiers:
        for n in _sizes(args.proc_n):
            if args.proc_logs:  # kept: the peers' logs and rows, to read what happened
                d = Path(args.proc_logs) / f"scale{n}"
                d.mkdir(parents=True, exist_ok=True)
                rows.append(proc_row(n, args.proc_rounds, d, args.proc_timeout_s, shlex.split(args.proc_args)))
            else:
                with tempfile.TemporaryDirectory(prefix=f"scale{n}-") as t:
                    rows.append(
                        proc_row(n, args.proc_rounds, Path(t), args.proc_timeout_s, shlex.split(args.proc_args))
                    )
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
