"""Start peer processes on 127.0.0.1 for tests, read their per-round JSON lines, stop them by PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Small and fast: tests are about the protocol, not the model.
FAST = ["--threads", "1", "--seq-len", "32", "--window-s", "2.5", "--profile-batches", "4,8",
        "--target-batch", "4", "--run-id", "test-swarm", "--pow-bits", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcSwarm:
    """Owns the processes it starts; :meth:`stop_all` ends each of them (SIGINT, then SIGKILL)."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.procs: dict[str, subprocess.Popen] = {}

    def peer(self, name: str, *args: str, bootstrap: str | None = None, port: int = 0,
             extra: list[str] | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-m", "peer.cli", "join", "--identity", str(self.dir / f"{name}.key"),
                "--port", str(port), "--log-json", str(self.log_path(name)), *FAST, *args, *(extra or [])]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        return self._spawn(name, argv)

    def bootstrap(self, name: str, port: int, run_id: str = "test-swarm") -> subprocess.Popen:
        argv = [sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(port),
                "--run-id", run_id, "--identity", str(self.dir / f"{name}.key")]
        return self._spawn(name, argv)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.dir / f"{name}.log", "a")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        out.close()
        self.procs[name] = p
        return p

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.jsonl"

    def rows(self, name: str) -> list[dict]:
        p = self.log_path(name)
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out

    def text(self, name: str) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text() if p.exists() else ""

    def wait_for(self, cond, timeout: float, what: str) -> None:
        """Poll ``cond()`` until true; fail with the peers' log tails after ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -9):
                    raise AssertionError(f"{name} exited with {p.returncode} while waiting for {what}:\n"
                                         + self.text(name)[-3000:])
            time.sleep(0.25)
        tails = "\n".join(f"--- {n}\n{self.text(n)[-1500:]}" for n in self.procs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")

    def wait_exit(self, names, timeout: float) -> dict[str, int]:
        self.wait_for(lambda: all(self.procs[n].poll() is not None for n in names), timeout, f"{names} to exit")
        return {n: self.procs[n].returncode for n in names}

    def interrupt(self, name: str) -> None:
        """Ctrl+C: SIGINT to the peer (it finishes its exchange, announces it leaves, exits)."""
        self.procs[name].send_signal(signal.SIGINT)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.time() + 40
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
