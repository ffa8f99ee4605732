"""What verified work (geomesh_p2p/trust/verify.py) can tell apart: the measurement behind its thresholds.

Trains the tiny preset DiLoCo-style on the shipped KJV corpus: 4 peers, each with its own persistent
inner AdamW (as the node does), ``--h-train`` inner steps per round, sign-compressed mean, outer Nesterov
0.7 / 0.9. At the ``--measure`` rounds, contributor A's contribution is built for H = 5, 10, 20, 40
(from A's real optimizer state), honest and as attacks:

  honest / honest-bf16   H AdamW steps (bf16: under CPU bf16 autocast, a proxy for a GPU contributor)
  flipped                -honest
  noise                  Gaussian, honest mean |x|
  wrong-data             A's optimizer on another peer's batches (a free rider copying a peer is alike)
  stale                  A's previous round delta
  stale-global           the previous round's global update (the adversary's "stale")
  first-2 / first-half   only the first 2 / H/2 steps trained, rescaled to the honest magnitude

and checked as verify.py does (``--samples`` draws of the k own steps, 4 control batches, 2^18 elements
over the whole model, the checker's own contribution = peer B's real round delta as the basis; with
``--basis others`` the three other peers' deltas). Prints min / mean / max of ``trace`` and ``plain``
per (H, candidate) and the share below each threshold; ``--adamw`` also prints the first idea (sign
agreement of a fresh k-step AdamW re-run, k = 1, 2, 4, with the contribution). Plus float noise: the
gradient sign agreement of fp32 vs bf16 autocast and of 1 vs 2 threads.

    python benchmarks/verify_agreement.py                      # ~15 min on 2 busy cores
    python benchmarks/verify_agreement.py --measure 1,4 --samples 4 --Hs 5,20   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.training import InnerTrainer

CANDIDATES = (
    "honest",
    "honest-bf16",
    "flipped",
    "noise",
    "wrong-data",
    "stale",
    "stale-global",
    "first-2",
    "first-half",
)


def bf16():
    return torch.autocast(device_type="cpu", dtype=torch.bfloat16)


def roundtrip(v: torch.Tensor) -> torch.Tensor:
    return compression.decode(compression.encode(v, 2048, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--measure", default="1,4,8,13,19")
    ap.add_argument("--Hs", default="5,10,20,40")
    ap.add_argument("--h-train", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--samples", type=int, default=10, help="draws of the own steps per (round, H)")
    ap.add_argument("--basis", choices=["own", "others"], default="own")
    ap.add_argument("--adamw", action="store_true", help="also the fresh k-step AdamW re-run (the first idea)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    Hs = [int(x) for x in a.Hs.split(",")]
    measure = {int(x) for x in a.measure.split(",")}
    cfg = VT.VerifyConfig()
    L, B, lr = a.seq_len, a.batch, 1e-3
    ds = load_dataset(None, seq_len=L)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    P = theta.numel()
    peers = ["peerA", "peerB", "peerC", "peerD"]
    trainers = {
        p: InnerTrainer(copy.deepcopy(base), ds, seq_len=L, lr=lr, warmup_steps=20, total_steps=2000, seed=0, peer_id=p)
        for p in peers
    }
    outer = OuterNesterov(0.7, 0.9)
    vmodel = copy.deepcopy(base)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    prev, prev_agg = {}, None
    stats: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    adamw: dict[tuple[int, int, str], list[float]] = {}
    for r in range(a.rounds):
        t0 = time.time()
        deltas = {}
        for p, tr in trainers.items():
            if r in measure and p == "peerA":
                continue  # A's own round delta is taken below, after its candidates (same optimizer state)
            load_flat_(tr.model, theta)
            tr.run(round=r, inner_steps=a.h_train, batch_size=B)
            deltas[p] = theta - flat_params(tr.model)
        if r in measure:

            def train(steps, data=None, amp=False):
                m = copy.deepcopy(trainers["peerA"].model)
                load_flat_(m, theta)
                t = InnerTrainer(
                    m, ds, seq_len=L, lr=lr, warmup_steps=20, total_steps=2000, seed=0, peer_id=data or "peerA"
                )
                t.load_state_dict(copy.deepcopy(trainers["peerA"].state_dict()))
                if amp:
                    t._autocast = bf16
                t.run(round=r, inner_steps=steps, batch_size=B)
                return theta - flat_params(m)

            index = VT.sample_elements([(0, P)], cfg.sample_elements, 1000 + r)
            basis_src = [deltas["peerB"]] if a.basis == "own" else [deltas[p] for p in ("peerB", "peerC", "peerD")]
            basis = [roundtrip(d)[index] for d in basis_src]
            need = sorted(set(range(max(Hs))))
            g_all = VC.batch_gradients(
                vmodel,
                ds,
                theta,
                [("peerA", j) for j in need] + [(VT.CONTROL_STREAM, i) for i in range(cfg.controls)],
                seed=0,
                round=r,
                batch_size=B,
                seq_len=L,
                index=index,
            )
            g, ctrl = g_all[: len(need)], g_all[len(need) :]
            # float noise of the gradient itself (whole vector)
            full = torch.arange(P)
            g0 = VC.batch_gradients(
                vmodel, ds, theta, [("peerA", 0)], seed=0, round=r, batch_size=B, seq_len=L, index=full
            )[0]
            m2 = copy.deepcopy(vmodel)
            load_flat_(m2, theta)
            x = ds.sample_batch(seed=0, peer_id="peerA", round=r, step=0, batch_size=B, seq_len=L)
            with bf16():
                loss = m2(input_ids=x, labels=x).loss
            loss.backward()
            gb = torch.cat([p.grad.reshape(-1) for _, p in m2.named_parameters()])
            torch.set_num_threads(2 if a.threads == 1 else 1)
            gt = VC.batch_gradients(
                vmodel, ds, theta, [("peerA", 0)], seed=0, round=r, batch_size=B, seq_len=L, index=full
            )[0]
            torch.set_num_threads(a.threads)
            print(
                f"round {r}: gradient signs fp32 vs bf16 autocast agree on "
                f"{float((torch.sign(g0) == torch.sign(gb)).double().mean()):.4f} "
                f"(|g|-weighted {float((g0.abs() * (torch.sign(g0) == torch.sign(gb))).sum() / g0.abs().sum()):.5f}),"
                f" 1 vs 2 threads on {float((torch.sign(g0) == torch.sign(gt)).double().mean()):.6f}",
                flush=True,
            )
            for H in Hs:
                honest = train(H)
                two, half = train(2), train(max(1, H // 2))
                cands = {
                    "honest": honest,
                    "honest-bf16": train(H, amp=True),
                    "flipped": -honest,
                    "noise": torch.randn(P, generator=gen) * honest.abs().mean(),
                    "wrong-data": train(H, data="peerB"),
                    "first-2": two * (honest.abs().mean() / two.abs().mean()),
                    "first-half": half * (honest.abs().mean() / half.abs().mean()),
                }
                if "peerA" in prev:
                    cands["stale"], cands["stale-global"] = prev["peerA"], prev_agg
                enc = compression.encode(honest, 2048, 0)
                print(
                    f"  r={r} H={H}: honest block scale / (H x lr): max {float(enc.scales.max()) / (H * lr):.3f}"
                    f" mean {float(enc.scales.mean()) / (H * lr):.3f}",
                    flush=True,
                )
                k = VT._k_of(cfg, H)
                draws = [sorted(rng.sample(range(H), k)) for _ in range(a.samples)]
                for name, cand in cands.items():
                    c = roundtrip(cand)[index]
                    for js in draws:
                        s = VC.work_statistics(c, g[js], ctrl, basis)
                        stats.setdefault((H, name), []).append((r, s.trace, s.plain))
                if a.adamw:
                    for kk in (1, 2, 4):
                        fresh = copy.deepcopy(vmodel)
                        load_flat_(fresh, theta)
                        t = InnerTrainer(
                            fresh, ds, seq_len=L, lr=lr, warmup_steps=20, total_steps=2000, seed=0, peer_id="peerA"
                        )
                        t.global_step = trainers["peerA"].global_step
                        t.run(round=r, inner_steps=kk, batch_size=B)
                        dk = (theta - flat_params(fresh))[index]
                        for name, cand in cands.items():
                            adamw.setdefault((H, kk, name), []).append(
                                float((torch.sign(roundtrip(cand)[index]) == torch.sign(dk)).double().mean())
                            )
            load_flat_(trainers["peerA"].model, theta)
            trainers["peerA"].run(round=r, inner_steps=a.h_train, batch_size=B)
            deltas["peerA"] = theta - flat_params(trainers["peerA"].model)
        agg = torch.stack([roundtrip(d) for d in deltas.values()]).mean(0)
        outer.step(theta, agg)
        prev, prev_agg = deltas, agg
        print(f"round {r}: {time.time() - t0:.1f}s", flush=True)
    print(
        f"\ntrace and plain, min/mean/max over rounds {sorted(measure)} x {a.samples} draws "
        f"(k = clamp(ceil(H/4), 4, 16), {cfg.controls} controls, basis {a.basis}); share below "
        f"trace_hard {cfg.trace_hard} / trace_min {cfg.trace_min}, plain_min {cfg.plain_min}"
    )
    for H in Hs:
        for name in CANDIDATES:
            v = stats.get((H, name))
            if not v:
                continue
            tr = torch.tensor([x[1] for x in v])
            pl = torch.tensor([x[2] for x in v])
            print(
                f"H={H:2d} k={VT._k_of(cfg, H):2d} {name:12s} trace {tr.min():.3f}/{tr.mean():.3f}/{tr.max():.3f}"
                f"  plain {pl.min():.3f}/{pl.mean():.3f}/{pl.max():.3f}  <{cfg.trace_hard}: "
                f"{float((tr < cfg.trace_hard).double().mean()):.2f}  <{cfg.trace_min}: "
                f"{float((tr < cfg.trace_min).double().mean()):.2f}  plain<{cfg.plain_min}: "
                f"{float((pl < cfg.plain_min).double().mean()):.2f}"
            )
    if adamw:
        print("\nfresh k-step AdamW re-run: sign agreement with the contribution, min/max over rounds")
        for (H, kk, name), v in sorted(adamw.items()):
            print(f"H={H:2d} k={kk} {name:12s} {min(v):.3f}/{max(v):.3f}")


if __name__ == "__main__":
    main()
