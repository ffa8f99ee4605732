"""geomesh-bootstrap: options, one-line failures, clean exit on SIGINT/SIGTERM, and three real OS
processes (bootstrap + two peers) on 127.0.0.1 that see each other's records."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bootstrap.cli import main, parse
from geomesh_p2p.util.procs import stop_process
from tests import zygote
from tests.proc_util import bootstrap_args

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90  # seconds: a cold interpreter imports torch + hivemind; CI machines can be slow


class Proc:
    """A child process whose stdout lines are collected by a thread; stopped by PID in teardown."""

    def __init__(self, argv, name):
        self.name = name
        # forked from this worker's pre-imported interpreter when it can be (tests/zygote.py), else a cold one
        self.p = zygote.spawn_piped([sys.executable, *argv], cwd=ROOT) or subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self, stream, q):
        for line in stream:
            q.put(line.rstrip("\n"))

    def _pump_err(self):
        for line in self.p.stderr:
            self.err.append(line.rstrip("\n"))

    def wait_line(self, pattern, timeout) -> re.Match:
        """The first stdout line matching ``pattern`` (earlier lines are kept in self.out)."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None and self.lines.empty():
                raise AssertionError(
                    f"{self.name}: no line matching {pattern!r} within {timeout}s; "
                    f"rc={self.p.poll()} out={self.out[-5:]} err={self.err[-10:]}"
                )
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            self.out.append(line)
            m = rx.search(line)
            if m:
                return m

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        return stop_process(self.p, sig, timeout)


@pytest.fixture
def procs():
    started: list[Proc] = []

    def spawn(argv, name):
        proc = Proc(argv, name)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:  # also on failure, by PID
        proc.stop()


def _bootstrap_argv(tmp_path, *extra):
    # the DHT CLI's records below carry no proof of work: count them (--pow-bits 0)
    return bootstrap_args("proc-test", tmp_path / "boot.key", "--pow-bits", "0", *extra)


# ---------------------------------------------------------------- options, in process
def test_defaults_and_help(capsys):
    ns = parse([])
    assert (ns.host, ns.port, ns.run_id, ns.bootstrap, ns.k, ns.alpha) == ("0.0.0.0", 31337, "geomesh-demo", [], 20, 3)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--identity",
        "--run-id",
        "--bootstrap",
        "--config",
        "--log-level",
        "--status-interval",
        "--advertise-host",
    ):
        assert flag in out
    assert out.count("default") >= 14  # every flag says its default


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--port", "eighty"], "--port"),
        (["--port", "70000"], "--port 70000"),
        (["--frobnicate"], "--frobnicate"),
        (["--bootstrap", "nohostport"], "--bootstrap 'nohostport'"),
        (["--bootstrap", "::1:31337"], "needs brackets, e.g. [::1]:31337"),
        (["--host", "no:such:host"], "--host: host 'no:such:host' holds ':' but is not an IPv6 address"),
        (["--log-level", "LOUD"], "--log-level"),
        (["--status-interval", "0"], "--status-interval"),
    ],
)
def test_bad_flag_fails_with_one_line_naming_it(capsys, argv, names):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and "Traceback" not in err
    assert err.startswith("geomesh-bootstrap: ")


def test_unusable_identity_file_fails_with_one_line(tmp_path, capsys):
    key = tmp_path / "boot.key"
    key.write_bytes(b"not a key")
    os.chmod(key, 0o600)
    assert main(["--identity", str(key), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(key) in err and "--identity" in err and "corrupt" in err
    os.chmod(key, 0o644)
    assert main(["--identity", str(key), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chmod 600" in err


def test_config_file_supplies_options_and_flags_win(tmp_path, capsys):
    cfg = tmp_path / "boot.yaml"
    cfg.write_text('run-id: from-config\nport: 4242\nbootstrap: ["10.0.0.1:1"]\nstatus_interval: 5\n')
    ns = parse(["--config", str(cfg), "--port", "4343"])
    assert (ns.run_id, ns.port, ns.bootstrap, ns.status_interval) == ("from-config", 4343, ["10.0.0.1:1"], 5.0)
    js = tmp_path / "boot.json"
    js.write_text(json.dumps({"run_id": "j", "k": 8}))
    assert parse(["--config", str(js)]).k == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("colour: blue\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "colour" in err and str(bad) in err


# ---------------------------------------------------------------- real processes
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_bootstrap_prints_address_and_peer_id_then_exits_0_on_signal(tmp_path, procs, sig):
    boot = procs(_bootstrap_argv(tmp_path, "--status-interval", "0.5"), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    peer_id = boot.wait_line(r"^PeerID: (\w+)$", 5).group(1)
    boot.wait_line(r"^writes under \S+: identity key \S+ \(--identity\), state \S+ \(--state-file", 5)  # fresh user
    boot.wait_line(rf"--bootstrap {re.escape(address)}", 5)
    assert len(peer_id) >= 43
    deadline = time.monotonic() + 20
    while not any("live peers: 0" in e for e in boot.err):
        assert time.monotonic() < deadline, boot.err[-5:]
        time.sleep(0.2)
    assert boot.stop(sig) == 0
    assert not any("Traceback" in e for e in boot.err), boot.err
    if sig != signal.SIGTERM:
        return
    # same identity file => same PeerID on restart; a second bootstrap on its port fails with one line
    again = procs(_bootstrap_argv(tmp_path), "bootstrap-again")
    assert again.wait_line(r"^PeerID: (\w+)$", START_TIMEOUT).group(1) == peer_id
    port = next(x for x in again.out if "serving on" in x).rsplit(":", 1)[1]
    busy = procs(
        ["-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", port, "--identity", str(tmp_path / "other.key")],
        "busy",
    )
    assert busy.p.wait(START_TIMEOUT) == 2
    time.sleep(0.5)
    assert len(busy.err) == 1 and busy.err[0].startswith(
        f"geomesh-bootstrap: --port {port}: cannot listen on 127.0.0.1:{port}: the port is in use"
    ), busy.err


def test_bootstrap_that_cannot_listen_fails_with_one_line(tmp_path, procs):
    bad = procs(
        ["-m", "bootstrap.cli", "--host", "203.0.113.1", "--port", "0", "--identity", str(tmp_path / "boot.key")],
        "unbindable",
    )  # TEST-NET-3: not an address of this machine
    assert bad.p.wait(START_TIMEOUT) == 2
    time.sleep(0.5)
    assert len(bad.err) == 1 and bad.err[0].startswith("geomesh-bootstrap: cannot listen on 203.0.113.1:0"), bad.err


def test_bootstrap_and_two_peer_processes_see_each_others_records(tmp_path, procs):
    boot = procs(_bootstrap_argv(tmp_path, "--status-interval", "0.5"), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    peers = []
    for i, other in ((0, 1), (1, 0)):
        argv = [
            "-m",
            "geomesh_p2p.dht",
            "--bootstrap",
            address,
            "--run-id",
            "proc-test",
            "--announce",
            "--watch",
            "--period",
            "0.5",
            "--put",
            f"proc-test/value-{i}=hello from {i}",
            "--get",
            f"proc-test/value-{other}",
        ]
        peers.append(procs(argv, f"peer{i}"))
    ids = []
    for p in peers:
        ids.append(json.loads(p.wait_line(r"^\{", START_TIMEOUT).string)["peer_id"])
    for i, p in enumerate(peers):
        other = 1 - i
        p.wait_line(rf'"peers": \["{min(ids)}", "{max(ids)}"\].*"hello from {other}"', 30)
    deadline = time.monotonic() + 20
    while not any("live peers: 2" in e for e in boot.err):
        assert time.monotonic() < deadline, boot.err[-5:]
        time.sleep(0.2)
    # the bootstrap goes away; the peers keep seeing each other past their records' lifetime (1.5 s)
    assert boot.stop(signal.SIGINT) == 0
    time.sleep(3)
    for i, p in enumerate(peers):
        p.wait_line(rf'"peers": \["{min(ids)}", "{max(ids)}"\].*"hello from {1 - i}"', 15)
    for p in peers:
        assert p.stop(signal.SIGTERM) == 0
        assert not any("Traceback" in e for e in p.err), p.err
