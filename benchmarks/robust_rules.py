"""Choose the aggregation rule by measurement: honest convergence and damage under attack, in the simulator.

Runs the virtual-time simulator (real training of the tiny proxy, real codec and outer optimizer) on a
profile with each aggregation rule (geomesh_p2p.exchange.robust.RULES) and each attack by ONE peer (the
fastest, which holds the largest token budget: the worst case), and prints the final eval perplexity of
each (rule, attack) against the same rule's clean run. Every row is measured in this one run.

    python benchmarks/robust_rules.py --rounds 15 --rules mean,vote,meanmed --attacks none,flip,flipmax,zeros

Attacks: ``flip`` (-delta), ``flipmax`` (-delta, block scales x1000, token claim x100), ``zeros``, ``noise``
(Gaussian with the delta's norm), ``stale`` (the previous round's aggregate, re-sent as its own).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ATTACKS = ("none", "flip", "flipmax", "zeros", "noise", "stale")


def _run(args) -> tuple[str, str, float, list[float]]:
    profile_name, rounds, rule, attack, seed, attackers, weight_cap = args
    rule, _, agree = rule.partition("@")
    agree = float(agree) if agree else None
    import torch

    torch.set_num_threads(1)
    from geomesh_p2p.exchange import codec as compression
    from geomesh_p2p.exchange.robust import aggregate_part
    from geomesh_p2p.sim.engine import Simulator as SimEngine
    from geomesh_p2p.sim.hardware import load_profile
    from geomesh_p2p.sim.methods import parse_method

    class Engine(SimEngine):
        prev = None

        def _aggregate(self, spec, deltas, tokens, efs, plan):
            if sum(tokens) == 0:
                return None
            gen = torch.Generator().manual_seed(1234 + len(deltas))
            packets, toks = [], list(tokens)
            for i, d in enumerate(deltas):
                if i < attackers and attack != "none":
                    if attack in ("flip", "flipmax"):
                        d = -d
                    elif attack == "zeros":
                        d = torch.zeros_like(d)
                    elif attack == "noise":
                        d = torch.randn(d.shape, generator=gen) * (d.norm() / d.numel() ** 0.5)
                    elif attack == "stale":
                        d = self.prev if self.prev is not None else torch.zeros_like(d)
                    if attack == "flipmax":
                        toks[i] = toks[i] * 100
                p = compression.encode(d, self.block, toks[i])
                if attack == "flipmax" and i < attackers:
                    p = compression.SignPacket(p.numel, p.block_size, p.tokens, p.signs, p.scales * 1000)
                packets.append(p)
            out = torch.empty(self.numel)
            for _, s, e in plan.owners():
                parts = [(n, compression.slice_packet(p, s, e)) for n, p in zip(toks, packets)]
                mean = aggregate_part(
                    parts, e - s, rule=rule, clip_k=self.tr.clip_k, weight_cap=weight_cap, min_agreement=agree
                )
                pkt = compression.encode_as(spec.aggregate, mean.contiguous(), self.block, sum(toks))
                out[s:e] = compression.decode_any(pkt)
            self.prev = out.clone()
            return out

    prof = load_profile(profile_name)
    eng = Engine(prof, rounds=rounds, seed=seed)
    res = eng.run(parse_method("geomesh"))
    curve = [c[1] for c in res.curve] if hasattr(res, "curve") else []
    return rule + (f"@{agree}" if agree else ""), attack, float(curve[-1]) if curve else float("nan"), curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="paper4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rules", default="mean,vote,meanmed")
    ap.add_argument("--attacks", default="none,flip,flipmax,zeros,noise,stale")
    ap.add_argument("--attackers", type=int, default=1, help="how many of the peers attack (the first ones)")
    ap.add_argument("--weight-cap", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    rules = a.rules.split(",")
    attacks = a.attacks.split(",")
    for x in attacks:
        if x not in ATTACKS:
            ap.error(f"--attacks: unknown attack {x!r} (known: {', '.join(ATTACKS)})")
    jobs = [(a.profile, a.rounds, r, x, a.seed, a.attackers, a.weight_cap) for r in rules for x in attacks]
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        results = list(ex.map(_run, jobs))
    table = {(r, x): ppl for r, x, ppl, _ in results}
    print(
        f"profile {a.profile}, {a.rounds} DiLoCo rounds of tokens, {a.attackers} attacker(s), weight cap "
        f"{a.weight_cap}; final eval perplexity (x the same rule's clean run)"
    )
    print("| rule | " + " | ".join(attacks) + " |")
    print("|---" * (len(attacks) + 1) + "|")
    for r in rules:
        clean = table.get((r, "none"))
        cells = []
        for x in attacks:
            v = table[(r, x)]
            cells.append(f"{v:.1f}" + (f" ({v / clean:.2f}x)" if clean and x != "none" else ""))
        print(f"| {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
