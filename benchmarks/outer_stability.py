#!/usr/bin/env python3
"""Outer-step stability of a young swarm at few inner steps per round, in process (no network).

3 simulated peers train the ``tiny`` preset on the shipped corpus (seq_len 32, batch 8, like the e2e swarms'
peers) for ``--rounds`` rounds of ``--steps`` inner steps each, through the code a peer runs: its
:class:`~geomesh_p2p.model.training.InnerTrainer` (AdamW state kept across rounds, the swarm's lr schedule
over ``uniform_inner_steps``), the pseudo-gradient, the sign codec part by part (optionally with error
feedback), the run's aggregation rule per owner part (``meanmed`` by default), and the outer step
(:func:`~geomesh_p2p.model.optim.outer_step_per_part`). Every variant starts from the same weights and data,
so their curves differ only by what the variant changes.

Prints eval perplexity per round for each variant side by side, the largest one-round ratio
``ppl[r+1] / ppl[r]`` and the final perplexity.

Usage::

    PYTHONPATH=$PWD python benchmarks/outer_stability.py                   # the default set of variants
    PYTHONPATH=$PWD python benchmarks/outer_stability.py --rounds 24 --steps 3 --variants sign,sign-unclipped
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import aggregate_part
from geomesh_p2p.model.build import build_model, flat_params, load_flat_, pseudo_gradient
from geomesh_p2p.model.optim import OuterNesterov, outer_step_per_part
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.node.training import trainer_kwargs
from geomesh_p2p.schema.partition import part_sizes


@dataclass(frozen=True)
class Variant:
    """One run of the experiment: what it changes against the run config's defaults."""

    label: str
    push: str = "sign"  # "sign" (CSS packets) or "fp32" (the diloco/awb push)
    error_feedback: bool = False
    momentum: Optional[float] = None  # None: the run config's
    outer_lr: Optional[float] = None
    reset_inner: bool = False  # a fresh inner AdamW every round
    momentum_clip: Optional[float] = None  # None: the run config's outer_momentum_clip; 0: off


VARIANTS = {
    "sign": Variant("sign, momentum clip 2 (default)"),
    "sign-unclipped": Variant("sign, no clip (before)", momentum_clip=0.0),
    "fp32": Variant("fp32 mean (diloco)", push="fp32"),
    "sign-ef": Variant("sign + EF, no clip", error_feedback=True, momentum_clip=0.0),
    "mom0": Variant("sign, mu=0, no clip", momentum=0.0, momentum_clip=0.0),
    "reset": Variant("sign, inner reset, no clip", reset_inner=True, momentum_clip=0.0),
}


def make_outer(run: RunConfig, v: Variant) -> OuterNesterov:
    """The outer optimizer a peer of ``run`` builds (geomesh_p2p.node.training), with the variant's changes."""
    clip = run.outer_momentum_clip if v.momentum_clip is None else v.momentum_clip
    return OuterNesterov(
        lr=run.outer_lr if v.outer_lr is None else v.outer_lr,
        momentum=run.outer_momentum if v.momentum is None else v.momentum,
        momentum_clip=clip if v.push == "sign" else 0.0,
        block_size=run.block_size,
    )


def run_variant(v: Variant, ns, dataset, theta0: torch.Tensor, base_model, evaluator: InnerTrainer) -> dict:
    run = RunConfig(seq_len=ns.seq_len, seed=ns.seed)
    p = theta0.numel()
    block = run.block_size
    sizes = part_sizes(p, [1.0] * ns.peers, align=block, equal=True)
    ranges, s = [], 0
    for n in sizes:
        if n:
            ranges.append((s, s + n))
        s += n
    # the peers' own inner-trainer arguments (full speed, no autocast)
    kw = trainer_kwargs(run, SimpleNamespace(speed_factor=1.0, amp=False))
    names = [f"peer{i}" for i in range(ns.peers)]
    trainers = [InnerTrainer(copy.deepcopy(base_model), dataset, peer_id=n, **kw) for n in names]
    efs = [compression.ErrorFeedback(p, block) if v.error_feedback else None for _ in names]
    outer = make_outer(run, v)
    theta = theta0.clone()
    load_flat_(evaluator.model, theta)
    ppl = [evaluator.evaluate(max_batches=ns.eval_batches, batch_size=8)]
    losses, step_norms = [], []
    for r in range(ns.rounds):
        deltas, tokens, lr = [], [], []
        for i, tr in enumerate(trainers):
            if v.reset_inner and r > 0:
                trainers[i] = tr = InnerTrainer(tr.model, dataset, peer_id=names[i], **kw)
            load_flat_(tr.model, theta)
            res = tr.run(round=r, inner_steps=ns.steps, batch_size=ns.batch)
            deltas.append(pseudo_gradient(tr.model, theta))
            tokens.append(res.tokens)
            lr.append(tr.last_lr)
        losses.append(res.mean_loss)
        agg = torch.empty(p)
        if v.push == "fp32":
            for s0, e0 in ranges:
                agg[s0:e0] = aggregate_part(
                    [(n, d[s0:e0].contiguous()) for n, d in zip(tokens, deltas)],
                    e0 - s0,
                    rule="mean",
                    encoding="fp32",
                    clip_k=None,
                    weight_cap=run.weight_cap,
                )
        else:
            packets = []
            for d, n, ef in zip(deltas, tokens, efs):
                pk = ef.encode(d, n) if ef is not None else compression.encode(d, block, n)
                packets.append(pk)
            for s0, e0 in ranges:
                agg[s0:e0] = aggregate_part(
                    [(n, compression.slice_packet(pk, s0, e0)) for n, pk in zip(tokens, packets)],
                    e0 - s0,
                    rule=run.aggregation,
                    clip_k=run.clip_k,
                    weight_cap=run.weight_cap,
                    min_agreement=run.min_agreement,
                )
        before = theta.clone()
        outer_step_per_part(outer, theta, agg, ranges, r)
        step_norms.append(float((theta - before).norm()))
        load_flat_(evaluator.model, theta)
        ppl.append(evaluator.evaluate(max_batches=ns.eval_batches, batch_size=8))
        if ns.verbose:
            fp = torch.stack(deltas).mean(0)
            print(
                f"  {v.label:28s} r{r:2d} lr {lr[0]:.2e} |agg| {float(agg.norm()):.3f} |fp32 mean| "
                f"{float(fp.norm()):.3f} |step| {step_norms[-1]:.3f} loss {losses[-1]:.3f} ppl {ppl[-1]:.0f}",
                flush=True,
            )
    ratios = [b / a for a, b in zip(ppl, ppl[1:])]
    return {"ppl": ppl, "max_ratio": max(ratios[1:]) if len(ratios) > 1 else float("nan"), "step": step_norms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2, help="inner steps per round (default 2, as the e2e swarms)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--variants", default="sign-unclipped,sign", help=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verbose", action="store_true")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    dataset = load_dataset(None, ns.seq_len)
    base = build_model("tiny", vocab_size=dataset.vocab_size, seed=ns.seed)
    theta0 = flat_params(base)
    evaluator = InnerTrainer(copy.deepcopy(base), dataset, seq_len=ns.seq_len)
    out = {}
    for key in ns.variants.split(","):
        t0 = time.perf_counter()
        out[key] = run_variant(VARIANTS[key], ns, dataset, theta0, base, evaluator)
        print(f"# {VARIANTS[key].label}: {time.perf_counter() - t0:.1f} s", flush=True)
    keys = list(out)
    print()
    print(f"tiny, {ns.peers} peers x {ns.steps} inner steps x batch {ns.batch} x seq {ns.seq_len}, seed {ns.seed}")
    print("| round | " + " | ".join(VARIANTS[k].label for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in range(ns.rounds + 1):
        print(f"| {r} | " + " | ".join(f"{out[k]['ppl'][r]:.0f}" for k in keys) + " |")
    print("| max ppl[r+1]/ppl[r] (r >= 1) | " + " | ".join(f"{out[k]['max_ratio']:.2f}" for k in keys) + " |")
    print("| final ppl | " + " | ".join(f"{out[k]['ppl'][-1]:.0f}" for k in keys) + " |")
    print("| best ppl | " + " | ".join(f"{min(out[k]['ppl']):.0f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
