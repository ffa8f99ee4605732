"""Running fake-driven :class:`~geomesh_p2p.round.driver.RoundDriver` s in tests (tests/unit/test_round_driver.py's
fakes): a bounded run of several, and the activity each announces."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Sequence


async def run_bounded(drivers: Sequence, timeout_s: float) -> None:
    """Run ``drivers`` together for at most ``timeout_s`` seconds, then cancel those still running: a hang guard
    only, for tests that count what happened (plans, take-overs) rather than wait for the runs to end."""
    runs = asyncio.gather(*[d.run() for d in drivers])
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(runs), timeout_s)
    runs.cancel()
    with contextlib.suppress(BaseException):
        await runs


def record_activity(drivers: Sequence) -> list[list]:
    """One list per driver of ``drivers`` receiving each ``activity`` it announces (``_activity_changed``), in order."""
    seen: list[list] = [[] for _ in drivers]
    for d, out in zip(drivers, seen):
        d._activity_changed = lambda d=d, out=out: out.append(d.activity)
    return seen
