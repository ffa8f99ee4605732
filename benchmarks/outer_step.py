#!/usr/bin/env python3
"""The outer step and the state digest at real size (issue 27), each against a ``copy_`` of the state it
touches, side by side in one run on one thread: ``outer_step_per_part`` (the fused in-place path), the same
with the fused path off (the copy-and-check path every part took before), the whole-vector
``OuterNesterov.step``, and ``state.digest`` of θ and the momentum: the BLAKE3 tree of 0.12.0 and the SHA-256
tree of 0.3.0-0.11 on 1 and 2 worker threads (``--digest-workers``), and the blake2b of the releases before them.
Beside the clipped step, session 45's kernels for it (``_clipped_s45``: the bits the tests compare it with); beside
the digest, one BLAKE3 hash of a ``bytes`` buffer of the state's size (the hash's own one-thread speed).

``--cpu-time`` times each row by the thread's CPU time (``time.thread_time``) rather than the wall clock: on a
shared, loaded box it leaves out the time the thread waited for a core (not cache or memory contention).

Usage::

    PYTHONPATH=$PWD python benchmarks/outer_step.py                 # 89M parameters (gpt2-124m's body), 8 parts
    PYTHONPATH=$PWD python benchmarks/outer_step.py --params 150e6 --parts 16
    PYTHONPATH=$PWD python benchmarks/outer_step.py --digest-only            # the copy_ and the digests only
    PYTHONPATH=$PWD python benchmarks/outer_step.py --cpu-time --repeat 5    # loaded box: CPU time, best of 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import blake3
import torch

from geomesh_p2p.model import optim
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part
from geomesh_p2p.model.digest import SHA256_TREE_ALGO, legacy_digest, tree_digest
from geomesh_p2p.model.state import _le_bytes, digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robust_agg import _best  # noqa: E402  (the benchmarks' one best-of timer)


CPU_TIME = False
REPEAT = 3


def best_of(f, n: int = 3) -> float:
    """The fastest of ``max(n, --repeat)`` runs of ``f()``, in seconds (wall clock, or the thread's CPU time with
    ``--cpu-time``)."""
    return _best(f, max(n, REPEAT), time.thread_time if CPU_TIME else time.perf_counter)


def _clipped_s45(outer: OuterNesterov, theta, agg, ranges) -> None:
    """The clipped fused step with session 45's kernels (every part under FUSED_BOUND): ``abs`` then ``amax`` for
    the block maxima (1 Mi elements at a time), then 128 Ki-element blocks with a scratch for ``μ·buf``, Python-float
    scalars and ``-bounds`` made again in every block (``clamp_blocks``)."""
    mu, lr, bs = outer.momentum, outer.lr, outer.block_size
    for s, e in ranges:
        g = agg[s:e]
        nfull = g.numel() // bs
        step = (1 << 20) // bs * bs
        parts = [
            torch.abs(g[a : min(nfull * bs, a + step)]).view(-1, bs).amax(dim=1) for a in range(0, nfull * bs, step)
        ]
        if nfull * bs < g.numel():
            parts.append(torch.abs(g[nfull * bs :]).amax().reshape(1))
        maxima = torch.cat(parts)
        if not float(maxima.max()) < float("inf"):
            continue
        bounds = torch.mul(maxima, outer.momentum_clip)
        nb, upd = torch.empty(1 << 17), torch.empty(1 << 17)
        for a in range(s, e, 1 << 17):
            z = min(e, a + (1 << 17))
            gg, b, th, m, u = agg[a:z], outer.buf[a:z], theta[a:z], nb[: z - a], upd[: z - a]
            torch.mul(b, mu, out=m)
            torch.add(m, gg, out=b)
            optim.clamp_blocks(b, bounds, a - s, bs)
            torch.mul(b, mu, out=u)
            torch.add(gg, u, out=u)
            torch.mul(u, lr, out=u)
            torch.sub(th, u, out=th)


def _raw_blake3(views, piece: int = 0) -> float:
    """BLAKE3 of the state's bytes copied into one ``bytes`` buffer (not zeros: calloc'd pages share one frame), in one
    ``update`` or in ``piece``-byte ones: the hash's own one-thread speed beside the digest's tree."""
    raw = b"".join(views)
    mv = memoryview(raw)

    def run() -> None:
        h = blake3.blake3()
        for a in range(0, len(raw), piece or len(raw)):
            h.update(mv[a : a + (piece or len(raw))])
        h.digest()

    return best_of(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=89e6, help="parameters P (default 89e6)")
    ap.add_argument("--parts", type=int, default=8, help="owner parts of the plan (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a peer per core)")
    ap.add_argument(
        "--digest-workers", default="1,2", help="worker threads of the digest rows, comma-separated (default 1,2)"
    )
    ap.add_argument("--digest-only", action="store_true", help="skip the outer steps (the copy_ and digests only)")
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (a loaded, shared box)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row, the best kept (default 3)")
    ns = ap.parse_args()
    global CPU_TIME, REPEAT
    CPU_TIME, REPEAT = ns.cpu_time, ns.repeat
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
        clip45_s = best_of(lambda: _clipped_s45(clipped, theta, agg, ranges))
        rows += [
            ("outer_step_per_part, fused in place (now)", fused_s),
            ("the same with the momentum clip (geomesh, css; now)", clip_s),
            ("the clipped step with session 45's kernels (before)", clip45_s),
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
    rows.append(("blake3 of one bytes buffer of the same size, 1 thread", _raw_blake3(views)))
    rows.append(("blake3 of one bytes buffer, 8 MiB updates, 1 thread", _raw_blake3(views, 8 << 20)))
    clock = "thread CPU time" if CPU_TIME else "wall clock"
    print(f"P = {p:,} fp32, {ns.parts} parts, {ns.threads} thread(s); state touched: theta + momentum; {clock}")
    print()
    print("| operation | seconds | x copy_ |")
    print("|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.3f} | {s / copy_s:.1f} |")


if __name__ == "__main__":
    main()
