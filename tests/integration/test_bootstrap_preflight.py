"""The join's pre-flight ping (:func:`geomesh_p2p.node.joining.check_bootstrap_run`, red team of session 16):
it names a bootstrap of another run at once, but never refuses a swarm the join itself would have joined: a
good bootstrap that is not up yet (refused connection) or hangs (accepts TCP, never answers) is retried by the
join, so another run's bootstrap next to it is no reason to stop before the join has tried."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.dht.state import OtherRunError
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node import joining
from tests.dht_helpers import start_node, stop_node

pytestmark = pytest.mark.timeout(60)


def _node(bootstrap: list[str], run_id: str = "run-b") -> SimpleNamespace:
    """What check_bootstrap_run reads of a PeerNode (its config and identity)."""
    return SimpleNamespace(
        cfg=NodeConfig(bootstrap=bootstrap),
        run_cfg=RunConfig(seq_len=32, run_id=run_id, pow_bits=40),
        identity=Identity.generate(),
    )


def _closed_port() -> str:
    """127.0.0.1:<a port nobody listens on> (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


async def test_another_runs_bootstrap_is_named_when_it_is_the_only_answer():
    boot = await start_node(run_id="run-a")
    try:
        with pytest.raises(OtherRunError, match="serves run 'run-a'"):
            await asyncio.wait_for(joining.check_bootstrap_run(_node([boot.transport.address]), None, 2.0), 20)
    finally:
        await stop_node(boot)


async def test_a_good_bootstrap_not_up_yet_is_left_to_the_join():
    """One bootstrap of another run and one that refuses the connection (still starting): the join retries
    the second (dht/join.py: not a definitive answer), so the pre-flight must not refuse the swarm."""
    boot = await start_node(run_id="run-a")
    try:
        node = _node([boot.transport.address, _closed_port()])
        await asyncio.wait_for(joining.check_bootstrap_run(node, None, 2.0), 20)  # no OtherRunError
    finally:
        await stop_node(boot)


async def test_a_hanging_bootstrap_is_left_to_the_join():
    """A bootstrap that accepts TCP and never answers: the pre-flight gives up at its timeout and leaves it to
    the join (no OtherRunError because of the other run's bootstrap next to it)."""
    boot = await start_node(run_id="run-a")
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts (the kernel's backlog), never reads nor answers
    try:
        node = _node([boot.transport.address, f"127.0.0.1:{hang.getsockname()[1]}"])
        await asyncio.wait_for(joining.check_bootstrap_run(node, None, 1.0), 20)
    finally:
        hang.close()
        await stop_node(boot)
