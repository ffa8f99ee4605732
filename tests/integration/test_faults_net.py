"""Network faults of issue 14, each as its smallest reproducer: an advertised address nobody can dial
(#5), a restarted bootstrap (#2), skewed clocks (#1)."""

from __future__ import annotations

import json
import signal
import time

import grpc
import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.identity import Identity
from geomesh_p2p.transport import RpcError, Transport, TransportConfig
from tests.dht_helpers import RUN, start_node, stop_all, stop_node
from tests.test_bootstrap import START_TIMEOUT, procs  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


async def _node_advertising(host: str, bootstrap: list[str]) -> DHTNode:
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0, advertise_host=host))
    node = DHTNode(t, rpc_timeout_s=2.0)
    await t.start()
    await node.join(bootstrap)
    return node


# ---------------------------------------------------------------- 5. unreachable advertised address
async def test_a_node_advertising_an_address_nobody_listens_on_becomes_client_only():
    boot = await start_node()
    nodes = [boot]
    try:
        good = await start_node([boot.address])
        nodes.append(good)
        assert good.reachability.reachable is True and good.advertised_address == good.address
        # 127.0.0.9 is loopback, but the node listens on 127.0.0.1 only: nothing answers there
        bad = await _node_advertising("127.0.0.9", [boot.address])
        nodes.append(bad)
        assert bad.address.startswith("127.0.0.9:")
        r = bad.reachability
        assert (r.reachable, r.checked_by, r.address) == (False, (boot.address,), bad.address)
        assert r.reason.startswith("UNAVAILABLE") or r.reason.startswith("DEADLINE_EXCEEDED"), r.reason
        assert bad.advertised_address is None and not bad.serving
        assert bad.self_info().address == ""  # it names no address in its calls: nobody adds it
        # it still uses the DHT as a client, and no node lists it as a contact
        assert await bad.store(f"{RUN}/k", b"from a client", time.time() + 30, owner=bad.identity)
        assert (await good.get(f"{RUN}/k"))[None].value == b"from a client"
        for n in (boot, good):
            assert bad.peer_id not in {c.peer_id for c in n.contacts()}
        nearest = await good.find_nearest_nodes([bad.node_id])
        assert bad.peer_id not in {c.peer_id for _, c in nearest[bad.node_id]}
    finally:
        await stop_all(nodes)


async def test_a_node_restarted_on_its_port_with_its_key_is_dialled_back():
    """A peer restarted with --resume on its old port (same key): the bootstrap's channel to that address
    failed while nobody listened there and sits in gRPC's reconnect backoff; the dial-back must not answer
    with that old "connection refused" (it used to: a false "nobody can dial this node" warning and a
    client-only node that was listening)."""
    boot = await start_node()
    nodes = [boot]
    try:
        ident = Identity.generate()
        first = await start_node([boot.address], identity=ident)
        address = first.address
        assert first.reachability.reachable is True
        await stop_node(first)
        with pytest.raises(RpcError) as dead:  # the bootstrap dials it while it is down (a refresh would)
            await boot.ping(address)
        assert dead.value.code == grpc.StatusCode.UNAVAILABLE
        t = Transport(ident, RUN, TransportConfig(host="127.0.0.1", port=int(address.rsplit(":", 1)[1])))
        again = DHTNode(t, rpc_timeout_s=2.0)
        nodes.append(again)
        assert await t.start() == address
        await again.join([boot.address])
        r = again.reachability
        assert (r.reachable, r.address, r.checked_by, r.reason) == (True, address, (boot.address,), "")
        assert again.advertised_address == address and again.serving
    finally:
        await stop_all(nodes)


async def test_reachability_is_not_checked_without_bootstrap_or_when_client_only():
    alone = await start_node()
    client = await start_node([alone.address], client_only=True)
    try:
        assert alone.reachability.reachable is None and alone.advertised_address == alone.address
        assert client.reachability.reachable is None and client.advertised_address is None
    finally:
        await stop_node(client)
        await stop_node(alone)


def _boot_argv(tmp_path, *extra):
    return ["-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
            "--run-id", "faults", "--status-interval", "0.5", *extra]


def test_process_advertising_an_unreachable_host_warns_and_runs_client_only(tmp_path, procs):  # noqa: F811
    boot = procs(_boot_argv(tmp_path), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    peer = procs(["-m", "geomesh_p2p.dht", "--bootstrap", address, "--run-id", "faults", "--announce",
                  "--advertise-host", "127.0.0.9"], "peer")
    row = json.loads(peer.wait_line(r"^\{", START_TIMEOUT).string)
    assert (row["address"], row["reachable"]) == (None, False)
    assert peer.p.wait(30) == 0
    warnings = [e for e in peer.err if "nobody can dial this node at 127.0.0.9:" in e]
    assert len(warnings) == 1 and "client-only" in warnings[0], peer.err
    assert not any("Traceback" in e for e in peer.err), peer.err
    assert boot.stop(signal.SIGTERM) == 0


def test_bootstrap_and_peer_processes_on_ipv6_loopback(tmp_path, procs):  # noqa: F811
    from tests.test_addr import _has_ipv6_loopback

    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    boot = procs(_boot_argv(tmp_path, "--host", "::1"), "bootstrap")
    address = boot.wait_line(r"serving on (\S+:\d+)", START_TIMEOUT).group(1)
    assert address.startswith("[::1]:")
    peer = procs(["-m", "geomesh_p2p.dht", "--bootstrap", address, "--run-id", "faults", "--announce",
                  "--host", "::1", "--watch", "--period", "0.5"], "peer")
    row = json.loads(peer.wait_line(r"^\{", START_TIMEOUT).string)
    assert row["address"].startswith("[::1]:") and row["reachable"] is True
    me = row["peer_id"]
    peer.wait_line(rf'"peers": \["{me}"\]', 30)  # its announcement, read back over [::1]
    assert peer.stop(signal.SIGTERM) == 0 and not any("Traceback" in e for e in peer.err), peer.err
    assert boot.stop(signal.SIGTERM) == 0


# ---------------------------------------------------------------- 2. a restarted bootstrap
def _dht_argv(address, *extra):
    return ["-m", "geomesh_p2p.dht", "--bootstrap", address, "--run-id", "faults", "--announce", "--watch",
            "--period", "0.5", *extra]


def _wait_file(path, cond, timeout, what):
    """Poll a JSON file until ``cond(data)``; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = json.loads(path.read_text())
            if cond(data):
                return data
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


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


# ---------------------------------------------------------------- 1. skewed clocks
async def _skewed_node(skew_s: float, bootstrap: list[str]) -> DHTNode:
    return await start_node(bootstrap, clock=lambda: time.time() + skew_s)


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
async def test_a_peer_with_a_skewed_clock_sees_and_is_seen_by_the_swarm(skew_s):
    boot = await start_node()
    honest = await start_node([boot.address])
    nodes = [boot, honest]
    try:
        skewed = await _skewed_node(skew_s, [boot.address])
        nodes.append(skewed)
        assert abs(skewed.clock_offset_s + skew_s) < 0.5  # measured from the bootstrap's ping reply
        assert abs(skewed.now() - time.time()) < 0.5
        # records that live 8 s, written on either side, are found on the other
        assert await honest.store(f"{RUN}/from-honest", b"h", honest.now() + 8, owner=honest.identity)
        assert await skewed.store(f"{RUN}/from-skewed", b"s", skewed.now() + 8, owner=skewed.identity)
        assert (await skewed.get(f"{RUN}/from-honest"))[None].value == b"h"
        found = await honest.get(f"{RUN}/from-skewed")
        assert found[None].value == b"s" and found[None].expiration_time < time.time() + 8.5
        # the fault of issue 14 #1, as it was: judged by its own clock, the skewed peer finds nothing
        # (+30 s: every 8 s record looks expired) or keeps records 30 s too long (-30 s)
        skewed.clock_offset_s = 0.0
        if skew_s > 0:
            assert await skewed.get(f"{RUN}/from-honest") == {}
    finally:
        await stop_all(nodes)


async def test_a_clock_beyond_the_tolerance_is_refused_at_join_in_one_line():
    from geomesh_p2p.dht import ClockSkewError
    from geomesh_p2p.errors import UserFacingError

    boot = await start_node()
    try:
        with pytest.raises(ClockSkewError) as e:
            await _skewed_node(100.0, [boot.address])
        msg = str(e.value)
        assert isinstance(e.value, UserFacingError) and "\n" not in msg
        assert msg.startswith(f"this machine's clock is 100 s ahead of the clock of bootstrap {boot.address}; "
                              f"the swarm tolerates 60 s"), msg
    finally:
        await stop_node(boot)


FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


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
