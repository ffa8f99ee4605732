"""Bytes that verified work adds in accountable mode (issues 26 and 28): the accused's contributions a checker
fetches, per check and per peer per round, side by side with the exchange's own bytes.

    PYTHONPATH=$PWD python benchmarks/verify_accountable_bytes.py [--peers 4 8 16] [--numel 4000000]

For each group size N, N in-process peers (each its own Identity, Transport and CollectiveService on 127.0.0.1,
equal parts) run one accountable round (sign pushes, sign aggregate), then every peer fetches what its screens
of that round need, as the node does (:mod:`geomesh_p2p.round.rules.verified_accountable`): every contributor is
a newcomer (the swarm's first screened rounds: the most screens there are), each screened by ``screeners`` = 4
peers drawn by :func:`~geomesh_p2p.trust.verify_task.screeners_of` over the round's commitment seed, each screen
covering ``CHECK_PARTS`` parts of the accused drawn as :func:`~geomesh_p2p.trust.verify_commit.narrow` does; each
contribution is fetched from the accused (``PullInputs(from_sender)``) and checked against its commitment.

Bytes: the serialized SignedMessage bytes of PullInputs traffic (requests and replies, client and server side)
counted by each peer's transport, mean of sent and received per peer; the exchange's: PushPart + PullPart of
the round (validation not run here: its bytes are in docs/collective.md). ``P/8`` = numel / 8 bytes. The
steady-state column is the sampled checks alone (no newcomer): ``p`` checks drawn per peer per round at
``share`` 0.1, H = 20 and equal batches, ``p = 0.1 x 20 / (k + m) = 0.22`` (k = 5, m = 4), times the bytes per
check measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import struct
import sys
import time
import types

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from geomesh_p2p.exchange import CollectiveService  # noqa: E402
from geomesh_p2p.exchange.fetch_input import committed_round, fetch_input  # noqa: E402
from geomesh_p2p.net.methods import COLLECTIVE_INPUTS, COLLECTIVE_PULL, COLLECTIVE_PUSH  # noqa: E402
from geomesh_p2p.trust.verify_commit import CHECK_PARTS, Committed, commitment_seed, verified_packet  # noqa: E402
from geomesh_p2p.trust.verify_task import VerifyConfig, screeners_of  # noqa: E402
from tests.collective_util import Swarm, deltas_for  # noqa: E402

#: sampled checks drawn per peer per round at the defaults, H = 20, equal batches (share x H / (k + m))
STEADY_CHECKS = 0.1 * 20 / (5 + 4)


def _bytes(service, method: str) -> tuple[int, int]:
    return service.transport.stats.by_method.get(method, (0, 0))


async def one_group(n: int, numel: int) -> dict:
    sw = Swarm(n, service_cls=[CollectiveService] * n)
    await sw.start()
    try:
        deltas = deltas_for(sw.pids, numel, seed=n)
        spec = sw.spec(numel, mode="accountable", deadline_s=20.0 + 2.0 * n, pull_s=20.0, validators_per_part=1)
        res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
        assert all(r.missing_parts == [] for r in res), "a part is missing: raise --deadline"
        exchange = [
            sum(_bytes(s, m)[0] + _bytes(s, m)[1] for m in (COLLECTIVE_PUSH, COLLECTIVE_PULL)) / 2 for s in sw.services
        ]
        held = [await asyncio.to_thread(committed_round, s, spec.round) for s in sw.services]
        committed = {
            a: {j: Committed(t, d, dr) for j, (t, dr, d) in parts.items()} for a, parts in held[0].inputs.items()
        }
        plan = types.SimpleNamespace(round=spec.round, start_digest="bench")
        seed = commitment_seed(spec.run_id, plan, committed)
        assert all(
            commitment_seed(
                spec.run_id,
                plan,
                {a: {j: Committed(t, d, dr) for j, (t, dr, d) in p.items()} for a, p in h.inputs.items()},
            )
            == seed
            for h in held
        ), "the seed differs between peers"
        screeners = VerifyConfig().screeners
        before = [_bytes(s, COLLECTIVE_INPUTS) for s in sw.services]
        fetches = [0] * n
        refused = 0

        async def screen(i: int, accused: str) -> None:
            nonlocal refused
            parts = sorted(committed[accused])
            key = seed + accused.encode()
            pick = sorted(parts, key=lambda j: hashlib.sha256(key + struct.pack("<Q", j)).digest())[:CHECK_PARTS]
            for j in pick:
                c = committed[accused][j]
                got, why, _ = await fetch_input(sw.services[i], spec.round, j, accused, c.digest, timeout_s=30.0)
                if got is None:
                    refused += 1
                    continue
                o = spec.owners[j]
                verified_packet(
                    got, c, run_id=spec.run_id, accused=accused, round=spec.round, part=j, part_range=(o.start, o.end)
                )
                fetches[i] += 1

        jobs = []
        for a in sw.pids:
            for v in screeners_of(seed, a, sw.pids, screeners):
                jobs.append(screen(sw.pids.index(v), a))
        t0 = time.monotonic()
        await asyncio.gather(*jobs)
        wall = time.monotonic() - t0
        after = [_bytes(s, COLLECTIVE_INPUTS) for s in sw.services]
        extra = [((a[0] - b[0]) + (a[1] - b[1])) / 2 for a, b in zip(after, before)]
        p8 = numel / 8
        per_fetch = sum(extra) / max(1, sum(fetches))
        return {
            "peers": n,
            "screens_per_peer": len(jobs) / n,
            "fetches_per_peer": sum(fetches) / n,
            "refused": refused,
            "kb_per_fetch": per_fetch / 1e3,
            "per_check_p8": CHECK_PARTS * per_fetch / p8,
            "extra_mb": sum(extra) / n / 1e6,
            "extra_p8": sum(extra) / n / p8,
            "extra_max_p8": max(extra) / p8,
            "exchange_p8": sum(exchange) / n / p8,
            "steady_p8": STEADY_CHECKS * CHECK_PARTS * per_fetch / p8,
            "wall_s": wall,
        }
    finally:
        await sw.stop()


def table(rows: list[dict], numel: int) -> str:
    out = [
        f"numel {numel} (P/8 = {numel / 8e6:.2f} MB), CHECK_PARTS = {CHECK_PARTS}, screeners = 4, load "
        f"{open('/proc/loadavg').read().split()[0]}",
        "| peers | screens / peer | fetches / peer | KB / fetch | bytes / check (P/8) | extra / peer / round, every "
        "contributor screened (P/8) [max] | extra, steady state: sampled checks only (P/8) | exchange push + pull (P/8) "
        "| refused |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['peers']} | {r['screens_per_peer']:.2f} | {r['fetches_per_peer']:.2f} | {r['kb_per_fetch']:.1f} | "
            f"{r['per_check_p8']:.3f} | {r['extra_p8']:.3f} [{r['extra_max_p8']:.3f}] | {r['steady_p8']:.4f} | "
            f"{r['exchange_p8']:.2f} | {r['refused']} |"
        )
    return "\n".join(out)


async def main_async(ns) -> int:
    rows = []
    for n in ns.peers:
        rows.append(await one_group(n, ns.numel))
        print(f"# {n} peers done ({rows[-1]['wall_s']:.1f} s of fetches)", file=sys.stderr, flush=True)
    print(table(rows, ns.numel))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--numel", type=int, default=4_000_000)
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
