"""A whole GeoMesh swarm on this machine: one bootstrap and N peers as separate OS processes on
127.0.0.1, training the --model preset (default: tiny) on the shipped corpus. Heterogeneity is emulated per peer
(--speed-factors: a peer with factor f sleeps so that each step takes 1/f as long; --memory-budgets
caps its batch). Prints one row per round for the swarm, stops at --target-ppl or --rounds, and
writes --summary-json. Every process it starts is stopped when it ends, also on Ctrl+C.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import shutil
import sys
import tempfile
import time
from pathlib import Path

from geomesh_p2p.config.flags import comma_numbers
from geomesh_p2p.util.procs import ProcGroup, bootstrap_argv, join_argv, read_json_rows, wait_for_address


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("demo")
    from peer.node_cli import _int_at_least, _positive_float

    g.add_argument(
        "--peers", type=_int_at_least(1, 64), default=3, help="number of peer processes (default: %(default)s)"
    )
    g.add_argument(
        "--speed-factors",
        type=comma_numbers(gt=0, le=1),
        default="1.0,0.55,0.4",
        help="per-peer relative speed, comma-separated, cycled (default: %(default)s)",
    )
    g.add_argument(
        "--memory-budgets",
        type=comma_numbers(gt=0),
        default="",
        help="per-peer CPU memory budget in GB, comma-separated (default: none)",
    )
    g.add_argument(
        "--rounds", type=_int_at_least(1), default=40, help="stop after this many rounds (default: %(default)s)"
    )
    g.add_argument(
        "--target-ppl",
        type=_positive_float,
        default=250.0,
        help="stop once the swarm's eval perplexity reaches this; the initial is ~4200 (default: %(default)s)",
    )
    g.add_argument("--workdir", help="where logs, keys and checkpoints go (default: a temporary folder)")
    g.add_argument("--summary-json", help="write the demo summary here, JSON (default: none written)")
    g.add_argument(
        "--threads-per-peer", type=_int_at_least(1), default=1, help="torch threads per peer (default: %(default)s)"
    )
    g.add_argument(
        "--timeout-s", type=_positive_float, default=900, help="give up after this long (default: %(default)s)"
    )


def _run_flags(ns: argparse.Namespace) -> list[str]:
    """The demo's run flags as each peer's argv, rendered from the RunConfig fields' own flags
    (:func:`peer.node_cli.run_argv`): every peer gets the same run config as the demo was given."""
    from peer.node_cli import run_argv

    return run_argv(ns)


class Swarm:
    """Starts and owns the demo's processes (``procs``: name -> Popen, in start order; logs in
    ``<workdir>/<name>.log``); :meth:`stop` ends every one of them, by PID (SIGINT, then SIGKILL)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._group = ProcGroup()
        self.procs = self._group.procs

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` in a session of its own (a Ctrl+C reaches the demo only, which stops it)."""
        return self._group.spawn(name, argv, self.workdir / f"{name}.log", new_session=True)

    def address(self, name: str, timeout: float = 120.0) -> str:
        """HOST:PORT that ``name`` (started with port 0) bound, from its "serving on" line. Raises
        RuntimeError when it exits first or after ``timeout`` seconds."""
        return wait_for_address(self.workdir / f"{name}.log", self.procs[name], timeout)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to each running process, SIGKILL to those still running ``grace_s`` seconds later."""
        self._group.stop_all(grace_s)


def cmd_demo(ns: argparse.Namespace) -> int:
    # each number was checked by its flag's type (comma_numbers), which names the flag at fault
    speeds = [float(x) for x in ns.speed_factors.split(",") if x.strip()]
    budgets = [float(x) for x in ns.memory_budgets.split(",") if x.strip()]
    if not speeds:
        print("geomesh-peer demo: --speed-factors: give at least one number in (0, 1]", file=sys.stderr)
        return 2
    from peer.node_cli import _check_writable, check_model

    try:  # a wrong --model fails here in one line, not in each peer's log after it started
        check_model(ns)
        # the files too: a --summary-json written after the whole swarm had run was a traceback that lost the
        # summary, a --workdir naming a file FileExistsError's (red team 43)
        given = Path(ns.workdir).expanduser() if ns.workdir else None  # a quoted "~/x" made a folder named "~"
        if given is not None and given.exists() and not given.is_dir():
            raise ValueError(f"--workdir {ns.workdir}: exists and is not a folder")
        made = given is not None and not given.exists()
        workdir = given or Path(tempfile.mkdtemp(prefix="geomesh-demo-"))
        workdir.mkdir(parents=True, exist_ok=True)
        if ns.summary_json:  # after the workdir: `make demo` puts the summary in it (runs/demo on a fresh clone)
            try:
                _check_writable("--summary-json", ns.summary_json)
            except ValueError:
                if made or given is None:
                    shutil.rmtree(workdir, ignore_errors=True)  # a refused start leaves no folder it made
                raise
    except ValueError as e:
        print(f"geomesh-peer demo: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a --workdir this user may not create
        print(f"geomesh-peer demo: --workdir {ns.workdir}: cannot create it ({e.strerror or e})", file=sys.stderr)
        return 2
    _clean_workdir(workdir)
    swarm = Swarm(workdir)
    print(f"GeoMesh demo: bootstrap + {ns.peers} peers on 127.0.0.1, method {ns.method}, logs in {workdir}")
    t0 = time.time()
    rc = 0

    def on_term(signum, _frame):  # SIGTERM stops the swarm like Ctrl+C does (no orphaned peers)
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) stop the swarm like Ctrl+C does
    old = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        # Port 0: the bootstrap binds a free port and prints it (a port picked first could be taken).
        swarm.spawn("bootstrap", bootstrap_argv(ns.run_id, workdir / "bootstrap.key"))
        entry = swarm.address("bootstrap")
        for i in range(ns.peers):
            f = speeds[i % len(speeds)]
            argv = join_argv(
                entry,
                workdir / f"peer{i}.key",
                "--speed-factor",
                str(f),
                "--min-peers",
                str(ns.peers),
                "--rounds",
                str(ns.rounds),
                # every peer evaluates the same global weights after every round (not auto's schedule, which
                # each peer sets by its own timings: a fresh-user trial saw peer 0 stop at round 5 and the two
                # others run a round 6 without it), so all see the target after the same round and stop together
                *(["--target-ppl", str(ns.target_ppl), "--eval-every", "1"] if ns.target_ppl is not None else []),
                "--threads",
                str(ns.threads_per_peer),
                "--log-json",
                str(workdir / f"peer{i}.jsonl"),
                "--summary-json",
                str(workdir / f"peer{i}.summary.json"),
                "--checkpoint-dir",
                str(workdir / f"ckpt{i}"),
            ) + _run_flags(ns)
            if budgets:
                argv += ["--memory-budget-gb", str(budgets[i % len(budgets)])]
            swarm.spawn(f"peer{i}", argv)
            print(f"  peer{i}: speed factor {f}")
        rc = _watch(ns, swarm, workdir, t0)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the swarm")
        rc = 130
    finally:
        swarm.stop()
        for s, h in old.items():
            signal.signal(s, h)
    summary = _summarize(ns, workdir, t0)
    if ns.summary_json:
        Path(ns.summary_json).expanduser().write_text(json.dumps(summary, indent=1))  # as checked at start
    _print_summary(summary, ns.summary_json)
    if rc == 0 and ns.target_ppl is not None and not summary["reached_target"]:
        rc = 1
    return rc


def _clean_workdir(workdir: Path) -> None:
    """A rerun in the same folder starts clean: remove what an earlier demo wrote (logs, round logs and
    events, summaries, checkpoints, the bootstrap's remembered swarm); identity keys and their proofs of
    work are kept. Without the bootstrap's state file, the new peers no longer wait for the old run's
    peers to come back (--on-empty-swarm wait): a second `make demo` hung."""
    stale = [*workdir.glob("peer*.jsonl"), *workdir.glob("*.summary.json"), *workdir.glob("*.log")]
    stale += list(workdir.glob("*.state.json"))
    ckpts = list(workdir.glob("ckpt*"))
    for old in stale:
        old.unlink()
    for old in ckpts:
        shutil.rmtree(old, ignore_errors=True)
    if stale or ckpts:  # said, not silent: a user may have wanted the earlier run's logs
        print(
            f"GeoMesh demo: cleared an earlier demo's {len(stale)} log/state files and {len(ckpts)} checkpoint folders in {workdir} (keys kept)"
        )


def _reached_at(row: dict | None, shown: int) -> str:
    """Where a target perplexity was measured, in both numberings: the round log's row ``r`` (the table's) evaluates
    the state after round ``r``'s exchange, which ``geomesh-peer checkpoints`` / ``export`` name round ``r + 1``
    (the round it starts; a fresh user 47 read "reached at round 3" against a newest checkpoint "round 4").
    ``row``: the round row that carries the perplexity (its ``eval_round``, the round whose end state it measured,
    when set: a background evaluation lands a round later); ``shown``: the table's round."""
    r = row.get("eval_round") if row is not None else None
    r = shown if not isinstance(r, int) else r
    return f"reached at round {r} (the state after round {r}: checkpoint round {r + 1} in ckptN/)"


def _watch(ns, swarm: Swarm, workdir: Path, t0: float) -> int:
    """Print one swarm row per finished round until the target, the last round or a failure."""
    shown = -1
    print(
        f"{'round':>5} {'peers':>5} {'batch/H per peer':<28} {'loss':>6} {'eval ppl':>9} "
        f"{'strag% max':>10} {'net% max':>8} {'KB sent/peer':>12} {'time':>6} digests"
    )
    while time.time() - t0 < ns.timeout_s:
        rows = [read_json_rows(workdir / f"peer{i}.jsonl") for i in range(ns.peers)]
        done_round = min((len(r) for r in rows), default=0) - 1
        while shown < done_round:
            shown += 1
            rr = [r[shown] for r in rows]
            digests = {r["digest"] for r in rr}
            bh = " ".join(
                f"{r['batch_size']}/{r['inner_steps_done']}" + ("!" if r.get("underfilled") else "") for r in rr
            )
            losses = [r["train_loss"] for r in rr if r["train_loss"] is not None]
            loss = sum(losses) / len(losses) if losses else float("nan")
            # the swarm's eval of the round: any peer's (the same global weights); None when none evaluated
            evald = next((r for r in rr if r["eval_ppl"] is not None), None)
            ppl = evald["eval_ppl"] if evald is not None else None
            print(
                f"{shown:>5} {rr[0]['peers']:>5} {bh:<28} {loss:>6.3f} "
                f"{(f'{ppl:.2f}' if ppl is not None else '-'):>9} {max(r['straggler_idle_pct'] for r in rr):>10.1f} "
                f"{max(r['network_idle_pct'] for r in rr):>8.1f} "
                f"{sum(r['bytes_sent'] for r in rr) / len(rr) / 1024:>12.1f} {rr[0]['round_s']:>6.1f} "
                f"{'equal' if len(digests) == 1 else 'DIFFER'}",
                flush=True,
            )
            if ns.target_ppl is not None and ppl is not None and ppl <= ns.target_ppl:
                print(
                    f"target eval perplexity {ns.target_ppl} {_reached_at(evald, shown)} after {rr[0]['time'] - t0:.0f}s"
                )
                # The peers saw the same perplexity and stop by themselves; give them the time to.
                peers = [p for name, p in swarm.procs.items() if name.startswith("peer")]
                deadline = time.time() + 60
                while time.time() < deadline and any(p.poll() is None for p in peers):
                    time.sleep(0.2)
                return 0
        for name, p in swarm.procs.items():
            if p.poll() is not None and p.returncode != 0:
                print(f"{name} exited with code {p.returncode}; its log: {workdir / (name + '.log')}")
                tail = (workdir / f"{name}.log").read_text().splitlines()[-15:]
                print("\n".join("    " + line for line in tail))
                return 1
        if all(p.poll() is not None for name, p in swarm.procs.items() if name.startswith("peer")):
            return 0
        time.sleep(0.5)
    print(f"demo timed out after {ns.timeout_s:.0f}s")
    return 1


def _summarize(ns, workdir: Path, t0: float) -> dict:
    rows = [read_json_rows(workdir / f"peer{i}.jsonl") for i in range(ns.peers)]
    n = min((len(r) for r in rows), default=0)
    curve = [rows[0][k]["eval_ppl"] for k in range(n)] if n else []
    initial = None
    s0 = workdir / "peer0.summary.json"
    if s0.exists():
        initial = json.loads(s0.read_text()).get("initial_eval_ppl")
    t_target = None
    target_round = None  # the round whose end state reached it (its checkpoint is named target_round + 1)
    if ns.target_ppl is not None:
        for k in range(n):
            if rows[0][k]["eval_ppl"] is not None and rows[0][k]["eval_ppl"] <= ns.target_ppl:
                t_target = rows[0][k]["time"] - t0
                er = rows[0][k].get("eval_round")
                target_round = er if isinstance(er, int) else k
                break
    per_peer = []
    for i, r in enumerate(rows):
        tot = sum(x["round_s"] for x in r) or 1e-9
        per_peer.append(
            {
                "peer": i,
                "rounds": len(r),
                "straggler_idle_pct": round(100 * sum(x["straggler_idle_s"] for x in r) / tot, 2),
                "network_idle_pct": round(100 * sum(x["network_idle_s"] for x in r) / tot, 2),
                "bytes_sent": sum(x["bytes_sent"] for x in r),
                "bytes_received": sum(x["bytes_received"] for x in r),
            }
        )
    digests_matched = all(len({rows[i][k]["digest"] for i in range(ns.peers)}) == 1 for k in range(n))
    return {
        "method": ns.method,
        "peers": ns.peers,
        "rounds": n,
        "initial_eval_ppl": initial,
        "final_eval_ppl": curve[-1] if curve else None,
        "eval_ppl_curve": curve,
        "target_ppl": ns.target_ppl,
        "reached_target": t_target is not None,
        "time_to_target_s": t_target,
        "target_round": target_round,
        "wall_s": time.time() - t0,
        "per_peer": per_peer,
        "digests_matched_every_round": digests_matched and n > 0,
        "workdir": str(workdir),
    }


def _target_said(s: dict) -> str:
    """The summary's words for the target: where and when it was reached, the round in both numberings."""
    if not s["reached_target"]:
        return "not reached"
    r = s.get("target_round")
    at = f" at round {r}, checkpoint round {r + 1}" if isinstance(r, int) else ""
    return f"reached{at} in {s['time_to_target_s']:.0f}s"


def _print_summary(s: dict, summary_json: str | None = None) -> None:
    print("\nsummary:")
    fmt = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
    print(
        f"  rounds {s['rounds']}, eval perplexity {fmt(s['initial_eval_ppl'])} -> {fmt(s['final_eval_ppl'])}"
        f" (target {s['target_ppl']}: {_target_said(s)})"
    )
    # not the table's figures: each row's strag% max / net% max is that round's worst peer
    print(
        "  idle per peer: its idle seconds / its round seconds, summed over all its rounds (round 0 included),"
        " not the table's per-round worst peer"
    )
    for p in s["per_peer"]:
        print(
            f"  peer{p['peer']}: straggler idle {p['straggler_idle_pct']:.1f}%, network idle "
            f"{p['network_idle_pct']:.1f}% over {p['rounds']} round(s), sent {p['bytes_sent'] / 1e6:.2f} MB"
        )
    print(f"  digests equal on every peer every round: {s['digests_matched_every_round']}")
    w = s["workdir"]
    print(f"\nresults in {w}: each peer's round rows (peerN.jsonl), log (peerN.log) and checkpoints (ckptN/)")
    if summary_json:
        print(f"summary (JSON): {summary_json}")
    # the console script by the name a user can run in this shell: not on PATH after `make demo` without the venv's
    # activate (a fresh user's report, session 36)
    prog = "geomesh-peer"
    if shutil.which(prog) is None and (Path(sys.executable).parent / prog).exists():
        prog = str(Path(sys.executable).parent / prog)
    print(f"next: {prog} generate --checkpoint-dir {w}/ckpt0 --prompt 'And God said'  (text from the model)")
    print("      README 'A swarm on one machine, to try it': run a bootstrap and peers yourself")
