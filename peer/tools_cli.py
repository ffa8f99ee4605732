"""``geomesh-peer status | export | generate | checkpoints``: look at a swarm, use what it trained.

  geomesh-peer status --bootstrap HOST:PORT --run-id R [--json]
  geomesh-peer checkpoints DIR [--json] [--verify]
  geomesh-peer export --checkpoint-dir DIR [--round N] --out HF_DIR
  geomesh-peer generate --checkpoint-dir DIR --prompt "In the beginning"

Every failure a person can cause is one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import collections
import asyncio
import json
import math
import sys
import time
from typing import Optional

from geomesh_p2p.config.flags import AppendOverDefault, takes
from geomesh_p2p.config.models import DEFAULT_RUN_ID
from geomesh_p2p.schema.shards import check_shards
from peer.path_checks import (
    BAD_INPUT,
    checkpoint_source_problem,
    data_file_problem,
    key_file_problem,
    out_dir_problem,
)
from peer.node_cli import _host_port, _int_at_least, _non_negative_float, _positive_float


def _say(cmd: str, message: str) -> None:
    print(f"geomesh-peer {cmd}: {message}", file=sys.stderr)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ----------------------------------------------------------------------------------------- status
@takes("int")
def _record_shards(text: str) -> int:
    """argparse type of ``--record-shards``: a power of two in 1..256 (argparse names the flag in its error)."""
    try:
        return check_shards(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("record_shards ")) from None


def _load_dht_libraries() -> None:
    """Import what :func:`_read_swarm` uses (the DHT loads hivemind, which loads torch: seconds on a loaded box)."""
    from geomesh_p2p.dht import DHTNode  # noqa: F401  (its names load on first use)
    from geomesh_p2p.status.swarm import SwarmWatcher  # noqa: F401


async def _read_swarm(ns):
    from geomesh_p2p.dht import DHTNode, swarm_progress
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.status.swarm import SwarmWatcher
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    identity = Identity.load_or_create(ns.identity) if ns.identity else Identity.generate()
    transport = Transport(identity, ns.run_id, TransportConfig(client_only=True))
    node = DHTNode(transport, rpc_timeout_s=ns.timeout, join_attempts=2, join_backoff_s=0.3)
    await transport.start()
    try:
        await node.join(ns.bootstrap)
        watcher = SwarmWatcher(node, ns.run_id, shards=ns.record_shards)
        view = await watcher.refresh()
        if not view.get("peers"):
            # nobody live: what the bootstrap saved of the run tells a user where it was (fresh user 39: after a
            # bootstrap restart "no live peer" alone did not say that the peers resume with --resume)
            p = await swarm_progress(node, ns.run_id)
            if p is not None:
                view["progress"] = {"round": p.round, "seen_at": p.seen_at, "peers": p.peers}
        return view, watcher.rounds()
    finally:
        await node.shutdown()
        await transport.stop(grace=0)


def _fmt(x, digits=1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _peer_count(peers: list[dict]) -> str:
    """``"3"`` when all train, else with the states: ``"3 (2 training, 1 leaving)"``, ``"4 (4 left)"`` (a fresh user
    read "peers 3" beside a plan of 2 after a peer left: the leaving record still counts until it expires; fresh user
    52 read "peers 4" after all four had left)."""
    states = collections.Counter(str(p.get("state")) for p in peers)
    if not states or set(states) == {"training"}:
        return str(len(peers))
    return f"{len(peers)} (" + ", ".join(f"{n} {s}" for s, n in states.most_common()) + ")"


def _peer_state(p: dict) -> str:
    """A peer row's state, with what the others may not see in it (fresh user 51): ``training, other plan r22``
    (its last summarised round ran another leader's plan than most reporters, or it trained alone) and ``no lead
    to r30`` (a late mark or no-show bench it announces on itself)."""
    notes = [p["state"]]
    if p.get("other_plan"):
        notes.append(f"other plan r{p['last_round']}")
    if p.get("marked_until") is not None:
        notes.append(f"no lead to r{p['marked_until']}")
    return ", ".join(notes)


def render_status(view: dict, rounds: dict, console=None) -> None:
    """The swarm as rich tables: a header line, the peers, the last rounds."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    d = view.get("digests") or {}
    digests = (
        "-"
        if not d.get("total")
        else (f"equal ({d['agree']}/{d['total']})" if d.get("equal") else f"DIFFER ({d['agree']}/{d['total']} agree)")
    )
    head = Text()
    head.append(f"run {view.get('run_id')}  ", style="bold")
    head.append(f"round {view.get('round') if view.get('round') is not None else '-'}  ")
    head.append(f"leader {view.get('leader') or '-'}  ")
    head.append(f"peers {_peer_count(view.get('peers') or [])}  ")
    head.append(f"digests {digests}", style="green" if d.get("equal") else ("red" if d.get("total") else ""))
    console.print(head)
    plan = view.get("plan")
    if plan:
        console.print(
            Text(
                f"plan of round {plan['round']} by {plan['leader']}: {len(plan['assignments'])} "
                f"participant(s), window {plan['window_s']} s, {plan['method']}/{plan['mode']}"
            )
        )
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col, just in (
        ("peer", "left"),
        ("device", "left"),
        ("mem GiB", "right"),
        ("tokens/s", "right"),
        ("up Mbit/s", "right"),
        ("down Mbit/s", "right"),
        ("round", "right"),
        ("state", "left"),
        ("batch/H", "right"),
        ("last seen", "right"),
    ):
        t.add_column(col, justify=just, no_wrap=col != "device", overflow="fold")
    for p in view.get("peers") or []:
        # Text(), not markup: a device name is whatever its peer announced
        t.add_row(
            Text(p["short"]),
            Text(p["device"]),
            _fmt(p["memory_gib"], 2),
            _fmt(p["tokens_per_s"], 0),
            _fmt(p["up_mbps"]),
            _fmt(p["down_mbps"]),
            str(p["round"]),
            Text(_peer_state(p)),
            "-" if p.get("batch") is None else f"{p['batch']}/{p['inner_steps']}",
            f"{p['last_seen_s']:.0f} s",
        )
    if view.get("peers"):
        console.print(t)
    else:
        console.print(Text(f"no live peer in run {view.get('run_id')} (or none has announced itself yet)"))
        saved = view.get("progress")
        if saved:
            ago = max(0.0, time.time() - float(saved["seen_at"]))
            console.print(
                Text(
                    f"its bootstrap last saw {saved['peers']} peer(s) at round {saved['round']}, {ago / 60:.0f} min "
                    "ago: restart them with the same flags plus --resume to go on from their checkpoints"
                )
            )
    if view.get("ignored"):
        console.print(Text(f"{view['ignored']} record(s) ignored (other run config, no proof of work, not allowed)"))
    rows = (rounds or {}).get("rounds") or []
    if rows:
        r = Table(
            show_header=True, header_style="bold", box=None, pad_edge=False, title="last rounds", title_justify="left"
        )
        cols = ("round", "peers", "plans", "loss", "eval ppl", "tokens/s", "strag%", "net%", "KB sent/peer", "digests")
        for col in cols:
            r.add_column(col, justify="right")
        for x in rows[-5:]:
            agree = {True: "equal", False: "MISMATCH", None: "-"}[x.get("digest_agree")]
            r.add_row(
                str(x["round"]),
                str(x["peers"]),
                # the leaders the reporters followed: over 1, the round split (fresh user 51)
                "-" if not x.get("leaders") else (f"{x['leaders']} SPLIT" if x["leaders"] > 1 else "1"),
                _fmt(x.get("loss"), 3),
                _fmt(x.get("eval_ppl"), 2),
                _fmt(x.get("tokens_per_s"), 0),
                _fmt(x.get("straggler_idle_pct")),
                _fmt(x.get("network_idle_pct")),
                _fmt(x.get("bytes_sent_per_peer", 0) / 1024),
                agree,
            )
        console.print(r)


def cmd_status(ns: argparse.Namespace) -> int:
    # gRPC's C core is silenced on import of the package (geomesh_p2p.util.grpc_env), before grpc loads.
    import logging

    lib = logging.getLogger("geomesh_p2p")
    level = lib.level
    if ns.log_level == "INFO":  # the default: the DHT's progress lines would only clutter the table
        lib.setLevel(logging.WARNING)
    try:
        return _status(ns)
    finally:
        lib.setLevel(level)  # run in-process (the tests), the next caller's INFO lines are not lost


def _status(ns: argparse.Namespace) -> int:
    """:func:`cmd_status`'s body."""
    if not ns.bootstrap:
        _say("status", "--bootstrap HOST:PORT is required (on the command line, or bootstrap: in --config)")
        return 2
    if ns.identity and _bad_paths("status", key_file_problem("--identity", ns.identity)):
        return BAD_INPUT
    t0 = time.monotonic()  # before the DHT's imports (hivemind loads torch: seconds), which a failure's figure counts
    from geomesh_p2p.dht import DHTJoinError
    from geomesh_p2p.dht.state import OtherRunError
    from geomesh_p2p.net.identity import IdentityError

    _load_dht_libraries()
    loaded = time.monotonic() - t0
    try:
        view, rounds = asyncio.run(asyncio.wait_for(_read_swarm(ns), timeout=ns.timeout * 4 + 10))
    except OtherRunError as e:  # it answered: "cannot reach" would send the user after the network
        _say("status", f"reached the bootstrap, but {_one_line(e).removeprefix('could not join the DHT: ')}")
        return 1
    except DHTJoinError as e:
        # the join's own figure ("2 attempt(s) over 0.3s") is its tries only: a fresh user timed 7.6 s in all (49)
        took = time.monotonic() - t0
        _say(
            "status",
            f"cannot reach the bootstrap {', '.join(ns.bootstrap)} ({took:.1f} s in all, {loaded:.1f} s of it "
            f"loading the DHT's libraries): {_one_line(e)}",
        )
        return 1
    except asyncio.TimeoutError:
        _say("status", f"no answer from the swarm through {', '.join(ns.bootstrap)} in time")
        return 1
    except IdentityError as e:  # a key file checked at start that went bad since: still the flag's fault
        _say("status", f"--identity: {_one_line(e)}")
        return BAD_INPUT
    except OSError as e:
        _say("status", _one_line(e))
        return 1
    if ns.json:
        print(json.dumps({"swarm": view, "rounds": rounds.get("rounds", [])}, indent=1, allow_nan=False))
    else:
        render_status(view, rounds)
    return 0


# ------------------------------------------------------------------------------------ checkpoints
def _bad_paths(cmd: str, *problems: Optional[str]) -> bool:
    """Before torch's import (~27 s on a loaded 2-core box for a mistyped folder, session 35): says the first of
    ``problems`` (one line each naming its flag, :mod:`peer.path_checks`) on stderr and returns True, or returns
    False when all are None. The caller exits 2, as for any bad flag or file (fresh user 49: these exited 1)."""
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        _say(cmd, problem)
    return problem is not None


#: What a checkpoint's round is, said under the listing: the state a round starts from, the previous round's result.
ROUND_OF_A_CHECKPOINT = (
    "round N: the state after round N-1's exchange, which round N starts from (the round log's row N-1, and the "
    "demo's, evaluated it)"
)


def _state_of_round(r: int) -> str:
    """What the checkpoint of round ``r`` holds, in the round rows' numbering."""
    return f"the state after round {r - 1}" if r > 0 else "the seed, before round 0"


def cmd_checkpoints(ns: argparse.Namespace) -> int:
    if _bad_paths("checkpoints", checkpoint_source_problem("DIR", ns.directory)):
        return BAD_INPUT
    from geomesh_p2p.model.export import ExportError, list_checkpoint_info

    try:
        rows = list_checkpoint_info(ns.directory, verify=ns.verify)
    except ExportError as e:
        _say("checkpoints", str(e))
        return 1
    if ns.json:
        print(json.dumps(rows, indent=1, allow_nan=False))
        return 0 if all(r["problem"] is None for r in rows) else 1
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=None if sys.stdout.isatty() else 160)
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col, just in (
        ("round", "right"),
        ("digest", "left"),
        ("size MB", "right"),
        ("params", "right"),
        ("momentum", "left"),
        ("written", "left"),
        ("run config", "left"),
        ("peer", "left"),
        ("problem", "left"),
    ):
        t.add_column(col, justify=just, overflow="fold")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r.get("time") else "-"
        t.add_row(
            str(r["round"]),
            (r["digest"] or "-")[:16],
            _fmt((r["bytes"] or 0) / 1e6, 2) if r["bytes"] else "-",
            f"{r['num_params']:,}" if r.get("num_params") else "-",
            {True: "yes", False: "no", None: "-"}[r.get("has_momentum")],
            when,
            r.get("run_config_hash") or "-",
            (r.get("peer_id") or "-")[:10],
            Text(r["problem"] or "", style="red"),
        )
    console.print(t)
    hashes = {r.get("run_config_hash") for r in rows if r.get("run_config_hash")}
    newest = next((r for r in reversed(rows) if isinstance(r.get("run_config"), dict)), None)
    if newest is not None:
        cfg = newest["run_config"]
        console.print(Text(f"run config of round {newest['round']} (hash {newest['run_config_hash']}):", style="bold"))
        # None is how the run config stores "auto" (--window-s auto): say it as the flags and --help do
        shown = {k: ("auto" if v is None and k == "window_s" else v) for k, v in cfg.items()}
        console.print(Text("  " + "  ".join(f"{k}={shown[k]!r}" for k in sorted(shown) if k != "model_config_json")))
    if len(hashes) > 1:
        console.print(
            Text(f"warning: checkpoints of {len(hashes)} different run configs in this directory", style="yellow")
        )
    # the round numbers of a checkpoint and of a round row differ by one (fresh user 47: the demo's "reached at
    # round 3" and a newest checkpoint "round 4" were the same state)
    console.print(Text(ROUND_OF_A_CHECKPOINT, style="dim"))
    if not ns.verify:
        console.print(Text("(digests not re-computed; --verify reads every weights file)", style="dim"))
    return 0 if all(r["problem"] is None for r in rows) else 1


# ------------------------------------------------------------------------------- export / generate
def cmd_export(ns: argparse.Namespace) -> int:
    if _bad_paths(
        "export",
        checkpoint_source_problem("--checkpoint-dir", ns.checkpoint_dir),
        data_file_problem("--data", ns.data),
        out_dir_problem("--out", ns.out),
    ):
        return BAD_INPUT
    from geomesh_p2p.model.export import ExportError, export_checkpoint

    try:
        info = export_checkpoint(
            ns.checkpoint_dir, ns.out, round=ns.round, data=ns.data, run_id=ns.run_id, overwrite=ns.force
        )
    except ExportError as e:
        _say("export", str(e))
        return 1
    print(
        f"exported round {info['round']} ({_state_of_round(info['round'])}; digest {info['digest'][:16]}, "
        f"{info['num_params']:,} parameters) "
        f"to {info['out']}: {', '.join(info['files'])}"
    )
    print(
        f"load it with: AutoModelForCausalLM.from_pretrained({info['out']!r}), "
        f"AutoTokenizer.from_pretrained({info['out']!r})"
    )
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    if _bad_paths(
        "generate",
        checkpoint_source_problem("--checkpoint-dir", ns.checkpoint_dir),
        data_file_problem("--data", ns.data),
    ):
        return BAD_INPUT
    from geomesh_p2p.model.export import ExportError, build_exported, generate

    try:
        ex = build_exported(ns.checkpoint_dir, round=ns.round, data=ns.data, run_id=ns.run_id)
    except ExportError as e:
        _say("generate", str(e))
        return 1
    text = generate(
        ex, ns.prompt, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k, seed=ns.seed
    )
    print(text)
    return 0


def add_subcommands(sub, add_common) -> None:
    st = sub.add_parser(
        "status",
        help="a swarm's peers, round, leader and digests (from its DHT)",
        description="Read a run's signed DHT records through a bootstrap and print its peers "
        "(device, memory, tokens/s, link, round, state), round, leader, plan, digests "
        "and last rounds. Exits 1 with one line when the bootstrap cannot be reached.",
    )
    st.add_argument(
        "--bootstrap",
        # the command line's replaces a --config file's list (plain append added to it), and the file's alone will
        # do: not required by argparse, checked by _status (red team 44)
        action=AppendOverDefault,
        default=[],
        type=_host_port,
        metavar="HOST:PORT",
        help="the swarm's bootstrap (its DHT port, as peers join with); repeatable; required (here or in --config)",
    )
    st.add_argument("--run-id", default=DEFAULT_RUN_ID, help="run to read (default: %(default)s)")
    st.add_argument("--json", action="store_true", help="print JSON (the status page's /api/swarm and rounds)")
    st.add_argument(
        "--record-shards",
        type=_record_shards,
        default=1,
        metavar="S",
        help="the run's --record-shards: the DHT keys its peer records are spread over (default: %(default)s)",
    )
    st.add_argument(
        "--timeout",
        type=_positive_float,
        default=3.0,
        metavar="SECONDS",
        help="deadline of each DHT call (default: %(default)s)",
    )
    st.add_argument(
        "--identity",
        default=None,
        metavar="PATH",
        help="key to call with (private runs allow listed keys only; default: a throwaway key)",
    )
    add_common(st)
    st.set_defaults(handler=cmd_status)

    ck = sub.add_parser(
        "checkpoints",
        help="list a checkpoint directory: rounds, digests, sizes, config",
        description="List the checkpoints of DIR (round, digest, size, parameters, run config).",
    )
    ck.add_argument("directory", metavar="DIR", help="a --checkpoint-dir")
    ck.add_argument("--verify", action="store_true", help="re-read every weights file and check its digest")
    ck.add_argument("--json", action="store_true", help="print JSON")
    add_common(ck)
    ck.set_defaults(handler=cmd_checkpoints)

    def source_flags(p):
        p.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="the peer's --checkpoint-dir")
        p.add_argument(
            "--round",
            type=_int_at_least(0),
            default=None,
            metavar="N",
            help="checkpoint of this round (default: the newest)",
        )
        p.add_argument(
            "--data",
            default=None,
            metavar="PATH|hf:...",
            help="the run's --data, when it did not train on the shipped corpus (rebuilds its tokenizer)",
        )
        p.add_argument("--run-id", default=None, help="refuse a checkpoint of another run")

    ex = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face (transformers) folder",
        description="Write the global weights of a checkpoint as a Hugging Face folder: config.json, "
        "model.safetensors and the run's tokenizer files, so that "
        "AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT) "
        "load it offline.",
    )
    source_flags(ex)
    ex.add_argument(
        "--out", required=True, metavar="DIR", help="folder to write (created; must be empty or an earlier export)"
    )
    ex.add_argument("--force", action="store_true", help="write into a non-empty --out")
    add_common(ex)
    ex.set_defaults(handler=cmd_export)

    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model",
        description="Load a checkpoint and print the prompt and its continuation.",
    )
    source_flags(gen)
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument(
        "--max-new-tokens",
        type=_int_at_least(1, 4096),
        default=40,
        help="tokens to generate after the prompt (default: %(default)s)",
    )
    gen.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.8,
        help="sampling temperature; 0 = greedy (default: %(default)s)",
    )
    gen.add_argument(
        "--top-k",
        type=_int_at_least(1),
        default=40,
        help="sample among the k most likely next tokens only (default: %(default)s)",
    )
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    add_common(gen)
    gen.set_defaults(handler=cmd_generate)
