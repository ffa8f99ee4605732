"""Seconds from each peer's "done (--rounds N reached)" line to its process exit (docs/exit-lag.md).

Usage (from the repository root, with it on PYTHONPATH)::

    python benchmarks/exit_lag.py --mode accountable --peers 5 --dir /tmp/exit-lag

Starts ``--peers`` ``python -m peer.cli join`` processes on 127.0.0.1 (ports 0) with the e2e tests' FAST flags,
``--min-peers N --rounds 3``, the first as the others' bootstrap; polls their logs and exits every 0.2 s and
prints one line per peer: its exit status and lag. Kills, by PID, whatever is still running after ``--timeout``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from geomesh_p2p.util.procs import address_in_log  # noqa: E402
from tests.swarm_util import FAST  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="accountable")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=900.0)
    ns = ap.parse_args()
    ns.dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.getcwd())

    def start(name: str, bootstrap: str | None) -> None:
        d = ns.dir
        argv = [sys.executable, "-m", "peer.cli", "join", "--identity", str(d / f"{name}.key"), "--port", "0"]
        argv += ["--log-json", str(d / f"{name}.jsonl"), *FAST, "--mode", ns.mode]
        argv += ["--min-peers", str(ns.peers), "--rounds", str(ns.rounds)]
        argv += ["--bootstrap", bootstrap] if bootstrap else []
        with open(d / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    start("p0", None)
    entry = None
    while entry is None:
        entry = address_in_log(ns.dir / "p0.log")
        if procs["p0"].poll() is not None:
            raise SystemExit((ns.dir / "p0.log").read_text()[-3000:])
        time.sleep(0.5)
    for i in range(1, ns.peers):
        start(f"p{i}", entry)
    done: dict[str, float] = {}
    exited: dict[str, float] = {}
    t0 = time.time()
    while len(exited) < len(procs) and time.time() - t0 < ns.timeout:
        for name, p in procs.items():
            if name not in done and "done (" in (ns.dir / f"{name}.log").read_text(errors="replace"):
                done[name] = time.time()
            if name not in exited and p.poll() is not None:
                exited[name] = time.time()
        time.sleep(0.2)
    for name, p in procs.items():
        lag = exited[name] - done[name] if name in exited and name in done else float("nan")
        print(f"{name} rc {p.poll()} exit lag {lag:.1f} s", flush=True)
        if p.poll() is None:
            p.kill()
            p.wait()
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
