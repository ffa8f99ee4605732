"""Red team (issue 28): what a verdict held alone does to a 2-peer swarm. h0 runs ``tests.redteam_join`` with
``GEOMESH_REDTEAM_FORCE=h0`` (every loss-gain test it runs fails hard: a lone false positive, as the shipped gate
gives an honest peer that trained 5 steps under load); h1 is honest. Once h0 leads a round without h1, h1 never leads
again (``round/planning.last_round_leaders``: only round r - 1's participants lead round r), so it is planned out of
every later round. Then h0 stops (Ctrl+C) while h1 still runs, and h1's exit code and last lines are printed::

    PYTHONPATH=$PWD python benchmarks/lone_two_peers.py --out /tmp/lone2 --mode accountable
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/lone2")
    ap.add_argument("--mode", default="accountable")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=420)
    a = ap.parse_args()
    os.environ["GEOMESH_REDTEAM_SHARE"] = "0.05"
    os.environ["GEOMESH_REDTEAM_FORCE"] = "h0"
    from tests.swarm_util import ProcSwarm

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = ProcSwarm(out)
    common = ["--rounds", str(a.rounds), "--min-peers", "2", "--mode", a.mode, "--window-s", "3", "--speed-factor", "1"]
    try:
        s.join("h0", ["tests.redteam_join", "join"], *common)
        s.join("h1", ["tests.redteam_join", "join"], *common, bootstrap=s.address("h0"))
        s.wait_for(lambda: "not in the plan of leader" in s.text("h1"), a.timeout, "h1 planned out")
        s.wait_for(lambda: s.text("h1").count("not in the plan of leader") >= 2, a.timeout, "h1 planned out twice")
        s.interrupt("h0")
        end = time.time() + a.timeout  # not wait_for: it raises on h0's exit code
        while time.time() < end and s.procs["h1"].poll() is None:
            time.sleep(0.5)
        print("h0 exit", s.procs["h0"].wait(), "h1 exit", s.procs["h1"].returncode)
        print("\n".join(s.text("h1").splitlines()[-8:]))
    finally:
        s.stop_all()


if __name__ == "__main__":
    main()
