"""Several peers on one host (issue 27): a peer without --threads takes its share of the host's cores."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from geomesh_p2p.node import host


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_a_peer_takes_its_share_of_the_cores_among_the_live_peers_of_its_host(tmp_path, monkeypatch, restore_threads):
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for p in sleepers:
            (tmp_path / str(p.pid)).write_text("")
        (tmp_path / "999999999").write_text("")  # a peer that died without cleaning up: not counted, removed
        (tmp_path / "notes.txt").write_text("")  # not a PID file: ignored
        monkeypatch.setattr(host, "usable_cores", lambda: 8)
        assert host.set_threads(None, directory=tmp_path) == 2 and torch.get_num_threads() == 2  # 8 cores / 4
        assert not (tmp_path / "999999999").exists()
        sleepers[0].kill()
        sleepers[0].wait()
        assert host.live_host_peers(directory=tmp_path) == 3 - 1  # the killed one no longer counts
        assert host.set_threads(3, directory=tmp_path) == 3 and torch.get_num_threads() == 3  # --threads wins
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_an_unwritable_host_directory_counts_this_peer_alone(tmp_path, monkeypatch, restore_threads):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(host, "usable_cores", lambda: 4)
    assert host.live_host_peers(directory=blocker / "peers") == 1
    assert host.set_threads(None, directory=blocker / "peers") == 4
