"""DHT requests and bytes per peer per round, measured in-process (issue 25): N real PeerNodes (tiny model,
the real DHT, plans, collective and trainer) and one bootstrap DHT node on 127.0.0.1 train ``--rounds``
rounds; each peer's outgoing calls (per RPC method), the bytes its transport moved (sent + received,
client and server side, per method) and its full reads of ``<run>/peers`` are snapshotted at each of its
round rows. The figures are the mean over peers and over rounds 1.. (round 0 includes the start-up).

    PYTHONPATH=$PWD python scripts/membership_traffic.py --peers 3 --rounds 5

One JSON line on stdout. Runs a minute or two on 2 cores. Counting wraps ``Transport.call`` and
``DHTNode.get`` (no library support needed, so the same script measures older trees too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM  # noqa: F401  (resolved once here: lazy imports race in threads)

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport, TransportConfig
from geomesh_p2p.node.peer import PeerNode

DHT_METHODS = ("/geomesh.wire.Dht/Ping", "/geomesh.wire.Dht/Store", "/geomesh.wire.Dht/Find")


class Counts:
    """Outgoing calls per (transport, method) and full peer-record reads per DHT node."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()  # (id(transport), method) -> calls
        self.reads: Counter = Counter()  # id(dht) -> gets of <run>/peers
        self.ops: Counter = Counter()  # (id(dht), "get" | "store", key kind: peers, plan, ...) -> calls

    def install(self) -> None:
        real_call, real_get, real_store = Transport.call, DHTNode.get, DHTNode.store
        counts = self

        async def call(self, address, method, *a, **kw):
            counts.calls[(id(self), method)] += 1
            return await real_call(self, address, method, *a, **kw)

        async def get(self, key, *a, **kw):
            if key.endswith("/peers"):
                counts.reads[id(self)] += 1
            counts.ops[(id(self), "get", _kind(key))] += 1
            return await real_get(self, key, *a, **kw)

        async def store(self, key, *a, **kw):
            counts.ops[(id(self), "store", _kind(key))] += 1
            return await real_store(self, key, *a, **kw)

        Transport.call, DHTNode.get, DHTNode.store = call, get, store  # type: ignore[method-assign]


def _kind(key: str) -> str:
    """``<run>/plan/7`` -> ``plan``: what a DHT key holds."""
    parts = key.split("/")
    return parts[1] if len(parts) > 1 else parts[0]


def snapshot(node: PeerNode, counts: Counts) -> dict:
    t = node.transport
    dht_bytes = sum(sum(t.stats.by_method.get(m, (0, 0))) for m in DHT_METHODS)
    all_bytes = t.stats.bytes_sent + t.stats.bytes_received
    dht_calls = sum(counts.calls[(id(t), m)] for m in DHT_METHODS)
    all_calls = sum(v for (tid, _), v in counts.calls.items() if tid == id(t))
    ops = {f"{op}:{kind}": v for (did, op, kind), v in counts.ops.items() if did == id(node.dht)}
    return {
        **ops,
        "dht_calls": dht_calls,
        "find_calls": counts.calls[(id(t), DHT_METHODS[2])],
        "store_calls": counts.calls[(id(t), DHT_METHODS[1])],
        "other_calls": all_calls - dht_calls,
        "dht_bytes": dht_bytes,
        "other_bytes": all_bytes - dht_bytes,
        "peer_reads": counts.reads[id(node.dht)],
    }


class Rows(list):
    """A round history that calls ``on_row(row)`` for each row appended."""

    def __init__(self, on_row) -> None:
        super().__init__()
        self.on_row = on_row

    def append(self, row) -> None:
        super().append(row)
        self.on_row(row)


def _locked(lock: threading.Lock, fn) -> None:
    with lock:
        fn()


async def main(args) -> dict:
    counts = Counts()
    counts.install()
    run_id = "membership-traffic"
    boot = Transport(Identity.generate(), run_id, TransportConfig(host="127.0.0.1", port=0))
    dht = DHTNode(boot, rpc_timeout_s=2.0)
    address = await boot.start()
    await dht.join([])
    run_cfg = RunConfig(run_id=run_id, seq_len=32, window_s=args.window, target_batch=4, pow_bits=0)
    tmp = Path(tempfile.mkdtemp(prefix="membership-traffic-"))
    nodes = [
        PeerNode(
            run_cfg,
            NodeConfig(
                bootstrap=[address],
                identity=str(tmp / f"p{k}.key"),
                threads=1,
                rounds=args.rounds,
                min_peers=args.peers,
                wait_peers_s=120.0,
                profile_batches=[4],
                probe_bytes=64 << 10,
                eval_batches=2,
            ),
            identity=Identity.generate(),
        )
        for k in range(args.peers)
    ]
    build_lock = threading.Lock()
    for n in nodes:  # one build at a time: the start-up threads share torch's global RNG (the seed's weights)
        n._build_training = (lambda real: lambda: _locked(build_lock, real))(n._build_training)
    rows: dict = {id(n): [] for n in nodes}  # node -> [(round, snapshot at its row)]
    for n in nodes:  # a snapshot as each round's row is appended (finish.py), before the next round starts
        n.rs.history = Rows(lambda rec, n=n: rows[id(n)].append((rec.round, snapshot(n, counts))))
    t0 = time.monotonic()
    try:
        codes = await asyncio.gather(*(n.run() for n in nodes))
    finally:
        await dht.shutdown()
        await boot.stop(grace=0)
    per_round: list[dict] = []
    for n in nodes:
        seen = rows[id(n)]
        for (_, a), (_, b) in zip(seen, seen[1:]):
            per_round.append({k: b[k] - a.get(k, 0) for k in b})
    digests = {r: {row.digest for n in nodes for row in n.history if row.round == r} for r in range(args.rounds)}
    # Seconds of the phases that poll the records (rounds 1..): a reused read may see a change later.
    phases = [row.phase_s for n in nodes for row in n.history[1:]]
    phase_mean = {
        k: round(sum(p.get(k, 0.0) for p in phases) / max(1, len(phases)), 3)
        for k in ("top", "gather", "plan", "digest_check")
    }
    cycles = [row.cycle_s or 0.0 for n in nodes for row in n.history[1:]]
    phase_mean["cycle"] = round(sum(cycles) / max(1, len(cycles)), 3)
    keys = sorted({k for d in per_round for k in d})
    mean = {k: round(sum(d.get(k, 0) for d in per_round) / max(1, len(per_round)), 1) for k in keys}
    return {
        "peers": args.peers,
        "rounds": args.rounds,
        "window_s": args.window,
        "exit_codes": codes,
        "digests_equal": all(len(d) == 1 for d in digests.values()),
        "rounds_measured_per_peer": len(per_round) // max(1, args.peers),
        "per_peer_per_round": mean,
        "phase_s": phase_mean,
        "wall_s": round(time.monotonic() - t0, 1),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=float, default=3.0, help="sync window, seconds")
    ns = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(asyncio.run(main(ns))))
