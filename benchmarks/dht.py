"""DHT benchmark: our Kademlia over gRPC vs hivemind's DHT over libp2p, side by side in one run.

1. Loopback, two processes: a server node in a child process, a client node in this process; store
   and get latency (get with latest=True) of our DHT and of hivemind's (``hivemind.DHT`` server in
   its own process + a ``hivemind.dht.DHTNode`` client here; each spawns a p2pd daemon, which is
   fine in a benchmark and never happens in the product). Blocks of operations alternate between
   the two systems so that machine load hits both alike; the figure that matters is the ratio
   ours / hivemind of the medians.
2. Lookups in a swarm of 64 and 256 in-process nodes of our DHT (k=20, alpha=3): hops (longest chain
   of find calls learnt from one another; 1 = answered by a node already in the routing table),
   find RPCs per lookup, and latency. All nodes share one process and event loop, so latency here
   includes CPU contention between nodes: read it as an upper bound, the hops and RPCs as the result.

Usage: python benchmarks/dht.py [--ops 60] [--blocks 4] [--sizes 64,256] [--lookups 100]
       [--json results.json] [--no-hivemind] [--no-swarm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no gRPC C-core info lines on every closed connection

RUN = "dht-bench"


def _q(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(xs):
    return {
        "median": _q(xs, 0.5),
        "p90": _q(xs, 0.9),
        "max": max(xs, default=float("nan")),
        "mean": statistics.fmean(xs) if xs else float("nan"),
        "n": len(xs),
    }


# ------------------------------------------------------------------------------------------ part 1
def start_our_server() -> tuple[subprocess.Popen, str]:
    """Our DHT node in a child process (python -m geomesh_p2p.dht --watch); returns (process, address)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "geomesh_p2p.dht", "--run-id", RUN, "--watch", "--period", "3600"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    if not line:
        raise RuntimeError("our DHT server process did not start")
    return p, json.loads(line)["address"]


async def loopback(args, our_address: str, hivemind_maddrs) -> dict:
    from geomesh_p2p.dht import DHTNode
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    value = os.urandom(args.value_bytes)
    transport = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    ours = DHTNode(transport, refresh_period_s=3600, republish_period_s=3600)
    await transport.start()
    await ours.join([our_address])

    hm = None
    if hivemind_maddrs:
        from hivemind.dht.node import DHTNode as HivemindNode

        hm = await HivemindNode.create(initial_peers=hivemind_maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def ours_store(key):
        assert await ours.store(key, value, time.time() + 300)

    async def ours_get(key):
        assert (await ours.get(key, latest=True))[None].value == value

    async def hm_store(key):
        assert await hm.store(key, value, time.time() + 300)

    async def hm_get(key):
        assert (await hm.get(key, latest=True)).value == value

    systems = {"ours": (ours_store, ours_get)}
    if hm is not None:
        systems["hivemind"] = (hm_store, hm_get)
    lat = {name: {"store": [], "get": []} for name in systems}
    for name, (st, gt) in systems.items():  # warm-up: connections, caches, JIT-free but still
        for i in range(5):
            await st(f"warm/{name}/{i}")
            await gt(f"warm/{name}/{i}")
    for block in range(args.blocks):
        order = list(systems.items())
        if block % 2:
            order.reverse()
        for name, (st, gt) in order:
            keys = [f"bench/{name}/{block}/{i}" for i in range(args.ops)]
            for key in keys:
                t = time.perf_counter()
                await st(key)
                lat[name]["store"].append((time.perf_counter() - t) * 1000)
            for key in keys:
                t = time.perf_counter()
                await gt(key)
                lat[name]["get"].append((time.perf_counter() - t) * 1000)
    out = {name: {op: _summary(v) for op, v in ops.items()} for name, ops in lat.items()}
    if "hivemind" in out:
        out["ratio_ours_over_hivemind"] = {
            op: out["ours"][op]["median"] / out["hivemind"][op]["median"] for op in ("store", "get")
        }
    await ours.shutdown()
    await transport.stop(grace=0)
    if hm is not None:
        await hm.shutdown()
    return out


# ------------------------------------------------------------------------------------------ part 2
async def swarm(n: int, args) -> dict:
    from hivemind.dht.routing import DHTID

    from geomesh_p2p.dht import DHTNode, LookupStats
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    rnd = random.Random(n)
    nodes = []
    t0 = time.perf_counter()
    for i in range(n):
        t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0, default_timeout_s=10))
        node = DHTNode(t, rpc_timeout_s=10.0, refresh_period_s=3600, republish_period_s=3600)
        await t.start()
        await node.join([rnd.choice(nodes).address] if nodes else [])
        nodes.append(node)
    build_s = time.perf_counter() - t0
    keys = [f"swarm/{i}" for i in range(args.keys)]
    for key in keys:
        assert await rnd.choice(nodes).store(key, b"v:" + key.encode(), time.time() + 600)
    res = {"nodes": n, "build_s": build_s, "table_size": _summary([len(x.contacts()) for x in nodes])}
    found_hop, rpcs_any, ms_any, rpcs_latest, ms_latest, hops_node, rpcs_node = [], [], [], [], [], [], []
    misses = 0
    for _ in range(args.lookups):
        node, key = rnd.choice(nodes), rnd.choice(keys)
        s = LookupStats()
        t = time.perf_counter()
        got = await node.get(key, latest=False, stats=s)
        ms_any.append((time.perf_counter() - t) * 1000)
        misses += None not in got
        if s.found_hop is not None:
            found_hop.append(s.found_hop)
        rpcs_any.append(s.rpcs)
        s = LookupStats()
        t = time.perf_counter()
        got = await node.get(key, latest=True, stats=s)
        ms_latest.append((time.perf_counter() - t) * 1000)
        misses += None not in got
        rpcs_latest.append(s.rpcs)
        s = LookupStats()
        await node.find_nearest_nodes([DHTID.generate()], stats=s)
        hops_node.append(s.hops)
        rpcs_node.append(s.rpcs)
    res.update(
        {
            "get_first_value": {
                "found_at_hop": _summary(found_hop),
                "rpcs": _summary(rpcs_any),
                "ms": _summary(ms_any),
            },
            "get_latest": {"rpcs": _summary(rpcs_latest), "ms": _summary(ms_latest)},
            "find_k_nearest": {"hops": _summary(hops_node), "rpcs": _summary(rpcs_node)},
            "misses": misses,
        }
    )
    await asyncio.gather(*(x.shutdown() for x in nodes))
    await asyncio.gather(*(x.transport.stop(grace=0) for x in nodes))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=60, help="stores and gets per system per block (default: %(default)s)")
    ap.add_argument("--blocks", type=int, default=4, help="alternating blocks (default: %(default)s)")
    ap.add_argument("--value-bytes", type=int, default=256, help="value size, bytes (default: %(default)s)")
    ap.add_argument("--sizes", default="64,256", help="in-process swarm sizes (default: %(default)s)")
    ap.add_argument("--keys", type=int, default=32, help="values stored in each swarm (default: %(default)s)")
    ap.add_argument("--lookups", type=int, default=100, help="lookups per swarm size (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the results here (default: none)")
    ap.add_argument("--no-hivemind", action="store_true", help="skip hivemind's DHT (default: run it)")
    ap.add_argument("--no-swarm", action="store_true", help="skip the in-process swarms (default: run them)")
    args = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    results = {"machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0]}}

    # hivemind's server first: hivemind.DHT forks, which must happen before this process uses gRPC
    hm_server = None
    maddrs = None
    if not args.no_hivemind:
        import hivemind

        hm_server = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in hm_server.get_visible_maddrs()]
    proc, address = start_our_server()
    try:
        results["loopback"] = asyncio.run(loopback(args, address, maddrs))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        if hm_server is not None:
            hm_server.shutdown()
    lb = results["loopback"]
    print(f"loopback, two processes, {args.value_bytes}-byte values, {args.blocks}x{args.ops} ops each (ms):")
    for name in ("ours", "hivemind"):
        if name in lb:
            s, g = lb[name]["store"], lb[name]["get"]
            print(
                f"  {name:9s} store median {s['median']:7.2f} p90 {s['p90']:7.2f} | "
                f"get median {g['median']:7.2f} p90 {g['p90']:7.2f}"
            )
    if "ratio_ours_over_hivemind" in lb:
        r = lb["ratio_ours_over_hivemind"]
        print(f"  ratio ours/hivemind (median): store {r['store']:.2f}, get {r['get']:.2f}")

    if not args.no_swarm:
        results["swarm"] = []
        for n in [int(x) for x in args.sizes.split(",") if x]:
            r = asyncio.run(swarm(n, args))
            results["swarm"].append(r)
            g, gl, f = r["get_first_value"], r["get_latest"], r["find_k_nearest"]
            print(
                f"swarm of {n} in-process nodes (built in {r['build_s']:.0f}s, routing table median "
                f"{r['table_size']['median']:.0f} nodes), {args.lookups} lookups:"
            )
            print(
                f"  get (first value): found at hop median {g['found_at_hop']['median']:.0f} "
                f"p90 {g['found_at_hop']['p90']:.0f}, rpcs median {g['rpcs']['median']:.0f}, "
                f"ms median {g['ms']['median']:.1f} p90 {g['ms']['p90']:.1f}"
            )
            print(
                f"  get (latest):      rpcs median {gl['rpcs']['median']:.0f}, ms median {gl['ms']['median']:.1f} "
                f"p90 {gl['ms']['p90']:.1f}"
            )
            print(
                f"  find k nearest:    hops median {f['hops']['median']:.0f} p90 {f['hops']['p90']:.0f} "
                f"max {f['hops']['max']:.0f}, rpcs median {f['rpcs']['median']:.0f}; misses {r['misses']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
