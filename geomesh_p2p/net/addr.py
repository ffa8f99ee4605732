"""The one parser and formatter of ``host:port`` network addresses (IPv6 literals in brackets).

Every place that forms an address to bind, dial or advertise calls :func:`format_address`; every
place that reads one (a flag, a DHT contact, a record) calls :func:`parse_address` or
:func:`valid_address`. An IPv6 literal is always written in brackets, ``[::1]:31337`` (RFC 3986
section 3.2.2; the form gRPC and every URL parser expect): without them ``::1:31337`` is ambiguous and
gRPC reads it as a host name ("Misformatted domain name").

    >>> format_address("::1", 31337)
    '[::1]:31337'
    >>> parse_address("[::1]:31337")
    ('::1', 31337)
    >>> parse_address("example.org:80")
    ('example.org', 80)
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional, Sequence, Tuple

MAX_ADDRESS_CHARS = 256  # longer strings are refused (they come from other nodes)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")  # a URL's scheme (RFC 3986 section 3.1)


class AddressError(ValueError):
    """A ``host:port`` string that cannot be used; the message says what is wrong in one line."""


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def normalize_host(host: str) -> str:
    """``host`` without brackets and surrounding spaces ("[::1]" -> "::1"). Raises AddressError when
    it is empty or holds a ':' without being an IPv6 literal."""
    h = _strip_brackets(host.strip())
    if not h:
        raise AddressError("empty host")
    if ":" in h:
        try:
            ipaddress.IPv6Address(h.split("%", 1)[0])  # "%eth0": a zone index of a link-local address
        except ValueError:
            raise AddressError(f"host {host!r} holds ':' but is not an IPv6 address") from None
    return h


def is_ipv6(host: str) -> bool:
    """Whether ``host`` (bracketed or not) is an IPv6 literal."""
    return ":" in _strip_brackets(host.strip())


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (``[::1]:5``). ``host`` may already be bracketed.

    Raises AddressError on an empty host or a port outside 0..65535 (0 only to bind a free port).
    """
    h = normalize_host(host)
    if not 0 <= int(port) <= 65535:
        raise AddressError(f"port {port} is not between 0 and 65535")
    return f"[{h}]:{int(port)}" if ":" in h else f"{h}:{int(port)}"


def parse_address(address: str) -> Tuple[str, int]:
    """``(host, port)`` of a ``host:port`` string; the host comes back without brackets.

    Accepts ``1.2.3.4:5``, ``name:5``, ``[::1]:5``. Raises AddressError (one line) when the port is
    missing or not ASCII digits in 1..65535, the host is empty or holds a ":" without being IPv6, it is a URL
    (``http://h:5``: its host:port suggested when that parses), or an IPv6 literal is not in brackets (``::1:5``:
    which colon starts the port is a guess, so it is refused with the bracketed form to use).
    """
    text = address.strip()
    if len(text) > MAX_ADDRESS_CHARS:
        raise AddressError(f"address of {len(text)} characters (at most {MAX_ADDRESS_CHARS})")
    scheme, sep, rest = text.partition("://")
    if sep:  # no HOST:PORT holds "//"
        # a URL (http://host:port): the IPv6 advice below would have told a user to bracket "http://host" (a fresh
        # user's trial, session 42). Only its host:port is suggested (no user@, path or query), and only when it
        # parses and prints on one line (red team 42: "http://h:5\n..." wrote its second line into the message).
        named = f" without {scheme}://" if _SCHEME.fullmatch(scheme) else ""
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
        raise AddressError(f"{address!r} is a URL: expected HOST:PORT{named}{_example(authority)}")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise AddressError(f"{address!r} is not [IPV6]:PORT")
        host, port = text[1:end], text[end + 2 :]
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise AddressError(f"{address!r} has no port: expected HOST:PORT")
        if ":" in host:
            # the bracket advice for an IPv6 host only (red team 42: "user:pw@h:5" was told "[user:pw@h]:5")
            if _is_ipv6(host):
                raise AddressError(f"{address!r}: an IPv6 address needs brackets{_example(f'[{host}]:{port}')}")
            if _is_ipv6(text):
                raise AddressError(f"{address!r} has no port: expected [IPV6]:PORT")
            raise AddressError(f"{address!r}: host {host!r} holds ':' but is not an IPv6 address")
    if not host:
        raise AddressError(f"{address!r} has no host: expected HOST:PORT")
    # ASCII digits only: str.isdigit() holds for "²", which int() refuses (a ValueError, red team 42)
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise AddressError(f"{address!r}: port {port!r} is not a number in 1..65535")
    return normalize_host(host), int(port)


def _is_ipv6(host: str) -> bool:
    """Whether ``host`` (no brackets) is an IPv6 literal, a ``%zone`` allowed."""
    try:
        ipaddress.IPv6Address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def _example(address: str) -> str:
    """``", e.g. ADDRESS"`` when ``address`` is one :func:`parse_address` accepts and prints on one line, else "":
    no suggestion that would be refused in turn."""
    return f", e.g. {address}" if address.isprintable() and valid_address(address) else ""


def valid_address(address: str) -> bool:
    """Whether :func:`parse_address` accepts ``address`` (never raises)."""
    try:
        parse_address(address)
        return True
    except (AddressError, TypeError):
        return False


def canonical_address(address: str) -> str:
    """``address`` re-formatted by :func:`format_address` (one spelling per address, e.g. for keys of
    tables). Raises AddressError like :func:`parse_address`."""
    return format_address(*parse_address(address))


def host_of(address: str) -> str:
    """The host of a ``host:port`` address, without brackets; the whole string (brackets stripped)
    when it does not parse (it is then only used to group or compare, never dialled)."""
    try:
        return parse_address(address)[0]
    except AddressError:
        return _strip_brackets(address.rpartition(":")[0] or address)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` ("127.0.0.9", "::1", "[::1]", "localhost") is a loopback address."""
    h = _strip_brackets(host.strip())
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` means "every interface" ("0.0.0.0", "::", "[::]", ""): one binds to it but
    nobody can dial it."""
    h = _strip_brackets(host.strip())
    if not h:
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


def ip_of(host: str) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP address ``host`` is a literal of (IPv4-mapped IPv6 as IPv4), None for a host name."""
    try:
        ip = ipaddress.ip_address(_strip_brackets(host.strip()).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def listen_problem(host: str, port: int, *, port_flag: str = "--port", host_flag: str = "--host") -> Optional[str]:
    """Why a server could not listen on ``host:port``, found by binding a socket there and closing it at once
    (at start, before the seconds of imports and proof of work that come before the real server: a busy
    ``--port`` was reported ~30 s in), or None when it can (or when only the server itself can tell: a host
    name that does not resolve, another error). The port may be taken between this check and the server's
    bind: that tiny race only moves the report to where it was before. Port 0 (a free one) is not checked.

    The message starts with the flag, as ``--metrics-port``'s always did: ``--port 5: cannot listen on
    127.0.0.1:5: the port is in use (another --port, or --port 0 for a free one)``; ``--host 203.0.113.1:
    cannot listen on 203.0.113.1:5: not an address of this machine``; a port below 1024 without the
    privilege to bind it."""
    import errno
    import socket

    if not port:
        return None
    try:
        where = format_address(host, port)
        infos = socket.getaddrinfo(normalize_host(host), port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (AddressError, OSError, UnicodeError):
        return None
    first: Optional[OSError] = None
    for family, kind, proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                # as gRPC binds (SO_REUSEADDR; no SO_REUSEPORT, transport.py): a port in TIME_WAIT is free
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
            return None  # gRPC listens when any of the host's addresses binds
        except OSError as e:
            first = first or e
    if first is None:
        return None
    if first.errno == errno.EADDRINUSE:
        return f"{port_flag} {port}: cannot listen on {where}: the port is in use (another {port_flag}, or {port_flag} 0 for a free one)"
    if first.errno == errno.EADDRNOTAVAIL:
        return f"{host_flag} {host}: cannot listen on {where}: not an address of this machine"
    if first.errno == errno.EACCES:
        return f"{port_flag} {port}: cannot listen on {where}: permission denied (a port below 1024 needs privileges)"
    return None


def first_listen_problem(listens: Sequence[tuple[str, Optional[int], str, str]]) -> Optional[str]:
    """:func:`listen_problem` of each ``(host, port, port_flag, host_flag)`` in order (a port of None or 0 is
    skipped); the first complaint, or None. The peer's and the bootstrap's start-up checks of their ports."""
    for host, port, port_flag, host_flag in listens:
        problem = listen_problem(host, port or 0, port_flag=port_flag, host_flag=host_flag)
        if problem is not None:
            return problem
    return None
