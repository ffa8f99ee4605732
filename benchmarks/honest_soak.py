"""Red-team soak (issue 28): one short HONEST swarm as OS processes on 127.0.0.1; afterwards every peer's log
is scanned for verdicts against honest peers (failed checks, exclusions, lone verdicts), warnings, tracebacks
and non-zero exits. Run several at once (one process each) for CI-like load; ``--summary`` merges their JSON.

    python benchmarks/honest_soak.py --mode accountable --peers 3 --rounds 8 --out /tmp/soak/a1
    python benchmarks/honest_soak.py --summary /tmp/soak
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.util.procs import read_json_rows  # noqa: E402

PATTERNS = {
    "plain": re.compile(r"plain agreement", re.I),
    "trace": re.compile(r"trace\b.*<|marginal", re.I),
    "gain": re.compile(r"gain t|loss.gain", re.I),
    "scale": re.compile(r"scale .*(above|bound)|zero scales", re.I),
    "excluded": re.compile(r"excluded", re.I),
    "verified_work": re.compile(r"verified work", re.I),
    "lone": re.compile(r"\blone\b|holds? alone|held alone", re.I),
    "not_swarm": re.compile(r"NOT the swarm", re.I),
    "benched": re.compile(r"bench", re.I),
    "probation": re.compile(r"probation", re.I),
    "warning": re.compile(r"\bWARNING\b"),
    "error": re.compile(r"\bERROR\b|\bCRITICAL\b"),
    "traceback": re.compile(r"Traceback"),
}


def scan(text: str) -> dict[str, list[str]]:
    """Pattern name -> the matching log lines."""
    out: dict[str, list[str]] = {k: [] for k in PATTERNS}
    for line in text.splitlines():
        for k, rx in PATTERNS.items():
            if rx.search(line):
                out[k].append(line)
    return out


def run(ns) -> dict:
    from tests.attack_util import AttackSwarm, run_scenario

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    s = AttackSwarm(out)
    if ns.share:
        orig = s.peer

        def peer(name, *args, bootstrap=None, port=0, extra=()):
            return s.join(name, ["tests.redteam_join", "join"], *args, *extra, bootstrap=bootstrap, port=port)

        s.peer = peer  # type: ignore[method-assign]
        del orig
    extra = ["--mode", ns.mode, *ns.extra.split()]
    t0 = time.time()
    try:
        o = run_scenario(s, None, n_honest=ns.peers, rounds=ns.rounds, timeout_s=ns.timeout, extra=extra)
    finally:
        s.stop_all()
    res = {
        "mode": ns.mode,
        "peers": ns.peers,
        "rounds": ns.rounds,
        "extra": ns.extra,
        "share": ns.share,
        "force": ns.force,
        "wall_s": round(time.time() - t0, 1),
        "exit_codes": o.exit_codes,
        "completed": o.completed_rounds(),
        "digest_mismatches": o.digest_mismatches(),
        "steps": {n: [r.get("inner_steps_done") for r in rows] for n, rows in o.rows.items()},
        "hits": {n: {k: v for k, v in scan(s.text(n)).items() if v} for n in o.exit_codes},
    }
    (out / "result.json").write_text(json.dumps(res, indent=1))
    return res


PASS_LINE = re.compile(r"round (\d+): verified work of (\S+) passes: (.*)")
FAIL_LINE = re.compile(
    r"round (\d+): verified work: the contribution of (\S+) (is marginal|does not reproduce)[^:]*: (.*)"
)
SERVING = re.compile(r"peer (\S{10}) serving on")


def _kind(reason: str) -> str:
    """The statistic a failed check's reason names."""
    for k, needle in (("plain", "plain agreement"), ("trace", "trace"), ("gain", "loss gain"), ("scale", "scale")):
        if needle in reason:
            return k
    return "other"


def summary(root: Path) -> None:
    """Per (mode, peers): swarms, rounds, checks passed / failed per statistic, exclusions, non-zero exits; then the
    lowest passing plain / trace / gain t (with the accused's steps in that round) and every failure line."""
    table: dict = collections.defaultdict(collections.Counter)
    passes, lines = [], []
    for res in sorted(root.glob("**/result.json")):
        d, r = res.parent, json.loads(res.read_text())
        forced = r.get("force") or ("force" in d.name)  # a run with one miscalibrated peer: not an honest swarm
        t = table[(r["mode"], r["peers"], "FORCED" if forced else "honest")]
        names = list(r["exit_codes"])
        ids, steps = {}, {}
        for n in names:
            m = SERVING.search((d / f"{n}.log").read_text())
            if m:
                ids[m.group(1)] = n
            for x in read_json_rows(d / f"{n}.jsonl"):
                steps[(n, x["round"])] = x["inner_steps_done"]
        t["swarms"] += 1
        t["rounds"] += max(r["completed"].values())
        t["nonzero_exit"] += sum(c != 0 for c in r["exit_codes"].values())
        t["digest_mismatch_rounds"] += len(r["digest_mismatches"])
        for n in names:
            for line in (d / f"{n}.log").read_text().splitlines():
                if m := PASS_LINE.search(line):
                    rd, acc, reason = int(m.group(1)), m.group(2), m.group(3)
                    H = steps.get((ids.get(acc[:10]), rd))
                    t["passed_" + ("screen" if "screening" in reason else "check")] += 1
                    t["inconclusive"] += "inconclusive" in reason
                    for stat in ("plain", "trace", "gain t"):
                        if v := re.search(stat + r" (-?[\d.]+)", reason):
                            passes.append((stat, float(v.group(1)), d.name, n, rd, H))
                elif m := FAIL_LINE.search(line):
                    rd, acc, what, reason = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                    H = steps.get((ids.get(acc[:10]), rd))
                    t["failed_" + _kind(reason) + ("_marginal" if "marginal" in what else "")] += 1
                    lines.append(f"{d.name} {n} accused steps {H}: {line.strip()[:280]}")
                elif "is excluded from the plans" in line or "NOT the swarm" in line or "Traceback" in line:
                    t["excluded" if "excluded" in line else "not_swarm" if "NOT" in line else "traceback"] += 1
                    lines.append(f"{d.name} {n}: {line.strip()[:280]}")
    for k, v in sorted(table.items()):
        print(k, dict(v))
    for stat in ("plain", "trace", "gain t"):
        low = sorted(x for x in passes if x[0] == stat)[:4]
        print(f"lowest passing {stat}:", [(x[1], x[2], x[3], f"round {x[4]}", f"steps {x[5]}") for x in low])
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="relay")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--extra", default="", help="more flags for every peer, space-separated")
    ap.add_argument("--share", type=float, default=0.0, help="raise the check share (tests.redteam_join)")
    ap.add_argument("--force", default="", help="this peer (h0) fails every loss-gain test it runs (a lone verdict)")
    ap.add_argument("--out", default="/tmp/soak/x")
    ap.add_argument("--summary", default=None)
    ns = ap.parse_args()
    if ns.summary:
        summary(Path(ns.summary))
        return
    if ns.share:
        import os

        os.environ["GEOMESH_REDTEAM_SHARE"] = str(ns.share)
        if ns.force:
            os.environ["GEOMESH_REDTEAM_FORCE"] = ns.force
    r = run(ns)
    print(json.dumps({k: r[k] for k in ("exit_codes", "completed", "digest_mismatches", "wall_s")}))


if __name__ == "__main__":
    main()
