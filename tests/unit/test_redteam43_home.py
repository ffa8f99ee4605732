"""Red team 43: a path flag naming ``~NAME/...`` where no user is called NAME (a typo of ``~/...``, or a config
file written on another machine). pathlib's expanduser raises RuntimeError("Could not determine home directory.")
for it, and every path flag but the checkpoint folder red team 42 fixed ended in that traceback: join's
--checkpoint-dir, --identity, --summary-json, --log-json, --allow-peers, --data; identity's and status's
--identity, export's --out, demo's --workdir, and the same values from a --config file. Now the command fails at
start, exit 2, with one line naming the flag and the user."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

_ROOT = Path(__file__).resolve().parents[2]
_USER = "nobody-redteam43"  # no such user on any machine this runs on (checked below)
_CASES = [
    (["join", "--checkpoint-dir", f"~{_USER}/ckpt"], "--checkpoint-dir"),
    (["join", "--identity", f"~{_USER}/key"], "--identity"),
    (["join", "--summary-json", f"~{_USER}/s.json"], "--summary-json"),
    (["join", "--allow-peers", f"~{_USER}/allow.txt"], "--allow-peers"),
    (["join", "--data", f"~{_USER}/corpus.txt"], "--data"),
    (["identity", "--identity", f"~{_USER}/key"], "--identity"),
    (["export", "--checkpoint-dir", ".", "--out", f"~{_USER}/out"], "--out"),
    (["demo", "--workdir", f"~{_USER}/w", "--rounds", "1"], "--workdir"),
]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from peer.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    # a subprocess: before the fix a join went on to import torch and start a node before the traceback
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("argv,flag", _CASES, ids=[" ".join(a[:2]) for a, _ in _CASES])
def test_a_home_of_nobody_is_one_line_naming_the_flag(tmp_path, argv, flag):
    assert os.path.expanduser(f"~{_USER}") == f"~{_USER}"  # the user does not exist here
    p = _run([*argv, "--bootstrap", "127.0.0.1:9"] if argv[0] == "join" else argv, tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0] == (
        f"geomesh-peer {argv[0]}: {flag} ~{_USER}/{argv[argv.index(flag) + 1].split('/', 1)[1]}: "
        f"no user {_USER!r} (~NAME is NAME's home folder)"
    )
    assert os.listdir(tmp_path) == []  # nothing made (no '~nobody...' folder in the working directory)


def test_from_a_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"identity: ~{_USER}/key\n")
    p = _run(["join", "--config", str(cfg), "--bootstrap", "127.0.0.1:9"], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (
        p.stderr.strip()
        == f"geomesh-peer join: --identity ~{_USER}/key: no user {_USER!r} (~NAME is NAME's home folder)"
    )


def test_the_bootstrap_too(tmp_path):
    code = "import sys; from bootstrap.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code, "--identity", f"~{_USER}/key", "--port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip() == (
        f"geomesh-bootstrap: --identity ~{_USER}/key: no user {_USER!r} (~NAME is NAME's home folder)"
    )
    assert os.listdir(tmp_path) == []
