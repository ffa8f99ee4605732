"""A process killed in the middle of an atomic write (a checkpoint, a token file) leaves its temporary file; the next
start removes such files and only those (util/atomic.sweep_stale_writes): never a write under way in another process,
never a fresh one, never another file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from geomesh_p2p.node.checkpoints import check_writable_dir
from geomesh_p2p.util.atomic import atomic_write, sweep_stale_writes

pytestmark = pytest.mark.timeout(60)

WRITER = """
import sys, time
from geomesh_p2p.util.atomic import atomic_write
def write(tmp):
    with open(tmp, "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        print(tmp, flush=True)
        sys.stdin.read()  # mid-write until killed
atomic_write(sys.argv[1], write)
"""


def _age(path: str, s: float) -> None:
    t = time.time() - s
    os.utime(path, (t, t))


def test_a_killed_writers_partial_file_is_removed_and_a_live_writers_is_kept(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / name)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in ("ckpt-00000003.safetensors", "ckpt-00000004.safetensors")
    ]
    try:
        dead_tmp, live_tmp = (p.stdout.readline().strip() for p in procs)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)
        for p in (dead_tmp, live_tmp):
            _age(p, 3600)
        (tmp_path / "notes.tmp").write_bytes(b"mine")  # not a name atomic_write makes
        _age(str(tmp_path / "notes.tmp"), 3600)
        other = tmp_path / ".notes.txt.abcd1234.tmp"  # another program's temporary file (mkstemp's shape, no gm-)
        other.write_bytes(b"theirs")
        _age(str(other), 3600)
        atomic_write(tmp_path / "ckpt-00000002.json", lambda t: open(t, "w").write("{}"))
        young = tmp_path / ".ckpt-00000005.json.gm-abcd1234.tmp"  # an instant after its creation: not yet locked
        young.write_bytes(b"")
        check_writable_dir(str(tmp_path), "--checkpoint-dir")
        assert sorted(os.listdir(tmp_path)) == sorted(
            [os.path.basename(live_tmp), "notes.tmp", other.name, "ckpt-00000002.json", young.name]
        )
        assert open(tmp_path / "ckpt-00000002.json").read() == "{}"
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(30)
        assert sweep_stale_writes(tmp_path) == [live_tmp]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
