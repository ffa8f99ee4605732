"""The peer's Prometheus listener (``--metrics-port``), bounded like every listener of the node (issue 29 #1).

``prometheus_client.start_http_server`` gives each connection a thread that waits for its request with no
timeout and accepts every connection: idle sockets each held a thread and a descriptor for good. This one
serves the same WSGI app with :data:`IO_TIMEOUT_S` on every read and write of a connection, at most
:data:`MAX_CONNECTIONS` connections at once and :data:`MAX_PER_CLIENT` per remote address; a connection
over a bound is closed at once (a scraper retries at its next interval).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["IO_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_PER_CLIENT", "REQUEST_DEADLINE_S", "start_metrics_server"]

log = logging.getLogger(__name__)

#: seconds a metrics client may stay silent on a read, or not take a write
IO_TIMEOUT_S = 10.0
#: connections served at once, in all and per remote address
MAX_CONNECTIONS = 16
MAX_PER_CLIENT = 4


#: seconds a connection may take in all, from accept to the last byte of the answer: a per-read timeout alone
#: is reset by every byte, and a client trickling one byte every few seconds held its slot for good (red team:
#: 16 such sockets shut a scraper out)
REQUEST_DEADLINE_S = 15.0


class _Handler(WSGIRequestHandler):
    timeout = IO_TIMEOUT_S  # socketserver.StreamRequestHandler sets it on the connection's socket

    def setup(self) -> None:
        super().setup()
        # Past the deadline the socket is shut: the handler's next read or write fails and its thread ends.
        self._deadline = threading.Timer(REQUEST_DEADLINE_S, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self) -> None:
        self._deadline.cancel()
        try:
            super().finish()
        except OSError:  # the deadline shut the socket under it
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        """No line per scrape."""


def start_metrics_server(
    host: str, port: int, registry: Any, max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_PER_CLIENT
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry``'s metrics on ``host:port`` (port 0: any free one) from a daemon thread; returns
    ``(server, thread)`` (stop: ``server.shutdown(); server.server_close()``). Raises OSError when the
    address cannot be bound."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    counts: dict[str, int] = {}
    lock = threading.Lock()

    class Server(ThreadingWSGIServer):
        address_family = family

        def process_request(self, request, client_address):
            ip = str(client_address[0])
            with lock:
                full = sum(counts.values()) >= max_connections or counts.get(ip, 0) >= max_per_client
                if not full:
                    counts[ip] = counts.get(ip, 0) + 1
            if full:
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

        def handle_error(self, request, client_address):
            """A client that timed out or went away: no traceback on stderr (socketserver prints one)."""
            log.debug("metrics client %s: %s", client_address[0], sys.exc_info()[1])

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                ip = str(client_address[0])
                with lock:
                    counts[ip] -= 1
                    if not counts[ip]:
                        del counts[ip]

    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_Handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
