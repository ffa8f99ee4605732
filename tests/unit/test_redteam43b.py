"""Red team 43b: the session's lock files and start-up stop, attacked."""

from __future__ import annotations

import errno
import os
import time

import pytest

import geomesh_p2p.util.atomic as atomic
from geomesh_p2p.util.atomic import atomic_write, sweep_stale_writes

pytestmark = pytest.mark.timeout(60)


def _no_flock(fd, op):
    # Lustre mounted without -o flock (the default) answers ENOSYS; an NFS mount whose lock daemon is unreachable ENOLCK
    raise OSError(errno.ENOSYS, "Function not implemented")


def test_atomic_write_works_where_the_file_system_refuses_flock(tmp_path, monkeypatch):
    """The lock is only there so that a later start can tell a dead write from a live one: a file system without
    ``flock`` (Lustre's default, an NFS mount without its lock daemon) must still get its checkpoints written, as
    before the lock existed (it raised ENOSYS/ENOLCK and every checkpoint and cache write failed)."""
    monkeypatch.setattr(atomic.fcntl, "flock", _no_flock)
    target = tmp_path / "ckpt-00000001.json"
    atomic_write(target, lambda t: open(t, "w").write('{"round": 1}'))
    assert target.read_text() == '{"round": 1}'
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.json"]
    # and such a file system's sweep removes nothing: it cannot tell a dead write from a live one there
    old = tmp_path / ".ckpt-00000002.json.gm-abcd1234.tmp"
    old.write_bytes(b"{}")
    t = time.time() - 3600
    os.utime(old, (t, t))
    assert sweep_stale_writes(tmp_path) == [] and old.exists()


@pytest.mark.parametrize("command", ["export", "generate"])
def test_ctrl_c_in_export_or_generate_is_not_a_success(tmp_path, monkeypatch, capsys, command):
    """A Ctrl+C that stops ``export``/``generate`` half-way left no model (or no text): exit 130 as before session 43,
    not join's 'stopped during start-up' with exit 0, which a script's ``export ... && upload`` read as done."""
    import geomesh_p2p.model.export as export

    import peer.tools_cli
    from peer.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(peer.tools_cli, "checkpoint_source_problem", lambda flag, d: None)
    monkeypatch.setattr(export, "export_checkpoint", interrupted)
    monkeypatch.setattr(export, "build_exported", interrupted)
    argv = [command, "--checkpoint-dir", str(tmp_path)]
    argv += ["--out", str(tmp_path / "hf")] if command == "export" else ["--prompt", "hi"]
    assert main(argv) == 130
    assert "start-up" not in capsys.readouterr().err
