"""--allow-peers (issue 15): a node of a private run refuses a peer not on its allow-list, with the reason
in the refusing node's log and in the refused peer's error; listed peers work as before."""

from __future__ import annotations

import time

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.dht import DHTJoinError, DHTNode
from geomesh_p2p.net.identity import Identity, allow_list
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig

RUN = "allow-test-run"
REASON = "not on this node's allow-list, --allow-peers"


async def _node(identity, allow, bootstrap=(), **kw) -> DHTNode:
    t = Transport(identity, RUN, TransportConfig(host="127.0.0.1", port=0), allow=allow)
    node = DHTNode(t, rpc_timeout_s=2.0, **kw)
    await t.start()
    await node.join(list(bootstrap))
    return node


@pytest.mark.timeout(60)
async def test_a_peer_off_the_allow_list_is_refused_with_the_reason_on_both_sides():
    boot_id, insider_id, outsider_id = Identity.generate(), Identity.generate(), Identity.generate()
    members = [str(boot_id.peer_id), str(insider_id.peer_id)]
    nodes: list[DHTNode] = []
    try:
        boot = await _node(boot_id, allow_list(members))
        nodes.append(boot)
        insider = await _node(insider_id, allow_list(members), [boot.address])
        nodes.append(insider)
        assert await insider.store("private/key", b"members only", time.time() + 120)
        assert (await boot.get("private/key"))[None].value == b"members only"

        t = Transport(outsider_id, RUN, TransportConfig(host="127.0.0.1", port=0))
        outsider = DHTNode(t, rpc_timeout_s=2.0, join_attempts=1)
        nodes.append(outsider)
        await t.start()
        with events.capture("call_refused") as refused:
            with pytest.raises(DHTJoinError) as ei:
                await outsider.join([boot.address])
        # the refused peer's error: who refused, the status and why
        msg = str(ei.value)
        assert boot.address in msg and "PERMISSION_DENIED" in msg and REASON in msg, msg
        assert outsider_id.peer_id.short() in msg
        # the refusing node's log: one line with the method, the caller and the same reason
        facts = [(e["peer"], e["method"], e["code"]) for e in refused if REASON in e["reason"]]
        assert facts == [(str(boot_id.peer_id), "/geomesh.wire.Dht/Ping", "PERMISSION_DENIED")], refused
        (e,) = [e for e in refused if REASON in e["reason"]]
        assert e["caller_address"].startswith("ipv4:127.0.0.1:") and outsider_id.peer_id.short() in e["reason"]
        # nothing of the outsider entered the members' routing tables
        assert outsider_id.peer_id not in {c.peer_id for n in nodes[:2] for c in n.contacts()}
    finally:
        for n in nodes:
            await n.shutdown()
            await n.transport.stop(grace=0)
