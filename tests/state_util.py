"""State-sync test doubles shared by tests/integration/test_global_state.py and test_catchup.py."""

from __future__ import annotations

import asyncio

import grpc

from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.sync.server import StateServer
from geomesh_p2p.wire import state_pb2


class StallingServer(StateServer):
    """A donor that sends ``stall_after`` chunks of a request, sets ``stalled``, then sends nothing until
    ``release`` is set (a donor gone quiet; the test may move the state on meanwhile); requests starting
    before byte ``refuse_below`` are refused (FAILED_PRECONDITION). ``closed`` is set when a stalled stream
    is closed."""

    def __init__(self, transport, *, stall_after: int, refuse_below: int = 0, **kw):
        super().__init__(transport, **kw)
        self.stall_after, self.refuse_below = stall_after, refuse_below
        self.stalled, self.closed, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def _handle(self, verified, context):
        req = state_pb2.StateRequest.FromString(verified.payload)
        if req.offset < self.refuse_below:
            raise EnvelopeError(grpc.StatusCode.FAILED_PRECONDITION, "refused (test)")
        n = 0
        try:
            async for chunk in super()._handle(verified, context):
                if n == self.stall_after:
                    self.stalled.set()
                    await self.release.wait()
                yield chunk
                n += 1
        finally:
            if self.stalled.is_set():
                self.closed.set()
