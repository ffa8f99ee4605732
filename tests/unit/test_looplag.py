"""The event-loop lag monitor (issue 13): a stall on the loop is reported, an idle loop is not, and
stopping leaves no task behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from geomesh_p2p.telemetry.looplag import LoopLagMonitor

pytestmark = pytest.mark.timeout(30)


async def _samples(m: LoopLagMonitor, n: int) -> None:
    """Wait until the monitor has measured ``n`` more wake-ups (its event, not a fixed sleep)."""
    before = m.samples
    await m.wait_samples(n)
    assert m.samples >= before + n


async def test_a_blocking_call_on_the_loop_is_reported():
    m = LoopLagMonitor(interval_s=0.02)
    m.start()
    try:
        await _samples(m, 2)
        m.take_worst()
        time.sleep(0.2)  # noqa: ASYNC251  (the stall under test: heavy work left on the loop thread)
        await _samples(m, 2)
        worst = m.take_worst()
        assert worst >= 0.15, worst
        assert m.worst_ever >= worst
        assert m.take_worst() < worst  # reset by the previous take
    finally:
        await m.stop()


async def test_an_idle_loop_reports_no_stall():
    m = LoopLagMonitor(interval_s=0.02)
    m.start()
    try:
        await _samples(m, 10)
        assert m.take_worst() < 0.1
    finally:
        await m.stop()


async def test_stop_leaves_no_task():
    before = asyncio.all_tasks()
    m = LoopLagMonitor()
    m.start()
    m.start()  # idempotent: still one task
    assert len(asyncio.all_tasks() - before) == 1 and m.running
    await _samples(m, 1)
    await m.stop()
    await m.stop()  # idempotent
    assert asyncio.all_tasks() - before == set() and not m.running
    with pytest.raises(ValueError):
        LoopLagMonitor(interval_s=0)
