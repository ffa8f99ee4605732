"""TLS of the gRPC connections (``--tls-cert``, ``--tls-key``, ``--tls-ca``): :class:`TlsConfig` checks
the PEM files at start (one-line :class:`TlsError` naming the flag and the file) and makes the server
and channel credentials the transport uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import grpc
import grpc.aio

from geomesh_p2p.util.errors import UserFacingError


class TlsError(UserFacingError, ValueError):
    """A TLS file (``--tls-cert/--tls-key/--tls-ca``) is missing, unreadable or not what it should be; the
    message names the flag and the file."""


@dataclass
class TlsConfig:
    """TLS of every gRPC connection (``--tls-cert``, ``--tls-key``, ``--tls-ca``): PEM file paths.

    * Server: ``cert_file`` + ``key_file`` (its certificate chain and private key). With ``ca_file`` too,
      the server requires each caller to present a certificate signed by that CA (mutual TLS).
    * Client: ``ca_file``, the root the servers' certificates must chain to (None: the system roots);
      ``cert_file`` + ``key_file``, when given, are presented to servers that ask for one.

    A certificate must name the address others dial (an IP SAN such as 127.0.0.1, or the DNS name).
    TLS authenticates and encrypts the connection; who sent a message is still the Ed25519 envelope
    (``identity.Verifier``), checked on every request and reply as without TLS.
    """

    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None
    _pem: Dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)

    def check(self) -> "TlsConfig":
        """Read and validate the files once (blocking file I/O; call it at start-up). Returns ``self``.

        Raises:
            TlsError: a key without a certificate or the reverse; a file missing or unreadable; a file that
                holds no PEM certificate (cert, CA) or private key (key); a key that does not belong to the
                certificate. The message names the flag and the file.
        """
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("--tls-cert and --tls-key go together (the server's certificate and its private key)")
        if not (self.cert_file or self.ca_file):
            raise TlsError("TLS needs --tls-cert/--tls-key (a server), --tls-ca (a client), or all three")
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        certs = {}
        for flag, path, what in (
            ("--tls-cert", self.cert_file, "cert"),
            ("--tls-ca", self.ca_file, "cert"),
            ("--tls-key", self.key_file, "key"),
        ):
            if path is None:
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise TlsError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
            try:
                if what == "cert":
                    certs[flag] = x509.load_pem_x509_certificates(data)[0]
                else:
                    key = serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as e:
                kind = "a PEM certificate" if what == "cert" else "an unencrypted PEM private key"
                raise TlsError(f"{flag} {path}: not {kind} ({str(e).splitlines()[0] if str(e) else e})") from None
            self._pem[flag] = data
        if self.cert_file is not None:
            pub = serialization.PublicFormat.SubjectPublicKeyInfo
            enc = serialization.Encoding.DER
            if key.public_key().public_bytes(enc, pub) != certs["--tls-cert"].public_key().public_bytes(enc, pub):
                raise TlsError(f"--tls-key {self.key_file} is not the private key of --tls-cert {self.cert_file}")
        return self

    def _bytes(self, flag: str) -> Optional[bytes]:
        if not self._pem:
            self.check()
        return self._pem.get(flag)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials: ``key_file`` + ``cert_file``; callers must present a certificate signed by
        ``ca_file`` when it is set. Raises TlsError (see :meth:`check`) or when no certificate is set."""
        if self.cert_file is None:
            raise TlsError("a TLS server needs --tls-cert and --tls-key (or run it --client-only)")
        ca = self._bytes("--tls-ca")
        return grpc.ssl_server_credentials(
            [(self._bytes("--tls-key"), self._bytes("--tls-cert"))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: servers are checked against ``ca_file`` (None: the system roots); this node's
        certificate and key, when set, answer a server's request for one. Raises TlsError (:meth:`check`)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._bytes("--tls-ca"),
            private_key=self._bytes("--tls-key"),
            certificate_chain=self._bytes("--tls-cert"),
        )


def tls_from_flags(cert: Optional[str], key: Optional[str], ca: Optional[str]) -> Optional[TlsConfig]:
    """The checked :class:`TlsConfig` of ``--tls-cert/--tls-key/--tls-ca`` (None when none is given: plaintext).
    Blocking file reads (call it at start-up, off the event loop). Raises TlsError naming the flag and file."""
    if not (cert or key or ca):
        return None
    return TlsConfig(cert or None, key or None, ca or None).check()
