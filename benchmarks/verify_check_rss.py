"""Peak RSS of one verified-work check (issue 27): what a check holds besides the node's own model.

One process, one torch thread. The node's model (``--model`` at ``--vocab-size``) and the round's start weights
``theta`` are built first, ``theta`` written to a kept-weights file (:class:`~geomesh_p2p.trust.kept_weights.KeptWeights`,
the node's path), the in-heap ``theta`` dropped. Then, each from its own baseline:

* ``copy``: the verifier's private model made as :meth:`~geomesh_p2p.trust.verify.WorkVerifier.for_node` makes it
  (a hollow copy on the CPU when this tree has :mod:`geomesh_p2p.trust.check_model`, else a whole deep copy);
  RSS read after (held between checks);
* ``check``: :func:`~geomesh_p2p.trust.verify_check.check_contribution` of a synthetic sign contribution (random,
  small block scales within the scale bound) at the kept weights read through the file's copy-on-write map, with
  the loss-gain test's early failure turned off (``gain_t_hard`` = -inf) so both the gain's forward passes and the
  gradient passes run; the peak over it is VmHWM after ``/proc/self/clear_refs`` reset it to the baseline.

Prints one JSON object (bytes, and the same over ``p`` = 4P bytes)::

    .venv/bin/python benchmarks/verify_check_rss.py --model tiny
    .venv/bin/python benchmarks/verify_check_rss.py --model gpt2-124m

Run it against another tree (the code before a change) with ``PYTHONPATH=<that tree>`` from that tree's root.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import tempfile
import time

import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.kept_weights import KeptWeights

try:  # the tree after issue 27's change
    from geomesh_p2p.trust.check_model import hollow_copy
except ImportError:  # before it: the whole deep copy
    hollow_copy = None


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def settle() -> dict[str, int]:
    gc.collect()
    release_freed_memory()
    return status()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="the contribution's inner steps (>= 5: a full check)")
    ap.add_argument("--parts", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="verify-check-rss-")
    ds = load_dataset(None, seq_len=args.seq_len, cache_dir=tmp)
    model = build_model(args.model, vocab_size=args.vocab_size, seed=0)
    n = sum(p.numel() for _, p in model.named_parameters())
    p_bytes = 4 * n
    kept = KeptWeights(tmp)
    kept.put(1, flat_params(model))
    base = settle()

    t0 = time.perf_counter()
    hollow = hollow_copy is not None
    vmodel = hollow_copy(model) if hollow else copy.deepcopy(model)
    after_copy = settle()

    cfg = dataclasses.replace(VT.VerifyConfig(), gain_t_hard=float("-inf"))
    size = -(-n // args.parts)
    ranges = tuple((s, min(n, s + size)) for s in range(0, n, size))
    k = VT._k_of(cfg, args.steps)
    task = VT.VerifyTask(
        round=1,
        verifier="V",
        accused="A",
        parts=tuple(range(len(ranges))),
        ranges=ranges,
        steps_done=args.steps,
        steps=tuple(sorted({(i * args.steps) // k for i in range(k)})),
        controls=cfg.controls,
        batch_size=args.batch,
        seq_len=args.seq_len,
        element_seed=7,
        n_elements=cfg.sample_elements,
        full_test=True,
    )
    g = torch.Generator().manual_seed(1)
    packets = {
        "A": {
            j: compression.encode(torch.randn(e - s, generator=g) * 1e-5, 2048, 100) for j, (s, e) in enumerate(ranges)
        }
    }
    before_check = settle()
    reset_peak()
    theta = kept.get(1)
    stats, verdict, _ = VC.check_contribution(
        cfg,
        task,
        model=vmodel,
        dataset=ds,
        theta=theta,
        seed=0,
        packets=packets,
        lr=1e-3,
        weight_decay=0.1,
    )
    peak = status()["VmHWM"]
    del theta
    if hollow:
        from geomesh_p2p.trust.check_model import release_

        release_(vmodel)
    after_check = settle()
    kept.close()
    out = {
        "model": args.model,
        "n_params": n,
        "p_bytes": p_bytes,
        "hollow": hollow,
        "copy_held_bytes": after_copy["VmRSS"] - base["VmRSS"],
        "check_peak_over_before_bytes": peak - before_check["VmRSS"],
        "after_check_over_before_bytes": after_check["VmRSS"] - before_check["VmRSS"],
        "verdict": verdict.outcome,
        "gain_t": None if stats.gain is None else stats.gain.t,
        "plain": stats.plain,
        "seconds": time.perf_counter() - t0,
    }
    out["copy_held_p"] = out["copy_held_bytes"] / p_bytes
    out["check_peak_p"] = out["check_peak_over_before_bytes"] / p_bytes
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
