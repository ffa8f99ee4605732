#!/usr/bin/env python3
"""Verified work's agreement measurement (``trust/agreement.sign_agreements``) at a real model's size, counted on
the packed bits (session 44) against decoding each packet to fp32 a slice at a time (sessions 41-43), side by side
in one process: seconds (best of ``--repeat``) and the peak resident memory above the inputs (sampled every
millisecond from ``/proc/self/statm``), with their ratios. The inputs are what a peer holds after a round of
``--peers`` contributors at ``--params`` parameters: one sign packet per contributor and part (each owner's part of
the vector) and the aggregate's :class:`~geomesh_p2p.trust.agreement.PackedSigns`. The counts of both must be equal
(the script stops otherwise).

Usage::

    PYTHONPATH=$PWD python benchmarks/agreement_bits.py                       # gpt2-124m's 124M, 2 peers
    PYTHONPATH=$PWD python benchmarks/agreement_bits.py --params 151000000 --peers 3
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

import geomesh_p2p.trust.agreement as A
from geomesh_p2p.exchange import codec as compression

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(fn, repeat: int) -> tuple[float, int, object]:
    """(best seconds, peak RSS above the start in bytes, the last result) of ``repeat`` calls of ``fn``."""
    best, peak, out = float("inf"), 0, None
    for _ in range(repeat):
        base, top, done = rss(), [0], threading.Event()

        def watch() -> None:
            while not done.wait(0.001):
                top[0] = max(top[0], rss())

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
        done.set()
        w.join()
        peak = max(peak, max(top[0], rss()) - base)
    return best, peak, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=124_439_808, help="P, elements of the vector (default gpt2-124m's)")
    ap.add_argument("--peers", type=int, default=2, help="contributors, and parts of the vector (default 2)")
    ap.add_argument("--block", type=int, default=2048, help="elements per scale block (default 2048)")
    ap.add_argument("--repeat", type=int, default=3, help="calls per figure; the fastest time counts (default 3)")
    args = ap.parse_args()
    torch.manual_seed(0)
    P, n = args.params, args.peers
    cuts = [P * i // n // args.block * args.block for i in range(n)] + [P]
    parts = list(zip(cuts[:-1], cuts[1:]))
    truth = torch.randn(P)
    contributions = {}
    for i in range(n):
        v = truth + torch.randn(P)
        contributions[f"peer{i}"] = {
            j: compression.encode(v[a:b].contiguous(), args.block, 1000) for j, (a, b) in enumerate(parts)
        }
        del v
    signs = A.signs_of(truth)
    del truth
    rows = []
    for name, packed in (("decoded to fp32 (before)", False), ("packed bits (now)", True)):
        A._COUNT_PACKED = packed
        rows.append((name, *measure(lambda: A.sign_agreements(contributions, signs, parts), args.repeat)))
    A._COUNT_PACKED = True
    if rows[0][3] != rows[1][3]:
        raise SystemExit(f"the counts differ: {rows[0][3]} against {rows[1][3]}")
    print(f"P = {P:,}, {n} contributors x {n} parts, block {args.block}; agreements {rows[1][3]}")
    print(f"{'path':<26} {'seconds':>8} {'peak MiB':>9}")
    for name, s, peak, _ in rows:
        print(f"{name:<26} {s:8.3f} {peak / 2**20:9.1f}")
    (_, s0, m0, _), (_, s1, m1, _) = rows
    print(f"ratio before/now: time {s0 / s1:.1f}x, peak {m0 / max(m1, 1):.1f}x")


if __name__ == "__main__":
    main()
