"""Waiting in async tests for a state that the code under test signals by no event."""

from __future__ import annotations

import asyncio
import time
from typing import Callable


async def until(
    condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition", interval: float = 0.01
) -> None:
    """Return once ``condition()`` (synchronous, cheap) is true, checked every ``interval`` seconds;
    AssertionError naming ``what`` after ``timeout`` seconds. Only for an internal state with no
    event to wait on (a counter of held requests, of open calls): where one exists, wait on it."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
