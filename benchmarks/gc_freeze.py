#!/usr/bin/env python3
"""A full collection of Python's cyclic garbage collector in a peer's process, before and after the start-up heap is
frozen (issue 27: event-loop stalls). Imports what ``geomesh-peer join`` imports, builds the model, then times
``gc.collect()`` of each generation (best of ``--repeat``) as it stands, and again after
:func:`geomesh_p2p.util.exit_gc.freeze_startup_heap` (what ``join`` does once its node is built), side by side.

Usage::

    PYTHONPATH=$PWD python benchmarks/gc_freeze.py                  # gpt2-124m
    PYTHONPATH=$PWD python benchmarks/gc_freeze.py --model tiny
"""

from __future__ import annotations

import argparse
import gc
import time

import geomesh_p2p.node.peer  # noqa: F401  (the imports of a peer: torch, transformers, grpc, hivemind's parts)
from geomesh_p2p.model.build import build_model
from geomesh_p2p.util import exit_gc


def collect_ms(generation: int, repeat: int) -> float:
    """The fastest of ``repeat`` ``gc.collect(generation)`` calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        gc.collect(generation)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="preset to build (default gpt2-124m)")
    ap.add_argument("--repeat", type=int, default=3, help="collections per figure; the fastest counts (default 3)")
    args = ap.parse_args()
    model = build_model(args.model)
    tracked = len(gc.get_objects())
    before = [collect_ms(g, args.repeat) for g in (0, 1, 2)]
    exit_gc.arm_startup_freeze()
    exit_gc.freeze_startup_heap()
    after = [collect_ms(g, args.repeat) for g in (0, 1, 2)]
    print(f"{args.model}: {tracked:,} GC-tracked objects, {gc.get_freeze_count():,} frozen")
    print(f"{'generation':>10} {'as started ms':>14} {'frozen ms':>10} {'ratio':>8}")
    for g in (0, 1, 2):
        r = before[g] / max(after[g], 1e-6)
        print(f"{g:>10} {before[g]:>14.3f} {after[g]:>10.3f} {'>1000x' if r > 1000 else f'{r:.1f}x':>8}")
    del model


if __name__ == "__main__":
    main()
