"""Who excluded whom, and when, in a ``benchmarks/attacks.py`` workdir (issue 26, session 26).

``benchmarks/attacks.py`` records perplexity, exits and digests; this reads the same runs' logs for the
exclusions accountable mode is judged by: for each run (a subfolder with ``h*.log`` honest peers and ``a*.log``
attackers), the round each attacker first acted as an owner (``forge`` / ``drop`` in its ``adversary_acted``
events), the round in which each honest peer logged its exclusion ("verified work: X is excluded from the plans
this peer makes: WHY"; the round then in progress, counted from the round table rows printed before it: the
exclusion is in that peer's plans from the next round), whether the reason is an owner proof ("owner ... proven")
or verified work, and any honest peer excluded anywhere (must be none). Prints a markdown table beside the
perplexity columns of ``results.jsonl``::

    python benchmarks/attack_exclusions.py WORKDIR [WORKDIR ...] [--out FILE]

``lag`` = exclusion round - first owner action round (0: excluded in the round it first forged or dropped),
over the honest peers that applied a round after that action (a peer planned out meanwhile, e.g. by a loaded
machine's timings, reads no proofs: it is counted in "excluded by" only, and named in brackets).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROW = re.compile(r"^\s+(\d+)\s+\d+\s+\d+\s+\d+/\d+")
SERVING = re.compile(r"peer (\S+) serving on ")
EXCLUDED = re.compile(r"verified work: (\S+) is excluded from the plans this peer makes: (.*)$")
OWNER_ACTIONS = ("forge", "drop")


def _pid10(log: Path) -> str:
    m = SERVING.search(log.read_text(errors="replace")) if log.exists() else None
    return m.group(1) if m else ""


def _exclusions(log: Path) -> list[tuple[int, str, str]]:
    """(round in progress, excluded PeerID prefix, reason) for each exclusion ``log`` records, oldest first."""
    out, last_row = [], -1
    for line in log.read_text(errors="replace").splitlines():
        m = ROW.match(line)
        if m:
            last_row = int(m.group(1))
            continue
        m = EXCLUDED.search(line)
        if m:
            out.append((last_row + 1, m.group(1), m.group(2)))
    return out


def _first_owner_action(events: Path) -> int | None:
    """The first round an attacker forged or dropped as an owner (its ``adversary_acted`` events), or None."""
    if not events.exists():
        return None
    rounds = []
    for line in events.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "adversary_acted" and e.get("action") in OWNER_ACTIONS:
            rounds.append(int(e["round"]))
    return min(rounds) if rounds else None


def analyse(run: Path) -> dict:
    """One run folder's exclusions: see the module docstring. Returns a dict (JSON-ready)."""
    honest = sorted(p.stem for p in run.glob("h*.log"))
    attackers = sorted(p.stem for p in run.glob("a*.log"))
    ids = {n: _pid10(run / f"{n}.log") for n in honest + attackers}
    honest_ids = {ids[n] for n in honest if ids[n]}
    rows = {h: _rounds_done(run / f"{h}.jsonl") for h in honest}
    per_attacker = {}
    wrongly = set()
    for a in attackers:
        per_attacker[a] = {"first_owner_action": _first_owner_action(run / f"{a}.events.jsonl"), "by": {}}
    for h in honest:
        for rnd, who, why in _exclusions(run / f"{h}.log"):
            if who in honest_ids:
                wrongly.add(f"{h} excluded {who} in round {rnd}: {why[:120]}")
            for a in attackers:
                if ids[a] == who and h not in per_attacker[a]["by"]:
                    kind = "proof" if why.startswith("owner ") and " proven" in why else "verified work"
                    per_attacker[a]["by"][h] = {"round": rnd, "kind": kind, "why": why[:160]}
    for a in per_attacker.values():  # honest peers that applied a round after the attacker's first owner action
        f = a["first_owner_action"]
        a["active"] = sorted(h for h in honest if any(r > (-1 if f is None else f) for r in rows[h]))
    return {"run": run.name, "honest": honest, "attackers": per_attacker, "honest_excluded": sorted(wrongly)}


def _rounds_done(path: Path) -> list[int]:
    """The rounds a peer applied (its JSON rows), [] without rows."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(int(json.loads(line)["round"]))
        except (ValueError, KeyError):
            continue
    return out


def _fmt_exclusions(a: dict, n_honest: int) -> tuple[str, str, str]:
    """(first owner action, excluded by, rounds until every honest peer) for one attacker."""
    f = a["first_owner_action"]
    by = a["by"]
    kinds = sorted({v["kind"] for v in by.values()})
    rounds = sorted(v["round"] for v in by.values())
    active = a.get("active", [])
    who = f"{len(by)} of {n_honest}" + (f" ({', '.join(kinds)})" if kinds else "")
    if len(active) < n_honest:
        who += f" [{len(active)} applied a round after it]"
    if not set(active) <= set(by):
        all_in = "not all"
    elif f is None:  # not an owner attack: when verified work had it out everywhere
        all_in = f"- (round {rounds[-1]})"
    else:
        all_in = f"{rounds[-1] - f} (round {rounds[-1]})"
    return "-" if f is None else str(f), who, all_in


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdirs", nargs="+", help="benchmarks/attacks.py --workdir folders")
    ap.add_argument("--out", help="also write the table here")
    ns = ap.parse_args(argv)
    lines = [
        "| attack | config | honest ppl | x clean | honest exited | digests equal | attacker: first owner "
        "action (round) | excluded by (honest peers) | rounds from first action until all honest excluded it "
        "| honest peers excluded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wd in map(Path, ns.workdirs):
        results = [json.loads(x) for x in (wd / "results.jsonl").read_text().splitlines() if x.strip()]
        refs = {r["config"]: r["final_ppl"] for r in results if r.get("reference")}
        for r in results:
            run = wd / r["label"]
            info = analyse(run) if run.exists() else {"attackers": {}, "honest_excluded": [], "honest": []}
            ref = refs.get(r["config"], float("nan"))
            ppl = r["final_ppl"]
            x = f"{ppl / ref:.2f}" if math.isfinite(ppl) and math.isfinite(ref) and ref > 0 else "n/a"
            exited = r["honest_exited"]
            exited_s = "0" if not exited else f"{len(exited)} of {r['n_honest']}"
            att = info["attackers"]
            cells = [_fmt_exclusions(att[a], len(info["honest"])) for a in sorted(att)]
            col = lambda k: "; ".join(f"{a}: {c[k]}" for a, c in zip(sorted(att), cells)) or "-"  # noqa: E731
            lines.append(
                f"| {r['name']} | {r['config']} | {ppl:,.1f} | {x} | "
                f"{exited_s} | "
                f"{'yes' if not r['digest_mismatches'] else 'no ' + str(r['digest_mismatches'][:5])} | "
                f"{col(0)} | {col(1)} | {col(2)} | {len(info['honest_excluded'])} |"
            )
            for w in info["honest_excluded"]:
                print(f"HONEST EXCLUDED in {r['label']}: {w}", file=sys.stderr)
    md = "\n".join(lines) + "\n"
    print(md)
    if ns.out:
        Path(ns.out).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
