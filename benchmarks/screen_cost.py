"""What a screening check costs against a full verified-work check (issue 28).

A screening check (``geomesh_p2p.trust.verify_check.screen_contribution``) is the loss-gain test alone: ``2 x (k
+ m)`` forward passes (k = min(8, H) assigned batches, m = 16 controls), ``2k + m`` once the round's control
losses are cached (the second and later newcomers of a round). A full check (``check_contribution``) of an honest
contribution runs the same gain test, then the gradients of k' = clamp(ceil(H/4), 4, 16) of its batches and 4
controls (forward and backward). Both are timed here on the tiny preset, one thread, on an honest contribution of
H AdamW steps (the screen decides a poisoner after the same forward passes; a full check of one stops there too).

    python benchmarks/screen_cost.py                       # batch 4 x 32 (the process tests) and 8 x 64
    python benchmarks/screen_cost.py --shapes 4x32 --H 5,20 --repeat 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geomesh_p2p.data import load_dataset  # noqa: E402
from geomesh_p2p.exchange import codec as compression  # noqa: E402
from geomesh_p2p.model.build import build_model, flat_params, load_flat_  # noqa: E402
from geomesh_p2p.model.training import InnerTrainer  # noqa: E402
from geomesh_p2p.trust import verify_check as VC  # noqa: E402
from geomesh_p2p.trust import verify_task as VT  # noqa: E402


def task_of(cfg, kind: str, B: int, L: int, H: int, P: int) -> VT.VerifyTask:
    k = VT._k_of(cfg, H)
    return VT.VerifyTask(
        round=0,
        verifier="v",
        accused="a",
        parts=(0,),
        ranges=((0, P),),
        steps_done=H,
        steps=() if kind == VT.SCREEN else tuple(range(k)),
        controls=cfg.gain_controls if kind == VT.SCREEN else cfg.controls,
        batch_size=B,
        seq_len=L,
        element_seed=12345,
        n_elements=0 if kind == VT.SCREEN else min(P, cfg.sample_elements),
        full_test=kind != VT.SCREEN and H <= cfg.max_full_steps,
        kind=kind,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x32,8x64", help="batch x seq_len entries (default: %(default)s)")
    ap.add_argument("--H", default="5,20", help="inner steps of the contribution (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = VT.VerifyConfig()
    print("| batch x seq | H | screen s | screen, controls cached s | full check s | screen / full | cached / full |")
    print("|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        ds = load_dataset(None, seq_len=L)
        base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
        theta = flat_params(base)
        P = theta.numel()
        for H in (int(x) for x in a.H.split(",")):
            m = copy.deepcopy(base)
            t = InnerTrainer(m, ds, seq_len=L, lr=1e-3, warmup_steps=5, total_steps=100, seed=0, peer_id="a")
            t.run(round=0, inner_steps=H, batch_size=B)
            delta = theta - flat_params(m)
            packets = {"a": {0: compression.encode(delta, 2048, H * B * L)}}
            model = copy.deepcopy(base)
            kw = dict(model=model, dataset=ds, theta=theta, seed=0, packets=packets, lr=1e-3, weight_decay=0.1)
            times: dict[str, list[float]] = {"screen": [], "cached": [], "full": []}
            for _ in range(a.repeat):
                cache: dict = {}
                t0 = time.perf_counter()
                _, v = VC.screen_contribution(cfg, task_of(cfg, VT.SCREEN, B, L, H, P), cache=cache, **kw)
                times["screen"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                VC.screen_contribution(cfg, task_of(cfg, VT.SCREEN, B, L, H, P), cache=cache, **kw)
                times["cached"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _, fv, _ = VC.check_contribution(cfg, task_of(cfg, VT.CHECK, B, L, H, P), checker="v", **kw)
                times["full"].append(time.perf_counter() - t0)
                load_flat_(model, theta)
            s, c, f = (statistics.median(times[k]) for k in ("screen", "cached", "full"))
            print(
                f"| {B} x {L} | {H} | {s:.3f} | {c:.3f} | {f:.3f} | {s / f:.2f} | {c / f:.2f} |  ({v.outcome}, {fv.outcome})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
