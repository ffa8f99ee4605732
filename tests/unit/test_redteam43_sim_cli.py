"""Red team 43: geomesh-sim's file flags. An output path that cannot be written (``--json`` naming a folder, or a
file in a folder that does not exist; ``--plot`` the same) was found only once every method had been simulated:
the whole run's results lost to an IsADirectoryError / FileNotFoundError traceback. ``--profile`` / ``--data`` of
``~NAME/...`` where no user is called NAME: pathlib's RuntimeError traceback. Now each fails before anything runs,
exit 2, one line naming the flag."""

from __future__ import annotations

import os

import pytest

from geomesh_p2p.sim import cli as sim_cli

pytestmark = pytest.mark.timeout(300)

_USER = "nobody-redteam43"


def _never(*a, **k):  # the simulation itself: it must not start
    raise AssertionError("the simulation ran before the flags were checked")


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--json", "{d}"], "--json {d}: is a folder, expected a file path"),
        (["--json", "{d}/no/such.json"], "--json {d}/no/such.json: folder {d}/no does not exist"),
        (["--plot", "{d}"], "--plot {d}: is a folder, expected a file path"),
        (["--plot", "{d}/no/p.png"], "--plot {d}/no/p.png: folder {d}/no does not exist"),
        (
            ["--profile", f"~{_USER}/p.yaml"],
            f"--profile ~{_USER}/p.yaml: no user {_USER!r} (~NAME is NAME's home folder)",
        ),
        (["--data", f"~{_USER}/c.txt"], f"--data ~{_USER}/c.txt: no user {_USER!r} (~NAME is NAME's home folder)"),
        (["--json", f"~{_USER}/o.json"], f"--json ~{_USER}/o.json: no user {_USER!r} (~NAME is NAME's home folder)"),
    ],
)
def test_a_file_flag_that_cannot_be_used_fails_before_the_run(tmp_path, capsys, monkeypatch, argv, line):
    assert os.path.expanduser(f"~{_USER}") == f"~{_USER}"
    monkeypatch.setattr(sim_cli, "_run", _never)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    assert sim_cli.main([*argv, "--rounds", "1", "--methods", "ddp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"geomesh-sim: error: {line.replace('{d}', str(tmp_path))}"
    assert os.listdir(tmp_path) == []
