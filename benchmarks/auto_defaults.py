#!/usr/bin/env python3
"""What ``--window-s auto`` and ``--eval-every auto`` choose for a measured device (issue 27, "defaults that fit the
model"): N identical peers with the profile ``geomesh-peer profile --json`` printed, planned by the run's defaults
(``plan.awb.plan_round``, geomesh, relay) at ``--window-s auto`` and at a fixed window, side by side; then the
evaluation interval (``round.eval_schedule.eval_interval``) for an evaluation of ``--eval-s`` seconds.

    geomesh-peer profile --model gpt2-124m --batch-sizes 4,8 --upload-mbps 1000 --download-mbps 1000 --json > p.json
    PYTHONPATH=$PWD python benchmarks/auto_defaults.py p.json --model gpt2-124m --eval-s 15

Pure arithmetic on the profile: it trains nothing and starts no process.
"""

from __future__ import annotations

import argparse
import json

from geomesh_p2p import __version__
from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.plan.awb import plan_round
from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.round.eval_schedule import eval_interval
from geomesh_p2p.round.rules.planning import EXCHANGE_HORIZON_SHARE, plan_horizon_s
from geomesh_p2p.schema.peer import PeerRecord


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="the JSON of geomesh-peer profile --json")
    ap.add_argument("--model", default="gpt2-124m", help="the run's --model (default %(default)s)")
    ap.add_argument("--peers", type=int, default=3, help="identical peers (default %(default)s)")
    ap.add_argument("--fixed-window-s", type=float, default=6.0, help="the fixed window to compare (default 6)")
    ap.add_argument("--eval-s", type=float, default=15.0, help="seconds of one evaluation (default 15)")
    ns = ap.parse_args()
    prof = json.load(open(ns.profile, encoding="utf-8"))
    run, n, P = RunConfig(model=ns.model), ns.peers, int(prof["n_params"])
    recs = [
        PeerRecord(
            peer_id=f"p{i}",
            address=f"127.0.0.1:{7000 + i}",
            device="cpu",
            memory_bytes=int(prof["device"]["memory_bytes"]),
            tokens_per_s={int(k): float(v) for k, v in prof["tokens_per_s"].items()},
            max_batch=int(prof["max_batch"]),
            upload_bps=float(prof["bandwidth"]["upload_bps"]),
            download_bps=float(prof["bandwidth"]["download_bps"]),
            version=__version__,
            run_config_hash="x",
        )
        for i in range(n)
    ]
    print(f"{n} peers of the profile ({P:,} parameters, tokens/s {prof['tokens_per_s']}), {run.method}/{run.mode}")
    print()
    print("| --window-s | window | inner steps H | batch | step | exchange (links) | evaluation every |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for window in (None, ns.fixed_window_s):
        cfg = PlanConfig(
            seq_len=run.seq_len,
            target_batch=run.target_batch,
            window_s=window,
            target_inner_steps=run.target_inner_steps if window is None else None,
            max_window_s=EXCHANGE_HORIZON_SHARE * plan_horizon_s(window),
            payload_bytes=MethodRule.from_run(run).payload_bytes(P, n),
            mode=run.mode,
            method=run.method,
            max_inner_steps=run.max_inner_steps,
        )
        plan = plan_round(recs, cfg, run_id="r", round=0, leader="p0", numel=P, start_time=0.0)
        a = plan.assignments[0]
        step = a.predicted_compute_s / max(1, a.inner_steps)
        k = eval_interval(ns.eval_s, plan.window_s)
        print(
            f"| {'auto' if window is None else f'{window:g}'} | {plan.window_s:.1f} s | {a.inner_steps} | "
            f"{a.batch_size} ({a.micro_batch} x {a.accum_steps}) | {step:.2f} s | {a.predicted_comm_s:.2f} s | "
            f"{k} round(s) |"
        )


if __name__ == "__main__":
    main()
