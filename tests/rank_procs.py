"""The OS processes of a multi-rank test (one per rank: torch.distributed's process group is per process, and the
test process must not join one): started on a fresh local port, reaped with their output, also when a test fails."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ranks' store binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(script: str, world: int, scenario: str, out: str, *extra: str) -> list[subprocess.Popen]:
    """``python tests/<script> RANK WORLD INIT SCENARIO OUT *extra`` for every rank, output piped (stderr too)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / script), str(r), str(world), init, scenario, out, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]


def reap(procs: list[subprocess.Popen]) -> str:
    """Kill what still runs of ``procs``, wait for all; returns their output, rank by rank."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return b"".join(p.stdout.read() for p in procs if p.stdout is not None).decode(errors="replace")
