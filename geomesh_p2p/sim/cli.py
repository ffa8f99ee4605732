"""``geomesh-sim``: replay a geo-distributed training run on a virtual clock.

Example (the paper's 4-GPU testbed, GeoMesh arXiv 2609.18388)::

    geomesh-sim --profile paper4 --methods diloco,awb,css,geomesh,async \\
        --json out.json --plot out.png

Prints one row per method: time to the target perplexity (virtual hours), final eval perplexity,
straggler idle of the fastest peer, network idle, GB sent per peer, compute utilisation. Times,
idle shares and bytes are *charged* for the profile's reference workload (e.g. a 150M-parameter
model); perplexities are *trained* on the small proxy model. See geomesh_p2p.sim.engine.
Exit status 2 on a bad profile, method or argument (one-line message).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from typing import Optional, Sequence

from geomesh_p2p.config.flags import home_problem
from geomesh_p2p.sim.charge import Charger
from geomesh_p2p.sim.hardware import Profile, load_profile, shipped_profiles
from geomesh_p2p.sim.methods import parse_method, parse_methods
from geomesh_p2p.util.errors import UserFacingError

DEFAULT_METHODS = "diloco,awb,css,geomesh,async"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="geomesh-sim",
        description="Virtual-time simulator of GeoMesh and its baselines (ddp, diloco, awb, css, geomesh, "
        "async). Charges time for the profile's reference workload; trains a small proxy model "
        "for the perplexity.",
        epilog="Method variants: geomesh+ef (error feedback), geomesh+relay, geomesh+int8 / +fp16 "
        "(re-encoded aggregate), geomesh+lion (+lr=X), +outer_lr=X, awb/geomesh+window=share|match.",
    )
    p.add_argument(
        "--profile",
        default="paper4",
        help="shipped profile name (paper4, homogeneous4, volunteer32) or a path to a YAML file (default: %(default)s)",
    )
    p.add_argument(
        "--methods", default=DEFAULT_METHODS, help="comma-separated methods to compare (default: %(default)s)"
    )
    p.add_argument(
        "--target-ppl",
        type=float,
        default=None,
        help="eval perplexity that defines 'time to target' (default: the profile's target_ppl, "
        "else 1.05 x diloco's final perplexity, else 1.05 x the first method's)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="token budget of every method in DiLoCo rounds (default: the profile's train.rounds)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for data order and initial weights (default: the profile's train.seed)",
    )
    p.add_argument(
        "--data", default=None, help="training corpus (.txt/.txt.xz/.jsonl/.parquet; default: the shipped KJV corpus)"
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="write all results (curves, per-round records, summaries) to this JSON file",
    )
    p.add_argument("--plot", default=None, help="write a PNG: perplexity vs virtual time, idle breakdown")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per method (default: %(default)s)")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="methods simulated in parallel processes; 0 = auto: min(#methods, CPUs / threads) "
        "(results do not depend on it; default: %(default)s)",
    )
    p.add_argument("--show-plans", action="store_true", help="print each method's first round plan")
    p.add_argument(
        "--charged-only",
        action="store_true",
        help="no training: print what the clock charges for one round of each method (seconds)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("--list-profiles", action="store_true", help="list the shipped profiles and exit")
    return p


def _die(msg: str) -> int:
    print(f"geomesh-sim: error: {msg}", file=sys.stderr)
    return 2


def _file_problem(args) -> Optional[str]:
    """Why a file flag cannot be used, in one line naming it, or None: ``--profile`` / ``--data`` / ``--json`` /
    ``--plot`` of ``~NAME`` where no user is called NAME, an output (``--json``, ``--plot``) that is a folder or whose
    folder does not exist or is not writable. Before the run: the outputs are written once every method was
    simulated, and an unwritable one was a traceback that lost the results (red team 43)."""
    for flag, value in (
        ("--profile", args.profile),
        ("--data", args.data),
        ("--json", args.json_path),
        ("--plot", args.plot),
    ):
        problem = home_problem(flag, value)
        if problem is not None:
            return problem
    for flag, value in (("--json", args.json_path), ("--plot", args.plot)):
        if not value:
            continue
        parent = os.path.dirname(value) or "."
        if os.path.isdir(value):
            return f"{flag} {value}: is a folder, expected a file path"
        if not os.path.isdir(parent):
            return f"{flag} {value}: folder {parent} does not exist"
        if not os.access(value if os.path.exists(value) else parent, os.W_OK):
            return f"{flag} {value}: {'file' if os.path.exists(value) else 'folder ' + parent} is not writable"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_profiles:
        for name in shipped_profiles():
            prof = load_profile(name)
            print(f"{name:14s} {prof.description}")
        return 0
    if args.threads < 1:
        return _die(f"--threads must be >= 1, got {args.threads}")
    if args.jobs < 0:
        return _die(f"--jobs must be >= 0, got {args.jobs}")
    if args.rounds is not None and args.rounds < 1:
        return _die(f"--rounds must be >= 1, got {args.rounds}")
    if args.target_ppl is not None and not (math.isfinite(args.target_ppl) and args.target_ppl > 1):
        return _die(f"--target-ppl must be a finite number > 1, got {args.target_ppl}")
    problem = _file_problem(args)
    if problem is not None:
        return _die(problem)
    try:
        profile = load_profile(args.profile)
        specs = parse_methods(args.methods)
    except (UserFacingError, ValueError) as e:
        return _die(str(e))
    try:
        if args.charged_only:
            return _charged_only(profile, specs)
        return _run(args, profile, specs, argv)
    except UserFacingError as e:
        return _die(str(e))
    except KeyboardInterrupt:
        return _die("interrupted")


def _run(args, profile, specs, argv) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from geomesh_p2p.data import DataError
    from geomesh_p2p.sim import report
    from geomesh_p2p.sim.engine import Simulator

    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    command = "geomesh-sim " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    progress = None
    tasks: dict[str, int] = {}
    plain_next: dict[str, float] = {}
    if not args.no_progress and console.is_terminal:
        progress = Progress(
            TextColumn("{task.description:<24}"),
            BarColumn(),
            TextColumn("{task.percentage:>5.1f}%"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def on_progress(label, done, budget, t, ppl):
        if args.no_progress:
            return
        if progress is None:  # not a terminal (a log file): a plain line every 10% per method
            if done >= plain_next.get(label, 0.0) or done >= budget:
                plain_next[label] = done + 0.1 * budget
                ppl_s = f" ppl={ppl:.1f}" if ppl is not None else ""
                print(f"[{label}] {100 * done / budget:5.1f}% t={t / 3600:.3f} h{ppl_s}", file=sys.stderr, flush=True)
            return
        if label not in tasks:
            tasks[label] = progress.add_task(label, total=budget, info="")
        info = f"t={t / 3600:.3f} h" + (f" ppl={ppl:.1f}" if ppl is not None else "")
        progress.update(tasks[label], completed=done, info=info)

    console.print(f"[bold]geomesh-sim[/] profile [cyan]{profile.name}[/]: {profile.description}")
    jobs = args.jobs or max(1, min(len(specs), (os.cpu_count() or 1) // args.threads))
    jobs = min(jobs, len(specs))
    try:
        sim = Simulator(
            profile, rounds=args.rounds, seed=args.seed, data=args.data, progress=on_progress if jobs == 1 else None
        )
    except DataError as e:
        return _die(str(e))
    console.print(
        f"charged: {profile.reference.model}, {profile.reference.params / 1e6:.0f}M params; "
        f"trained: preset {profile.train.preset!r} ({sim.numel / 1e6:.2f}M params), seq {profile.train.seq_len}; "
        f"budget {sim.rounds} DiLoCo rounds = {sim.budget_ref / 1e6:.1f}M reference tokens"
        + (f"; {jobs} parallel jobs" if jobs > 1 else "")
    )
    if progress is not None:
        progress.start()
    try:
        if jobs == 1:
            results = [sim.run(spec) for spec in specs]
        else:
            results = _run_parallel(profile, specs, args, jobs, on_progress)
    finally:
        if progress is not None:
            progress.stop()

    if args.target_ppl is not None:
        target, source = args.target_ppl, "--target-ppl"
    elif profile.target_ppl is not None:
        target, source = profile.target_ppl, f"profile {profile.name} target_ppl"
    else:
        base = next((r for r in results if r.spec.label == "diloco"), results[0])
        target = round(1.05 * base.curve[-1][1], 2)
        source = f"auto: 1.05 x {base.spec.label}'s final perplexity"
    rows = report.summaries(results, target)
    title = (
        f"{profile.name}: target ppl {target:g} ({source}); charged = virtual time of "
        f"{profile.reference.params / 1e6:.0f}M-param reference, trained = {profile.train.preset} proxy ppl"
    )
    out = Console()
    if args.show_plans:
        for r in results:
            pi = r.plan_info
            out.print(
                f"[bold]{r.spec.label}[/] first plan: window {pi['window_s']:.2f} s, "
                f"{pi['tokens_ref_per_round'] / 1e6:.2f}M ref tokens/round"
            )
            for p in pi["peers"]:
                out.print(
                    f"  {p['name']:<14} batch {p['batch']:>3} (proxy {p['proxy_batch']}) H {p['inner_steps']:>3}"
                    f"  compute {p['predicted_compute_s']:.2f} s  comm {p['predicted_comm_s']:.2f} s"
                )
    if out.is_terminal:
        out.print(report.rich_table(rows, title=title))
    else:
        print(report.format_table(rows, title=title))
    if args.json_path:
        obj = report.to_json(
            results,
            rows,
            profile=profile,
            target_ppl=target,
            target_source=source,
            command=command,
            budget_ref=sim.budget_ref,
            diloco_tokens_per_round=sim.diloco_tokens_per_round,
            numel=sim.numel,
        )
        report.dump_json(obj, args.json_path)
        console.print(f"wrote {args.json_path}")
    if args.plot:
        report.plot(results, rows, args.plot, target_ppl=target, title=f"geomesh-sim --profile {profile.name}")
        console.print(f"wrote {args.plot}")
    return 0


def _charged_only(profile, specs) -> int:
    """One round of each method on the clock, without training (fast)."""
    from geomesh_p2p.model.build import build_model, num_params

    numel = num_params(build_model(profile.train.preset, seed=profile.train.seed))
    ch = Charger(profile, numel)
    print(
        f"{profile.name}: one round of each method, charged for {profile.reference.model} "
        f"(DiLoCo: {ch.diloco_tokens_per_round / 1e6:.2f}M tokens per round); no training"
    )
    head = [
        "method",
        "window s",
        "round s",
        "tokens/round [M]",
        "x diloco tokens",
        "k tokens/s",
        "straggler idle fastest %",
        "network idle %",
        "compute util %",
        "MB sent/peer",
        "H min..max",
    ]
    rows = []
    skipped = []
    for spec in specs:
        if spec.base == "async":
            skipped.append(spec.label)
            continue
        plan = ch.plan(spec)
        rc = ch.charge(spec, plan)
        tm = rc.timing
        R = tm.round_s
        H = [a.inner_steps for a in plan.assignments]
        rows.append(
            [
                spec.label,
                f"{plan.window_s:.2f}",
                f"{R:.2f}",
                f"{rc.tokens_ref / 1e6:.2f}",
                f"{rc.tokens_ref / ch.diloco_tokens_per_round:.2f}",
                f"{rc.tokens_ref / R / 1e3:.0f}",
                f"{100 * tm.straggler_s[ch.fastest] / R:.1f}",
                f"{100 * tm.network_s / R:.1f}",
                f"{100 * sum(tm.compute_s) / len(H) / R:.1f}",
                f"{sum(rc.xb.sent(i) for i in range(ch.n)) / ch.n / 1e6:.1f}",
                f"{min(H)}..{max(H)}",
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if skipped:
        print(f"not shown (event-driven, no rounds; run without --charged-only): {', '.join(skipped)}")
    return 0


def _worker(profile_json: str, label: str, rounds, seed, data, threads: int, queue):
    """One method in a child process (spawned): its own Simulator, progress through ``queue``."""
    import torch

    from geomesh_p2p.sim.engine import Simulator

    torch.set_num_threads(threads)
    profile = Profile.model_validate_json(profile_json)

    def prog(lbl, done, budget, t, ppl):
        queue.put((lbl, done, budget, t, ppl))

    sim = Simulator(profile, rounds=rounds, seed=seed, data=data, progress=prog)
    return sim.run(parse_method(label))


def _run_parallel(profile, specs, args, jobs: int, on_progress):
    """Run methods in ``jobs`` spawned processes; results in the order of ``specs``."""
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        q = manager.Queue()
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
            futs = [
                ex.submit(
                    _worker, profile.model_dump_json(), s.label, args.rounds, args.seed, args.data, args.threads, q
                )
                for s in specs
            ]
            while not all(f.done() for f in futs):
                try:
                    on_progress(*q.get(timeout=0.2))
                except queue_mod.Empty:
                    pass
            while True:
                try:
                    on_progress(*q.get_nowait())
                except queue_mod.Empty:
                    break
            return [f.result() for f in futs]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
