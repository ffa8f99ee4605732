"""geomesh_p2p.net.addr: the one host:port parser/formatter (IPv6 literals in brackets), and IPv6 end to end
(issue 14 #5: ``--host ::1`` failed with "Misformatted domain name")."""

from __future__ import annotations

import socket

import pytest

from geomesh_p2p.net.addr import (
    AddressError,
    canonical_address,
    format_address,
    host_of,
    is_loopback_host,
    is_wildcard_host,
    parse_address,
    valid_address,
)
from geomesh_p2p.dht import DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from tests.dht_helpers import stop_node

pytestmark = pytest.mark.timeout(60)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host,port,text",
    [
        ("127.0.0.1", 5, "127.0.0.1:5"),
        ("::1", 31337, "[::1]:31337"),
        ("[::1]", 31337, "[::1]:31337"),
        ("::", 0, "[::]:0"),
        ("fe80::1%eth0", 7, "[fe80::1%eth0]:7"),
        ("example.org", 80, "example.org:80"),
    ],
)
def test_format_brackets_ipv6_literals_only(host, port, text):
    assert format_address(host, port) == text


@pytest.mark.parametrize(
    "text,parsed",
    [
        ("127.0.0.1:5", ("127.0.0.1", 5)),
        ("[::1]:31337", ("::1", 31337)),
        ("[2001:db8::7]:65535", ("2001:db8::7", 65535)),
        (" example.org:80 ", ("example.org", 80)),
    ],
)
def test_parse_round_trips(text, parsed):
    assert parse_address(text) == parsed
    assert format_address(*parse_address(text)) == text.strip()
    assert valid_address(text)


@pytest.mark.parametrize(
    "text,says",
    [
        ("::1:31337", "needs brackets, e.g. [::1]:31337"),
        ("http://127.0.0.1:31337", "is a URL: expected HOST:PORT without http://, e.g. 127.0.0.1:31337"),
        ("grpc://[::1]:5/", "is a URL: expected HOST:PORT without grpc://, e.g. [::1]:5"),
        ("127.0.0.1", "has no port"),
        (":5", "has no host"),
        ("[::1]", "is not [IPV6]:PORT"),
        ("[::1]:0", "port '0' is not a number in 1..65535"),
        ("h:65536", "port '65536'"),
        ("h:x", "port 'x'"),
        ("[nonsense:]:5", "is not an IPv6 address"),
        ("h" * 300 + ":5", "at most 256"),
        # red team 42: what a URL or a non-IPv6 host with ':' is told (one line; no advice that fails in turn)
        ("http://h:5\nINJECTED", "is a URL: expected HOST:PORT without http://"),
        ("http://h:5\x1b[31m", "is a URL: expected HOST:PORT without http://"),
        ("a\nb://h:5", "is a URL: expected HOST:PORT"),
        ("::1:5\nx", "needs brackets"),
        ("http://h:5/path?q=1", "without http://, e.g. h:5"),
        ("http://user:pw@h:5", "without http://, e.g. h:5"),
        ("http://", "is a URL: expected HOST:PORT without http://"),
        ("://x:5", "is a URL: expected HOST:PORT"),
        ("a:b://c:5", "is a URL: expected HOST:PORT"),
        ("user:pw@host:5", "holds ':' but is not an IPv6 address"),
        ("http:/h:5", "holds ':' but is not an IPv6 address"),
        ("2001:db8::7", "has no port: expected [IPV6]:PORT"),
        ("h:\u00b2", "port '\u00b2' is not a number"),
        ("h:\uff15", "port '\uff15' is not a number"),
    ],
)
def test_parse_refuses_with_one_line_naming_the_problem(text, says):
    with pytest.raises(AddressError) as e:
        parse_address(text)
    assert says in str(e.value) and str(e.value).isprintable()
    if ", e.g. " in str(e.value):  # the address it suggests is one
        assert valid_address(str(e.value).partition(", e.g. ")[2]), str(e.value)
    assert not valid_address(text)


def test_helpers():
    assert canonical_address(" [::1]:7") == "[::1]:7"
    assert host_of("[::1]:7") == "::1" and host_of("10.0.0.1:7") == "10.0.0.1"
    assert [is_loopback_host(h) for h in ("::1", "[::1]", "127.0.0.9", "localhost", "10.0.0.1")] == [
        True,
        True,
        True,
        True,
        False,
    ]
    assert [is_wildcard_host(h) for h in ("0.0.0.0", "::", "[::]", "", "127.0.0.1")] == [True, True, True, True, False]
    with pytest.raises(AddressError):
        format_address("::1", 70000)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
async def test_dht_nodes_serve_and_join_on_ipv6_loopback(host):
    nodes = []
    try:
        for i in range(2):
            t = Transport(Identity.generate(), "v6-run", TransportConfig(host=host, port=0))
            node = DHTNode(t, rpc_timeout_s=2.0)
            nodes.append(node)
            address = await t.start()
            assert address.startswith("[::1]:") and parse_address(address)[0] == "::1"
            await node.join([nodes[0].address] if i else [])
        assert nodes[1].reachability.reachable is True  # the first node dialled it back at [::1]:port
        assert [c.address for c in nodes[1].contacts()] == [nodes[0].address]
        assert await nodes[1].store("v6/key", b"over v6", __import__("time").time() + 30)
        found = await nodes[0].get("v6/key")
        assert found[None].value == b"over v6"
    finally:
        for n in nodes:
            await stop_node(n)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
async def test_transport_binds_every_ipv6_interface_with_host_double_colon():
    t = Transport(Identity.generate(), "v6-run", TransportConfig(host="::", port=0, advertise_host="::1"))
    try:
        address = await t.start()
        assert address.startswith("[::1]:")
    finally:
        await t.stop(grace=0)


async def test_transport_refuses_a_bad_host_with_oserror_in_one_line():
    t = Transport(Identity.generate(), "r", TransportConfig(host="no:such:host", port=0))
    with pytest.raises(OSError) as e:
        await t.start()
    assert "holds ':' but is not an IPv6 address" in str(e.value)
    await t.stop(grace=0)
