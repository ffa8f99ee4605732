"""The join's pre-flight: one ping to each ``--bootstrap`` from a client-only transport that lives for that check
only (:func:`check_bootstraps`), and what it shares with the join (:mod:`~geomesh_p2p.dht.join`): the DHT protocol
version, the join's errors, and how a failed call is classified (:func:`final_failure`) and worded
(:func:`short_reason`, :func:`other_run_message`).

This module imports neither hivemind nor torch (nor does :mod:`geomesh_p2p.dht`'s package, whose names load on
first use): ``geomesh-peer join`` runs the pre-flight before torch's import, so a wrong ``--run-id`` or a
bootstrap that does not answer is named seconds after start, not after torch, the model and the proof of work
(a fresh user waited ~60 s for either on a loaded 2-core machine, session 35).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Optional, Sequence, Union

import grpc
from google.protobuf.message import DecodeError

from geomesh_p2p import __version__
from geomesh_p2p.config.models import run_named
from geomesh_p2p.net.addr import format_address
from geomesh_p2p.net.identity import Identity, PeerID
from geomesh_p2p.net.methods import DHT_PING
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.telemetry import events
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.wire import dht_pb2

DHT_PROTOCOL_VERSION = 1

#: Seconds each bootstrap has to answer the pre-flight ping.
PREFLIGHT_TIMEOUT_S = 5.0

#: Seconds for which bootstrap addresses at which nothing listens (each connection refused) are tried again before
#: the join gives up: a bootstrap that is starting listens within them (~14 s from its start to its "serving on" line
#: on a loaded 2-core machine, session 44), and a mistyped port is named within them. It was 63-76 s: the pre-flight
#: warned and went on, then the join's 8 attempts (~31 s of backoff) came after torch, the model and the proof of work.
REFUSED_WINDOW_S = 15.0

#: The first wait between two tries of addresses that refuse connections (seconds), doubled up to
#: :data:`REFUSED_WAIT_CAP_S` (the join's backoff: ``DHTNode.join_backoff_s``, 8 s).
REFUSED_FIRST_WAIT_S = 0.5
REFUSED_WAIT_CAP_S = 8.0

# The join's logger: the pre-flight's retry lines are the join's, worded alike.
log = logging.getLogger("geomesh_p2p.dht.node")

# The clock and the sleep of the pre-flight's retries (tests replace them: no real waits, the waits counted).
_now = time.monotonic
_sleep = asyncio.sleep

# RPC failures that mean "this node cannot serve us" (as opposed to "it refused this record").
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
}


class DHTJoinError(RuntimeError):
    """No bootstrap node answered (after retries with backoff), or all of them refused us."""


class IdentityInUseError(DHTJoinError):
    """A bootstrap answered signed by this node's own PeerID: another live process holds the same key."""


class OtherRunError(DHTJoinError):
    """A bootstrap answered, but it serves another run (``--run-id``): it was reached, so no "cannot reach"."""


class NothingListensError(DHTJoinError):
    """Nothing listened at any bootstrap address (each connection refused) for :data:`REFUSED_WINDOW_S`: a mistyped
    address or port, or no bootstrap runs there."""


class ClockSkewError(DHTJoinError, UserFacingError):
    """This machine's clock and its bootstrap's differ by more than the swarm tolerates
    (``DHTNode.max_clock_skew_s``): records and deadlines would be misjudged. One line, says what to do."""


class BootstrapAddressError(DHTJoinError, UserFacingError):
    """Every ``--bootstrap`` failed for good at the pre-flight: its host name does not resolve, or the server there
    is no gRPC server (an HTTP one: a bootstrap's status page). No retry can help: said before torch's import and
    the proof of work (fresh user 48: they came first, 4-16 s, then "1 attempt(s) over 0.0s"), exit 2."""


def permanent_failure(result: object) -> bool:
    """Whether a failed ping (``result``) can never succeed at that address: its host name does not resolve, or the
    server there is not a gRPC server. A refused connection (a bootstrap restarting), a timeout or a refusal by the
    bootstrap (another run, a private run's allow-list) is not one."""
    return isinstance(result, RpcError) and (_unresolvable(result.reason) or _not_grpc(result.reason))


#: What gRPC's resolvers say of a host name that does not resolve (c-ares, native; versions word it apart).
_UNRESOLVABLE = ("dns resolution failed", "address lookup failed", "domain name not found", "name or service not known")


#: What gRPC says when the server at the address does not speak HTTP/2 (an HTTP/1 server: a bootstrap's status page on
#: its --http-port, given as --bootstrap by a fresh user, session 34): lower-case substrings.
_NOT_GRPC = ("failed parsing http/2", "http1.x server")


def _not_grpc(reason: Optional[str]) -> bool:
    """Whether a call failed because the server there is not a gRPC server (no point in retrying)."""
    text = (reason or "").lower()
    return any(m in text for m in _NOT_GRPC)


#: What they add when the look-up failed *now*, not the name (a DNS server down or slow, a machine or container started
#: before its network): gRPC's prefix above ("address lookup failed") comes before these too, and the pre-flight
#: ended such a start at once, exit 2, where a retry joins (red team 48b); lower-case substrings.
_DNS_TRANSIENT = ("could not contact dns servers", "timeout while contacting dns servers", "temporary failure in name")


def _unresolvable(reason: Optional[str]) -> bool:
    """Whether a call failed because its host name does not resolve (a typo: no point in retrying); not when the
    resolver could not be asked (:data:`_DNS_TRANSIENT`)."""
    text = (reason or "").lower()
    return any(m in text for m in _UNRESOLVABLE) and not any(m in text for m in _DNS_TRANSIENT)


#: What gRPC says of a call that got no connection, worded short for a log line (substring, lower case -> words).
_SHORT_REASONS = (
    ("connection refused", "connection refused"),
    ("deadline", "timed out"),
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network is unreachable"),
    ("socket closed", "connection closed during set-up"),
    ("handshake", "TLS handshake failed"),
    ("ssl", "TLS handshake failed"),
)

#: The most characters of a gRPC reason that :func:`short_reason` keeps when it has no shorter word for it.
_SHORT_REASON_CHARS = 80


def short_reason(error: BaseException) -> str:
    """``error`` (a failed ping's) in a few words for one log line: "connection refused", "timed out", "host
    name does not resolve", ...; else the status code and the reason's first :data:`_SHORT_REASON_CHARS`
    characters (gRPC's own text for a refused connection is ~150 characters: "failed to connect to all
    addresses; last error: UNKNOWN: ipv4:...", and a retry line named each bootstrap's: fresh-user trial)."""
    if not isinstance(error, RpcError):
        return str(error)[:_SHORT_REASON_CHARS] or type(error).__name__
    if _unresolvable(error.reason):
        return "host name does not resolve"
    if _not_grpc(error.reason):
        return "not a gRPC server (an HTTP server? a bootstrap's status page is its --http-port, not its --port)"
    text = (error.reason or "").lower()
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timed out"
    if error.code in _UNREACHABLE:
        for marker, words in _SHORT_REASONS:
            if marker in text:
                return words
    reason = (error.reason or "").strip()
    if len(reason) > _SHORT_REASON_CHARS:
        reason = reason[:_SHORT_REASON_CHARS] + "..."
    return f"{error.code.name}: {reason}" if reason else error.code.name


def final_failure(result: BaseException) -> bool:
    """Whether a bootstrap's failed ping is final, as the join sees it: a refusal, an unresolvable name or
    another error; False for a bootstrap that may still be starting or is slow (UNAVAILABLE, DEADLINE_EXCEEDED,
    CANCELLED with a name that resolves), which the join retries. The join's pre-flight
    (:func:`geomesh_p2p.node.joining.check_bootstrap_run`) stops only on final failures (red team, session 16)."""
    if not isinstance(result, RpcError):
        return True
    return result.code not in _UNREACHABLE or _unresolvable(result.reason) or _not_grpc(result.reason)


def nothing_listens(result: object) -> bool:
    """Whether a failed ping (``result``) got no connection because nothing listens at its address: the host
    refused the connection (a mistyped port, a bootstrap not started yet or restarting). Not a timeout (a host that
    drops packets may be far or slow) nor an unresolvable name (final at once: :func:`final_failure`)."""
    return (
        isinstance(result, RpcError)
        and result.code == grpc.StatusCode.UNAVAILABLE
        and "connection refused" in (result.reason or "").lower()
    )


def refused_wait(delay_s: float, elapsed_s: float, window_s: float = REFUSED_WINDOW_S) -> float:
    """The wait before the next try of addresses that refused every connection so far: ``delay_s`` (the backoff's),
    cut so that the last try comes when ``window_s`` is over (``elapsed_s``: seconds since the first try); 0 when
    it is over (no next try)."""
    left = window_s - elapsed_s
    return 0.0 if left < 0.001 else min(delay_s, left)  # not a try for a float's rounding


def nothing_listens_message(addresses: Sequence[str], attempts: int, seconds: float) -> str:
    """The join error for ``addresses`` at which nothing listened: each of ``attempts`` tries over ``seconds``
    got its connection refused."""
    return (
        f"could not join the DHT: nothing listens at {', '.join(addresses)} (connection refused at each of "
        f"{attempts} attempt(s) in {seconds:.0f} s): check the --bootstrap address and port, and that the "
        f"bootstrap runs"
    )


def other_run_message(address: str, reason: str, own_run: str) -> str:
    """The join error for a bootstrap that answered for another run. ``reason``: its refusal, worded by
    :mod:`geomesh_p2p.net.identity` from the bootstrap's side ("message is for run 'a', this node serves 'b'")."""
    m = re.search(r"this node serves ('.*')", reason)
    theirs = m.group(1) if m else "another run"
    return (
        f"could not join the DHT: bootstrap {address} serves run {theirs}, not the run {run_named(own_run)} asked for: "
        "check --run-id"
    )


def ping_request(sender: "dht_pb2.NodeInfo") -> "dht_pb2.PingRequest":
    """The DHT ping from ``sender``: this node's protocol and software version (the join's and the pre-flight's)."""
    return dht_pb2.PingRequest(sender=sender, dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__)


def check_ping_protocol(address: str, resp: "dht_pb2.PingResponse") -> None:
    """Raises DHTJoinError when the node at ``address`` answered ``resp`` in another DHT protocol."""
    if resp.dht_protocol != DHT_PROTOCOL_VERSION:
        raise DHTJoinError(
            f"{address} speaks DHT protocol {resp.dht_protocol}, this node {DHT_PROTOCOL_VERSION} "
            f"(software {resp.software_version or '?'} vs {__version__})"
        )


async def ping_bootstraps(
    identity: Identity,
    run_id: str,
    addresses: Sequence[str],
    tls: Optional[object] = None,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
) -> list[Union[PeerID, BaseException]]:
    """One DHT ping to each of ``addresses`` at once, from a client-only transport started for it and stopped
    after: per address, the PeerID that answered, or the error (RpcError: no answer, a refusal, a bad reply;
    DHTJoinError: another DHT protocol). The ping is the join's (``DHTProtocol.ping``): no address of this node
    in it (nothing to dial back), no proof of work (a node's ping handler asks for none; only records carry it).
    ``tls``: the checked ``TlsConfig`` of ``--tls-*``, None for plaintext."""
    transport = Transport(identity, run_id, TransportConfig(client_only=True, tls=tls))  # type: ignore[arg-type]
    request = ping_request(dht_pb2.NodeInfo(peer_id=bytes(identity.peer_id))).SerializeToString()

    async def one(address: str) -> PeerID:
        reply = await transport.call(address, DHT_PING, request, timeout=timeout_s)
        try:
            resp = dht_pb2.PingResponse.FromString(reply.payload)
        except DecodeError as e:
            raise RpcError(address, DHT_PING, grpc.StatusCode.DATA_LOSS, f"malformed reply: {e}") from None
        check_ping_protocol(address, resp)
        return reply.sender

    try:
        await transport.start()
        return list(await asyncio.gather(*(one(a) for a in addresses), return_exceptions=True))
    finally:
        await transport.stop(grace=0)


def preflight_verdict(
    addresses: Sequence[str], results: Sequence[Union[PeerID, BaseException]], run_id: str
) -> Optional[str]:
    """What :func:`ping_bootstraps`' ``results`` mean before the join: None when a bootstrap answered; else the
    WARNING line naming each address and why (:func:`unanswered_bootstraps_line`).

    Raises:
        OtherRunError: no bootstrap answered, one said it serves another run, and every other failure is final
            (:func:`final_failure`: one silent or not up yet is left to the join's retries, which may get in
            through it: another run's bootstrap next to it is no reason to refuse the swarm before that; red
            team, session 16).
        BootstrapAddressError: every address failed for good (:func:`permanent_failure`).
    """
    if any(not isinstance(r, BaseException) for r in results):
        return None
    if all(isinstance(r, BaseException) and final_failure(r) for r in results):
        for address, r in zip(addresses, results):
            if (
                isinstance(r, RpcError)
                and r.code == grpc.StatusCode.FAILED_PRECONDITION
                and "this node serves" in (r.reason or "")
            ):
                raise OtherRunError(other_run_message(address, r.reason, run_id))
    failed = [(a, r) for a, r in zip(addresses, results) if isinstance(r, BaseException) and permanent_failure(r)]
    if len(failed) == len(results):
        raise BootstrapAddressError(
            "; ".join(f"--bootstrap {a}: {short_reason(r)}" for a, r in failed)
            + ": check --bootstrap (the HOST:PORT the bootstrap printed: 'peers join with: --bootstrap ...')"
        )
    return unanswered_bootstraps_line(list(addresses), list(results))  # type: ignore[arg-type]


def own_address(host: str, advertise_host: Optional[str], port: int, client_only: bool) -> Optional[str]:
    """The address a node of these flags will advertise (``Transport.start``'s spelling), which its join leaves out of
    its ``--bootstrap`` list; None when it is not known before it listens (``--port 0``) or it serves nothing."""
    return None if client_only or not port else format_address(advertise_host or host, port)


async def check_bootstraps(
    identity: Identity,
    run_id: str,
    addresses: Sequence[str],
    tls: Optional[object] = None,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    attempts: int = 1,
    window_s: float = REFUSED_WINDOW_S,
    own: Optional[str] = None,
) -> Optional[str]:
    """The pre-flight: :func:`ping_bootstraps` (each address once, duplicates and ``own`` dropped: this node's own
    address, :func:`own_address`, which the join leaves out too), judged by :func:`preflight_verdict`. Returns the
    WARNING line to log when none answered, None when one did or there is none to ping.

    While every address refuses the connection (:func:`nothing_listens`: nothing listens there yet), they are
    pinged again, up to ``attempts`` times in all (the join's ``--join-attempts``) within ``window_s`` seconds,
    the waits doubling from :data:`REFUSED_FIRST_WAIT_S` (cut to end with the window): one INFO line per retry
    naming each address ("no answer from ADDRESS (connection refused); retrying in 1.0 s (attempt 2 of 6)"). A
    bootstrap that is starting is joined once it listens; a mistyped port is named within ``window_s``.

    Raises:
        NothingListensError: every address refused every connection, ``attempts`` times or for ``window_s``.
        OtherRunError, BootstrapAddressError: as :func:`preflight_verdict`.
    """
    # not this node's own address: nothing listens there before it starts, and a list naming it was refused after
    # 15 s (red team 44) where the join starts a new swarm
    addresses = [a for a in dict.fromkeys(a.strip() for a in addresses if a and a.strip()) if a != own]
    if not addresses:
        return None
    attempts = max(1, attempts)
    # the tries that fit the window: the same schedule each time, so the retry lines can say "attempt n of m"
    waits: list[float] = []
    delay, planned = REFUSED_FIRST_WAIT_S, 0.0
    while len(waits) + 1 < attempts and planned < window_s:
        waits.append(refused_wait(delay, planned, window_s))
        planned += waits[-1]
        delay = min(2 * delay, REFUSED_WAIT_CAP_S)
    t0 = _now()
    for attempt in range(len(waits) + 1):
        results = await ping_bootstraps(identity, run_id, addresses, tls, timeout_s)
        if not all(nothing_listens(r) for r in results):
            return preflight_verdict(addresses, results, run_id)
        if attempt == len(waits):
            raise NothingListensError(nothing_listens_message(addresses, attempt + 1, _now() - t0))
        events.emit(
            log,
            logging.INFO,
            "dht_join_retry",
            "no answer from %s (connection refused); retrying in %.1f s (attempt %d of %d)",
            ", ".join(addresses),
            waits[attempt],
            attempt + 1,
            len(waits) + 1,
            peer=identity.peer_id.to_string(),
            attempt=attempt + 1,
            attempts=len(waits) + 1,
            wait_s=waits[attempt],
        )
        await _sleep(waits[attempt])
    return None  # not reached: the last attempt returns or raises


def unanswered_bootstraps_line(addresses: list[str], results: list[BaseException]) -> str:
    """One line for ``--bootstrap`` addresses none of which answered a ping (``results``: each one's error, in
    the order of ``addresses``), each named with the flag and why in a few words
    (:func:`short_reason`: connection refused, timed out, ...), and what comes next."""
    parts = []
    for address, r in zip(addresses, results):
        # silent (not up, slow) or final (a refusal, a name that does not resolve): final_failure's split
        parts.append(f"--bootstrap {address}: {'failed' if final_failure(r) else 'no answer'} ({short_reason(r)})")
    return (
        "; ".join(parts) + "; check the address and that the bootstrap runs (the join tries again after the proof "
        "of work, with retries while a bootstrap may be restarting)"
    )
