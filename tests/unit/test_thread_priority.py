"""benchmarks/thread_priority.py (kept with its benchmark, unused by the peer: session 27): a pool worker raises its own nice (and a thread it starts inherits it), the
calling (loop) thread's nice is unchanged, renice_threads skips the kept threads, and nothing raises."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading

import pytest

from benchmarks.thread_priority import lower_current_thread, nice_initializer, renice_threads, thread_nice

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's"),
]


def _in_child_thread(fn):
    """Run ``fn`` in a new thread (its nice raised there cannot be undone by this process) and return its result."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_executor_worker_niced_loop_thread_not() -> None:
    base = thread_nice()
    assert base is not None

    async def main() -> tuple:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1, initializer=nice_initializer(base + 5))
        loop.set_default_executor(pool)

        def worker() -> tuple:
            inherited = _in_child_thread(thread_nice)  # a thread the worker starts (an OpenMP team) inherits it
            return thread_nice(), inherited

        try:
            return await asyncio.to_thread(worker), thread_nice()
        finally:
            pool.shutdown()

    (worker_nice, child_nice), loop_nice = asyncio.run(main())
    assert worker_nice == min(base + 5, 19)
    assert child_nice == worker_nice
    assert loop_nice == base
    # the /proc view agrees: field 19 of the stat line is the nice value
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[16]) == base


def test_zero_is_off_and_nothing_lowers() -> None:
    def probe() -> tuple:
        off = lower_current_thread(0)
        before = thread_nice()
        on = lower_current_thread(before + 3)
        after = thread_nice()
        again = lower_current_thread(before + 1)  # lower than now: kept (lowering needs a privilege)
        return off, on, after - before, again, thread_nice() - before

    off, on, raised, again, kept = _in_child_thread(probe)
    assert (off, on, again) == (False, True, True)
    assert raised == 3 and kept == 3


def test_renice_threads_skips_kept() -> None:
    ready, stop = threading.Event(), threading.Event()
    seen: dict = {}

    def idle() -> None:
        seen["tid"] = threading.get_native_id()
        ready.set()
        stop.wait()
        seen["nice"] = thread_nice()

    t = threading.Thread(target=idle)
    t.start()
    ready.wait()
    me = threading.get_native_id()
    base = thread_nice()
    assert base is not None
    # every thread of this process except this one (pytest-timeout's and others' threads get niced too: harmless)
    n = renice_threads(base + 2, keep=[me])
    stop.set()
    t.join()
    assert n >= 1
    assert seen["nice"] == base + 2
    assert thread_nice() == base
    assert renice_threads(0) == 0
    assert os.getpriority(os.PRIO_PROCESS, me) == base
