"""One box, two devices (issue 30): one peer of 2 ranks (``--local-devices cpu,cpu``) against two one-rank peers on
the same cores, each next to one ordinary peer (so there is a swarm), side by side in one run.

Per configuration: the box's bytes sent per round (the collective's, and everything: DHT, probes), the whole
swarm's, and the tokens the box trained per round (the 2-rank peer's, or the two one-rank peers' sum). Goals
(docs/multi-rank.md): the box's collective bytes about half, its tokens within 10%. Rounds after the first
(round 0 is warm-up: no step's time is known yet), medians over the rounds. The tiny model and short windows of
the tests (tests.swarm_util.FAST) with the speed factor given here.

    .venv/bin/python benchmarks/multi_rank.py --rounds 8 --workdir /tmp/mrb
    .venv/bin/python benchmarks/multi_rank.py --rounds 8 --workdir /tmp/mrb --method diloco \
        --peer-args="--uniform-inner-steps 4"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.swarm_util import ProcSwarm  # noqa: E402  (the tests' process helper: benchmarks may use it)


def _collective_sent(row: dict) -> int:
    return int(row.get("extra", {}).get("traffic", {}).get("collective", {}).get("sent", 0))


def run_config(workdir: Path, two_ranks: bool, rounds: int, extra: list[str]) -> dict:
    """Start the ordinary peer and the box's peer(s), train ``rounds`` rounds, return per-round medians."""
    workdir.mkdir(parents=True, exist_ok=True)
    sw = ProcSwarm(workdir)
    args = ["--rounds", str(rounds), "--min-peers", "2" if two_ranks else "3", *extra]
    box = ["box"] if two_ranks else ["box1", "box2"]
    try:
        entry = sw.start_peers(["other"], *args)
        for name in box:
            sw.peer(name, *args, *(["--local-devices", "cpu,cpu"] if two_ranks else []), bootstrap=entry)
        codes = sw.wait_exit(["other", *box], 60 + 20 * rounds)
        if any(codes.values()):
            raise SystemExit(f"a peer failed: {codes} (logs in {workdir})")
    finally:
        sw.stop_all(10)
    rows = {n: {r["round"]: r for r in sw.rows(n)} for n in ["other", *box]}
    common = sorted(set.intersection(*(set(v) for v in rows.values())) - {0})
    if not common:
        raise SystemExit(f"no round trained by every peer after round 0 (logs in {workdir})")

    def med(f) -> float:
        return statistics.median(f(r) for r in common)

    return {
        "rounds": len(common),
        "box_collective_sent": med(lambda r: sum(_collective_sent(rows[n][r]) for n in box)),
        "box_sent": med(lambda r: sum(rows[n][r]["bytes_sent"] for n in box)),
        "swarm_collective_sent": med(lambda r: sum(_collective_sent(rows[n][r]) for n in rows)),
        "box_tokens": med(lambda r: sum(rows[n][r]["tokens"] for n in box)),
        "other_tokens": med(lambda r: rows["other"][r]["tokens"]),
        "box_batch": med(lambda r: sum(rows[n][r]["batch_size"] for n in box)),
        "digests_agree": all(len({rows[n][r]["digest"] for n in rows}) == 1 for r in common),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/multi_rank_bench"))
    ap.add_argument("--method", default="geomesh", help="the run's --method (default: %(default)s)")
    ap.add_argument("--speed-factor", default="0.5", help="every peer's --speed-factor (default: %(default)s)")
    ap.add_argument("--peer-args", default="", help="more flags for every peer, e.g. '--uniform-inner-steps 4'")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = ap.parse_args()
    extra = ["--method", ns.method, "--speed-factor", ns.speed_factor, *shlex.split(ns.peer_args)]
    res = {
        "one peer of 2 ranks": run_config(ns.workdir / "two_ranks", True, ns.rounds, extra),
        "two peers of 1 rank": run_config(ns.workdir / "one_rank", False, ns.rounds, extra),
    }
    if ns.json:
        print(json.dumps(res, indent=1))
        return 0
    a, b = res["one peer of 2 ranks"], res["two peers of 1 rank"]
    print(
        f"method {ns.method}, speed factor {ns.speed_factor} {ns.peer_args}, medians over the rounds after round 0 "
        f"that every peer trained ({a['rounds']} and {b['rounds']})"
    )
    print(f"{'':38}{'2 ranks':>14}{'2 x 1 rank':>14}{'ratio':>9}")
    for key, label in [
        ("box_collective_sent", "box: collective bytes sent"),
        ("box_sent", "box: all bytes sent (DHT, probes too)"),
        ("swarm_collective_sent", "swarm: collective bytes sent"),
        ("box_tokens", "box: tokens trained"),
        ("box_batch", "box: batch (sequences)"),
        ("other_tokens", "ordinary peer: tokens trained"),
    ]:
        ratio = a[key] / b[key] if b[key] else float("nan")
        print(f"{label:38}{a[key]:>14,.0f}{b[key]:>14,.0f}{ratio:>9.2f}")
    print(f"{'digests agree every round':38}{str(a['digests_agree']):>14}{str(b['digests_agree']):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
