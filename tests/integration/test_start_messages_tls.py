"""A plaintext peer joining through a TLS bootstrap (review finding 5): the join error says the bootstrap may
require TLS and names the flags, at once, rather than leaving the user with "Socket closed"."""

from __future__ import annotations

import pytest

from geomesh_p2p.dht import DHTJoinError, DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from tests.integration.test_tls import RUN, _ca, _dht, _tls


@pytest.mark.timeout(60)
async def test_plaintext_join_of_a_tls_bootstrap_hints_at_tls(tmp_path):
    boot = await _dht(_tls(tmp_path, _ca(tmp_path, "run-ca"), "boot"))
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    node = DHTNode(t, rpc_timeout_s=2.0)
    try:
        await t.start()
        with pytest.raises(DHTJoinError) as ei:
            await node.join([boot.address], attempts=1)
        msg = str(ei.value)
        assert msg.startswith("could not join the DHT: no bootstrap node answered (1 attempt(s) over "), msg
        assert msg.endswith(
            "; the bootstrap may require TLS: if the swarm uses TLS, pass --tls-cert/--tls-key/--tls-ca"
        ), msg
    finally:
        await node.shutdown()
        await t.stop(grace=0)
        await boot.shutdown()
        await boot.transport.stop(grace=0)
