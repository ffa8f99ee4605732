"""Small asyncio helpers shared by the node's services."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Awaitable, Collection, Tuple

__all__ = ["cancel_and_wait", "finish_or_cancel", "unless_set", "wait_event"]


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


async def cancel_and_wait(tasks: Collection[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until each has finished; their results and errors are dropped. Why: a
    task only cancelled (not awaited) is still pending when its loop closes, and is then reported as
    "Task was destroyed but it is pending!"."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def finish_or_cancel(tasks: Collection[asyncio.Future]) -> None:
    """Wait for ``tasks`` to finish (results and errors dropped); if this waiter is cancelled, cancel
    them and wait for them before re-raising. Spawned on an owner (e.g. ``TaskOwner.spawn``), it makes
    that owner's shutdown end tasks it did not start itself."""
    try:
        if tasks:
            await asyncio.wait(tasks)
    finally:
        await cancel_and_wait([t for t in tasks if not t.done()])


async def unless_set(aw: Awaitable[Any], event: asyncio.Event) -> Tuple[bool, Any]:
    """Run ``aw`` until it finishes or ``event`` is set, whichever comes first: (True, its result), or
    (False, None) once it was cancelled and awaited (a Ctrl+C during a join's retries ends it at once,
    leaving no task behind). Raises what ``aw`` raised."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([stopped] + ([task] if not task.done() else []))
    if task.cancelled():
        return False, None
    return True, task.result()
