"""Where a round's time goes (issue 17): a loopback swarm (one bootstrap + N peer processes on 127.0.0.1,
the demo's small model and corpus), then the per-phase breakdown of every peer's rows (``phase_s`` of
``--log-json``, measured by the round driver on the monotonic clock) and the compute share
(``compute_s / cycle_s``). Rows with a known cycle only (each peer's first row has none).

Usage (the "before/after" of docs/round.md):

    .venv/bin/python benchmarks/round_overhead.py --rounds 6 --workdir /tmp/ro
    .venv/bin/python benchmarks/round_overhead.py --rounds 6 --workdir /tmp/ro --peer-args="--eval-background"
    .venv/bin/python benchmarks/round_overhead.py --analyze /tmp/ro/peer*.jsonl   # no run, just the table
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.telemetry.metrics import PHASES  # noqa: E402
from geomesh_p2p.util.procs import join_argv  # noqa: E402


def analyze(files: list[str]) -> dict:
    """Mean seconds per phase, cycle, compute and compute share per peer file, and over all peers."""
    out: dict = {"peers": {}}
    all_rows = []
    for f in files:
        rows = [json.loads(line) for line in Path(f).read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("cycle_s")]
        if not rows:
            continue
        all_rows += rows
        out["peers"][Path(f).stem] = _summary(rows)
    if all_rows:
        out["all"] = _summary(all_rows)
    return out


def _summary(rows: list[dict]) -> dict:
    cycle = statistics.mean(r["cycle_s"] for r in rows)
    compute = statistics.mean(r["compute_s"] for r in rows)
    phases = {k: statistics.mean(r["phase_s"].get(k, 0.0) for r in rows) for k in PHASES}
    # the process's CPU seconds (all threads) in each phase (extra["phase_cpu_s"]; rows before it have none)
    cpu = {k: statistics.mean(r.get("extra", {}).get("phase_cpu_s", {}).get(k, 0.0) for r in rows) for k in PHASES}
    return {
        "phase_cpu_s": cpu,
        "rows": len(rows),
        "cycle_s": cycle,
        "compute_s": compute,
        "compute_share": compute / cycle,
        "phase_s": phases,
        "other_s": statistics.mean(r["other_s"] for r in rows),
    }


def print_table(res: dict) -> None:
    names = [k for k in PHASES if any(p["phase_s"][k] > 0 for p in res["peers"].values())]
    head = ["peer", "rows", "cycle s", "compute s", "comp%"] + names + ["other"]
    print(" | ".join(head))
    for name, p in list(res["peers"].items()) + ([("all", res["all"])] if "all" in res else []):
        print(
            " | ".join(
                [
                    name,
                    str(p["rows"]),
                    f"{p['cycle_s']:.2f}",
                    f"{p['compute_s']:.2f}",
                    f"{100 * p['compute_share']:.1f}",
                ]
                + [f"{p['phase_s'][k]:.3f}" for k in names]
                + [f"{p['other_s']:.3f}"]
            )
        )
    if any(any(p["phase_cpu_s"].values()) for p in res["peers"].values()):
        print("CPU seconds of the process (all threads) in each phase, mean per row:")
        print(" | ".join(["peer"] + names))
        for name, p in list(res["peers"].items()) + ([("all", res["all"])] if "all" in res else []):
            print(" | ".join([name] + [f"{p['phase_cpu_s'][k]:.3f}" for k in names]))


def print_memory(files: list[str]) -> None:
    """Per peer and row: anonymous RSS at the row (MiB), the process's peak so far, and the MiB each phase
    added in the row's cycle (``extra["phase_rss_mib"]``, 0.12.1+; phases within +-8 MiB are left out): where
    a growth over the first rounds comes from (issue 27). What no phase accounts for (background verified
    work or evaluation, the time between phases) is the row's growth minus the phases' sum ("between")."""
    print("\nmemory: peer | round | anon MiB | peak MiB | MiB added per phase (|x| > 8) | between")
    for f in files:
        prev = None
        for line in Path(f).read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            ex = r.get("extra") or {}
            rss = (ex.get("rss_mib") or {}).get("RssAnon")
            if rss is None:
                continue
            by_phase = ex.get("phase_rss_mib") or {}
            big = {k: v for k, v in by_phase.items() if abs(v) > 8}
            between = "" if prev is None else f"{rss - prev - sum(by_phase.values()):+.0f}"
            peak = (ex.get("memory") or {}).get("rss_peak_bytes", 0) / 2**20
            added = ", ".join(f"{k} {v:+.0f}" for k, v in big.items()) or "-"
            print(f"{Path(f).stem} | {r.get('round')} | {rss:.0f} | {peak:.0f} | {added} | {between}")
            prev = rss


def run_swarm(ns: argparse.Namespace) -> list[str]:
    """Start the swarm (processes owned by peer.demo.Swarm, stopped by PID at the end), wait for every
    peer to finish ``--rounds``; returns the peers' JSON row files."""
    from geomesh_p2p.util.procs import bootstrap_argv
    from peer.demo import Swarm

    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # a new run each time: the bootstrap's remembered state would have the peers wait for the last run's peers
    for old in [*workdir.glob("peer*.jsonl"), *workdir.glob("*.log"), *workdir.glob("bootstrap.state.json")]:
        old.unlink()
    swarm = Swarm(workdir)
    speeds = [float(x) for x in ns.speed_factors.split(",")]
    files, peers = [], []
    try:
        swarm.spawn("bootstrap", bootstrap_argv(ns.run_id, workdir / "bootstrap.key"))
        # Port 0: the bootstrap binds a free port and prints it (a port picked first could be taken).
        entry = swarm.address("bootstrap")
        for i in range(ns.peers):
            files.append(str(workdir / f"peer{i}.jsonl"))
            peers.append(
                swarm.spawn(
                    f"peer{i}",
                    join_argv(
                        entry,
                        workdir / f"peer{i}.key",
                        "--speed-factor",
                        str(speeds[i % len(speeds)]),
                        "--min-peers",
                        str(ns.peers),
                        "--rounds",
                        str(ns.rounds),
                        "--threads",
                        "1",
                        "--log-json",
                        files[-1],
                        *shlex.split(ns.peer_args),
                        run_id=ns.run_id,
                    ),
                )
            )
        deadline = time.monotonic() + ns.timeout_s
        for p in peers:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        swarm.stop()
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--speed-factors", default="1.0,0.55,0.4", help="as the demo's")
    ap.add_argument("--peer-args", default="", help="extra flags for every peer, e.g. '--eval-background'")
    ap.add_argument("--workdir", default="/tmp/round_overhead")
    ap.add_argument("--run-id", default="round-overhead")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", help="write the breakdown here")
    ap.add_argument("--analyze", nargs="+", metavar="JSONL", help="only analyze these row files")
    ns = ap.parse_args()
    files = ns.analyze or run_swarm(ns)
    res = analyze(files)
    if not res["peers"]:
        print("no rows with a cycle", file=sys.stderr)
        return 1
    print_table(res)
    print_memory(files)
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
