"""TLS of the transport (issue 15): --tls-cert/--tls-key/--tls-ca reach transport.TlsConfig on the server and
client side; a bootstrap and 2 peers talk over mutual TLS; plaintext and foreign-CA clients are refused; a bad
or missing file fails at start naming it."""

from __future__ import annotations

import datetime
import ipaddress
import time

import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import DHT_PING
from geomesh_p2p.net.tls import TlsConfig, TlsError, tls_from_flags

RUN = "tls-test-run"


def _ca(tmp, name: str):
    """A self-signed CA: (key, cert, path of its PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, str(path)


def _node_cert(tmp, ca, name: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (IP SAN) signed by ``ca``: (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key, ca_cert, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    c, k = tmp / f"{name}.crt", tmp / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(c), str(k)


def _tls(tmp, ca, name: str) -> TlsConfig:
    cert, key = _node_cert(tmp, ca, name)
    return tls_from_flags(cert, key, ca[2])


async def _dht(tls, bootstrap=()) -> DHTNode:
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0, tls=tls))
    node = DHTNode(t, rpc_timeout_s=2.0)
    await t.start()
    await node.join(list(bootstrap))
    return node


@pytest.mark.timeout(60)
async def test_bootstrap_and_two_peers_talk_over_tls_and_plaintext_or_foreign_clients_are_refused(tmp_path):
    ca = _ca(tmp_path, "run-ca")
    nodes: list[DHTNode] = []
    outsiders: list[Transport] = []
    try:
        boot = await _dht(_tls(tmp_path, ca, "boot"))
        nodes.append(boot)
        for name in ("p1", "p2"):
            nodes.append(await _dht(_tls(tmp_path, ca, name), [boot.address]))
        p1, p2 = nodes[1], nodes[2]
        assert await p1.store("tls/key", b"over tls", time.time() + 120)
        found = await p2.get("tls/key", latest=True)
        assert found[None].value == b"over tls"
        assert {c.peer_id for c in p2.contacts()} >= {boot.transport.identity.peer_id, p1.transport.identity.peer_id}

        # A plaintext client gets no answer from a TLS node (the handshake never happens).
        plain = Transport(Identity.generate(), RUN, TransportConfig(client_only=True, default_timeout_s=3.0))
        outsiders.append(plain)
        with pytest.raises(RpcError) as ei:
            await plain.call(boot.address, DHT_PING, b"x")
        assert ei.value.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), ei.value
        # A client whose certificate another CA signed is refused too (mutual TLS: the server checks --tls-ca).
        other = _ca(tmp_path, "other-ca")
        cert, key = _node_cert(tmp_path, other, "stranger")
        foreign = Transport(
            Identity.generate(),
            RUN,
            TransportConfig(client_only=True, default_timeout_s=3.0, tls=tls_from_flags(cert, key, ca[2])),
        )
        outsiders.append(foreign)
        with pytest.raises(RpcError) as ei:
            await foreign.call(boot.address, DHT_PING, b"x")
        assert ei.value.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), ei.value
        # ... and a TLS client that does not trust the run's CA refuses the server.
        distrust = Transport(
            Identity.generate(),
            RUN,
            TransportConfig(client_only=True, default_timeout_s=3.0, tls=tls_from_flags(cert, key, other[2])),
        )
        outsiders.append(distrust)
        with pytest.raises(RpcError):
            await distrust.call(boot.address, DHT_PING, b"x")
        # The swarm's own nodes still answer each other.
        assert await p1.ping(p2.address)
    finally:
        for t in outsiders:
            await t.stop(grace=0)
        for n in nodes:
            await n.shutdown()
            await n.transport.stop(grace=0)


@pytest.mark.timeout(30)
def test_bad_or_missing_tls_files_fail_naming_them(tmp_path):
    ca = _ca(tmp_path, "ca")
    cert, key = _node_cert(tmp_path, ca, "n")
    other_cert, other_key = _node_cert(tmp_path, ca, "m")
    assert tls_from_flags(None, None, None) is None
    assert tls_from_flags(None, None, ca[2]).ca_file == ca[2]  # a client-only node needs the CA only
    missing = str(tmp_path / "nope.pem")
    cases = [
        ((missing, key, ca[2]), f"--tls-cert {missing}: cannot read it"),
        ((cert, key, missing), f"--tls-ca {missing}: cannot read it"),
        ((cert, ca[2], ca[2]), f"--tls-key {ca[2]}: not an unencrypted PEM private key"),
        ((key, key, ca[2]), f"--tls-cert {key}: not a PEM certificate"),
        ((cert, other_key, None), f"--tls-key {other_key} is not the private key of --tls-cert {cert}"),
        ((cert, None, ca[2]), "--tls-cert and --tls-key go together"),
    ]
    for args, want in cases:
        with pytest.raises(TlsError) as ei:
            tls_from_flags(*args)
        assert want in str(ei.value), (args, str(ei.value))
    del other_cert


@pytest.mark.timeout(60)
def test_bootstrap_and_join_take_the_tls_flags(tmp_path, capsys):
    from bootstrap.cli import main as boot_main
    from bootstrap.cli import parse as boot_parse
    from peer.cli import build_parser
    from peer.node_cli import node_config_from

    ca = _ca(tmp_path, "ca")
    cert, key = _node_cert(tmp_path, ca, "n")
    flags = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca[2]]
    ns = boot_parse(flags)
    assert (ns.tls_cert, ns.tls_key, ns.tls_ca) == (cert, key, ca[2])
    cfg = node_config_from(build_parser().parse_args(["join", *flags]))
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (cert, key, ca[2])
    missing = str(tmp_path / "gone.key")
    assert (
        boot_main(
            [
                "--tls-cert",
                cert,
                "--tls-key",
                missing,
                "--tls-ca",
                ca[2],
                "--identity",
                str(tmp_path / "b.key"),
                "--port",
                "0",
                "--state-file",
                "",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tls-key {missing}: cannot read it" in err, err


@pytest.mark.timeout(60)
async def test_a_peer_node_with_a_bad_tls_file_fails_at_start_naming_it(tmp_path):
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from geomesh_p2p.node.peer import PeerNode

    ca = _ca(tmp_path, "ca")
    cert, _ = _node_cert(tmp_path, ca, "n")
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    node = PeerNode(
        RunConfig(seq_len=32), NodeConfig(tls_cert=cert, tls_key=str(bad), tls_ca=ca[2]), identity=Identity.generate()
    )
    with pytest.raises(TlsError, match=f"--tls-key {bad}: not an unencrypted PEM private key"):
        await node.start()
    assert getattr(node, "transport", None) is None  # nothing was listening
