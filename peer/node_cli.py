"""``geomesh-peer join | demo | profile``: flags, validation at start, clean Ctrl+C. No protocol logic."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

log = logging.getLogger("geomesh-peer")

from geomesh_p2p.config.models import DEFAULT_POW_BITS, MAX_POW_BITS  # noqa: F401  (re-exported for tests)
from geomesh_p2p.config.flags import (
    PARSERS,
    FlagSpec,
    add_flags,
    flag_specs,
    named_source,
    number_type,
    takes,
    to_argv,
    values_from,
)
from geomesh_p2p.config.models import DEFAULT_IDENTITY, NODE_GROUP, RUN_GROUP, NodeConfig, RunConfig
from geomesh_p2p.net.addr import host_of, is_loopback_host, first_listen_problem
from geomesh_p2p.util.aio import prestart_default_executor
from geomesh_p2p.util.errors import StartInputError, UserFacingError
from geomesh_p2p.util.malloc import LOW_MEMORY_MMAP_MIB, set_mmap_threshold
from geomesh_p2p.model.presets import PRESETS
from peer.path_checks import is_default_key, key_file_problem, writable_dir_problem

# Defaults of --data-column / --data-max-bytes (kept in sync with geomesh_p2p.data.hub, which is
# not imported here so that --help stays fast; tests/unit/test_cli.py checks they are equal).
DEFAULT_HF_COLUMN = "text"
DEFAULT_HF_MAX_BYTES = 50_000_000

# Flag types shared with the other commands (profile, status, the demo); the config models' flags get
# theirs from their fields' ranges (geomesh_p2p.config.flags.flag_specs).
_positive_float = number_type(float, gt=0)
_non_negative_float = number_type(float, ge=0)
_positive_int = number_type(int, ge=1)
_host_port = PARSERS["host_port"]
_batch_list = PARSERS["batch_list"]


def _int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
    return number_type(int, ge=lo, le=hi)


@takes("number")
def _probe_mb(text: str) -> float:
    v = _positive_float(text)
    if not 0.0625 <= v <= 4:
        raise argparse.ArgumentTypeError(f"must be between 0.0625 (64 KiB) and 4 MiB, got {text}")
    return v


#: Flags of the run group that are inputs, not RunConfig fields: run_config_from derives RunConfig.model /
#: model_config_json / data (and NodeConfig.model_config_file / data_path) from them.
INPUT_FLAGS = [
    FlagSpec(
        "--model-config",
        "model_config",
        None,
        {"metavar": "FILE.json", "help": "transformers config JSON instead of a preset"},
    ),
    FlagSpec(
        "--data",
        "data",
        None,
        {
            "metavar": "PATH|hf:NAME[:CONFIG][@SPLIT]",
            "help": ".txt/.txt.xz/.jsonl/.parquet training text, or a Hugging Face dataset streamed from the hub, "
            "e.g. hf:wikitext:wikitext-2-raw-v1@train (default: the shipped KJV corpus)",
        },
    ),
    FlagSpec(
        "--data-column",
        "data_column",
        None,
        {
            "metavar": "NAME",
            "help": f"with --data hf:...: the string column holding the text (default: {DEFAULT_HF_COLUMN})",
        },
    ),
    FlagSpec(
        "--data-max-bytes",
        "data_max_bytes",
        None,
        {
            "type": _positive_int,
            "metavar": "N",
            "help": f"with --data hf:...: take only the first N bytes of text (default: {DEFAULT_HF_MAX_BYTES})",
        },
    ),
]


def run_flag_specs() -> list[FlagSpec]:
    """Every flag of the run group, in --help order: --run-id and --model, the input flags, then the other
    RunConfig fields. The demo renders its peers' run flags from this same list (:func:`run_argv`)."""
    specs = flag_specs(RunConfig)
    return specs[:2] + INPUT_FLAGS + specs[2:]


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the run config (generated from RunConfig's fields): every peer of a run must use the same
    values (they are hashed)."""
    add_flags(p, run_flag_specs(), RUN_GROUP)


def run_argv(ns: argparse.Namespace) -> list[str]:
    """The run flags of ``ns`` as argv (what the demo passes to each peer): the same run config."""
    return to_argv(ns, run_flag_specs())


def add_node_flags(p: argparse.ArgumentParser) -> None:
    """Flags of this node (generated from NodeConfig's fields)."""
    add_flags(p, flag_specs(NodeConfig), NODE_GROUP)


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

    from pydantic import ValidationError

    model_json = None
    if ns.model_config:
        try:
            model_json = Path(ns.model_config).read_text(encoding="utf-8")
            json.loads(model_json)
        except OSError as e:
            raise ValueError(f"cannot read --model-config {ns.model_config}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--model-config {ns.model_config} is not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-config {ns.model_config} is not valid JSON: {e}") from None
    data_id = "kjv"
    spec = data_spec_from(ns)
    if spec is not None and spec.startswith("hf:"):
        data_id = spec  # name, config, split, column, max bytes (and revision): all compared between peers
    elif ns.data:
        p = Path(ns.data).expanduser()  # as the loader reads it (a YAML config may say ~/corpus.txt)
        if not p.exists():
            raise ValueError(f"--data {ns.data}: no such file")
        if not p.is_file():
            raise ValueError(f"--data {ns.data}: not a file")
        if p.stat().st_size == 0:
            raise ValueError(f"--data {ns.data}: the file is empty")
        from geomesh_p2p.data.corpus import DataError, check_data_suffix

        try:
            check_data_suffix(p)
        except DataError as e:
            raise ValueError(f"--data {ns.data}: {e}") from None
        try:
            with p.open("rb") as f:
                head = f.read(1 << 20)
        except OSError as e:
            raise ValueError(f"--data {ns.data}: cannot read: {e.strerror}") from None
        data_id = f"{p.name}:{p.stat().st_size}:{hashlib.sha256(head).hexdigest()[:16]}"
    values = values_from(ns, flag_specs(RunConfig))
    values.update(
        data=data_id,
        model_config_json=model_json,
        min_agreement=ns.min_agreement or None,
        min_support=ns.min_support or None,
        support_z=ns.support_z or None,
    )  # 0 = off
    if model_json:
        values["model"] = hashlib.sha256(model_json.encode()).hexdigest()[:16]
    try:
        return RunConfig(**values)
    except ValidationError as e:
        # A combination of flags refused by the config's own rule (e.g. --eager with --method ddp): its
        # sentence alone, one line, instead of pydantic's three-line report.
        whole = [x for x in e.errors() if not x.get("loc") and x.get("type") == "value_error"]
        if whole:
            raise ValueError(str(whole[0]["msg"]).removeprefix("Value error, ")) from None
        raise


def node_config_from(ns: argparse.Namespace):
    """Build the NodeConfig from the parsed flags (fields read back in their own units: bytes, bytes/s, s);
    reads --allow-peers FILE. Raises ValueError naming a bad value or the allow file's line."""
    values = values_from(ns, flag_specs(NodeConfig))
    values.update(data_path=data_spec_from(ns), model_config_file=ns.model_config, allow_peers=_allow_peers(ns))
    cfg = NodeConfig(**values)
    check_output_files(cfg)
    return cfg


def _check_writable(flag: str, path: str) -> None:
    """``path`` can be created or appended to: its folder exists and is writable, and it is not a folder
    itself. Raises ValueError naming ``flag`` (nothing is created)."""
    import os
    from pathlib import Path

    p = Path(path).expanduser()
    parent = p.parent
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file path")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(p if p.exists() else parent, os.W_OK):
        raise ValueError(f"{flag} {path}: {'file' if p.exists() else 'folder ' + str(parent)} is not writable")


def check_output_files(cfg) -> None:
    """Start-up check of the files a node writes (review L1): ``--log-json`` and its events file
    (:func:`geomesh_p2p.telemetry.events.events_path`), ``--summary-json``. Raises ValueError naming the flag, before
    the node joins anything."""
    from geomesh_p2p.telemetry.events import events_path

    if cfg.log_json:
        _check_writable("--log-json", cfg.log_json)
        _check_writable("--log-json", str(events_path(cfg.log_json)))
    if cfg.summary_json:
        _check_writable("--summary-json", cfg.summary_json)


def _allow_peers(ns: argparse.Namespace):
    """Entries of --allow-peers FILE (None when not given). Raises ValueError naming the file and line."""
    if not getattr(ns, "allow_peers", None):
        return None
    from geomesh_p2p.trust.admission import read_allow_file

    try:
        return read_allow_file(ns.allow_peers)
    except UnicodeDecodeError as e:  # a binary file (review M3)
        raise ValueError(f"--allow-peers {ns.allow_peers} is not UTF-8 text (byte {e.start})") from None


async def _run_node(node, ranks=None) -> int:
    """``node.run()`` with Ctrl+C / SIGTERM asking it to stop; with ``ranks`` (a multi-rank peer's
    :class:`~geomesh_p2p.node.ranks.LocalRanks`) a failure of the ranks stops it too."""
    loop = asyncio.get_running_loop()
    prestart_default_executor(loop)  # no worker thread started from the loop mid-round (a 51 ms stall, issue 27)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.request_stop)
    watch = None
    if ranks is not None:
        ranks.attach(node, loop)
        watch = asyncio.ensure_future(ranks.watch())
    try:
        return await node.run()
    finally:
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def join_inputs(ns: argparse.Namespace, prog: str):
    """``(RunConfig, NodeConfig, Identity)`` from the parsed ``join`` flags (the identity loaded from, or
    created at, ``--identity``); shared by ``geomesh-peer join`` and ``tests.adversary join``. On an
    invalid value or an unusable key file it prints ``"<prog>: <reason>"`` to stderr and returns None
    (the caller exits 2)."""
    from geomesh_p2p.net.identity import Identity, IdentityError

    try:
        run = run_config_from(ns)  # first: its messages for a missing or non-JSON file name the flag and path
        check_offline(ns)
        cfg = node_config_from(ns)
        check_memory(run, cfg)
        return run, cfg, Identity.load_or_create(ns.identity)
    except (ValueError, IdentityError, UserFacingError) as e:
        print(f"{prog}: {named_source(ns, e)}", file=sys.stderr)
        return None


def check_memory(run, cfg) -> None:
    """``--memory-budget-gb`` against the whole run's static memory, at start (before the proof of work and
    the DHT join): the parameters counted on torch's meta device (no weights), the estimate of
    :func:`geomesh_p2p.node.training.check_memory_budget` on the device ``--device`` picks. Nothing without
    a budget, and nothing for a multi-rank peer (``--local-devices``, torchrun), whose node checks one rank's share
    of the budget, whole copy or sharded (:func:`geomesh_p2p.node.training.choose_rank_training`), in one line too.
    Raises UserFacingError (one line naming ``--memory-budget-gb``) when the budget cannot hold it."""
    if cfg.memory_budget_bytes is None:
        return
    # Red team 45: the whole run checked against one rank's device refused budgets the node trains in sharded (two
    # GPUs that each hold a shard, not a whole copy), and CPU ranks' refusals came from here, with this process's
    # RSS and not the node's per-rank bytes (its message said neither "sharded" nor what a rank needs)
    if cfg.local_devices or cfg.shard or "WORLD_SIZE" in os.environ:  # as rank_layout asks
        from geomesh_p2p.node.ranks import layout_from

        layout = layout_from(cfg)
        if layout is not None and layout.world >= 2:
            return
    import torch

    from geomesh_p2p.model.build import count_params
    from geomesh_p2p.model.profile import memory_in_use
    from geomesh_p2p.node.training import check_memory_budget

    model = None if cfg.model_config_file else run.model
    n = count_params(model, cfg.model_config_file, vocab_size=run.vocab_size)
    auto = cfg.device == "auto"
    cuda = cfg.device.startswith("cuda") or (auto and torch.cuda.is_available())
    # on a CPU the budget bounds this process's RSS, Python and torch included (what the profile counts as in use);
    # where it cannot be read (no /proc) the estimate alone, and the profile says why in one line (red team 45: a
    # traceback here)
    try:
        in_use = 0 if cuda else memory_in_use("cpu")
    except OSError:
        in_use = 0
    check_memory_budget(run, cfg, n, "cuda" if cuda else "cpu", in_use)


def check_model(ns: argparse.Namespace) -> None:
    """The model ``--model`` / ``--model-config`` name, checked offline before anything joins or loads (a
    wrong preset used to surface after the proof of work, the DHT join and the data load, or as a config
    mismatch with a live swarm). Builds the ``transformers`` config only, no weights (imports torch, which
    the node needs anyway). Raises ValueError naming the flag: unknown preset, model-config file missing,
    not JSON, or rejected by the model class."""
    if not ns.model_config and ns.model not in PRESETS:  # before torch's import (seconds on a loaded machine)
        raise ValueError(f"--model {ns.model}: unknown model preset (known: {', '.join(PRESETS)})")
    from geomesh_p2p.model.build import ConfigError, model_config

    try:
        model_config(ns.model, ns.model_config or None)
    except ConfigError as e:
        raise ValueError(f"--model-config: {e}" if ns.model_config else f"--model: {e}") from None


def check_offline(ns: argparse.Namespace) -> None:
    """Every value of ``join`` that can be checked without the network, at start (before the proof of work
    and the DHT join): the model (:func:`check_model`) and ``--resume``, which needs ``--checkpoint-dir``
    (it used to be ignored without one: the peer started at round 0 silently). The data file and
    ``--model-config``'s JSON are checked by :func:`run_config_from`. Raises ValueError naming the flag."""
    check_resume_flags(ns)
    check_model(ns)


def check_resume_flags(ns: argparse.Namespace) -> None:
    """``--resume`` and ``--on-empty-swarm resume`` need ``--checkpoint-dir``. Raises ValueError naming them."""
    if getattr(ns, "resume", False) and not getattr(ns, "checkpoint_dir", None):
        raise ValueError("--resume needs --checkpoint-dir DIR (the folder whose newest checkpoint it continues from)")
    if getattr(ns, "on_empty_swarm", None) == "resume" and not getattr(ns, "checkpoint_dir", None):
        raise ValueError(
            "--on-empty-swarm resume needs --checkpoint-dir DIR (the folder whose newest checkpoint it continues from)"
        )


def check_fast(ns: argparse.Namespace) -> None:
    """The ``join`` values checked before torch's import (seconds, up to 30 on a loaded box: a new user's bad
    ``--group-size`` or ``--model`` was refused only after 25-35 s): the run config's fields and combinations, the
    node config, ``--resume`` / ``--on-empty-swarm resume`` without a folder, the preset's name, the ports
    (:func:`check_ports`). Raises ValueError
    or UserFacingError naming the flag; :func:`join_inputs` checks them all again, with the rest."""
    run_config_from(ns)
    node_config_from(ns)
    check_resume_flags(ns)
    if not ns.model_config and ns.model not in PRESETS:
        check_model(ns)  # its message, before torch
    check_path_flags(ns)
    check_ports(ns)


def check_path_flags(ns: argparse.Namespace) -> None:
    """``--checkpoint-dir`` (made if absent and written into: tried, then undone), ``--identity`` (a key file, or one
    that can be made) and the ``--tls-*`` files, before torch's import: ``--checkpoint-dir /proc/nope`` failed after
    torch with exit 1 (fresh user 49). ``--data``, ``--model-config``, ``--allow-peers``, ``--log-json`` and
    ``--summary-json`` are checked by :func:`run_config_from` and :func:`node_config_from`. Raises ValueError naming
    the flag (exit 2)."""
    from geomesh_p2p.net.tls import tls_from_flags

    d = getattr(ns, "checkpoint_dir", None)
    # a typed path makes no chain of folders (fresh user 50): --checkpoint-dir only its last, --identity none
    problem = (writable_dir_problem("--checkpoint-dir", d, parents=False) if d else None) or key_file_problem(
        "--identity", ns.identity, make_folder=is_default_key(ns.identity, DEFAULT_IDENTITY)
    )
    if problem is not None:
        raise ValueError(problem)
    tls_from_flags(getattr(ns, "tls_cert", None), getattr(ns, "tls_key", None), getattr(ns, "tls_ca", None))


def check_ports(ns: argparse.Namespace) -> None:
    """``--port`` (unless ``--client-only``) and ``--metrics-port`` can be listened on, checked by binding them
    at start (:func:`~geomesh_p2p.net.addr.listen_problem`): a busy port was reported after torch's import and
    the proof of work (~30 s). The node checks ``--port`` again before its proof of work. Raises ValueError
    naming the flag."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return  # a torchrun follower rank: rank 0 listens on these ports (and may be doing so already)
    checks = [] if getattr(ns, "client_only", False) else [(ns.host, ns.port, "--port", "--host")]
    checks.append(
        (getattr(ns, "metrics_host", ""), getattr(ns, "metrics_port", None), "--metrics-port", "--metrics-host")
    )
    problem = first_listen_problem(checks)
    if problem is not None:
        raise ValueError(problem)


def ping_bootstraps_first(ns: argparse.Namespace) -> bool:
    """Each ``--bootstrap`` pinged before torch's import (:func:`~geomesh_p2p.dht.preflight.check_bootstraps`, 5 s
    deadline): a wrong ``--run-id`` or an address nobody answers at was named only after torch, the model and the
    proof of work (~60 s on a loaded 2-core box, session 35). Signed with ``--identity``'s key when the file exists
    (a private run's bootstrap may admit only it), else a throwaway one: a ping needs no proof of work. Addresses
    that each refuse the connection (nothing listens there) are pinged again, ``--join-attempts`` times within
    :data:`~geomesh_p2p.dht.preflight.REFUSED_WINDOW_S` (15 s), a line per retry. When none answered, one WARNING
    line (the node's, word for word). Returns whether it pinged (the node then does not again:
    :func:`geomesh_p2p.node.joining.check_before_proof_of_work`).

    Raises:
        NothingListensError: nothing listened at any ``--bootstrap`` address during those tries, naming them.
        OtherRunError: a bootstrap serves another run (and every other failure is final), naming ``--run-id``.
        BootstrapAddressError: every address failed for good (a name that does not resolve, no gRPC server there):
            a UserFacingError, exit 2 at once, before torch and the proof of work.
        ValueError: ``--identity`` cannot be loaded; TlsError (a ValueError): a ``--tls-*`` file, named.
    """
    if os.environ.get("RANK", "0") not in ("", "0") or not ns.bootstrap:
        return False  # a torchrun follower rank does not join (rank 0 does), nor a peer that starts a swarm
    from pathlib import Path

    from geomesh_p2p.dht.preflight import check_bootstraps, own_address

    own = own_address(ns.host, getattr(ns, "advertise_host", None), ns.port, getattr(ns, "client_only", False))
    if all(a == own for a in ns.bootstrap):
        return False  # only this peer itself: nothing to ping (the join leaves it out and starts a new swarm)
    from geomesh_p2p.net.identity import Identity, IdentityError
    from geomesh_p2p.net.tls import tls_from_flags

    tls = tls_from_flags(getattr(ns, "tls_cert", None), getattr(ns, "tls_key", None), getattr(ns, "tls_ca", None))
    try:
        # loaded only: a key this start would create is created by join_inputs (and removed if the start fails)
        identity = Identity.load_or_create(ns.identity) if Path(ns.identity).expanduser().exists() else None
    except IdentityError as e:
        raise ValueError(str(e)) from None
    attempts = getattr(ns, "join_attempts", 1)
    line = asyncio.run(
        check_bootstraps(identity or Identity.generate(), ns.run_id, ns.bootstrap, tls, attempts=attempts, own=own)
    )
    if line is not None:
        logging.getLogger("geomesh_p2p.node.peer").warning(line)  # the node's logger: the line it logged before
    return True


def cmd_join(ns: argparse.Namespace) -> int:
    from geomesh_p2p.dht.preflight import DHTJoinError

    try:
        check_fast(ns)
        pinged = ping_bootstraps_first(ns)
    except (ValueError, UserFacingError) as e:
        print(f"geomesh-peer join: {named_source(ns, e)}", file=sys.stderr)
        return 2
    except DHTJoinError as e:  # another run, nothing listening: exit 1, as when the node raised it (start_error_status)
        print(f"geomesh-peer join: {e}", file=sys.stderr)
        return 1
    # torch's import and the model take 10-30 s on a CPU box, the proof of work as long again or more (a fresh-user
    # trial, session 44: 29 s, then 34-67 s at load ~8): say so before the long silence
    log.info(
        "geomesh-peer join: starting (torch and the model: 10-30 s on a CPU; then a new identity's proof of work: "
        "seconds to a minute or more on a busy machine)"
    )
    from geomesh_p2p.node.host import set_threads
    from geomesh_p2p.node.peer import PeerNode
    from geomesh_p2p.node.checkpoints import remove_empty_folders
    from geomesh_p2p.trust.admission import discard_new_identity

    set_threads(getattr(ns, "threads", None))  # --threads, else the host's cores shared by its peers (issue 27)
    _mmap_threshold(ns)

    if not ns.bootstrap:
        # said plainly: a volunteer who forgot the flag trained alone, told only "starting a new swarm" (session 34);
        # a WARNING since fresh user 50 (an INFO line among the start-up lines went unread)
        log.warning(
            "no --bootstrap given: this peer starts a NEW swarm of its own for run %r (others join it through this "
            "peer's address); to join an existing swarm instead, stop (Ctrl+C) and pass --bootstrap HOST:PORT, the "
            "address of that swarm's bootstrap",
            getattr(ns, "run_id", None) or "?",
        )
    warning = reachability_warning(ns)
    if warning:
        log.warning(warning)
    trust = trust_warning(ns)
    if trust:
        log.warning(trust)
    layout = rank_layout(ns, "geomesh-peer join")  # several local devices as one peer (issue 30)
    if layout is False:
        return 2
    if layout is not None and layout.rank > 0:  # a torchrun follower: no identity, no swarm, rank 0's commands
        return follow_rank_0(ns, layout)
    inputs = join_inputs(ns, "geomesh-peer join")
    if inputs is None:
        return 2
    ranks, node = None, None
    try:
        node = PeerNode(*inputs)
        node.bootstraps_pinged = pinged  # pinged above, before torch: not again before the proof of work
        if layout is not None:
            from geomesh_p2p.node.ranks import LocalRanks

            ranks = LocalRanks.start(node.run_cfg, node.cfg, layout)
        status = asyncio.run(_run_node(node, ranks))
        # A peer whose ranks failed left cleanly, but did not end as asked: a supervisor should restart it.
        return 1 if ranks is not None and ranks.channel.broken is not None and status == 0 else status
    except Exception as e:  # known start-up failures are reported in one line, not a traceback
        if isinstance(e, user_facing_errors()):
            print(f"geomesh-peer join: {e}", file=sys.stderr)
            return start_error_status(e)
        raise
    finally:
        if ranks is not None:
            ranks.close()
        # a key file this start created goes with a failed start (kept once the node served: PeerNode.run)
        discard_new_identity(inputs[2])
        if node is not None:  # folders it made and left empty (a refused start: fresh user, session 37)
            remove_empty_folders(getattr(node, "made_dirs", []))


def rank_layout(ns: argparse.Namespace, prog: str):
    """This process's place among a multi-rank peer's ranks (``--local-devices``, torchrun's environment):
    a :class:`~geomesh_p2p.node.ranks.RankLayout`, None for a one-device peer, or False after printing
    ``"<prog>: <reason>"`` (a bad flag combination, named; the caller exits 2)."""
    from geomesh_p2p.node.ranks import layout_from

    if not getattr(ns, "local_devices", None) and not getattr(ns, "shard", False) and "WORLD_SIZE" not in os.environ:
        return None  # a one-device peer: its start is as before (its flags are checked by join_inputs)
    try:
        return layout_from(node_config_from(ns))
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False


def follow_rank_0(ns: argparse.Namespace, layout) -> int:
    """A follower rank started by torchrun: builds its run config from the same flags as rank 0 and follows
    rank 0's commands (:func:`geomesh_p2p.node.ranks.run_follower`). Returns its exit status."""
    from geomesh_p2p.node.ranks import follower_spec_from_flags, run_follower

    try:
        run, cfg = run_config_from(ns), node_config_from(ns)
    except ValueError as e:
        print(f"geomesh-peer join (rank {layout.rank}): {e}", file=sys.stderr)
        return 2
    return run_follower(follower_spec_from_flags(run, cfg, layout))


def start_error_status(e: BaseException) -> int:
    """The exit status of a failed start: 2 for bad start-up input (a flag's value, a file, a port that
    cannot be listened on: what argparse and ``geomesh-bootstrap`` also exit 2 for), 1 for a failure of
    the run itself (no bootstrap answered, the swarm runs another config)."""
    return 2 if isinstance(e, StartInputError) or "cannot listen on" in str(e) else 1


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
    advice = (
        # --eager refuses relay mode for the sign methods (docs/eager.md): the defaults are not an option there
        ". --eager needs --mode reencode: use it only when every peer is trusted (docs/security.md, docs/eager.md)"
        if getattr(ns, "eager", False)
        else ". Use the defaults (--mode auto --aggregation meanmed) unless every peer is trusted (docs/security.md)"
    )
    return "open run (no --allow-peers): " + "; ".join(trusting) + advice


def _is_loopback(host: str) -> bool:
    return is_loopback_host(host)


def reachability_warning(ns: argparse.Namespace):
    """A warning when this peer would serve on a loopback address while its bootstrap is elsewhere:
    peers on other machines could not reach the parts it owns. None when all is well."""
    if ns.client_only:
        return None
    own = ns.advertise_host or ns.host
    remote = [b for b in ns.bootstrap if not _is_loopback(host_of(b))]
    if _is_loopback(own) and remote:
        return (
            f"this peer listens on {ns.host} and tells others to dial {own}, but its bootstrap {remote[0]} is on "
            f"another machine: nobody there can reach it. Pass --host 0.0.0.0 --advertise-host YOUR_PUBLIC_IP "
            f"(and open --port), or --client-only behind NAT"
        )
    return None


def user_facing_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is enough for the user (bad data path, bad model config, no bootstrap...)."""
    from geomesh_p2p.data import DataError
    from geomesh_p2p.net.identity import IdentityError
    from geomesh_p2p.model.state import StateError
    from geomesh_p2p.sync.download import StateSyncError
    from geomesh_p2p.model.build import ConfigError

    errs = [UserFacingError, DataError, IdentityError, StateError, StateSyncError, ConfigError, OSError]
    from geomesh_p2p.dht import DHTJoinError, IncompatibleSwarmError

    errs += [DHTJoinError, IncompatibleSwarmError]
    return tuple(errs)


def cmd_profile(ns: argparse.Namespace) -> int:
    from geomesh_p2p.model.profile import format_profile_table, profile

    try:  # before the probe and the measurements (profile has no --model-config)
        check_model(argparse.Namespace(model=ns.model, model_config=None))
    except ValueError as e:
        print(f"geomesh-peer profile: {e}", file=sys.stderr)
        return 2
    from geomesh_p2p.node.host import set_threads

    # the threads join would use (--threads, else the host's cores shared by its peers): torch's default of every
    # core measured 13-30x fewer tokens/s than join then trained at on a loaded 2-core host (fresh-user trial,
    # session 31: 115 against 3,661 tokens/s at batch 1)
    set_threads(getattr(ns, "threads", None))
    _mmap_threshold(ns)  # the heap join would run with (4 MiB with --memory-budget-gb): the peak it measures is join's
    probed = None
    if ns.probe:  # first: a wrong --run-id or a dead address fails before the device is measured
        try:
            probed = asyncio.run(_probe(ns.probe, ns.run_id, ns.probe_mb))
        except Exception as e:  # unreachable / refusing node: say so in one line
            print(f"geomesh-peer profile: link probe of {ns.probe} failed: {e}", file=sys.stderr)
            return 1
    try:
        result = profile(
            preset=ns.model,
            seq_len=ns.seq_len,
            batch_sizes=ns.batch_sizes,
            device=ns.device,
            speed_factor=ns.speed_factor,
            memory_budget_bytes=int(ns.memory_budget_gb * 2**30) if ns.memory_budget_gb else None,
            upload_bps=ns.upload_mbps * 1e6 / 8 if ns.upload_mbps else None,
            download_bps=ns.download_mbps * 1e6 / 8 if ns.download_mbps else None,
        )
    except ValueError as e:  # the budget cannot hold this model: one line, as join says it (fresh user, session 45)
        print(f"geomesh-peer profile: cannot train {ns.model} here: {e}", file=sys.stderr)
        return 1
    if probed is not None:
        result["bandwidth"] = {
            "upload_bps": ns.upload_mbps * 1e6 / 8 if ns.upload_mbps else probed.upload_bps,
            "download_bps": ns.download_mbps * 1e6 / 8 if ns.download_mbps else probed.download_bps,
            "rtt_s": probed.rtt_s,
            "measured_against": probed.address,
            "probe_bytes": probed.nbytes,
        }
    print(json.dumps(result, indent=1, default=str) if ns.json else format_profile_table(result))
    return 0


def _mmap_threshold(ns) -> None:
    """``--mmap-threshold-mib`` (else 4 MiB with ``--memory-budget-gb``, else glibc's own): one INFO line when set
    (:func:`geomesh_p2p.util.malloc.set_mmap_threshold`; issue 27, session 42)."""
    mib = getattr(ns, "mmap_threshold_mib", None)
    if mib is None:
        mib = LOW_MEMORY_MMAP_MIB if getattr(ns, "memory_budget_gb", None) else 0.0
    if mib > 0 and set_mmap_threshold(max(1, int(mib * 2**20))):
        log.info("malloc: blocks of %g MiB or more are mapped and handed back when freed (--mmap-threshold-mib)", mib)


async def _probe(address: str, run_id: str, mb: float):
    """Measure the link to ``address`` with a throwaway identity and a client-only transport."""
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.net.links import probe_link
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    t = Transport(Identity.generate(), run_id, TransportConfig(client_only=True))
    await t.start()
    try:
        return await probe_link(t, address, nbytes=max(1, int(mb * (1 << 20))), timeout_s=30.0)
    finally:
        await t.stop(grace=0)


def add_subcommands(sub, add_common) -> None:
    join = sub.add_parser(
        "join",
        help="train with a swarm (via one or more --bootstrap nodes)",
        description="Join a GeoMesh swarm and train.",
    )
    add_node_flags(join)
    add_run_flags(join)
    add_common(join)
    join.set_defaults(handler=cmd_join)

    from peer import demo

    d = sub.add_parser(
        "demo",
        help="a whole swarm on this machine (bootstrap + N peers)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_flags(d)
    add_run_flags(d)
    add_common(d)
    d.set_defaults(handler=demo.cmd_demo)

    prof = sub.add_parser(
        "profile",
        help="measure this device: memory, tokens/s, link (--probe)",
        description="Measure this device (memory, tokens/s per batch size) and print it.",
    )
    # The flags it shares with join, from the same fields (defaults and checks written once).
    add_flags(prof, flag_specs(RunConfig, only=("model", "seq_len")))
    # join's own start-up sizes, so profile shows what join measures (fresh-user trial 44: 1,4,8,16 here, 4,8,16 there)
    join_sizes = NodeConfig.model_fields["profile_batches"].get_default(call_default_factory=True)
    prof.add_argument(
        "--batch-sizes",
        type=_batch_list,
        default=join_sizes,
        help=f"comma-separated batch sizes (default: {','.join(map(str, join_sizes))}, what join measures at start)",
    )
    add_flags(
        prof,
        flag_specs(
            NodeConfig, only=("device", "speed_factor", "memory_budget_bytes", "upload_bps", "download_bps", "threads")
        ),
    )
    prof.add_argument(
        "--probe",
        type=_host_port,
        metavar="HOST:PORT",
        help="also measure upload/download bandwidth with real transfers to this bootstrap or peer",
    )
    prof.add_argument(
        "--probe-mb",
        type=_probe_mb,
        default=4.0,
        help="MiB each way per probe transfer, at most 4 (default: %(default)s)",
    )
    add_flags(prof, flag_specs(RunConfig, only=("run_id",)))
    prof.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_common(prof)
    prof.set_defaults(handler=cmd_profile)
