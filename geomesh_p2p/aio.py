"""Small asyncio helpers shared by the node's services."""

from __future__ import annotations

import asyncio
import sys

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True when it is set.

    Unlike ``asyncio.wait_for(event.wait(), timeout)`` this creates no inner task on Python >= 3.11
    (``asyncio.timeout``), so a handler cancelled while waiting (a client that hung up on a long poll)
    leaves no pending task behind to be garbage-collected with "Task was destroyed but it is pending!".
    """
    if event.is_set():
        return True
    if timeout <= 0:
        return False
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout):
                await event.wait()
        else:  # pragma: no cover - 3.10
            await asyncio.wait_for(event.wait(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        pass
    return event.is_set()
