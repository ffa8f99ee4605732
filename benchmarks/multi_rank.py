"""One box, two devices (issue 30): one peer of 2 ranks (``--local-devices cpu,cpu``) against two one-rank peers on
the same cores, each next to one ordinary peer (so there is a swarm), side by side in one run.

Per configuration: the box's bytes sent per round (the collective's, and everything: DHT, probes), the whole
swarm's, and the tokens the box trained per round (the 2-rank peer's, or the two one-rank peers' sum). Goals
(docs/multi-rank.md): the box's collective bytes about half, its tokens within 10%. Rounds after the first
(round 0 is warm-up: no step's time is known yet), medians over the rounds. The tiny model and short windows of
the tests (tests.swarm_util.FAST) with the speed factor given here. Other jobs on the machine change its load from
minute to minute: the configurations run in turns, A B C C B A ... (``--pairs``), each repetition's tokens ratios
are printed with the load averages at the starts of its runs, and the table pools every run's rounds. The 2-rank
peer runs with ``--rank-sync step`` (the ranks meet at every inner step: DDP) and ``--rank-sync round`` (each rank
steps alone, the ranks meet once a round), side by side (``--rank-sync both``, the default).

    .venv/bin/python benchmarks/multi_rank.py --rounds 8 --workdir /tmp/mrb
    .venv/bin/python benchmarks/multi_rank.py --rounds 8 --workdir /tmp/mrb --method diloco \
        --peer-args="--uniform-inner-steps 4"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.swarm_util import ProcSwarm  # noqa: E402  (the tests' process helper: benchmarks may use it)


def _collective_sent(row: dict) -> int:
    return int(row.get("extra", {}).get("traffic", {}).get("collective", {}).get("sent", 0))


def run_config(
    workdir: Path,
    two_ranks: bool,
    rounds: int,
    extra: list[str],
    box_speed: str = "0.5",
    other_speed: str = "0.5",
    rank_sync: str = "step",
) -> dict:
    """Start the ordinary peer and the box's peer(s), train ``rounds`` rounds, return the box's per-round figures
    (round -> figure) for the rounds after round 0 that every peer trained, and the 1-minute load average at the
    start. ``rank_sync``: the 2-rank peer's ``--rank-sync`` (every inner step, or once a round)."""
    workdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    sw = ProcSwarm(workdir)
    args = ["--rounds", str(rounds), "--min-peers", "2" if two_ranks else "3", *extra]
    box = ["box"] if two_ranks else ["box1", "box2"]
    try:
        entry = sw.start_peers(["other"], *args, "--speed-factor", other_speed)
        for name in box:
            devices = ["--local-devices", "cpu,cpu", "--rank-sync", rank_sync] if two_ranks else []
            sw.peer(name, *args, "--speed-factor", box_speed, *devices, bootstrap=entry)
        codes = sw.wait_exit(["other", *box], 60 + 20 * rounds)
        if any(codes.values()):
            raise SystemExit(f"a peer failed: {codes} (logs in {workdir})")
    finally:
        sw.stop_all(10)
    rows = {n: {r["round"]: r for r in sw.rows(n)} for n in ["other", *box]}
    common = sorted(set.intersection(*(set(v) for v in rows.values())) - {0})
    if not common:
        raise SystemExit(f"no round trained by every peer after round 0 (logs in {workdir})")
    figures = {
        "box_collective_sent": lambda r: sum(_collective_sent(rows[n][r]) for n in box),
        "box_sent": lambda r: sum(rows[n][r]["bytes_sent"] for n in box),
        "swarm_collective_sent": lambda r: sum(_collective_sent(rows[n][r]) for n in rows),
        "box_tokens": lambda r: sum(rows[n][r]["tokens"] for n in box),
        # the rate of the inner steps (emulated slow-down included): what AWB plans by, not rounded to whole steps
        "box_tokens_per_s": lambda r: sum(rows[n][r]["tokens"] / max(rows[n][r]["compute_s"], 1e-9) for n in box),
        "other_tokens": lambda r: rows["other"][r]["tokens"],
        "box_batch": lambda r: sum(rows[n][r]["batch_size"] for n in box),
    }
    return {
        "load": load,
        "per_round": {k: [f(r) for r in common] for k, f in figures.items()},
        "digests_agree": all(len({rows[n][r]["digest"] for n in rows}) == 1 for r in common),
    }


def pooled(runs: list[dict]) -> dict:
    """Medians per round over all the rounds of ``runs`` (one configuration), and whether digests agreed."""
    out: dict = {k: statistics.median(v for run in runs for v in run["per_round"][k]) for k in runs[0]["per_round"]}
    out["rounds"] = sum(len(run["per_round"]["box_tokens"]) for run in runs)
    out["digests_agree"] = all(run["digests_agree"] for run in runs)
    return out


#: The configurations: (key, label, two ranks, --rank-sync).
CONFIGS = {
    "step": ("2 ranks, step", True, "step"),
    "round": ("2 ranks, round", True, "round"),
    "one": ("2 x 1 rank", False, "step"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/multi_rank_bench"))
    ap.add_argument("--method", default="geomesh", help="the run's --method (default: %(default)s)")
    ap.add_argument("--speed-factor", default="0.5", help="the box's peers' --speed-factor (default: %(default)s)")
    ap.add_argument(
        "--other-speed-factor",
        help="the ordinary peer's --speed-factor (default: --speed-factor's). A low one (e.g. 0.2) leaves the "
        "box's processes a core each, as GPUs that no other process shares would be",
    )
    ap.add_argument("--peer-args", default="", help="more flags for every peer, e.g. '--uniform-inner-steps 4'")
    ap.add_argument(
        "--rank-sync",
        choices=["step", "round", "both"],
        default="both",
        help="the 2-rank peer's --rank-sync: its ranks meet every inner step (DDP), once a round (each steps "
        "alone), or both configurations side by side (default: %(default)s)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="repetitions: each runs every configuration once, in turns (A B C, then C B A, ...) so that a change "
        "of the machine's load hits all alike (default: %(default)s)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = ap.parse_args()
    extra = ["--method", ns.method, *shlex.split(ns.peer_args)]
    other_speed = ns.other_speed_factor or ns.speed_factor
    keys = (["step", "round"] if ns.rank_sync == "both" else [ns.rank_sync]) + ["one"]
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    for i in range(ns.pairs):
        for key in keys if i % 2 == 0 else keys[::-1]:
            _, two_ranks, sync = CONFIGS[key]
            runs[key].append(
                run_config(ns.workdir / f"{key}{i}", two_ranks, ns.rounds, extra, ns.speed_factor, other_speed, sync)
            )
    agg = {k: pooled(v) for k, v in runs.items()}
    pairs = []
    for i in range(ns.pairs):
        base = runs["one"][i]
        tb = statistics.median(base["per_round"]["box_tokens"])
        sb = statistics.median(base["per_round"]["box_tokens_per_s"])
        row: dict = {"pair": i, "load": {k: runs[k][i]["load"] for k in keys}, "tokens": {}, "ratio": {}, "rate": {}}
        for k in keys:
            ta = statistics.median(runs[k][i]["per_round"]["box_tokens"])
            sa = statistics.median(runs[k][i]["per_round"]["box_tokens_per_s"])
            row["tokens"][k] = ta
            row["ratio"][k] = ta / tb if tb else float("nan")
            row["rate"][k] = sa / sb if sb else float("nan")
        pairs.append(row)
    if ns.json:
        print(json.dumps({"configs": agg, "pairs": pairs}, indent=1))
        return 0
    print(
        f"method {ns.method}, speed factor {ns.speed_factor} (ordinary peer {other_speed}) {ns.peer_args}, medians "
        f"over the rounds after round 0 that every peer trained "
        f"({', '.join(str(agg[k]['rounds']) for k in keys)} rounds in {ns.pairs} run(s) each)"
    )
    heads = [CONFIGS[k][0] for k in keys]
    ratio_heads = [f"{CONFIGS[k][0].split(', ')[-1]}/1" for k in keys if k != "one"]
    print(f"{'':38}" + "".join(f"{h:>16}" for h in heads) + "".join(f"{h:>10}" for h in ratio_heads))
    for key, label in [
        ("box_collective_sent", "box: collective bytes sent"),
        ("box_sent", "box: all bytes sent (DHT, probes too)"),
        ("swarm_collective_sent", "swarm: collective bytes sent"),
        ("box_tokens", "box: tokens trained"),
        ("box_tokens_per_s", "box: tokens/s in its inner steps"),
        ("box_batch", "box: batch (sequences)"),
        ("other_tokens", "ordinary peer: tokens trained"),
    ]:
        b = agg["one"][key]
        vals = "".join(f"{agg[k][key]:>16,.0f}" for k in keys)
        ratios = "".join(f"{(agg[k][key] / b if b else float('nan')):>10.2f}" for k in keys if k != "one")
        print(f"{label:38}{vals}{ratios}")
    print(f"{'digests agree every round':38}" + "".join(f"{str(agg[k]['digests_agree']):>16}" for k in keys))
    for p in pairs:
        parts = ", ".join(
            f"{CONFIGS[k][0]} {p['tokens'][k]:,.0f} ({p['ratio'][k]:.2f}, tokens/s {p['rate'][k]:.2f})"
            for k in keys
            if k != "one"
        )
        loads = ", ".join(f"{p['load'][k]:.2f}" for k in keys)
        print(
            f"run {p['pair']}: box tokens per round {parts} against 2 x 1 rank {p['tokens']['one']:,.0f}; "
            f"1-minute load at the starts {loads}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
