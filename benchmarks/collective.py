"""Collective bytes and wall time: relay vs reencode (sign) vs an fp32 butterfly, side by side.

    python benchmarks/collective.py [--peers 4 8] [--numel 25000000] [--block-size 2048]
                                    [--markdown docs/collective-benchmark.md]

For each group size N, N peers run as separate OS processes on 127.0.0.1 (each its own Identity,
Transport and CollectiveService; equal parts via ``make_partition``), and run three rounds over the
same transport in one run, in this order:

* ``relay``     sign pushes; owners forward the signed contributions; every peer averages.
* ``reencode``  sign pushes; owners average and send the mean sign-encoded.
* ``fp32``      fp32 pushes; owners average and send the fp32 mean (a butterfly all-reduce:
                hivemind's reduce-scatter + all-gather pattern, over our gRPC transport).

Per peer: serialized SignedMessage bytes of all PushPart/PullPart traffic (client and server side,
requests and replies, counted by the transport) of that round; wall time = from the common start
to the last peer's result. Ratios are fp32 bytes / mode bytes (goal for reencode sign: >= 30x).
"identical" = every peer's aggregate has the same SHA-256. "rel. err" = ||agg - fp32 mean|| /
||fp32 mean|| on the Gaussian test vectors (independent per peer: a worst case for sign
compression, not a convergence figure).

Exchange memory (issue 13):

    python benchmarks/collective.py --memory [--peers 3] [--numel 25000000] [--modes fp32 relay]

runs one all-reduce of every mode with ``--peers`` services in ONE fresh child process each (the
peers' deltas allocated first) and prints the peak extra resident memory the exchange needed
(``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the exchange minus before it; tracemalloc
does not see torch's allocations), per peer, in MB and in full fp32 vectors (``4 * numel`` bytes),
and its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tests.jsonl_util import JsonLineProc, commands, exit_workers, kill_workers  # noqa: E402

RUN = "bench-collective"
MODES = [  # (name, mode, push_encoding, aggregate_encoding)
    ("relay", "relay", "sign", "sign"),
    # relay as before 0.5.1: every result sent whole, the reader's own contribution included (CollectiveService.omit_own)
    ("relay-whole", "relay", "sign", "sign"),
    ("reencode", "reencode", "sign", "sign"),
    ("accountable", "accountable", "sign", "sign"),
    ("fp32", "reencode", "fp32", "fp32"),
]
LABELS = {
    "relay": "relay (sign)",
    "relay-whole": "relay, own entry sent back (before)",
    "reencode": "reencode (sign)",
    "accountable": "accountable (sign, V=1)",
    "fp32": "fp32 butterfly",
}


# ------------------------------------------------------------------------------------- worker


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _worker(seed: int, numel: int) -> int:
    from geomesh_p2p.exchange import CollectiveService, CollectiveSpec
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig
    from geomesh_p2p.net.methods import COLLECTIVE_INPUTS, COLLECTIVE_PULL, COLLECTIVE_PUSH

    torch.set_num_threads(1)
    ident = Identity.generate()
    transport = Transport(ident, RUN, TransportConfig(default_timeout_s=600.0))
    service = CollectiveService(transport, long_poll_s=30.0)
    address = await transport.start()
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    def stats():
        by = transport.stats.by_method
        a, b, c = (by.get(m, (0, 0)) for m in (COLLECTIVE_PUSH, COLLECTIVE_PULL, COLLECTIVE_INPUTS))
        return [a[0] + b[0] + c[0], a[1] + b[1] + c[1]]

    _emit({"event": "ready", "peer_id": ident.peer_id.to_string(), "address": address})
    try:
        async for cmd in commands():
            if cmd["cmd"] == "stats":
                _emit({"event": "stats", "bytes": stats()})
                continue
            spec = CollectiveSpec.from_dict(cmd["spec"])
            service.omit_own = bool(cmd.get("omit_own", True))
            before = stats()
            await asyncio.sleep(max(0.0, cmd["start_at"] - time.time()))
            res = await service.all_reduce(spec, delta, cmd["tokens"])
            finished = time.time()
            # accountable: the validation of the parts this peer is drawn for (its bytes count in the round's)
            findings = await service.validate_round(spec.round, timeout_s=300.0) if spec.mode == "accountable" else []
            if cmd.get("out"):
                res.aggregate.numpy().astype("<f4").tofile(cmd["out"])
            complete = all(res.pushed.values()) and all(
                len(c) == len(spec.participants) for c in res.contributors.values()
            )
            _emit(
                {
                    "event": "done",
                    "finished_at": finished,
                    "before": before,
                    "missing": res.missing_parts,
                    "complete": complete,
                    "sha256": hashlib.sha256(res.aggregate.numpy().tobytes()).hexdigest(),
                    "findings": len(findings),
                }
            )
    finally:
        await service.close()
        await transport.stop(grace=1.0)
    return 0


# ------------------------------------------------------------------------------------- parent


async def run_group(
    n: int, numel: int, block_size: int, tmp: str, deadline_s: float, modes=tuple(m[0] for m in MODES)
) -> dict:
    from geomesh_p2p.exchange import CollectiveSpec, make_partition

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = []
    try:
        for k in range(n):
            w = await JsonLineProc.start(
                os.path.abspath(__file__),
                "--worker",
                "--seed",
                str(1000 + k),
                "--numel",
                str(numel),
                env=env,
                timeout=900.0,
            )
            procs.append(w)
        ready = [await p.read() for p in procs]
        pids = [r["peer_id"] for r in ready]
        owners = make_partition(numel, [(r["peer_id"], r["address"], 1.0) for r in ready], block_size=block_size)
        tokens = {p: 1000 * (k + 1) for k, p in enumerate(pids)}
        rows = {}
        # rounds numbered over the modes run only: an owner refuses a round too far ahead of its last
        for r, (name, mode, push, agg) in enumerate([m for m in MODES if m[0] in modes], start=1):
            start_at = time.time() + 2.0
            spec = CollectiveSpec(
                RUN,
                r,
                {p: 10**9 for p in pids},
                owners,
                numel,
                start_at + deadline_s,
                start_at + deadline_s + 30.0,
                mode=mode,
                push_encoding=push,
                aggregate_encoding=agg,
                block_size=block_size,
            )
            if name not in modes:
                continue
            out = os.path.join(tmp, f"agg-{n}-{name}.f32")
            for k, p in enumerate(procs):
                p.send(
                    {
                        "cmd": "round",
                        "spec": spec.to_dict(),
                        "tokens": tokens[pids[k]],
                        "start_at": start_at,
                        "out": out if k == 0 else None,
                        "omit_own": name != "relay-whole",
                    }
                )
            done = [await p.read() for p in procs]
            for p in procs:
                p.send({"cmd": "stats"})
            after = [await p.read() for p in procs]
            sent = [a["bytes"][0] - d["before"][0] for a, d in zip(after, done)]
            recv = [a["bytes"][1] - d["before"][1] for a, d in zip(after, done)]
            rows[name] = {
                "sent": sent,
                "recv": recv,
                "wall_s": max(d["finished_at"] for d in done) - start_at,
                "identical": len({d["sha256"] for d in done}) == 1,
                "missing": sorted({j for d in done for j in d["missing"]}),
                "out": out,
                "complete": all(not d["missing"] and d["complete"] and not d["findings"] for d in done),
            }
        ref = torch.from_numpy(np.fromfile(rows["fp32"]["out"], dtype="<f4"))
        for name, row in rows.items():
            agg = torch.from_numpy(np.fromfile(row["out"], dtype="<f4"))
            row["rel_err"] = float((agg - ref).norm() / ref.norm())
            os.unlink(row["out"]) if name != "fp32" else None
        os.unlink(rows["fp32"]["out"])
        await exit_workers(procs)
        return rows
    finally:
        await kill_workers(procs)


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def table(results: dict, numel: int) -> str:
    lines = [
        f"numel = {numel:,} fp32 elements ({4 * numel / 1e6:.0f} MB); bytes per peer in MB (mean over peers; max in brackets)",
        "",
        "| peers | mode | sent MB/peer | received MB/peer | wall s | fp32 bytes / mode bytes | identical | rel. err vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, rows in results.items():
        fp = rows["fp32"]
        fp_bytes = np.mean(fp["sent"]) + np.mean(fp["recv"])
        for name, row in rows.items():
            s, r = np.mean(row["sent"]), np.mean(row["recv"])
            label = LABELS[name]
            lines.append(
                f"| {n} | {label} | {_mb(s)} [{_mb(max(row['sent']))}] | {_mb(r)} [{_mb(max(row['recv']))}] | "
                f"{row['wall_s']:.2f} | {fp_bytes / (s + r):.1f}x | {'yes' if row['identical'] else 'NO'} | "
                f"{row['rel_err']:.3f} |" + ("" if row["complete"] else " INCOMPLETE (a push or part was lost)")
            )
    return "\n".join(lines)


async def main_async(ns) -> int:
    results = {}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns.peers:
            t0 = time.time()
            results[n] = await run_group(n, ns.numel, ns.block_size, tmp, ns.deadline_s, ns.bytes_modes)
            print(f"# {n} peers done in {time.time() - t0:.1f}s", file=sys.stderr)
    cmd = "python benchmarks/collective.py " + " ".join(sys.argv[1:])
    head = (
        f"command: {cmd.strip()}\nmachine: {platform.platform()}, {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}, torch {torch.__version__}; 1-min load average {load0:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end (other work on the machine inflates wall times, not bytes)\n"
    )
    text = head + "\n" + table(results, ns.numel)
    print(text)
    ok = all(row["identical"] and row["complete"] for rows in results.values() for row in rows.values())
    ratios = []
    for rows in results.values():
        if "reencode" not in rows:  # --bytes-modes without it: no 30x line
            continue
        fp = np.mean(rows["fp32"]["sent"]) + np.mean(rows["fp32"]["recv"])
        ratios.append(fp / (np.mean(rows["reencode"]["sent"]) + np.mean(rows["reencode"]["recv"])))
    goal = bool(ratios) and all(r >= 30 for r in ratios)
    print(
        f"\nreencode (sign) vs fp32: {', '.join(f'{r:.1f}x' for r in ratios) or 'not run'} fewer bytes "
        f"(goal >= 30x: {'met' if goal else 'NOT met'}); every round complete with identical aggregates on all "
        f"peers: {'yes' if ok else 'NO'}"
    )
    if ns.markdown:
        with open(ns.markdown, "w") as f:
            f.write(text + "\n")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {
                    str(n): {m: {k: v for k, v in row.items() if k != "out"} for m, row in rows.items()}
                    for n, rows in results.items()
                },
                f,
                indent=1,
            )
    return 0 if (ok and goal) else 1


def model_table(peers, numel: int, block_size: int) -> str:
    """Modelled bytes per peer per round (sent + received, mean over peers) of a sign exchange of ``numel``
    elements split equally among ``n`` owners, in units of P/8 (one sign bit per element), by mode: the
    model of :func:`geomesh_p2p.sim.link_time.exchange_bytes` (envelopes and protobuf framing left out)."""
    from geomesh_p2p.sim.link_time import exchange_bytes

    unit = numel / 8
    cols = [("relay", 1), ("reencode", 1), ("accountable", 1), ("accountable", 2)]
    lines = [
        f"modelled bytes per peer per round (sent + received) / 2, in P/8 (P = {numel:,}, B = {block_size})",
        "",
        "| peers | relay | reencode | accountable V=1 | accountable V=2 |",
        "|---|---|---|---|---|",
    ]
    for n in peers:
        sizes = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
        row = []
        for mode, v in cols:
            xb = exchange_bytes(
                sizes, contribution="sign", aggregate="sign", mode=mode, block_size=block_size, validators=v
            )
            per_peer = sum(xb.sent(i) + xb.received(i) for i in range(n)) / n / 2
            row.append(f"{per_peer / unit:.2f}")
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ exchange memory


async def _memory_child(n: int, numel: int, block_size: int, mode_name: str) -> dict:
    """One all-reduce of ``mode_name`` among ``n`` in-process services; peak RSS growth and wall time."""
    import resource

    from geomesh_p2p.exchange import CollectiveService, CollectiveSpec, make_partition
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    _, mode, push, agg = next(m for m in MODES if m[0] == mode_name)
    ids = [Identity.generate() for _ in range(n)]
    transports = [Transport(i, RUN, TransportConfig(default_timeout_s=600.0)) for i in ids]
    services = [CollectiveService(t, long_poll_s=30.0) for t in transports]
    try:
        addrs = [await t.start() for t in transports]
        pids = [i.peer_id.to_string() for i in ids]
        owners = make_partition(numel, [(p, a, 1.0) for p, a in zip(pids, addrs)], block_size=block_size)
        deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(1000 + k)) for k in range(n)]
        now = time.time()
        spec = CollectiveSpec(
            RUN,
            1,
            {p: 10**9 for p in pids},
            owners,
            numel,
            now + 600.0,
            now + 660.0,
            mode=mode,
            push_encoding=push,
            aggregate_encoding=agg,
            block_size=block_size,
        )
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *(s.all_reduce(spec, d, 1000 * (k + 1)) for k, (s, d) in enumerate(zip(services, deltas)))
        )
        wall = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        digests = {hashlib.sha256(r.aggregate.numpy().tobytes()).hexdigest() for r in res}
        return {
            "mode": mode_name,
            "peers": n,
            "numel": numel,
            "extra_bytes": rss1 - rss0,
            "wall_s": wall,
            "identical": len(digests) == 1,
            "missing": sorted({j for r in res for j in r.missing_parts}),
        }
    finally:
        for s in services:
            await s.close()
        for t in transports:
            await t.stop(grace=0.5)


def memory_main(ns) -> int:
    """``--memory``: one child process per mode (a fresh peak RSS each); prints a table."""
    import subprocess

    lines = [
        f"exchange memory: {ns.peers[0]} peers in one process, numel = {ns.numel:,} "
        f"({4 * ns.numel / 1e6:.0f} MB per fp32 vector); command: python benchmarks/collective.py "
        + " ".join(sys.argv[1:]),
        "",
        "| mode | peak extra RSS MB (all peers) | per peer MB | per peer, fp32 vectors | wall s | identical |",
        "|---|---|---|---|---|---|",
    ]
    ok = True
    for name in ns.modes:
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-child",
                name,
                "--peers",
                str(ns.peers[0]),
                "--numel",
                str(ns.numel),
                "--block-size",
                str(ns.block_size),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
        )
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        per = r["extra_bytes"] / r["peers"]
        ok = ok and r["identical"] and not r["missing"]
        lines.append(
            f"| {name} | {r['extra_bytes'] / 1e6:.0f} | {per / 1e6:.0f} | {per / (4 * r['numel']):.2f} | "
            f"{r['wall_s']:.2f} | {'yes' if r['identical'] and not r['missing'] else 'NO'} |"
        )
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=240.0,
        help="push deadline after the start (parts close as soon as everyone pushed)",
    )
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--json", default=None, help="also write raw figures to this JSON file")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="measure the exchange's peak extra RSS and wall time instead (default --peers 3)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["fp32", "relay"],
        choices=[m[0] for m in MODES],
        help="--memory: the modes measured (default: %(default)s)",
    )
    ap.add_argument(
        "--bytes-modes",
        nargs="+",
        default=[m[0] for m in MODES],
        choices=[m[0] for m in MODES],
        help="the modes of the bytes run (fp32 is always run: the reference)",
    )
    ap.add_argument(
        "--model",
        action="store_true",
        help="print the modelled bytes per peer per round (sim.link_time.exchange_bytes) of relay, reencode and "
        "accountable side by side for --peers, in units of P/8, and exit (no processes)",
    )
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.memory_child:
        torch.set_num_threads(1)
        _emit(asyncio.run(_memory_child(ns.peers[0], ns.numel, ns.block_size, ns.memory_child)))
        return 0
    if ns.memory:
        if ns.peers == [4, 8]:
            ns.peers = [3]
        return memory_main(ns)
    if ns.worker:
        return asyncio.run(_worker(ns.seed, ns.numel))
    if ns.model:
        print(model_table(ns.peers, ns.numel, ns.block_size))
        return 0
    if "fp32" not in ns.bytes_modes:
        ns.bytes_modes = [*ns.bytes_modes, "fp32"]
    return asyncio.run(main_async(ns))


if __name__ == "__main__":
    sys.exit(main())
