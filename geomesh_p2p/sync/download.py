"""A joiner's side of state transfer (DESIGN.md, "Late joiners and restarts"): download the state from
donors, or catch up by their outer updates. The donor's side is :mod:`geomesh_p2p.sync.server`.

A donor serves its :class:`~geomesh_p2p.model.state.GlobalState`: the fp32 global weights and the outer
optimizer's state, one contiguous buffer of raw little-endian fp32 (``(1 + k) * P * 4`` bytes; no
pickle), each chunk one slice of it (no whole-state copy). :func:`download_state` splits the byte range
over several donors whose announced digest matches and downloads the pieces in parallel
(server-streaming ``State/GetState``, chunks of ``chunk_bytes``). A piece whose donor fails, or sends
nothing for ``stall_timeout_s`` seconds, moves to another healthy donor from the byte it reached; a
piece that fails on every donor cancels its siblings at once. The digest of the assembled state is
verified in a worker thread before the state is used.

Issue 14 #3 (a joiner on a slow link): a peer one or more rounds behind catches up *incrementally*:
each donor keeps the outer update of its last few rounds (:class:`~geomesh_p2p.sync.server.UpdateLog`;
:class:`OuterUpdate`: the round's aggregate, part ranges and idle ranges, served zlib-compressed over
``State/GetUpdate``, about a quarter of ``4 * P`` bytes for a sign-compressed swarm against
``(1 + k) * P * 4`` for the whole state), and :func:`catch_up_updates` replays them with the run's
outer optimizer, checking every step against the digests (the final one is the digest the swarm's
vote backs, so a forged or tampered update is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import re
import struct
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Optional, Protocol, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from geomesh_p2p.telemetry import events
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.model.state import GlobalState, StateError
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.net.methods import STATE_GET, STATE_UPDATE
from geomesh_p2p.wire import state_pb2
from geomesh_p2p.util.untrusted import json_loads

if TYPE_CHECKING:
    from geomesh_p2p.net.identity import Verified

# State transfer was one module: its log lines keep that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.sync.transfer")

#: One round's outer update (:class:`~geomesh_p2p.sync.server.UpdateLog`), streamed like the state
#: (StateRequest / StateChunk).
#: Rounds of outer updates a donor keeps (memory: ``4 * P`` bytes per round until first asked, then its
#: zlib blob, ~``P`` bytes for a sign-compressed swarm).
DEFAULT_KEEP_UPDATES = 3


class StateSyncError(RuntimeError):
    """No donor could provide a state with the expected digest."""


class DonorsUnreachable(StateSyncError):
    """Every donor asked for a piece was unreachable (no connection: refused, no route; ``RpcError.unreachable``): the
    donors have most likely left (their records outlive them by a TTL), so asking them again at once is futile."""


#: Seconds without a chunk after which a piece moves to another donor (4 s: with the move and the new
#: donor's first chunk a frozen donor costs at most ~5 s, issue 14 #3; the call's own deadline is
#: ``timeout_s``, 120 s by default: far too long to wait on a donor that went quiet).
DEFAULT_STALL_TIMEOUT_S = 4.0
#: Once a donor has sent a piece ``STALL_MIN_CHUNKS`` chunks, its stall limit is ``STALL_FACTOR`` x its mean
#: interval between chunks, at least ``STALL_FLOOR_S`` (an outer step and a commit may hold the donor's
#: state that long) and at most the stall timeout.
STALL_MIN_CHUNKS = 3
STALL_FACTOR = 4.0
STALL_FLOOR_S = 2.0

#: ``busy_until(donor address) -> swarm seconds`` (:func:`geomesh_p2p.net.swarm_time.swarm_time`): until when a donor
#: is known to be busy with its own round (a plan it takes part in, up to that plan's exchange deadline; the
#: plans' deadlines are known to every peer). A donor whose uplink carries its own exchange -- seconds of
#: fp32 parts on a slow link -- sends a state chunk late, not never: the stall clock of its piece does not
#: run before that time (the call's own ``timeout_s`` still bounds it). 0 or a past time: not known busy.
BusyFn = Callable[[str], float]

#: ``on_event(kind, piece, donor, detail)`` of :func:`download_state`; kinds: "start" (a piece asked of
#: a donor, detail = first byte), "stalled" (no chunk for ``stall_timeout_s``), "failed" (the donor
#: refused or sent something inconsistent, detail = the reason), "done" (the piece is complete),
#: "cancelled" (a sibling failed for good), "moved" (the first chunk from the next donor after a stall or
#: failure arrived; detail = the seconds since the last chunk of the piece, what the bad donor cost), "held"
#: (the piece's donor is known busy with its own round: its stall clock waits; detail = seconds left of it).
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


class StreamCaller(Protocol):
    """What :func:`download_state` uses of a transport: :meth:`Transport.call_stream` (a
    :class:`~geomesh_p2p.net.transport.Transport`, or a proxy of one such as the sync meter's counting wrapper)."""

    def call_stream(
        self, address: str, method: str, payload: bytes, *, round: int = 0, timeout: Optional[float] = None
    ) -> AsyncGenerator[Verified, None]:
        """Server-streaming call; yields each verified reply (raises as :meth:`Transport.call`)."""
        ...


def donor_moved_on(error: BaseException, asked: int) -> Optional[int]:
    """The round a donor holds when it refused the state of round ``asked`` because it moved on past it (its
    FAILED_PRECONDITION "state for round N asked, this node holds round M", :mod:`geomesh_p2p.sync.server`,
    M > N), else None."""
    if not isinstance(error, RpcError) or error.code != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    m = re.search(r"this node holds round (\d+)", error.reason or "")
    held = int(m.group(1)) if m else None
    return held if held is not None and held > asked else None


async def download_state(
    transport: StreamCaller,
    donors: Sequence[str],
    *,
    round: int,
    numel: int,
    expected_digest: str,
    timeout_s: float = 120.0,
    state_numel: Optional[int] = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    on_event: Optional[EventFn] = None,
    busy_until: Optional[BusyFn] = None,
    last_attempt: bool = False,
) -> Snapshot:
    """Download the round-``round`` state (P = ``numel``) from ``donors`` (addresses), in parallel.

    ``state_numel``: elements of the outer optimizer's state (default P: Nesterov's momentum; 2P
    for the ddp baseline's AdamW moments; a multiple of P). The ``(P + state_numel) * 4`` bytes are
    split into one contiguous piece per donor and written straight into one buffer. A piece whose
    donor refuses, sends something inconsistent or stops sending for ``stall_timeout_s`` seconds moves
    to the next healthy donor, resuming at the byte it reached; that donor is then not asked again
    by any piece. ``timeout_s`` is each call's deadline. When a piece has failed on every donor, its
    sibling downloads are cancelled (and their streams closed) before the error is raised. The
    digest is checked in a worker thread. ``on_event``: see :data:`EventFn`. ``busy_until``
    (:data:`BusyFn`): a piece that stalled on a donor known busy with its own round retries it after the
    other donors, and then its stall clock starts only once that busy time is over (a donor inside its
    exchange window is slow, not gone; one ``"held"`` event per such attempt). A first attempt keeps the
    plain limit, so a frozen donor still costs a piece with another donor only that limit.

    Each failed piece attempt is one ``state_piece_failed`` line: INFO for a donor that moved on past ``round``
    (:func:`donor_moved_on`: the caller asks again for the newer round) unless ``last_attempt`` (the caller's
    last try), WARNING otherwise.

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
    unreachable: set[str] = set()  # donors no connection reached (DonorsUnreachable when all are)
    # donor -> its latest failure, any piece: a piece skips donors a sibling already found unhealthy, so its own
    # errors may name only some of them (a test saw "connection refused" alone where the other said "no state yet")
    reasons: dict[str, str] = {}

    def event(kind: str, piece: int, donor: str, detail: str = "") -> None:
        if on_event is not None:
            on_event(kind, piece, donor, detail)

    # per piece: monotonic s of its last chunk, and whether it is moving to another donor after a bad one
    last_chunk = [time.monotonic()] * n
    moving = [False] * n
    gaps: list[float] = []
    asked = [time.monotonic()] * n  # when the piece's current donor was asked
    n_chunks = [0] * n  # chunks from the piece's current donor
    relaxed = [False] * n  # the piece's current attempt is a retry: the full stall timeout applies
    stalled_early: set[str] = set()  # donors left under an adaptive limit shorter than stall_timeout_s
    held = [0.0] * n  # monotonic s the piece's donor is busy with its own round until (busy_until)
    busy_left: set[tuple[int, str]] = set()  # (piece, donor) left on a stall while the donor was known busy

    def busy_s(donor: str) -> float:
        """Seconds the donor is still known busy with its own round (<= 0: not known busy)."""
        return busy_until(donor) - swarm_time() if busy_until is not None else 0.0

    def quiet_s(piece: int, donor: str) -> float:
        """Seconds the piece has waited for a chunk; on a retry, not counting its donor's known busy time
        (negative while the donor is busy). A first attempt keeps the plain limit: a frozen donor is left
        as fast as before when another donor can serve the piece."""
        now = time.monotonic()
        left = busy_s(donor) if relaxed[piece] else 0.0
        if left > 0:
            if not held[piece]:  # once per attempt
                event("held", piece, donor, f"{left:.3f}")
            held[piece] = now + left
        return now - max(last_chunk[piece], asked[piece], held[piece])

    def stall_limit(piece: int) -> float:
        """STALL_FACTOR x the mean interval between chunks of the piece's current donor once it sent
        STALL_MIN_CHUNKS chunks (before: of the fastest sibling piece that did; none: ``stall_timeout_s``),
        within [STALL_FLOOR_S, stall_timeout_s]: on a fast link a frozen donor costs about STALL_FLOOR_S,
        not stall_timeout_s (issue 14 #3: <= 5 s)."""

        def mean(i: int) -> float:
            return (last_chunk[i] - asked[i]) / n_chunks[i]

        if relaxed[piece]:
            return stall_timeout_s

        if n_chunks[piece] >= STALL_MIN_CHUNKS:
            m = mean(piece)
        else:  # a donor frozen from its first chunk: the siblings' rate says what a live donor sends
            rates = [mean(i) for i in range(n) if i != piece and n_chunks[i] >= STALL_MIN_CHUNKS]
            if not rates:
                return stall_timeout_s
            m = min(rates)
        return min(stall_timeout_s, max(STALL_FLOOR_S, STALL_FACTOR * m))

    async def attempt(donor: str, got: list[int], end: int, piece: int) -> None:
        """Stream ``[got[0], end)`` from ``donor`` into ``buf``, advancing ``got[0]`` per chunk."""
        req = state_pb2.StateRequest(round=round, offset=got[0], length=end - got[0])
        # aclosing: a piece abandoned half-way (inconsistent chunk, stall, sibling failure) cancels its
        # stream now, in this task, rather than whenever the generator is garbage-collected
        async with contextlib.aclosing(
            transport.call_stream(donor, STATE_GET, req.SerializeToString(), round=round, timeout=timeout_s)
        ) as stream:
            async for v in stream:
                chunk = state_pb2.StateChunk.FromString(v.payload)
                pos = got[0]
                if (
                    chunk.total_bytes != total
                    or chunk.offset != pos
                    or chunk.digest != expected_digest
                    or pos + len(chunk.data) > end
                ):
                    raise StateSyncError(f"donor {donor} sent an inconsistent chunk at {chunk.offset}")
                buf[pos : pos + len(chunk.data)] = chunk.data
                got[0] = pos + len(chunk.data)
                now = time.monotonic()
                if moving[piece]:
                    moving[piece] = False
                    gaps.append(now - last_chunk[piece])
                    event("moved", piece, donor, f"{now - last_chunk[piece]:.3f}")
                last_chunk[piece] = now
                n_chunks[piece] += 1
        if got[0] != end:
            raise StateSyncError(f"donor {donor} stopped at byte {got[0]} of {end}")

    async def fetch(piece: int) -> None:
        start, end = bounds[piece]
        got = [start]
        errors = []
        order = [donors[(piece + i) % n] for i in range(n)]
        # A second pass retries, with the full stall timeout, donors only left for a short adaptive limit: a
        # busy donor's 2 s hiccup must not end a download when every other donor is gone too. It also retries
        # the donors this piece left while they were known busy with their own round, waiting out that time
        # (busy_until): when every donor is inside its exchange, the piece waits rather than fails.
        for donor, second in [(d, False) for d in order] + [(d, True) for d in order]:
            if got[0] == end:
                break
            if second:
                if (piece, donor) in busy_left:
                    busy_left.discard((piece, donor))
                elif donor in stalled_early:
                    stalled_early.discard(donor)
                else:
                    continue
            elif donor in unhealthy:
                continue
            relaxed[piece] = second
            event("start", piece, donor, str(got[0]))
            asked[piece], n_chunks[piece], held[piece] = time.monotonic(), 0, 0.0
            task = loop.create_task(attempt(donor, got, end, piece), name=f"state-piece-{piece}-from-{donor}")
            try:
                while True:  # progress watchdog: a chunk must arrive within the piece's stall limit
                    limit = stall_limit(piece)
                    quiet = quiet_s(piece, donor)
                    done, _ = await asyncio.wait({task}, timeout=max(0.01, min(limit - quiet, 0.5)))
                    if done:
                        task.result()  # raises the attempt's error
                        event("done", piece, donor)
                        return
                    quiet = quiet_s(piece, donor)
                    if quiet >= stall_limit(piece):
                        raise TimeoutError(f"donor {donor} sent nothing for {quiet:.1f} s (at byte {got[0]} of {end})")
            except (RpcError, StateSyncError, ValueError, DecodeError, TimeoutError) as e:
                kind = "stalled" if isinstance(e, TimeoutError) else "failed"
                if isinstance(e, TimeoutError) and not second and busy_s(donor) > 0:
                    busy_left.add((piece, donor))
                elif isinstance(e, TimeoutError) and not second and stall_limit(piece) < stall_timeout_s:
                    stalled_early.add(donor)
                unhealthy.add(donor)
                said = donor in unreachable  # a gone donor is said once per download, not once per piece
                if isinstance(e, RpcError) and e.unreachable:
                    # no connection (a gone donor); a donor answering UNAVAILABLE itself ("no state yet") is there
                    unreachable.add(donor)
                moving[piece] = True
                errors.append(str(e))
                reasons[donor] = str(e)
                event(kind, piece, donor, str(e))
                moved_on = donor_moved_on(e, round)
                events.emit(
                    log,
                    # a donor past the round asked is expected while the swarm trains: the catch-up asks again
                    # for the round it moved to (INFO); a donor that cannot be reached is gone (its record outlives
                    # it), and the download's own line says so once (fresh user 43: 23 WARNING lines in 15 s for two
                    # gone donors); WARNING on the caller's last attempt, or any other failure
                    logging.DEBUG
                    if said and isinstance(e, RpcError) and e.unreachable
                    else logging.INFO
                    if (moved_on is not None or (isinstance(e, RpcError) and e.unreachable)) and not last_attempt
                    else logging.WARNING,
                    "state_piece_failed",
                    "state piece %d from %s %s: %s",
                    piece,
                    donor,
                    kind,
                    e
                    if moved_on is None
                    else f"the donor moved on to round {moved_on} (round {round} asked); asked again at the newer round",
                    round=round,
                    piece=piece,
                    donor=donor,
                    outcome=kind,
                    error=str(e),
                )
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.wait({task})
                if not task.cancelled():
                    # retrieved here: an attempt that failed while this piece was itself being cancelled (a
                    # sibling piece failed) left "Task exception was never retrieved" (an ERROR with traceback)
                    task.exception()
        if got[0] != end:
            every = "; ".join(reasons[d] for d in dict.fromkeys(donors) if d in reasons)
            why = f"piece {piece} failed on every donor: {every or (errors[-1] if errors else 'no healthy donor')}"
            raise DonorsUnreachable(why) if donors and set(donors) <= unreachable else StateSyncError(why)

    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
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
        # every piece's error is retrieved (two pieces failing at once, or a cancelled caller, left the
        # others' "Task exception was never retrieved" in the log); the first one is raised below
        failed = [exc for t in tasks if t.done() and not t.cancelled() and (exc := t.exception()) is not None]
    if failed:
        raise failed[0]

    gs = GlobalState(numel, k, buffer=flat)
    got_digest = await asyncio.to_thread(gs.compute_digest)  # 0.5-1 GB/s: off the loop
    if got_digest != expected_digest:
        raise StateSyncError(f"downloaded state has digest {got_digest}, expected {expected_digest}")
    # measured here, not by callers' clocks: what a bad donor cost is the gap its piece saw (issue 14 #3)
    log.info(
        "state of round %d: %d bytes from %d donor(s) in %.2f s; %d piece move(s), longest gap %.2f s",
        round,
        total,
        n,
        time.monotonic() - t0,
        len(gaps),
        max(gaps, default=0.0),
    )
    return Snapshot(round, gs.theta, gs.opt_state, got_digest, buffer=flat)


# --- incremental catch-up (issue 14 #3) ---------------------------------------------------

_UPDATE_MAGIC = b"GMU1"
#: zlib level of an update blob: level 1 gives ~0.25 of the raw fp32 for a mean of sign packets
#: (a few distinct values per block) at ~30 MB/s on a busy core; level 6 only reaches ~0.2 at 2.5x the time.
_ZLIB_LEVEL = 1


@dataclass(frozen=True)
class OuterUpdate:
    """The outer update of round ``round``: what turns the state of round ``round`` (digest
    ``start_digest``) into the state of round ``round + 1`` (``end_digest``), as every peer of the round
    applied it (:func:`geomesh_p2p.model.optim.outer_step_per_part`).

    Attributes:
        aggregate: fp32 CPU [P], the round's aggregated pseudo-gradient (zeros in missing parts).
        ranges: the plan's part ranges ``[start, end)`` in elements, in which the step is applied part
            by part (a non-finite part is skipped, as on every peer).
        idle: ranges that aggregated no token (weights and optimizer state unchanged there).
    """

    round: int
    start_digest: str
    end_digest: str
    ranges: tuple
    idle: tuple
    aggregate: torch.Tensor

    def encode(self) -> bytes:
        """``b"GMU1"``, a 4-byte little-endian header length, the JSON header (round, digests, ranges,
        idle, P) and the zlib-compressed raw little-endian fp32 bytes of ``aggregate``. Synchronous
        (zlib, ~30 MB/s): run it in a worker thread."""
        head = json.dumps(
            {
                "round": int(self.round),
                "start_digest": self.start_digest,
                "end_digest": self.end_digest,
                "numel": int(self.aggregate.numel()),
                "ranges": [list(map(int, r)) for r in self.ranges],
                "idle": [list(map(int, r)) for r in self.idle],
            }
        ).encode()
        body = zlib.compress(self.aggregate.contiguous().numpy().astype("<f4", copy=False).data, _ZLIB_LEVEL)
        return _UPDATE_MAGIC + struct.pack("<I", len(head)) + head + body

    @staticmethod
    def decode(blob: bytes, numel: int) -> "OuterUpdate":
        """Parse :meth:`encode`'s bytes for a model of ``numel`` parameters (synchronous: run it in a thread).

        Raises:
            StateSyncError: a bad magic or header, another P, ranges outside ``[0, P)``, or a body that
                does not inflate to exactly ``4 * P`` bytes (decompression is capped there)."""
        try:
            if blob[:4] != _UPDATE_MAGIC:
                raise ValueError("not an outer update")
            (n,) = struct.unpack("<I", blob[4:8])
            head = json_loads(bytes(blob[8 : 8 + n]), "update header")
            if int(head["numel"]) != numel:
                raise ValueError(f"update for P = {head['numel']}, this model has {numel}")
            ranges = tuple((int(a), int(b)) for a, b in head["ranges"])
            idle = tuple((int(a), int(b)) for a, b in head["idle"])
            if any(not 0 <= a <= b <= numel for a, b in ranges + idle):
                raise ValueError("a range lies outside the model")
            d = zlib.decompressobj()
            raw = d.decompress(bytes(blob[8 + n :]), 4 * numel)
            if len(raw) != 4 * numel or d.unconsumed_tail or not d.eof:
                raise ValueError(f"body does not inflate to {4 * numel} bytes")
            agg = torch.frombuffer(bytearray(raw), dtype=torch.float32)
            return OuterUpdate(
                int(head["round"]), str(head["start_digest"]), str(head["end_digest"]), ranges, idle, agg
            )
        except (ValueError, KeyError, TypeError, struct.error, zlib.error) as e:
            raise StateSyncError(f"malformed outer update: {e}") from None


def apply_update(theta: torch.Tensor, opt_state: torch.Tensor, outer: Any, upd: OuterUpdate) -> None:
    """Apply ``upd`` in place to ``theta`` (fp32 [P]) and ``opt_state`` (fp32 [k * P]) with a shallow copy of
    ``outer`` (the run's outer optimizer: OuterNesterov or SyncAdamW; its own state is not touched),
    exactly as the round's peers did (:meth:`geomesh_p2p.round.rules.outer.OuterStepRule.apply`): nothing when the idle ranges
    cover the model, else :func:`~geomesh_p2p.model.optim.outer_step_per_part`. Synchronous: run it
    in a worker thread."""
    p = theta.numel()
    if sum(e - s for s, e in upd.idle) >= p:
        return
    o = copy.copy(outer)
    o.buf = opt_state
    outer_step_per_part(o, theta, upd.aggregate, list(upd.ranges) or [(0, p)], upd.round, list(upd.idle))


async def fetch_update(
    transport: StreamCaller,
    donors: Sequence[str],
    round: int,
    numel: int,
    *,
    timeout_s: float = 120.0,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    on_event: Optional[EventFn] = None,
    busy_until: Optional[BusyFn] = None,
    on_size: Optional[Callable[[int, int], None]] = None,
) -> OuterUpdate:
    """Download and parse the outer update of ``round`` (``State/GetUpdate``) from the first donor that
    has it; a donor that refuses, sends something inconsistent or nothing for ``stall_timeout_s`` is left
    for the next one (resuming at the byte reached when it serves the same blob, by hash). The blob is at
    most ``4 * P`` bytes plus 1 MiB. ``on_event`` and ``busy_until`` as :func:`download_state`'s (piece -1):
    the stall clock does not run while the donor is known busy with its own round. ``on_size(round,
    total_bytes)``: called (on the loop, must not block) when a blob's first chunk states its size (the
    joiner's announced progress then counts the real size, not an estimate).

    Raises:
        StateSyncError: no donor served a well-formed update of ``round`` (the reasons of each).
    """
    limit = 4 * numel + (1 << 20)
    buf = bytearray()
    blob_hash: Optional[str] = None
    errors: list[str] = []
    loop = asyncio.get_running_loop()

    def event(kind: str, donor: str, detail: str = "") -> None:
        if on_event is not None:
            on_event(kind, -1, donor, detail)

    async def attempt(donor: str) -> None:
        nonlocal blob_hash
        total = None
        req = state_pb2.StateRequest(round=round, offset=len(buf))
        async with contextlib.aclosing(
            transport.call_stream(donor, STATE_UPDATE, req.SerializeToString(), round=round, timeout=timeout_s)
        ) as stream:
            async for v in stream:
                c = state_pb2.StateChunk.FromString(v.payload)
                if blob_hash is not None and c.digest != blob_hash:
                    if c.offset == 0 and not buf:
                        blob_hash = None
                    else:  # another encoding of the update: restart it from this donor
                        raise StateSyncError(f"donor {donor} serves another encoding of the update")
                if (
                    c.round != round
                    or c.offset != len(buf)
                    or c.total_bytes > limit
                    or len(buf) + len(c.data) > c.total_bytes
                ):
                    raise StateSyncError(f"donor {donor} sent an inconsistent update chunk at {c.offset}")
                if blob_hash != c.digest and on_size is not None:
                    on_size(round, c.total_bytes)  # a blob's first chunk: its size is known
                blob_hash = c.digest
                buf.extend(c.data)
                total = c.total_bytes
            if total is None or len(buf) != total:
                raise StateSyncError(f"donor {donor} stopped at byte {len(buf)} of the update")

    def busy(donor: str) -> bool:
        return busy_until is not None and busy_until(donor) > swarm_time()

    # A donor left on a stall while it was known busy with its own round is asked again after the others,
    # and then waited for until that round's end (a first attempt keeps the plain limit: a frozen donor
    # costs no more than before when another donor has the update).
    retry: list[str] = []
    queue = [(d, False) for d in donors]
    while queue:
        donor, second = queue.pop(0)
        event("start", donor, str(len(buf)))
        task = loop.create_task(attempt(donor), name=f"update-{round}-from-{donor}")
        try:
            seen, since = len(buf), time.monotonic()
            while True:
                done, _ = await asyncio.wait(
                    {task}, timeout=max(0.01, min(0.5, since + stall_timeout_s - time.monotonic()))
                )
                if done:
                    task.result()
                    break
                if len(buf) != seen or (second and busy(donor)):
                    seen, since = len(buf), time.monotonic()  # progress, or a donor busy with its own round
                elif time.monotonic() - since >= stall_timeout_s:
                    raise TimeoutError(f"donor {donor} sent nothing for {stall_timeout_s:g} s")
            data = bytes(buf)
            if hashlib.blake2b(data).hexdigest()[:32] != blob_hash:
                raise StateSyncError(f"update of round {round} from {donor} does not match its hash")
            upd = await asyncio.to_thread(OuterUpdate.decode, data, numel)
            if upd.round != round:
                raise StateSyncError(f"donor {donor} sent the update of round {upd.round}, not {round}")
            event("done", donor)
            return upd
        except (RpcError, StateSyncError, ValueError, DecodeError, TimeoutError) as e:
            errors.append(f"{donor}: {e}")
            event("stalled" if isinstance(e, TimeoutError) else "failed", donor, str(e))
            log.info("outer update of round %d from %s failed: %s", round, donor, e)
            if not isinstance(e, TimeoutError):
                buf.clear()  # an inconsistent blob: start again from the next donor
                blob_hash = None
            elif not second and busy(donor):
                retry.append(donor)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if not queue and retry:
            queue, retry = [(d, True) for d in retry], []
    raise StateSyncError(f"no donor served the outer update of round {round}: {'; '.join(errors) or 'no donor'}")


async def catch_up_updates(
    transport: StreamCaller,
    donors: Sequence[str],
    snap: Snapshot,
    *,
    target_round: int,
    target_digest: str,
    outer: Any,
    timeout_s: float = 120.0,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    on_event: Optional[EventFn] = None,
    busy_until: Optional[BusyFn] = None,
    on_size: Optional[Callable[[int, int], None]] = None,
) -> Snapshot:
    """From ``snap`` (a state of round r with its buffer, e.g. a download or a copy of this node's own),
    apply the donors' outer updates of rounds r .. ``target_round`` - 1 in place and return the
    Snapshot of ``target_round``: bitwise the swarm's state, its digest checked to be ``target_digest``
    (the digest the swarm's vote backs). Each update must start from the digest reached so far and end
    at the digest it states (checked after applying it, in a worker thread); the last must reach
    ``target_digest``. ``outer``: the run's outer optimizer (copied, not changed). ``busy_until``: as for
    :func:`download_state` (each update's stall clock waits while its donor is busy). ``on_size``: as for
    :func:`fetch_update`. ``snap``'s buffer is changed in place: discard it when this raises.

    Raises:
        StateSyncError: ``snap`` has no buffer or is past ``target_round``; no donor kept an update;
            an update is forged or tampered (names the round, the donor-stated and the computed digest).
    """
    if snap.buffer is None:
        raise StateSyncError("catch-up needs a snapshot that owns its buffer")
    if snap.round > target_round:
        raise StateSyncError(f"snapshot of round {snap.round} is past round {target_round}")
    P = snap.theta.numel()
    k = snap.buffer.numel() // P - 1
    gs = GlobalState(P, k, buffer=snap.buffer)
    gs.round, gs.digest = snap.round, snap.digest
    # all updates are asked for at once (each round's transfer overlaps the others' and the steps), then
    # applied in order; structured: none of these tasks outlives this call
    loop = asyncio.get_running_loop()
    fetches = {
        r: loop.create_task(
            fetch_update(
                transport,
                donors,
                r,
                P,
                timeout_s=timeout_s,
                stall_timeout_s=stall_timeout_s,
                on_event=on_event,
                busy_until=busy_until,
                on_size=on_size,
            ),
            name=f"update-{r}",
        )
        for r in range(snap.round, target_round)
    }
    try:
        for r in range(snap.round, target_round):
            await _apply_checked(gs, outer, await fetches[r], r, target_round, target_digest)
    finally:
        pending = [t for t in fetches.values() if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        for t in fetches.values():  # a later round's fetch that failed while an earlier one was applied:
            if not t.cancelled():  # its error is retrieved here (the first error is what this call raises)
                t.exception()
    return Snapshot(gs.round, gs.theta, gs.opt_state, gs.digest, buffer=gs.buffer)


async def _apply_checked(
    gs: GlobalState, outer: Any, upd: OuterUpdate, r: int, target_round: int, target_digest: str
) -> None:
    """Apply update ``upd`` of round ``r`` to ``gs`` and check the digests (see :func:`catch_up_updates`)."""
    if upd.start_digest != gs.digest:
        raise StateSyncError(
            f"the outer update of round {r} starts from digest {upd.start_digest[:8]}, "
            f"this state is {(gs.digest or '-')[:8]}"
        )
    await asyncio.to_thread(apply_update, gs.theta, gs.opt_state, outer, upd)
    got = await asyncio.to_thread(gs.commit, r + 1)
    want = target_digest if r + 1 == target_round else upd.end_digest
    if got != upd.end_digest or got != want:
        raise StateSyncError(
            f"the outer update of round {r} is refused: applying it gives digest {got[:8]}, "
            f"the update states {upd.end_digest[:8]}"
            + (f" and the swarm {target_digest[:8]}" if r + 1 == target_round else "")
            + " (forged or tampered)"
        )
