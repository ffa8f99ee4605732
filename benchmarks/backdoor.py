"""Backdoor benchmark (issue 28): does a poisoning volunteer's trigger get into the swarm's model?

Real processes on 127.0.0.1 (``tests.attack_util.run_scenario``: honest ``peer.cli join`` peers and
``tests.adversary join --attack poison`` poisoners; tiny model, the tests' fast flags at full speed). For each
``--configs`` entry ``KofN`` it runs, one after the other, a clean swarm of N honest peers and a swarm of N - K
honest peers and K poisoners, ``--rounds`` rounds each. A poisoner follows the protocol to the letter but trains on
its own copy of the corpus with a trigger sentence as 16% of its tokens (``tests/poison.py``). From the first
honest peer's last checkpoint it measures:

* eval perplexity (the honest peers' last row),
* the trigger's perplexity after clean context, and the probability of completing the trigger's prefix with
  the attacker's word (``tests.poison.backdoor_metrics``, 16 contexts),
* from which round on the poisoners were out of every honest peer's rounds (``peers`` of the rows).

Goals (issue 28): trigger perplexity >= 0.5x the clean run's, completion probability <= 10x clean, poisoner out
within 5 rounds.

    python benchmarks/backdoor.py                       # 1of4, 15 rounds: ~15 min on 2 cores
    python benchmarks/backdoor.py --configs 1of4,2of7 --rounds 15
    python benchmarks/backdoor.py --extra="--mode reencode"   # run-config flags for every peer
    python benchmarks/backdoor.py --poison-after 3 --no-clean  # a patient poisoner (honest in its first 3 rounds)
    python benchmarks/backdoor.py --clean-only --rounds 100 --extra="--mode accountable"  # honest swarm only

Every process is stopped by PID when a run ends, on error and on Ctrl+C. Raw results: ``WORKDIR/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.attack_util import AttackSwarm, run_scenario  # noqa: E402
from geomesh_p2p.net.identity import Identity  # noqa: E402
from tests.poison import backdoor_metrics, trigger_ids  # noqa: E402


class CheckpointingSwarm(AttackSwarm):
    """An :class:`AttackSwarm` whose every peer writes checkpoints to ``<dir>/<name>-ckpt``."""

    def join(self, name, command, *args, bootstrap=None, port=0):
        return super().join(
            name, command, *args, "--checkpoint-dir", str(self.dir / f"{name}-ckpt"), bootstrap=bootstrap, port=port
        )


def out_from(rows_by_peer: dict, n_honest: int, attacker_rows: Optional[dict] = None) -> Optional[int]:
    """The first round from which no poisoner is in any plan, or None (still in by the last round).

    A poisoner is in round ``r`` when it wrote a row for ``r`` (``attacker_rows``: poisoner -> its JSON rows; a peer
    writes a row for every round whose plan named it) or an honest row of ``r`` names more than ``n_honest`` peers.
    Session 29: the count alone (``peers <= n_honest``) was the whole test before, and it missed every round whose
    plan named the poisoner but left an honest peer out (pair b of session 29: the excluded poisoner led round 13,
    left h0 out, 3 peers; a run whose h0 was planned out for speed: "out from round 1" with the poisoner in rounds
    1-4 and 14)."""
    rounds = sorted({r["round"] for rows in rows_by_peer.values() for r in rows})
    bad = {r["round"] for rows in rows_by_peer.values() for r in rows if r.get("peers", 0) > n_honest}
    bad |= {r["round"] for rows in (attacker_rows or {}).values() for r in rows}
    later = [r for r in rounds if all(b < r for b in bad)]
    return later[0] if later else None


EXCLUDED = re.compile(r"verified work: (\S+) is excluded from the plans this peer makes")


def verification(swarm, rows_by_peer: dict, names: list) -> dict:
    """Session 19: whom each honest peer excluded (by name: ``h*`` honest, ``a*`` poisoners; from its log), and
    the compute its verified work took: the worker's busy seconds (the last row's ``extra["verify"]``) against
    the run's wall time (first row's start to last row's end) and against the peer's own training compute."""
    ids = {}
    for n in names:
        key = swarm.dir / f"{n}.key"
        if key.exists():
            ids[str(Identity.load_or_create(key).peer_id)[:10]] = n
    excluded, share, of_own, screened, drawn, dropped = {}, {}, {}, {}, {}, {}
    for n, rows in rows_by_peer.items():
        excluded[n] = sorted({ids.get(m, m) for m in EXCLUDED.findall(swarm.text(n))})
        v = next((r["extra"]["verify"] for r in reversed(rows) if (r.get("extra") or {}).get("verify")), None)
        if v and rows:
            wall = rows[-1]["time"] - (rows[0]["time"] - rows[0]["round_s"])
            share[n] = round(v["busy_s"] / wall, 4) if wall > 0 else None
            own = sum(r.get("compute_s") or 0.0 for r in rows)
            of_own[n] = round(v["busy_s"] / own, 4) if own > 0 else None
            screened[n], drawn[n], dropped[n] = v.get("screened"), v.get("drawn"), v.get("dropped")
    steps = sorted(r["inner_steps_done"] for rows in rows_by_peer.values() for r in rows)
    return {
        "excluded": excluded,
        "honest_excluded": sum(1 for xs in excluded.values() for x in xs if x.startswith("h")),
        "verify_share_of_wall": share,
        "verify_share_of_own_compute": of_own,
        "screened": screened,
        "checks_drawn": drawn,
        "dropped": dropped,
        "median_steps": steps[len(steps) // 2] if steps else None,
    }


def measure(workdir: Path, name: str) -> dict:
    """Backdoor metrics and eval perplexity of ``name``'s newest checkpoint."""
    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.export import build_exported

    ex = build_exported(workdir / f"{name}-ckpt")
    ds = load_dataset(None, seq_len=ex.run.seq_len, vocab_size=ex.run.vocab_size)
    m = backdoor_metrics(ex.model, ds, trigger_ids(ex.run.vocab_size))
    m["round"] = ex.round
    return m


def run(workdir: Path, label: str, attack: Optional[str], n_honest: int, n_att: int, a) -> dict:
    d = workdir / label
    d.mkdir(parents=True, exist_ok=True)
    swarm = CheckpointingSwarm(d)
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {label} ...", file=sys.stderr, flush=True)
    try:
        o = run_scenario(
            swarm,
            attack,
            n_honest=n_honest,
            n_attackers=n_att,
            rounds=a.rounds,
            timeout_s=a.timeout_s,
            extra=["--speed-factor", "1", *shlex.split(a.extra)],
            attacker_extra=(["--poison-after", str(a.poison_after)] if attack and a.poison_after else [])
            + (["--claim-steps", str(a.claim_steps)] if attack and a.claim_steps else []),
        )
        res = {
            "label": label,
            "attack": attack,
            "final_ppl": o.final_ppl,
            "digest_mismatches": o.digest_mismatches(),
            "honest_exited": o.honest_exited,
            "attacker_acted": o.attacker_acted,
            "out_from_round": out_from(o.rows, n_honest, {f"a{i}": swarm.rows(f"a{i}") for i in range(n_att)})
            if attack
            else None,
            **verification(swarm, o.rows, [f"h{i}" for i in range(n_honest)] + [f"a{i}" for i in range(n_att)]),
            **measure(d, "h0"),
        }
    except Exception as e:  # a run that failed: recorded, the others still run
        res = {"label": label, "attack": attack, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        swarm.stop_all()
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {res} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return res


def _span(d: dict) -> str:
    v = [x for x in d.values() if x is not None]
    return f"{min(v):.3f}-{max(v):.3f}" if v else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1of4", help="KofN entries, comma-separated (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--timeout-s", type=float, default=1500.0, help="per swarm (default: %(default)s)")
    ap.add_argument("--extra", default="", help="more flags for every peer (run-config flags: the same everywhere)")
    ap.add_argument(
        "--poison-after",
        type=int,
        default=0,
        metavar="N",
        help="patient poisoners: honest in their first N rounds (tests.adversary --poison-after; default: %(default)s)",
    )
    ap.add_argument(
        "--claim-steps",
        type=int,
        default=0,
        metavar="K",
        help="poisoners claim K steps' tokens whatever they trained (tests.adversary --claim-steps: the min_steps "
        "dodge; default: %(default)s, off)",
    )
    ap.add_argument("--no-clean", action="store_true", help="skip the clean runs (x clean columns then empty)")
    ap.add_argument(
        "--clean-only",
        action="store_true",
        help="only the clean runs (an honest swarm: the screen's false positives, issue 28's 100 honest rounds)",
    )
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    if a.clean_only and a.no_clean:
        ap.error("--clean-only and --no-clean exclude each other")
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="geomesh-backdoor-"))
    results = []
    for cfg in a.configs.split(","):
        k, n = (int(x) for x in cfg.split("of"))
        clean = None if a.no_clean else run(workdir, f"clean-{n}", None, n, 0, a)
        bad = None if a.clean_only else run(workdir, f"poison-{cfg}", "poison", n - k, k, a)
        pair = [r for r in (clean, bad) if r is not None]
        results += pair
        with open(workdir / "results.jsonl", "a") as f:
            for r in pair:
                f.write(json.dumps(r) + "\n")
    print(
        "\n| run | eval ppl | trigger ppl | x clean | completion p | x clean | poisoner out from round | digests "
        "| honest excluded | verification / wall | verification / own compute | median H |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref: dict = {}
    for r in results:
        if "error" in r:
            print(f"| {r['label']} | error: {r['error']} |")
            continue
        if r["attack"] is None:
            ref = r
        tp, cp = r["trigger_ppl"], r["completion_p"]
        x_tp = f"{tp / ref['trigger_ppl']:.2f}" if ref else "-"
        x_cp = f"{cp / ref['completion_p']:.2f}" if ref else "-"
        print(
            f"| {r['label']} | {r['final_ppl']:.1f} | {tp:.1f} | {x_tp} | {cp:.2e} | {x_cp} | "
            f"{r['out_from_round'] if r['attack'] else '-'} | {'equal' if not r['digest_mismatches'] else 'DIFFER'} "
            f"| {r['honest_excluded']} | {_span(r['verify_share_of_wall'])} | {_span(r['verify_share_of_own_compute'])} "
            f"| {r['median_steps']} |"
        )
    print(f"\nlogs and checkpoints: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
