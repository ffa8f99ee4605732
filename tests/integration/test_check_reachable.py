"""CheckReachable dials only the caller's own IP and says only reachable or a coarse reason: it was a
port scanner for anyone (red team, session 28: asked for another peer's port it named who listens there;
a closed port, a plain TCP listener and an HTTP server each gave their raw gRPC error)."""

from __future__ import annotations

import asyncio
from typing import Optional

import grpc
import pytest

from geomesh_p2p.dht.protocol import dial_back_refusal
from geomesh_p2p.dht.state import DHT_CHECK_REACHABLE, DHT_PROTOCOL_VERSION
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.wire import dht_pb2
from tests.dht_helpers import RUN, start_node, stop_all, stop_node
from tests.proc_util import closed_ports

pytestmark = pytest.mark.timeout(60)

ONLY_OWN_IP = "only the caller's own IP is dialled back"


class _Listener:
    """A plain TCP listener on ``host`` that counts the connections it accepts (and answers nothing)."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self, host: str) -> int:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await reader.read()  # until the dialler gives up
            writer.close()

        self.server = await asyncio.start_server(accept, host, 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is None:
            return
        self.server.close()
        await self.server.wait_closed()


async def _ask(caller: Transport, boot: str, address: str) -> dht_pb2.StoreOutcome:
    """Ask the node at ``boot`` to dial ``address`` back, as ``caller`` (the request names ``address`` as
    the caller's own, the only address the handler takes)."""
    req = dht_pb2.PingRequest(
        sender=dht_pb2.NodeInfo(address=address, peer_id=bytes(caller.identity.peer_id)),
        dht_protocol=DHT_PROTOCOL_VERSION,
    )
    reply = await caller.call(boot, DHT_CHECK_REACHABLE, req.SerializeToString(), timeout=10.0)
    return dht_pb2.StoreOutcome.FromString(reply.payload)


def _client() -> Transport:
    return Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0, client_only=True))


@pytest.mark.parametrize(
    "address, peer, why",
    [
        ("127.0.0.1:7", "ipv4:127.0.0.1:50000", ""),
        ("127.0.0.1:7", "ipv6:[::ffff:127.0.0.1]:50000", ""),  # a dual-stack server sees IPv4 callers so
        ("[::1]:7", "ipv6:[::1]:50000", ""),
        ("[::1]:7", "ipv6:%5B::1%5D:50000", ""),  # how gRPC writes it
        ("[0:0::1]:7", "ipv6:[::1]:50000", ""),
        (
            "127.0.0.2:7",
            "ipv4:127.0.0.1:50000",
            f"the address names 127.0.0.2, but the call comes from 127.0.0.1; {ONLY_OWN_IP}",
        ),
        ("[::1]:7", "ipv4:127.0.0.1:50000", f"the address names ::1, but the call comes from 127.0.0.1; {ONLY_OWN_IP}"),
        ("localhost:7", "ipv4:127.0.0.1:50000", f"the address names host name 'localhost', not an IP; {ONLY_OWN_IP}"),
        ("127.0.0.1:7", "unix:/tmp/s", "the caller's IP is unknown ('unix:/tmp/s')"),
    ],
)
def test_dial_back_only_to_the_callers_own_ip(address, peer, why):
    assert dial_back_refusal(address, peer) == why


async def test_an_address_of_another_host_than_the_callers_is_refused_without_a_dial():
    boot = await start_node(rpc_timeout_s=1.0)
    caller = _client()
    target = _Listener()
    try:
        port = await target.start("127.0.0.2")  # loopback, but not the IP the caller calls from
        sent = boot.stats.rpcs_sent
        for address, why in [
            (f"127.0.0.2:{port}", f"the address names 127.0.0.2, but the call comes from 127.0.0.1; {ONLY_OWN_IP}"),
            (f"localhost:{port}", f"the address names host name 'localhost', not an IP; {ONLY_OWN_IP}"),
        ]:
            with pytest.raises(RpcError) as ei:
                await _ask(caller, boot.address, address)
            assert (ei.value.code, ei.value.reason) == (grpc.StatusCode.PERMISSION_DENIED, f"not checked: {why}")
        await asyncio.sleep(1.5)  # longer than the dial-back's deadline: a dial would have connected by now
        assert target.connections == 0
        assert boot.stats.rpcs_sent == sent
    finally:
        await target.stop()
        await caller.stop(grace=0)
        await stop_node(boot)


async def test_the_callers_own_ip_is_dialled_and_the_reply_names_only_a_coarse_reason():
    boot = await start_node(rpc_timeout_s=1.0)
    other = await start_node()
    me = await start_node()  # serves the DHT's Ping, which the dial-back calls
    caller = me.transport
    target = _Listener()
    try:
        ok = await _ask(caller, boot.address, me.address)
        assert (ok.stored, ok.code, ok.reason) == (True, 0, "")
        port = await target.start("127.0.0.1")
        cases = [
            # another node listens there: its PeerID is not told (it used to be: "reply signed by ...")
            (
                other.address,
                grpc.StatusCode.FAILED_PRECONDITION,
                "wrong identity: another node answers at this address",
            ),
            (
                f"127.0.0.1:{closed_ports(1)[0]}",
                grpc.StatusCode.UNAVAILABLE,
                "refused: no connection could be made to this address",
            ),
            (
                f"127.0.0.1:{port}",
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "timeout: nothing answered at this address in time",
            ),
        ]
        for address, code, reason in cases:
            out = await _ask(caller, boot.address, address)
            assert (out.stored, out.code, out.reason) == (False, code.value[0], reason), address
        assert target.connections >= 1  # the caller's own IP is dialled
        text = str(await _ask(caller, boot.address, other.address))
        assert str(other.peer_id) not in text and other.peer_id.short() not in text
    finally:
        await target.stop()
        await stop_all([boot, other, me])
