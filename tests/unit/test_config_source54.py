"""A value from ``--config FILE`` that a later check refuses names the file (fresh user 54: ``model: tiney`` in a config
file was refused as ``--model tiney: unknown model preset``, a flag nobody typed)."""

from __future__ import annotations

import argparse

import pytest

from geomesh_p2p.config.flags import named_source
from peer.cli import main

pytestmark = pytest.mark.timeout(60)


def test_a_bad_value_from_the_config_file_names_the_file(tmp_path, capsys):
    cfg = tmp_path / "p1.yaml"
    cfg.write_text("model: tiney\nbootstrap: 127.0.0.1:9\nrun-id: X\n")
    assert main(["join", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("geomesh-peer join: --model tiney: unknown model preset (known: tiny,")
    assert err.endswith(f"(set by model: in config file {cfg})")
    # the same value on the command line is the flag's, and says nothing of the file
    assert main(["join", "--config", str(cfg), "--model", "tinyy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("geomesh-peer join: --model tinyy: unknown model preset") and "config file" not in err


def test_named_source_names_only_the_options_the_file_set():
    ns = argparse.Namespace(config="c.yaml", config_dests=frozenset({"window_s"}))
    assert named_source(ns, ValueError("--window-s 0: must be > 0")) == (
        "--window-s 0: must be > 0 (set by window-s: in config file c.yaml)"
    )
    assert named_source(ns, ValueError("--model x: unknown")) == "--model x: unknown"
    assert named_source(ns, ValueError("no flag here")) == "no flag here"
    assert named_source(argparse.Namespace(), ValueError("--window-s 0: bad")) == "--window-s 0: bad"
