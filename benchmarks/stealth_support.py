"""The support filter against the issue-28 red team's stealthy attacks: measured on real training of the tiny model.

Trains the tiny preset DiLoCo-style on the shipped KJV corpus in one process: 4 peers, each with its own
persistent inner AdamW (as the node does) and its own number of inner steps per round (``--steps``: the process
runs' spread, a slow peer of 1-6 steps and others of 5-25), sign-compressed pushes (block 2048), the real
aggregation (``exchange/robust.aggregate_part``: meanmed, agreement filter 0.5) over the whole vector as one part,
outer Nesterov 0.7 / 0.9 with the momentum clip 2. Peer 0 is the attacker in the attack runs (it holds the most
steps: the worst case), using the red team's own functions (``tests/adversary.py``):

  none            every peer honest
  absent          peer 0 sends nothing (the honest peers alone: the reference for an attacker that is dropped)
  stealth-flip    trains honestly, flips the sign of the 45% largest-magnitude coordinates
  stealth-block   the same within each codec block (the red team's milder variant)
  stale           re-sends the previous round's aggregate
  partial         trains only the last 25% of its steps (claims all)

Each run is repeated with the support filter off and on (``min_support`` 0.5; ``--filters``). Per round and contributor it
records the steps, the plain sign agreement with the first-pass consensus and the *support* (its signs' share of
the others' summed vote margin, ``robust._robust_sign`` step 3b), and whether the filter dropped it; it prints
the honest contributors' support by step count (min / mean over the runs), the attackers', and the final eval
perplexity of each run against the honest reference with the same filter.

    python benchmarks/stealth_support.py --rounds 15             # ~10 min on 2 busy cores
    python benchmarks/stealth_support.py --rounds 4 --attacks none,stealth-flip --steps 1,5,12,25
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from geomesh_p2p.data import load_dataset  # noqa: E402
from geomesh_p2p.exchange import codec as compression  # noqa: E402
from geomesh_p2p.exchange.robust import aggregate_part  # noqa: E402
from geomesh_p2p.model.build import build_model, flat_params, load_flat_  # noqa: E402
from geomesh_p2p.model.optim import OuterNesterov  # noqa: E402
from geomesh_p2p.model.training import InnerTrainer  # noqa: E402
from tests.adversary import _StepShift, partial_steps, stealth_flip  # noqa: E402

ATTACKS = ("none", "absent", "stealth-flip", "stealth-block", "stale", "partial")
BLOCK = 2048


def support_and_agreement(packets: list) -> tuple[list[float], list[float]]:
    """Per packet: the support (share of the others' |vote margin| its signs side with, over its voting
    elements) and the plain agreement with the unweighted sign-mean consensus (where both are non-zero).
    Straightforward float64 code, independent of robust.py's table and streaming paths."""
    votes = []
    for p in packets:
        s = torch.sign(compression.decode(p)).to(torch.int32)
        votes.append(s)
    v = torch.stack(votes)  # [C, P], 0 where abstaining
    margin = v.sum(dim=0)
    cons = torch.sign(margin)
    sup, agr = [], []
    for i in range(len(packets)):
        m = margin - v[i]
        live = v[i] != 0
        w = (m.abs() * live).double()
        sup.append(float((w * (v[i] * m > 0)).sum() / w.sum()) if float(w.sum()) > 0 else float("nan"))
        both = live & (cons != 0)
        agr.append(float((v[i] == cons)[both].double().mean()) if bool(both.any()) else float("nan"))
    return sup, agr


def run(attack: str, support: bool, a, ds, base) -> dict:
    torch.manual_seed(0)
    theta = flat_params(base).clone()
    steps = [int(x) for x in a.steps.split(",")]
    peers = [f"peer{i}" for i in range(len(steps))]
    trainers = [
        InnerTrainer(
            copy.deepcopy(base), ds, seq_len=a.seq_len, lr=1e-3, warmup_steps=20, total_steps=2000, seed=0, peer_id=p
        )
        for p in peers
    ]
    outer = OuterNesterov(0.7, 0.9, momentum_clip=2.0, block_size=BLOCK)
    prev = None
    rows = []
    for r in range(a.rounds):
        packets, toks = [], []
        for i, tr in enumerate(trainers):
            load_flat_(tr.model, theta)
            H = steps[i]
            if i == 0 and attack == "absent":
                d = theta
            elif i == 0 and attack == "stale":
                d = prev.clone() if prev is not None else torch.zeros_like(theta)
            elif i == 0 and attack == "partial":
                skip, train = partial_steps(H)
                honest = tr.dataset
                tr.dataset = _StepShift(honest, skip)
                tr.run(round=r, inner_steps=train, batch_size=a.batch)
                tr.dataset = honest
                d = theta - flat_params(tr.model)
            else:
                tr.run(round=r, inner_steps=H, batch_size=a.batch)
                d = theta - flat_params(tr.model)
                if i == 0 and attack == "stealth-flip":
                    d = stealth_flip(d)
                elif i == 0 and attack == "stealth-block":
                    d = torch.cat([stealth_flip(d[j : j + BLOCK]) for j in range(0, d.numel(), BLOCK)])
            if i == 0 and attack == "absent":
                continue
            tokens = H * a.batch * a.seq_len
            packets.append(compression.encode(d.contiguous(), BLOCK, tokens))
            toks.append(tokens)
        sup, agr = support_and_agreement(packets)
        dropped: list = []
        agg = aggregate_part(
            list(zip(toks, packets)),
            theta.numel(),
            rule="meanmed",
            clip_k=4.0,
            weight_cap=1.0,
            min_agreement=0.5,
            min_support=0.5 if support else None,
            dropped=dropped,
        )
        outer.step(theta, agg)
        prev = agg.clone()
        shown = steps[1:] if attack == "absent" else steps
        rows.append({"round": r, "steps": shown, "support": sup, "agreement": agr, "dropped": sorted(dropped)})
    load_flat_(trainers[0].model, theta)
    ppl = trainers[0].evaluate(max_batches=16, batch_size=16)
    return {"attack": attack, "support_filter": support, "ppl": ppl, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", default="25,1,6,14", help="inner steps per peer; peer 0 attacks (default %(default)s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--filters", default="off,on", help="the support filter's settings to run (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ds = load_dataset(None, seq_len=a.seq_len)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    results = []
    for attack in a.attacks.split(","):
        if attack not in ATTACKS:
            ap.error(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
        for support in [f == "on" for f in a.filters.split(",")]:
            t0 = time.time()
            res = run(attack, support, a, ds, base)
            results.append(res)
            drops = [(row["round"], row["dropped"]) for row in res["rows"] if row["dropped"]]
            print(
                f"{attack:14} support filter {'on ' if support else 'off'}: ppl {res['ppl']:.1f}, dropped "
                f"(round, [peer]) {drops or 'none'} ({time.time() - t0:.0f} s)",
                flush=True,
            )
            for row in res["rows"]:
                print(
                    f"   round {row['round']:2}: steps {row['steps']} support "
                    + " ".join(f"{x:.3f}" for x in row["support"])
                    + "  agreement "
                    + " ".join(f"{x:.3f}" for x in row["agreement"]),
                    flush=True,
                )
    ref = {r["support_filter"]: r["ppl"] for r in results if r["attack"] == "none"}
    steps = [int(x) for x in a.steps.split(",")]
    print(f"\nsteps per peer {steps} (peer 0 attacks), {a.rounds} rounds, batch {a.batch} x {a.seq_len}")
    print(
        "| attack | support filter | eval ppl | x honest (same filter) | attacker support min / mean / max | "
        "attacker dropped in rounds |"
    )
    print("|---|---|---|---|---|---|")
    for res in results:
        att = [row["support"][0] for row in res["rows"]] if res["attack"] != "absent" else [float("nan")]
        dr = [row["round"] for row in res["rows"] if 0 in row["dropped"] and res["attack"] != "absent"]
        x = res["ppl"] / ref[res["support_filter"]] if res["support_filter"] in ref else float("nan")
        print(
            f"| {res['attack']} | {'on' if res['support_filter'] else 'off'} | {res['ppl']:.1f} | {x:.2f} | "
            f"{min(att):.3f} / {sum(att) / len(att):.3f} / {max(att):.3f} | {len(dr)} of {a.rounds} |"
        )
    print("\nhonest contributors' support by inner steps (all runs, honest peers only; min / mean / n):")
    by: dict[int, list[float]] = {}
    for res in results:
        for row in res["rows"]:
            for i, s in enumerate(row["support"]):
                if i == 0 and res["attack"] not in ("none", "absent"):
                    continue
                by.setdefault(row["steps"][i], []).append(s)
    for h in sorted(by):
        v = by[h]
        print(f"  H = {h:3}: {min(v):.3f} / {sum(v) / len(v):.3f} / {len(v)}")
    honest_drops = sum(
        1 for res in results for row in res["rows"] for i in row["dropped"] if i != 0 or res["attack"] == "none"
    )
    print(f"honest contributions dropped: {honest_drops}")


if __name__ == "__main__":
    main()
