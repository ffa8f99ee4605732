"""A kept-weights store whose process died without closing it (SIGKILL, the OOM killer) leaves up to 4P bytes a
round in its directory; the next store removes such directories and only those (trust/kept_weights.sweep_orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from geomesh_p2p.trust import kept_weights
from geomesh_p2p.trust.kept_weights import LOCK_NAME, PREFIX, KeptWeights, sweep_orphans

pytestmark = pytest.mark.timeout(60)


def _store_in_child(tmp_path, named: bool) -> subprocess.Popen:
    """A child process with a store of round 3 under ``tmp_path`` (its path on the first line of its stdout); it waits
    on stdin. ``named``: named files (as where ``O_TMPFILE`` is missing), else the system's default."""
    force = "kept_weights._unnamed_supported = lambda d: False\n" if named else ""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; from geomesh_p2p.trust import kept_weights\n"
            f"{force}k = kept_weights.KeptWeights(dir={str(tmp_path)!r}); k.put(3, torch.ones(1000))\n"
            "print(k.path, k.unnamed, flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


def test_a_killed_processs_unnamed_files_go_with_it(tmp_path):
    """Fresh user 54: killed peers left their kept weights in /tmp until a later peer swept them (on a tmpfs: RAM).
    Unnamed files (Linux ``O_TMPFILE``) are the process's: its directory holds the lock file only, alive or dead."""
    child = _store_in_child(tmp_path, named=False)
    try:
        path, unnamed = child.stdout.readline().split()
        assert unnamed == "True"  # this machine has O_TMPFILE and /proc (Linux)
        assert os.listdir(path) == [LOCK_NAME]
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert os.listdir(path) == [LOCK_NAME]  # nothing of the 4,000 bytes to sweep; the empty folder is swept
        assert sweep_orphans(str(tmp_path)) == [path] and os.listdir(tmp_path) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)


def test_a_killed_processs_store_is_removed_by_the_next_and_a_live_ones_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(kept_weights, "_unnamed_supported", lambda d: False)  # named files, as without O_TMPFILE
    child = _store_in_child(tmp_path, named=True)
    try:
        dead = child.stdout.readline().split()[0]
        assert sorted(os.listdir(dead)) == [LOCK_NAME, "theta-3.f32"]
        live = KeptWeights(dir=str(tmp_path))
        live.put(1, torch.zeros(10))
        assert os.path.isdir(dead)  # its owner lives: the new store's sweep left it
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        legacy = tmp_path / (PREFIX + "old12345")  # made before the lock file existed: never swept
        legacy.mkdir()
        (legacy / "theta-0.f32").write_bytes(b"\0" * 8)
        other = KeptWeights(dir=str(tmp_path))
        assert os.path.exists(dead)  # this process swept that folder already (at `live`): once a process
        monkeypatch.setattr(kept_weights, "_SWEPT", set())  # as a new process
        other.close()
        other = KeptWeights(dir=str(tmp_path))
        assert not os.path.exists(dead)
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (live.path, other.path, str(legacy)))
        assert live.get(1).tolist() == [0.0] * 10 and sweep_orphans(str(tmp_path)) == []
        live.close()
        other.close()
        assert sorted(os.listdir(tmp_path)) == [legacy.name]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)


def test_a_closed_stores_lock_is_released_and_a_collected_ones_too(tmp_path):
    k = KeptWeights(dir=str(tmp_path))
    d = k.path
    del k  # collected: the directory goes with the store (its finalizer), and the lock descriptor with it
    assert not os.path.exists(d)
    k2 = KeptWeights(dir=str(tmp_path))
    k2.close()
    k2.close()  # twice: the descriptor is closed once
    assert os.listdir(tmp_path) == []


def test_a_collected_unnamed_stores_descriptors_are_closed(tmp_path):
    k = KeptWeights(dir=str(tmp_path))
    assert k.unnamed
    k.put(1, torch.ones(10))
    fd = k._fds["theta-1.f32"]
    assert os.fstat(fd).st_size == 40
    del k  # collected without close(): its descriptors go with it, as its directory
    with pytest.raises(OSError):
        os.fstat(fd)
    assert os.listdir(tmp_path) == []
