"""Where does the loss-gain test's power lie? Honest t over 2 of N equal parts against the whole (issue 28, session 31).

Accountable mode cut a screen to 2 of its N parts (``verify_commit.narrow``, before session 31). This trains the tiny
preset DiLoCo-style as ``verify_gain.py`` does (4 peers, persistent inner AdamW, sign-compressed mean, outer Nesterov
0.7 / 0.9; batch ``--batch`` x ``--seq-len``), and in ``--measure`` rounds each peer trains its own H of ``--Hs`` and
its honest contribution (sign codec, block 2048) is measured with the shipped ``gain_stats`` (k = min(8, H) of its
steps against 16 control batches) over the whole vector and over every pair of N equal parts, ``--samples`` draws of
the k steps each. Then, pairing each honest t with every other peer's t on the same parts and round as the power
reference, how often the shipped gate (``t < gain_t_hard`` and reference ``>= t + gain_t_gap``) fails honest work::

    PYTHONPATH=$PWD python benchmarks/gain_parts.py                   # ~5 min on 2 busy cores
    PYTHONPATH=$PWD python benchmarks/gain_parts.py --batch 4 --Hs 5,10
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import random

import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.trust.gain import gain_stats
from geomesh_p2p.trust.verify_task import CONTROL_STREAM, VerifyConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--Hs", default="8,13,23,40", help="one per peer, in turn (the peers' H in measured rounds)")
    ap.add_argument("--measure", default="2,3,4")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = VerifyConfig()
    L, B, N = a.seq_len, a.batch, a.parts
    Hs = [int(x) for x in a.Hs.split(",")]
    measure = {int(x) for x in a.measure.split(",")}
    ds = load_dataset(None, seq_len=L)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    bounds = [round(i * theta.numel() / N) for i in range(N + 1)]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    peers = [f"peer{c}" for c in "ABCD"]
    trainers = {
        p: InnerTrainer(
            copy.deepcopy(base), ds, seq_len=L, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id=p
        )
        for p in peers
    }
    outer, vmodel, rng = OuterNesterov(0.7, 0.9), copy.deepcopy(base), random.Random(0)
    rows = []  # (round, peer, H, parts, t)
    for r in range(max(measure) + 1):
        deltas = {}
        for i, (p, tr) in enumerate(trainers.items()):
            H = Hs[i % len(Hs)] if r in measure else 20
            load_flat_(tr.model, theta)
            tr.run(round=r, inner_steps=H, batch_size=B)
            deltas[p] = compression.decode(compression.encode(theta - flat_params(tr.model), 2048, 0))
            if r not in measure:
                continue
            cache: dict = {}
            for sel in [tuple(range(N))] + list(itertools.combinations(range(N), 2)):
                pieces = [(ranges[j][0], deltas[p][ranges[j][0] : ranges[j][1]].clone()) for j in sel]
                for _ in range(a.samples):
                    steps = sorted(rng.sample(range(H), min(cfg.gain_assigned, H)))
                    g = gain_stats(
                        vmodel, ds, theta, pieces, [(p, j) for j in steps],
                        [(CONTROL_STREAM, c) for c in range(cfg.gain_controls)],
                        seed=0, round=r, batch_size=B, seq_len=L, cache=cache,
                    )  # fmt: skip
                    rows.append((r, p, H, sel, g.t))
            print(f"round {r} {p} H {H}: measured", flush=True)
        outer.step(theta, torch.stack(list(deltas.values())).mean(0))
    by_parts = collections.defaultdict(list)
    for _, _, _, sel, t in rows:
        by_parts["whole" if len(sel) == N else str(sel)].append(t)
    print(
        f"\nhonest t (k = {cfg.gain_assigned}, m = {cfg.gain_controls}, batch {B} x {L}, H {Hs}, rounds {sorted(measure)})"
    )
    for k, v in by_parts.items():
        v = sorted(v)
        low = sum(t < cfg.gain_t_hard for t in v) / len(v)
        print(f"{k:>8}: min {v[0]:.2f} median {v[len(v) // 2]:.2f} max {v[-1]:.2f}, below {cfg.gain_t_hard}: {low:.2f}")
    for whole in (True, False):
        cell = collections.defaultdict(list)
        for r, p, _, sel, t in rows:
            if (len(sel) == N) == whole:
                cell[(r, sel)].append((p, t))
        n = fp = 0
        for xs in cell.values():
            for (p, t), (q, ref) in itertools.product(xs, xs):
                if p != q:
                    n += 1
                    fp += t < cfg.gain_t_hard and ref >= t + cfg.gain_t_gap
        what = "the whole contribution" if whole else f"2 of {N} parts"
        print(f"{what}: (accused, reference) honest pairs {n}, failed by the gate {fp} ({fp / max(1, n):.3f})")
    # by (accused H, reference H), whole contributions (session 32 red team: under load an honest peer trains
    # fewer steps than planned, and a screener whose own contribution had more steps reaches t + gain_t_gap)
    byh = collections.defaultdict(lambda: [0, 0, []])
    cell = collections.defaultdict(list)
    for r, p, H, sel, t in rows:
        if len(sel) == N:
            cell[r].append((p, H, t))
    for xs in cell.values():
        for (p, h, t), (q, hr, ref) in itertools.product(xs, xs):
            if p != q:
                c = byh[(h, hr)]
                c[0] += 1
                c[1] += t < cfg.gain_t_hard and ref >= t + cfg.gain_t_gap
                c[2].append(t)
    for (h, hr), (n, fp, ts) in sorted(byh.items()):
        print(
            f"accused H {h:>3}, reference H {hr:>3}: pairs {n}, failed {fp} ({fp / max(1, n):.3f}), accused t min {min(ts):.2f}"
        )


if __name__ == "__main__":
    main()
