"""A donor's side of state transfer (DESIGN.md, "Late joiners and restarts"): :class:`StateServer` serves
this node's :class:`~geomesh_p2p.model.state.GlobalState` (``State/GetState``, chunks of one contiguous
fp32 buffer), its round and digest (``State/Status``) and its last rounds' outer updates
(``State/GetUpdate``, kept by :class:`UpdateLog`). The joiner's side is :mod:`geomesh_p2p.sync.download`.

Issue 14 #3 (a joiner on a slow link): a download that crosses a round boundary finishes from the same
round's snapshot (:meth:`StateServer.retain` keeps a copy of a round while downloads of it are in
progress), and the outer update of each of the last few rounds is kept for peers that catch up
incrementally (:func:`~geomesh_p2p.sync.download.catch_up_updates`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import grpc
import torch

from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.model.state import GlobalState, StateChanged
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.methods import STATE_GET, STATE_STATUS, STATE_UPDATE
from geomesh_p2p.wire import state_pb2

from geomesh_p2p.sync.download import DEFAULT_KEEP_UPDATES, OuterUpdate, Snapshot
from geomesh_p2p.trust.kept_weights import KeptWeights

# State transfer was one module: its log lines keep that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.sync.transfer")

DEFAULT_CHUNK_BYTES = 1 << 20

#: Older snapshots a donor keeps for downloads in progress (memory: ``(1 + k) * P * 4`` bytes each, only
#: while a download of that round is in progress or was asked within ``RETAIN_AFTER_S``).
DEFAULT_KEEP_SNAPSHOTS = 2
#: A round whose state was asked this recently is copied before the state moves on (its download may
#: still be resuming on this donor after a stall elsewhere).
RETAIN_AFTER_S = 30.0
#: A caller counts as downloading a round (its snapshot is then kept across an outer step and the next
#: outer updates are encoded eagerly) only once it has been served ``1 / MIN_SHARE`` of the state (bytes,
#: not requests) within ``RETAIN_AFTER_S``: a 1-byte request costs the donor no copy (adversarial review
#: M2). A joiner splitting its download over more than ``MIN_SHARE`` donors gets no such retention.
MIN_SHARE = 64
#: (round, caller) entries a state server tracks (least recently served dropped first; review M1).
MAX_TRACKED_CALLERS = 256
#: Whole states of one round a donor serves one caller (bytes, in units of the state): a download, a restart of it
#: and a digest retry. Beyond: PERMISSION_DENIED (the joiner takes its pieces from another donor). A state is ~4P
#: bytes, so an unbounded loop of downloads by one identity made this donor's upload an amplifier (the kind the
#: collective's per-caller serve limits close, ``exchange.owner.RESULT_SERVES_PER_CALLER``).
STATE_SERVES_PER_CALLER = 3
#: Whole outer updates of one round a node serves one caller (``State/GetUpdate``, bytes in units of the encoded
#: update): a catch-up, its restart and a retry. The update is ~4P bytes (zlib): the same amplifier as the state.
UPDATE_SERVES_PER_CALLER = 3


class StateServer:
    """Serves this node's :class:`GlobalState` over ``State/GetState``, its round and digest over
    ``State/Status`` and its last rounds' outer updates over ``State/GetUpdate`` (construct before the
    transport starts).

    :meth:`serve` names the state to serve (the node's own, stepped in place each round): each request
    is answered with the round and digest the state holds at that moment, each chunk read from its
    buffer (:meth:`GlobalState.read`; an outer step in progress is waited for in a worker thread,
    never on the loop). A download that crosses a round boundary finishes from the same round's
    snapshot: the node calls :meth:`retain` before each change of the state, which copies the state
    while a caller downloads its round (served at least ``1 / MIN_SHARE`` of the state within
    ``RETAIN_AFTER_S``); at most ``keep_snapshots`` such copies are kept, ``(1 + k) * P * 4`` bytes each.
    A request for a round neither held nor kept is refused with FAILED_PRECONDITION and the reason,
    before anything is recorded; the bytes served are tracked per (round, caller) for held rounds only,
    at most ``MAX_TRACKED_CALLERS`` entries (LRU). :meth:`publish` (a
    :class:`Snapshot`) is kept for callers that hold separate tensors: it copies them into a
    GlobalState of its own.

    ``updates`` (:class:`UpdateLog`): the outer updates this node applied, recorded by the node.
    """

    def __init__(
        self,
        transport: Transport,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        state: Optional[GlobalState] = None,
        keep_snapshots: int = DEFAULT_KEEP_SNAPSHOTS,
        keep_updates: int = DEFAULT_KEEP_UPDATES,
        clock: Callable[[], float] = time.monotonic,
        *,
        spill_updates: bool = False,
        spill_dir: Optional[str] = None,
    ):
        self.chunk_bytes = chunk_bytes
        self._state: Optional[GlobalState] = state
        self.keep_snapshots = int(keep_snapshots)
        spawn = getattr(getattr(transport, "tasks", None), "spawn", None)
        self.updates = UpdateLog(keep_updates, spawn=spawn, spill=spill_updates, spill_dir=spill_dir)
        self.updates.busy = self._downloading
        self._clock = clock
        self._kept: dict[int, GlobalState] = {}  # round -> copy made by retain()
        # (round, caller peer id) -> [bytes served, monotonic s of the last chunk, state bytes]; only rounds
        # held or kept (a request for another round is refused first), LRU-capped: bounded whatever callers send
        self._served: OrderedDict[tuple[int, str], list] = OrderedDict()
        # (round, caller) -> bytes of that caller's streams in progress not sent yet: checked with the bytes sent,
        # so that concurrent streams of one caller cannot each pass the check against the same count
        self._pending: dict[tuple[int, str], int] = {}
        # (round, caller) -> outer-update bytes served to that caller (GetUpdate), LRU-capped like _served
        self._served_updates: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._mu = threading.Lock()  # retain() runs in a worker thread, the handlers on the loop
        transport.add_stream(STATE_GET, self._handle, max_payload_bytes=1024)
        transport.add_stream(STATE_UPDATE, self._handle_update, max_payload_bytes=1024)
        transport.add_unary(STATE_STATUS, self._status, max_payload_bytes=1024)
        self.peer_id = str(transport.identity.peer_id)

    @property
    def state(self) -> Optional[GlobalState]:
        """The state served (None: nothing yet; requests are refused with UNAVAILABLE)."""
        return self._state

    def kept_rounds(self) -> list[int]:
        """Rounds of the older snapshots kept for downloads in progress, oldest first."""
        with self._mu:
            return sorted(self._kept)

    async def _status(self, verified, context) -> bytes:
        """This node's round and digest: a cheap liveness and sync check for operators and tests. Raises
        EnvelopeError (INVALID_ARGUMENT) for a payload that is not a StatusRequest (red team, session 28: junk was
        answered as if valid)."""
        try:
            state_pb2.StatusRequest.FromString(verified.payload)
        except Exception:  # protobuf's DecodeError and friends: any malformed payload
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "StatusRequest is malformed") from None
        gs = self._state
        if gs is None or gs.digest is None:  # not ready: round 0, no digest
            return state_pb2.StatusResponse(round=0, digest="", peer_id=self.peer_id).SerializeToString()
        return state_pb2.StatusResponse(round=gs.round, digest=gs.digest, peer_id=self.peer_id).SerializeToString()

    def serve(self, state: GlobalState) -> None:
        """Serve ``state`` from now on (not copied: its round, digest and bytes as they are at each request)."""
        self._state = state

    def publish(self, snap: Snapshot) -> None:
        """Serve a copy of ``snap`` (its digest as given, not recomputed). For callers with separate tensors;
        a node that keeps its state in a :class:`GlobalState` calls :meth:`serve` once instead. The copy
        is the size of the state: call it from a worker thread for a large model."""
        gs = self._state
        if gs is not None:
            self.retain()
        # without the buffer: always a copy, so the caller may go on changing its tensors
        self._state = Snapshot(snap.round, snap.theta, snap.momentum, snap.digest).to_global_state()

    def retain(self) -> Optional[int]:
        """Call before the served state changes (outer step, re-sync), with its lock held so nothing
        changes meanwhile: when a caller was served at least ``1 / MIN_SHARE`` of its round within
        ``RETAIN_AFTER_S`` (a download in progress), copy it (``(1 + k) * P * 4`` bytes) so that download finishes from the same
        round. Drops copies no download asked for within ``RETAIN_AFTER_S`` and all but the newest
        ``keep_snapshots``. Returns the round copied, or None. Synchronous (a copy of the state): call it
        in a worker thread."""
        gs = self._state
        now = self._clock()
        with self._mu:
            for r in [r for r in self._kept if not self._wanted(r, now)]:
                del self._kept[r]
            if gs is None or gs.digest is None or not self._wanted(gs.round, now) or gs.round in self._kept:
                return None
            rnd = gs.round
        copy_ = GlobalState(gs.num_params, gs.k, buffer=gs.buffer.clone())
        copy_.round, copy_.digest = gs.round, gs.digest
        with self._mu:
            self._kept[rnd] = copy_
            for r in sorted(self._kept)[: -max(1, self.keep_snapshots)]:
                del self._kept[r]
        log.info("state of round %d kept for a download in progress (%d MB)", rnd, gs.nbytes >> 20)
        return rnd

    def _downloading(self) -> bool:
        """True while a caller downloads a state from this node (see :meth:`_wanted`), any round."""
        now = self._clock()
        with self._mu:
            return any(self._real(e, now) for e in self._served.values())

    @staticmethod
    def _real(entry: list, now: float) -> bool:
        """A real download: served a meaningful share of the state, recently (not a cheap probe)."""
        nbytes, last, total = entry
        return nbytes * MIN_SHARE >= total and now - last < RETAIN_AFTER_S

    def _wanted(self, rnd: int, now: float) -> bool:
        """A caller was served ``1 / MIN_SHARE`` of round ``rnd``'s state within RETAIN_AFTER_S (lock held)."""
        return any(k[0] == rnd and self._real(e, now) for k, e in self._served.items())

    def tracked(self) -> int:
        """(round, caller) entries tracked (at most ``MAX_TRACKED_CALLERS``; diagnostics, tests)."""
        with self._mu:
            return len(self._served)

    def _note(self, key: tuple[int, str], nbytes: int, total: int) -> None:
        """Count ``nbytes`` served to ``key`` = (round, caller) now (lock held); LRU order, capped."""
        e = self._served.get(key)
        if e is None:
            e = self._served[key] = [0, 0.0, total]
        self._served.move_to_end(key)
        e[0] += nbytes
        e[1] = self._clock()
        while len(self._served) > MAX_TRACKED_CALLERS:
            self._served.popitem(last=False)

    async def _read(self, gs: GlobalState, start: int, end: int, round: int, digest: str) -> bytes:
        try:  # fast path: the state is not being changed (a 1 MiB copy, ~0.1 ms)
            return gs.read(start, end, round=round, digest=digest, blocking=False)
        except StateChanged:
            pass
        # an outer step or a load holds the state: wait for it off the loop, then re-check the round
        return await asyncio.to_thread(gs.read, start, end, round=round, digest=digest)

    async def _handle(self, verified, context):
        try:
            req = state_pb2.StateRequest.FromString(verified.payload)
        except Exception:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "StateRequest is malformed") from None
        gs = self._state
        if gs is None or gs.digest is None:
            raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "this node has no state yet")
        now = self._clock()
        with self._mu:
            if req.round != gs.round:
                gs = self._kept.get(req.round, gs)
            held = {gs.round, *self._kept}
            # entries of rounds no longer held go once nobody was served them recently
            for k in [k for k, e in self._served.items() if k[0] not in held and now - e[1] >= RETAIN_AFTER_S]:
                del self._served[k]
        rnd, dg, total = gs.round, gs.digest, gs.nbytes
        if req.round != rnd:  # refused before anything is recorded (review M1)
            raise EnvelopeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"state for round {req.round} asked, this node holds round {rnd}"
                f" (kept: {self.kept_rounds() or 'none'})",
            )
        if req.offset > total:
            raise EnvelopeError(grpc.StatusCode.OUT_OF_RANGE, f"offset {req.offset} beyond {total} bytes")
        key = (rnd, str(verified.sender))
        end = min(total, req.offset + (req.length or total))
        with self._mu:
            served = self._served[key][0] if key in self._served else 0
            pending = self._pending.get(key, 0)
            if served + pending + (end - req.offset) > STATE_SERVES_PER_CALLER * total:
                raise EnvelopeError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the state of round {rnd} was served to this caller {STATE_SERVES_PER_CALLER} times already",
                )
            # reserved before the first byte (a concurrent stream of this caller counts it), released as sent
            self._pending[key] = pending + (end - req.offset)
        unsent = end - req.offset
        try:
            for off in range(req.offset, end, self.chunk_bytes):
                try:
                    data = await self._read(gs, off, min(end, off + self.chunk_bytes), rnd, dg)
                except StateChanged as e:
                    # the state moved on mid-stream: finish from the copy retain() made of this round
                    with self._mu:
                        kept = self._kept.get(rnd)
                    if kept is None or kept.digest != dg:
                        raise EnvelopeError(
                            grpc.StatusCode.FAILED_PRECONDITION, f"state of round {rnd} no longer held: {e}"
                        ) from None
                    gs = kept
                    data = await self._read(gs, off, min(end, off + self.chunk_bytes), rnd, dg)
                with self._mu:
                    self._note(key, len(data), total)
                    self._release(key, len(data))
                unsent -= len(data)
                yield state_pb2.StateChunk(
                    round=rnd, digest=dg, total_bytes=total, offset=off, data=data
                ).SerializeToString()
        finally:
            with self._mu:
                self._release(key, unsent)

    def _release(self, key: tuple[int, str], nbytes: int) -> None:
        """Drop ``nbytes`` of ``key``'s reservation (sent, or never to be: the stream ended). Lock held."""
        left = self._pending.get(key, 0) - nbytes
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)

    async def _handle_update(self, verified, context):
        """``State/GetUpdate``: request StateRequest(round r, offset, length) for the outer update of round
        r (state of round r -> r + 1); chunks StateChunk(round, digest = the blob's hash, total_bytes,
        offset, data) of its :meth:`OuterUpdate.encode` blob."""
        try:
            req = state_pb2.StateRequest.FromString(verified.payload)
        except Exception:
            raise EnvelopeError(grpc.StatusCode.INVALID_ARGUMENT, "StateRequest is malformed") from None
        blob = await self.updates.blob(req.round, asked=False)
        if blob is None:
            raise EnvelopeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no outer update of round {req.round} kept (kept: {self.updates.rounds() or 'none'})",
            )
        data, h = blob
        total = len(data)
        if req.offset > total:
            raise EnvelopeError(grpc.StatusCode.OUT_OF_RANGE, f"offset {req.offset} beyond {total} bytes")
        end = min(total, req.offset + (req.length or total))
        key = (int(req.round), str(verified.sender))
        with self._mu:
            # charged before the first byte (concurrent streams of one caller see it), the unsent part refunded
            done = self._served_updates.get(key, 0)
            if done + (end - req.offset) > UPDATE_SERVES_PER_CALLER * max(1, total):
                raise EnvelopeError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the outer update of round {req.round} was served to this caller "
                    f"{UPDATE_SERVES_PER_CALLER} times already",
                )
            self._served_updates[key] = done + (end - req.offset)
            self._served_updates.move_to_end(key)
            while len(self._served_updates) > MAX_TRACKED_CALLERS:
                self._served_updates.popitem(last=False)
        served = 0
        try:
            for off in range(req.offset, end, self.chunk_bytes):
                piece = data[off : min(end, off + self.chunk_bytes)]
                served += len(piece)
                if served * MIN_SHARE >= total:
                    # a real catch-up (not a 1-byte probe): encode the next rounds as soon as they are sealed
                    self.updates.note_asked()
                yield state_pb2.StateChunk(
                    round=req.round, digest=h, total_bytes=total, offset=off, data=piece
                ).SerializeToString()
        finally:
            unsent = (end - req.offset) - served
            if unsent > 0:
                with self._mu:
                    if key in self._served_updates:
                        self._served_updates[key] = max(0, self._served_updates[key] - unsent)


@dataclass(frozen=True)
class _Spilled:
    """An outer update whose aggregate was written to the spill store (:class:`~geomesh_p2p.trust.kept_weights.
    KeptWeights`, keyed by round): its header fields, ``numel`` fp32 elements on disk."""

    round: int
    start_digest: str
    end_digest: str
    ranges: tuple
    idle: tuple
    numel: int


class UpdateLog:
    """The outer updates of this node's last ``keep_rounds`` rounds, served to peers that fell behind.

    The node calls :meth:`record` with the round's aggregate before its outer step and :meth:`seal`
    with the digest after it (both in the worker thread of the outer step). Memory: the aggregate is
    copied (``4 * P`` bytes per round kept), or kept as it is with ``record(copy=False)`` (the node: its round
    buffer is its own and only read); the first request
    for a round encodes it once (zlib, in a worker thread) and the raw copy is dropped. Thread-safe.

    ``spill=True`` (the node, issue 27): when no peer is catching up, the newest round's raw aggregate is written
    to a raw fp32 file once sealed (a worker thread of the ``spawn`` owner, during the next round's inner steps)
    and the tensor is released, so the next round does not hold ``4 * P`` bytes for a peer that may never ask
    (at ``gpt2-124m``, 356 MB of the peak); a request reads it back through a copy-on-write map, encodes it
    and serves it bit for bit as if it had stayed in memory. Older spilled rounds stay on disk up to
    ``keep_rounds`` (in memory only the newest raw round is kept). The files live in a private temp directory under
    ``spill_dir`` (None: the system's), deleted by :meth:`close` (and at exit)."""

    def __init__(
        self,
        keep_rounds: int = DEFAULT_KEEP_UPDATES,
        spawn: Optional[Callable[..., Any]] = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        spill: bool = False,
        spill_dir: Optional[str] = None,
    ):
        self.keep_rounds = max(0, int(keep_rounds))
        self._spill_on = bool(spill)
        self._spill_dir = spill_dir
        self._store: Optional[KeptWeights] = None  # made on the first spill (a temp directory)
        # spawn(coro, name): an owner of background tasks (the transport's TaskOwner). With it, a round
        # sealed while a peer catches up (an update asked within RETAIN_AFTER_S) is encoded at once, off
        # the loop, so that peer's next request does not wait for zlib.
        self._spawn = spawn
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop() if spawn else None
        except RuntimeError:
            self._loop = None
        self._clock = clock
        self._last_asked = -1e18
        #: () -> bool: a peer is syncing from this node (its state server sets it: a state download in progress)
        self.busy: Callable[[], bool] = lambda: False
        self._mu = threading.Lock()
        self._pending: Optional[tuple] = None  # (round, start digest, ranges, idle, aggregate copy)
        self._spilling: set[int] = set()  # rounds whose spill is being written
        self._spill_queued: set[int] = set()  # rounds whose spill a seal scheduled on the loop (not started yet)
        self._spills_idle = threading.Condition(self._mu)  # notified when a spill ends (:meth:`wait_spilled`)
        self._written: Optional[tuple] = None  # (round, id of the aggregate): spilled before its seal (seal takes it)
        self._done: dict[int, Any] = {}  # round -> OuterUpdate, or (blob, hash) once encoded
        self._encoding: dict[int, asyncio.Future] = {}

    def record(
        self,
        round: int,
        start_digest: Optional[str],
        ranges: Sequence[tuple[int, int]],
        idle: Sequence[tuple[int, int]],
        aggregate: torch.Tensor,
        *,
        copy: bool = True,
    ) -> None:
        """Round ``round`` is about to apply ``aggregate`` (fp32 [P], copied here) from the state of digest
        ``start_digest`` in ``ranges`` with ``idle`` ranges left unchanged. Synchronous (a copy).
        ``copy=False``: kept as it is (a flat view) when already a contiguous fp32 tensor, no ``[P]`` copy (issue 27); the
        caller then never changes it (the node's round aggregate: a buffer of its own each round, which the
        outer step only reads)."""
        if self.keep_rounds == 0 or not start_digest:
            return
        agg = aggregate.detach().to(torch.float32).reshape(-1)
        if copy:
            agg = agg.clone()
        with self._mu:
            self._pending = (
                int(round),
                start_digest,
                tuple(tuple(map(int, r)) for r in ranges),
                tuple(tuple(map(int, r)) for r in idle),
                agg,
            )
            self._drop_written()  # a round recorded and spilled but never sealed
            # Issue 27 (session 45): the spill starts at the seal, not here. Started here (session 39) it ran beside
            # the outer step and the digest on the peer's core, ~0.5 s of CPU a round on that critical path at
            # gpt2-124m; the next round's steps wait for it instead (:meth:`wait_spilled`) when it still holds
            # the aggregate, their gradient buffer, so they take no second [P].

    def seal(self, round_after: int, end_digest: str) -> None:
        """The state is now at ``round_after`` with ``end_digest``: the update recorded for
        ``round_after - 1`` is complete and served; anything else pending is dropped."""
        with self._mu:
            p, self._pending = self._pending, None
            if p is None or p[0] != round_after - 1 or not end_digest:
                self._drop_written()
                return
            loop = self._loop if self._loop is not None and self._catching_up() else None
            eager = loop is not None
            written = self._written == (p[0], id(p[4])) and self._store is not None
            if written:  # spilled since record(): a syncing peer wants it raw (to encode), else the seal takes the file
                self._written = None
            if written and not eager:
                self._done[p[0]] = _Spilled(p[0], p[1], end_digest, p[2], p[3], int(p[4].numel()))
            else:
                self._done[p[0]] = OuterUpdate(p[0], p[1], end_digest, p[2], p[3], p[4])
                if written and self._store is not None:  # written implies a store; said again for the checker
                    self._store.drop(p[0])
            for r in sorted(self._done)[: -self.keep_rounds]:
                self._forget(r)
            # Memory: only the newest round stays a raw [P] copy; older raw ones are encoded now when a peer is
            # syncing, else dropped (a planned-out peer needs only the newest; a joiner's download makes
            # this node eager before the rounds it will need are sealed).
            stale = [
                r for r, u in self._done.items() if isinstance(u, OuterUpdate) and r != p[0] and r not in self._encoding
            ]
            if not eager:
                for r in stale:
                    self._forget(r)
                stale = []
            spill_loop = self._loop if not eager and self._spill_on and self._spawn is not None else None
            if isinstance(self._done[p[0]], _Spilled) or p[0] in self._spilling:
                spill_loop = None  # written, or being written: taken when the write ends
        if loop is not None:  # eager
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody will ask any more
                for r in [p[0], *stale]:
                    loop.call_soon_threadsafe(self._encode_soon, r)
        elif spill_loop is not None:
            with self._mu:
                self._spill_queued.add(p[0])
            try:
                spill_loop.call_soon_threadsafe(self._spill_soon, p[0])
            except RuntimeError:  # the loop is closing: no spill will run
                with self._mu:
                    self._spill_queued.discard(p[0])
                    self._spills_idle.notify_all()

    def wait_spilled(self, timeout_s: float) -> bool:
        """Block (a worker thread) until no spill is scheduled or being written, at most ``timeout_s`` seconds;
        True when none is. The next round's inner steps call it before they allocate a second gradient buffer
        (:attr:`~geomesh_p2p.model.grad_buffer.FlatGradBuffer.wait_release`): the spill reads the aggregate, which
        is their buffer."""
        with self._mu:
            return self._spills_idle.wait_for(lambda: not self._spilling and not self._spill_queued, timeout_s)

    def _drop_written(self) -> None:
        """Delete the file of a round spilled before a seal that did not come (``_mu`` held)."""
        written, self._written = self._written, None
        if written is not None and written[0] not in self._done and self._store is not None:
            self._store.drop(written[0])

    def _forget(self, round: int) -> None:
        """Drop ``round``'s entry and its spilled file, if any (``_mu`` held)."""
        u = self._done.pop(round, None)
        if isinstance(u, _Spilled) and self._store is not None:
            self._store.drop(round)

    def _spill_soon(self, round: int) -> None:
        """Write ``round``'s raw update to the spill store, in a task of the ``spawn`` owner (on the loop)."""
        with self._mu:
            self._spill_queued.discard(round)
            if self._spawn is None or round in self._encoding or round in self._spilling:
                self._spills_idle.notify_all()
                return
            self._spilling.add(round)
        try:
            self._spawn(asyncio.to_thread(self._spill_guarded, round), name=f"spill-update-{round}")
        except BaseException:
            with self._mu:
                self._spilling.discard(round)
                self._spills_idle.notify_all()
            raise

    def _spill_guarded(self, round: int) -> bool:
        try:
            return self._spill(round)
        finally:
            with self._mu:
                self._spilling.discard(round)
                self._spills_idle.notify_all()

    def _spill(self, round: int) -> bool:
        """Worker thread: write ``round``'s raw aggregate to a file and keep only its header (True), unless it was
        encoded, dropped or asked for meanwhile (False: then the raw copy stays until that ends). A round recorded
        and not sealed yet is written all the same; its seal then takes the file. A failed write (disk full) keeps
        it in memory, logged once at DEBUG: serving it matters more than the bytes."""
        with self._mu:
            got, pend = self._done.get(round), self._pending
            if isinstance(got, OuterUpdate) and round not in self._encoding:
                agg = got.aggregate
            elif got is None and pend is not None and pend[0] == round:
                agg = pend[4]  # recorded, its outer step under way
            else:
                return False
            if self._store is None:
                try:
                    self._store = KeptWeights(self._spill_dir)
                except OSError as e:
                    log.debug("cannot spill outer updates to disk: %r", e)
                    self._spill_on = False
                    return False
            store = self._store
        try:
            store.put(round, agg)
        except (OSError, RuntimeError, ValueError) as e:
            log.debug("spilling the update of round %d failed: %r", round, e)
            return False
        with self._mu:
            u, pend = self._done.get(round), self._pending
            if isinstance(u, OuterUpdate) and u.aggregate is agg and round not in self._encoding:
                self._done[round] = _Spilled(u.round, u.start_digest, u.end_digest, u.ranges, u.idle, int(agg.numel()))
                return True
            if u is None and pend is not None and pend[0] == round and pend[4] is agg:
                self._written = (round, id(agg))  # not sealed yet: its seal takes the file
                return True
            store.drop(round)  # encoded, dropped or being encoded meanwhile: the file is not needed
            return False

    def _load(self, s: _Spilled) -> Optional[OuterUpdate]:
        """The spilled update ``s`` as an :class:`OuterUpdate` whose aggregate maps its file (copy-on-write), or
        None when the file is gone (dropped meanwhile)."""
        store = self._store
        agg = None if store is None or store.closed else store.get(s.round)
        if agg is None:
            return None
        return OuterUpdate(s.round, s.start_digest, s.end_digest, s.ranges, s.idle, agg)

    def close(self) -> None:
        """Delete the spilled files (the node's shutdown). Safe to call twice; later spills are not made."""
        with self._mu:
            store, self._store, self._spill_on = self._store, None, False
            for r in [r for r, u in self._done.items() if isinstance(u, _Spilled)]:
                del self._done[r]
        if store is not None:
            store.close()

    def _catching_up(self) -> bool:
        return self._clock() - self._last_asked < RETAIN_AFTER_S or self.busy()

    @property
    def catching_up(self) -> bool:
        """A peer syncs from this node: it was served a meaningful share of an update within
        ``RETAIN_AFTER_S``, or of the state (``busy``). Rounds sealed meanwhile are encoded eagerly."""
        with self._mu:
            return self._catching_up()

    def note_asked(self) -> None:
        """A peer is catching up from this node (served a meaningful share of an update): the rounds sealed
        within ``RETAIN_AFTER_S`` are encoded eagerly."""
        with self._mu:
            self._last_asked = self._clock()

    def _encode_soon(self, round: int) -> None:
        """Encode ``round``'s update now, in a task of the ``spawn`` owner (scheduled by :meth:`seal` only
        when there is one: ``_loop`` is set only with ``spawn``)."""
        if round not in self._encoding and self._spawn is not None:
            self._spawn(self.blob(round, asked=False), name=f"encode-update-{round}")

    def rounds(self) -> list[int]:
        """Rounds whose update is kept, oldest first."""
        with self._mu:
            return sorted(self._done)

    def get(self, round: int) -> Optional[OuterUpdate]:
        """The update of ``round`` while it is kept and not yet encoded (tests, diagnostics), else None. A spilled
        one is mapped from its file (blocking: a file open)."""
        with self._mu:
            u = self._done.get(round)
        if isinstance(u, _Spilled):
            return self._load(u)
        return u if isinstance(u, OuterUpdate) else None

    def spilled(self) -> list[int]:
        """Rounds whose update is on disk, not in memory, oldest first."""
        with self._mu:
            return sorted(r for r, u in self._done.items() if isinstance(u, _Spilled))

    async def blob(self, round: int, asked: bool = True) -> Optional[tuple[bytes, str]]:
        """(the encoded update of ``round``, its blake2b hash, 32 hex) or None when not kept. Encoded once,
        in a worker thread; concurrent requests share the encoding. ``asked``: a peer's request of a kept
        round (the next rounds are then encoded as soon as they are sealed; the state server passes False
        and calls :meth:`note_asked` once a meaningful share was served)."""
        with self._mu:
            u = self._done.get(round)
            if asked and u is not None:  # a round not kept is no sign of a catch-up (review M2)
                self._last_asked = self._clock()
        if u is None:
            return None
        if not isinstance(u, (OuterUpdate, _Spilled)):
            return u
        fut = self._encoding.get(round)
        if fut is None:
            fut = self._encoding[round] = asyncio.ensure_future(asyncio.to_thread(self._encode, u))
            fut.add_done_callback(functools.partial(self._encoded, round))
        return await asyncio.shield(fut)

    def _encoded(self, round: int, fut: asyncio.Future) -> None:
        """Done callback of an encoding (on the loop): the table entry goes, and its error is retrieved
        here, so an encoding whose every awaiter left (a cancelled download) leaves neither an entry nor a
        "Future exception was never retrieved" behind. Awaiters still waiting get the error themselves."""
        if self._encoding.get(round) is fut:
            del self._encoding[round]
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("encoding the update of round %d failed: %r", round, fut.exception())

    def _encode(self, u: Union[OuterUpdate, _Spilled]) -> Optional[tuple[bytes, str]]:
        if isinstance(u, _Spilled):
            loaded = self._load(u)
            if loaded is None:
                return None  # dropped meanwhile (no longer kept): refused as a round not kept
            data = loaded.encode()
            del loaded  # the file's mapping
        else:
            data = u.encode()
        out = (data, hashlib.blake2b(data).hexdigest()[:32])
        with self._mu:
            if u.round in self._done:
                was = self._done[u.round]
                self._done[u.round] = out  # the raw [P] copy is dropped
                if isinstance(was, _Spilled) and self._store is not None:
                    self._store.drop(u.round)
        return out
