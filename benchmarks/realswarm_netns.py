"""Real-process check: the paper4 scenario, scaled down, as real OS processes on shaped links.

    sudo .venv/bin/python benchmarks/realswarm_netns.py               # diloco then geomesh, 5 rounds each
    .venv/bin/python benchmarks/realswarm_netns.py --no-netns         # fallback: 127.0.0.1, NOT shaped

A bootstrap and 4 of the product's own peers (``python -m peer.cli join``), each peer in its own
network namespace, joined by veth pairs to a bridge that lives in a hub namespace (where the
bootstrap runs). Nothing is addressed in the root namespace: all traffic stays on 10.77.0.0/24
inside namespaces this script creates. Each peer's link is shaped with ``tc tbf`` in both
directions (egress of the peer end = upload, egress of the hub end = download) to the paper's
580-940 Mbit/s divided by ``--bw-scale`` (default 125: 7.5 / 6.4 / 4.6 / 5.6 Mbit/s), and the
peer is told that bandwidth (``--upload-mbps/--download-mbps``) so its planner uses it. The
paper's one-way latencies are added in the transport (``--added-latency-ms``; netem is absent).
Relative speeds 1.0/0.55/0.45/0.40 come from ``--speed-factor``.

Then it reads each peer's JSON lines and prints, per method: straggler idle of the fastest peer,
mean network idle, bytes sent per peer per round, round time, eval perplexity, whether every
round's digests matched -- and, if the simulator can express the same scaled scenario (a custom
profile YAML), its prediction next to it.

Every namespace (and with it every veth, the bridge and the qdiscs) and every process this
script starts is removed/stopped when it ends, also on Ctrl+C / SIGTERM (try/finally, atexit,
signal handlers); processes are stopped by PID.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geomesh_p2p.util.procs import ProcGroup, bootstrap_argv, read_json_rows, wait_for_address  # noqa: E402

# paper4 (geomesh_p2p/sim/profiles/paper4.yaml): name, speed, upload Mbit/s, one-way latency ms
PAPER4 = [
    ("H100", 1.00, 940.0, 20.0),
    ("A100", 0.55, 800.0, 35.0),
    ("L40S", 0.45, 580.0, 60.0),
    ("RTX6000Ada", 0.40, 700.0, 30.0),
]
SUBNET = "10.77.0"
HUB_IP = f"{SUBNET}.1"
BOOT_PORT = 31337
PEER_PORT = 31400


def sh(*argv: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


# ---------------------------------------------------------------------------------------------
# network namespaces


class NetLab:
    """Hub namespace with a bridge + one namespace per peer, each on a tbf-shaped veth pair.

    Everything lives inside namespaces created here, so deleting them removes the veths, the
    bridge and the qdiscs too; :meth:`cleanup` is idempotent and also removes leftovers by name.
    """

    def __init__(self, n: int, tag: str):
        self.tag = tag
        self.hub = f"gmrs{tag}-hub"
        self.peers = [f"gmrs{tag}-p{i}" for i in range(n)]
        self.created: list[str] = []
        self.shaping: list[dict] = []

    @staticmethod
    def usable() -> tuple[bool, str]:
        """Can we create a namespace, a veth pair into it and a tbf qdisc? (cleaned up at once)"""
        ns = f"gmrsprobe{os.getpid()}"
        try:
            sh("ip", "netns", "add", ns)
        except Exception as e:  # noqa: BLE001
            return False, f"ip netns add failed: {e}"
        try:
            sh("ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
            sh("ip", "-n", ns, "link", "set", "pa", "up")
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                "pa",
                "root",
                "tbf",
                "rate",
                "5mbit",
                "burst",
                "64kb",
                "latency",
                "300ms",
            )
            return True, "ip netns, veth and tc tbf work"
        except Exception as e:  # noqa: BLE001
            return False, str(e)
        finally:
            sh("ip", "netns", "del", ns, check=False)

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def setup(self, mbps: list[float]) -> None:
        sh("ip", "netns", "add", self.hub)
        self.created.append(self.hub)
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, rate) in enumerate(zip(self.peers, mbps)):
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            hv = f"vh{i}"
            sh("ip", "-n", self.hub, "link", "add", hv, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", hv, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", hv, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            # tbf: burst 64 KB so one GSO super-packet fits; 300 ms of queue so TCP is not starved
            tbf = ["tbf", "rate", f"{rate}mbit", "burst", "64kb", "latency", "300ms"]
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)  # upload
            sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hv, "root", *tbf)  # download
            self.shaping.append(
                {
                    "ns": ns,
                    "ip": self.ip(i),
                    "mbit": rate,
                    "qdisc": f"tbf rate {rate}mbit burst 64kb latency 300ms (both directions)",
                }
            )

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def tc_stats(self) -> dict[str, str]:
        out = {}
        for i, ns in enumerate(self.peers):
            up = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0", check=False).stdout
            dn = sh("ip", "netns", "exec", self.hub, "tc", "-s", "qdisc", "show", "dev", f"vh{i}", check=False).stdout
            out[ns] = " | ".join(" ".join(x.split()) for x in (up, dn))
        return out

    def cleanup(self) -> None:
        existing = set(sh("ip", "netns", "list", check=False).stdout.split())
        for ns in reversed(self.peers + [self.hub]):
            if ns in existing or ns in self.created:
                sh("ip", "netns", "del", ns, check=False)
        self.created.clear()


LINK_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(65536)
    if not b: break
    if t0 is None: t0 = time.time()
    n += len(b)
print(n, time.time() - t0, flush=True)
"""

LINK_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def link_check(lab: NetLab, i: int, nbytes: int = 1_000_000) -> float:
    """Upload ``nbytes`` from peer i's namespace to the hub over its shaped link; Mbit/s measured."""
    port = 31999
    srv = subprocess.Popen(
        lab.exec_prefix(lab.hub) + [sys.executable, "-c", LINK_SERVER, HUB_IP, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        srv.stdout.readline()
        subprocess.run(
            lab.exec_prefix(lab.peers[i]) + [sys.executable, "-c", LINK_CLIENT, HUB_IP, str(port), str(nbytes)],
            check=True,
            timeout=60,
        )
        n, dt = srv.stdout.readline().split()
        srv.wait(timeout=10)
        return int(n) * 8 / float(dt) / 1e6
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


# ---------------------------------------------------------------------------------------------
# processes


class Procs(ProcGroup):
    """Owns the processes it starts and stops each by PID (SIGINT, then SIGKILL): a
    :class:`geomesh_p2p.util.procs.ProcGroup` that runs them from the repository root in sessions of their own."""

    def spawn(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        """Start ``argv`` with its output in ``log`` (truncated)."""
        return super().spawn(name, argv, log, cwd=ROOT, new_session=True)

    def stop_all(self, grace_s: float = 20.0) -> None:
        """Stop every process (see ProcGroup.stop_all) and forget them (a method's run starts afresh)."""
        super().stop_all(grace_s)
        self.procs.clear()


def method_flags(label: str) -> tuple[str, list[str]]:
    """A contender's label, simulator-style (``geomesh``, ``geomesh+reencode+eager+outer_lr=0.35``) -> the
    peer's ``--method`` and extra flags: ``eager`` -> ``--eager`` (issue 17), ``reencode`` -> ``--mode
    reencode``, ``outer_lr=X`` -> ``--outer-lr X``. Raises ValueError on another option."""
    base, *opts = label.split("+")
    extra: list[str] = []
    for o in opts:
        key, _, val = o.partition("=")
        if key == "eager" and not val:
            extra.append("--eager")
        elif key == "reencode" and not val:
            extra += ["--mode", "reencode"]
        elif key == "outer_lr" and val:
            extra += ["--outer-lr", val]
        else:
            raise ValueError(
                f"{label}: unknown option {o!r} for a real-process run (known: eager, reencode, outer_lr=X)"
            )
    return base, extra


def sim_label(label: str) -> str:
    """The simulator's label of a contender: its methods exchange in reencode mode unless ``+relay``, so the
    real run's ``+reencode`` is dropped."""
    return "+".join(p for p in label.split("+") if p != "reencode")


def run_method(method: str, args, lab: NetLab | None, workdir: Path, procs: Procs, peers_cfg) -> dict:
    mdir = workdir / method
    mdir.mkdir(parents=True, exist_ok=True)
    base, extra = method_flags(method)
    run_id = f"realswarm-{method.replace('+', '-')}"
    exe = [sys.executable, "-m"]
    if lab:
        boot_host, boot_port = HUB_IP, BOOT_PORT
        boot_prefix = lab.exec_prefix(lab.hub)
    else:
        # Port 0: the bootstrap binds a free port and prints it (a port picked first could be taken).
        boot_host, boot_port = "127.0.0.1", 0
        boot_prefix = []
    boot = procs.spawn(
        "bootstrap",
        boot_prefix + bootstrap_argv(run_id, workdir / "bootstrap.key", host=boot_host, port=boot_port),
        mdir / "bootstrap.log",
    )
    entry = wait_for_address(mdir / "bootstrap.log", boot, 120)
    common = [
        "--threads",
        "1",
        "--seq-len",
        str(args.seq_len),
        "--window-s",
        str(args.window_s),
        "--profile-batches",
        args.profile_batches,
        "--target-batch",
        str(args.target_batch),
        "--uniform-inner-steps",
        str(args.inner_steps),
        "--rounds",
        str(args.rounds),
        "--min-peers",
        str(len(peers_cfg)),
        "--wait-peers-s",
        "180",
        "--method",
        base,
        *extra,
        "--run-id",
        run_id,
        "--bootstrap",
        entry,
    ]
    for i, pc in enumerate(peers_cfg):
        if lab:
            host, port, prefix = lab.ip(i), PEER_PORT, lab.exec_prefix(lab.peers[i])
        else:
            host, port, prefix = "127.0.0.1", 0, []  # port 0: each peer binds a free one
        argv = (
            prefix
            + exe
            + [
                "peer.cli",
                "join",
                "--identity",
                str(workdir / f"peer{i}.key"),
                "--host",
                host,
                "--advertise-host",
                host,
                "--port",
                str(port),
                "--speed-factor",
                str(pc["speed"]),
                *([] if args.measure_links else ["--upload-mbps", str(pc["mbit"]), "--download-mbps", str(pc["mbit"])]),
                "--added-latency-ms",
                str(pc["latency_ms"]),
                "--log-json",
                str(mdir / f"peer{i}.jsonl"),
                "--summary-json",
                str(mdir / f"peer{i}.summary.json"),
            ]
            + common
        )
        procs.spawn(f"peer{i}", argv, mdir / f"peer{i}.log")
        pc["argv"] = " ".join(argv)
    t0 = time.time()
    status = "ok"
    names = [f"peer{i}" for i in range(len(peers_cfg))]
    last = -1
    while True:
        rows = {n: read_json_rows(mdir / f"{n}.jsonl") for n in names}
        done = min(len(r) for r in rows.values())
        if done != last:
            print(
                f"  [{method}] {time.time() - t0:5.0f}s  rounds logged per peer: "
                + " ".join(str(len(r)) for r in rows.values()),
                flush=True,
            )
            last = done
        if all(procs.procs[n].poll() is not None for n in names):
            break
        if done >= args.rounds:
            # every peer logged its last round; give them a moment to exit cleanly
            try:
                for n in names:
                    procs.procs[n].wait(timeout=max(0.1, 20 - 0))
            except subprocess.TimeoutExpired:
                pass
            break
        if time.time() - t0 > args.timeout_s:
            status = f"timed out after {args.timeout_s:.0f}s"
            break
        time.sleep(1.0)
    rcs = {n: procs.procs[n].poll() for n in names}
    procs.stop_all()
    wall = time.time() - t0
    rows = {n: read_json_rows(mdir / f"{n}.jsonl") for n in names}
    for n, rc in rcs.items():
        if rc not in (0, None):
            status = f"{n} exited {rc} (see {mdir / (n + '.log')})"
    return {"method": method, "status": status, "wall_s": wall, "rows": rows, "exit_codes": rcs}


# ---------------------------------------------------------------------------------------------
# figures


def summarize(res: dict, skip_first: bool) -> dict:
    rows = res["rows"]
    names = sorted(rows)

    def use(rs):
        rs = sorted(rs, key=lambda r: r["round"])
        return rs[1:] if skip_first and len(rs) > 1 else rs

    fast = use(rows[names[0]])  # peer0 is the speed-1.0 peer

    def pct(rs, key):
        tot = sum(r["round_s"] for r in rs)
        return 100.0 * sum(r[key] for r in rs) / tot if tot else float("nan")

    net = [pct(use(rows[n]), "network_idle_s") for n in names if use(rows[n])]
    strag_all = [pct(use(rows[n]), "straggler_idle_s") for n in names if use(rows[n])]
    sent = [r["bytes_sent"] for n in names for r in use(rows[n])]
    recv = [r["bytes_received"] for n in names for r in use(rows[n])]
    round_s = [r["round_s"] for r in fast]
    compute = [r["compute_s"] for r in fast]
    # digests: for every round, all peers logged it, with 4 participants, and the same digest
    by_round: dict[int, list] = {}
    for n in names:
        for r in rows[n]:
            by_round.setdefault(r["round"], []).append(r)
    rounds_ok = [
        rd
        for rd, rs in by_round.items()
        if len(rs) == len(names) and len({r["digest"] for r in rs}) == 1 and all(r["peers"] == len(names) for r in rs)
    ]
    # Cross-check of the node's own split, re-derived from compute_s only (approximate: assumes the
    # peers start a round together): the fastest peer waits max_j compute_j - its compute for the
    # slowest; what is left of the round beyond the slowest peer's compute is exchange + outer step
    # + eval ("non-compute").
    d_strag, d_noncomp = [], []
    for rd, rs in by_round.items():
        if len(rs) != len(names) or (skip_first and rd == min(by_round)):
            continue
        f = next((r for r in rows[names[0]] if r["round"] == rd), None)
        cmax = max(r["compute_s"] for r in rs)
        if f and f["round_s"] > 0:
            d_strag.append(100.0 * max(0.0, cmax - f["compute_s"]) / f["round_s"])
            d_noncomp.append(100.0 * statistics.mean(max(0.0, r["round_s"] - cmax) / r["round_s"] for r in rs))
    last_ppl = [r["eval_ppl"] for r in sorted(rows[names[0]], key=lambda r: r["round"])][-1:] or [float("nan")]
    tokens = sum(r.get("tokens", 0) for n in names for r in use(rows[n]))
    return {
        "method": res["method"],
        "status": res["status"],
        "rounds": len(by_round),
        "rounds_digest_equal": len(rounds_ok),
        "digests_ok": len(by_round) > 0 and len(rounds_ok) == len(by_round),
        "straggler_idle_fastest_pct": pct(fast, "straggler_idle_s") if fast else float("nan"),
        "derived_straggler_fastest_pct": statistics.mean(d_strag) if d_strag else float("nan"),
        "derived_noncompute_pct": statistics.mean(d_noncomp) if d_noncomp else float("nan"),
        "straggler_idle_max_pct": max(strag_all) if strag_all else float("nan"),
        "network_idle_mean_pct": statistics.mean(net) if net else float("nan"),
        "mb_sent_per_peer_round": statistics.mean(sent) / 1e6 if sent else float("nan"),
        "mb_recv_per_peer_round": statistics.mean(recv) / 1e6 if recv else float("nan"),
        "round_s": statistics.mean(round_s) if round_s else float("nan"),
        "compute_s_fastest": statistics.mean(compute) if compute else float("nan"),
        "tokens_per_round": tokens / max(1, len(use(rows[names[0]]))),
        "final_ppl": last_ppl[0],
        "fast_tokens_per_s": (
            sum(r["tokens"] for r in fast) / max(1e-9, sum(r["compute_s"] for r in fast)) if fast else float("nan")
        ),
        "plans": {
            n: [
                f"{r.get('batch_size')}/{r.get('inner_steps_planned')}"
                for r in sorted(rows[n], key=lambda r: r["round"])
            ]
            for n in names
        },
    }


def fmt(v, f="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and v != v) else f.format(v)


def table(sums: list[dict], sim: dict | None) -> str:
    head = [
        "source",
        "method",
        "strag% fastest",
        "net% mean",
        "derived strag% / non-compute%",
        "MB sent/peer/round",
        "round s",
        "tokens/round",
        "eval ppl",
        "digests equal",
    ]
    body = []
    for s in sums:
        body.append(
            [
                "measured",
                s["method"],
                fmt(s["straggler_idle_fastest_pct"], "{:.1f}"),
                fmt(s["network_idle_mean_pct"], "{:.1f}"),
                fmt(s["derived_straggler_fastest_pct"], "{:.1f}") + " / " + fmt(s["derived_noncompute_pct"], "{:.1f}"),
                fmt(s["mb_sent_per_peer_round"], "{:.3f}"),
                fmt(s["round_s"], "{:.1f}"),
                fmt(s["tokens_per_round"], "{:.0f}"),
                fmt(s["final_ppl"], "{:.0f}"),
                f"{'yes' if s['digests_ok'] else 'NO'} ({s['rounds_digest_equal']}/{s['rounds']})",
            ]
        )
    for m, s in (sim or {}).items():
        body.append(
            [
                "simulator",
                m,
                fmt(s.get("strag"), "{:.1f}"),
                fmt(s.get("net"), "{:.1f}"),
                "-",
                fmt(s.get("mb_sent"), "{:.3f}"),
                fmt(s.get("round_s"), "{:.1f}"),
                fmt(s.get("tokens_per_round"), "{:.0f}"),
                fmt(s.get("ppl"), "{:.0f}"),
                "n/a",
            ]
        )
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = [
        "| " + " | ".join(h.ljust(x) for h, x in zip(head, w)) + " |",
        "|" + "|".join("-" * (x + 2) for x in w) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(x) for c, x in zip(b, w)) + " |" for b in body]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# simulator


def sim_profile_yaml(args, peers_cfg, numel: int, tokens_per_s: float) -> str:
    lines = [
        "name: realswarm-scaled",
        'description: "paper4 scaled down: the tiny model on 1 CPU thread, links = paper / %g"' % args.bw_scale,
        'source: "benchmarks/realswarm_netns.py"',
        "reference:",
        '  model: "the tiny proxy itself, as measured in the real-process run"',
        f"  params: {numel}",
        f"  seq_len: {args.seq_len}",
        f"  peak_tokens_per_s: {tokens_per_s:.1f}",
        "  batch_half: 0",
        "  fixed_memory_gb: 0.05",
        "  activation_gb_per_seq: 0.001",
        f"  measured_batches: [{args.profile_batches}]",
        "plan:",
        f"  target_batch: {args.target_batch}",
        f"  inner_steps: {args.inner_steps}",
        "  comm_share: 0.1",
        "  window:",
        "    awb: match_diloco",
        "    geomesh: comm_share",
        "train:",
        "  preset: tiny",
        f"  seq_len: {args.seq_len}",
        "  batch_div: 1",
        f"  rounds: {args.rounds}",
        "  eval_batches: 4",
        "  eval_batch_size: 16",
        "peers:",
    ]
    for pc in peers_cfg:
        lines.append(
            f"  - {{name: {pc['name']}, speed: {pc['speed']}, memory_gb: 16, up_mbps: {pc['mbit']}, "
            f"latency_ms: {pc['latency_ms']}}}"
        )
    return "\n".join(lines) + "\n"


def run_sim(args, peers_cfg, workdir: Path, numel: int, tokens_per_s: float) -> tuple[dict | None, str]:
    prof = workdir / "sim_profile.yaml"
    prof.write_text(sim_profile_yaml(args, peers_cfg, numel, tokens_per_s))
    out = workdir / "sim.json"
    cmd = [
        sys.executable,
        "-m",
        "geomesh_p2p.sim.cli",
        "--profile",
        str(prof),
        "--methods",
        ",".join(dict.fromkeys(sim_label(m) for m in args.methods)),
        "--json",
        str(out),
        "--no-progress",
        "--jobs",
        "1",
    ]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.sim_timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"simulator timed out after {args.sim_timeout_s}s"
    (workdir / "sim.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not out.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return None, f"simulator could not run this profile (exit {p.returncode}): {tail[0]}"
    return parse_sim(out), f"simulator ran profile {prof} ({' '.join(cmd[1:])})"


def parse_sim(out: Path) -> dict:
    data = json.loads(out.read_text())
    res = {}
    for s in data["summaries"]:
        m = s["method"]
        rounds = data["methods"].get(m, {}).get("rounds", [])
        per_peer = data["methods"].get(m, {}).get("per_peer", [])
        n_rounds = max(1, len(rounds))
        res[m] = {
            "strag": s.get("straggler_idle_fastest_pct"),
            "net": s.get("network_idle_pct"),
            "mb_sent": (statistics.mean(pp["sent"] for pp in per_peer) / n_rounds / 1e6) if per_peer else None,
            "round_s": statistics.mean(r["round_s"] for r in rounds) if rounds else None,
            "tokens_per_round": (statistics.mean(r["tokens_trained"] for r in rounds) if rounds else None),
            "ppl": s.get("final_ppl"),
        }
    return res


def tiny_numel() -> int:
    code = (
        "from geomesh_p2p.model.training import build_model;"
        "import inspect;"
        "m=build_model('tiny', vocab_size=4096);"
        "print(sum(p.numel() for p in m.parameters()))"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    try:
        return int(p.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        return 0


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--methods",
        default="diloco,geomesh",
        help="contenders, comma-separated, as the simulator names them; +eager adds --eager (default: %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds per method (default: %(default)s)")
    ap.add_argument(
        "--bw-scale",
        type=float,
        default=125.0,
        help="paper Mbit/s divided by this (default 125: 7.5/6.4/4.6/5.6 Mbit/s)",
    )
    ap.add_argument("--window-s", type=float, default=4.0, help="--window-s of the peers (default: %(default)s)")
    ap.add_argument(
        "--inner-steps", type=int, default=10, help="--uniform-inner-steps, DiLoCo's H (default: %(default)s)"
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--target-batch", type=int, default=8)
    ap.add_argument("--profile-batches", default="4,8")
    ap.add_argument("--timeout-s", type=float, default=300, help="per method (default: %(default)s)")
    ap.add_argument("--skip-first", action="store_true", help="leave round 0 out of the idle/time figures")
    ap.add_argument("--no-netns", action="store_true", help="do not use namespaces: 127.0.0.1, unshaped")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument(
        "--measure-links",
        action="store_true",
        help="do not state each peer's bandwidth: peers measure it (start-up probe + every exchange)",
    )
    ap.add_argument("--sim-timeout-s", type=float, default=240)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument(
        "--report-only",
        metavar="DIR",
        default=None,
        help="start nothing: re-read the logs (and sim.json) an earlier run left in DIR and print the table",
    )
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        try:
            method_flags(m)
        except ValueError as e:
            ap.error(f"--methods: {e}")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="realswarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    peers_cfg = [
        {"name": n, "speed": s, "mbit": round(bw / args.bw_scale, 2), "latency_ms": lat} for n, s, bw, lat in PAPER4
    ]

    lab = None
    net_note = ""
    if args.report_only:
        return report_only(args, Path(args.report_only), peers_cfg)
    if args.no_netns:
        net_note = "FALLBACK (--no-netns): all processes on 127.0.0.1, links NOT shaped (bandwidth only stated)"
    elif os.geteuid() != 0:
        net_note = "FALLBACK (not root): all processes on 127.0.0.1, links NOT shaped (bandwidth only stated)"
    else:
        ok, why = NetLab.usable()
        if ok:
            lab = NetLab(len(peers_cfg), tag=str(os.getpid() % 100000))
            net_note = (
                f"network namespaces: hub {lab.hub} (bridge br0, {HUB_IP}, bootstrap) + one per peer "
                f"({SUBNET}.11-14), tc tbf on both ends of each veth"
            )
        else:
            net_note = f"FALLBACK (netns unusable: {why}): all processes on 127.0.0.1, links NOT shaped"
    print(net_note, flush=True)

    procs = Procs()
    cleaned = {"done": False}

    def cleanup():
        if cleaned["done"]:
            return
        cleaned["done"] = True
        procs.stop_all(grace_s=10)
        if lab:
            lab.cleanup()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    atexit.register(cleanup)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    results, link = [], {}
    t_start = time.time()
    try:
        if lab:
            lab.setup([pc["mbit"] for pc in peers_cfg])
            for i, pc in enumerate(peers_cfg):
                link[pc["name"]] = round(link_check(lab, i), 2)
            print(
                "link check (1 MB upload peer -> hub, Mbit/s measured vs shaped): "
                + ", ".join(f"{pc['name']} {link[pc['name']]}/{pc['mbit']}" for pc in peers_cfg),
                flush=True,
            )
        for m in args.methods:
            print(f"method {m}: bootstrap + {len(peers_cfg)} peers, {args.rounds} rounds", flush=True)
            results.append(run_method(m, args, lab, workdir, procs, peers_cfg))
            print(f"  [{m}] {results[-1]['status']}, {results[-1]['wall_s']:.0f}s", flush=True)
        tc = lab.tc_stats() if lab else {}
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e}): stopping processes and removing namespaces", file=sys.stderr)
        cleanup()
        return 130
    finally:
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)
    if lab:
        left = [ns for ns in sh("ip", "netns", "list", check=False).stdout.split() if ns.startswith(f"gmrs{lab.tag}")]
        print("namespaces left behind: " + (", ".join(left) if left else "none"))

    sums = [summarize(r, args.skip_first) for r in results if any(r["rows"].values())]
    sim, sim_note = None, "simulator skipped (--no-sim)"
    if not args.no_sim and sums:
        numel = tiny_numel()
        tps = statistics.median(s["fast_tokens_per_s"] for s in sums)
        if numel and tps == tps:
            sim, sim_note = run_sim(args, peers_cfg, workdir, numel, tps)
        else:
            sim_note = "simulator skipped: could not determine the tiny model's size / measured tokens/s"

    print()
    print(
        f"real-process paper4, scaled: {len(peers_cfg)} peers, speeds "
        + "/".join(str(p["speed"]) for p in peers_cfg)
        + ", links "
        + "/".join(str(p["mbit"]) for p in peers_cfg)
        + f" Mbit/s (paper / {args.bw_scale:g}), window {args.window_s}s, DiLoCo H={args.inner_steps}, "
        f"{args.rounds} rounds each{', round 0 left out' if args.skip_first else ''}"
    )
    print(net_note)
    print(table(sums, sim))
    print(sim_note)
    for s in sums:
        print(
            f"{s['method']}: status {s['status']}; compute of fastest {s['compute_s_fastest']:.2f}s/round, "
            f"measured fastest tokens/s {s['fast_tokens_per_s']:.0f}; plans (batch/H) "
            + "; ".join(f"{n}: {' '.join(v)}" for n, v in s["plans"].items())
        )
    if args.measure_links:
        print("links measured by the peers (Mbit/s, upload/download): shaped | start-up probe | announced at the end")
        for r in results:
            for i, pc in enumerate(peers_cfg):
                try:
                    lk = json.loads((workdir / r["method"] / f"peer{i}.summary.json").read_text())["links"]
                except (OSError, ValueError, KeyError):
                    print(f"  {r['method']:8s} {pc['name']}: no summary")
                    continue
                mb = lambda v: "-" if v is None else f"{v * 8 / 1e6:.2f}"  # noqa: E731  bytes/s -> Mbit/s
                pr = lk.get("probe") or {}
                print(
                    f"  {r['method']:8s} {pc['name']:10s} {pc['mbit']:.2f} | {mb(pr.get('upload_bps'))}/"
                    f"{mb(pr.get('download_bps'))} | {mb(lk.get('upload_bps'))}/{mb(lk.get('download_bps'))}"
                )
    by = {s["method"]: s for s in sums}
    if "diloco" in by and "geomesh" in by:
        d, g = by["diloco"], by["geomesh"]
        print(
            f"geomesh/diloco: round time {g['round_s'] / d['round_s']:.2f}x, bytes sent "
            f"{g['mb_sent_per_peer_round'] / d['mb_sent_per_peer_round']:.3f}x, tokens/s of the swarm "
            f"{(g['tokens_per_round'] / g['round_s']) / (d['tokens_per_round'] / d['round_s']):.2f}x"
        )
    if "geomesh" in by and "geomesh+eager" in by:
        g, e = by["geomesh"], by["geomesh+eager"]
        ppl = (
            f"{e['final_ppl'] / g['final_ppl']:.3f}x"
            if e.get("final_ppl") and g.get("final_ppl")
            else "n/a (no final eval ppl in one of them)"
        )
        print(
            f"geomesh+eager/geomesh: round time {e['round_s'] / g['round_s']:.2f}x, network idle "
            f"{e['network_idle_mean_pct']:.1f}% vs {g['network_idle_mean_pct']:.1f}%, final eval ppl {ppl}"
        )
    print(f"total {time.time() - t_start:.0f}s; logs in {workdir}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "net": net_note,
                    "link_check_mbit": link,
                    "peers": peers_cfg,
                    "summaries": sums,
                    "sim": sim,
                    "sim_note": sim_note,
                    "tc": tc,
                    "args": vars(args),
                },
                indent=1,
                default=str,
            )
        )
    return 0 if all(s["status"] == "ok" and s["digests_ok"] for s in sums) and len(sums) == len(results) else 1


def report_only(args, workdir: Path, peers_cfg) -> int:
    results = []
    for m in args.methods:
        names = sorted(p.stem for p in (workdir / m).glob("peer*.jsonl"))
        results.append(
            {
                "method": m,
                "status": "ok (re-read)",
                "rows": {n: read_json_rows(workdir / m / f"{n}.jsonl") for n in names},
            }
        )
    sums = [summarize(r, args.skip_first) for r in results if any(r["rows"].values())]
    sim = parse_sim(workdir / "sim.json") if (workdir / "sim.json").exists() else None
    print(
        f"re-read from {workdir}; links "
        + "/".join(str(p["mbit"]) for p in peers_cfg)
        + " Mbit/s"
        + (", round 0 left out" if args.skip_first else "")
    )
    print(table(sums, sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
