"""Cost of the robust aggregation rules against the plain mean, for one part, side by side.

Builds C sign packets of N elements with the project's codec (honest-like contributions: a shared
direction plus per-peer noise, so the agreement filter keeps them all; ``--flip K`` negates the first K,
which the filter then drops and the second pass runs), then times, on the same packets and in this one run:

* ``copy_``: a plain ``out.copy_(x)`` of an fp32 vector of N elements (the memory-bandwidth floor);
* ``mean``: ``aggregate_part(rule="mean")``;
* ``meanmed`` / ``vote``: ``aggregate_part(rule=...)`` (the robust rules); ``meanmed+support``: with the
  support filter (``min_support=0.5``, the run config's default since session 19);
* with ``--reference``, ``meanmed-ref``: the pre-rewrite ``_robust_sign`` kept in
  tests/unit/test_robust_agg_equiv.py (the "before" of the same run), checked bitwise against the current one.

    python benchmarks/robust_agg.py                          # N = 4M, 30M; C = 3, 8
    python benchmarks/robust_agg.py --sizes 4e6 --contribs 3 --reference --repeat 3

Each time is the best of ``--repeat`` runs, in seconds; ``x copy`` is the ratio to ``copy_``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from geomesh_p2p.exchange import codec as compression  # noqa: E402
from geomesh_p2p.exchange.robust import aggregate_part  # noqa: E402


def _packets(n: int, c: int, block: int, flip: int, seed: int = 0) -> list[tuple[int, compression.SignPacket]]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen)
    items = []
    for i in range(c):
        v = base + 0.7 * torch.randn(n, generator=gen)
        if i < flip:
            v.neg_()
        items.append((1000 + 37 * i, compression.encode(v, block, 1000 + 37 * i)))
        del v
    return items


def _best(fn, repeat: int, clock=time.perf_counter) -> float:
    """The fastest of ``repeat`` runs of ``fn()``, in seconds of ``clock`` (wall clock by default; the benchmarks'
    one best-of timer)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4e6,30e6", help="comma-separated element counts N")
    ap.add_argument("--contribs", default="3,8", help="comma-separated contribution counts C")
    ap.add_argument("--block", type=int, default=compression.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--flip", type=int, default=0, help="negate the first K contributions (filter drops them)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rules", default="mean,meanmed,vote", help="also meanmed+support (the support filter on)")
    ap.add_argument("--reference", action="store_true", help="also time the pre-rewrite meanmed (tests/)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = None
    if args.reference:
        from tests.unit.test_robust_agg_equiv import reference_robust_sign as ref

    rules = [r for r in args.rules.split(",") if r]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {args.block}, flip {args.flip}, "
        f"best of {args.repeat}"
    )
    hdr = f"{'N':>11} {'C':>3} {'copy_ s':>9}"
    for r in rules + (["meanmed-ref"] if ref else []):
        hdr += f" {r + ' s':>13} {'x copy':>7}"
    print(hdr)
    for n in (int(float(s)) for s in args.sizes.split(",")):
        for c in (int(s) for s in args.contribs.split(",")):
            items = _packets(n, c, args.block, args.flip)
            src = torch.randn(n)
            dst = torch.empty(n)
            out = torch.empty(n)
            t_copy = _best(lambda: dst.copy_(src), max(3, args.repeat))
            row = f"{n:>11} {c:>3} {t_copy:>9.4f}"
            results = {}
            for r in rules:
                base, _, extra = r.partition("+")  # "meanmed+support": with the support filter (min_support 0.5)
                sup = 0.5 if extra == "support" else None
                t = _best(lambda: aggregate_part(items, n, rule=base, out=out, min_support=sup), args.repeat)
                results[r] = out.clone() if r == "meanmed" else None
                row += f" {t:>13.4f} {t / t_copy:>7.0f}"
            if ref:
                box = {}

                def run_ref():
                    box["out"] = ref(items, n, "meanmed", 1.0, 0.5, [])

                t = _best(run_ref, args.repeat)
                row += f" {t:>13.4f} {t / t_copy:>7.0f}"
                if results.get("meanmed") is not None and not torch.equal(results["meanmed"], box["out"]):
                    row += "  MISMATCH vs reference"
            print(row, flush=True)


if __name__ == "__main__":
    main()
