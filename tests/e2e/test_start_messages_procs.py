"""A busy port through the console scripts, with GRPC_VERBOSITY unset as on a fresh shell (review findings
5, 6): one line on stderr, no gRPC C-core line (``E1130 ... add_port.cc:83] Failed to add port``), and the
same exit status (2, bad start-up input) for ``geomesh-bootstrap`` and ``geomesh-peer join``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_util import FAST

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).parent


def _fresh_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _run(argv) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=150, env=_fresh_env())


@pytest.mark.parametrize("script", ["geomesh-bootstrap", "geomesh-peer"])
def test_busy_port_is_one_line_and_exit_2(tmp_path, busy_port, script):
    exe = BIN / script
    if not exe.exists():
        pytest.skip(f"{script} is not installed in this environment")
    args = ["--host", "127.0.0.1", "--port", str(busy_port), "--identity", str(tmp_path / "id.key")]
    argv = [str(exe), *args] if script == "geomesh-bootstrap" else [str(exe), "join", *FAST, *args]
    r = _run(argv)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x[:2].isdigit()]  # log lines start HH:MM:SS
    prog = "geomesh-bootstrap" if script == "geomesh-bootstrap" else "geomesh-peer join"
    # named with the flag, at start (session 33: the peer's came after torch's import and the proof of work)
    assert len(lines) == 1 and lines[0] == (
        f"{prog}: --port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port is in use (another --port, "
        "or --port 0 for a free one)"
    ), r.stderr
    assert "proof of work" not in r.stderr and "starting (" not in r.stderr, r.stderr
    assert "add_port.cc" not in r.stderr and "Failed to add port" not in r.stderr, r.stderr
    assert not (tmp_path / "id.key").exists()  # the key it created went with the failed start (session 32)


def _ignoring_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell does for `geomesh-peer join ... &`


@pytest.mark.parametrize("when", ["import", "proof of work"])
def test_sigint_during_the_start_of_a_background_join_stops_it_with_exit_0(tmp_path, when):
    """A peer started in the background (SIGINT ignored by the shell) and sent SIGINT while it starts: it stopped
    only once the node ran, and a stop in the proof of work exited 1 (fresh user, session 43). Now exit 0 with one
    line saying it stopped, no traceback, and no key file left (none existed before)."""
    import signal
    import threading

    exe = BIN / "geomesh-peer"
    if not exe.exists():
        pytest.skip("geomesh-peer is not installed in this environment")
    key = tmp_path / "id.key"
    argv = [str(exe), "join", "--host", "127.0.0.1", "--port", "0", "--identity", str(key)]
    # 32 bits: minutes of hashing, so the signal surely lands in it
    argv += ["--pow-bits", "32"] if when == "proof of work" else []
    wait_for = "computing this identity's proof of work" if when == "proof of work" else "geomesh-peer join: starting"
    p = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_fresh_env(), preexec_fn=_ignoring_sigint
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in p.stderr:
            lines.append(line)
            if wait_for in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(120), "".join(lines)  # (the proof of work runs under the node's loop and its handler)
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0, "".join(lines)
        reader.join(10)
        text = "".join(lines)
        assert "Traceback" not in text, text
        if when == "proof of work":  # the node's clean stop before it joined (exit 0), in its log
            said = [x for x in lines if "stop requested before this peer joined the swarm" in x]
            assert len(said) == 1 and "stopped while computing the proof of work" in said[0], text
            # no --bootstrap: a WARNING saying how to join an existing swarm instead (fresh user 50: it was an INFO)
            [warned] = [x.split(" W ", 1)[1].split(": ", 1)[1].rstrip() for x in lines if "no --bootstrap given" in x]
            assert warned == (
                "no --bootstrap given: this peer starts a NEW swarm of its own for run 'geomesh-demo' (others join it through "
                "this peer's address); to join an existing swarm instead, stop (Ctrl+C) and pass --bootstrap "
                "HOST:PORT, the address of that swarm's bootstrap"
            ), text
        else:
            said = [x.strip() for x in lines if x.startswith("geomesh-peer join: stopped")]
            assert said == ["geomesh-peer join: stopped during start-up"], text
        assert not key.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
