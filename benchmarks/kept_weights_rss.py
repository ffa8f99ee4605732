"""RSS of verified work's kept start weights: clones on the heap (before issue 27) against files read through a
copy-on-write memory map (:mod:`geomesh_p2p.trust.kept_weights`, now).

One process, one torch thread. The global weights ``theta`` [P] fp32 (P of ``--model`` at the shipped vocabulary,
counted on the meta device) are made first; then, each from the same baseline:

* files: a :class:`~geomesh_p2p.trust.verify.WorkVerifier` keeps ``--rounds`` rounds (``keep_round``, the node's
  path), RSS read; one kept round is read whole (``kept_theta`` + a max over it, what a check's scale bound
  reads), RSS read while the tensor lives and after it is dropped; the verifier closed (files removed);
* clones: ``--rounds`` clones of ``theta`` held in a list (what ``VerifiedWork`` kept before), RSS read.

RSS from ``/proc/self/status`` (VmRSS, RssAnon, RssFile), bytes. Prints one JSON object::

    .venv/bin/python benchmarks/kept_weights_rss.py --model tiny
    .venv/bin/python benchmarks/kept_weights_rss.py --model gpt2-124m
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile

import torch

from geomesh_p2p.model.build import PRESETS, count_params
from geomesh_p2p.model.memory import SHIPPED_VOCAB_SIZE, release_freed_memory
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.trust.verify import WorkVerifier
from geomesh_p2p.trust.verify_task import VerifyConfig


def rss() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _verifier(rounds: int, dir: str | None) -> WorkVerifier:
    """A verifier that keeps ``rounds`` rounds (no model: nothing is checked here)."""
    return WorkVerifier(
        VerifyConfig(keep_rounds=rounds),
        identity=Identity.generate(),
        run_id="bench",
        model=None,
        dataset=None,
        seed=0,
        lr=1e-3,
        weight_decay=0.1,
        kept_dir=dir or tempfile.gettempdir(),
    )


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)})")
    p.add_argument("--rounds", type=int, default=3, help="rounds kept (VerifyConfig.keep_rounds: 3)")
    p.add_argument("--dir", default=None, help="folder of the verifier's private directory (default: TMPDIR)")
    ns = p.parse_args(argv)
    if ns.model not in PRESETS:
        print(f"kept_weights_rss: --model {ns.model}: unknown preset (known: {', '.join(PRESETS)})", file=sys.stderr)
        return 2
    if ns.rounds < 1:
        print(f"kept_weights_rss: --rounds {ns.rounds}: must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    n = count_params(ns.model, vocab_size=SHIPPED_VOCAB_SIZE)
    theta = torch.randn(n, generator=torch.Generator().manual_seed(0))
    gc.collect()
    release_freed_memory()
    res: dict = {"model": ns.model, "params": n, "bytes_per_round": 4 * n, "rounds": ns.rounds}

    # warm-up: the code paths' own first-use pages (library code, the temp directory) out of the figures
    warm = _verifier(1, ns.dir)
    warm.keep_round(0, theta=theta[:1024], plan=None, part_ranges=[], packets={})
    float(warm.kept_theta(0).abs().max())  # type: ignore[union-attr]
    warm.close()
    gc.collect()

    base = rss()
    wv = _verifier(ns.rounds, ns.dir)
    for r in range(ns.rounds):
        theta.add_(1e-3)  # each round starts from other weights
        wv.keep_round(r, theta=theta, plan=None, part_ranges=[], packets={})
    res["files_kept"] = _delta(base, rss())
    t = wv.kept_theta(ns.rounds - 1)
    assert t is not None
    res["kept_round_max_abs"] = float(t.abs().max())  # reads every page of the file
    res["files_while_one_round_is_read"] = _delta(base, rss())
    del t
    gc.collect()
    res["files_after_the_read"] = _delta(base, rss())
    wv.close()
    gc.collect()
    release_freed_memory()

    base = rss()
    clones = [theta.clone() for _ in range(ns.rounds)]
    res["clones_kept"] = _delta(base, rss())
    del clones
    gc.collect()
    release_freed_memory()
    res["saved_vm_rss"] = res["clones_kept"]["VmRSS"] - res["files_kept"]["VmRSS"]
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
