"""The bootstrap's read-only status page: a tiny HTTP/1.1 server on the node's asyncio loop.

Routes (GET or HEAD only; anything else is 405, unknown paths 404):

* ``/`` — the page (``geomesh_p2p/status/static/index.html``), which fetches the two APIs every few seconds
  and draws its plots with uPlot (MIT, shipped in ``geomesh_p2p/status/static``; no CDN);
* ``/api/swarm`` — :meth:`~geomesh_p2p.status.swarm.SwarmWatcher.swarm_json`;
* ``/api/rounds`` — :meth:`~geomesh_p2p.status.swarm.SwarmWatcher.rounds_json`;
* ``/static/<name>`` — the page's script, style sheet and uPlot (a fixed list of files).

Answers come from the watcher's last view (built every few seconds off the request path), so a
request costs one write. Every answer carries a Content-Security-Policy that allows scripts from this
server only (an HTML string that slipped through could not run a script), ``nosniff`` and no caching
of the APIs.

Bounds (issue 29 #1: 300 idle sockets made a normal GET wait past 5 s and, with no share of the descriptor
table, could take the bootstrap's DHT down with it): 8 KiB of request head, :data:`HEAD_TIMEOUT_S` to send
it and :data:`WRITE_TIMEOUT_S` to take the answer; at most :data:`MAX_CONNECTIONS_PER_CLIENT` connections per
remote address and :data:`MAX_CONNECTIONS` in all, the latter also at most the status page's share of the
file-descriptor limit (:func:`geomesh_p2p.util.fds.fd_share`, 1/16: gRPC's server has half). A connection
over a bound closes the oldest connection of that address (or, over the total, the oldest of all) that has
not sent its request head yet; when every one is being answered, the new one is closed at once. An idle
socket therefore never makes a request wait, and the page never holds more descriptors than its share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from importlib import resources
from typing import Dict, Optional, Tuple

from geomesh_p2p.util.fds import fd_share

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 << 10
#: seconds a client has to send its whole request head (then 408 and close)
HEAD_TIMEOUT_S = 10.0
#: seconds a client has to take the answer (a reader that does not read is cut off)
WRITE_TIMEOUT_S = 10.0
#: connections open at once, in all (also at most the page's share of the descriptor limit)
MAX_CONNECTIONS = 64
#: connections open at once from one remote address
MAX_CONNECTIONS_PER_CLIENT = 8

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}
STATIC_FILES = ("index.html", "status.js", "status.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE.txt")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _static() -> Dict[str, Tuple[bytes, str]]:
    root = resources.files("geomesh_p2p.status").joinpath("static")
    out = {}
    for name in STATIC_FILES:
        ext = name[name.rfind(".") :]
        out[name] = (root.joinpath(name).read_bytes(), _TYPES[ext])
    return out


class _Conn:
    """One open connection: its writer, remote address, monotonic accept time, whether it still waits for
    its request head (``idle``: it may be closed to make room), and its handler task."""

    __slots__ = ("writer", "ip", "t", "idle")

    def __init__(self, writer: asyncio.StreamWriter, ip: str):
        self.writer, self.ip, self.t, self.idle = writer, ip, time.monotonic(), True


class StatusServer:
    """Serves ``watcher``'s views on ``host:port`` (port 0: any free one; see :attr:`port`).
    ``await start()``, ``await stop()``; runs on the caller's event loop and never blocks it.

    ``max_connections`` (in all; at most :func:`~geomesh_p2p.util.fds.fd_share` ``("http")``, fixed at
    :meth:`start`) and ``max_per_client`` (per remote address) bound the connections open at once (see the
    module's docstring). Counters: :attr:`requests`, :attr:`evicted` (idle connections closed to make room),
    :attr:`refused` (new connections closed at once: every open one was being answered)."""

    def __init__(
        self,
        watcher,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
    ):
        self.watcher = watcher
        self.host, self.port = host, port
        self._server: Optional[asyncio.base_events.Server] = None
        self._files = _static()
        self.max_connections = max(1, int(max_connections))
        self.max_per_client = max(1, int(max_per_client))
        self._conns: Dict[asyncio.StreamWriter, _Conn] = {}
        self.requests = 0
        self.evicted = 0
        self.refused = 0

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    def open_connections(self, ip: Optional[str] = None) -> int:
        """Connections open now (from remote address ``ip`` only, when given)."""
        return sum(1 for c in self._conns.values() if ip is None or c.ip == ip)

    async def start(self) -> str:
        """Listen; returns the page's URL. Raises OSError when the address is taken or not ours."""
        self.max_connections = fd_share("http", self.max_connections, floor=min(8, self.max_connections))
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=MAX_HEAD_BYTES, backlog=self.max_connections
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        """Stop listening and close open connections. Idempotent."""
        if self._server is None:
            return
        self._server.close()
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()
        try:
            await asyncio.wait_for(self._server.wait_closed(), timeout=2.0)
        except asyncio.TimeoutError:
            pass
        self._server = None

    def _oldest_idle(self, ip: Optional[str]) -> Optional[_Conn]:
        idle = [c for c in self._conns.values() if c.idle and (ip is None or c.ip == ip)]
        return min(idle, key=lambda c: c.t) if idle else None

    def _admit(self, conn: _Conn) -> bool:
        """Make room for ``conn`` under both bounds by closing idle connections; False when there is none."""
        for ip, bound in ((conn.ip, self.max_per_client), (None, self.max_connections)):
            if self.open_connections(ip) >= bound:
                victim = self._oldest_idle(ip)
                if victim is None:
                    return False
                self._conns.pop(victim.writer, None)
                victim.writer.transport.abort()  # its handler sees the connection lost and ends
                self.evicted += 1
        self._conns[conn.writer] = conn
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        conn = _Conn(writer, str(peer[0]) if peer else "?")
        if not self._admit(conn):
            self.refused += 1
            writer.transport.abort()
            return
        try:
            await self._serve(reader, writer, conn)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one bad request must not stop the page
            log.debug("status page: request failed: %r", e)
        finally:
            self._conns.pop(writer, None)
            writer.close()

    def _route(self, path: str) -> Tuple[int, bytes, str, bool]:
        """(status, body, content type, cacheable)."""
        path = path.split("?", 1)[0].split("#", 1)[0]
        if path in ("/", "/index.html"):
            body, ctype = self._files["index.html"]
            return 200, body, ctype, False
        if path == "/api/swarm":
            return 200, self.watcher.swarm_json(), "application/json", False
        if path == "/api/rounds":
            return 200, self.watcher.rounds_json(), "application/json", False
        if path.startswith("/static/") and path[len("/static/") :] in self._files:
            body, ctype = self._files[path[len("/static/") :]]
            return 200, body, ctype, True
        return 404, b"not found\n", _TYPES[".txt"], False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=HEAD_TIMEOUT_S)
        except asyncio.TimeoutError:
            conn.idle = False
            await self._reply(writer, 408, b"", _TYPES[".txt"], False, head_only=False)
            return
        except asyncio.LimitOverrunError:
            conn.idle = False
            await self._reply(writer, 431, b"request head too large\n", _TYPES[".txt"], False, head_only=False)
            return
        conn.idle = False  # being answered: not closed to make room (the write timeout bounds it)
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._reply(writer, 400, b"bad request\n", _TYPES[".txt"], False, head_only=False)
            return
        method, path = parts[0], parts[1]
        self.requests += 1
        if method not in ("GET", "HEAD"):
            await self._reply(writer, 405, b"read-only: GET or HEAD\n", _TYPES[".txt"], False, head_only=False)
            return
        status, body, ctype, cacheable = self._route(path)
        await self._reply(writer, status, body, ctype, cacheable, head_only=method == "HEAD")

    @staticmethod
    async def _reply(writer, status: int, body: bytes, ctype: str, cacheable: bool, head_only: bool) -> None:
        headers = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
            f"Content-Type: {ctype}",
            f"Content-Length: {len(body)}",
            "Cache-Control: " + ("max-age=300" if cacheable else "no-store"),
            f"Content-Security-Policy: {CSP}",
            "X-Content-Type-Options: nosniff",
            "Referrer-Policy: no-referrer",
            "Connection: close",
        ]
        if status == 405:
            headers.append("Allow: GET, HEAD")
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body))
        try:
            await asyncio.wait_for(writer.drain(), timeout=WRITE_TIMEOUT_S)
        except asyncio.TimeoutError:  # a client that does not read: cut off, its buffer freed
            writer.transport.abort()
