"""CLI flags generated from the config models (geomesh_p2p.config.flags): every field has its flag and
its default in --help, flag > config file > default, bad config files are refused naming the key,
the demo's peers get the same run config, and bootstrap/ imports nothing from peer/."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from geomesh_p2p.config.flags import ConfigFileError, derived_fields, flag_specs, load_config_defaults
from geomesh_p2p.config.models import BootstrapConfig, NodeConfig, RunConfig

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _help(parser) -> str:
    """--help with each flag's help on its own line (no wrapping), so the default sits next to its flag."""
    import argparse

    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, max_help_position=1000, width=5000)
    return parser.format_help()


def _join_parser():
    from peer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["join"]


@pytest.mark.parametrize("model", [RunConfig, NodeConfig])
def test_every_field_has_a_join_flag_with_its_default_in_help(model):
    join = _join_parser()
    text = _help(join)
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip().startswith("--")}
    specs = flag_specs(model)
    derived = derived_fields(model)
    assert {s.field for s in specs} | set(derived) == set(model.model_fields)
    for field, source in derived.items():  # computed from a flag of join (e.g. data from --data)
        assert source in lines, (field, source)
    for s in specs:
        assert s.flag in lines, s.flag
        default = s.kwargs.get("default")
        if isinstance(default, bool) or default is None or default == []:
            continue
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        assert f"(default: {shown}" in lines[s.flag], lines[s.flag]
        # the help shows the field's own default, in the flag's unit
        field_default = model.model_fields[s.field].get_default(call_default_factory=True)
        assert default == (field_default / s.scale if s.scale else field_default)


def test_bootstrap_flags_are_its_fields():
    from bootstrap.cli import build_parser

    lines = {line.split()[0]: line for line in _help(build_parser()).splitlines() if line.strip().startswith("--")}
    for s in flag_specs(BootstrapConfig):
        assert s.flag in lines
    assert "(default: 31337)" in lines["--port"] and "(default: ~/.geomesh/bootstrap.key)" in lines["--identity"]
    assert "(default: geomesh-demo)" in lines["--run-id"]


def test_join_flags_build_the_configs_in_field_units():
    from peer import node_cli

    ns = _join_parser().parse_args(
        [
            "--memory-budget-gb",
            "1.5",
            "--upload-mbps",
            "8",
            "--added-latency-ms",
            "20",
            "--window-s",
            "3",
            "--min-agreement",
            "0",
            "--no-amp",
            "--clip-k",
            "2.5",
            "--bootstrap",
            "127.0.0.1:5",
            "--bootstrap",
            "[::1]:6",
        ]
    )
    cfg = node_cli.node_config_from(ns)
    assert cfg.memory_budget_bytes == 3 * 2**29 and isinstance(cfg.memory_budget_bytes, int)
    assert cfg.upload_bps == 1e6 and cfg.download_bps is None and cfg.added_latency_s == 0.02
    assert cfg.amp is False and cfg.bootstrap == ["127.0.0.1:5", "[::1]:6"]
    run = node_cli.run_config_from(ns)
    assert (run.window_s, run.min_agreement, run.clip_k) == (3.0, None, 2.5)
    # no flag given: exactly the models' defaults
    ns0 = _join_parser().parse_args([])
    assert node_cli.run_config_from(ns0) == RunConfig()
    assert node_cli.node_config_from(ns0) == NodeConfig()


def test_rounds_zero_is_refused_at_start_and_help_says_what_no_flag_means(tmp_path, capsys):
    """Fresh-user report: ``--rounds 0`` was accepted (the peer joined, profiled, then stopped before round 0
    having trained nothing) and --help did not say what leaving it out means. 0 fails at start naming the flag,
    from the command line and from a config file; the help says the default is no limit."""
    from peer.cli import main

    key = tmp_path / "id.key"
    with pytest.raises(SystemExit) as e:
        main(["join", "--identity", str(key), "--rounds", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "geomesh-peer join: error: argument --rounds: must be >= 1, got 0 (see geomesh-peer join --help)"
    cfg = tmp_path / "peer.yaml"
    cfg.write_text("rounds: 0\n")
    assert main(["join", "--config", str(cfg), "--identity", str(key)]) == 2
    assert capsys.readouterr().err.strip() == f"geomesh-peer join: config file {cfg}: rounds: must be >= 1, got 0"
    assert not key.exists()  # refused before anything starts
    with pytest.raises(ValueError, match="rounds"):
        NodeConfig(rounds=0)
    assert NodeConfig(rounds=1).rounds == 1 and NodeConfig().rounds is None
    line = next(ln for ln in _help(_join_parser()).splitlines() if ln.strip().startswith("--rounds"))
    assert line.split()[:2] == ["--rounds", "N"]
    assert "default: no limit, train until Ctrl+C or --target-ppl" in line


def test_flag_beats_config_file_beats_default(tmp_path):
    from peer.cli import build_parser, with_config_file

    cfg = tmp_path / "peer.yaml"
    cfg.write_text("window-s: 9\nseed: 7\nmemory_budget_gb: 2\nbootstrap: 127.0.0.1:31337\n")
    argv = ["join", "--config", str(cfg), "--seed", "3"]
    parser = build_parser()
    ns = with_config_file(parser, parser.parse_args(argv), argv)
    from peer import node_cli

    run, node = node_cli.run_config_from(ns), node_cli.node_config_from(ns)
    assert run.seed == 3  # flag
    assert run.window_s == 9.0 and node.memory_budget_bytes == 2 * 2**30  # file
    assert node.bootstrap == ["127.0.0.1:31337"]
    assert run.inner_lr == RunConfig().inner_lr == 1e-3 and node.port == 0  # default
    # a list flag given on the command line replaces the file's list (it was added to it), and repeats append
    for extra, want in (
        (["--bootstrap", "127.0.0.1:1"], ["127.0.0.1:1"]),
        (["--bootstrap", "127.0.0.1:1", "--bootstrap", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2"]),
    ):
        argv = ["join", "--config", str(cfg), *extra]
        parser = build_parser()
        assert node_cli.node_config_from(with_config_file(parser, parser.parse_args(argv), argv)).bootstrap == want


def test_bootstrap_flag_beats_config_file_beats_default(tmp_path):
    from bootstrap.cli import parse

    cfg = tmp_path / "b.json"
    cfg.write_text('{"k": 8, "run-id": "from-file", "bootstrap": "127.0.0.1:1"}')
    ns = parse(["--config", str(cfg), "--k", "5"])
    assert (ns.k, ns.run_id, ns.bootstrap, ns.alpha, ns.port) == (5, "from-file", ["127.0.0.1:1"], 3, 31337)


@pytest.mark.parametrize(
    "text, expect",
    [
        ("windw-s: 3\n", "unknown option 'windw-s' (did you mean window-s?)"),
        ("bootstrp: 127.0.0.1:1\n", "unknown option 'bootstrp' (did you mean bootstrap?)"),  # fresh user 44
        ("--run-id: r\n", "unknown option '--run-id' (write it without the dashes: run-id)"),
        ("--run_id: r\n", "unknown option '--run_id' (write it without the dashes: run_id)"),
        ("zzz-qqq: 1\n", "unknown option 'zzz-qqq'"),  # nothing near: no hint
        ("window-s: -1\n", "window-s: must be a finite number > 0, got -1"),
        ("method: sgd\n", "method: 'sgd' is not one of geomesh, awb, css, diloco, ddp"),
        ("vocab_size: 12\n", "vocab_size: must be >= 257, got 12"),
    ],
)
def test_bad_config_file_is_refused_naming_key_and_file(tmp_path, capsys, text, expect):
    from peer.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert main(["join", "--config", str(cfg), "--identity", str(tmp_path / "id.key")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"geomesh-peer join: config file {cfg}: {expect}"
    assert not (tmp_path / "id.key").exists()  # refused before anything starts


def test_bootstrap_bad_config_key_is_refused(tmp_path, capsys):
    from bootstrap.cli import main

    cfg = tmp_path / "b.yaml"
    cfg.write_text("no_such: 1\n")
    assert main(["--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == f"geomesh-bootstrap: config file {cfg}: unknown option 'no_such'"


def test_demo_peers_get_the_same_run_config(tmp_path):
    """The demo renders its run flags into each peer's argv from the same specs (no hand list)."""
    from peer import demo, node_cli
    from peer.cli import build_parser

    data = tmp_path / "t.txt"
    data.write_text("some text\n")
    args = [
        "--run-id",
        "r1",
        "--seed",
        "4",
        "--method",
        "diloco",
        "--mode",
        "reencode",
        "--min-agreement",
        "0",
        "--error-feedback",
        "--window-s",
        "2.5",
        "--pow-bits",
        "0",
        "--data",
        str(data),
        "--clip-k",
        "3",
        "--max-inner-steps",
        "50",
    ]
    ns = build_parser().parse_args(["demo", *args])
    peer_ns = _join_parser().parse_args(demo._run_flags(ns))
    want = node_cli.run_config_from(_join_parser().parse_args(args))
    assert node_cli.run_config_from(peer_ns) == want
    assert want.method == "diloco" and want.error_feedback and want.min_agreement is None
    # every RunConfig flag is rendered (also at its default), so a peer's own defaults never matter
    rendered = demo._run_flags(build_parser().parse_args(["demo"]))
    assert {s.flag for s in flag_specs(RunConfig) if s.kwargs.get("action") != "store_true"} <= set(rendered)


def test_config_file_error_is_a_value_error():
    assert issubclass(ConfigFileError, ValueError)


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("deep.json", "[" * 100_000, "nested too deeply"),
        ("deep.yaml", "[" * 100_000, "nested too deeply"),
        ("big.json", '{"rounds": ' + "9" * 5000 + "}", "Exceeds the limit"),
    ],
)
def test_a_config_file_that_breaks_the_parser_is_one_line_naming_it(tmp_path, name, text, reason):
    """Review (session 10): nesting past the parsers' recursion limit (RecursionError) and an integer over
    Python's 4,300-digit limit (ValueError) gave a traceback instead of the ConfigFileError naming the file."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=rf"config file {path} does not parse: .*{reason}"):
        load_config_defaults(argparse.ArgumentParser(), str(path))


def test_bootstrap_imports_nothing_from_peer():
    for path in (ROOT / "bootstrap").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "peer" or n.startswith("peer.") for n in names), (path, names)
    code = (
        "import sys, bootstrap.cli as b; b.build_parser(); "
        "print(sorted(m for m in sys.modules if m == 'peer' or m.startswith('peer.')))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_config_takes_a_non_finite_number(tmp_path):
    """Red team (session 16): ``RunConfig(inner_lr=inf)`` was accepted (``gt=0`` lets +inf through) and would have
    reached training. Every float of the three configs refuses inf and nan, naming the field; from a config file
    and from a flag the message names the key or flag."""
    import math

    from peer.cli import build_parser, with_config_file

    floats = [
        (cls, name)
        for cls in (RunConfig, NodeConfig, BootstrapConfig)
        for name, f in cls.model_fields.items()
        if "float" in repr(f.annotation)
    ]
    assert len(floats) >= 20, floats  # inner_lr, outer_lr, window_s, quorum, speed_factor, rpc_timeout, ...
    for cls, name in floats:
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ValueError, match=rf"{name}\n.*finite number"):
                cls(**{name: bad})
    cfg = tmp_path / "peer.yaml"
    cfg.write_text("inner_lr: .inf\n")
    argv = ["join", "--config", str(cfg)]
    parser = build_parser()
    with pytest.raises(ConfigFileError, match="inner_lr"):
        with_config_file(parser, parser.parse_args(argv), argv)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["join", "--inner-lr", "inf"])
    assert e.value.code == 2


def test_a_config_file_under_home_is_read_and_of_nobody_refused(tmp_path, monkeypatch):
    """``--config=~/peer.yaml`` (the shell leaves a ``~`` after ``=`` alone): read from the home folder as every other
    path flag is (red team 43: it was "cannot read config file ~/peer.yaml"); ``~NAME`` of no user: one line."""
    from geomesh_p2p.config.flags import ConfigFileError, load_config_defaults
    from peer.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "peer.yaml").write_text("seed: 7\n")
    sub = build_parser()._subparsers._group_actions[0].choices["join"]
    assert load_config_defaults(sub, "~/peer.yaml")["seed"] == 7
    with pytest.raises(ConfigFileError, match=r"^--config ~nosuchuser43/p.yaml: no user 'nosuchuser43'"):
        load_config_defaults(sub, "~nosuchuser43/p.yaml")


def test_the_readmes_example_config_file_is_read_as_it_says(tmp_path):
    """The README's example ``peer.yaml`` (fresh-user trial 44: no example file) parses to the flags it names."""
    from pathlib import Path

    from peer.cli import build_parser, parse, with_config_file

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = tmp_path / "peer.yaml"
    cfg.write_text("\n".join(line.strip() for line in block.splitlines()))
    parser, argv = build_parser(), ["join", "--config", str(cfg)]
    ns = with_config_file(parser, parse(parser, argv), argv)
    got = (ns.bootstrap, ns.run_id, ns.identity, ns.checkpoint_dir, ns.threads, ns.log_json)
    assert got == (["127.0.0.1:31337"], "R", "p1.key", "ckpt1", 1, "p1.jsonl")


def test_the_lr_schedule_flags_say_they_count_rounds_times_uniform_inner_steps():
    """Fresh user 48: --total-inner-steps / --warmup-steps said "inner steps", but swarm_lr_at counts swarm rounds x
    --uniform-inner-steps, whatever steps a peer trains (25-85 a round there): the default decays to 0.1x at round
    100 (2000 / 20), as the help now says, and reaches it there whatever the plan gave a peer."""
    from geomesh_p2p.model.training import swarm_lr_at

    lines = {line.split()[0]: line for line in _help(_join_parser()).splitlines() if line.strip().startswith("--")}
    for flag in ("--total-inner-steps", "--warmup-steps"):
        assert "swarm rounds x --uniform-inner-steps" in lines[flag], lines[flag]
    assert (
        "round 100" in lines["--total-inner-steps"] and "set R x --uniform-inner-steps" in lines["--total-inner-steps"]
    )
    cfg = RunConfig(seq_len=32)
    last = cfg.total_inner_steps // cfg.uniform_inner_steps
    assert last == 100
    for planned in (25, 85):
        at = [
            swarm_lr_at(
                r,
                0,
                planned,
                steps_per_round=cfg.uniform_inner_steps,
                lr=1.0,
                warmup_steps=cfg.warmup_steps,
                total_steps=cfg.total_inner_steps,
            )
            for r in (0, 1, last - 1, last, 3 * last)
        ]
        assert at[0] == pytest.approx(1 / cfg.warmup_steps) and at[1] == pytest.approx(1.0)  # warm-up: round 0
        assert at[2] > 0.1 and at[3] == pytest.approx(0.1) and at[4] == pytest.approx(0.1)
