"""One prepared script for a GPU machine: the CUDA paths measured side by side, results as markdown.

What it runs (each step's figures are ratios measured in the same run, never bare times):

1. **Codec on the device**: ``benchmarks/codec.py --device DEV`` (sign encode / decode of a
   ``--numel`` vector vs ``torch.clone`` on the same device).
2. **Training step on the device**: :class:`geomesh_p2p.training.InnerTrainer` tokens/s with bf16
   autocast vs fp32, for ``--model`` (default ``small``), several batch sizes.
3. **A mixed swarm**: a bootstrap, one peer on ``--device`` and one on the CPU, as OS processes on
   127.0.0.1, ``--rounds`` rounds of geomesh: the global weights' digests must be equal on both peers
   after every round (the outer step runs on an fp32 CPU copy, so a GPU and a CPU peer agree bit for bit).

Writes ``--out`` (markdown, default ``docs/device-check.md``) and prints it. Exit status 0 when every
step ran and the digests matched.

On the lent GPU machine (torch is there; hivemind, cryptography, pydantic and the rest are not):
build a wheelhouse here first (``pip download -d wheels hivemind cryptography pydantic ...`` or
``pip wheel``), carry it, then ``pip install --no-index --find-links wheels -e . --no-deps`` plus the
wheels, and run ``python benchmarks/device_check.py --device cuda --out $OUT/device-check.md``.
Here, without a GPU, ``--device cpu --quick`` checks that the script itself works.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def codec_step(device: str, numel: int, workdir: Path) -> tuple[str, bool]:
    md = workdir / "codec.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--device", device, "--numel", str(numel),
                        "--repeats", "3", "--markdown", str(md)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return f"codec benchmark failed (exit {r.returncode}):\n\n```\n{r.stderr[-2000:]}\n```\n", False
    return md.read_text() if md.exists() else f"```\n{r.stdout[-3000:]}\n```\n", True


def training_step(device: str, model: str, batches: list[int], steps: int) -> tuple[str, bool]:
    import torch

    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.training import InnerTrainer, build_model

    ds = load_dataset(None, seq_len=128)
    rows = ["| batch | fp32 tokens/s | bf16 autocast tokens/s | bf16 / fp32 |", "|---|---|---|---|"]
    ok = True
    for b in batches:
        tps = {}
        for amp in (False, True):
            m = build_model(model, vocab_size=ds.vocab_size, seed=0)
            tr = InnerTrainer(m, ds, device=device, seq_len=128, amp=amp, peer_id="bench")
            tr.run(round=0, inner_steps=2, batch_size=b)  # warm-up (kernels, allocator)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            res = tr.run(round=1, inner_steps=steps, batch_size=b)
            tps[amp] = res.tokens / res.compute_s
            del tr, m
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.append(f"| {b} | {tps[False]:,.0f} | {tps[True]:,.0f} | {tps[True] / tps[False]:.2f}x |")
    note = "" if device.startswith("cuda") else "\n(autocast is CUDA-only: on a CPU both columns are fp32.)\n"
    return f"Model `{model}`, seq 128, {steps} timed inner steps (AdamW) per cell.\n\n" + "\n".join(rows) + "\n" + note, ok


def swarm_step(device: str, rounds: int, workdir: Path, model: str) -> tuple[str, bool]:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    run = ["--run-id", "device-check", "--model", model, "--seq-len", "64", "--window-s", "6",
           "--rounds", str(rounds), "--min-peers", "2", "--profile-batches", "4,8"]
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(port),
                                       "--run-id", "device-check", "--identity", str(workdir / "b.key")],
                                      stdout=open(workdir / "bootstrap.log", "w"), stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        for name, dev in (("gpu", device), ("cpu", "cpu")):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "peer.cli", "join", "--bootstrap", f"127.0.0.1:{port}", "--device", dev,
                 "--identity", str(workdir / f"{name}.key"), "--threads", "4",
                 "--log-json", str(workdir / f"{name}.jsonl")] + run,
                stdout=open(workdir / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.time() + 540
        while time.time() < deadline and any(p.poll() is None for p in procs[1:]):
            time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def rows(name):
        path = workdir / f"{name}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    g, c = rows("gpu"), rows("cpu")
    n = min(len(g), len(c))
    lines = ["| round | digest on the device peer | digest on the CPU peer | equal | eval ppl |", "|---|---|---|---|---|"]
    equal = n == rounds
    for k in range(n):
        same = g[k]["digest"] == c[k]["digest"]
        equal &= same
        lines.append(f"| {g[k]['round']} | {g[k]['digest'][:16]} | {c[k]['digest'][:16]} | {'yes' if same else 'NO'} "
                     f"| {g[k]['eval_ppl']:.1f} |")
    if n < rounds:
        tail = (workdir / "gpu.log").read_text()[-1500:] if (workdir / "gpu.log").exists() else ""
        lines.append(f"\nonly {n} of {rounds} rounds logged by both peers; device peer's log tail:\n\n```\n{tail}\n```")
    return (f"Bootstrap + one peer on `{device}` + one on `cpu`, model `{model}`, {rounds} rounds of geomesh.\n\n"
            + "\n".join(lines) + "\n"), equal


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto",
                    help="device under test; auto = cuda if present, else cpu with --quick (default: %(default)s)")
    ap.add_argument("--out", help="markdown report (default: docs/device-check.md on CUDA, else a temporary file)")
    ap.add_argument("--numel", type=int, default=124_000_000, help="codec vector size (default: GPT-2 small)")
    ap.add_argument("--model", default="small", help="model preset for the training step (default: %(default)s)")
    ap.add_argument("--batches", default="8,32,64", help="batch sizes of the training step (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed inner steps per cell (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the mixed swarm (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script on a CPU")
    ns = ap.parse_args(argv)
    import torch

    if ns.device == "auto":
        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
        ns.quick = ns.quick or ns.device == "cpu"
    workdir = Path(tempfile.mkdtemp(prefix="device-check-"))
    if ns.out is None:
        ns.out = str(ROOT / "docs" / "device-check.md" if ns.device.startswith("cuda") else workdir / "device-check.md")
    if ns.quick:
        ns.numel, ns.model, ns.batches, ns.steps, ns.rounds = 2_000_000, "tiny", "4", 3, 2
    batches = [int(x) for x in ns.batches.split(",") if x]
    head = [f"# Device check ({time.strftime('%Y-%m-%d')})", "",
            f"Command: `python benchmarks/device_check.py --device {ns.device}"
            + (" --quick" if ns.quick else "") + "`", "",
            f"torch {torch.__version__}; device: "
            + (torch.cuda.get_device_name(0) if ns.device.startswith("cuda") and torch.cuda.is_available() else ns.device),
            ""]
    sections, ok = [], True
    for title, fn in (("Codec on the device", lambda: codec_step(ns.device, ns.numel, workdir)),
                      ("Inner training step: bf16 autocast vs fp32", lambda: training_step(ns.device, ns.model, batches,
                                                                                             ns.steps)),
                      ("Mixed swarm: digests of a device peer and a CPU peer",
                       lambda: swarm_step(ns.device, ns.rounds, workdir, "tiny"))):
        t0 = time.time()
        try:
            text, good = fn()
        except Exception as e:  # one failing step must not hide the others' figures
            text, good = f"failed: `{type(e).__name__}: {e}`\n", False
        ok &= good
        sections += [f"## {title} ({time.time() - t0:.0f} s)", "", text]
        print(f"{title}: {'ok' if good else 'FAILED'}", flush=True)
    report = "\n".join(head + sections)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
