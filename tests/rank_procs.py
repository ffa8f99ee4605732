"""The OS processes of a multi-rank test (one per rank: torch.distributed's process group is per process, and the
test process must not join one): started on a fresh local port, reaped with their output, also when a test fails."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests import zygote

ROOT = Path(__file__).resolve().parents[1]


def store_init(out: str) -> str:
    """The ranks' ``init_method``: a rendezvous file in a fresh folder beside ``out`` (as the peer's self-started
    ranks use, ``geomesh_p2p.node.ranks._store_dir``). A ``tcp://`` port found free here was bound by rank 0 only
    later, and another test's socket took it once in CI: rank 0 died in 2 s, its follower waited to the timeout."""
    return "file://" + tempfile.mkdtemp(prefix="rank-store-", dir=Path(out).parent) + "/store"


def spawn_ranks(script: str, world: int, scenario: str, out: str, *extra: str) -> list:
    """``python -m tests.<script's module> RANK WORLD INIT SCENARIO OUT *extra`` for every rank (stdout, stderr
    piped), forked from this worker's zygote when it can be (tests/zygote.py: torch, torch.distributed and
    transformers imported once, ~4 CPU-s less a rank; the workers set ``GLOO_SOCKET_IFNAME=lo`` themselves), else a
    cold interpreter with ``GLOO_SOCKET_IFNAME=lo``. Returns ``subprocess.Popen`` or :class:`tests.zygote.ZygoteChild`
    objects (:func:`reap` reads either)."""
    init = store_init(out)
    module = "tests." + Path(script).stem
    procs: list = []
    for r in range(world):
        argv = [sys.executable, "-m", module, str(r), str(world), init, scenario, out, *extra]
        child = zygote.spawn_piped(argv, cwd=ROOT)
        if child is None:
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
            child = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        _drain(child)
        procs.append(child)
    return procs


def _drain(child) -> None:
    """Read ``child``'s stdout and stderr in daemon threads as it writes them (into ``child.drained``): a child that
    writes more than a pipe holds (64 KiB: a traceback per step, gloo's warnings under load) would otherwise block
    on its write while the test waits for it to exit, and the test would hang to its timeout."""
    child.drained, child.readers = [], []
    for stream in (child.stdout, getattr(child, "stderr", None)):
        if stream is None:
            continue
        t = threading.Thread(target=lambda s=stream: child.drained.append(_read(s)), daemon=True)
        t.start()
        child.readers.append(t)


def _read(stream) -> str:
    if stream is None:
        return ""
    data = stream.read()
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def reap(procs: list) -> str:
    """Kill what still runs of ``procs``, wait for all; returns their output (stdout, then stderr), rank by rank."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    out = []
    for p in procs:
        readers = getattr(p, "readers", None)
        if readers is None:  # not started by spawn_ranks
            out.append(_read(p.stdout) + _read(getattr(p, "stderr", None)))
            continue
        for t in readers:
            t.join(timeout=10)  # the child is gone: its pipes end at once
        out.append("".join(p.drained))
    return "".join(out)
