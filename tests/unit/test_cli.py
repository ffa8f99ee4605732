"""The CLIs: --version, identity, config files, bad flags fail with one line."""

from __future__ import annotations

import os

import pytest

from geomesh_p2p import __version__
from peer.cli import main

pytestmark = pytest.mark.timeout(60)


def test_version(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"geomesh-peer {__version__}"


def test_identity_creates_then_shows_same_peer_id(tmp_path, capsys):
    key = tmp_path / "id.key"
    assert main(["identity", "--identity", str(key)]) == 0
    first = capsys.readouterr().out
    assert main(["identity", "--identity", str(key)]) == 0
    again = capsys.readouterr().out
    assert first.replace(f"{key} (created now)", f"{key} (loaded)") == again != first  # the same PeerID, now loaded
    assert first.startswith("PeerID: ") and oct(key.stat().st_mode)[-3:] == "600"


def test_identity_bad_key_is_one_line(tmp_path, capsys):
    key = tmp_path / "id.key"
    key.write_bytes(b"garbage")
    os.chmod(key, 0o600)
    assert main(["identity", "--identity", str(key)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "corrupt" in err and str(key) in err


def test_identity_from_config_file(tmp_path, capsys):
    key = tmp_path / "k.key"
    cfg = tmp_path / "peer.yaml"
    cfg.write_text(f"identity: {key}\n")
    assert main(["identity", "--config", str(cfg)]) == 0
    assert key.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-option: 1\n")
    assert main(["identity", "--config", str(bad)]) == 2
    assert "unknown option 'no-such-option'" in capsys.readouterr().err


def test_config_file_repeatable_flag_given_once(tmp_path):
    import argparse

    from peer.config import load_config_defaults

    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", action="append", default=[])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bootstrap: 127.0.0.1:31337\n")
    assert load_config_defaults(ap, str(cfg)) == {"bootstrap": ["127.0.0.1:31337"]}
    cfg.write_text("bootstrap: [a:1, b:2]\n")
    assert load_config_defaults(ap, str(cfg)) == {"bootstrap": ["a:1", "b:2"]}


def test_config_file_values_get_the_flags_checks(tmp_path):
    """A value from --config goes through the flag's own type and choices (found by an adversarial
    review: `threads: -3` gave a traceback in the node, `port: 70000` listened on 4464)."""
    import argparse

    import pytest

    from peer.config import ConfigFileError, load_config_defaults
    from peer.node_cli import add_node_flags, add_run_flags

    ap = argparse.ArgumentParser()
    add_run_flags(ap)
    add_node_flags(ap)
    cfg = tmp_path / "c.yaml"
    for text, expect in [
        ("threads: -3", "threads: must be in [1, 1024], got -3"),
        ("port: 70000", "port: must be in [0, 65535]"),
        ("rounds: -5", "rounds:"),
        ("quorum: 1.5", "quorum: must be in [0, 1], got 1.5"),
        ("aggregation: median", "aggregation: 'median' is not one of"),
        ("client_only: 3", "client_only: expected true or false"),
        # a broken file names where it broke (line and column, 1-based)
        (
            "threads: 2\nbootstrap: [a, b",
            "does not parse: expected ',' or ']', but got '<stream end>' .line 3, column 1.",
        ),
    ]:
        cfg.write_text(text + "\n")
        with pytest.raises(ConfigFileError, match=expect.replace("[", r"\[").replace("]", r"\]")):
            load_config_defaults(ap, str(cfg))
    cfg.write_text("threads: 2\nprofile_batches: [4, 8]\nquorum: 0.75\nclient_only: true\n")
    assert load_config_defaults(ap, str(cfg)) == {
        "threads": 2,
        "profile_batches": [4, 8],
        "quorum": 0.75,
        "client_only": True,
    }


def test_help_lists_each_command_once_with_one_line(monkeypatch):
    from peer.cli import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    text = build_parser().format_help()
    expected = {
        "identity": "create or show this node's key and print its PeerID",
        "join": "train with a swarm (via one or more --bootstrap nodes)",
        "demo": "a whole swarm on this machine (bootstrap + N peers)",
        "profile": "measure this device: memory, tokens/s, link (--probe)",
        "status": "a swarm's peers, round, leader and digests (from its DHT)",
        "checkpoints": "list a checkpoint directory: rounds, digests, sizes, config",
        "export": "write a checkpoint as a Hugging Face (transformers) folder",
        "generate": "continue a prompt with a checkpoint's model",
    }
    lines = text.splitlines()
    width = max(map(len, expected))
    for name, help_text in expected.items():
        hits = [l for l in lines if l.split()[:1] == [name]]
        assert hits == [f"    {name:<{width}}  {help_text}"], text
    assert "Subcommands:" not in text


def _join_ns(*args):
    from peer.cli import build_parser

    return build_parser().parse_args(["join", *args])


def test_hf_data_spec_goes_into_run_config():
    from peer import node_cli
    from geomesh_p2p.data import hub

    assert (node_cli.DEFAULT_HF_COLUMN, node_cli.DEFAULT_HF_MAX_BYTES) == (
        hub.DEFAULT_HF_COLUMN,
        hub.DEFAULT_HF_MAX_BYTES,
    )
    ns = _join_ns("--data", "hf:wikitext:wikitext-2-raw-v1", "--data-max-bytes", "1000")
    canonical = "hf:wikitext:wikitext-2-raw-v1@train?column=text&max_bytes=1000"
    run = node_cli.run_config_from(ns)
    assert run.data == canonical
    assert node_cli.node_config_from(ns).data_path == canonical  # what the node loads
    other = node_cli.run_config_from(
        _join_ns("--data", "hf:wikitext:wikitext-2-raw-v1", "--data-max-bytes", "1000", "--data-column", "body")
    )
    assert other.data == "hf:wikitext:wikitext-2-raw-v1@train?column=body&max_bytes=1000"
    assert run.config_hash() != other.config_hash()
    assert run.diff(other) == [f"data: {canonical!r} vs {other.data!r}"]
    # the defaults, spelled out or not, give the same identifier
    a = node_cli.run_config_from(_join_ns("--data", "hf:wikitext"))
    b = node_cli.run_config_from(
        _join_ns("--data", "hf:wikitext@train", "--data-column", "text", "--data-max-bytes", "50000000")
    )
    assert a.data == b.data == "hf:wikitext@train?column=text&max_bytes=50000000"
    assert node_cli.node_config_from(_join_ns()).data_path is None


def test_join_bad_data_flags_fail_in_one_line(tmp_path, capsys):
    key = str(tmp_path / "id.key")
    assert main(["join", "--identity", key, "--data", "hf:wikitext?max_bytes=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "geomesh-peer join: bad data spec 'hf:wikitext?max_bytes=0': max_bytes must be >= 1, got 0"
    (tmp_path / "t.txt").write_text("text")
    assert main(["join", "--identity", key, "--data", str(tmp_path / "t.txt"), "--data-column", "body"]) == 2
    assert capsys.readouterr().err.strip() == (
        "geomesh-peer join: --data-column and --data-max-bytes apply only to --data hf:NAME[:CONFIG][@SPLIT]"
    )
    # a file with no reader is refused at start (it used to fail after the proof of work, the DHT join and
    # the port bind); the identity file is not even created
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    key2 = tmp_path / "id2.key"
    assert main(["join", "--identity", str(key2), "--data", str(tmp_path / "x.csv")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"geomesh-peer join: --data {tmp_path / 'x.csv'}: unsupported data file type: {tmp_path / 'x.csv'} "
        '(use .txt, .txt.xz, .jsonl with field "text", or .parquet)'
    )
    assert not key2.exists()
    # an empty file or a folder: at start too, saying which (fresh-user trial: an empty file failed only after
    # the proof of work and the DHT join; a folder was "no such file")
    (tmp_path / "empty.txt").write_text("")
    assert main(["join", "--identity", str(key2), "--data", str(tmp_path / "empty.txt")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--data {tmp_path / 'empty.txt'}: the file is empty")
    assert main(["join", "--identity", str(key2), "--data", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--data {tmp_path}: not a file")
    assert not key2.exists()
    with pytest.raises(SystemExit) as ei:
        main(["join", "--data", "hf:wikitext", "--data-max-bytes", "0"])
    assert ei.value.code == 2
    assert "--data-max-bytes: must be >= 1, got 0" in capsys.readouterr().err
    assert not os.path.exists(key)  # refused before creating anything


def test_a_demo_rerun_starts_clean_but_keeps_keys(tmp_path, capsys):
    """A second `make demo` in the same folder hung: the bootstrap's remembered swarm (its state file)
    made the new peers wait for the old run's peers. Everything a run wrote goes; keys stay."""
    from peer.demo import _clean_workdir

    kept = ["peer0.key", "peer0.key.pow", "bootstrap.key"]
    gone = ["bootstrap.state.json", "peer0.jsonl", "peer0.events.jsonl", "peer0.summary.json", "peer0.log"]
    for name in kept + gone:
        (tmp_path / name).write_text("x")
    (tmp_path / "ckpt0").mkdir()
    (tmp_path / "ckpt0" / "ckpt-00000004.json").write_text("{}")
    _clean_workdir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    # said, not silent (a fresh user lost an earlier run's logs without a word)
    assert "cleared an earlier demo's 5 log/state files and 1 checkpoint folders" in capsys.readouterr().out
    _clean_workdir(tmp_path)  # nothing left to clear: nothing said
    assert capsys.readouterr().out == ""


def test_a_data_path_under_home_is_read_as_the_loader_reads_it(tmp_path, monkeypatch):
    """``--data ~/t.txt`` (e.g. from a YAML config, where no shell expands ``~``) is fingerprinted from the
    file the loader opens; it used to fail at start with "no such file"."""
    from peer import node_cli

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.txt").write_text("some text")
    run = node_cli.run_config_from(_join_ns("--data", "~/t.txt"))
    assert run.data.startswith("t.txt:9:")


def test_an_abbreviated_or_mistyped_flag_is_refused_with_the_flag_it_is_close_to(capsys):
    """Fresh-user trial: ``--thread 1`` was taken as ``--threads 1`` (argparse's prefix matching) and a peer
    trained 10 minutes on a typo. Now it fails at start, in one line, naming the flag it is close to; the
    bootstrap's parser does the same."""
    from bootstrap.cli import parse as boot_parse

    for argv in (["join", "--thread", "1"], ["join", "--bootstrap=127.0.0.1:1", "--thread=1"]):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "unrecognized arguments" in err and "did you mean --threads?" in err, err
    with pytest.raises(SystemExit) as ei:
        boot_parse(["--pow-bit", "3"])
    assert ei.value.code == 2 and "did you mean --pow-bits?" in capsys.readouterr().err


def test_group_size_auto_is_the_default_and_a_number_needs_a_re_encoding_mode(capsys):
    """``--group-size auto`` (issue 26: the group size chosen per round, exchange.groups.auto_group_size) is None in
    the run config and its default since 0.12; a number changes the hash (peers must agree on it) and is refused in
    a mode whose rounds relay (auto there leaves every round one group)."""
    from peer import node_cli
    from geomesh_p2p.config.models import RunConfig

    run = node_cli.run_config_from(_join_ns("--mode", "reencode", "--group-size", "auto"))
    assert run.group_size is None
    assert node_cli.run_config_from(_join_ns("--mode", "reencode", "--group-size", "8")).group_size == 8
    assert node_cli.run_config_from(_join_ns("--mode", "reencode")).group_size is None
    assert node_cli.run_config_from(_join_ns("--mode", "reencode", "--group-size", "0")).group_size == 0
    assert run.config_hash() == RunConfig(mode="reencode").config_hash()
    assert (
        len(
            {
                run.config_hash(),
                RunConfig(mode="reencode", group_size=0).config_hash(),
                RunConfig(mode="reencode", group_size=8).config_hash(),
            }
        )
        == 3
    )
    assert RunConfig(mode="relay").group_size is None  # the default in relay: every round one group
    with pytest.raises(ValueError, match=r"group_size \(--group-size\) needs mode 'reencode', 'accountable' or 'auto'"):
        RunConfig(mode="relay", group_size=8)
    with pytest.raises(SystemExit):
        _join_ns("--group-size", "many")
    assert "expected auto or a number, got 'many'" in capsys.readouterr().err


def test_join_refuses_bad_run_values_before_importing_torch(tmp_path):
    """A new user's ``--group-size 2`` or ``--model huge`` was refused only after torch's import and the model's
    build (25-35 s on a loaded box). ``geomesh-peer join`` now checks the run and node configs, the resume flags and
    the preset's name first: each bad value exits 2 with its one line, torch not imported, no key file written."""
    import subprocess
    import sys

    key = tmp_path / "id.key"
    cases = {
        ("--mode", "relay", "--group-size", "2"): "needs mode 'reencode', 'accountable' or 'auto'",  # mode first
        ("--mode", "reencode", "--group-size", "2"): "a group needs at least 3 members",
        ("--model", "huge"): "--model huge: unknown model preset",
        ("--resume",): "--resume needs --checkpoint-dir",
        ("--data", str(tmp_path / "none.txt")): "no such file",
    }
    code = (
        "import sys; from peer.cli import main; rc = main(sys.argv[1:]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH'); sys.exit(rc)"
    )
    for flags, message in cases.items():
        out = subprocess.run(
            [sys.executable, "-c", code, "join", "--identity", str(key), *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (flags, out.stderr[-2000:])
        assert message in out.stderr and "Traceback" not in out.stderr, (flags, out.stderr[-2000:])
        assert out.stdout.strip().endswith("NO TORCH"), (flags, out.stdout)
    assert not key.exists()


@pytest.mark.parametrize(
    "args, line",
    [
        (["--speed-factors", "1,x"], "argument --speed-factors: '1,x': expected a number, got 'x'"),
        (["--speed-factors", "1,2"], "argument --speed-factors: '1,2': must be in (0, 1], got 2"),
        (["--memory-budgets", "2,y"], "argument --memory-budgets: '2,y': expected a number, got 'y'"),
        (
            ["--speed-factors", "1", "--memory-budgets", "0"],
            "argument --memory-budgets: '0': must be a finite number > 0",
        ),
    ],
)
def test_a_bad_demo_number_list_names_only_its_flag(args, line, capsys):
    """Fresh user 46: ``demo --speed-factors 1,x`` said "--speed-factors '1,x' / --memory-budgets '': expected
    comma-separated numbers", naming a flag that was not given; each list is now checked by its own flag's type."""
    with pytest.raises(SystemExit) as ei:
        main(["demo", *args])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert line in err
    other = "--memory-budgets" if "--speed-factors" in line else "--speed-factors"
    assert other not in err


def test_a_bad_bootstrap_k_or_alpha_names_only_its_flag(capsys):
    """The same kind in geomesh-bootstrap: "--k 20 / --alpha 0: must be >= 1" named both flags."""
    from bootstrap.cli import parse as boot_parse

    for flag in ("--alpha", "--k"):
        with pytest.raises(SystemExit) as ei:
            boot_parse(["--run-id", "r", flag, "0"])
        assert ei.value.code == 2
        assert capsys.readouterr().err.strip() == f"geomesh-bootstrap: {flag} 0: must be >= 1"
