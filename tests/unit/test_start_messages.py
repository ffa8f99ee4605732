"""Start-up messages a fresh user meets (issue: review of the README on a fresh clone, findings 5-10, 13):
one line per error naming the command and the flag, gRPC's C core quiet below DEBUG, the model and --resume
checked before anything joins, run-id and TLS hints in the join error. No socket is opened here."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ gRPC's C core (findings 5, 6)
@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["join"], {}, "NONE"),
        (["join", "--log-level", "DEBUG"], {}, None),
        (["join", "--log-level=DEBUG"], {}, None),
        (["join"], {"GRPC_VERBOSITY": "debug"}, "debug"),  # the user's own choice wins
        (["join"], {"GRPC_TRACE": "http"}, None),
    ],
)
def test_quiet_grpc_core_sets_verbosity_unless_debug_or_the_users(monkeypatch, argv, env, expect):
    from geomesh_p2p.util.grpc_env import quiet_grpc_core

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    monkeypatch.delenv("GRPC_TRACE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import os

    assert quiet_grpc_core(argv) is (expect == "NONE")
    assert os.environ.get("GRPC_VERBOSITY") == expect


def test_the_bootstrap_package_quiets_grpc_before_anything_else():
    """The first statements of bootstrap/__init__ call quiet_grpc_core, before its CLI module imports grpc (the C
    core reads GRPC_VERBOSITY once, when grpc is first imported)."""
    import ast
    import importlib
    from pathlib import Path

    tree = ast.parse(Path(importlib.import_module("bootstrap").__file__).read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    assert ast.unparse(body[0]) == "from geomesh_p2p.util.grpc_env import quiet_grpc_core"
    assert ast.unparse(body[1]) == "quiet_grpc_core()"


def test_geomesh_peer_quiets_grpc_first_in_main_and_nothing_before_loads_grpc():
    """``geomesh-peer`` (and ``python -m peer.cli``) calls quiet_grpc_core as the first statement of
    peer.cli.main run as the program (argv None; main([...]) in a test leaves the environment alone), and neither
    importing peer.cli nor building its parser (node_cli, tools_cli) loads grpc before it: a fresh interpreter
    shows it. The ``peer`` package itself runs nothing at import (the test zygote preloads its modules)."""
    import ast
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    import peer
    from peer import cli

    tree = ast.parse(Path(peer.__file__).read_text())
    assert [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))] == []
    [fn] = ast.parse(inspect.getsource(cli.main)).body
    first = fn.body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "argv is None"
    assert [ast.unparse(n) for n in first.body] == ["quiet_grpc_core()"]
    probe = (
        "import sys, peer.cli as c; c.build_parser(); print(sorted(m for m in ('grpc', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, cwd=Path(peer.__file__).parents[1]
    )
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


@pytest.mark.parametrize("module", ["tests.adversary", "geomesh_p2p.dht.__main__"])
def test_library_programs_quiet_grpc_before_any_import_when_run_as_main(module):
    """``python -m tests.adversary`` / ``python -m geomesh_p2p.dht``: the statement after
    ``from __future__`` calls quiet_grpc_core when run as a program, before any import that may load grpc;
    imported as a library module, the environment is left alone."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    assert ast.unparse(body[0]) == "from __future__ import annotations"
    guard = body[1]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"
    assert [ast.unparse(n) for n in guard.body] == [
        "from geomesh_p2p.util.grpc_env import quiet_grpc_core",
        "quiet_grpc_core()",
    ]


# ------------------------------------------------------------------ argparse errors in one line (finding 7)
def _peer_main_error(capsys, *argv) -> tuple[int, list[str]]:
    from peer.cli import main

    with pytest.raises(SystemExit) as ei:
        main(list(argv))
    out, err = capsys.readouterr()
    assert out == ""
    return ei.value.code, err.splitlines()


def test_join_bad_value_is_one_line_naming_join(capsys):
    code, lines = _peer_main_error(capsys, "join", "--rounds", "-1")
    assert code == 2
    assert lines == ["geomesh-peer join: error: argument --rounds: must be >= 1, got -1 (see geomesh-peer join --help)"]


def test_join_bootstrap_without_port_is_one_line(capsys):
    code, lines = _peer_main_error(capsys, "join", "--bootstrap", "127.0.0.1")
    assert code == 2
    assert lines == [
        "geomesh-peer join: error: argument --bootstrap: '127.0.0.1' has no port: expected HOST:PORT "
        "(see geomesh-peer join --help)"
    ]


@pytest.mark.parametrize("command", ["join", "demo", "profile", "status"])
def test_unknown_flag_is_reported_by_the_command(capsys, command):
    needed = ["--bootstrap", "127.0.0.1:1"] if command == "status" else []
    code, lines = _peer_main_error(capsys, command, *needed, "--bogus-flag")
    assert code == 2
    assert lines == [
        f"geomesh-peer {command}: error: unrecognized arguments: --bogus-flag (see geomesh-peer {command} --help)"
    ]


def test_top_level_error_is_one_line(capsys):
    code, lines = _peer_main_error(capsys, "nosuchcommand")
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        "geomesh-peer: error: argument COMMAND: invalid choice: 'nosuchcommand'"
    )
    assert lines[0].endswith("(see geomesh-peer --help)")


# ------------------------------------------------------------------ offline checks at start (findings 8, 10)
def _join_rc(capsys, tmp_path, *argv) -> tuple[int, list[str]]:
    from peer.cli import main

    rc = main(["join", "--identity", str(tmp_path / "id.key"), *argv])
    _, err = capsys.readouterr()
    return rc, [x for x in err.splitlines() if x.startswith("geomesh-peer")]


def test_unknown_model_preset_fails_before_joining(capsys, tmp_path, monkeypatch):
    from geomesh_p2p.model.build import PRESETS
    import geomesh_p2p.node.peer

    def no_node(*a, **k):
        raise AssertionError("the node must not start")

    monkeypatch.setattr(geomesh_p2p.node.peer, "PeerNode", no_node)
    rc, lines = _join_rc(capsys, tmp_path, "--model", "huge")
    assert rc == 2
    assert lines == [f"geomesh-peer join: --model huge: unknown model preset (known: {', '.join(PRESETS)})"]
    assert not (tmp_path / "id.key").exists()  # refused before the identity is created


def test_model_config_without_model_type_fails_at_start(capsys, tmp_path):
    cfg = tmp_path / "m.json"
    cfg.write_text('{"n_layer": 2}')
    rc, lines = _join_rc(capsys, tmp_path, "--model-config", str(cfg))
    assert rc == 2
    assert lines == [
        f'geomesh-peer join: --model-config: model config file {cfg}: missing "model_type" '
        f'(e.g. "gpt2", "llama") or "preset"'
    ]


def test_resume_without_checkpoint_dir_is_refused(capsys, tmp_path):
    rc, lines = _join_rc(capsys, tmp_path, "--resume")
    assert rc == 2
    assert lines == [
        "geomesh-peer join: --resume needs --checkpoint-dir DIR (the folder whose newest checkpoint it continues from)"
    ]


def test_profile_unknown_model_is_one_line(capsys):
    from geomesh_p2p.model.build import PRESETS
    from peer.cli import main

    assert main(["profile", "--model", "huge"]) == 2
    _, err = capsys.readouterr()
    assert err.splitlines() == [
        f"geomesh-peer profile: --model huge: unknown model preset (known: {', '.join(PRESETS)})"
    ]


def test_demo_unknown_model_is_one_line_before_any_process(capsys, tmp_path):
    from geomesh_p2p.model.build import PRESETS
    from peer.cli import main

    assert main(["demo", "--model", "huge", "--workdir", str(tmp_path / "w")]) == 2
    _, err = capsys.readouterr()
    assert err.splitlines() == [f"geomesh-peer demo: --model huge: unknown model preset (known: {', '.join(PRESETS)})"]
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------ exit status convention (finding 6)
def test_a_busy_port_exits_2_like_the_bootstrap():
    from peer.node_cli import start_error_status

    assert (
        start_error_status(OSError("cannot listen on 127.0.0.1:31337: the port is in use or the address is not local"))
        == 2
    )
    assert start_error_status(RuntimeError("could not join the DHT: no bootstrap node answered")) == 1


# ------------------------------------------------------------------ join error wording (findings 5, 9)
def test_other_run_message_names_both_runs_from_this_peers_side():
    from geomesh_p2p.dht.join import other_run_message

    msg = other_run_message("127.0.0.1:31337", "message is for run 'lonely', this node serves 'my-run'", "lonely")
    assert msg == (
        "could not join the DHT: bootstrap 127.0.0.1:31337 serves run 'my-run', not the run 'lonely' asked "
        "for: check --run-id"
    )


def test_tls_hint_on_a_closed_socket():
    from geomesh_p2p.dht.join import _tls_hint

    assert _tls_hint(["UNAVAILABLE: Socket closed"], tls=False) == (
        "; the bootstrap may require TLS: if the swarm uses TLS, pass --tls-cert/--tls-key/--tls-ca"
    )
    assert _tls_hint(["UNAVAILABLE: Ssl handshake failed: SSL_ERROR_SSL"], tls=True) == (
        "; the bootstrap may not use TLS, or its certificate is not signed by --tls-ca"
    )
    assert _tls_hint(["UNAVAILABLE: failed to connect to all addresses; Connection refused"], tls=False) == ""


def test_status_says_it_reached_a_bootstrap_of_another_run(capsys, monkeypatch):
    from geomesh_p2p.dht.join import other_run_message
    from geomesh_p2p.dht.state import OtherRunError
    from peer import tools_cli
    from peer.cli import main

    async def other_run(ns):
        raise OtherRunError(
            other_run_message("127.0.0.1:31337", "message is for run 'lonely', this node serves 'my-run'", "lonely")
        )

    monkeypatch.setattr(tools_cli, "_read_swarm", other_run)
    assert main(["status", "--bootstrap", "127.0.0.1:31337", "--run-id", "lonely"]) == 1
    _, err = capsys.readouterr()
    assert err.splitlines() == [
        "geomesh-peer status: reached the bootstrap, but bootstrap 127.0.0.1:31337 serves run "
        "'my-run', not the run 'lonely' asked for: check --run-id"
    ]


# ------------------------------------------------------------------ help texts (finding 13)
def test_help_texts_match_the_defaults():
    import bootstrap.cli
    from peer import demo

    assert "small model" not in demo.__doc__ and "default: tiny" in demo.__doc__
    assert "geomesh-bootstrap --run-id" in bootstrap.cli.__doc__


# ------------------------------------------------------------------ where the bootstrap writes (fresh-user report)
def test_bootstrap_says_where_it_writes(tmp_path, monkeypatch, caplog):
    """The bootstrap wrote its key and state file under ~/.geomesh without a word: a line at start (stdout, after
    its address and PeerID: tests/e2e/test_bootstrap.py) names the folder, each file and the flag that moves it."""
    import bootstrap.cli as b

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert b.writes_line(b.parse([])) == (
        f"writes under {tmp_path}/home/.geomesh: identity key bootstrap.key (--identity), "
        "state bootstrap.state.json (--state-file; '' = none)"
    )
    key = tmp_path / "k" / "b.key"
    assert b.writes_line(b.parse(["--identity", str(key), "--state-file", str(tmp_path / "s.json")])) == (
        f"writes under {tmp_path}/k, {tmp_path}: identity key {key} (--identity), "
        f"state {tmp_path}/s.json (--state-file; '' = none)"
    )
    assert b.writes_line(b.parse(["--identity", str(key), "--state-file", ""])) == (
        f"writes under {tmp_path}/k: identity key b.key (--identity), no state file (--state-file '')"
    )


# ------------------------------------------------------------------ start-time checks (red team, session 28)
def _no_node(monkeypatch) -> None:
    """The node must not be built: a value refused at parse time never reaches it."""
    import geomesh_p2p.node.peer

    def no_node(*a, **k):
        raise AssertionError("the node must not start")

    monkeypatch.setattr(geomesh_p2p.node.peer, "PeerNode", no_node)


@pytest.mark.parametrize("device", ["tpu:7", "meta", "cuda:x", "mps", "cuda:01", "CUDA"])
def test_join_refuses_at_parse_time_a_device_the_node_cannot_build(capsys, monkeypatch, tmp_path, device):
    """``--device tpu:7`` (or ``meta``) passed the start checks (they looked at values starting with "cuda" only):
    the peer served, joined, loaded its data and then died with two tracebacks of parse_device's ValueError."""
    _no_node(monkeypatch)
    code, lines = _peer_main_error(capsys, "join", "--identity", str(tmp_path / "id.key"), "--device", device)
    assert code == 2
    assert lines == [
        f"geomesh-peer join: error: argument --device: {device!r} is not a device: use auto, cpu, cuda or cuda:N "
        "(see geomesh-peer join --help)"
    ]
    assert not (tmp_path / "id.key").exists()


def test_the_device_flag_takes_only_what_parse_device_takes():
    from geomesh_p2p.config.flags import PARSERS
    from geomesh_p2p.model.device import parse_device

    values = ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:12", "cpu:0", "cuda:00", "cuda:01", "cuda:-1"]
    values += ["cuda:x", "cuda: 1", " cuda", "CUDA", "Cpu", "tpu:7", "meta", "mps", "xla", "hpu:0", "cuda:٣", "cu da"]
    flag_ok = set()
    for v in values:
        try:
            assert PARSERS["device"](v) == v
            flag_ok.add(v)
        except argparse.ArgumentTypeError as e:
            assert str(e) == f"{v!r} is not a device: use auto, cpu, cuda or cuda:N"
    assert flag_ok == {"auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:12"}
    for v in flag_ok:
        parse_device(v)  # every value the flag takes, the node takes (whether the GPU is there: checked at start)


def test_both_clis_refuse_a_run_id_whose_keys_a_node_would_refuse(capsys):
    """A 600-character --run-id was accepted by both CLIs, and the peer then never announced: "announce failed:
    INVALID_ARGUMENT: key of 606 bytes is over the limit of 512"."""
    import bootstrap.cli as b
    from geomesh_p2p.schema.run_id import MAX_RUN_ID_BYTES
    from peer.cli import build_parser, parse

    assert MAX_RUN_ID_BYTES == 346
    ok, long = "r" * 346, "r" * 347
    assert parse(build_parser(), ["join", "--run-id", ok]).run_id == ok
    assert b.parse(["--run-id", ok]).run_id == ok
    why = "is 347 bytes long, over the maximum of 346 bytes (UTF-8): the run's longest DHT key must fit 512 bytes"
    code, lines = _peer_main_error(capsys, "join", "--run-id", long)
    assert (code, lines) == (2, [f"geomesh-peer join: error: argument --run-id: {why} (see geomesh-peer join --help)"])
    with pytest.raises(SystemExit) as ei:
        b.parse(["--run-id", long])
    out, err = capsys.readouterr()
    assert (ei.value.code, out) == (2, "")
    assert err.splitlines() == [f"geomesh-bootstrap: error: argument --run-id: {why} (see --help)"]
    # bytes, not characters: 174 two-byte characters are 348 bytes
    code, lines = _peer_main_error(capsys, "join", "--run-id", "é" * 174)
    assert lines == [
        "geomesh-peer join: error: argument --run-id: is 348 bytes long, over the maximum of 346 bytes (UTF-8): the "
        "run's longest DHT key must fit 512 bytes (see geomesh-peer join --help)"
    ]


@pytest.mark.parametrize(
    "run_id, why",
    [
        ("a/owner:b", "must not contain '/owner:' (it marks the owner of a DHT key)"),
        ("a\udcff", "is not UTF-8 text (character 2 is an undecodable byte)"),  # a byte argv could not decode
    ],
)
def test_both_clis_refuse_a_run_id_that_cannot_be_in_a_key(capsys, run_id, why):
    import bootstrap.cli as b

    code, lines = _peer_main_error(capsys, "join", "--run-id", run_id)
    assert (code, lines) == (2, [f"geomesh-peer join: error: argument --run-id: {why} (see geomesh-peer join --help)"])
    with pytest.raises(SystemExit) as ei:
        b.parse(["--run-id", run_id])
    assert ei.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"geomesh-bootstrap: error: argument --run-id: {why} (see --help)"]


def _bootstrap_main(capsys, monkeypatch, tmp_path, state) -> tuple[int, list[str]]:
    """``geomesh-bootstrap --state-file STATE`` up to the point it would serve: (exit status, stderr lines)."""
    import bootstrap.cli as b

    async def served(*a, **k):
        return 0

    monkeypatch.setattr(b, "serve", served)
    rc = b.main(["--identity", str(tmp_path / "b.key"), "--state-file", str(state), "--port", "0"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, err.splitlines()


def test_bootstrap_refuses_a_state_file_it_did_not_write(capsys, monkeypatch, tmp_path):
    """A --state-file naming binary junk was logged as "ignoring the saved bootstrap state F: 'utf-8' codec can't
    decode..." and then overwritten with the bootstrap's JSON: a mistyped path cost the user that file."""
    junk = tmp_path / "photo.jpg"
    body = b"\xff\xd8\xff\xe0" + bytes(range(256))
    junk.write_bytes(body)
    rc, lines = _bootstrap_main(capsys, monkeypatch, tmp_path, junk)
    assert rc == 2
    assert lines == [
        f"geomesh-bootstrap: --state-file {junk}: is not a bootstrap state file: not UTF-8 text (byte 0); "
        "give another path, or move the file away"
    ]
    assert junk.read_bytes() == body and not (tmp_path / "b.key").exists()  # nothing written, no key created
    other = tmp_path / "config.json"
    other.write_text('{"run_id": "x", "port": 1}')
    rc, lines = _bootstrap_main(capsys, monkeypatch, tmp_path, other)
    assert (rc, lines) == (
        2,
        [
            f"geomesh-bootstrap: --state-file {other}: is not a bootstrap state file: no contacts, progress, "
            "saved_at, version; give another path, or move the file away"
        ],
    )


def test_bootstrap_takes_an_absent_or_an_older_state_file(capsys, monkeypatch, tmp_path):
    """An absent file is created later; one an older release wrote (its progress without config_hash), or one of
    another run, is a state file of this program: taken (and replaced, as before) without a word."""
    from geomesh_p2p.dht.progress import BootstrapState

    assert _bootstrap_main(capsys, monkeypatch, tmp_path, tmp_path / "absent.json") == (0, [])
    older = tmp_path / "older.json"
    older.write_text(
        '{"run_id": "geomesh-demo", "contacts": [], "progress": {"round": 3, "seen_at": 1.0, "peers": 2}, '
        '"saved_at": 5.0, "version": 1}'
    )
    assert _bootstrap_main(capsys, monkeypatch, tmp_path, older) == (0, [])
    state = BootstrapState.load(str(older), "geomesh-demo")
    assert state is not None and state.swarm_progress() is not None and state.swarm_progress().round == 3
    assert BootstrapState.read(str(older)) == BootstrapState("geomesh-demo", [], state.progress, 5.0, 1)
    assert BootstrapState.load(str(older), "another-run") is None


def test_profile_with_a_memory_budget_measures_with_joins_mmap_threshold(monkeypatch, capsys):
    """``profile --memory-budget-gb`` sets the 4 MiB mmap threshold ``join`` sets with that flag (session 42 left
    profile on glibc's own, so the peak it measured was not the one join would see); without the flag, glibc's own."""
    import geomesh_p2p.model.profile
    import geomesh_p2p.node.host

    import peer.node_cli

    set_to = []
    monkeypatch.setattr(peer.node_cli, "set_mmap_threshold", lambda b: set_to.append(b) or True)
    monkeypatch.setattr(geomesh_p2p.node.host, "set_threads", lambda n: None)
    monkeypatch.setattr(geomesh_p2p.model.profile, "profile", lambda **kw: {"budget": kw["memory_budget_bytes"]})
    monkeypatch.setattr(geomesh_p2p.model.profile, "format_profile_table", lambda r: str(r))
    from peer.cli import main

    assert main(["profile", "--model", "tiny"]) == 0 and set_to == []
    assert main(["profile", "--model", "tiny", "--memory-budget-gb", "6"]) == 0 and set_to == [4 * 2**20]
    assert capsys.readouterr().out.splitlines() == ["{'budget': None}", "{'budget': 6442450944}"]


def test_profile_measures_joins_batch_sizes_by_default(monkeypatch, capsys):
    """Fresh-user trial 44: ``profile`` measured 1,4,8,16 and ``join`` 4,8,16 at start; the same by default now."""
    import geomesh_p2p.model.profile
    import geomesh_p2p.node.host
    from geomesh_p2p.config.models import NodeConfig

    monkeypatch.setattr(geomesh_p2p.node.host, "set_threads", lambda n: None)
    monkeypatch.setattr(geomesh_p2p.model.profile, "profile", lambda **kw: {"sizes": kw["batch_sizes"]})
    monkeypatch.setattr(geomesh_p2p.model.profile, "format_profile_table", lambda r: str(r))
    from peer.cli import main

    assert main(["profile", "--model", "tiny"]) == 0 and main(["profile", "--batch-sizes", "2,3"]) == 0
    assert capsys.readouterr().out.splitlines() == ["{'sizes': [4, 8, 16]}", "{'sizes': [2, 3]}"]
    assert NodeConfig().profile_batches == [4, 8, 16]


def test_profile_refuses_a_budget_too_small_in_one_line(monkeypatch, capsys):
    """Fresh-user trial, session 45: ``profile --memory-budget-gb 0.001`` ended in a traceback (``join`` says the
    same in one line), and printed the budget as "0.00 GiB". The real profile, refused before its first step."""
    import geomesh_p2p.node.host

    import peer.node_cli

    monkeypatch.setattr(geomesh_p2p.node.host, "set_threads", lambda n: None)
    monkeypatch.setattr(peer.node_cli, "set_mmap_threshold", lambda b: True)  # this test process's heap left as is
    from peer.cli import main

    assert main(["profile", "--model", "tiny", "--memory-budget-gb", "0.001"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and "Traceback" not in err
    assert err.startswith(
        "geomesh-peer profile: cannot train tiny here: memory budget 0.001 GiB is below what training this model "
        "needs before any activation: "
    )
