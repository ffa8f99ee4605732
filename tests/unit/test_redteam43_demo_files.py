"""Red team 43: ``geomesh-peer demo``'s files. ``--summary-json`` naming a folder, or a file in a folder that does
not exist, was found only after the whole demo swarm had run (51 s for one round on a 2-core box): its summary lost
to an IsADirectoryError / NotADirectoryError traceback. ``--workdir`` naming a file: FileExistsError's traceback.
Now both fail before any process starts, exit 2, one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

import peer.demo as demo
from peer.cli import main

pytestmark = pytest.mark.timeout(120)


class _NoSwarm:
    def __init__(self, *a, **k):
        raise AssertionError("the demo swarm started before its files were checked")


@pytest.mark.parametrize(
    "flag,name,line",
    [
        ("--summary-json", "", "--summary-json {p}: is a folder, expected a file path"),
        ("--summary-json", "no/s.json", "--summary-json {p}: folder {d}/no does not exist"),
        ("--workdir", "afile", "--workdir {p}: exists and is not a folder"),
    ],
)
def test_a_demo_file_that_cannot_be_used_fails_before_the_swarm(tmp_path, capsys, monkeypatch, flag, name, line):
    monkeypatch.setattr(demo, "Swarm", _NoSwarm)
    (tmp_path / "afile").write_text("x")
    p = str(tmp_path / name) if name else str(tmp_path)
    assert main(["demo", flag, p, "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "geomesh-peer demo: " + line.format(p=p, d=tmp_path)
    assert (tmp_path / "afile").read_text() == "x"


class _SwarmMade(Exception):
    pass


def test_a_quoted_home_workdir_is_the_home_folder_not_a_folder_named_tilde(tmp_path, monkeypatch):
    """``demo --workdir "~/run"`` (quoted: the shell leaves the ``~``) used a folder literally named ``~`` in the
    working directory (red team 43's note); now ``$HOME/run``, as every other path flag."""
    made = []

    def swarm(workdir):
        made.append(workdir)
        raise _SwarmMade

    monkeypatch.setattr(demo, "Swarm", swarm)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_SwarmMade):
        main(["demo", "--workdir", "~/run", "--rounds", "1"])
    assert made == [tmp_path / "home" / "run"] and made[0].is_dir() and not (tmp_path / "~").exists()


def test_the_makefiles_demo_line_on_a_fresh_clone_starts_the_swarm(tmp_path, monkeypatch):
    """`make demo` runs `demo --workdir runs/demo --summary-json runs/demo/summary.json` where runs/demo does not
    exist yet: the summary's folder is the workdir the demo makes, so it starts (session 43's own check of the
    summary refused it: "folder runs/demo does not exist", caught by a fresh clone's `make demo`). A summary path
    refused elsewhere leaves no workdir behind."""
    made = []

    def swarm(workdir):
        made.append(workdir)
        raise _SwarmMade

    monkeypatch.setattr(demo, "Swarm", swarm)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_SwarmMade):
        main(["demo", "--workdir", "runs/demo", "--summary-json", "runs/demo/summary.json", "--rounds", "1"])
    assert made == [Path("runs/demo")] and (tmp_path / "runs" / "demo").is_dir()
    assert main(["demo", "--workdir", "other", "--summary-json", "no/s.json", "--rounds", "1"]) == 2
    assert made == [Path("runs/demo")] and not (tmp_path / "other").exists()
