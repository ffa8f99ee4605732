"""The process-level tests of ``tests/integration/test_faults_net.py`` (they start OS processes)."""

from __future__ import annotations

import json
import signal
import pytest
from tests.e2e.test_bootstrap import START_TIMEOUT, procs  # noqa: F401  (the fixture)
from tests.integration.test_faults_net import FAKETIME_LIB, _boot_argv, _dht_argv, _wait_file  # noqa: F401


def test_process_advertising_an_unreachable_host_warns_and_runs_client_only(tmp_path, procs):  # noqa: F811
    boot = procs(_boot_argv(tmp_path), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    peer = procs(_dht_argv(address, "--advertise-host", "127.0.0.9", watch=False), "peer")  # one row, then exit
    row = json.loads(peer.wait_line(r"^\{", START_TIMEOUT).string)
    assert (row["address"], row["reachable"]) == (None, False)
    assert peer.p.wait(30) == 0
    warnings = [e for e in peer.err if "nobody can dial this node at 127.0.0.9:" in e]
    assert len(warnings) == 1 and "client-only" in warnings[0], peer.err
    assert not any("Traceback" in e for e in peer.err), peer.err
    assert boot.stop(signal.SIGTERM) == 0


def test_bootstrap_and_peer_processes_on_ipv6_loopback(tmp_path, procs):  # noqa: F811
    from tests.integration.test_addr import _has_ipv6_loopback

    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    boot = procs(_boot_argv(tmp_path, "--host", "::1"), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    assert address.startswith("[::1]:")
    peer = procs(_dht_argv(address, "--host", "::1"), "peer")
    row = json.loads(peer.wait_line(r"^\{", START_TIMEOUT).string)
    assert row["address"].startswith("[::1]:") and row["reachable"] is True
    me = row["peer_id"]
    peer.wait_line(rf'"peers": \["{me}"\]', 30)  # its announcement, read back over [::1]
    assert peer.stop(signal.SIGTERM) == 0 and not any("Traceback" in e for e in peer.err), peer.err
    assert boot.stop(signal.SIGTERM) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("state", ["saved", "none"])
def test_newcomer_joining_through_a_restarted_bootstrap_finds_the_swarm(tmp_path, procs, state):  # noqa: F811
    """SIGKILL the bootstrap of a swarm, restart it on the same address: a newcomer joining through it
    sees the swarm. 'saved': the bootstrap re-dials the routing table it saved; 'none' (--state-file ''):
    the old peers' periodic ping of their bootstrap makes it learn them again."""
    extra = ["--state-file", ""] if state == "none" else []
    # Port 0 first (the OS picks a free one, no race); the restart takes the port the first one bound.
    boot = procs(_boot_argv(tmp_path, *extra), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    argv = _boot_argv(tmp_path, *extra, "--port", address.rsplit(":", 1)[1])
    old = [procs(_dht_argv(address), f"peer{i}") for i in range(2)]
    ids = sorted(json.loads(p.wait_line(r"^\{", START_TIMEOUT).string)["peer_id"] for p in old)
    for p in old:
        p.wait_line(rf'"peers": \["{ids[0]}", "{ids[1]}"\]', 30)
    if state == "saved":
        _wait_file(tmp_path / "boot.state.json", lambda d: len(d["contacts"]) == 2, 30, "the saved routing table")
    boot.stop(signal.SIGKILL)
    for _ in range(8):  # ~4 s of announcements: each old peer drops the dead bootstrap from its table
        old[0].wait_line(r"^\{", 30)
    boot = procs(argv, "bootstrap-restarted")
    assert boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1) == address
    new = procs(_dht_argv(address), "newcomer")
    me = json.loads(new.wait_line(r"^\{", START_TIMEOUT).string)["peer_id"]
    everyone = '", "'.join(sorted(ids + [me]))
    new.wait_line(rf'"peers": \["{everyone}"\]', 30)
    for p in old + [new]:
        assert p.stop(signal.SIGTERM) == 0 and not any("Traceback" in e for e in p.err), p.err
    assert boot.stop(signal.SIGTERM) == 0


@pytest.mark.timeout(240)
def test_newcomer_of_a_run_whose_peers_all_left_learns_the_round_it_was_at(tmp_path, procs):  # noqa: F811
    """The bootstrap saw the run at round 7, every peer left, the bootstrap restarted: a newcomer finds
    no live peer but learns round 7 (so it can say so and wait or resume, not restart at round 0)."""
    boot = procs(_boot_argv(tmp_path), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    argv = _boot_argv(tmp_path, "--port", address.rsplit(":", 1)[1])  # the restart: the same address
    peer = procs(_dht_argv(address, "--round", "7"), "peer")
    peer.wait_line(r'"progress": 7', 30)  # the bootstrap published it, the peer reads it back
    _wait_file(tmp_path / "boot.state.json", lambda d: (d["progress"] or {}).get("round") == 7, 30, "saved round")
    assert peer.stop(signal.SIGTERM) == 0
    boot.stop(signal.SIGKILL)
    boot = procs(argv, "bootstrap-restarted")
    boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT)
    new = procs(["-m", "geomesh_p2p.dht", "--bootstrap", address, "--run-id", "faults"], "newcomer")
    row = json.loads(new.wait_line(r"^\{", START_TIMEOUT).string)
    assert (row["peers"], row["progress"]) == ([], 7)
    assert new.p.wait(30) == 0
    assert boot.stop(signal.SIGTERM) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("skew", ["+30s", "-30s", "+100s"])
def test_process_with_a_faked_clock_joins_or_is_refused_in_one_line(tmp_path, procs, monkeypatch, skew):  # noqa: F811
    """libfaketime moves the whole process's wall clock (envelopes included); its monotonic clock is
    left alone (timeouts)."""
    import os

    if not os.path.exists(FAKETIME_LIB):
        pytest.skip(f"libfaketime is not installed ({FAKETIME_LIB}; apt-get install libfaketime)")
    boot = procs(_boot_argv(tmp_path), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    honest = procs(_dht_argv(address, "--put", "faults/h=from honest", "--get", "faults/s"), "honest")
    h_id = json.loads(honest.wait_line(r"^\{", START_TIMEOUT).string)["peer_id"]
    monkeypatch.setenv("LD_PRELOAD", FAKETIME_LIB)
    monkeypatch.setenv("FAKETIME", skew)
    monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    monkeypatch.setenv("FAKETIME_NO_CACHE", "1")
    skewed = procs(_dht_argv(address, "--put", "faults/s=from skewed", "--get", "faults/h"), "skewed")
    monkeypatch.delenv("LD_PRELOAD")
    if skew == "+100s":
        assert skewed.p.wait(START_TIMEOUT) == 1
        lines = [e for e in skewed.err if e.strip()]
        assert len(lines) == 1 and "clock is 100 s ahead of the clock of bootstrap" in lines[0], skewed.err
    else:
        s_id = json.loads(skewed.wait_line(r"^\{", START_TIMEOUT).string)["peer_id"]
        both = '", "'.join(sorted([h_id, s_id]))
        skewed.wait_line(rf'"peers": \["{both}"\].*"faults/h": "from honest"', 30)
        honest.wait_line(rf'"peers": \["{both}"\].*"faults/s": "from skewed"', 30)
        assert skewed.stop(signal.SIGTERM) == 0 and not any("Traceback" in e for e in skewed.err), skewed.err
    assert honest.stop(signal.SIGTERM) == 0
    assert boot.stop(signal.SIGTERM) == 0
