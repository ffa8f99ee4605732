"""``geomesh-peer join | demo | profile``: flags, validation at start, clean Ctrl+C. No protocol logic."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys

log = logging.getLogger("geomesh-peer")

# Defaults of --data-column / --data-max-bytes (kept in sync with geomesh_p2p.data.hub, which is
# not imported here so that --help stays fast).
DEFAULT_HF_COLUMN = "text"
DEFAULT_HF_MAX_BYTES = 50_000_000
# Proof of work per identity (kept in sync with geomesh_p2p.admission, not imported for the same reason).
DEFAULT_POW_BITS, MAX_POW_BITS = 22, 40


def _positive_float(text: str) -> float:
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {text}" if hi is not None
                                             else f"must be >= {lo}, got {text}")
        return v
    return parse


def _mbps(text: str) -> float:
    v = _positive_float(text)
    if not 0.001 <= v <= 1e6:
        raise argparse.ArgumentTypeError(f"must be between 0.001 and 1,000,000 Mbit/s, got {text}")
    return v


def _speed_factor(text: str) -> float:
    v = _positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = this device's own speed), got {text}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def _momentum(text: str) -> float:
    v = float(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _batch_list(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    return sizes


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _probe_mb(text: str) -> float:
    v = _positive_float(text)
    if not 0.0625 <= v <= 4:
        raise argparse.ArgumentTypeError(f"must be between 0.0625 (64 KiB) and 4 MiB, got {text}")
    return v


def _host_port(text: str) -> str:
    """A ``HOST:PORT`` flag value (``[IPV6]:PORT`` for an IPv6 literal), in its canonical spelling
    (:func:`geomesh_p2p.addr.canonical_address`). Raises ArgumentTypeError naming what is wrong."""
    from geomesh_p2p.addr import AddressError, canonical_address

    try:
        return canonical_address(text)
    except AddressError as e:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r} ({e})") from None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the run config: every peer of a run must use the same values (they are hashed)."""
    g = p.add_argument_group("run config (shared by every peer of a run; mismatches are refused)")
    g.add_argument("--run-id", default="geomesh-demo", help="name of the training run (default: %(default)s)")
    g.add_argument("--model", default="tiny", help="model preset: tiny, small, llama-tiny, gpt2-124m, llama-150m; README 'Memory a preset needs' gives what each costs (default: %(default)s)")
    g.add_argument("--model-config", metavar="FILE.json", help="transformers config JSON instead of a preset")
    g.add_argument("--data", metavar="PATH|hf:NAME[:CONFIG][@SPLIT]",
                   help=".txt/.txt.xz/.jsonl/.parquet training text, or a Hugging Face dataset streamed from the hub, "
                        "e.g. hf:wikitext:wikitext-2-raw-v1@train (default: the shipped KJV corpus)")
    g.add_argument("--data-column", metavar="NAME",
                   help=f"with --data hf:...: the string column holding the text (default: {DEFAULT_HF_COLUMN})")
    g.add_argument("--data-max-bytes", type=_positive_int, metavar="N",
                   help=f"with --data hf:...: take only the first N bytes of text (default: {DEFAULT_HF_MAX_BYTES})")
    g.add_argument("--vocab-size", type=_int_at_least(257), default=4096, help="byte-level BPE vocabulary (default: %(default)s)")
    g.add_argument("--seq-len", type=_int_at_least(1), default=64, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="run seed: initial weights and data order (default: %(default)s)")
    g.add_argument("--method", default="geomesh", choices=["geomesh", "awb", "css", "diloco", "ddp"],
                   help="geomesh = AWB + sign compression; awb / css = one of them; diloco = neither; "
                        "ddp = fp32 gradient sync every step, AdamW on the mean (default: %(default)s)")
    g.add_argument("--mode", default="relay", choices=["relay", "reencode"],
                   help="how part owners serve a part: relay = forward the signed contributions, every peer "
                        "aggregates them itself (an owner cannot forge the update; bytes grow with the group); "
                        "reencode = send the owner's re-encoded aggregate (~2 P/8 bytes per peer; trusted owners "
                        "only) (default: %(default)s)")
    g.add_argument("--aggregation", default="meanmed", choices=["mean", "meanmed", "vote"],
                   help="aggregation rule of compressed methods: meanmed = bounded-weight mean of signs x median "
                        "block scale, vote = weighted sign majority x median scale (both drop contributions that "
                        "disagree with the consensus), mean = plain token-weighted mean (not robust to attackers; "
                        "docs/security.md) (default: %(default)s)")
    g.add_argument("--weight-cap", type=_positive_float, default=1.0, metavar="X",
                   help="no contributor weighs more than X times the median weight, whatever tokens it claims "
                        "(default: %(default)s)")
    g.add_argument("--min-agreement", type=_fraction, default=0.5, metavar="F",
                   help="robust rules drop a contribution whose signs agree with the consensus on fewer than F of "
                        "the elements; 0 = off (default: %(default)s)")
    g.add_argument("--quorum", type=_fraction, default=0.5, metavar="F",
                   help="a part result counts only if it holds contributions of at least F of the round's "
                        "participants (default: %(default)s)")
    g.add_argument("--aggregate-encoding", default="sign", choices=["sign", "int8", "fp16"],
                   help="reencode mode: encoding of the aggregate (default: %(default)s)")
    g.add_argument("--block-size", type=_int_at_least(1), default=2048, help="elements per sign-codec scale (default: %(default)s)")
    g.add_argument("--error-feedback", action="store_true", help="keep the compression residual (off: it hurt under Nesterov)")
    g.add_argument("--inner-optimizer", default="adamw", choices=["adamw", "lion"], help="(default: %(default)s)")
    g.add_argument("--inner-lr", type=_positive_float, default=1e-3, help="(default: %(default)s)")
    g.add_argument("--outer-lr", type=_positive_float, default=0.7, help="outer Nesterov lr, DiLoCo's 0.7 (default: %(default)s)")
    g.add_argument("--outer-momentum", type=_momentum, default=0.9, help="(default: %(default)s)")
    g.add_argument("--target-batch", type=_int_at_least(1), default=8, help="sequences per inner step (default: %(default)s)")
    g.add_argument("--window-s", type=_positive_float, default=6.0, help="sync window per round, seconds (default: %(default)s)")
    g.add_argument("--uniform-inner-steps", type=_int_at_least(1), default=20, help="H of the uniform (diloco/css) plan (default: %(default)s)")
    g.add_argument("--pow-bits", type=_int_at_least(0, MAX_POW_BITS), default=DEFAULT_POW_BITS, metavar="BITS",
                   help="proof of work per identity, in leading zero bits of SHA-256 (computed once per key and run, "
                        "cached next to the key file; records without it are ignored); 0 = off "
                        "(default: %(default)s, a few seconds of one CPU core)")


def add_node_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("this node")
    g.add_argument("--bootstrap", action="append", type=_host_port, default=[], metavar="HOST:PORT",
                   help="a bootstrap (or any live peer) to join through; repeatable")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=_int_at_least(0, 65535), default=0, help="port to listen on; 0 = any free (default: %(default)s)")
    g.add_argument("--advertise-host", help="address others dial (default: --host)")
    g.add_argument("--client-only", action="store_true", help="behind NAT: accept no connections, own no part")
    g.add_argument("--identity", default="~/.geomesh/identity.key", metavar="PATH", help="Ed25519 key file (default: %(default)s)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--threads", type=_int_at_least(1), help="torch CPU threads (default: torch's choice)")
    g.add_argument("--no-amp", dest="amp", action="store_false",
                   help="on CUDA, train in fp32 instead of bf16 autocast (the outer step is always fp32)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="write safetensors checkpoints here")
    g.add_argument("--checkpoint-every", type=_int_at_least(1), default=5, help="rounds between checkpoints (default: %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    g.add_argument("--on-empty-swarm", default="wait", choices=["wait", "resume", "seed"],
                   help="when a bootstrap saw this run at round N > 0 but no peer of it is live: wait = wait for "
                        "a peer to come back (Ctrl+C stops), resume = continue from the newest checkpoint in "
                        "--checkpoint-dir, seed = start the run again from the seed at round 0 "
                        "(default: %(default)s)")
    g.add_argument("--rounds", type=_non_negative_int, help="stop once this many rounds are done (round numbers start at 0)")
    g.add_argument("--target-ppl", type=_positive_float, help="stop once eval perplexity is at or below this")
    g.add_argument("--min-peers", type=_int_at_least(1), default=1, help="peers to wait for before round 0 (default: %(default)s)")
    g.add_argument("--wait-peers-s", type=_non_negative_float, default=60.0, help="how long to wait for --min-peers (default: %(default)s)")
    g.add_argument("--speed-factor", type=_speed_factor, default=1.0,
                   help="emulate a slower device: each step takes 1/f as long (default: %(default)s)")
    g.add_argument("--memory-budget-gb", type=_positive_float, help="memory budget of this peer in GB (CPU RAM, or GPU memory on CUDA): the start-up profile never tries a batch whose predicted peak exceeds it (default: the memory available)")
    g.add_argument("--upload-mbps", type=_mbps, help="state your upload bandwidth (Mbit/s) instead of measuring")
    g.add_argument("--download-mbps", type=_mbps, help="state your download bandwidth (Mbit/s)")
    g.add_argument("--added-latency-ms", type=_non_negative_float, default=0.0, help="add this latency to every outgoing call (WAN emulation)")
    g.add_argument("--profile-batches", type=_batch_list, default=[4, 8, 16],
                   metavar="B,B,...", help="batch sizes to measure tokens/s at start-up (default: 4,8,16)")
    g.add_argument("--checkpoint-keep", type=_int_at_least(1), default=3, help="checkpoints kept (default: %(default)s)")
    g.add_argument("--eval-every", type=_int_at_least(1), default=1, metavar="N",
                   help="evaluate the global weights every N rounds and at the last (default: %(default)s; "
                        "raise it for --method ddp, whose rounds are single steps)")
    g.add_argument("--log-json", metavar="PATH", help="append one JSON line per round here")
    g.add_argument("--summary-json", metavar="PATH", help="write a run summary here at exit")
    g.add_argument("--metrics-port", type=_int_at_least(0, 65535), help="serve Prometheus metrics on this port")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="interface the metrics are served on; 0.0.0.0 (or ::) exposes them to other machines, e.g. "
                        "out of a Docker container with -p 9100:9100 (default: %(default)s)")
    g.add_argument("--allow-peers", metavar="FILE",
                   help="private run: deal only with the peers listed in FILE (one base58 PeerID or public key per "
                        "line; include the bootstraps); everyone else's records and requests are refused")


def data_spec_from(ns: argparse.Namespace) -> str | None:
    """What the node loads: None (shipped corpus), a file path, or a canonical ``hf:`` spec that
    carries --data-column / --data-max-bytes. Raises ValueError (DataError) with the spec."""
    column, max_bytes = getattr(ns, "data_column", None), getattr(ns, "data_max_bytes", None)
    if ns.data and ns.data.startswith("hf:"):
        from geomesh_p2p.data.hub import parse_hf_spec

        return parse_hf_spec(ns.data, column=column, max_bytes=max_bytes).canonical()
    if column is not None or max_bytes is not None:
        raise ValueError("--data-column and --data-max-bytes apply only to --data hf:NAME[:CONFIG][@SPLIT]")
    return ns.data or None


def run_config_from(ns: argparse.Namespace):
    """Build the RunConfig; reads --model-config and fingerprints --data (an hf: spec is identified by its
    canonical form). Raises ValueError with the path or spec."""
    import hashlib
    from pathlib import Path

    from geomesh_p2p.node import RunConfig

    model_json = None
    if ns.model_config:
        try:
            model_json = Path(ns.model_config).read_text()
            json.loads(model_json)
        except OSError as e:
            raise ValueError(f"cannot read --model-config {ns.model_config}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-config {ns.model_config} is not valid JSON: {e}") from None
    data_id = "kjv"
    spec = data_spec_from(ns)
    if spec is not None and spec.startswith("hf:"):
        data_id = spec  # name, config, split, column, max bytes (and revision): all compared between peers
    elif ns.data:
        p = Path(ns.data)
        if not p.is_file():
            raise ValueError(f"--data {ns.data}: no such file")
        try:
            with p.open("rb") as f:
                head = f.read(1 << 20)
        except OSError as e:
            raise ValueError(f"--data {ns.data}: cannot read: {e.strerror}") from None
        data_id = f"{p.name}:{p.stat().st_size}:{hashlib.sha256(head).hexdigest()[:16]}"
    return RunConfig(
        run_id=ns.run_id, model=ns.model if not model_json else hashlib.sha256(model_json.encode()).hexdigest()[:16],
        model_config_json=model_json, data=data_id, vocab_size=ns.vocab_size, seq_len=ns.seq_len, seed=ns.seed,
        method=ns.method, mode=ns.mode, aggregate_encoding=ns.aggregate_encoding, block_size=ns.block_size,
        aggregation=ns.aggregation, weight_cap=ns.weight_cap, min_agreement=ns.min_agreement or None, quorum=ns.quorum,
        error_feedback=ns.error_feedback, inner_optimizer=ns.inner_optimizer, inner_lr=ns.inner_lr,
        outer_lr=ns.outer_lr, outer_momentum=ns.outer_momentum, target_batch=ns.target_batch,
        window_s=ns.window_s, uniform_inner_steps=ns.uniform_inner_steps, pow_bits=getattr(ns, "pow_bits", DEFAULT_POW_BITS))


def node_config_from(ns: argparse.Namespace):
    from geomesh_p2p.node import NodeConfig

    mbps = lambda v: None if v is None else v * 1e6 / 8  # noqa: E731  Mbit/s -> bytes/s
    return NodeConfig(
        bootstrap=ns.bootstrap, host=ns.host, port=ns.port, advertise_host=ns.advertise_host,
        client_only=ns.client_only, identity=ns.identity, device=ns.device, threads=ns.threads,
        data_path=data_spec_from(ns), model_config_file=ns.model_config, checkpoint_dir=ns.checkpoint_dir,
        checkpoint_every=ns.checkpoint_every, checkpoint_keep=ns.checkpoint_keep, resume=ns.resume,
        on_empty_swarm=getattr(ns, "on_empty_swarm", "wait"), rounds=ns.rounds, target_ppl=ns.target_ppl,
        min_peers=ns.min_peers, wait_peers_s=ns.wait_peers_s, speed_factor=ns.speed_factor,
        memory_budget_bytes=int(ns.memory_budget_gb * 2**30) if ns.memory_budget_gb else None,
        upload_bps=mbps(ns.upload_mbps), download_bps=mbps(ns.download_mbps),
        added_latency_s=ns.added_latency_ms / 1000, profile_batches=ns.profile_batches, log_json=ns.log_json, summary_json=ns.summary_json,
        eval_every=ns.eval_every, amp=getattr(ns, "amp", True),
        metrics_port=ns.metrics_port, metrics_host=getattr(ns, "metrics_host", "127.0.0.1"),
        allow_peers=_allow_peers(ns))


def _allow_peers(ns: argparse.Namespace):
    """Entries of --allow-peers FILE (None when not given). Raises ValueError naming the file and line."""
    if not getattr(ns, "allow_peers", None):
        return None
    from geomesh_p2p.admission import read_allow_file

    return read_allow_file(ns.allow_peers)


async def _run_node(node) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.request_stop)
    try:
        return await node.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def cmd_join(ns: argparse.Namespace) -> int:
    from geomesh_p2p.identity import Identity, IdentityError
    from geomesh_p2p.node import PeerNode

    if not ns.bootstrap:
        log.info("no --bootstrap given: starting a new swarm (others can join through this peer)")
    warning = reachability_warning(ns)
    if warning:
        log.warning(warning)
    trust = trust_warning(ns)
    if trust:
        log.warning(trust)
    try:
        run = run_config_from(ns)
        cfg = node_config_from(ns)
        identity = Identity.load_or_create(ns.identity)
    except (ValueError, IdentityError) as e:
        print(f"geomesh-peer join: {e}", file=sys.stderr)
        return 2
    node = PeerNode(run, cfg, identity)
    try:
        return asyncio.run(_run_node(node))
    except Exception as e:  # known start-up failures are reported in one line, not a traceback
        if isinstance(e, user_facing_errors()):
            print(f"geomesh-peer join: {e}", file=sys.stderr)
            return 1
        raise


def trust_warning(ns: argparse.Namespace) -> str | None:
    """A one-line warning when an open run (no --allow-peers) uses settings that trust other peers
    (docs/security.md): the owner-computed aggregate of --mode reencode, the plain mean of --aggregation mean."""
    if getattr(ns, "allow_peers", None):
        return None
    trusting = []
    if ns.mode == "reencode" and ns.method in ("geomesh", "css"):
        trusting.append("--mode reencode lets each part owner compute its range's update alone")
    if ns.aggregation == "mean" and ns.method in ("geomesh", "css"):
        trusting.append("--aggregation mean lets one contributor steer the update")
    if not trusting:
        return None
    return ("open run (no --allow-peers): " + "; ".join(trusting) +
            ". Use the defaults (--mode relay --aggregation meanmed) unless every peer is trusted (docs/security.md)")


def _is_loopback(host: str) -> bool:
    from geomesh_p2p.addr import is_loopback_host

    return is_loopback_host(host)


def reachability_warning(ns: argparse.Namespace):
    """A warning when this peer would serve on a loopback address while its bootstrap is elsewhere:
    peers on other machines could not reach the parts it owns. None when all is well."""
    if ns.client_only:
        return None
    own = ns.advertise_host or ns.host
    from geomesh_p2p.addr import host_of

    remote = [b for b in ns.bootstrap if not _is_loopback(host_of(b))]
    if _is_loopback(own) and remote:
        return (f"this peer listens on {ns.host} and tells others to dial {own}, but its bootstrap {remote[0]} is on "
                f"another machine: nobody there can reach it. Pass --host 0.0.0.0 --advertise-host YOUR_PUBLIC_IP "
                f"(and open --port), or --client-only behind NAT")
    return None


def user_facing_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is enough for the user (bad data path, bad model config, no bootstrap...)."""
    from geomesh_p2p.data import DataError
    from geomesh_p2p.errors import UserFacingError
    from geomesh_p2p.identity import IdentityError
    from geomesh_p2p.state import StateError
    from geomesh_p2p.state_sync import StateSyncError
    from geomesh_p2p.training import ConfigError

    errs = [UserFacingError, DataError, IdentityError, StateError, StateSyncError, ConfigError, OSError]
    from geomesh_p2p.dht import DHTJoinError, IncompatibleSwarmError

    errs += [DHTJoinError, IncompatibleSwarmError]
    return tuple(errs)


def cmd_profile(ns: argparse.Namespace) -> int:
    from geomesh_p2p.capability import format_profile_table, profile

    probed = None
    if ns.probe:  # first: a wrong --run-id or a dead address fails before the device is measured
        try:
            probed = asyncio.run(_probe(ns.probe, ns.run_id, ns.probe_mb))
        except Exception as e:  # unreachable / refusing node: say so in one line
            print(f"geomesh-peer profile: link probe of {ns.probe} failed: {e}", file=sys.stderr)
            return 1
    result = profile(preset=ns.model, seq_len=ns.seq_len, batch_sizes=ns.batch_sizes, device=ns.device,
                     speed_factor=ns.speed_factor,
                     memory_budget_bytes=int(ns.memory_budget_gb * 2**30) if ns.memory_budget_gb else None,
                     upload_bps=ns.upload_mbps * 1e6 / 8 if ns.upload_mbps else None,
                     download_bps=ns.download_mbps * 1e6 / 8 if ns.download_mbps else None)
    if probed is not None:
        result["bandwidth"] = {"upload_bps": ns.upload_mbps * 1e6 / 8 if ns.upload_mbps else probed.upload_bps,
                               "download_bps": ns.download_mbps * 1e6 / 8 if ns.download_mbps else probed.download_bps,
                               "rtt_s": probed.rtt_s, "measured_against": probed.address,
                               "probe_bytes": probed.nbytes}
    print(json.dumps(result, indent=1, default=str) if ns.json else format_profile_table(result))
    return 0


async def _probe(address: str, run_id: str, mb: float):
    """Measure the link to ``address`` with a throwaway identity and a client-only transport."""
    from geomesh_p2p.identity import Identity
    from geomesh_p2p.links import probe_link
    from geomesh_p2p.transport import Transport, TransportConfig

    t = Transport(Identity.generate(), run_id, TransportConfig(client_only=True))
    await t.start()
    try:
        return await probe_link(t, address, nbytes=max(1, int(mb * (1 << 20))), timeout_s=30.0)
    finally:
        await t.stop(grace=0)


def add_subcommands(sub, add_common) -> None:
    join = sub.add_parser("join", help="train with a swarm (via one or more --bootstrap nodes)", description="Join a GeoMesh swarm and train.")
    add_node_flags(join)
    add_run_flags(join)
    add_common(join)
    join.set_defaults(handler=cmd_join)

    from peer import demo

    d = sub.add_parser("demo", help="a whole swarm on this machine (bootstrap + N peers)",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_flags(d)
    add_run_flags(d)
    add_common(d)
    d.set_defaults(handler=demo.cmd_demo)

    prof = sub.add_parser("profile", help="measure this device: memory, tokens/s, link (--probe)",
                          description="Measure this device (memory, tokens/s per batch size) and print it.")
    prof.add_argument("--model", default="tiny", help="model preset to measure (default: %(default)s)")
    prof.add_argument("--seq-len", type=_int_at_least(1), default=64, help="tokens per sequence (default: %(default)s)")
    prof.add_argument("--batch-sizes", type=_batch_list, default=[1, 4, 8, 16],
                      help="comma-separated batch sizes (default: 1,4,8,16)")
    prof.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    prof.add_argument("--speed-factor", type=_speed_factor, default=1.0,
                      help="emulate a slower device: each step takes 1/f as long (default: %(default)s)")
    prof.add_argument("--memory-budget-gb", type=_positive_float, help="memory budget in GB (CPU RAM, or GPU memory on CUDA; default: the memory available)")
    prof.add_argument("--upload-mbps", type=_mbps, help="state the upload bandwidth (Mbit/s)")
    prof.add_argument("--download-mbps", type=_mbps, help="state the download bandwidth (Mbit/s)")
    prof.add_argument("--probe", type=_host_port, metavar="HOST:PORT",
                      help="also measure upload/download bandwidth with real transfers to this bootstrap or peer")
    prof.add_argument("--probe-mb", type=_probe_mb, default=4.0,
                      help="MiB each way per probe transfer, at most 4 (default: %(default)s)")
    prof.add_argument("--run-id", default="geomesh-demo", help="run id the probed node serves (default: %(default)s)")
    prof.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_common(prof)
    prof.set_defaults(handler=cmd_profile)
