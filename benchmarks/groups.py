"""All-reduce groups (issue 26): calls and bytes per peer of one round, one group of all vs groups of G, side by side.

    PYTHONPATH=$PWD python benchmarks/groups.py [--peers 8 16 32] [--numel 1000000] [--group-size 0]
    PYTHONPATH=$PWD python benchmarks/groups.py --sim [--peers 8 16 ... 1024] [--numel 16000000]

For each N, N in-process peers on 127.0.0.1 (one event loop; each its own Identity, Transport and services) run
two rounds over the same transports: ``flat`` (reencode, sign: every peer pushes to and pulls from every owner)
and ``grouped`` (:mod:`geomesh_p2p.exchange.groups`: groups of ``G``, default ``ceil(sqrt(N))``; the same
deltas and tokens). Per peer, counted by the transports: collective calls made (PushPart / PullPart of every
level, answered) and served, bytes sent + received (serialized SignedMessages, both sides), mean and max over
the peers (the max is a slice leader in grouped rounds). "identical": every peer's aggregate has the same
SHA-256; "rel. err": ||aggregate - exact fp32 token-weighted mean|| / ||exact|| on independent Gaussian deltas
(a worst case for sign compression, not a convergence figure). P/8 = the sign-packed vector, numel / 8 bytes.

``--sim``: no processes; :func:`geomesh_p2p.sim.groups.exchange_traffic` counts the calls and encoded bytes of a
healthy round from the real specs (the layout and level specs the peers build), one group against groups of
``ceil(sqrt(N))`` and of 16, to N = 1,024 (default sizes 8 ... 1,024).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import math
import os
import platform
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from geomesh_p2p.exchange.groups import GroupedCollective, auto_group_size, group_layout  # noqa: E402
from geomesh_p2p.net.methods import LEVELS  # noqa: E402
from tests.collective_util import Swarm, deltas_for  # noqa: E402


def _traffic(svc) -> tuple[int, int, int]:
    st = svc.transport.stats
    calls = sum(st.calls_by_method.get(m, 0) for lv in LEVELS for m in lv.all())
    served = sum(st.served_by_method.get(m, 0) for lv in LEVELS for m in lv.all())
    nbytes = sum(sum(st.by_method.get(m, (0, 0))) for lv in LEVELS for m in lv.all())
    return calls, served, nbytes


async def _round(sw, grouped, spec, deltas, tokens, group_size: int):
    before = [_traffic(s) for s in sw.services]
    t0 = time.monotonic()
    start = time.time()  # the pushes start now: the stages split now -> the pull deadline
    out = await asyncio.gather(
        *(
            gc.all_reduce(
                spec, deltas[gc.peer_id].clone(), tokens[gc.peer_id], group_size=group_size, exchange_start=start
            )
            for gc in grouped
        )
    )
    wall = time.monotonic() - t0
    after = [_traffic(s) for s in sw.services]
    diff = [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after, before)]
    return out, diff, wall


async def _one(n: int, numel: int, group_size: int, deadline_s: float) -> list[dict]:
    sw = Swarm(n, long_poll_s=5.0)
    grouped = [GroupedCollective(s, long_poll_s=5.0) for s in sw.services]
    await sw.start()
    rows = []
    try:
        deltas = deltas_for(sw.pids, numel, seed=n)
        tokens = {p: 1000 + 37 * k for k, p in enumerate(sw.pids)}
        total = sum(tokens.values())
        exact = sum(deltas[p] * (tokens[p] / total) for p in sw.pids)
        g = group_size or math.ceil(math.sqrt(n))
        for r, (name, gs) in enumerate((("flat", 0), (f"grouped G={g}", g))):
            spec = sw.spec(numel, round=r + 1, deadline_s=deadline_s, pull_s=deadline_s / 3)
            layout = group_layout(spec, gs) if gs else None
            out, diff, wall = await _round(sw, grouped, spec, deltas, tokens, gs)
            digests = {hashlib.sha256(o.aggregate.numpy().tobytes()).hexdigest() for o in out}
            err = float(torch.linalg.vector_norm(out[0].aggregate - exact) / torch.linalg.vector_norm(exact))
            rows.append(
                dict(
                    n=n,
                    mode=name,
                    groups=len(layout.groups) if layout else 1,
                    calls=sum(d[0] for d in diff) / n,
                    calls_max=max(d[0] for d in diff),
                    served_max=max(d[1] for d in diff),
                    mb=sum(d[2] for d in diff) / n / 1e6,
                    mb_max=max(d[2] for d in diff) / 1e6,
                    p8=numel / 8 / 1e6,
                    wall=wall,
                    identical=len(digests) == 1,
                    missing=sum(len(o.missing_parts) for o in out),
                    err=err,
                )
            )
    finally:
        for gc in grouped:
            await gc.close()
        await sw.stop()
    return rows


def _sim(peers: list[int], numel: int) -> None:
    from geomesh_p2p.exchange import CollectiveSpec, make_partition
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.sim.groups import exchange_traffic

    print("| N | round | groups | calls made / peer (max) | calls served, max | bytes / peer in P/8 (max) |")
    print("|---|---|---|---|---|---|")
    p8 = numel / 8
    ids = [Identity.generate().peer_id.to_string() for _ in range(max(peers))]
    for n in peers:
        pids = ids[:n]
        owners = make_partition(numel, [(p, f"10.0.{k // 250}.{k % 250}:7000", None) for k, p in enumerate(pids)])
        spec = CollectiveSpec("sim", 1, {p: 10**6 for p in pids}, owners, numel, time.time() + 60, time.time() + 80)
        auto = auto_group_size(None, n)  # --group-size auto
        for g in dict.fromkeys((0, math.ceil(math.sqrt(n)), 16, auto)):
            layout = group_layout(spec, g) if g else None
            if g and layout is None:
                continue  # one group at this size: the flat row
            t = exchange_traffic(spec, g)
            made = [t.made[p] for p in pids]
            moved = [(t.sent[p] + t.received[p]) / p8 for p in pids]
            label = ("flat" if not g else f"grouped G={g}") + (" (auto)" if g == auto else "")
            print(
                f"| {n} | {label} | {len(layout.groups) if layout else 1} | {sum(made) / n:.1f} ({max(made)}) | "
                f"{max(t.served.values())} | {sum(moved) / n:.2f} ({max(moved):.2f}) |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32], help="swarm sizes N (default: 8 16 32)")
    ap.add_argument("--numel", type=int, default=1_000_000, help="elements of the vector (default: 1,000,000)")
    ap.add_argument("--group-size", type=int, default=0, help="G; 0: ceil(sqrt(N)) (default: 0)")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="push deadline of a round, s (default: 30)")
    ap.add_argument("--sim", action="store_true", help="count a healthy round from the specs, no peers (see above)")
    ns = ap.parse_args()
    if ns.sim:
        _sim(
            ns.peers if ns.peers != [8, 16, 32] else [8, 16, 32, 64, 128, 256, 1024],
            ns.numel if ns.numel != 1_000_000 else 16_000_000,
        )
        return
    if ns.numel < 1 or ns.group_size < 0 or any(n < 2 for n in ns.peers):
        ap.error("--numel >= 1, --group-size >= 0, --peers >= 2")
    torch.set_num_threads(1)
    # the exchange's WARNINGs (late pushes, missing parts) are counted in the table; an overloaded flat round
    # logs thousands of them
    logging.basicConfig(level=logging.ERROR)
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"1-min load average {os.getloadavg()[0]:.1f}"
    )
    print()
    print(
        "| N | round | groups | calls / peer (max) | served, max | MB / peer (max) | in P/8 | wall s | identical | rel. err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for n in ns.peers:
        rows = asyncio.run(_one(n, ns.numel, ns.group_size, ns.deadline_s))
        for row in rows:
            print(
                f"| {n} | {row['mode']} | {row['groups']} | {row['calls']:.1f} ({row['calls_max']}) | "
                f"{row['served_max']} | {row['mb']:.2f} ({row['mb_max']:.2f}) | {row['mb'] / row['p8']:.2f} | "
                f"{row['wall']:.1f} | {'yes' if row['identical'] and not row['missing'] else 'NO'} | {row['err']:.3f} |"
            )
        flat, grp = rows
        ratios.append(f"N={n}: calls {grp['calls'] / flat['calls']:.2f}x, bytes {grp['mb'] / flat['mb']:.2f}x")
    print()
    print("grouped / flat, per peer: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
