#!/usr/bin/env python3
"""The outer step and the state digest at real size (issue 27), each against a ``copy_`` of the state it
touches, side by side in one run on one thread: ``outer_step_per_part`` (the fused in-place path), the same
with the fused path off (the copy-and-check path every part took before), the whole-vector
``OuterNesterov.step``, and ``state.digest`` of θ and the momentum: the BLAKE3 tree of 0.12.0 and the SHA-256
tree of 0.3.0-0.11 on 1 and 2 worker threads (``--digest-workers``), and the blake2b of the releases before them.

Usage::

    PYTHONPATH=$PWD python benchmarks/outer_step.py                 # 89M parameters (gpt2-124m's body), 8 parts
    PYTHONPATH=$PWD python benchmarks/outer_step.py --params 150e6 --parts 16
    PYTHONPATH=$PWD python benchmarks/outer_step.py --digest-only            # the copy_ and the digests only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part
from geomesh_p2p.model.digest import SHA256_TREE_ALGO, legacy_digest, tree_digest
from geomesh_p2p.model.state import _le_bytes, digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robust_agg import _best  # noqa: E402  (the benchmarks' one best-of timer)


def best_of(f, n: int = 3) -> float:
    """The fastest of ``n`` runs of ``f()``, in seconds."""
    return _best(f, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=89e6, help="parameters P (default 89e6)")
    ap.add_argument("--parts", type=int, default=8, help="owner parts of the plan (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a peer per core)")
    ap.add_argument(
        "--digest-workers", default="1,2", help="worker threads of the digest rows, comma-separated (default 1,2)"
    )
    ap.add_argument("--digest-only", action="store_true", help="skip the outer steps (the copy_ and digests only)")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    p = int(ns.params)
    theta, agg = torch.randn(p), torch.randn(p) * 1e-3
    outer = OuterNesterov(0.7, 0.9)
    outer.buf = torch.randn(p) * 1e-3
    ranges = [(i * p // ns.parts, (i + 1) * p // ns.parts) for i in range(ns.parts)]
    d1, d2 = torch.empty_like(theta), torch.empty_like(theta)
    d1.copy_(theta), d2.copy_(outer.buf)  # touch the pages once: the copy below is warm
    copy_s = best_of(lambda: (d1.copy_(theta), d2.copy_(outer.buf)))
    rows = [("copy_ of theta and momentum", copy_s)]
    if not ns.digest_only:
        fused_s = best_of(lambda: outer_step_per_part(outer, theta, agg, ranges, 1))
        bound = optim.FUSED_BOUND
        optim.FUSED_BOUND = -1.0  # every part takes the copy-and-check path (the code before)
        checked_s = best_of(lambda: outer_step_per_part(outer, theta, agg, ranges, 1), n=2)
        optim.FUSED_BOUND = bound
        whole_s = best_of(lambda: outer.step(theta, agg))
        # the sign-compressed methods' momentum clip (run config outer_momentum_clip, 2.0): block maxima + a clamp
        clipped = OuterNesterov(0.7, 0.9, momentum_clip=2.0, block_size=2048)
        clipped.buf = outer.buf.clone()
        clip_s = best_of(lambda: outer_step_per_part(clipped, theta, agg, ranges, 1))
        rows += [
            ("outer_step_per_part, fused in place (now)", fused_s),
            ("the same with the momentum clip (geomesh, css)", clip_s),
            ("outer_step_per_part, copy-and-check (before)", checked_s),
            ("OuterNesterov.step, whole vector", whole_s),
        ]
    views = [_le_bytes(theta), _le_bytes(outer.buf)]
    for w in (int(x) for x in ns.digest_workers.split(",")):
        s = best_of(lambda w=w: digest(theta, outer.buf, workers=w), n=2)
        rows.append((f"state.digest(theta, momentum), BLAKE3 tree (0.12.0), {w} worker(s)", s))
        s = best_of(lambda w=w: tree_digest(views, w, algo=SHA256_TREE_ALGO), n=2)
        rows.append((f"the SHA-256 tree of 0.3.0-0.11, {w} worker(s)", s))
    rows.append(("blake2b of theta and momentum (the digest before 0.3.0)", best_of(lambda: legacy_digest(views), n=2)))
    print(f"P = {p:,} fp32, {ns.parts} parts, {ns.threads} thread(s); state touched: theta + momentum")
    print()
    print("| operation | seconds | x copy_ |")
    print("|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.3f} | {s / copy_s:.1f} |")


if __name__ == "__main__":
    main()
