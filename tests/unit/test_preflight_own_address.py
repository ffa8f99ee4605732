"""Red team 44: a ``--bootstrap`` list that names this peer itself (``--port 7391 --bootstrap 127.0.0.1:7391``: the
first peer of a swarm whose peers share one list). The join leaves its own address out (it starts a new swarm when
nothing else is listed); the pre-flight pinged it, found nothing listening (this peer's port is bound later) and,
since session 44, exited 1 after ~15 s: "nothing listens at 127.0.0.1:7391". It leaves this peer's address out too."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.dht.preflight import check_bootstraps, own_address
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node import joining
from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig
from peer.node_cli import ping_bootstraps_first

pytestmark = pytest.mark.timeout(60)


def test_own_address_is_the_one_the_join_leaves_out():
    assert own_address("127.0.0.1", None, 7391, client_only=False) == "127.0.0.1:7391"
    assert own_address("0.0.0.0", "::1", 7391, client_only=False) == "[::1]:7391"
    assert own_address("127.0.0.1", None, 0, client_only=False) is None  # a free port: not known yet
    assert own_address("127.0.0.1", None, 7391, client_only=True) is None  # serves nothing


def test_the_preflight_pings_no_address_of_this_peer(tmp_path):
    # a unit test: a ping would open a gRPC channel, which fails the test (tests/conftest.py)
    assert asyncio.run(check_bootstraps(Identity.generate(), "R", [" 127.0.0.1:7391 "], own="127.0.0.1:7391")) is None
    ns = argparse.Namespace(
        bootstrap=["127.0.0.1:7391"], port=7391, host="127.0.0.1", advertise_host=None, client_only=False,
        identity=str(tmp_path / "id.key"), run_id="R", join_attempts=2, tls_cert=None, tls_key=None, tls_ca=None,
    )  # fmt: skip
    assert ping_bootstraps_first(ns) is False  # nothing pinged: the node's join decides (a new swarm)


async def test_the_nodes_preflight_pings_no_address_of_this_peer():
    node = PeerNode(
        RunConfig(seq_len=32, pow_bits=4), NodeConfig(port=7391, bootstrap=["127.0.0.1:7391"]), Identity.generate()
    )
    node.transport = SimpleNamespace(address=None)
    await joining.check_bootstrap_run(node, None)
