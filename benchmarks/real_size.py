"""Real model sizes on a modest machine (issue 13): peak RSS, loop stalls, round overhead, a joiner.

    .venv/bin/python benchmarks/real_size.py                                   # the full matrix (long)
    .venv/bin/python benchmarks/real_size.py --model gpt2-124m --method geomesh --rounds 2 --quick

For each (model, method): a ``geomesh-bootstrap`` (``python -m bootstrap.cli``) and ``--peers``
(default 3) ``geomesh-peer join`` processes (``python -m peer.cli join``) on 127.0.0.1, on CPU, batch
1-2, a few inner steps per round. Once every peer has logged ``--rounds`` rounds, a 4th peer joins
and downloads the swarm's state; then every process is stopped (SIGINT, then SIGKILL after a grace
period), by PID. Printed, per peer, and written as JSON (``--out``):

* peak RSS (the larger of the VmHWM sampled from /proc/PID/status and the ``ru_maxrss`` the kernel
  reports when the process is reaped) against the minimum the method needs
  (:func:`geomesh_p2p.model.memory.method_min_memory`: weights + gradients + inner AdamW state + global
  weights + outer state, fp32), and the ratio (goal for geomesh: <= 1.25x);
* per round: the worst event-loop stall (``loop_stall_ms`` of the round log, when the node writes it;
  goal <= 50 ms), round time minus compute time (exchange + outer step + digest + straggler idle;
  also without the straggler idle; goal for 150M on loopback: <= 2 s), and whether the digests of
  all peers are equal;
* the joiner's download time (from the line where its start-up profile is done, its last step before
  it looks for the swarm's state, to its "downloaded state" line; polled every 0.2 s) and its peak RSS;
* the time to write one checkpoint of the state (weights + outer state, fp32 safetensors with fsync,
  :func:`geomesh_p2p.model.state.save_checkpoint`, the node's own writer) in a helper process.

The parent process imports neither torch nor the model (its RSS would otherwise leak into the
children's ``ru_maxrss`` through fork); model facts come from a helper process (``--helper``).
Results are measurements of this machine under its current load: other processes on a shared box
slow the steps down (compute time), not the memory figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# Goals of issue 13.
GOAL_RSS_RATIO = 1.25
GOAL_STALL_MS = 50.0
GOAL_OVERHEAD_S = 2.0
GOAL_BASELINE_BUDGET = 24 * GIB

_PROFILED = re.compile(r"device .*tokens/s per batch|profile: batch \d+:")
_DOWNLOADED = re.compile(r"downloaded state of round (\d+)")
_SERVING = re.compile(r"serving on (\S+)")  # the bootstrap's line once it listens; group 1: HOST:PORT


# ---------------------------------------------------------------------------------------------
# processes


class Proc:
    """One child process: its log file, sampled memory (VmHWM/VmRSS every 0.25 s) and, once reaped
    with ``os.wait4``, its exit status and kernel-reported peak RSS (bytes)."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict):
        self.name, self.argv, self.log_path = name, argv, log_path
        with open(log_path, "ab") as out:
            # The Popen object is kept (not polled): this class reaps the child itself, for its rusage.
            self._popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
        self.pid = self._popen.pid
        self.started = time.time()
        self.returncode: int | None = None
        self.ru_maxrss = 0
        self.hwm = 0
        self.rss_max = 0

    def sample(self) -> None:
        """Read VmHWM / VmRSS (bytes) while the process lives."""
        if self.returncode is not None:
            return
        try:
            with open(f"/proc/{self.pid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.hwm = max(self.hwm, int(line.split()[1]) * 1024)
                    elif line.startswith("VmRSS:"):
                        self.rss_max = max(self.rss_max, int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            pass

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status, ru = os.wait4(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.ru_maxrss = ru.ru_maxrss * 1024  # Linux reports KiB
                self._popen.returncode = self.returncode  # so Popen never reaps it again
        return self.returncode

    @property
    def peak_rss(self) -> int:
        return max(self.hwm, self.rss_max, self.ru_maxrss)

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class Procs:
    """Every process this script starts; :meth:`stop_all` ends them by PID (SIGINT, then SIGKILL).
    A thread samples their memory every 0.25 s."""

    def __init__(self):
        self.procs: dict[str, Proc] = {}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="rss-sampler", daemon=True)
        self._sampler.start()

    def _sample_loop(self) -> None:
        while not self._stop.wait(0.25):
            for p in list(self.procs.values()):
                p.sample()

    def spawn(self, name: str, argv: list[str], log_path: Path) -> Proc:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = Proc(name, argv, log_path, env)
        self.procs[name] = p
        return p

    def stop(self, names, grace_s: float = 60.0) -> None:
        ps = [self.procs[n] for n in names if n in self.procs]
        for p in ps:
            p.sample()
            p.signal(signal.SIGINT)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.poll() is None for p in ps):
            for p in ps:
                p.sample()
            time.sleep(0.1)
        for p in ps:
            if p.poll() is None:
                p.signal(signal.SIGKILL)
                while p.poll() is None:
                    time.sleep(0.05)

    def stop_all(self, grace_s: float = 60.0) -> None:
        self.stop(list(self.procs), grace_s)

    def close(self) -> None:
        self.stop_all(grace_s=20.0)
        self._stop.set()


def wait_for(cond, timeout_s: float, what: str, procs: list[Proc], poll_s: float = 0.2) -> float:
    """Poll ``cond()`` until true; returns the time it became true. Raises RuntimeError on timeout or
    when one of ``procs`` exits first (with the tail of its log)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return time.time()
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited with {p.returncode} while waiting for {what}; its log ends:\n" + p.text()[-2500:]
                )
        time.sleep(poll_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


# ---------------------------------------------------------------------------------------------
# helper process: model facts and a checkpoint write (imports torch; kept out of the parent)


def helper(model: str, method: str, vocab_size: int) -> dict:
    """Parameters, the method's minimum memory (bytes, by part) and the seconds to write one
    checkpoint of the state (theta [P] + outer state [k*P], fp32) to a temporary directory."""
    import torch

    from geomesh_p2p.model import state as gstate
    from geomesh_p2p.model.memory import method_min_memory
    from geomesh_p2p.model.build import count_params

    n = count_params(model, vocab_size=vocab_size)
    mins = {m: method_min_memory(n, m) for m in ("geomesh", "diloco", "ddp")}
    k = 2 if method == "ddp" else 1
    theta = torch.randn(n)
    momentum = torch.randn(k * n)
    with tempfile.TemporaryDirectory(prefix="real-size-ckpt-") as d:
        t0 = time.perf_counter()
        gstate.save_checkpoint(d, round=1, theta=theta, momentum=momentum, meta={"benchmark": "real_size"})
        ckpt_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(d).iterdir())
    return {
        "n_params": n,
        "checkpoint_s": ckpt_s,
        "checkpoint_bytes": size,
        "min_bytes": {
            m: {
                "total": v.total,
                "weights": v.weights,
                "gradients": v.gradients,
                "inner_optimizer": v.inner_optimizer,
                "global_weights": v.global_weights,
                "outer_state": v.outer_state,
            }
            for m, v in mins.items()
        },
    }


def run_helper(model: str, method: str, vocab_size: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--helper", model, method, str(vocab_size)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"helper failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# one (model, method)


def run_one(model: str, method: str, args, workdir: Path, procs: Procs, results: list) -> dict:
    """Run one (model, method) swarm, append its result to ``results`` (also when interrupted) and
    return it. Raises KeyboardInterrupt after the summary when interrupted."""
    from geomesh_p2p.util.procs import bootstrap_argv

    tag = f"{model}-{method}"
    d = workdir / tag
    d.mkdir(parents=True, exist_ok=True)
    facts = run_helper(model, method, args.vocab_size)
    print(
        f"[{tag}] {facts['n_params']:,} parameters; minimum for {method}: "
        f"{facts['min_bytes'][method]['total'] / GIB:.2f} GiB; checkpoint write {facts['checkpoint_s']:.2f}s "
        f"({facts['checkpoint_bytes'] / GIB:.2f} GiB)",
        flush=True,
    )
    exe = [sys.executable, "-m"]
    run_id = f"real-size-{tag}"
    # Port 0: the bootstrap binds a free port and prints it ("serving on HOST:PORT"); a port picked here
    # first could be taken by another process before the bootstrap binds it.
    boot = procs.spawn(
        f"{tag}/bootstrap",
        bootstrap_argv(run_id, d / "bootstrap.key", "--pow-bits", "8"),  # the peers' below
        d / "bootstrap.log",
    )
    wait_for(lambda: _SERVING.search(boot.text()) is not None, 120, "the bootstrap to listen", [boot])
    entry = _SERVING.search(boot.text()).group(1)
    common = [
        "--model",
        model,
        "--method",
        method,
        "--device",
        "cpu",
        "--threads",
        str(args.threads),
        "--seq-len",
        str(args.seq_len),
        "--target-batch",
        str(args.batch),
        "--profile-batches",
        args.profile_batches,
        "--uniform-inner-steps",
        str(args.inner_steps),
        "--window-s",
        str(args.window_s),
        "--run-id",
        run_id,
        "--pow-bits",
        "8",
        "--bootstrap",
        entry,
        "--vocab-size",
        str(args.vocab_size),
        "--eval-every",
        "1000",
    ]
    if args.memory_budget_gb:
        common += ["--memory-budget-gb", str(args.memory_budget_gb)]
    if args.mmap_threshold_mib is not None:
        common += ["--mmap-threshold-mib", str(args.mmap_threshold_mib)]
    names = [f"{tag}/peer{i}" for i in range(args.peers)]
    peers = []
    t0 = time.time()
    for i, name in enumerate(names):
        argv = (
            exe
            + [
                "peer.cli",
                "join",
                "--identity",
                str(d / f"peer{i}.key"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--log-json",
                str(d / f"peer{i}.jsonl"),
                "--summary-json",
                str(d / f"peer{i}.summary.json"),
                "--min-peers",
                str(args.peers),
                "--wait-peers-s",
                str(args.timeout_s),
                "--rounds",
                str(args.rounds + 3),
            ]
            + common
        )
        if args.pin:  # one core each, as peers on separate machines (taskset execs the peer: same PID)
            argv = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[i % len(os.sched_getaffinity(0))])] + argv
        peers.append(procs.spawn(name, argv, d / f"peer{i}.log"))
    last = None
    status = "ok"
    joiner = None
    download_s = None
    interrupted = False
    hwm_profiled: dict[str, int] = {}
    loads: list[float] = []  # 1-minute load average, sampled while waiting (the machine may be shared)
    try:

        def rounds_done() -> bool:
            nonlocal last
            loads.append(os.getloadavg()[0])
            counts = [len(read_rows(d / f"peer{i}.jsonl")) for i in range(args.peers)]
            for p in peers:  # peak RSS once the start-up profile is done: what start-up alone costs
                if p.name not in hwm_profiled and _PROFILED.search(p.text()):
                    p.sample()
                    hwm_profiled[p.name] = p.hwm
            if counts != last:
                print(f"[{tag}] {time.time() - t0:6.0f}s rounds logged per peer: {counts}", flush=True)
                last = counts
            return min(counts) >= args.rounds

        wait_for(rounds_done, args.timeout_s, f"{args.rounds} rounds on every peer", peers, poll_s=1.0)
        if args.no_joiner:
            print(f"[{tag}] no joiner (--no-joiner)", flush=True)
        else:
            # The joiner: a fresh peer that downloads the state the swarm backs.
            jname = f"{tag}/joiner"
            joiner = procs.spawn(
                jname,
                exe
                + [
                    "peer.cli",
                    "join",
                    "--identity",
                    str(d / "joiner.key"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--log-json",
                    str(d / "joiner.jsonl"),
                    "--rounds",
                    str(args.rounds + 3),
                ]
                + common,
                d / "joiner.log",
            )
            t_prof = wait_for(
                lambda: bool(_PROFILED.search(joiner.text())), args.timeout_s, "the joiner's start-up profile", [joiner]
            )
            # Either it downloads, or it logs a round or exits without one: then the swarm's state was
            # still the seed's, which the joiner holds already (every round so far aggregated nothing).
            t_dl = wait_for(
                lambda: bool(
                    _DOWNLOADED.search(joiner.text()) or read_rows(d / "joiner.jsonl") or joiner.poll() is not None
                ),
                args.timeout_s,
                "the joiner's state download",
                [],
            )
            if _DOWNLOADED.search(joiner.text()):
                download_s = t_dl - t_prof
                print(
                    f"[{tag}] joiner downloaded the state in {download_s:.1f}s "
                    f"({t_dl - joiner.started:.0f}s after its start)",
                    flush=True,
                )
            elif joiner.poll() not in (None, 0):
                raise RuntimeError(
                    f"the joiner exited with {joiner.returncode}; its log ends:\n{joiner.text()[-2500:]}"
                )
            else:
                status = (
                    "joiner did not download: the swarm's state was still the seed state it holds "
                    "(no round aggregated an update)"
                )
                print(f"[{tag}] {status}", flush=True)
    except RuntimeError as e:
        status = f"failed: {e}"
        print(f"[{tag}] {status}", flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
        print(f"[{tag}] interrupted: stopping its processes, then the summary of what was logged", flush=True)
        interrupted = True
    finally:
        procs.stop([*names, *([joiner.name] if joiner else []), boot.name], grace_s=args.grace_s)
    res = summarise(
        tag, model, method, facts, d, peers, joiner, download_s, status, time.time() - t0, args, hwm_profiled, loads
    )
    results.append(res)
    if interrupted:
        raise KeyboardInterrupt
    return res


def summarise(
    tag,
    model,
    method,
    facts,
    d: Path,
    peers: list[Proc],
    joiner,
    download_s,
    status,
    wall_s,
    args,
    hwm_profiled: dict,
    loads: Sequence[float] = (),
) -> dict:
    min_bytes = facts["min_bytes"][method]["total"]
    rows = {i: [r for r in read_rows(d / f"peer{i}.jsonl")] for i in range(len(peers))}
    by_round: dict[int, dict[int, dict]] = {}
    for i, rs in rows.items():
        for r in rs:
            by_round.setdefault(int(r["round"]), {})[i] = r
    rounds = []
    prev_digest = None
    for rnd in sorted(by_round)[: args.rounds]:
        rr = by_round[rnd]
        stalls = [r.get("loop_stall_ms") for r in rr.values() if r.get("loop_stall_ms") is not None]
        over = [r["round_s"] - r["compute_s"] for r in rr.values()]
        over_ns = [r["round_s"] - r["compute_s"] - r.get("straggler_idle_s", 0.0) for r in rr.values()]
        digests = {r.get("digest") for r in rr.values()}
        # a round that aggregated an update moves the state: its digest differs from the previous round's
        changed = None if prev_digest is None or len(digests) != 1 else next(iter(digests)) != prev_digest
        prev_digest = next(iter(digests)) if len(digests) == 1 else None
        rounds.append(
            {
                "round": rnd,
                "peers_logged": len(rr),
                "compute_s": [round(r["compute_s"], 2) for r in rr.values()],
                "round_s": [round(r["round_s"], 2) for r in rr.values()],
                "worst_stall_ms": max(stalls) if stalls else None,
                "max_round_minus_compute_s": max(over),
                "max_round_minus_compute_minus_idle_s": max(over_ns),
                "digests_equal": len(digests) == 1 and len(rr) == len(peers),
                "digest_changed": changed,
                "min_contributors": min((int(r.get("contributors", 0)) for r in rr.values()), default=0),
                "missing_parts": max((int(r.get("missing_parts", 0)) for r in rr.values()), default=0),
            }
        )
    peer_mem = [
        {
            "name": p.name,
            "peak_rss_bytes": p.peak_rss,
            "ratio_to_min": p.peak_rss / min_bytes,
            "peak_rss_after_profile_bytes": hwm_profiled.get(p.name),
            "exit": p.returncode,
        }
        for p in peers
    ]
    jrows = read_rows(d / "joiner.jsonl")
    res = {
        "tag": tag,
        "model": model,
        "method": method,
        "status": status,
        "wall_s": wall_s,
        "n_params": facts["n_params"],
        "min_bytes": facts["min_bytes"][method],
        "peers": peer_mem,
        "sum_peak_rss_bytes": sum(p.peak_rss for p in peers),
        "rounds": rounds,
        "checkpoint_s": facts["checkpoint_s"],
        "checkpoint_bytes": facts["checkpoint_bytes"],
        "load_avg_1m": {"max": max(loads), "mean": sum(loads) / len(loads)} if loads else None,
        "joiner": None
        if joiner is None
        else {
            "download_s": download_s,
            "peak_rss_bytes": joiner.peak_rss,
            "ratio_to_min": joiner.peak_rss / min_bytes,
            "rounds_logged": len(jrows),
            "worst_stall_ms": max(
                (r["loop_stall_ms"] for r in jrows if r.get("loop_stall_ms") is not None), default=None
            ),
            "exit": joiner.returncode,
        },
        "settings": {
            k: getattr(args, k)
            for k in ("seq_len", "batch", "inner_steps", "window_s", "threads", "profile_batches", "peers", "rounds")
        },
    }
    print_result(res)
    return res


def _g(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def print_result(res: dict) -> None:
    print(f"\n=== {res['tag']}: {res['status']} ({res['wall_s']:.0f}s) ===")
    mb = res["min_bytes"]
    print(
        f"minimum for {res['method']}: {mb['total']:,} bytes ({_g(mb['total'])}) = weights {mb['weights']:,} + "
        f"gradients {mb['gradients']:,} + inner optimizer {mb['inner_optimizer']:,} + global weights "
        f"{mb['global_weights']:,} + outer state {mb['outer_state']:,}"
    )
    for p in res["peers"]:
        goal = f" (goal <= {GOAL_RSS_RATIO}x)" if res["method"] == "geomesh" else ""
        after = p.get("peak_rss_after_profile_bytes")
        print(
            f"  {p['name']:<28} peak RSS {_g(p['peak_rss_bytes']):>10}  = {p['ratio_to_min']:.2f}x the minimum{goal}"
            f"  (peak once profiled: {'-' if after is None else _g(after)})  exit {p['exit']}"
        )
    tot = res["sum_peak_rss_bytes"]
    print(f"  sum of the peers' peaks {_g(tot)} ({100 * tot / GOAL_BASELINE_BUDGET:.0f}% of 24 GiB)")
    print(
        f"{'round':>5} {'peers':>5} {'compute s':>16} {'round s':>16} {'stall ms':>9} {'round-compute s':>15} "
        f"{'(-idle) s':>9} contributors digests"
    )
    for r in res["rounds"]:
        st = "-" if r["worst_stall_ms"] is None else f"{r['worst_stall_ms']:.0f}"
        print(
            f"{r['round']:>5} {r['peers_logged']:>5} {','.join(map(str, r['compute_s'])):>16} "
            f"{','.join(map(str, r['round_s'])):>16} {st:>9} {r['max_round_minus_compute_s']:>15.2f} "
            f"{r['max_round_minus_compute_minus_idle_s']:>9.2f} {r.get('min_contributors', '-'):>12} "
            f"{'equal' if r['digests_equal'] else 'DIFFER'}"
            f"{'' if r.get('digest_changed') is None else (', changed' if r['digest_changed'] else ', UNCHANGED')}"
        )
    print(f"  goals: stall <= {GOAL_STALL_MS:.0f} ms, round - compute <= {GOAL_OVERHEAD_S:.0f} s (150M, loopback)")
    j = res["joiner"]
    if j:
        dl = "-" if j["download_s"] is None else f"{j['download_s']:.1f}s"
        st = "-" if j.get("worst_stall_ms") is None else f"{j['worst_stall_ms']:.0f} ms"
        print(
            f"  joiner: download {dl}, peak RSS {_g(j['peak_rss_bytes'])} ({j['ratio_to_min']:.2f}x), "
            f"{j.get('rounds_logged', 0)} round(s) logged, worst stall {st}"
        )
    print(f"  checkpoint write: {res['checkpoint_s']:.2f}s for {_g(res['checkpoint_bytes'])}")
    la = res.get("load_avg_1m")
    if la:
        print(
            f"  machine load (1-minute load average) while measured: mean {la['mean']:.1f}, max {la['max']:.1f} "
            f"on {os.cpu_count()} CPUs"
        )


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-150m,gpt2-124m", help="comma-separated presets (default: %(default)s)")
    ap.add_argument("--method", default="geomesh,diloco", help="comma-separated methods (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds measured (default: %(default)s)")
    ap.add_argument("--peers", type=int, default=3, help="peers before the joiner (default: %(default)s)")
    ap.add_argument(
        "--no-joiner",
        action="store_true",
        help="no 4th peer joining at the end (a machine that cannot hold one more process of the model)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="seq_len 64, batch 1, 2 inner steps, profile at batch 1 only: proves the pipeline",
    )
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="--target-batch of the peers (default: %(default)s)")
    ap.add_argument("--inner-steps", type=int, default=4, help="--uniform-inner-steps (default: %(default)s)")
    ap.add_argument("--window-s", type=float, default=60.0, help="--window-s of the peers (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per peer (default: %(default)s)")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="start peer i on core i modulo the cores (taskset -c): no peer's threads run on another's core",
    )
    ap.add_argument("--profile-batches", default="1,2", help="(default: %(default)s)")
    ap.add_argument("--memory-budget-gb", type=float, help="passed to every peer")
    ap.add_argument(
        "--mmap-threshold-mib",
        type=float,
        help="passed to every peer (default: the peers' own, geomesh-peer join --help)",
    )
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per wait (default: %(default)s)")
    ap.add_argument("--grace-s", type=float, default=90.0, help="SIGINT to SIGKILL (default: %(default)s)")
    ap.add_argument("--workdir", help="keep logs here (default: a temporary directory, kept)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--helper", nargs=3, metavar=("MODEL", "METHOD", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.helper:
        print(json.dumps(helper(args.helper[0], args.helper[1], int(args.helper[2]))))
        return 0
    if args.quick:
        args.seq_len, args.batch, args.inner_steps, args.profile_batches = 64, 1, 2, "1"
        args.window_s = min(args.window_s, 30.0)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="real-size-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {workdir}", flush=True)
    procs = Procs()

    def on_term(signum, frame):  # SIGTERM behaves as Ctrl+C: the finally below stops every child
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    results = []
    try:
        for model in args.model.split(","):
            for method in args.method.split(","):
                run_one(model.strip(), method.strip(), args, workdir, procs, results)
    except KeyboardInterrupt:
        print("interrupted: stopping the processes this script started", flush=True)
        return 130
    finally:
        procs.close()
        if args.out and results:
            Path(args.out).write_text(json.dumps(results, indent=1))
            print(f"results written to {args.out}")
    print("\nsummary")
    for r in results:
        worst = [x["worst_stall_ms"] for x in r["rounds"] if x["worst_stall_ms"] is not None]
        over = [x["max_round_minus_compute_minus_idle_s"] for x in r["rounds"]]
        print(
            f"  {r['tag']:<22} {r['status'][:40]:<40} max peak/min {max(p['ratio_to_min'] for p in r['peers']):.2f}x"
            f"  worst stall {max(worst) if worst else float('nan'):.0f} ms"
            f"  max overhead {max(over) if over else float('nan'):.2f}s"
            f"  digests {'equal' if r['rounds'] and all(x['digests_equal'] for x in r['rounds']) else 'NOT equal'}"
        )
    return 0 if results and all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
