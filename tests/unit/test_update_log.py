"""UpdateLog's encodings are owned: one whose every awaiter left leaves no table entry and no
"exception was never retrieved" behind (issue 14 review, left open in session 5)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

from geomesh_p2p.sync.server import UpdateLog

pytestmark = pytest.mark.timeout(30)


async def test_an_encoding_whose_awaiters_left_is_retrieved_and_forgotten():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    log = UpdateLog(keep_rounds=2)
    log.record(0, "a" * 32, [(0, 8)], (), torch.ones(8))
    log.seal(1, "b" * 32)
    started, release = threading.Event(), threading.Event()

    def failing_encode(u):
        started.set()
        release.wait(10)
        raise OSError("disk gone")

    log._encode = failing_encode  # type: ignore[method-assign]
    waiter = asyncio.ensure_future(log.blob(0))
    await asyncio.to_thread(started.wait, 10)
    assert list(log._encoding) == [0]
    waiter.cancel()  # the only awaiter leaves (a download that was cancelled)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    for _ in range(200):  # the worker thread finishes on its own; its done callback runs on the loop
        if not log._encoding:
            break
        await asyncio.sleep(0.01)
    assert log._encoding == {}
    gc.collect()
    await asyncio.sleep(0)
    assert [c.get("message") for c in reported] == []


async def test_awaiters_still_waiting_get_the_error_and_the_next_request_encodes_again():
    log = UpdateLog(keep_rounds=2)
    log.record(0, "a" * 32, [(0, 8)], (), torch.ones(8))
    log.seal(1, "b" * 32)
    real, calls = log._encode, []

    def flaky(u):
        calls.append(u.round)
        if len(calls) == 1:
            raise OSError("disk gone")
        return real(u)

    log._encode = flaky  # type: ignore[method-assign]
    a, b = await asyncio.gather(log.blob(0), log.blob(0), return_exceptions=True)
    assert isinstance(a, OSError) and a is b  # both shared the one encoding
    assert log._encoding == {}
    blob, digest = await log.blob(0)
    assert blob.startswith(b"GMU1") and len(digest) == 32 and calls == [0, 0]
