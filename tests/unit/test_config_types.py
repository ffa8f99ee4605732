"""A config file's value of the wrong type fails at start, naming the file and the key (session 44:
``mmap_threshold_mib: [1]`` in a peer's config file read as 1: each value went through its flag's type as text, a
list joined with commas). Every kind of key of ``geomesh-peer`` (join, demo, status) and ``geomesh-bootstrap``, the
simulator's profiles and a ``--model-config`` file."""

from __future__ import annotations

import json

import pytest

from geomesh_p2p.config.flags import load_config_defaults
from geomesh_p2p.model.build import ConfigError, model_config
from geomesh_p2p.sim.hardware import PROFILE_DIR, ProfileError, parse_profile

pytestmark = pytest.mark.timeout(60)


def _command(name: str):
    from peer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize(
    "text, message",
    [
        ("mmap_threshold_mib: [1]\n", "mmap_threshold_mib: expected a number, got the list [1]"),
        ("threads: true\n", "threads: expected an integer, got true"),
        ("rounds: 1.5\n", "rounds: expected an integer, got the number 1.5"),
        ("inner_lr: '0.001'\n", "inner_lr: expected a number, got the text '0.001'"),
        ("port: null\n", "port: expected an integer, got null (leave the key out for the default)"),
        ("identity: 5\n", 'identity: expected text, got the number 5 (quote it: "5")'),
        ("checkpoint_dir: [a, b]\n", 'checkpoint_dir: expected text, got the list ["a", "b"]'),
        ("run_id: 2024\n", 'run_id: expected text, got the number 2024 (quote it: "2024")'),
        ("method: {a: 1}\n", "method: expected text, got a mapping"),
        ("bootstrap: [5]\n", 'bootstrap: expected text, got the number 5 (quote it: "5")'),
        ("window_s: [3]\n", "window_s: expected auto or a number, got the list [3]"),
        ("group_size: 2.5\n", "group_size: expected auto or an integer, got the number 2.5"),
        ("profile_batches: [4, true]\n", "profile_batches: expected a list of integers, got the list [4, true]"),
        ("local_devices: [cpu, 1]\n", 'local_devices: expected a list of text values, got the list ["cpu", 1]'),
        ("client_only: 1\n", "client_only: expected true or false, got the number 1"),
    ],
)
def test_join_refuses_a_value_of_the_wrong_type_naming_the_file_and_key(tmp_path, capsys, text, message):
    from peer.cli import main

    cfg = tmp_path / "peer.yaml"
    cfg.write_text(text)
    assert main(["join", "--config", str(cfg), "--identity", str(tmp_path / "id.key")]) == 2
    assert capsys.readouterr().err.strip() == f"geomesh-peer join: config file {cfg}: {message}"
    assert not (tmp_path / "id.key").exists()  # refused before anything starts


def test_values_of_the_right_type_are_read(tmp_path):
    cfg = tmp_path / "peer.yaml"
    cfg.write_text(
        "mmap_threshold_mib: 1\ninner_lr: 0.001\nwindow_s: auto\ngroup_size: 4\nprofile_batches: '4,8'\n"
        "local_devices: [cpu, cpu]\nbootstrap: 127.0.0.1:1\nrun_id: '2024'\nclient_only: true\nspeed_factor: 1\n"
        "target_ppl: null\n"
    )
    assert load_config_defaults(_command("join"), str(cfg)) == {
        "mmap_threshold_mib": 1,
        "inner_lr": 0.001,
        "window_s": None,
        "group_size": 4,
        "profile_batches": [4, 8],
        "local_devices": ["cpu", "cpu"],
        "bootstrap": ["127.0.0.1:1"],
        "run_id": "2024",
        "client_only": True,
        "speed_factor": 1.0,
        "target_ppl": None,  # a flag that may be unset: null is its default
    }


def test_demo_and_status_keys_are_checked_too(tmp_path):
    from geomesh_p2p.config.flags import ConfigFileError

    cfg = tmp_path / "demo.yaml"
    cfg.write_text("speed_factors: [1.0, 0.5]\nmemory_budgets: '2,3'\npeers: 2\n")
    assert load_config_defaults(_command("demo"), str(cfg)) == {
        "speed_factors": "1.0,0.5",
        "memory_budgets": "2,3",
        "peers": 2,
    }
    for command, text, message in [
        ("demo", "speed_factors: [true]\n", "speed_factors: expected a list of numbers, got the list [true]"),
        ("demo", "workdir: 7\n", 'workdir: expected text, got the number 7 (quote it: "7")'),
        ("status", "record_shards: [4]\n", "record_shards: expected an integer, got the list [4]"),
        ("status", "timeout: false\n", "timeout: expected a number, got false"),
    ]:
        cfg.write_text(text)
        with pytest.raises(ConfigFileError) as ei:
            load_config_defaults(_command(command), str(cfg))
        assert str(ei.value) == f"config file {cfg}: {message}", command


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"k": [8]}', "k: expected an integer, got the list [8]"),
        ('{"rpc_timeout": true}', "rpc_timeout: expected a number, got true"),
        ('{"identity": 5}', 'identity: expected text, got the number 5 (quote it: "5")'),
        ('{"state_file": false}', 'state_file: expected text, got false (quote it: "false")'),
        ('{"bootstrap": 31337}', 'bootstrap: expected text, got the number 31337 (quote it: "31337")'),
        ('{"http_port": "8080"}', "http_port: expected an integer, got the text '8080'"),
    ],
)
def test_bootstrap_refuses_a_value_of_the_wrong_type_naming_the_file_and_key(tmp_path, capsys, text, message):
    from bootstrap.cli import main

    cfg = tmp_path / "b.json"
    cfg.write_text(text)
    assert main(["--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == f"geomesh-bootstrap: config file {cfg}: {message}"


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("rounds: 60", "rounds: true", "train.rounds: Input should be a valid integer"),
        ("batch_div: 8", 'batch_div: "8"', "train.batch_div: Input should be a valid number"),
        ("seq_len: 1024", "seq_len: [1024]", "reference.seq_len: Input should be a valid integer"),
    ],
)
def test_a_simulator_profile_refuses_a_value_of_the_wrong_type(old, new, message):
    text = (PROFILE_DIR / "homogeneous4.yaml").read_text()
    assert old in text
    with pytest.raises(ProfileError) as ei:
        parse_profile(text.replace(old, new, 1), "h.yaml")
    assert str(ei.value) == f"profile h.yaml: {message}"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"n_layer": True}, "n_layer: expected an integer, got true"),
        ({"n_embd": [128]}, "n_embd: expected an integer, got the list [128]"),
        ({"resid_pdrop": "0.1"}, "resid_pdrop: expected a number, got the text '0.1'"),
    ],
)
def test_a_model_config_file_refuses_a_value_of_the_wrong_type(tmp_path, override, message):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"preset": "tiny", **override}))
    with pytest.raises(ConfigError) as ei:
        model_config(config_file=path)
    assert str(ei.value) == f"model config file {path}: {message}"
    path.write_text(json.dumps({"preset": "tiny", "n_layer": 3, "resid_pdrop": 0}))
    assert model_config(config_file=path).n_layer == 3
