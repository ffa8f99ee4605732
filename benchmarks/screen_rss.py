"""Peak RSS of the loss-gain test's second pass, the whole copy of ``theta - d`` against one module at a time
(issue 27, session 24).

Each path runs in its own child process (so the peaks do not mix), one torch thread, as a node's screen does: the
node's model (``--model`` at ``--vocab-size``, built from its config: nothing is downloaded), the round's start
weights ``theta`` written to a kept-weights file and read back through its copy-on-write map
(:class:`~geomesh_p2p.trust.kept_weights.KeptWeights`), verified work's hollow copy
(:func:`~geomesh_p2p.trust.check_model.hollow_copy`) and a synthetic sign-coded contribution in ``--parts`` parts.
The first pass (losses at ``theta``) runs, then VmHWM is reset to the current RSS (``/proc/self/clear_refs``) and
the second pass runs:

* ``old``: every parameter a private copy of ``theta - d``
  (:func:`~geomesh_p2p.trust.check_model.sub_flat_`, the parts decoded one at a time, as ``gain_stats`` did);
* ``new``: ``theta - d`` built around each module's forward (:func:`~geomesh_p2p.trust.check_model.subtracted`,
  what ``gain_stats`` does now on a hollow model).

Prints one row per path (bytes over the RSS before the second pass, seconds) and whether both computed the same
row losses, bit for bit::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/screen_rss.py --model llama-150m
    PYTHONPATH=$PWD .venv/bin/python benchmarks/screen_rss.py --model gpt2-124m --batches 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.trust import check_model as CM
from geomesh_p2p.trust.gain import row_losses
from geomesh_p2p.trust.kept_weights import KeptWeights
from verify_check_rss import settle, status  # noqa: E402  (the benchmarks' one /proc/self/status reader)

GIB = 1024**3


def child(args) -> dict:
    """One path's measurement (see the module docstring)."""
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="screen-rss-")
    ds = load_dataset(None, seq_len=args.seq_len, cache_dir=tmp)
    model = build_model(args.model, vocab_size=args.vocab_size, seed=0)
    n = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    kept = KeptWeights(tmp)
    kept.put(1, flat_params(model))
    hollow = CM.hollow_copy(model)
    g = torch.Generator().manual_seed(1)
    size = -(-n // args.parts // 2048) * 2048
    pieces = [
        (s, compression.encode(torch.randn(min(n, s + size) - s, generator=g) * 1e-3, 2048, 100))
        for s in range(0, n, size)
    ]
    streams = [("A", j) for j in range(args.batches)] + [("control", i) for i in range(args.batches)]
    kw = dict(seed=0, round=1, batch_size=args.batch, seq_len=args.seq_len)
    theta = kept.get(1)
    CM.load_for_check(hollow, theta)
    before = row_losses(hollow, ds, streams, **kw)
    base = settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS
    t0 = time.perf_counter()
    if args.child == "old":
        CM.sub_flat_(hollow, ((s, compression.decode(p)) for s, p in pieces))
        after = row_losses(hollow, ds, streams, **kw)
    else:
        with CM.subtracted(hollow, pieces):
            after = row_losses(hollow, ds, streams, **kw)
    seconds = time.perf_counter() - t0
    peak = status()["VmHWM"]
    rows = [v for batch in before + after for v in batch]
    return {
        "path": args.child,
        "model": args.model,
        "n_params": n,
        "largest_module_params": largest,
        "rss_before_second_pass": base["VmRSS"],
        "second_pass_peak_over_before": peak - base["VmRSS"],
        "second_pass_s": seconds,
        "forward_passes": len(streams),
        "losses_sha256": hashlib.sha256(struct.pack(f"<{len(rows)}d", *rows)).hexdigest(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-150m")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--batches", type=int, default=2, help="assigned batches, and as many controls")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    load0 = os.getloadavg()[0]
    res = {}
    for path in ("old", "new"):
        argv2 = list(argv if argv is not None else sys.argv[1:])
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv2, "--child", path],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        res[path] = json.loads(out.strip().splitlines()[-1])
    o, w = res["old"], res["new"]
    P, largest = o["n_params"], o["largest_module_params"]
    print(f"{args.model}: P = {P:,} ({4 * P / GIB:.3f} GiB fp32), largest module {largest:,} parameters")
    print("| second pass | peak RSS over before it | x 4P | seconds (forward passes) |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in (("whole copy of theta - d (old)", o), ("one module at a time (new)", w)):
        b = r["second_pass_peak_over_before"]
        print(f"| {name} | {b:,} B ({b / GIB:.3f} GiB) | {b / (4 * P):.2f} | {r['second_pass_s']:.1f} "
              f"({r['forward_passes']}) |")  # fmt: skip
    saved = o["second_pass_peak_over_before"] - w["second_pass_peak_over_before"]
    print(
        f"saved: {saved:,} B ({saved / GIB:.3f} GiB); losses bitwise equal: {o['losses_sha256'] == w['losses_sha256']}"
    )
    print(f"load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
