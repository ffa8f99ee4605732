"""State transfer to late joiners and re-syncing peers (DESIGN.md, "Late joiners and restarts").

A donor serves its :class:`~geomesh_p2p.state.GlobalState`: the fp32 global weights and the outer
optimizer's state, one contiguous buffer of raw little-endian fp32 (``(1 + k) * P * 4`` bytes; no
pickle), each chunk one slice of it (no whole-state copy). A joiner splits the byte range over
several donors whose announced digest matches and downloads the pieces in parallel
(server-streaming ``State/GetState``, chunks of ``chunk_bytes``). A piece whose donor fails, or sends
nothing for ``stall_timeout_s`` seconds, moves to another healthy donor from the byte it reached; a
piece that fails on every donor cancels its siblings at once. The digest of the assembled state is
verified in a worker thread before the state is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from geomesh_p2p.identity import EnvelopeError
from geomesh_p2p.state import GlobalState, StateChanged, StateError
from geomesh_p2p.transport import STATE_GET, STATE_STATUS, RpcError, Transport
from geomesh_p2p.wire import collective_pb2

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20


class StateSyncError(RuntimeError):
    """No donor could provide a state with the expected digest."""


#: Seconds without a chunk after which a piece moves to another donor (the call's own deadline is
#: ``timeout_s``, 120 s by default: far too long to wait on a donor that went quiet).
DEFAULT_STALL_TIMEOUT_S = 5.0

#: ``on_event(kind, piece, donor, detail)`` of :func:`download_state`; kinds: "start" (a piece asked of
#: a donor, detail = first byte), "stalled" (no chunk for ``stall_timeout_s``), "failed" (the donor
#: refused or sent something inconsistent, detail = the reason), "done" (the piece is complete),
#: "cancelled" (a sibling failed for good).
EventFn = Callable[[str, int, str, str], None]


@dataclass(frozen=True)
class Snapshot:
    """Global state at the start of ``round``: weights fp32 CPU [P] and the outer optimizer's state
    (``momentum``) fp32 CPU [k·P] (k = 1 for Nesterov's momentum, 2 for the ddp baseline's AdamW).

    ``buffer``: when set (a download), the contiguous fp32 ``[(1 + k) * P]`` that ``theta`` and
    ``momentum`` are views of; :meth:`to_global_state` adopts it without a copy."""

    round: int
    theta: torch.Tensor
    momentum: torch.Tensor
    digest: str
    buffer: Optional[torch.Tensor] = None

    @property
    def blob(self) -> memoryview:
        """The raw bytes ``[theta | momentum]`` (a copy of the state: kept for old callers only)."""
        return memoryview(torch.cat([self.theta, self.momentum]).numpy().tobytes())

    def to_global_state(self) -> GlobalState:
        """A :class:`GlobalState` at ``round`` with this ``digest``: adopts ``buffer`` (no copy, no re-hash)
        when set, else copies theta and momentum in (synchronous: run it in a thread). Raises
        StateError when momentum is not k × P elements."""
        P = self.theta.numel()
        if P == 0 or self.momentum.numel() % P:
            raise StateError(f"optimizer state of {self.momentum.numel()} elements is not k x {P}")
        k = self.momentum.numel() // P
        if self.buffer is not None:
            gs = GlobalState(P, k, buffer=self.buffer)
        else:
            gs = GlobalState(P, k)
            gs.theta.copy_(self.theta.reshape(-1))
            gs.opt_state.copy_(self.momentum.reshape(-1))
        gs.round, gs.digest = int(self.round), self.digest
        return gs


class StateServer:
    """Serves this node's :class:`GlobalState` over ``State/GetState`` and its round and digest over
    ``State/Status`` (construct before the transport starts).

    :meth:`serve` names the state to serve (the node's own, stepped in place each round): each request
    is answered with the round and digest the state holds at that moment, each chunk read from its
    buffer (:meth:`GlobalState.read`; an outer step in progress is waited for in a worker thread,
    never on the loop). A request for another round, or a state that moves on (or is re-synced)
    while a piece streams, is refused with FAILED_PRECONDITION and the reason. :meth:`publish` (a
    :class:`Snapshot`) is kept for callers that hold separate tensors: it copies them into a
    GlobalState of its own.
    """

    def __init__(self, transport: Transport, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 state: Optional[GlobalState] = None):
        self.chunk_bytes = chunk_bytes
        self._state: Optional[GlobalState] = state
        transport.add_stream(STATE_GET, self._handle, max_payload_bytes=1024)
        transport.add_unary(STATE_STATUS, self._status, max_payload_bytes=1024)
        self.peer_id = str(transport.identity.peer_id)

    @property
    def state(self) -> Optional[GlobalState]:
        """The state served (None: nothing yet; requests are refused with UNAVAILABLE)."""
        return self._state

    async def _status(self, verified, context) -> bytes:
        """This node's round and digest: a cheap liveness and sync check for operators and tests."""
        gs = self._state
        if gs is None or gs.digest is None:  # not ready: round 0, no digest
            return collective_pb2.StatusResponse(round=0, digest="", peer_id=self.peer_id).SerializeToString()
        return collective_pb2.StatusResponse(round=gs.round, digest=gs.digest, peer_id=self.peer_id).SerializeToString()

    def serve(self, state: GlobalState) -> None:
        """Serve ``state`` from now on (not copied: its round, digest and bytes as they are at each request)."""
        self._state = state

    def publish(self, snap: Snapshot) -> None:
        """Serve a copy of ``snap`` (its digest as given, not recomputed). For callers with separate tensors;
        a node that keeps its state in a :class:`GlobalState` calls :meth:`serve` once instead. The copy
        is the size of the state: call it from a worker thread for a large model."""
        # without the buffer: always a copy, so the caller may go on changing its tensors
        self._state = Snapshot(snap.round, snap.theta, snap.momentum, snap.digest).to_global_state()

    async def _read(self, gs: GlobalState, start: int, end: int, round: int, digest: str) -> bytes:
        try:  # fast path: the state is not being changed (a 1 MiB copy, ~0.1 ms)
            return gs.read(start, end, round=round, digest=digest, blocking=False)
        except StateChanged:
            pass
        # an outer step or a load holds the state: wait for it off the loop, then re-check the round
        return await asyncio.to_thread(gs.read, start, end, round=round, digest=digest)

    async def _handle(self, verified, context):
        try:
            req = collective_pb2.StateRequest.FromString(verified.payload)
        except Exception:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "StateRequest is malformed") from None
        gs = self._state
        if gs is None or gs.digest is None:
            raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "this node has no state yet")
        rnd, dg, total = gs.round, gs.digest, gs.nbytes
        if req.round != rnd:
            raise EnvelopeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"state for round {req.round} asked, this node holds round {rnd}")
        if req.offset > total:
            raise EnvelopeError(grpc.StatusCode.OUT_OF_RANGE, f"offset {req.offset} beyond {total} bytes")
        end = min(total, req.offset + (req.length or total))
        for off in range(req.offset, end, self.chunk_bytes):
            try:
                data = await self._read(gs, off, min(end, off + self.chunk_bytes), rnd, dg)
            except StateChanged as e:
                raise EnvelopeError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"state of round {rnd} no longer held: {e}") from None
            yield collective_pb2.StateChunk(round=rnd, digest=dg, total_bytes=total, offset=off,
                                            data=data).SerializeToString()


async def download_state(
    transport: Transport,
    donors: Sequence[str],
    *,
    round: int,
    numel: int,
    expected_digest: str,
    timeout_s: float = 120.0,
    state_numel: Optional[int] = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    on_event: Optional[EventFn] = None,
) -> Snapshot:
    """Download the round-``round`` state (P = ``numel``) from ``donors`` (addresses), in parallel.

    ``state_numel``: elements of the outer optimizer's state (default P: Nesterov's momentum; 2P
    for the ddp baseline's AdamW moments; a multiple of P). The ``(P + state_numel) * 4`` bytes are
    split into one contiguous piece per donor and written straight into one buffer. A piece whose
    donor refuses, sends something inconsistent or stops sending for ``stall_timeout_s`` seconds moves
    to the next healthy donor, resuming at the byte it reached; that donor is then not asked again
    by any piece. ``timeout_s`` is each call's deadline. When a piece has failed on every donor, its
    sibling downloads are cancelled (and their streams closed) before the error is raised. The
    digest is checked in a worker thread. ``on_event``: see :data:`EventFn`.

    Returns a :class:`Snapshot` whose ``theta`` [P] and ``momentum`` [state_numel] are views of its
    ``buffer`` (``snap.to_global_state()`` adopts it without a copy).

    Raises:
        StateSyncError: no donors, a piece failed on every donor, or the assembled state's digest
            differs from ``expected_digest``.
    """
    if not donors:
        raise StateSyncError("no donor to download the state from")
    state_numel = numel if state_numel is None else int(state_numel)
    if numel <= 0 or state_numel < 0 or state_numel % numel:
        raise StateSyncError(f"optimizer state of {state_numel} elements is not a multiple of P = {numel}")
    k = state_numel // numel
    total = (numel + state_numel) * 4
    flat = torch.empty(numel + state_numel, dtype=torch.float32)
    buf = flat.numpy().data.cast("B")  # written chunk by chunk: no assembly copy
    n = len(donors)
    bounds = [(total * i // n, total * (i + 1) // n) for i in range(n)]
    unhealthy: set[str] = set()

    def event(kind: str, piece: int, donor: str, detail: str = "") -> None:
        if on_event is not None:
            on_event(kind, piece, donor, detail)

    async def attempt(donor: str, got: list[int], end: int) -> None:
        """Stream ``[got[0], end)`` from ``donor`` into ``buf``, advancing ``got[0]`` per chunk."""
        req = collective_pb2.StateRequest(round=round, offset=got[0], length=end - got[0])
        # aclosing: a piece abandoned half-way (inconsistent chunk, stall, sibling failure) cancels its
        # stream now, in this task, rather than whenever the generator is garbage-collected
        async with contextlib.aclosing(transport.call_stream(donor, STATE_GET, req.SerializeToString(),
                                                             round=round, timeout=timeout_s)) as stream:
            async for v in stream:
                chunk = collective_pb2.StateChunk.FromString(v.payload)
                pos = got[0]
                if (chunk.total_bytes != total or chunk.offset != pos or chunk.digest != expected_digest
                        or pos + len(chunk.data) > end):
                    raise StateSyncError(f"donor {donor} sent an inconsistent chunk at {chunk.offset}")
                buf[pos:pos + len(chunk.data)] = chunk.data
                got[0] = pos + len(chunk.data)
        if got[0] != end:
            raise StateSyncError(f"donor {donor} stopped at byte {got[0]} of {end}")

    async def fetch(piece: int) -> None:
        start, end = bounds[piece]
        got = [start]
        errors = []
        order = [donors[(piece + i) % n] for i in range(n)]
        for donor in order:
            if got[0] == end:
                break
            if donor in unhealthy:
                continue
            event("start", piece, donor, str(got[0]))
            task = loop.create_task(attempt(donor, got, end), name=f"state-piece-{piece}-from-{donor}")
            try:
                while True:  # progress watchdog: a chunk must arrive every stall_timeout_s
                    before = got[0]
                    done, _ = await asyncio.wait({task}, timeout=stall_timeout_s)
                    if done:
                        task.result()  # raises the attempt's error
                        event("done", piece, donor)
                        return
                    if got[0] == before:
                        raise TimeoutError(f"donor {donor} sent nothing for {stall_timeout_s:g} s "
                                           f"(at byte {got[0]} of {end})")
            except (RpcError, StateSyncError, ValueError, DecodeError, TimeoutError) as e:
                kind = "stalled" if isinstance(e, TimeoutError) else "failed"
                unhealthy.add(donor)
                errors.append(str(e))
                event(kind, piece, donor, str(e))
                log.warning("state piece %d from %s %s: %s", piece, donor, kind, e)
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.wait({task})
        if got[0] != end:
            raise StateSyncError(f"piece {piece} failed on every donor: {errors[-1] if errors else 'no healthy donor'}")

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(fetch(i), name=f"state-piece-{i}") for i in range(n)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        # structured: nothing outlives this call, whether a piece failed or the caller was cancelled
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        for i, t in enumerate(tasks):
            if t in pending:
                event("cancelled", i, "", "a sibling piece failed")
    for t in tasks:
        if not t.cancelled() and (exc := t.exception()) is not None:
            raise exc

    gs = GlobalState(numel, k, buffer=flat)
    got_digest = await asyncio.to_thread(gs.compute_digest)  # 0.5-1 GB/s: off the loop
    if got_digest != expected_digest:
        raise StateSyncError(f"downloaded state has digest {got_digest}, expected {expected_digest}")
    return Snapshot(round, gs.theta, gs.opt_state, got_digest, buffer=flat)
