"""Red team 42: :func:`~geomesh_p2p.model.ckpt_files.checkpoint_dir_problem` says why a folder holds no checkpoint in
one line (``geomesh-peer checkpoints / export / generate`` print it before torch's import), never a traceback: a
``~user`` that names nobody, a folder this user may not read, a broken link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from geomesh_p2p.model.ckpt_files import checkpoint_dir_problem

pytestmark = pytest.mark.timeout(30)


def test_a_home_of_nobody_is_one_line():
    assert checkpoint_dir_problem("~no-such-user-red42/ckpts") == "~no-such-user-red42/ckpts: no such directory"


def test_a_folder_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()

    def refused(self):  # as root the mode bits are no bar: what a user without read permission meets
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refused)
    assert checkpoint_dir_problem(tmp_path / "d") == f"{tmp_path / 'd'}: cannot be read (Permission denied)"


def test_a_folder_under_a_parent_that_cannot_be_searched_is_one_line(tmp_path, monkeypatch):
    real = os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    d = tmp_path / "locked" / "inner"
    assert checkpoint_dir_problem(d) == f"{d}: cannot be read (Permission denied)"


def test_the_plain_cases(tmp_path):
    (tmp_path / "f").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "broken")
    assert checkpoint_dir_problem(tmp_path / "nope") == f"{tmp_path / 'nope'}: no such directory"
    assert checkpoint_dir_problem(tmp_path / "broken") == f"{tmp_path / 'broken'}: no such directory"
    assert checkpoint_dir_problem(tmp_path / "f") == f"{tmp_path / 'f'}: not a directory"
    assert checkpoint_dir_problem(tmp_path) == f"{tmp_path}: no checkpoint (ckpt-NNNNNNNN.json) in this directory"
    (tmp_path / "ckpt-00000003.json").write_text("{}")
    assert checkpoint_dir_problem(tmp_path) is None
