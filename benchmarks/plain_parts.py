"""Where do the sign statistics of verified work lie? Honest ``plain`` / ``trace`` over 2 of N equal parts against
the whole contribution (issue 28, session 32 red team: accountable mode's sampled checks are cut to 2 parts,
``verify_commit.narrow``, and two honest peers failed each other there with plain 0.544 / 0.548 < 0.55).

Trains the tiny preset DiLoCo-style as ``gain_parts.py`` does (4 peers, persistent inner AdamW, sign-compressed mean,
outer Nesterov 0.7 / 0.9; batch ``--batch`` x ``--seq-len``); in ``--measure`` rounds each peer trains its H of
``--Hs``, and its honest contribution (sign codec, block 2048) is checked as ``verify_check.check_contribution`` does
(k = clamp(ceil(H/4), 4, 16) of its steps, 4 controls, 2^18 elements sampled by ``sample_elements``, the next peer's
contribution as the checker's own in the basis) over the whole vector and over every pair of N equal parts::

    PYTHONPATH=$PWD python benchmarks/plain_parts.py --parts 3 --Hs 40,20,10,40
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
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT


def weighted_plain(c: torch.Tensor, own: torch.Tensor) -> float:
    """A candidate fix: ``plain`` weighted by ``|s|``, ``s`` the summed normalised batch gradients (as ``trace``
    weights by ``|d|``): elements where the batches say nothing (weight decay, momentum) stop counting half."""
    own = own.double()
    s = sum(g / g.pow(2).mean().sqrt().clamp_min(1e-30) for g in own)
    w = s.abs()
    return float((w * (torch.sign(c.double()) == torch.sign(s))).sum() / w.sum().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--Hs", default="40,20,10,40", help="one per peer, in turn (the peers' H in measured rounds)")
    ap.add_argument("--measure", default="1,2,3,5")
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--h-train", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = VT.VerifyConfig()
    L, B, N = a.seq_len, a.batch, a.parts
    Hs = [int(x) for x in a.Hs.split(",")]
    measure = {int(x) for x in a.measure.split(",")}
    ds = load_dataset(None, seq_len=L)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    P = theta.numel()
    bounds = [round(i * P / N) for i in range(N + 1)]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    peers = [f"peer{c}" for c in "ABCD"]
    trainers = {
        p: InnerTrainer(
            copy.deepcopy(base), ds, seq_len=L, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id=p
        )
        for p in peers
    }
    outer, vmodel, rng = OuterNesterov(0.7, 0.9), copy.deepcopy(base), random.Random(0)
    everything = torch.arange(P, dtype=torch.int64)
    rows = []  # (round, peer, H, sel, plain, trace)
    for r in range(max(measure) + 1):
        deltas, Hr = {}, {}
        for i, (p, tr) in enumerate(trainers.items()):
            H = Hs[i % len(Hs)] if r in measure else a.h_train
            Hr[p] = H
            load_flat_(tr.model, theta)
            tr.run(round=r, inner_steps=H, batch_size=B)
            deltas[p] = compression.decode(compression.encode(theta - flat_params(tr.model), 2048, 0))
        if r in measure:
            for i, p in enumerate(peers):
                H, checker = Hr[p], peers[(i + 1) % len(peers)]
                k = min(H, max(cfg.k_min, min(cfg.k_max, -(-H * 1 // 4))))
                for _ in range(a.samples):
                    steps = sorted(rng.sample(range(H), k))
                    streams = [(p, j) for j in steps] + [(VT.CONTROL_STREAM, c) for c in range(cfg.controls)]
                    g = VC.batch_gradients(
                        vmodel, ds, theta, streams, seed=0, round=r, batch_size=B, seq_len=L, index=everything
                    )
                    for sel in [tuple(range(N))] + list(itertools.combinations(range(N), 2)) + [(j,) for j in range(N)]:
                        idx = VT.sample_elements([ranges[j] for j in sel], cfg.sample_elements, rng.getrandbits(63))
                        s = VC.work_statistics(deltas[p][idx], g[:k, idx], g[k:, idx], [deltas[checker][idx]])
                        rows.append((r, p, H, sel, s.plain, s.trace, weighted_plain(deltas[p][idx], g[:k, idx])))
                        # the null and the flipped contribution over the same elements (the weighted statistic)
                        noise = torch.randn_like(deltas[p][idx])
                        rows.append((r, "noise", H, sel, 0.0, 0.0, weighted_plain(noise, g[:k, idx])))
                        rows.append((r, "flipped", H, sel, 0.0, 0.0, weighted_plain(-deltas[p][idx], g[:k, idx])))
                print(f"round {r} {p} H {H}: measured", flush=True)
        outer.step(theta, torch.stack(list(deltas.values())).mean(0))
    print(f"\nhonest plain / trace (batch {B} x {L}, H {Hs}, rounds {sorted(measure)}, {N} equal parts {ranges})")
    by = collections.defaultdict(list)
    for r, p, H, sel, pl, tr, wp in rows:
        what = p if p in ("noise", "flipped") else "honest"
        by[(what, "whole" if len(sel) == N else str(sel), H)].append((pl, tr, wp))
    for (what, sel, H), v in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        if what != "honest":
            wps = sorted(x[2] for x in v)
            print(f"{what:>7} H {H:>3} {sel:>8}: |s|-weighted plain min {wps[0]:.3f} max {wps[-1]:.3f}")
            continue
        pls, trs, wps = sorted(x[0] for x in v), sorted(x[1] for x in v), sorted(x[2] for x in v)
        print(
            f"H {H:>3} {sel:>8}: plain min {pls[0]:.3f} med {pls[len(pls) // 2]:.3f} "
            f"<{cfg.plain_min}: {sum(x < cfg.plain_min for x in pls)}/{len(pls)} | trace min {trs[0]:.3f} "
            f"med {trs[len(trs) // 2]:.3f} <{cfg.trace_min}: {sum(x < cfg.trace_min for x in trs)}/{len(trs)} | "
            f"|s|-weighted plain min {wps[0]:.3f} med {wps[len(wps) // 2]:.3f}"
        )


if __name__ == "__main__":
    main()
