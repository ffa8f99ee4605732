"""The collective vs hivemind's all-reduce, side by side: wall time and CPU-seconds per peer.

    python benchmarks/collective_vs_hivemind.py [--peers 2 4] [--numel 25000000] [--repeats 3] [--quick]
                                                [--contenders fp32 sign hm_fp32 hm_fp16] [--json out.json]

For each group size N, N worker processes run on 127.0.0.1; each hosts both contenders at once (our
Transport + CollectiveService on one asyncio loop, and a hivemind ``DHT`` + two
``DecentralizedAverager``s over one shared p2pd daemon), so the contenders run on the same processes
and are interleaved round by round (ours fp32, ours sign, hivemind fp32, hivemind fp16, then again),
``--repeats`` times; the table gives medians.

* ``fp32``    our plain fp32 butterfly: ``mode="reencode"``, fp32 pushes, fp32 aggregate (what the
              ``diloco`` / ``ddp`` baselines use).
* ``sign``    our reencode-sign exchange (sign pushes, the owners' mean sign-encoded).
* ``hm_fp32`` hivemind 1.1's ``DecentralizedAverager`` all-reduce, ``NoCompression``.
* ``hm_fp16`` the same with ``Float16Compression``.

Wall time = from a common start to the last peer's result. Hivemind's matchmaking is left out (its
step is held with ``require_trigger=True`` until every peer is in the group, then all are triggered at
the common start), as ours gets its plan from the leader beforehand. CPU-s per peer = user + system
CPU seconds of the worker's whole process tree (worker, hivemind's averager and DHT processes, p2pd)
over the round, from ``/proc``; mean over peers. Ratios are ours / hivemind (fp32 vs hm_fp32; sign
vs hm_fp16); goals (issue 17): fp32 <= 1.0x, sign <= 0.5x.

Parts: by default ours are cut as the node cuts them (``split_owners(max_part_elements(...))``: about
2 MiB messages, so that the stages of the exchange overlap across parts); ``--max-part-mb 0`` gives one
part per owner (the code before issue 17 had nothing else), ``--max-part-mb X`` parts of X fp32 MB.
``--reads-per-ip``: our transport reads one large request at a time per remote IP (a flood
defence); on loopback every peer is 127.0.0.1, so by default the benchmark gives it one slot per
peer of the group, as distinct hosts would have (1 = a real node's default, serializing pushes here).

``--quick``: 2 peers, 2M elements, 1 repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tests.jsonl_util import JsonLineProc, commands, exit_workers, kill_workers  # noqa: E402

RUN = "bench-vs-hivemind"
OURS = {"fp32": ("reencode", "fp32", "fp32"), "sign": ("reencode", "sign", "sign")}
CONTENDERS = ["fp32", "sign", "hm_fp32", "hm_fp16"]
_CLK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and its live descendants (from /proc/<pid>/stat)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(ticks.get(p, 0) for p in tree) / _CLK


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------- worker


async def _worker(seed: int, numel: int, n: int, initial_peers: list[str], reads_per_ip: int) -> int:
    import torch
    from hivemind import DHT, DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression, NoCompression

    from geomesh_p2p.exchange import CollectiveService, CollectiveSpec
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    torch.set_num_threads(1)
    ident = Identity.generate()
    # On loopback every peer calls from 127.0.0.1: the transport's per-IP read cap (one large request
    # read at a time per remote IP, a flood defence) would serialize the pushes of all peers, which a
    # swarm of distinct hosts does not; --reads-per-ip 0 gives it one slot per peer of the group.
    transport = Transport(ident, RUN, TransportConfig(default_timeout_s=600.0, max_reads_per_ip=reads_per_ip or n))
    service = CollectiveService(transport, long_poll_s=30.0)
    address = await transport.start()
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averagers = {
        name: DecentralizedAverager(
            [delta.clone()],
            dht,
            prefix=f"bench_{name}",
            target_group_size=n,
            min_group_size=n,
            min_matchmaking_time=3.0,
            request_timeout=2.0,
            compression=comp,
            start=True,
        )
        for name, comp in (("hm_fp32", NoCompression()), ("hm_fp16", Float16Compression()))
    }
    pending = None
    _emit(
        {
            "event": "ready",
            "peer_id": ident.peer_id.to_string(),
            "address": address,
            "maddrs": [str(a) for a in dht.get_visible_maddrs()],
        }
    )
    try:
        async for cmd in commands():
            if cmd["cmd"] == "hm_match":  # form the group now; the all-reduce waits for the trigger
                avg = averagers[cmd["name"]]
                pending = avg.step(wait=False, require_trigger=True, timeout=300.0)
                while pending.stage != AveragingStage.AWAITING_TRIGGER:
                    if pending.done():
                        pending.result()  # raises the matchmaking error
                        raise RuntimeError("hivemind step ended before the trigger")
                    await asyncio.sleep(0.02)  # a benchmark's poll of hivemind's shared stage flag
                _emit({"event": "matched"})
                continue
            await asyncio.sleep(max(0.0, cmd["start_at"] - time.time()))
            cpu0 = _tree_cpu_s(os.getpid())
            if cmd["cmd"] == "hm_go":
                pending.allow_allreduce()
                await asyncio.to_thread(pending.result)
                pending = None
                complete = True
            else:
                spec = CollectiveSpec.from_dict(cmd["spec"])
                res = await service.all_reduce(spec, delta, cmd["tokens"])
                complete = not res.missing_parts and all(res.pushed.values())
            finished = time.time()
            _emit(
                {
                    "event": "done",
                    "finished_at": finished,
                    "cpu_s": _tree_cpu_s(os.getpid()) - cpu0,
                    "complete": complete,
                }
            )
    finally:
        for avg in averagers.values():
            avg.shutdown()
        dht.shutdown()
        await service.close()
        await transport.stop(grace=1.0)
    return 0


# ------------------------------------------------------------------------------------- parent


async def _spawn(k: int, n: int, numel: int, initial: list[str], reads_per_ip: int) -> JsonLineProc:

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GRPC_VERBOSITY="ERROR")
    return await JsonLineProc.start(
        os.path.abspath(__file__),
        *("--worker", "--seed", str(1000 + k), "--numel", str(numel), "--group", str(n)),
        *("--initial", json.dumps(initial), "--reads-per-ip", str(reads_per_ip)),
        env=env,
        timeout=900.0,
    )


async def run_group(
    n: int,
    numel: int,
    repeats: int,
    contenders: list[str],
    block_size: int,
    reads_per_ip: int,
    max_part_mb: Optional[float] = None,
) -> dict:
    """Medians of wall s and CPU-s per peer for each contender, ``n`` peers."""
    from geomesh_p2p.exchange import CollectiveSpec, make_partition, max_part_elements, split_owners
    from geomesh_p2p.net.transport_config import TransportConfig

    procs: list[JsonLineProc] = []
    try:
        procs.append(await _spawn(0, n, numel, [], reads_per_ip))
        first = await procs[0].read()
        for k in range(1, n):
            procs.append(await _spawn(k, n, numel, first["maddrs"], reads_per_ip))
        ready = [first] + [await p.read() for p in procs[1:]]
        pids = [r["peer_id"] for r in ready]
        owners = make_partition(numel, [(r["peer_id"], r["address"], 1.0) for r in ready], block_size=block_size)
        if max_part_mb is None:  # what the node does (round/policy.py): parts cut by max_part_elements
            rows0 = {}
            for c in contenders:
                if c in OURS:
                    mode, push, agg = OURS[c]
                    rows0[c] = split_owners(
                        owners,
                        max_part_elements(
                            push_encoding=push,
                            mode=mode,
                            aggregate_encoding=agg,
                            n_participants=n,
                            block_size=block_size,
                            max_message_bytes=TransportConfig().max_message_bytes,
                        ),
                    )
            owners_of = rows0
        elif max_part_mb > 0:  # several parts per owner: their pushes, reductions and pulls overlap
            owners = split_owners(owners, max(block_size, int(max_part_mb * 2**20 / 4) // block_size * block_size))
            owners_of = {c: owners for c in OURS}
        else:
            owners_of = {c: owners for c in OURS}
        rows: dict[str, dict[str, list]] = {c: {"wall_s": [], "cpu_s": [], "complete": []} for c in contenders}
        rnd = 0
        for rep in range(repeats):
            for c in contenders:
                if c.startswith("hm_"):
                    for p in procs:
                        p.send({"cmd": "hm_match", "name": c})
                    for p in procs:
                        await p.read()
                    start_at = time.time() + 0.5
                    for p in procs:
                        p.send({"cmd": "hm_go", "start_at": start_at})
                else:
                    rnd += 1
                    mode, push, agg = OURS[c]
                    start_at = time.time() + 0.5
                    spec = CollectiveSpec(
                        RUN,
                        rnd,
                        {p: 10**9 for p in pids},
                        owners_of[c],
                        numel,
                        start_at + 300.0,
                        start_at + 330.0,
                        mode=mode,
                        push_encoding=push,
                        aggregate_encoding=agg,
                        block_size=block_size,
                    )
                    for k, p in enumerate(procs):
                        p.send({"cmd": "round", "spec": spec.to_dict(), "tokens": 1000 * (k + 1), "start_at": start_at})
                done = [await p.read() for p in procs]
                rows[c]["wall_s"].append(max(d["finished_at"] for d in done) - start_at)
                rows[c]["cpu_s"].append(statistics.mean(d["cpu_s"] for d in done))
                rows[c]["complete"].append(all(d["complete"] for d in done))
                print(
                    f"# {n} peers, repeat {rep + 1}, {c}: {rows[c]['wall_s'][-1]:.2f} s wall, "
                    f"{rows[c]['cpu_s'][-1]:.2f} CPU-s/peer",
                    file=sys.stderr,
                    flush=True,
                )
        await exit_workers(procs)
        return rows
    finally:
        await kill_workers(procs)


def table(results: dict, numel: int) -> str:
    def med(row, key):
        return statistics.median(row[key]) if row[key] else float("nan")

    lines = [
        f"numel = {numel:,} fp32 elements ({4 * numel / 1e6:.0f} MB); medians; CPU-s = per peer, whole process tree",
        "",
        "| peers | ours | wall s | CPU-s | hivemind | wall s | CPU-s | wall ratio (ours/hm) | CPU ratio | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, rows in results.items():
        for ours, hm, goal in (("fp32", "hm_fp32", 1.0), ("sign", "hm_fp16", 0.5)):
            if ours not in rows or hm not in rows:
                continue
            a, b = rows[ours], rows[hm]
            ratio = med(a, "wall_s") / med(b, "wall_s")
            ok = all(a["complete"]) and all(b["complete"])
            lines.append(
                f"| {n} | {ours} | {med(a, 'wall_s'):.2f} | {med(a, 'cpu_s'):.2f} | {hm} | "
                f"{med(b, 'wall_s'):.2f} | {med(b, 'cpu_s'):.2f} | {ratio:.2f}x | "
                f"{med(a, 'cpu_s') / med(b, 'cpu_s'):.2f}x | <= {goal}x: "
                f"{'met' if ratio <= goal else 'NOT met'} |" + ("" if ok else " INCOMPLETE")
            )
    return "\n".join(lines)


async def main_async(ns) -> int:
    results = {}
    load0 = os.getloadavg()[0]
    for n in ns.peers:
        results[n] = await run_group(
            n, ns.numel, ns.repeats, ns.contenders, ns.block_size, ns.reads_per_ip, ns.max_part_mb
        )
    import torch

    head = (
        f"command: python benchmarks/collective_vs_hivemind.py {' '.join(sys.argv[1:])}\n"
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, torch "
        f"{torch.__version__}; 1-min load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end\n"
    )
    print(head + "\n" + table(results, ns.numel))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({str(n): rows for n, rows in results.items()}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    ap.add_argument("--quick", action="store_true", help="2 peers, 2M elements, 1 repeat")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--max-part-mb",
        type=float,
        default=None,
        help="cut every owner's range into parts of at most this many fp32 MB (split_owners; 0: one "
        "part per owner; default: as the node does, max_part_elements)",
    )
    ap.add_argument(
        "--reads-per-ip",
        type=int,
        default=0,
        help="our transport's max_reads_per_ip (0: the group size, as distinct hosts would get; "
        "1: the default of a real node, which serializes loopback pushes)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--initial", default="[]", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.worker:
        return asyncio.run(_worker(ns.seed, ns.numel, ns.group, json.loads(ns.initial), ns.reads_per_ip))
    if ns.quick:
        ns.peers, ns.numel, ns.repeats = [2], 2_000_000, 1
    return asyncio.run(main_async(ns))


if __name__ == "__main__":
    sys.exit(main())
