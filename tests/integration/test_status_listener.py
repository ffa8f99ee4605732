"""Issue 29 #1: the bootstrap's status page is a bounded listener. Idle sockets (slowloris) neither make a normal
GET wait nor, by filling the descriptor table, take the DHT served by the same process down: connections are
bounded per client and in all (the oldest one that has not sent its request head makes room), and the page
holds at most its share of the descriptor limit (``geomesh_p2p.util.fds``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
import urllib.request

import pytest

from geomesh_p2p.status.http import MAX_CONNECTIONS_PER_CLIENT, StatusServer
from tests.dht_helpers import start_node, stop_node, wait_for

pytestmark = pytest.mark.timeout(120)

IDLE = 300
ATTACKER = "127.0.0.2"  # all of 127.0.0.0/8 is loopback: another client address on this machine


class _Watcher:
    def swarm_json(self) -> bytes:
        return b'{"peers": []}'

    def rounds_json(self) -> bytes:
        return b'{"rounds": []}'


def _open_idle(port: int, n: int, source: str) -> list[socket.socket]:
    """Up to ``n`` connections from ``source`` that never send a byte (stops at the first refusal, e.g. a
    full descriptor table: the old server accepted every one of them)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        try:
            s.settimeout(10)
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            break
        socks.append(s)
    return socks


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:  # the issue: no answer within 5 s
        return r.status, r.read()


def _raw_get(port: int, source: str, path: str) -> bytes:
    """A GET of ``path`` sent from address ``source``: the whole answer (the server closes after it)."""
    with socket.socket() as s:
        s.settimeout(5)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _closed_by_server(s: socket.socket) -> bool:
    """True when the server closed ``s`` (EOF or reset), False while it is open (nothing to read yet)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@contextlib.contextmanager
def _fd_limit(headroom: int):
    """The soft descriptor limit lowered to the descriptors open now plus ``headroom`` (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_idle_sockets_starve_neither_a_get_nor_the_dht_of_the_same_process():
    boot = await start_node()  # the bootstrap's DHT node, in this process
    server = None
    socks: list[socket.socket] = []
    client = None
    try:
        # Room for the 300 idle client sockets of this test and 160 descriptors more: a server that accepted
        # every idle socket too would run out (as the bootstrap did at its real limit).
        with _fd_limit(IDLE + 160):
            server = StatusServer(_Watcher(), "127.0.0.1", 0)
            url = await server.start()
            assert server.max_connections < 64  # its share of this limit (1/16), not the default 64
            socks = await asyncio.to_thread(_open_idle, server.port, IDLE, ATTACKER)
            assert len(socks) == IDLE
            await wait_for(
                lambda: _true(server.evicted + server.open_connections(ATTACKER) == IDLE),
                10,
                0.05,
                "every idle connection handled",
            )
            assert server.open_connections(ATTACKER) == MAX_CONNECTIONS_PER_CLIENT
            assert server.evicted == IDLE - MAX_CONNECTIONS_PER_CLIENT and server.refused == 0
            # a normal GET answers at once ...
            status, body = await asyncio.to_thread(_get, url + "api/swarm")
            assert (status, body) == (200, b'{"peers": []}')
            # ... and the DHT served by the same process still answers a newcomer: join, store, read back
            client = await start_node([boot.address])
            assert await client.store("run/slowloris", b"still here", time.time() + 60)
            assert (await boot.get("run/slowloris"))[None].value == b"still here"
            assert server.open_connections() <= server.max_connections
    finally:
        for s in socks:
            s.close()
        if client is not None:
            await stop_node(client)
        if server is not None:
            await server.stop()
        await stop_node(boot)


async def _true(value: bool) -> bool:
    return value


async def _wait_closed(socks: list[socket.socket], expected: list[bool]) -> None:
    """Wait until which of ``socks`` the server closed is ``expected`` (AssertionError after 10 s)."""

    async def matches() -> bool:
        return [_closed_by_server(s) for s in socks] == expected

    await wait_for(matches, 10, 0.05, f"closed connections {expected}")


async def test_connections_are_bounded_per_client_and_idle_ones_make_room():
    server = StatusServer(_Watcher(), "127.0.0.1", 0, max_connections=12, max_per_client=4)
    await server.start()
    socks: list[socket.socket] = []
    try:
        first = await asyncio.to_thread(_open_idle, server.port, 10, ATTACKER)
        socks += first
        await wait_for(lambda: _true(server.evicted + server.open_connections() == 10), 10, 0.05, "10 handled")
        assert server.open_connections(ATTACKER) == 4
        # the oldest six were closed by the server (the close lands at the loop's next pass), the newest four are open
        await _wait_closed(first, [True] * 6 + [False] * 4)
        # another client is not limited by the first one's bound
        other = await asyncio.to_thread(_open_idle, server.port, 3, "127.0.0.3")
        socks += other
        await wait_for(lambda: _true(server.open_connections("127.0.0.3") == 3), 10, 0.05, "3 from 127.0.0.3")
        assert server.evicted == 6 and server.open_connections() == 7
        # a GET from the first client's own address is answered: its oldest idle connection makes room
        answer = await asyncio.to_thread(_raw_get, server.port, ATTACKER, "/api/rounds")
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"rounds": []}')
        assert server.evicted == 7 and server.requests == 1
        await _wait_closed(first, [True] * 7 + [False] * 3)
        # over the total (12): the oldest idle connection of all makes room, whichever client it is
        socks += await asyncio.to_thread(_open_idle, server.port, 3, "127.0.0.4")
        for source in ("127.0.0.5", "127.0.0.6"):
            socks += await asyncio.to_thread(_open_idle, server.port, 3, source)
        # 3 + 3 + 3 + 3 + 3 idle (the GET's connection closed after its answer): 15 > 12, so the three oldest
        # of all, the first client's, made room
        await wait_for(lambda: _true(server.evicted + server.open_connections() == 22), 10, 0.05, "22 handled")
        assert server.open_connections() == 12 and server.evicted == 7 + 3 and server.refused == 0
        assert server.open_connections(ATTACKER) == 0 and server.open_connections("127.0.0.6") == 3
        await _wait_closed(first, [True] * 10)
    finally:
        for s in socks:
            s.close()
        await server.stop()


async def test_the_peer_metrics_listener_is_bounded_per_client_too():
    """The same kind on a peer's --metrics-port: prometheus_client's server gave every idle socket a thread with
    no timeout. Now connections over the per-client bound are closed at once and a scrape still answers."""
    from geomesh_p2p.telemetry.metrics import RoundLog
    from geomesh_p2p.telemetry.metrics_http import MAX_PER_CLIENT

    rl = RoundLog(None, 0, print_fn=lambda line: None)
    socks: list[socket.socket] = []
    try:
        port = rl.metrics_port
        socks = await asyncio.to_thread(_open_idle, port, MAX_PER_CLIENT + 6, ATTACKER)
        assert len(socks) == MAX_PER_CLIENT + 6

        async def over_bound_closed() -> bool:
            return all([_closed_by_server(s) for s in socks[MAX_PER_CLIENT:]])

        await wait_for(over_bound_closed, 10, 0.05, "the connections over the per-client bound to be closed")
        assert not any(_closed_by_server(s) for s in socks[:MAX_PER_CLIENT])  # served (until their timeout)
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"geomesh_round" in body
    finally:
        for s in socks:
            s.close()
        rl.close()


async def test_a_metrics_client_trickling_its_request_is_cut_at_the_request_deadline(monkeypatch, capfd):
    """Red team: the per-read timeout was reset by every byte, so a client sending one byte every few seconds
    held its slot for good (16 of them shut a scraper out), and each timed-out connection printed a traceback.
    Now a connection has REQUEST_DEADLINE_S in all, and a failed one logs at DEBUG only."""
    from geomesh_p2p.telemetry import metrics_http
    from geomesh_p2p.telemetry.metrics import RoundLog

    monkeypatch.setattr(metrics_http, "REQUEST_DEADLINE_S", 1.0)
    rl = RoundLog(None, 0, print_fn=lambda line: None)
    s = socket.create_connection(("127.0.0.1", rl.metrics_port), timeout=5)
    try:
        sent = 0
        s.sendall(b"GET /metrics HTTP/1.1\r\n")

        def trickle_until_cut() -> int:
            nonlocal sent
            for _ in range(100):  # one header byte every 0.1 s: 10 s if nothing cuts it
                try:
                    s.sendall(b"X")
                    sent += 1
                except OSError:
                    return sent
                if _closed_by_server(s):
                    return sent
                time.sleep(0.1)
            return sent

        n = await asyncio.to_thread(trickle_until_cut)
        assert n < 100, "the trickling client was never cut"
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{rl.metrics_port}/metrics")
        assert status == 200 and b"geomesh_round" in body
    finally:
        s.close()
        rl.close()
    assert "Traceback" not in capfd.readouterr().err
