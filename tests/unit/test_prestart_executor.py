"""Issue 27 (session 46): the node's default executor starts its worker threads before the loop is busy, so no
``asyncio.to_thread`` starts one from the event loop mid-round (``Thread.start`` waits for the new thread to run:
a 51 ms stall at ``gpt2-124m`` on a loaded host); ``asyncio.run`` stops them with the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from geomesh_p2p.util.aio import prestart_default_executor

pytestmark = pytest.mark.timeout(60)


def _workers() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("asyncio")}


def test_every_worker_runs_before_the_first_to_thread_and_none_outlives_the_loop():
    before = _workers()
    seen: dict = {}

    async def main():
        pool = prestart_default_executor(asyncio.get_running_loop(), 3)
        seen["started"] = _workers() - before
        # 6 calls, 3 at a time: each runs on one of the 3 started threads; no thread is started for them
        gate = threading.Barrier(3, timeout=10)
        for _ in range(2):
            idents = await asyncio.gather(
                *[asyncio.to_thread(lambda: (gate.wait(), threading.get_ident())[1]) for _ in range(3)]
            )
            seen.setdefault("ran_on", set()).update(idents)
        seen["after"] = _workers() - before
        seen["pool"] = pool

    asyncio.run(main())
    assert len(seen["started"]) == 3
    assert seen["ran_on"] == seen["started"] and seen["after"] == seen["started"]
    assert _workers() - before == set()  # asyncio.run shut the executor down: no thread outlives the loop
    assert seen["pool"]._shutdown


def test_a_bad_worker_count_is_refused():
    async def main():
        with pytest.raises(ValueError, match="workers must be >= 1"):
            prestart_default_executor(asyncio.get_running_loop(), 0)

    asyncio.run(main())
