"""Attack benchmark (issue 11): a clean swarm and each red-team attack, side by side in one session.

Every run is real processes on 127.0.0.1 (``peer.cli join`` for honest peers, ``python -m
tests.adversary join --attack A`` for attackers; tiny model, the tests' fast flags), ``--rounds``
rounds (default 15). For each ``--configs`` entry ``KofN`` (K attackers among N peers; default
``1of4,2of7``) it runs:

* ``clean (N-K honest)``: the honest peers alone -- the reference of the ``x clean`` column (an attacker
  whose contribution is merely ignored leaves the honest peers exactly this swarm);
* ``clean (N honest)``: every peer honest (what the swarm would reach with no attacker at all);
* each attack of ``--attacks`` (default: all of :data:`tests.adversary.ATTACKS`) with K attackers.

and prints a markdown table: attack | config | honest eval ppl after R rounds | x clean | honest peers
exited | digests equal among honest. ``rogue-leader`` identities are rigged so that an attacker leads the
first ``--lead-rounds`` rounds (default 3; rendezvous hashing would otherwise make that luck).

    python benchmarks/attacks.py                                  # everything, ~1 h on 2 cores
    python benchmarks/attacks.py --rounds 6 --attacks flipmax,forge-aggregate --configs 1of4
    python benchmarks/attacks.py --extra="--mode reencode"        # run-config flags for every peer
    python benchmarks/attacks.py --attacks forge-aggregate --attacker-extra="--relay-forge tamper"

Each run has a timeout (``--timeout-s``; honest peers still running then count as exited); every process
is stopped by PID when a run ends, on error and on Ctrl+C / SIGTERM / SIGHUP. Raw outcomes go to
``WORKDIR/results.jsonl``; ``--out FILE`` also writes the table there.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.adversary import ATTACKS  # noqa: E402
from tests.attack_util import AttackSwarm, run_scenario  # noqa: E402

_CURRENT: list[AttackSwarm] = []


_INTERRUPTED = False


def _on_signal(signum, _frame):
    global _INTERRUPTED
    if _INTERRUPTED:
        return  # the clean-up is already under way (bounded by its grace): let it finish
    _INTERRUPTED = True
    raise KeyboardInterrupt(f"signal {signum}")


def _parse_config(text: str) -> tuple[int, int]:
    k, sep, n = text.lower().partition("of")
    if not sep or not k.isdigit() or not n.isdigit() or not 0 < int(k) < int(n):
        raise argparse.ArgumentTypeError(f"expected KofN with 0 < K < N, e.g. 1of4, got {text!r}")
    return int(k), int(n)


def _fmt_ppl(v: float) -> str:
    if not math.isfinite(v):
        return "inf (no honest value)"
    return f"{v:,.1f}" if v < 1e5 else f"{v:.2g}"


def _fmt_ratio(v: float, ref: float) -> str:
    if not (math.isfinite(v) and math.isfinite(ref) and ref > 0):
        return "inf" if not math.isfinite(v) else "n/a"
    x = v / ref
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}" if x < 1e5 else f"{x:.2g}"


def run_one(
    workdir: Path,
    label: str,
    attack,
    *,
    n_honest: int,
    n_attackers: int,
    rounds: int,
    timeout_s: float,
    lead_rounds: int,
    extra: list[str],
    attacker_extra: list[str] = (),
) -> dict:
    d = workdir / label
    d.mkdir(parents=True, exist_ok=True)
    swarm = AttackSwarm(d)
    _CURRENT.append(swarm)
    t0 = time.time()
    print(
        f"[{time.strftime('%H:%M:%S')}] {label}: {n_honest} honest + {n_attackers} x {attack or '-'} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        o = run_scenario(
            swarm,
            attack,
            n_honest=n_honest,
            n_attackers=n_attackers,
            rounds=rounds,
            timeout_s=timeout_s,
            lead_rounds=lead_rounds if attack == "rogue-leader" else 0,
            extra=extra,
            attacker_extra=attacker_extra,
        )
        res = {
            "label": label,
            "attack": attack,
            "n_honest": n_honest,
            "n_attackers": o.n_attackers,
            "rounds": rounds,
            "final_ppl": o.final_ppl,
            "ppl_by_round": o.ppl_by_round(),
            "exit_codes": o.exit_codes,
            "attacker_exit_codes": o.attacker_exit_codes,
            "honest_exited": o.honest_exited,
            "digest_mismatches": o.digest_mismatches(),
            "attacker_acted": o.attacker_acted,
            "completed_rounds": o.completed_rounds(),
            "wall_s": round(o.wall_s, 1),
            "notes": o.notes,
        }
    except KeyboardInterrupt:
        swarm.stop_all(grace_s=10.0)
        raise
    except Exception as e:  # a run that could not even start: recorded, the others still run
        res = {
            "label": label,
            "attack": attack,
            "n_honest": n_honest,
            "n_attackers": n_attackers,
            "rounds": rounds,
            "final_ppl": float("inf"),
            "error": f"{type(e).__name__}: {str(e)[:500]}",
            "honest_exited": [f"h{i}" for i in range(n_honest)],
            "digest_mismatches": [],
            "attacker_acted": False,
        }
    finally:
        swarm.stop_all()
        _CURRENT.remove(swarm)
    print(
        f"[{time.strftime('%H:%M:%S')}] {label}: honest ppl {_fmt_ppl(res['final_ppl'])}, exited "
        f"{res['honest_exited'] or 'none'}, digest mismatches {res['digest_mismatches'] or 'none'} "
        f"({time.time() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return res


def table(results: list[dict], rounds: int) -> str:
    lines = [
        f"| attack | config | honest eval ppl after {rounds} rounds | x clean | honest peers exited | "
        f"digests equal among honest |",
        "|---|---|---|---|---|---|",
    ]
    refs = {r["config"]: r["final_ppl"] for r in results if r.get("reference")}
    for r in results:
        ref = refs.get(r["config"], float("nan"))
        exited = r["honest_exited"]
        exited_s = "0" if not exited else f"{len(exited)} of {r['n_honest']}"
        if r.get("error"):
            exited_s += f" (run failed: {r['error'][:80]})"
        elif r["attack"] and not r.get("attacker_acted"):
            exited_s += " (attacker never acted!)"
        dig = "yes" if not r["digest_mismatches"] else f"no (rounds {r['digest_mismatches'][:5]})"
        lines.append(
            f"| {r['name']} | {r['config']} | {_fmt_ppl(r['final_ppl'])} | {_fmt_ratio(r['final_ppl'], ref)} "
            f"| {exited_s} | {dig} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=15, help="rounds per run (default: %(default)s)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated attacks (default: all: %(default)s)")
    ap.add_argument("--configs", default="1of4,2of7", help="comma-separated KofN (default: %(default)s)")
    ap.add_argument("--workdir", help="where the runs' logs go (default: a new temporary folder, kept)")
    ap.add_argument("--timeout-s", type=float, help="per run (default: 120 + 15 s per round, scaled by peers / 4)")
    ap.add_argument("--lead-rounds", type=int, default=3, help="rogue-leader: rounds an attacker is rigged to lead")
    ap.add_argument("--extra", default="", help="more flags for every peer, e.g. '--mode relay' (one string)")
    ap.add_argument(
        "--attacker-extra",
        default="",
        help="more flags for the attackers only, e.g. '--relay-forge tamper' (one string)",
    )
    ap.add_argument("--no-all-honest", action="store_true", help="skip the 'clean (N honest)' rows")
    ap.add_argument("--out", help="also write the markdown table (with the command) to this file")
    ns = ap.parse_args(argv)

    attacks = [a.strip() for a in ns.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s) {unknown}; known: {', '.join(ATTACKS)}")
    try:
        configs = [_parse_config(c.strip()) for c in ns.configs.split(",") if c.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if ns.rounds < 1:
        ap.error("--rounds must be >= 1")
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="geomesh-attacks-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # full speed (the tests' FAST flags emulate a half-speed device since session 11): the figures in
    # docs/security.md were measured so; --extra may still set another --speed-factor (the last one counts)
    extra = ["--speed-factor", "1", *shlex.split(ns.extra)]
    attacker_extra = shlex.split(ns.attacker_extra)
    # SIGINT too: started in the background by a shell, this process (and so its peers) would ignore it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    print(f"workdir: {workdir}", file=sys.stderr)

    results: list[dict] = []
    t0 = time.time()
    try:
        with open(workdir / "results.jsonl", "a") as log:
            for k, n in configs:
                cfg = f"{k}of{n}"
                timeout = ns.timeout_s or (120 + 15 * ns.rounds) * max(1.0, n / 4)
                runs = [(f"clean ({n - k} honest)", None, n - k, 0, True)]
                if not ns.no_all_honest:
                    runs.append((f"clean ({n} honest)", None, n, 0, False))
                runs += [(a, a, n - k, k, False) for a in attacks]
                for name, attack, n_h, n_a, is_ref in runs:
                    label = f"{cfg}-{name.replace(' ', '_').replace('(', '').replace(')', '')}"
                    res = run_one(
                        workdir,
                        label,
                        attack,
                        n_honest=n_h,
                        n_attackers=n_a,
                        rounds=ns.rounds,
                        timeout_s=timeout,
                        lead_rounds=ns.lead_rounds,
                        extra=extra,
                        attacker_extra=attacker_extra,
                    )
                    res.update(name=name, config=cfg, reference=is_ref)
                    results.append(res)
                    log.write(json.dumps(res, default=str) + "\n")
                    log.flush()
    except KeyboardInterrupt:
        print("\ninterrupted: processes stopped; partial table below", file=sys.stderr)
    finally:
        for s in list(_CURRENT):
            s.stop_all(grace_s=10.0)
    cmd = "python benchmarks/attacks.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    md = (
        f"{table(results, ns.rounds)}\n\n`x clean`: ratio to the clean run of the same config's honest peers alone, "
        f"measured in this session. Command: `{cmd.strip()}` ({(time.time() - t0) / 60:.0f} min).\n"
    )
    print(md)
    if ns.out:
        Path(ns.out).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
