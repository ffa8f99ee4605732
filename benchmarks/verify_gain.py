"""Can a contribution's loss gain on its assigned batches tell honest work from wrong data and poisoning (issue 28)?

The statistic (after Templar's Gauntlet, which scores a peer by the loss change its update causes on the peer's
assigned data against random data): for a contribution ``d`` (the pseudo-gradient, decoded from its sign
packet, fp32 ``[P]``) at the round's start weights ``theta``,

    gain(batches) = mean over the batches of  loss(theta) - loss(theta - d)      (nats per token)
    assigned_gain = gain(k of the contributor's assigned batches: seed, peer, round, step; drawn among its H)
    control_gain  = gain(k control batches nobody trains on)
    excess        = assigned_gain - control_gain
    t             = Welch's t of that difference over the batches' rows (``geomesh_p2p.trust.gain``: the test
                    verified work runs; its thresholds come from this table)

An honest contributor trained on exactly its assigned batches, so ``theta - d`` fits them better than text it
never saw (excess > 0); a contributor that trained on other text (a free rider copying a peer, a poisoner's own
corpus) has no such excess. Both losses are taken on the same batches at both weights, so the batch noise
cancels in each difference.

Trains the tiny preset DiLoCo-style on the shipped KJV corpus as ``verify_agreement.py`` does (4 peers with
persistent inner AdamW, sign-compressed mean, outer Nesterov 0.7 / 0.9), and at the ``--measure`` rounds builds
contributor A's candidates for each H of ``--Hs`` from A's real optimizer state:

  honest           H AdamW steps on A's assigned batches
  wrong-data       the same steps on another peer's batches (a free rider copying a peer is alike)
  poison-corpus    A's own copy of the corpus: other windows, a trigger sentence making up ``--trigger-share``
                   of the tokens (the red team's backdoor of issue 28)
  poison-assigned  A's assigned batches with the trigger written over ``--trigger-share`` of each row's tokens
                   (a poisoner that knows the statistic)
  stale            A's previous round delta
  partial-F        A's optimizer on a random share F of its H batches (--partial), claiming all H

Prints, per (H, candidate), min / mean / max of ``excess``, of the assigned / control gain ratio and of ``t`` over
the measured rounds and ``--samples`` draws of the k batches (``--m`` control batches), and the share of draws
below t = 0.5, 1, 1.5, 2::

    python benchmarks/verify_gain.py                                  # ~6 min on 2 busy cores
    python benchmarks/verify_gain.py --measure 2,6 --Hs 5,20 --samples 4   # a quick look

Session 50 (partial work): ``partial-F`` candidates train a random share F of their H batches (at least one) and
claim all H; ``--rows FILE`` keeps every candidate's row gains, and ``--from-rows FILE[,FILE]`` prints the shipped
rules on them (the whole t, the per-batch ``low`` of :mod:`geomesh_p2p.trust.gain_batches`, staged screens) over
``--draws`` draws a round, without training again::

    python benchmarks/verify_gain.py --batch 8 --rows rows8.json && python benchmarks/verify_gain.py --batch 4 \
        --rows rows4.json && python benchmarks/verify_gain.py --from-rows rows8.json,rows4.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.trust.gain import row_losses, welch_t

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.poison import PartialData  # noqa: E402  (the partial-work free rider the tests use too)

CANDIDATES = ("honest", "wrong-data", "poison-corpus", "poison-assigned", "stale")
PARTIAL = (0.05, 0.25, 0.5)  # shares of its batches a partial-work candidate trains (it claims all H)
CONTROL = "control-batches"


def roundtrip(v: torch.Tensor) -> torch.Tensor:
    """``v`` through the sign codec (block 2048): what an owner receives."""
    return compression.decode(compression.encode(v, 2048, 0))


class PoisonedData:
    """A dataset stand-in whose ``sample_batch`` gives poisoned rows: each row's first ``share`` of tokens is the
    trigger (repeated), the rest is text from ``shift`` tokens further in the corpus (``shift`` 0: the assigned
    row itself). int64 ``[batch, seq_len]``, like :meth:`TokenDataset.sample_batch`."""

    def __init__(self, ds, trigger: torch.Tensor, share: float, shift: int):
        self.ds, self.trigger, self.share, self.shift = ds, trigger, share, shift

    def __getattr__(self, name):
        return getattr(self.ds, name)

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):
        x = self.ds.sample_batch(
            seed=seed, peer_id=peer_id, round=round, step=step, batch_size=batch_size, seq_len=seq_len
        )
        if self.shift:
            x = self.ds.sample_batch(
                seed=seed + self.shift, peer_id=peer_id, round=round, step=step, batch_size=batch_size, seq_len=seq_len
            )
        n = max(1, int(round_half(self.share * seq_len)))
        reps = self.trigger.repeat(n // len(self.trigger) + 1)[:n]
        x = x.clone()
        x[:, :n] = reps
        return x


def rule_table(path: str, draws: int, seed: int = 0) -> None:
    """Session 50: the shipped rules on a ``--rows`` file, ``draws`` draws of the k steps per (round, H, candidate),
    in drawn order as a screen takes them (:func:`~geomesh_p2p.trust.verify_task.gain_order`'s role). Per candidate:
    the whole t's minimum, the per-batch ``low`` (min / mean / max), and the share of draws that fail hard / fail or
    mark: by the whole t alone (before session 50), by t and ``low`` on the whole test, by a staged screen (a half
    passes alone at t >= 2.95 when :func:`~geomesh_p2p.trust.gain_batches.half_may_pass`), and how many screens a half
    passes alone before / now (the cost: the others run the whole test). No power reference (every draw decides)."""
    from geomesh_p2p.trust.gain import gain_of
    from geomesh_p2p.trust.gain_batches import half_may_pass, low_kw
    from geomesh_p2p.trust.gain_stages import stage_bounds
    from geomesh_p2p.trust.verify_task import VerifyConfig

    cfg = VerifyConfig()
    bound = stage_bounds(cfg.gain_t_min, cfg.gain_stage_kappa)[1]
    d = json.load(open(path))
    rng, out = random.Random(seed), {}
    for key, v in d["rows"].items():
        r, H, name = key.split("/", 2)
        ctrl, asg, H = v["control"][: d["m"]], v["assigned"], int(H)
        for _ in range(draws):
            order = rng.sample(range(H), min(d["k"], H))
            js, s1 = sorted(order), sorted(order[: len(order) // 2])
            g = gain_of([asg[j] for j in js], ctrl, steps=H, at=js, **low_kw(cfg))
            h = gain_of([asg[j] for j in s1], ctrl[: len(ctrl) // 2], steps=H, at=s1, **low_kw(cfg))
            old = 2 if g.t < cfg.gain_t_hard else 1 if g.t < cfg.gain_t_min else 0
            low = 0 if g.low is None or g.low >= cfg.gain_low_min else 2 if g.low < cfg.gain_low_hard else 1
            new = max(old, low) if g.t >= cfg.gain_t_hard else old
            alone = h.t >= bound and half_may_pass(cfg, [asg[j] for j in s1], ctrl[: len(ctrl) // 2], s1, order, H)
            out.setdefault((H, name), []).append((g.t, g.low, old, new, 0 if alone else new, h.t >= bound, alone))
    print(f"\n{path}: batch {d['batch']}, k = {d['k']}, m = {d['m']}, {draws} draws a round; low: the settled "
          f"batches' lower half (settle {cfg.gain_settle_steps}), fails < {cfg.gain_low_hard}, marginal < "
          f"{cfg.gain_low_min}; shares fail / fail or marginal")  # fmt: skip
    for (H, name), rows in sorted(out.items()):
        lows = [x[1] for x in rows if x[1] is not None]

        def share(i: int, at_least: int) -> float:
            return sum(x[i] >= at_least for x in rows) / len(rows)

        low = f"{min(lows):5.2f}/{sum(lows) / len(lows):5.2f}/{max(lows):5.2f}" if lows else "  (not measured)  "
        print(
            f"H={H:2d} {name:16s} t min {min(x[0] for x in rows):5.2f}  low {low}  t alone {share(2, 2):.2f}/"
            f"{share(2, 1):.2f}  t+low {share(3, 2):.2f}/{share(3, 1):.2f}  staged {share(4, 2):.2f}/{share(4, 1):.2f}"
            f"  half passes alone {share(5, 1):.2f} -> {share(6, 1):.2f}"
        )


def round_half(x: float) -> float:
    return float(int(x + 0.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--measure", default="2,5,8,11")
    ap.add_argument("--Hs", default="5,20,40")
    ap.add_argument("--h-train", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="assigned batches per check (at most H)")
    ap.add_argument("--m", type=int, default=16, help="control batches per check")
    ap.add_argument(
        "--sizes",
        default=None,
        help="more screen sizes KxM[xR] measured on the same draws (R: rows of each batch used, default all), "
        "comma-separated, e.g. 4x8,4x8x2 (session 19)",
    )
    ap.add_argument("--json", default=None, help="also write every draw's statistics here")
    ap.add_argument("--rows", default=None, help="also write every candidate's row gains here (JSON)")
    ap.add_argument("--samples", type=int, default=6, help="draws of the k assigned steps per (round, H)")
    ap.add_argument("--trigger-share", type=float, default=0.16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--from-rows", default=None, help="print the rules' table from these --rows files (comma-separated)"
    )
    ap.add_argument("--draws", type=int, default=400, help="draws a round for --from-rows")
    a = ap.parse_args()
    if a.from_rows:
        for path in a.from_rows.split(","):
            rule_table(path, a.draws)
        return
    torch.set_num_threads(a.threads)
    Hs = [int(x) for x in a.Hs.split(",")]
    sizes = [(a.k, a.m, 0)] + [
        tuple(int(v) for v in (z.split("x") + ["0"])[:3]) for z in (a.sizes.split(",") if a.sizes else [])
    ]
    a.m = max(m for _, m, _ in sizes)
    measure = {int(x) for x in a.measure.split(",")}
    L, B, lr = a.seq_len, a.batch, 1e-3
    ds = load_dataset(None, seq_len=L)
    trigger = torch.tensor([7, 3, 11, 5, 13, 2, 17, 19][: max(1, min(8, ds.vocab_size - 1))]) % ds.vocab_size
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(base)
    peers = ["peerA", "peerB", "peerC", "peerD"]

    def trainer(model, data, pid):
        return InnerTrainer(model, data, seq_len=L, lr=lr, warmup_steps=20, total_steps=2000, seed=0, peer_id=pid)

    trainers = {p: trainer(copy.deepcopy(base), ds, p) for p in peers}
    outer = OuterNesterov(0.7, 0.9)
    vmodel, moved = copy.deepcopy(base), copy.deepcopy(base)
    rng = random.Random(0)
    prev: dict[str, torch.Tensor] = {}
    stats: dict[tuple[int, str], list[float]] = {}
    honest_ex: dict[tuple[int, int], float] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    tstats: dict[tuple[int, str], list[float]] = {}
    small: dict[tuple[int, str, tuple], list[float]] = {}
    dump: dict[str, dict] = {}  # every candidate's row gains, "round/H/name" (--rows)
    for r in range(a.rounds):
        t0 = time.time()
        deltas = {}
        for p, tr in trainers.items():
            if r in measure and p == "peerA":
                continue
            load_flat_(tr.model, theta)
            tr.run(round=r, inner_steps=a.h_train, batch_size=B)
            deltas[p] = theta - flat_params(tr.model)
        if r in measure:

            def train(steps, data=ds, pid="peerA"):
                m = copy.deepcopy(trainers["peerA"].model)
                load_flat_(m, theta)
                t = trainer(m, data, pid)
                t.load_state_dict(copy.deepcopy(trainers["peerA"].state_dict()))
                t.run(round=r, inner_steps=steps, batch_size=B)
                return theta - flat_params(m)

            kw = dict(seed=0, round=r, batch_size=B, seq_len=L)
            ctrl_streams = [(CONTROL, i) for i in range(a.m)]
            load_flat_(vmodel, theta)
            base_ctrl = row_losses(vmodel, ds, ctrl_streams, **kw)
            for H in Hs:
                cands = {
                    "honest": train(H),
                    "wrong-data": train(H, pid="peerB"),
                    "poison-corpus": train(H, data=PoisonedData(ds, trigger, a.trigger_share, shift=7919)),
                    "poison-assigned": train(H, data=PoisonedData(ds, trigger, a.trigger_share, shift=0)),
                }
                if "peerA" in prev:
                    cands["stale"] = prev["peerA"]
                trained: dict[str, list[int]] = {}
                for f in PARTIAL:  # trains a random share f of its H batches (at least one), claims all H
                    sub = sorted(random.Random(f"{r}/{H}/{f}").sample(range(H), max(1, round(f * H))))
                    trained[f"partial-{f:g}"] = sub
                    cands[f"partial-{f:g}"] = train(len(sub), data=PartialData(ds, sub))
                asg_streams = [("peerA", j) for j in range(H)]
                base_asg = row_losses(vmodel, ds, asg_streams, **kw)
                for name, cand in cands.items():
                    # the rows' gains exactly as trust.gain.gain_stats takes them, each draw of k steps apart
                    load_flat_(moved, theta - roundtrip(cand))
                    after_asg = row_losses(moved, ds, asg_streams, **kw)
                    after_ctrl = row_losses(moved, ds, ctrl_streams, **kw)
                    k0, m0 = sizes[0][0], sizes[0][1]
                    gc = [b - x for rb, rx in zip(base_ctrl[:m0], after_ctrl[:m0]) for b, x in zip(rb, rx)]
                    dump[f"{r}/{H}/{name}"] = {
                        "assigned": [[b - x for b, x in zip(rb, rx)] for rb, rx in zip(base_asg, after_asg)],
                        "control": [[b - x for b, x in zip(rb, rx)] for rb, rx in zip(base_ctrl, after_ctrl)],
                        "trained": trained.get(name, list(range(H))),
                    }
                    c_gain = sum(gc) / len(gc)
                    for k_, m_, rows in sizes[1:]:  # smaller screens on the same candidates (session 19)
                        R = rows or B
                        gc_ = [b - x for rb, rx in zip(base_ctrl[:m_], after_ctrl[:m_]) for b, x in zip(rb[:R], rx[:R])]
                        for _ in range(a.samples):
                            js = rng.sample(range(H), min(k_, H))
                            ga_ = [b - x for j in js for b, x in zip(base_asg[j][:R], after_asg[j][:R])]
                            small.setdefault((H, name, (k_, m_, rows)), []).append(welch_t(ga_, gc_))
                    for _ in range(a.samples):
                        js = rng.sample(range(H), min(k0, H))
                        ga = [b - x for j in js for b, x in zip(base_asg[j], after_asg[j])]
                        a_gain = sum(ga) / len(ga)
                        tstats.setdefault((H, name), []).append(welch_t(ga, gc))
                        stats.setdefault((H, name), []).append(a_gain - c_gain)
                        ratios.setdefault((H, name), []).append(a_gain / c_gain if c_gain > 0 else float("inf"))
                    if name == "honest":
                        honest_ex[(r, H)] = sum(stats[(H, name)][-a.samples :]) / a.samples
                print(
                    f"  r={r} H={H}: t "
                    + ", ".join(f"{n} {sum(tstats[(H, n)][-a.samples :]) / a.samples:+.2f}" for n in cands),
                    flush=True,
                )
            load_flat_(trainers["peerA"].model, theta)
            trainers["peerA"].run(round=r, inner_steps=a.h_train, batch_size=B)
            deltas["peerA"] = theta - flat_params(trainers["peerA"].model)
        agg = torch.stack([roundtrip(d) for d in deltas.values()]).mean(0)
        outer.step(theta, agg)
        prev = deltas
        print(f"round {r}: {time.time() - t0:.1f}s", flush=True)
    print(
        f"\nexcess = assigned gain - control gain (nats/token), k = {sizes[0][0]}, m = {sizes[0][1]}, rounds {sorted(measure)}:"
    )
    for H in Hs:
        ref = [honest_ex[(r, H)] for r in sorted(measure)]
        cut = 0.5 * min(ref) if ref else 0.0
        for name in CANDIDATES + tuple(f"partial-{f:g}" for f in PARTIAL):
            v = stats.get((H, name))
            if not v:
                continue
            t, q, w = torch.tensor(v), torch.tensor(ratios[(H, name)]), torch.tensor(tstats[(H, name)])
            print(
                f"H={H:2d} {name:16s} excess {t.min():+.4f}/{t.mean():+.4f}/{t.max():+.4f}"
                f"   below {cut:+.4f} (half the lowest honest round mean): {float((t < cut).double().mean()):.2f}"
                f"   assigned/control gain {q.min():.2f}/{q.median():.2f}/{q.max():.2f}"
                f"   welch t {w.min():.2f}/{w.mean():.2f}/{w.max():.2f}, share t < 0.5/1/1.5/2: "
                + "/".join(f"{float((w < c).double().mean()):.2f}" for c in (0.5, 1.0, 1.5, 2.0))
            )
    for size in sizes[1:]:
        print(f"\nwelch t of a smaller screen: k = {size[0]}, m = {size[1]}, rows {size[2] or B} of each batch:")
        for H in Hs:
            for name in CANDIDATES:
                v = small.get((H, name, size))
                if v:
                    w = torch.tensor(v)
                    print(
                        f"H={H:2d} {name:16s} welch t {w.min():.2f}/{w.mean():.2f}/{w.max():.2f} (sd {w.std():.2f}), "
                        "share t < 0.5/1/1.5/2: "
                        + "/".join(f"{float((w < c).double().mean()):.2f}" for c in (0.5, 1.0, 1.5, 2.0))
                    )
    if a.rows:
        with open(a.rows, "w") as f:
            json.dump({"batch": B, "seq_len": L, "k": sizes[0][0], "m": sizes[0][1], "rows": dump}, f)
    if a.json:
        with open(a.json, "w") as f:
            out = {f"{H}/{n}": {"excess": stats[(H, n)], "t": tstats[(H, n)]} for (H, n) in stats}
            out.update({f"{H}/{n}/{'x'.join(map(str, z))}": {"t": v} for (H, n, z), v in small.items()})
            json.dump(out, f)


if __name__ == "__main__":
    main()
