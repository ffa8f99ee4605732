"""The one check for a service that ``PeerNode.start()`` builds (DHT, announcer, plans, collective, state
server, global state): used before start, it is a programming error that names itself."""

from __future__ import annotations

from typing import Optional, TypeVar

T = TypeVar("T")

__all__ = ["started"]


def started(value: Optional[T]) -> T:
    """``value``, which ``PeerNode.start()`` has built. Raises ``RuntimeError`` when it is still None (the
    node was not started, or is already shut down)."""
    if value is None:
        raise RuntimeError("this node service is built by PeerNode.start(): start the node first")
    return value
