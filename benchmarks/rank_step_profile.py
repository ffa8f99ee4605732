"""Where the time of one inner step of a 2-rank CPU peer goes (issue 30, docs/multi-rank.md "Measured").

Two gloo ranks in two processes (one torch thread each, as a peer with ``--threads 1``), the tiny preset at the
shipped corpus's vocabulary, a step of ``--batch`` rows (B/2 per rank). Milliseconds per step, medians; pieces
that are compared are measured in turns (A B A B ...), so a change of the machine's load hits them alike:

* ``pieces``, each on both ranks after a barrier: the command broadcast (8 float64), the batch broadcast
  (``[B, seq_len]`` int64), the forward and backward pass of B/2 rows without a gradient all-reduce
  (``no_sync``), with DDP's all-reduce in torch's default buckets (25 MiB, the first 1 MiB: all-reduced while
  the backward pass runs) and in one bucket (:func:`~geomesh_p2p.model.ranks.ddp_bucket_cap_mb`, this peer on
  a CPU), one bare all-reduce of the whole gradient (fp32 ``[P]``), the loss's scalar all-reduce, clip + AdamW;
* ``run()``: :meth:`RankedTrainer.run` per step (what the peer's re-profiling measures), ``before`` (every
  command waited for, DDP's default buckets: the code until session 15) and ``after`` (the STEP's broadcasts
  not waited for, one bucket), in A B B A order, with the time of each phase of a step on each rank;
* ``one device``: :class:`InnerTrainer` steps of B and B/2 rows alone, and of B/2 rows in two processes at
  once (two one-rank peers on the same cores: what the 2-rank peer's step is compared with).

    .venv/bin/python benchmarks/rank_step_profile.py --seq-len 128 --batch 16
    .venv/bin/python benchmarks/rank_step_profile.py --seq-len 32 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from geomesh_p2p.data import load_dataset  # noqa: E402
from geomesh_p2p.model.build import build_model  # noqa: E402
from geomesh_p2p.model.rank_channel import EXIT, Command, RankChannel  # noqa: E402
from geomesh_p2p.model.ranks import NoData, RankedTrainer, ddp_bucket_cap_mb  # noqa: E402
from geomesh_p2p.model.training import InnerTrainer  # noqa: E402

KW = dict(lr=1e-3, warmup_steps=0, total_steps=1000, seed=0)


def _ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 2)


def _in_turns(fns: dict, n: int, before=None) -> dict[str, float]:
    """Each of ``fns`` ``n`` times, in turns; ``before()`` (untimed) ahead of each call. Returns ms medians."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: _ms(v) for k, v in times.items()}


def _per_step(t: InnerTrainer, rows: int, steps: int, round: int) -> float:
    """Seconds per step of one run of ``steps`` inner steps (its compute_s / steps)."""
    return t.run(round=round, inner_steps=steps, batch_size=rows).compute_s / steps


def one_process(ns, sizes: tuple[int, ...]) -> dict:
    """One-device steps at each of ``sizes`` rows (3 runs of ``--steps`` steps each, in turns)."""
    torch.set_num_threads(1)
    ds = load_dataset(None, seq_len=ns.seq_len)
    trainers = {}
    for rows in sizes:
        t = InnerTrainer(build_model("tiny", vocab_size=ds.vocab_size, seed=0), ds, seq_len=ns.seq_len, **KW)
        t.run(round=0, inner_steps=2, batch_size=rows)
        trainers[rows] = t
    times: dict[int, list[float]] = {rows: [] for rows in sizes}
    for r in range(3):
        for rows, t in trainers.items():
            times[rows].append(_per_step(t, rows, ns.steps, 1 + r))
    return {f"{rows} rows": _ms(v) for rows, v in times.items()}


def _instrument(t: RankedTrainer, ch: RankChannel, phases: dict[str, float]) -> None:
    """Wrap the pieces of a step in timers adding seconds to ``phases`` (phase -> seconds)."""

    def wrap(obj, name: str, label: str) -> None:
        real = getattr(obj, name)
        phases.setdefault(label, 0.0)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    wrap(ch, "send", "send command + batch")
    wrap(ch, "recv", "wait for + receive command")
    wrap(ch, "recv_batch", "receive batch")
    wrap(t, "_shard_accumulate", "fwd+bwd, gradient + loss all-reduce")
    wrap(t.optimizer, "step", "AdamW step")
    if isinstance(t.dataset, NoData):
        phases.setdefault("sample batch", 0.0)
    else:
        wrap(t.dataset, "sample_batch", "sample batch")


def pieces(rank: int, ch: RankChannel, vocab: int, ns) -> dict:
    """The pieces of a step, each on both ranks after a barrier, in turns."""
    b, n = ns.batch, ns.steps
    x = torch.randint(0, vocab, (b // 2, ns.seq_len))
    barrier = lambda: dist.barrier(group=ch.cmd)  # noqa: E731
    cmd = torch.zeros(8, dtype=torch.float64)
    bt = torch.zeros(b, ns.seq_len, dtype=torch.int64)
    models = {}
    for name in ("default buckets", "one bucket"):
        m = build_model("tiny", vocab_size=vocab, seed=0)
        cap = ddp_bucket_cap_mb(m, ch.device) if name == "one bucket" else None
        ddp = DistributedDataParallel(m, process_group=ch.main, forward_sync_buffers=False, bucket_cap_mb=cap)
        models[name] = (m, ddp)
    opt = torch.optim.AdamW(models["one bucket"][0].parameters(), lr=1e-3, betas=(0.9, 0.95))

    def fwd_bwd(name: str, sync: bool):
        m, ddp = models[name]
        m.zero_grad(set_to_none=True)
        with ddp.no_sync() if not sync else torch.enable_grad():
            ddp(input_ids=x, labels=x).loss.backward()

    def clip_step():
        torch.nn.utils.clip_grad_norm_(models["one bucket"][0].parameters(), 1.0)
        opt.step()

    flat = torch.zeros(sum(p.numel() for p in models["one bucket"][0].parameters()))
    one = torch.zeros(1, dtype=torch.float64)
    for _ in range(2):
        for name in models:
            fwd_bwd(name, True)
    fns = {
        "command broadcast": lambda: dist.broadcast(cmd, src=0, group=ch.cmd),
        "batch broadcast": lambda: dist.broadcast(bt, src=0, group=ch.cmd),
        "fwd+bwd B/2, no all-reduce": lambda: fwd_bwd("one bucket", False),
        "fwd+bwd B/2 + DDP all-reduce, default buckets": lambda: fwd_bwd("default buckets", True),
        "fwd+bwd B/2 + DDP all-reduce, one bucket": lambda: fwd_bwd("one bucket", True),
        f"bare all-reduce of [P={flat.numel()}] fp32": lambda: dist.all_reduce(flat, group=ch.main),
        "loss scalar all-reduce": lambda: dist.all_reduce(one, group=ch.main),
        "clip + AdamW step": clip_step,
    }
    return _in_turns(fns, n, barrier)


def whole_steps(rank: int, ch: RankChannel, ds, ns) -> dict:
    """:meth:`RankedTrainer.run` per step, ``before`` and ``after``, A B B A, a fresh trainer for each."""
    vocab = ds.vocab_size
    out: dict = {}
    for i, variant in enumerate(("before", "after", "after", "before")):
        model = build_model("tiny", vocab_size=vocab, seed=0)
        if rank == 0:
            t = RankedTrainer(model, ds, channel=ch, seq_len=ns.seq_len, **KW)
        else:
            assert ch.wait_setup() == vocab
            t = RankedTrainer(model, NoData(vocab), channel=ch, seq_len=ns.seq_len, **KW)
        assert t.ddp is not None
        if variant == "before":  # torch's default buckets, every broadcast waited for
            t.ddp = DistributedDataParallel(t.model, process_group=ch.main, forward_sync_buffers=False)
            real_send = ch.send
            ch.send = lambda c, batch=None, wait=True: real_send(c, batch)  # type: ignore[method-assign]
        phases = out.setdefault(f"{variant}: phases", {})
        if rank == 0:
            t.run(round=0, inner_steps=2, batch_size=ns.batch)  # warm-up
            _instrument(t, ch, phases)
            out.setdefault(f"{variant}: run() per step", []).extend(
                _per_step(t, ns.batch, ns.steps, 1 + k) for k in range(2)
            )
            ch.send(Command(EXIT))
        else:
            _instrument(t, ch, phases)
            assert t.follow() == 0
        for name in ("send", "recv", "recv_batch"):  # back to the class's methods
            ch.__dict__.pop(name, None)
        out.setdefault(f"{variant}: steps", 0)
        out[f"{variant}: steps"] += 2 * ns.steps + (2 if rank else 0)
    res: dict = {}
    for variant in ("before", "after"):
        if rank == 0:
            res[f"run() per step, {variant}"] = _ms(out[f"{variant}: run() per step"])
        steps = out[f"{variant}: steps"]
        for k, v in out[f"{variant}: phases"].items():
            res[f"  {variant}: {k}"] = round(1e3 * v / steps, 2)
    return res


def rank_main(rank: int, init: str, ns) -> None:
    """One of the two ranks: the pieces, then whole steps; writes ``OUT.rank<R>.json``."""
    torch.set_num_threads(1)
    ch = RankChannel.init(rank, 2, "cpu", init, timeout_s=300)
    ds = load_dataset(None, seq_len=ns.seq_len)
    res = {"pieces": pieces(rank, ch, ds.vocab_size, ns), "steps": whole_steps(rank, ch, ds, ns)}
    ch.close(exit_followers=False)
    with open(f"{ns.out}.rank{rank}.json", "w") as f:
        json.dump(res, f)


def _spawn(argv: list[str], env: dict) -> list[int]:
    procs = [subprocess.Popen(a, env=env) for a in argv]
    try:
        return [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed run and samples per piece")
    ap.add_argument("--out", default="/tmp/rank_step_profile")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--alone", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.alone is not None:  # one of two one-device peers stepping at the same time
        with open(f"{ns.out}.alone{ns.alone}.json", "w") as f:
            json.dump(one_process(ns, (ns.batch // 2,)), f)
        return 0
    if ns.rank is not None:
        rank_main(ns.rank, ns.init, ns)
        return 0
    load0 = os.getloadavg()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    me = [sys.executable, __file__, *sys.argv[1:]]
    if any(_spawn([[*me, "--init", init, "--rank", str(r)] for r in range(2)], env)):
        print("a rank failed")
        return 1
    if any(_spawn([[*me, "--alone", str(i)] for i in range(2)], env)):
        print("a one-device process failed")
        return 1
    ranks = []
    for r in range(2):
        with open(f"{ns.out}.rank{r}.json") as f:
            ranks.append(json.load(f))
    alone = [json.load(open(f"{ns.out}.alone{i}.json")) for i in range(2)]
    print(
        f"seq_len {ns.seq_len}, batch {ns.batch} (B/2 = {ns.batch // 2} per rank), ms per step; "
        f"1-minute load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    for section in ("pieces", "steps"):
        print(f"{section}:{'rank 0':>58}{'rank 1':>10}")
        for k in ranks[0][section]:
            print(f"  {k:62}{ranks[0][section].get(k, ''):>10}{ranks[1][section].get(k, ''):>10}")
    print("one device:")
    for k, v in one_process(ns, (ns.batch, ns.batch // 2)).items():
        print(f"  {k + ', alone':62}{v:>10}")
    for k in alone[0]:
        print(f"  {k + ', two processes at once':62}{alone[0][k]:>10}{alone[1][k]:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
