"""State transfer to late joiners and re-syncing peers (DESIGN.md, "Late joiners and restarts").

A donor serves a snapshot of its global state taken at a round boundary: the fp32 global weights
and the outer momentum, concatenated as raw little-endian fp32 (``2 * P * 4`` bytes; no pickle).
A joiner splits the byte range over several donors whose announced digest matches, downloads the
pieces in parallel (server-streaming ``State/GetState``, chunks of ``chunk_bytes``), reassigns the
piece of a donor that fails to another, and verifies the digest of the assembled state before
using it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import grpc
import torch

from geomesh_p2p.identity import EnvelopeError
from geomesh_p2p.state import digest as state_digest
from geomesh_p2p.transport import STATE_GET, STATE_STATUS, RpcError, Transport
from geomesh_p2p.wire import collective_pb2

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20


class StateSyncError(RuntimeError):
    """No donor could provide a state with the expected digest."""


@dataclass(frozen=True)
class Snapshot:
    """Global state at the start of ``round``: weights fp32 CPU [P] and the outer optimizer's state
    (``momentum``) fp32 CPU [k·P] (k = 1 for Nesterov's momentum, 2 for the ddp baseline's AdamW)."""

    round: int
    theta: torch.Tensor
    momentum: torch.Tensor
    digest: str

    @property
    def blob(self) -> memoryview:
        return memoryview(torch.cat([self.theta, self.momentum]).numpy().tobytes())


class StateServer:
    """Serves this node's latest :class:`Snapshot` over ``State/GetState`` (register before start)."""

    def __init__(self, transport: Transport, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._snapshot: Optional[Snapshot] = None
        self._blob: Optional[memoryview] = None
        transport.add_stream(STATE_GET, self._handle, max_payload_bytes=1024)
        transport.add_unary(STATE_STATUS, self._status, max_payload_bytes=1024)
        self.peer_id = str(transport.identity.peer_id)

    async def _status(self, verified, context) -> bytes:
        """This node's round and digest: a cheap liveness and sync check for operators and tests."""
        snap = self._snapshot
        return collective_pb2.StatusResponse(round=snap.round if snap else 0, digest=snap.digest if snap else "",
                                             peer_id=self.peer_id).SerializeToString()

    def publish(self, snap: Snapshot) -> None:
        """Make ``snap`` the state served from now on (called at each round boundary)."""
        self._blob = snap.blob
        self._snapshot = snap

    async def _handle(self, verified, context):
        try:
            req = collective_pb2.StateRequest.FromString(verified.payload)
        except Exception:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "StateRequest is malformed") from None
        snap, blob = self._snapshot, self._blob
        if snap is None:
            raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "this node has no state yet")
        if req.round != snap.round:
            raise EnvelopeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"state for round {req.round} asked, this node holds round {snap.round}")
        total = len(blob)
        end = min(total, req.offset + (req.length or total))
        if req.offset > total:
            raise EnvelopeError(grpc.StatusCode.OUT_OF_RANGE, f"offset {req.offset} beyond {total} bytes")
        for off in range(req.offset, end, self.chunk_bytes):
            data = bytes(blob[off:min(end, off + self.chunk_bytes)])
            yield collective_pb2.StateChunk(round=snap.round, digest=snap.digest, total_bytes=total,
                                            offset=off, data=data).SerializeToString()


async def download_state(
    transport: Transport,
    donors: Sequence[str],
    *,
    round: int,
    numel: int,
    expected_digest: str,
    timeout_s: float = 120.0,
    state_numel: Optional[int] = None,
) -> Snapshot:
    """Download the round-``round`` state (P = ``numel``) from ``donors`` (addresses), in parallel.

    ``state_numel``: elements of the outer optimizer's state (default P: Nesterov's momentum; 2P
    for the ddp baseline's AdamW moments). The ``(P + state_numel) * 4`` bytes are split into one contiguous piece per donor; a donor that fails or sends
    something inconsistent has its piece retried on the next donor. Raises StateSyncError when the
    state cannot be assembled or its digest differs from ``expected_digest``.
    """
    if not donors:
        raise StateSyncError("no donor to download the state from")
    total = (numel + (numel if state_numel is None else int(state_numel))) * 4
    buf = bytearray(total)
    n = len(donors)
    bounds = [(total * i // n, total * (i + 1) // n) for i in range(n)]

    async def fetch(piece: int) -> None:
        start, end = bounds[piece]
        errors = []
        for attempt in range(n):
            donor = donors[(piece + attempt) % n]
            req = collective_pb2.StateRequest(round=round, offset=start, length=end - start)
            try:
                got = start
                # aclosing: a piece abandoned half-way (inconsistent chunk) cancels its stream now, in
                # this task, rather than whenever the generator is garbage-collected
                async with contextlib.aclosing(transport.call_stream(donor, STATE_GET, req.SerializeToString(),
                                                                     round=round, timeout=timeout_s)) as stream:
                    async for v in stream:
                        chunk = collective_pb2.StateChunk.FromString(v.payload)
                        if (chunk.total_bytes != total or chunk.offset != got or chunk.digest != expected_digest
                                or got + len(chunk.data) > end):
                            raise StateSyncError(f"donor {donor} sent an inconsistent chunk at {chunk.offset}")
                        buf[got:got + len(chunk.data)] = chunk.data
                        got += len(chunk.data)
                if got != end:
                    raise StateSyncError(f"donor {donor} stopped at byte {got} of {end}")
                return
            except (RpcError, StateSyncError, ValueError) as e:
                errors.append(str(e))
                log.warning("state piece %d from %s failed: %s", piece, donor, e)
        raise StateSyncError(f"piece {piece} failed on every donor: {errors[-1] if errors else '?'}")

    await asyncio.gather(*(fetch(i) for i in range(n)))
    flat = torch.frombuffer(buf, dtype=torch.float32).clone()
    theta, momentum = flat[:numel].clone(), flat[numel:].clone()
    got_digest = state_digest(theta, momentum)
    if got_digest != expected_digest:
        raise StateSyncError(f"downloaded state has digest {got_digest}, expected {expected_digest}")
    return Snapshot(round, theta, momentum, got_digest)
