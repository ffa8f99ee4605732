"""The CLIs: --version, identity, config files, bad flags fail with one line."""

from __future__ import annotations

import os
import subprocess
import sys

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
    assert capsys.readouterr().out == first
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


def test_console_scripts_help():
    for exe in ("geomesh-peer", "geomesh-bootstrap"):
        path = os.path.join(os.path.dirname(sys.executable), exe)
        r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "usage:" in r.stdout
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "geomesh-peer"), "--no-such-flag"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


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
