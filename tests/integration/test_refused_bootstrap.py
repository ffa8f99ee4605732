"""A ``--bootstrap`` at which nothing listens (a mistyped port: each connection refused) fails the join within
:data:`~geomesh_p2p.dht.preflight.REFUSED_WINDOW_S` seconds, naming the address (it took 63-76 s: the pre-flight
warned and went on, the join's 8 attempts came after torch, the model and the proof of work), while a bootstrap
that starts listening within the window is joined. The pre-flight's and the join's clocks and sleeps are replaced
(no real waits): the tests count the dial attempts and read the fake clock."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from geomesh_p2p.dht import DHTJoinError, DHTNode
from geomesh_p2p.dht import join as join_mod
from geomesh_p2p.dht import preflight
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from tests.dht_helpers import RUN, start_node, stop_node
from tests.swarm_util import dead_address

pytestmark = pytest.mark.timeout(90)


class FakeClock:
    """A monotonic clock moved only by its :meth:`sleep` (which records each wait, seconds); ``on_wait(n)`` is
    awaited after the n-th wait (1-based), e.g. to start a bootstrap there."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.waits: list[float] = []
        self.on_wait = None

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.t += seconds
        if self.on_wait is not None:
            await self.on_wait(len(self.waits))
        await asyncio.sleep(0)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    c = FakeClock()
    for mod in (preflight, join_mod):
        monkeypatch.setattr(mod, "_now", c.now, raising=False)
        monkeypatch.setattr(mod, "_sleep", c.sleep, raising=False)
    return c


@pytest.fixture
def pings(monkeypatch) -> list[list[str]]:
    """The pre-flight's dial rounds: each the addresses pinged."""
    rounds: list[list[str]] = []
    real = preflight.ping_bootstraps

    async def counted(identity, run_id, addresses, *args, **kwargs):
        rounds.append(list(addresses))
        return await real(identity, run_id, addresses, *args, **kwargs)

    monkeypatch.setattr(preflight, "ping_bootstraps", counted)
    return rounds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CountingNode(DHTNode):
    """A DHT node that counts its pings per address (the join's dial attempts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pinged: list[str] = []

    async def ping(self, address, *args, **kwargs):
        self.pinged.append(address)
        return await super().ping(address, *args, **kwargs)


async def _bootstrap_on(port: int) -> DHTNode:
    """A DHT node of this run listening on 127.0.0.1:``port``."""
    transport = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=port))
    node = DHTNode(transport, rpc_timeout_s=2.0)
    await transport.start()
    await node.join([])
    return node


async def test_the_preflight_gives_up_on_an_address_nothing_listens_at(clock, pings, caplog):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.dht.node")
    with dead_address() as dead, pytest.raises(preflight.NothingListensError) as ei:
        await preflight.check_bootstraps(Identity.generate(), RUN, [dead], timeout_s=2.0, attempts=8)
    # 6 tries within the 15 s window (waits 0.5, 1, 2, 4, then 7.5 to end with it), not --join-attempts' 8
    assert pings == [[dead]] * 6
    assert clock.waits == [0.5, 1.0, 2.0, 4.0, 7.5] and clock.t - 1000.0 == preflight.REFUSED_WINDOW_S
    assert str(ei.value) == (
        f"could not join the DHT: nothing listens at {dead} (connection refused at each of 6 attempt(s) in 15 s): "
        "check the --bootstrap address and port, and that the bootstrap runs"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "geomesh_p2p.dht.node"]
    assert lines[0] == f"no answer from {dead} (connection refused); retrying in 0.5 s (attempt 1 of 6)"
    assert lines[-1] == f"no answer from {dead} (connection refused); retrying in 7.5 s (attempt 5 of 6)"
    assert len(lines) == 5


async def test_the_preflight_tries_join_attempts_times_at_most(clock, pings):
    with dead_address() as dead, pytest.raises(preflight.NothingListensError) as ei:
        await preflight.check_bootstraps(Identity.generate(), RUN, [dead, dead], timeout_s=2.0, attempts=2)
    assert pings == [[dead], [dead]] and clock.waits == [0.5]
    assert f"nothing listens at {dead} (connection refused at each of 2 attempt(s) in 0 s)" in str(ei.value)


async def test_the_preflight_joins_a_bootstrap_that_starts_listening(clock, pings):
    port = _free_port()
    boot: list[DHTNode] = []

    async def start_after_two_waits(n: int) -> None:
        if n == 2:
            boot.append(await _bootstrap_on(port))

    clock.on_wait = start_after_two_waits
    try:
        line = await preflight.check_bootstraps(
            Identity.generate(), RUN, [f"127.0.0.1:{port}"], timeout_s=2.0, attempts=8
        )
    finally:
        for b in boot:
            await stop_node(b)
    assert line is None  # it answered at the third try: nothing to warn of
    assert len(pings) == 3 and clock.waits == [0.5, 1.0]


async def test_the_join_gives_up_on_an_address_nothing_listens_at(clock):
    made: list[_CountingNode] = []

    class Node(_CountingNode):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with dead_address() as dead, pytest.raises(DHTJoinError) as ei:
        await start_node([dead], node_cls=Node, join_attempts=8)
    attempts = len(made[0].pinged)
    assert made[0].pinged == [dead] * attempts and attempts == len(clock.waits) + 1
    assert attempts < 8  # the window ended it, not --join-attempts
    assert clock.t - 1000.0 == pytest.approx(preflight.REFUSED_WINDOW_S)
    assert str(ei.value) == (
        f"could not join the DHT: nothing listens at {dead} (connection refused at each of {attempts} attempt(s) "
        "in 15 s): check the --bootstrap address and port, and that the bootstrap runs"
    )


async def test_the_join_joins_a_bootstrap_that_starts_listening(clock):
    port = _free_port()
    boot: list[DHTNode] = []

    async def start_after_two_waits(n: int) -> None:
        if n == 2:
            boot.append(await _bootstrap_on(port))

    clock.on_wait = start_after_two_waits
    node = None
    try:
        node = await start_node([f"127.0.0.1:{port}"], node_cls=_CountingNode, join_attempts=8)
        assert node.pinged[:3] == [f"127.0.0.1:{port}"] * 3 and len(clock.waits) == 2
        assert boot[0].peer_id in node.bootstrap_peers
    finally:
        for n in boot + ([node] if node is not None else []):
            await stop_node(n)


async def test_a_silent_bootstrap_keeps_every_attempt(clock):
    """A bootstrap that accepts TCP and never answers (timeouts, not refusals) may be slow or far: all of
    ``join_attempts`` are tried, the window does not end them."""
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    address = f"127.0.0.1:{hang.getsockname()[1]}"
    made: list[_CountingNode] = []

    class Node(_CountingNode):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    try:
        with pytest.raises(DHTJoinError) as ei:
            await start_node([address], node_cls=Node, join_attempts=3, rpc_timeout_s=0.5)
    finally:
        hang.close()
    assert made[0].pinged == [address] * 3
    assert str(ei.value).startswith("could not join the DHT: no bootstrap node answered (3 attempt(s) over ")
