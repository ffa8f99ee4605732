"""The process's file-descriptor budget, shared explicitly between its listeners (issue 29 #1).

Every accepted connection, every client channel and every open file takes one descriptor, and when the
table is full ``accept()``, ``socket()`` and ``open()`` fail for everyone: a status page that accepted
every idle socket took the bootstrap's DHT down with it. Each listener therefore gets a share of the soft
``RLIMIT_NOFILE`` (:data:`SHARES`), the rest staying for client channels, files and the runtime, and the
command-line tools raise the soft limit to the hard one at start (:func:`raise_fd_limit`).
"""

from __future__ import annotations

import resource
from typing import Optional

__all__ = ["SHARES", "fd_limit", "fd_share", "raise_fd_limit"]

#: Fraction of the soft descriptor limit each consumer may hold at most. gRPC's server takes half (as
#: before), the status page 1/16, the client channel cache a quarter; the remaining 3/16 are for files,
#: pipes and what the libraries open themselves.
SHARES = {"grpc_server": 1 / 2, "http": 1 / 16, "channels": 1 / 4}
#: The most the soft limit is raised to (:func:`raise_fd_limit`): plenty for every share's default cap.
RAISE_TO = 65536


def fd_limit() -> Optional[int]:
    """The soft ``RLIMIT_NOFILE`` (descriptors), None when unlimited or unknown."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def fd_share(name: str, cap: int, floor: int = 8) -> int:
    """Descriptors consumer ``name`` (a key of :data:`SHARES`) may hold: its share of :func:`fd_limit`, at
    most ``cap`` (its own configured bound) and at least ``floor`` (a listener with no descriptor would serve
    nobody). KeyError for an unknown name."""
    soft = fd_limit()
    if soft is None:
        return int(cap)
    return int(min(cap, max(floor, soft * SHARES[name])))


def raise_fd_limit(target: int = RAISE_TO) -> Optional[int]:
    """Raise the soft descriptor limit to the hard limit, at most ``target`` (never lowers it); returns the
    soft limit now (None: unlimited or unknown). A refusal (a container that forbids it) keeps the old one."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):
        return None
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return fd_limit()
