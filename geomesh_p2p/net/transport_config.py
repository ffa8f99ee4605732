"""Settings of a node's gRPC transport (:class:`TransportConfig`): address, message and call limits,
deadlines, keepalive, TLS, and the server-side resource bounds that :mod:`geomesh_p2p.net.guard` and
:mod:`geomesh_p2p.net.transport` apply. Units: bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from geomesh_p2p.net.methods import DEFAULT_MAX_MESSAGE_BYTES
from geomesh_p2p.net.tls import TlsConfig


@dataclass
class TransportConfig:
    """Transport settings. Units: bytes, seconds."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    advertise_host: Optional[str] = None  # what others dial; defaults to host
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    default_timeout_s: float = 10.0
    keepalive_s: float = 20.0
    # The skew window also covers the time a large message spends in flight (a 25 MB part over a slow
    # uplink takes tens of seconds), so it is wider than clock skew alone needs.
    max_skew_s: float = 120.0
    added_latency_s: float = 0.0
    tls: Optional[TlsConfig] = None
    client_only: bool = False
    max_channels: int = 1024  # client channels kept open (LRU closed first; at most 1/4 of the fd limit, util/fds.py)
    # ---- server-side resource bounds (see the module docstring) ----
    # Connections: in total (also at most half the process's file-descriptor limit), streams per
    # connection, seconds to finish the HTTP/2 handshake, idle seconds before a connection is closed,
    # maximum age (then ``connection_age_grace_s`` for the calls in flight).
    max_connections: int = 1024
    max_streams_per_connection: int = 256
    handshake_timeout_s: float = 10.0
    connection_idle_s: float = 300.0
    connection_age_s: float = 3600.0
    connection_age_grace_s: float = 300.0
    # Calls in progress on the server, all methods (gRPC answers RESOURCE_EXHAUSTED beyond).
    max_concurrent_rpcs: int = 4096
    # Requests being received at once (each may hold up to the server-wide limit in memory, twice,
    # while it is read; see _Guard), per remote IP and in all, per class (small: max_reads, bulk: half,
    # large: a quarter), and requests waiting to be received (~64 KiB each), per IP and in all.
    max_reads_per_ip: int = 1
    max_reads: int = 8
    max_waiting_per_ip: int = 256
    max_waiting: int = 2048
    # A connection that sent a request over its method's limit is refused for this long.
    oversize_penalty_s: float = 30.0
    # {method class: (calls in total, calls per verified sender)}; missing classes use DEFAULT_CALL_LIMITS.
    call_limits: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    # HTTP/2 BDP probing on the server grows every stream's receive window to the link's
    # bandwidth-delay product (~16 MB per stream on loopback), so each request waiting for its turn
    # would hold that much; off, a waiting request holds 64 KiB and a request being read gets a
    # window sized to its message.
    server_bdp_probe: bool = False
