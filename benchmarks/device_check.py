"""One prepared script for a GPU machine: the CUDA paths measured side by side, results as markdown.

What it runs, in this order (each step's figures are ratios or rates measured in the same run; a
section that fails is reported as failed and the next one still runs):

1. **The suite's CUDA tests**: ``pytest tests/unit/test_capability.py`` (its ``test_cuda_paths`` is
   skipped without a GPU), outcome per test.
2. **Codec on the device**: ``benchmarks/codec.py --device DEV`` (sign encode / decode of a
   ``--numel`` fp32 vector vs ``torch.clone`` and ``copy_`` on the same device, GB/s of fp32 input).
3. **Start-up profile** (:func:`geomesh_p2p.model.profile.profile_training`, as a peer runs it at
   start-up, with the peer's default ``--profile-batches``) for each of ``--profile-models``: the
   memory budget, the fitted static and per-sequence bytes, the max batch and tokens/s per batch;
   then the same profile under a small ``--check-budget-gib`` budget, and one real AdamW step at the
   max batch it found, whose measured peak (allocator) must stay within that budget.
4. **Inner training step**: :class:`geomesh_p2p.model.training.InnerTrainer` tokens/s with bf16 autocast
   vs fp32, for ``--model`` (default ``gpt2-124m``), several batch sizes.
5. **A mixed swarm**: a bootstrap, one peer on ``--device`` and one on the CPU, as OS processes on
   127.0.0.1, ``--rounds`` rounds of geomesh with ``--swarm-model``: the global weights' digests must
   be equal on both peers after every round (the outer step runs on an fp32 CPU copy, so a GPU and a
   CPU peer agree bit for bit).
6. **A multi-rank peer** (issue 30): the same with the device peer started as ``--local-devices`` of 2
   ranks (two GPUs, or both ranks on one), next to a CPU peer: digests and steps x batch per round.
7. **Real size** (issue 27): two peers of ``--real-model`` (default ``llama-150m``, the paper's size) on
   the device with bf16 autocast (the peer's CUDA default), seq 128: digests, and each peer's peak device
   memory and host RSS (the round row's ``extra["memory"]``) against the method's minimum (24 B/param).

Writes ``--out`` (markdown; rewritten after every section, so a run cut short still leaves the
sections done) and prints it. Exit status 0 when every step ran, its checks held and the digests
matched.

On the lent GPU machine (torch, grpcio, protobuf, numpy, transformers are there; hivemind,
cryptography, pydantic, base58 and a few others are not): carry their cp312 manylinux wheels in
``.whl/`` (see docs/device-check.md), install them with ``pip install --no-deps --target /tmp/site``,
and run from the working tree with ``PYTHONPATH=/tmp/site:.``::

    python3 benchmarks/device_check.py --device cuda --out $OUT/device-check.md

Here, without a GPU, ``--device cpu --quick`` checks that the script itself works (small sizes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2.0**30
MIB = 2.0**20


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def machine_section(device: str) -> tuple[str, bool]:
    """The machine: nvidia-smi's GPU line, torch and CUDA versions, the device's properties."""
    import torch

    lines = [
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    ]
    if device.startswith("cuda"):
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            lines.append(f"- nvidia-smi: {smi}")
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"- nvidia-smi: not available ({e})")
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        lines.append(
            f"- {p.name}: compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
            f"{total / GIB:.1f} GiB ({free / GIB:.1f} GiB free at start)"
        )
    return "\n".join(lines) + "\n", True


def tests_section(device: str, quick: bool, timeout_s: float) -> tuple[str, bool]:
    """``pytest tests/unit/test_capability.py`` (``-k cuda`` with --quick): one row per test and its outcome."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "tests/unit/test_capability.py"]
    if quick:
        cmd += ["-k", "cuda"]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
        if r.returncode not in (0, 1, 5):
            # pytest itself did not start (a carried pytest-asyncio too new for the image's pytest, say):
            # once more without that plugin (this file has no async test).
            print(f"pytest exit {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}\nagain with -p no:asyncio", flush=True)
            cmd[3:3] = ["-p", "no:asyncio"]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"pytest ran past {timeout_s:.0f} s:\n\n```\n{out[-2000:]}\n```\n", False
    print(r.stdout[-4000:], flush=True)
    results = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", r.stdout, re.M)
    summary = [x for x in r.stdout.strip().splitlines() if x.startswith("=")][-1:] or ["(no summary)"]
    rows = ["| test | outcome |", "|---|---|"] + [f"| `{t.split('::', 1)[1]}` | {o} |" for t, o in results]
    skips = [x for x in r.stdout.splitlines() if x.startswith("SKIPPED")]
    text = (
        f"`{' '.join(['pytest'] + cmd[3:])}` (exit {r.returncode}): {summary[0].strip('= ')}\n\n"
        + "\n".join(rows)
        + "\n"
    )
    if skips:
        text += "\n" + "\n".join(f"- {s}" for s in skips) + "\n"
    if r.returncode != 0:
        text += f"\n```\n{(r.stdout + r.stderr)[-3000:]}\n```\n"
    cuda_ok = any("cuda_paths" in t and o == "PASSED" for t, o in results) or not device.startswith("cuda")
    return text, r.returncode == 0 and cuda_ok


def codec_step(device: str, numel: int, repeats: int, workdir: Path) -> tuple[str, bool]:
    md = workdir / "codec.md"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "codec.py"),
            "--device",
            device,
            "--numel",
            str(numel),
            "--repeats",
            str(repeats),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        return f"codec benchmark failed (exit {r.returncode}):\n\n```\n{r.stderr[-2000:]}\n```\n", False
    text = md.read_text() if md.exists() else f"```\n{r.stdout[-3000:]}\n```\n"
    text = text.replace("# Sign codec benchmark", "").replace("\nNotes:", "\nNotes (codec.py's, written for the CPU):")
    return text.strip() + "\n", True


def profile_section(
    device: str, presets: list[str], seq_len: int, batches: list[int], check_budget: int, time_left
) -> tuple[str, bool]:
    """The peer's start-up profile on ``device`` for each preset: full budget, then ``check_budget`` bytes
    with one real step at the max batch found, whose allocator peak must stay within that budget (CUDA)."""
    import torch

    from geomesh_p2p.model.device import detect_device
    from geomesh_p2p.model.memory import SHIPPED_VOCAB_SIZE
    from geomesh_p2p.model.profile import profile_training
    from geomesh_p2p.model.build import build_model

    info = detect_device(device)
    dev = info.torch_device
    rows = [
        "| model | params | budget | static (weights+grads+AdamW) | per sequence | max batch | tokens/s per batch "
        "| peak | profile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    checks, ok = [], True
    for name in presets:
        if time_left() < 20:
            rows.append(f"| {name} | not run: the script's time budget is spent | | | | | | | |")
            continue
        # the small budget on CUDA only: on a CPU the probe is the process's RSS, torch's own included
        for budget in (info.memory_bytes, check_budget) if dev.type == "cuda" else (info.memory_bytes,):
            _free(device)
            torch.manual_seed(0)
            m = build_model(name, vocab_size=SHIPPED_VOCAB_SIZE, seed=0).to(dev)
            n = sum(p.numel() for p in m.parameters())
            prof = profile_training(
                m, seq_len, dev, budget, vocab_size=SHIPPED_VOCAB_SIZE, batch_sizes=batches, limit=256
            )
            tps = ", ".join(f"{b}: {t:,.0f}" for b, t in sorted(prof.tokens_per_s.items()))
            rows.append(
                f"| {name} | {n / 1e6:.1f}M | {budget / GIB:.2f} GiB | {prof.memory.static_bytes / GIB:.2f} GiB "
                f"| {prof.memory.per_sequence_bytes / MIB:.1f} MiB | {prof.max_batch} | {tps} "
                f"| {max(prof.peak_bytes.values()) / GIB:.2f} GiB | {prof.seconds:.1f} |"
            )
            if budget == check_budget and dev.type == "cuda":
                # One real step at the max batch found: its allocator peak must be within the budget.
                b = prof.max_batch
                opt = torch.optim.AdamW(m.parameters(), lr=0.0)
                x = torch.randint(0, SHIPPED_VOCAB_SIZE, (b, seq_len), device=dev)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                loss = m(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(dev)
                fits = peak <= budget
                ok &= fits
                checks.append(
                    f"- `{name}` under {budget / GIB:.2f} GiB: one AdamW step at the max batch {b} peaked "
                    f"at {peak / GIB:.3f} GiB ({100 * peak / budget:.1f}% of the budget, predicted "
                    f"{(prof.memory.static_bytes + b * prof.memory.per_sequence_bytes) / GIB:.3f} GiB): "
                    f"{'within' if fits else 'OVER'} the budget"
                )
                del opt, x, loss
            del m
            _free(device)
    text = (
        f"`profile_training(model, seq_len={seq_len}, device, budget, batch_sizes={batches}, limit=256)` as "
        f"`geomesh-peer join` runs it at start-up (default `--profile-batches`, steps=2, warmup=0, fp32; "
        f"the first budget is `detect_device`'s: free memory plus what the allocator holds).\n\n"
        + "\n".join(rows)
        + "\n"
    )
    if checks:
        text += "\n" + "\n".join(checks) + "\n"
    return text, ok


def training_step(device: str, model: str, batches: list[int], steps: int, time_left) -> tuple[str, bool]:
    import torch

    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.build import build_model
    from geomesh_p2p.model.training import InnerTrainer

    ds = load_dataset(None, seq_len=128)
    rows = [
        "| batch | fp32 tokens/s | bf16 autocast tokens/s | bf16 / fp32 | peak GiB fp32 / bf16 |",
        "|---|---|---|---|---|",
    ]
    for b in batches:
        if time_left() < 15:
            rows.append(f"| {b} | not run: the script's time budget is spent | | | |")
            continue
        tps, peak = {}, {}
        for amp in (False, True):
            m = build_model(model, vocab_size=ds.vocab_size, seed=0)
            tr = InnerTrainer(m, ds, device=device, seq_len=128, amp=amp, peer_id="bench")
            tr.run(round=0, inner_steps=2, batch_size=b)  # warm-up (kernels, allocator)
            _sync(device)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            res = tr.run(round=1, inner_steps=steps, batch_size=b)
            tps[amp] = res.tokens / res.compute_s
            peak[amp] = torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else float("nan")
            del tr, m
            _free(device)
        rows.append(
            f"| {b} | {tps[False]:,.0f} | {tps[True]:,.0f} | {tps[True] / tps[False]:.2f}x "
            f"| {peak[False]:.2f} / {peak[True]:.2f} |"
        )
    note = "" if device.startswith("cuda") else "\n(autocast is CUDA-only: on a CPU both columns are fp32.)\n"
    return (
        f"Model `{model}` (vocab {ds.vocab_size}), seq 128, `InnerTrainer.run`: 2 warm-up then {steps} timed "
        f"inner steps (AdamW) per cell; tokens/s = tokens / compute seconds.\n\n" + "\n".join(rows) + "\n" + note,
        True,
    )


def swarm_step(
    device: str,
    rounds: int,
    workdir: Path,
    model: str,
    deadline_s: float,
    device_args: list[str] | None = None,
    other_args: list[str] | None = None,
    seq_len: int = 64,
) -> tuple[str, bool]:
    """Bootstrap + a peer on ``device`` (or started with ``device_args``, e.g. ``--local-devices cuda:0,cuda:1``:
    one peer of several ranks, issue 30) + a second peer (``other_args``, default ``--device cpu``); the
    digests of both after every round, steps x batch, and each peer's peak memory (host RSS and device)
    against the method's minimum for ``model`` (issue 27)."""
    workdir.mkdir(parents=True, exist_ok=True)
    device_args = device_args or ["--device", device]
    other_args = other_args or ["--device", "cpu"]
    from geomesh_p2p.util.procs import bootstrap_argv, wait_for_address

    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    run = [
        "--run-id",
        "device-check",
        "--model",
        model,
        "--seq-len",
        str(seq_len),
        "--window-s",
        "6",
        "--rounds",
        str(rounds),
        "--min-peers",
        "2",
        "--profile-batches",
        "4,8",
    ]
    procs = []
    t0 = time.time()
    try:
        # Port 0: the bootstrap binds a free port and prints it; a port picked here first could be taken.
        procs.append(
            subprocess.Popen(
                bootstrap_argv("device-check", workdir / "b.key"),
                stdout=open(workdir / "bootstrap.log", "w"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        entry = wait_for_address(workdir / "bootstrap.log", procs[0], 120)
        for name in ("gpu", "cpu"):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "peer.cli",
                        "join",
                        "--bootstrap",
                        entry,
                        *(device_args if name == "gpu" else other_args),
                        "--identity",
                        str(workdir / f"{name}.key"),
                        "--threads",
                        "4",
                        "--log-json",
                        str(workdir / f"{name}.jsonl"),
                    ]
                    + run,
                    stdout=open(workdir / f"{name}.log", "w"),
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        deadline = time.time() + deadline_s
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
    wall = time.time() - t0

    def rows(name):
        path = workdir / f"{name}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    g, c = rows("gpu"), rows("cpu")
    n = min(len(g), len(c))
    lines = [
        f"| round | digest on the device peer | digest on the `{' '.join(other_args)}` peer | equal | eval ppl |",
        "|---|---|---|---|---|",
    ]
    equal = n == rounds
    for k in range(n):
        same = g[k]["digest"] == c[k]["digest"]
        equal &= same
        lines.append(
            f"| {g[k]['round']} | {g[k]['digest'][:16]} | {c[k]['digest'][:16]} | {'yes' if same else 'NO'} "
            f"| {'-' if g[k].get('eval_ppl') is None else format(g[k]['eval_ppl'], '.1f')} |"
        )
    if n < rounds:
        for name in ("gpu", "cpu"):
            tail = (workdir / f"{name}.log").read_text()[-1500:] if (workdir / f"{name}.log").exists() else ""
            lines.append(
                f"\nonly {n} of {rounds} rounds logged by both peers; {name} peer's log tail:\n\n```\n{tail}\n```"
            )
    extra = []
    for name, rs in (("device", g), ("`" + " ".join(other_args) + "`", c)):
        cells = [
            f"{r.get('inner_steps_done')}x{r.get('batch_size')}"
            + (f" at {r['tokens'] / r['compute_s']:,.0f} tok/s" if r.get("compute_s") and r.get("tokens") else "")
            for r in rs
        ]
        if cells:
            extra.append(f"- {name} peer, inner steps x batch per round: {', '.join(cells)}")
    from geomesh_p2p.model.memory import preset_min_memory

    minimum = preset_min_memory(model).total
    for name, rs in (("device", g), ("`" + " ".join(other_args) + "`", c)):
        peaks = [r.get("extra", {}).get("memory", {}) for r in rs]
        for key, what in (("device_peak_bytes", "device memory (allocator)"), ("rss_peak_bytes", "host RSS")):
            vals = [m[key] for m in peaks if key in m]
            if vals:
                extra.append(
                    f"- {name} peer, peak {what}: {max(vals) / GIB:.2f} GiB = {max(vals) / minimum:.2f}x the "
                    f"method's minimum ({minimum / GIB:.2f} GiB, 24 B/param)"
                )
    return (
        f"Bootstrap + one peer (`{' '.join(device_args)}`) + one (`{' '.join(other_args)}`), model `{model}`, "
        f"seq {seq_len}, 6 s windows, "
        f"{rounds} rounds "
        f"of geomesh ({wall:.0f} s wall, processes included).\n\n"
        + "\n".join(lines)
        + "\n"
        + ("\n" + "\n".join(extra) + "\n" if extra else "")
    ), equal


def two_ranks(device: str) -> str:
    """``--local-devices`` for a 2-rank peer: two GPUs when there are, else both ranks on one (the issue's
    fallback), ``cpu,cpu`` without CUDA."""
    import torch

    if not device.startswith("cuda"):
        return "cpu,cpu"
    return "cuda:0,cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0,cuda:0"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        default="auto",
        help="device under test; auto = cuda if present, else cpu with --quick (default: %(default)s)",
    )
    ap.add_argument("--out", help="markdown report (default: docs/device-check.md on CUDA, else a temporary file)")
    ap.add_argument("--numel", type=int, default=124_000_000, help="codec vector size (default: GPT-2 small)")
    ap.add_argument("--codec-repeats", type=int, default=10, help="codec repeats (default: %(default)s)")
    ap.add_argument("--model", default="gpt2-124m", help="model preset for the training step (default: %(default)s)")
    ap.add_argument("--batches", default="8,32,64,128", help="batch sizes of the training step (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed inner steps per cell (default: %(default)s)")
    ap.add_argument(
        "--profile-models",
        default="small,gpt2-124m,llama-150m",
        help="presets for the start-up profile (default: %(default)s)",
    )
    ap.add_argument(
        "--profile-batches", default="4,8,16", help="batch sizes the profile measures (the peer's default: %(default)s)"
    )
    ap.add_argument(
        "--check-budget-gib",
        type=float,
        default=4.0,
        help="the small budget the profile is checked under (GiB, default: %(default)s)",
    )
    ap.add_argument("--swarm-model", default="small", help="model of the mixed swarm (default: %(default)s)")
    ap.add_argument(
        "--real-model",
        default="llama-150m",
        help="model of the 2-peer real-size round on the device (default: %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the mixed swarm (default: %(default)s)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420,
        help="the whole script's time budget: later sections shrink or are skipped (default: %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script on a CPU")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)
    import torch

    t_start = time.time()

    def time_left() -> float:
        return ns.budget_s - (time.time() - t_start)

    if ns.device == "auto":
        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
        ns.quick = ns.quick or ns.device == "cpu"
    workdir = Path(tempfile.mkdtemp(prefix="device-check-"))
    if ns.out is None:
        ns.out = str(ROOT / "docs" / "device-check.md" if ns.device.startswith("cuda") else workdir / "device-check.md")
    if ns.quick:
        ns.numel, ns.codec_repeats, ns.model, ns.batches, ns.steps, ns.rounds = 2_000_000, 3, "tiny", "4", 3, 2
        ns.profile_models, ns.swarm_model, ns.check_budget_gib, ns.real_model = "tiny", "tiny", 1.0, "tiny"
    batches = [int(x) for x in ns.batches.split(",") if x]
    prof_batches = [int(x) for x in ns.profile_batches.split(",") if x]
    presets = [x for x in ns.profile_models.split(",") if x]
    head = [
        f"# Device check ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `python3 benchmarks/device_check.py --device {ns.device}" + (" --quick" if ns.quick else "") + "`",
        "",
        f"torch {torch.__version__}; device: "
        + (torch.cuda.get_device_name(0) if ns.device.startswith("cuda") and torch.cuda.is_available() else ns.device),
        "",
    ]
    steps = (
        ("Machine", lambda: machine_section(ns.device)),
        ("The suite's CUDA tests", lambda: tests_section(ns.device, ns.quick, min(150.0, max(30.0, time_left())))),
        ("Codec on the device", lambda: codec_step(ns.device, ns.numel, ns.codec_repeats, workdir)),
        (
            "Start-up profile (profile.profile_training)",
            lambda: profile_section(ns.device, presets, 128, prof_batches, int(ns.check_budget_gib * GIB), time_left),
        ),
        (
            "Inner training step: bf16 autocast vs fp32",
            lambda: training_step(ns.device, ns.model, batches, ns.steps, time_left),
        ),
        (
            "Mixed swarm: digests of a device peer and a CPU peer",
            lambda: swarm_step(ns.device, ns.rounds, workdir, ns.swarm_model, max(60.0, min(240.0, time_left()))),
        ),
        (
            "Multi-rank peer (issue 30): 2 ranks on the device(s) next to a CPU peer",
            lambda: swarm_step(
                ns.device,
                ns.rounds,
                workdir / "ranks",
                ns.swarm_model,
                max(60.0, min(240.0, time_left())),
                device_args=["--local-devices", two_ranks(ns.device)],
            ),
        ),
        (
            "Real size (issue 27): 2 peers of the paper's model on the device, bf16 autocast",
            lambda: swarm_step(
                ns.device,
                ns.rounds,
                workdir / "real",
                ns.real_model,
                max(60.0, min(240.0, time_left())),
                other_args=["--device", ns.device],
                seq_len=128,
            ),
        ),
    )
    sections, ok = [], True
    for title, fn in steps:
        t0 = time.time()
        print(f"== {title} (t={t0 - t_start:.0f} s)", flush=True)
        try:
            text, good = fn()
        except Exception as e:  # one failing step must not hide the others' figures
            import traceback

            traceback.print_exc()
            text, good = f"failed: `{type(e).__name__}: {e}`\n", False
        ok &= good
        sections += [f"## {title} ({time.time() - t0:.0f} s){'' if good else ' - FAILED'}", "", text]
        print(f"{title}: {'ok' if good else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text("\n".join(head + sections))  # after every section: a cut-short run keeps what it did
    report = "\n".join(
        head + sections + [f"Total {time.time() - t_start:.0f} s; all checks {'passed' if ok else 'did NOT pass'}.", ""]
    )
    Path(ns.out).write_text(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
