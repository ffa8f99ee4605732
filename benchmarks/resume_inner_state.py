#!/usr/bin/env python3
"""A swarm stopped and resumed from checkpoints, with and without the peers' inner optimizer state (fresh user,
session 37: eval perplexity 122.97 before the stop, 129.02 and 128.91 after). In one process: ``--peers`` inner
trainers of the ``tiny`` preset on the shipped corpus (seq 32, batch 8, ``--h`` AdamW steps a round), their fp32
mean pseudo-gradient, the outer Nesterov step of the run config; ``--before`` rounds, then the state is "resumed"
into fresh trainers whose inner state is either fresh (zero moments: every release before this file) or taken back
through ``model/inner_ckpt.py``'s files, and ``--after`` rounds run; the run that never stopped is printed last.
Eval perplexity (8 held-out batches of 8) after each round.

Usage::

    PYTHONPATH=$PWD python benchmarks/resume_inner_state.py            # H 10, 12 rounds, then 6 (~70 s, 1 thread)
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.inner_ckpt import load_inner_state, save_inner_state
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.training import InnerTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--h", type=int, default=10, help="inner steps a round")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--before", type=int, default=12, help="rounds before the stop")
    ap.add_argument("--after", type=int, default=6, help="rounds after the resume")
    a = ap.parse_args()
    torch.set_num_threads(1)
    run = RunConfig(seq_len=32)
    ds = load_dataset(None, run.seq_len)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    kw = dict(seq_len=run.seq_len, lr=run.inner_lr, weight_decay=0.1, warmup_steps=run.warmup_steps)
    kw.update(total_steps=run.total_inner_steps, steps_per_round=a.h)
    ev = InnerTrainer(copy.deepcopy(base), ds, seq_len=run.seq_len)

    def trainers() -> list[InnerTrainer]:
        return [InnerTrainer(copy.deepcopy(base), ds, peer_id=f"peer{i}", **kw) for i in range(a.peers)]

    def rounds(trs: list[InnerTrainer], theta: torch.Tensor, outer: OuterNesterov, r0: int, n: int) -> list[float]:
        ppl = []
        for r in range(r0, r0 + n):
            agg = torch.zeros_like(theta)
            for tr in trs:
                load_flat_(tr.model, theta)
                tr.run(round=r, inner_steps=a.h, batch_size=8)
                agg += (theta - flat_params(tr.model)) / len(trs)
            outer.step(theta, agg)
            load_flat_(ev.model, theta)
            ppl.append(round(ev.evaluate(max_batches=8, batch_size=8), 2))
        return ppl

    theta = flat_params(base).clone()
    outer = OuterNesterov(run.outer_lr, run.outer_momentum)
    trs = trainers()
    print(f"before the stop (last 3 of {a.before} rounds): {rounds(trs, theta, outer, 0, a.before)[-3:]}")
    with tempfile.TemporaryDirectory(prefix="resume-inner-") as d:
        for i, tr in enumerate(trs):
            save_inner_state(tr, d, f"ckpt-peer{i}", round=a.before, digest="-", config_hash="-")
        for kept in (False, True):
            theta2, outer2 = theta.clone(), copy.deepcopy(outer)
            new = trainers()
            for i, tr in enumerate(new if kept else []):
                assert load_inner_state(tr, d, f"ckpt-peer{i}", round=a.before, digest="-", config_hash="-")[0]
            label = "kept " if kept else "fresh"
            print(f"resumed, inner state {label}: {rounds(new, theta2, outer2, a.before, a.after)}")
    print(f"never stopped             : {rounds(trs, theta, outer, a.before, a.after)}")


if __name__ == "__main__":
    main()
