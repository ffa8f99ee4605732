"""The command channel of one multi-rank peer's ranks (issue 30): rank 0's :class:`Command` to its followers, the
process groups (:class:`RankChannel`), the failure of a collective (:class:`RankFailure`) and the row split of a
step's batch (:func:`split_rows`). How the ranks use them: :mod:`geomesh_p2p.model.ranks` (every inner step
together) and :mod:`geomesh_p2p.model.rank_rounds` (once a round)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

log = logging.getLogger("geomesh_p2p.model.ranks")

__all__ = [
    "Command",
    "RankFailure",
    "RankChannel",
    "split_rows",
    "collective_timeout_s",
    "rank_profile",
    "one_line",
    "PING",
    "SETUP",
    "WEIGHTS",
    "STEP",
    "EXIT",
    "GATHER",
    "RUN",
    "PING_PERIOD_S",
    "MIN_COLLECTIVE_TIMEOUT_S",
    "MAX_RANKS",
]

# Command opcodes (Command.op).
PING, SETUP, WEIGHTS, STEP, EXIT, GATHER, RUN = 0, 1, 2, 3, 4, 5, 6
_OPS = {PING: "ping", SETUP: "setup", WEIGHTS: "weights", STEP: "step", EXIT: "exit", GATHER: "gather", RUN: "run"}
#: Seconds between rank 0's keep-alive commands while no other command goes out.
PING_PERIOD_S = 2.0
#: Shortest collective timeout (seconds): a step of a large model, the followers' model build at SETUP.
MIN_COLLECTIVE_TIMEOUT_S = 60.0
#: Most ranks one peer may have (a record's ``ranks`` is bounded the same way).
MAX_RANKS = 64


def collective_timeout_s(window_s: Optional[float]) -> float:
    """The timeout of every torch.distributed collective of a peer's ranks (seconds): 4 sync windows, at
    least :data:`MIN_COLLECTIVE_TIMEOUT_S`; 300 s without a window. A collective waits at most one inner
    step or one keep-alive period in a healthy peer; a rank that hangs (SIGSTOP, a stuck device) ends the
    peer's round after this long instead of hanging it forever (a dead rank is seen at once: its
    connections close)."""
    if window_s is None:
        return 300.0
    return max(MIN_COLLECTIVE_TIMEOUT_S, 4.0 * float(window_s))


def split_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row micro-batch that rank ``rank`` of ``world`` trains: equal
    shares, the first ``rows % world`` ranks one row more. A rank may get none (``rows < world``).
    Raises ValueError for ``world < 1``, a rank outside ``[0, world)`` or ``rows < 0``."""
    if world < 1 or not 0 <= rank < world or rows < 0:
        raise ValueError(f"rank {rank} of {world} ranks, {rows} rows: need world >= 1, 0 <= rank < world, rows >= 0")
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_profile(tokens_per_s: dict[int, float], max_batch: int, ranks: int) -> tuple[dict[int, float], int]:
    """A peer's figures from one rank's start-up profile: batch ``b`` per rank is ``ranks x b`` for the peer
    at ``ranks x`` the tokens/s (DDP over local devices scales about linearly; each round's re-profiling
    corrects it), and the peer's largest batch is ``ranks x`` the rank's. Returns ``(tokens/s per peer
    batch, peer max batch)``. Raises ValueError for ``ranks < 1``."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    return {b * ranks: v * ranks for b, v in tokens_per_s.items()}, max(1, max_batch) * ranks


@dataclass(frozen=True)
class Command:
    """One command of rank 0 to its followers, 8 float64 on the wire (:meth:`to_tensor`).

    ``op``: :data:`PING`, :data:`SETUP` (``arg`` = the vocabulary size the model is built with, ``step`` 1 =
    shard it, FSDP), :data:`WEIGHTS` (a broadcast of rank 0's flat parameters follows on the main group; sharded:
    ``set_model_state_dict`` from rank 0), :data:`GATHER` (sharded only: every rank joins the gather of the
    trained shards to rank 0's whole model), :data:`STEP` (the
    ``[batch_size, seq_len]`` int64 batch follows on the command channel; ``micro_batch`` rows per pass for
    the whole peer, 0 = all; learning rate ``lr``; ``arg`` 1 = step the inner optimizer, 0 = gradient
    only, the ddp baseline), :data:`RUN` (``--rank-sync round``: the run's int64 ``[step, batch_size, seq_len]``
    batches follow; each rank trains its rows of them alone, ``lr`` = seconds to the train deadline or -1, ``arg``
    = rank 0's global step; :mod:`geomesh_p2p.model.rank_rounds`) or :data:`EXIT`. ``round`` and ``step`` are for
    the followers' logs.
    """

    op: int
    round: int = 0
    step: int = 0
    batch_size: int = 0
    micro_batch: int = 0
    seq_len: int = 0
    lr: float = 0.0
    arg: int = 0

    def to_tensor(self) -> torch.Tensor:
        """float64 ``[8]`` (integers below 2**53 are exact; ``lr`` is a float64)."""
        return torch.tensor(
            [self.op, self.round, self.step, self.batch_size, self.micro_batch, self.seq_len, self.lr, self.arg],
            dtype=torch.float64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Command":
        """The inverse of :meth:`to_tensor`. Raises ValueError for an unknown opcode or a malformed tensor."""
        if t.shape != (8,):
            raise ValueError(f"a command is 8 float64, got shape {tuple(t.shape)}")
        v = t.tolist()
        op = int(v[0])
        if op not in _OPS or v[0] != op:
            raise ValueError(f"unknown command opcode {v[0]}")
        return cls(op, int(v[1]), int(v[2]), int(v[3]), int(v[4]), int(v[5]), float(v[6]), int(v[7]))

    def __str__(self) -> str:
        return f"{_OPS[self.op]}(round={self.round}, step={self.step}, batch={self.batch_size})"


class RankFailure(RuntimeError):
    """A collective of the peer's ranks failed (a rank died or timed out); the message says which and why."""


class RankChannel:
    """The process groups of one peer's ranks and rank 0's command channel.

    Made by :meth:`init` in every rank (a collective: all ranks call it). On rank 0 :meth:`send` and
    :meth:`broadcast_weights` issue commands (thread-safe: a lock orders them with the keep-alive thread of
    :meth:`start_keepalive`); on a follower :meth:`recv` and :meth:`recv_batch` take them. ``on_failure``
    (rank 0) is called once, with a one-line reason, when a collective fails; :attr:`broken` holds it.
    """

    def __init__(self, rank: int, world: int, device: torch.device, main: Any, cmd: Any, timeout_s: float):
        self.rank, self.world, self.device = rank, world, device
        self.main, self.cmd, self.timeout_s = main, cmd, timeout_s
        self.broken: Optional[str] = None
        #: a follower: rank 0's SETUP asked for a sharded model (FSDP); set by :meth:`wait_setup`
        self.setup_shard = False
        #: one rank's memory budget (bytes), set by the node once it profiled (its record announces it)
        self.rank_memory_bytes: Optional[int] = None
        self.on_failure: Optional[Callable[[str], None]] = None
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._stop = threading.Event()
        self._keepalive: Optional[threading.Thread] = None
        #: rank 0: the followers run a command on their own until the ranks meet (a RUN): no keep-alive
        self._busy = False
        #: rank 0: the broadcasts of the last command sent without waiting, and their tensors (:meth:`send`)
        self._pending: Optional[tuple[list[Any], list[torch.Tensor]]] = None

    @classmethod
    def init(
        cls, rank: int, world: int, device: str, init_method: str, timeout_s: float, backend: Optional[str] = None
    ) -> "RankChannel":
        """Join the peer's process groups (blocks until all ``world`` ranks joined, at most ``timeout_s``):
        the main group with ``backend`` (default NCCL when ``device`` is CUDA, else gloo; gloo for ranks that
        share one GPU, which NCCL refuses), and a gloo command group. ``init_method``:
        ``env://`` (MASTER_ADDR / MASTER_PORT, as torchrun sets) or ``tcp://HOST:PORT``. Raises RankFailure
        when the others do not come (the reason in one line)."""
        dev = torch.device(device)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
            cmd = dist.new_group(backend="gloo", timeout=timeout)  # the commands: small CPU tensors
        except (RuntimeError, ValueError) as e:
            raise RankFailure(f"rank {rank} of {world}: the peer's ranks did not form ({one_line(e)})") from None
        return cls(rank, world, dev, dist.group.WORLD, cmd, timeout_s)

    # -- rank 0 ---------------------------------------------------------------------------------------
    def send(
        self,
        command: Command,
        batch: Optional[torch.Tensor] = None,
        *,
        wait: bool = True,
        more: tuple = (),
        busy: bool = False,
    ) -> None:
        """Rank 0: broadcast ``command`` (and ``batch``, int64 ``[B, seq_len]``, for a STEP; int64 ``[H, B,
        seq_len]`` for a RUN, then ``more``: a RUN's int64 ``[K + 2]``, the rows per rank then the token floor's
        steps and its grace in microseconds) on the command channel. The command sent before, when it was not waited
        for, completes first (:meth:`_settle`).

        ``wait`` False (a STEP): the broadcasts are started (``async_op``) and this returns at once, so rank 0
        does not wait for the followers to be ready to receive (they are finishing the step before, or reading
        the weights) but goes on with its rows; gloo's threads complete the broadcasts meanwhile. They are waited
        for before the next command, so a failure is still seen (the step's gradient all-reduce sees a dead rank
        first). The bytes on the wire are the same. Raises RankFailure (after :meth:`fail`) when it fails, or
        when the channel is broken.

        ``busy`` (a RUN): the followers are busy until the ranks meet (:meth:`met`); no keep-alive goes out
        meanwhile. A follower takes no command while it trains, and gloo's broadcast waits until every rank
        receives, so a PING sent then would wait for the whole run holding the lock, and fail the peer once a run
        outlasts the collective timeout although every rank is healthy (the meeting's own collectives see a
        dead or hung rank)."""
        if self.broken is not None:
            raise RankFailure(self.broken)
        with self._lock:
            self._send_locked(command, batch, wait, more)
            if busy:
                self._busy = True

    def _send_locked(self, command: Command, batch: Optional[torch.Tensor], wait: bool, more: tuple) -> None:
        """:meth:`send`'s broadcasts, the lock held. Raises RankFailure."""
        try:
            self._settle()
            tensors = [command.to_tensor()]
            if batch is not None:
                tensors.append(batch.to("cpu", torch.int64).contiguous())
            tensors.extend(m.to("cpu", torch.int64).contiguous() for m in more)
            works = [dist.broadcast(t, src=0, group=self.cmd, async_op=not wait) for t in tensors]
            if not wait:
                self._pending = (works, tensors)  # the tensors live until their broadcasts completed
        except RuntimeError as e:
            raise self.fail(f"command {command} to the other ranks failed", e) from None
        self._last_send = time.monotonic()

    def met(self) -> None:
        """Rank 0: the followers of a ``busy`` command (:meth:`send`) met rank 0 and wait for commands again:
        the keep-alive resumes, its period counted from now, and the command's broadcasts are settled (they
        completed: every rank took them before it trained), so their tensors (a RUN's batches, ``8 x H x B x
        seq_len`` bytes) are not held through the round's exchange. Never raises."""
        with self._lock:
            if self.broken is None:
                try:
                    self._settle()
                except RuntimeError as e:
                    self.fail("a command to the other ranks failed", e)
            self._pending = None
            self._last_send = time.monotonic()
            self._busy = False

    def _settle(self) -> None:
        """Rank 0, the lock held: wait until the last command sent without waiting (``send(wait=False)``) reached
        every rank. Raises the broadcast's RuntimeError."""
        pending, self._pending = self._pending, None
        for work in pending[0] if pending is not None else ():
            work.wait()

    def broadcast_weights(self, model: torch.nn.Module) -> None:
        """Rank 0: the model's parameters to every rank (a :data:`WEIGHTS` command, then one flat broadcast
        on the main group). Raises RankFailure."""
        self.send(Command(WEIGHTS))
        try:
            with torch.no_grad():
                flat = parameters_to_vector(model.parameters())
                dist.broadcast(flat, src=0, group=self.main)
        except RuntimeError as e:
            raise self.fail("broadcasting the weights to the other ranks failed", e) from None

    def fail(self, what: str, error: BaseException) -> RankFailure:
        """Mark the channel broken (first failure only), call ``on_failure`` once; returns the RankFailure
        to raise. ``what``: what was being done."""
        reason = f"{what}: {one_line(error)}"
        first = self.broken is None
        if first:
            self.broken = reason
            self._stop.set()
            cb = self.on_failure
            if cb is not None:
                cb(reason)
        return RankFailure(self.broken or reason)

    def start_keepalive(self, period_s: float = PING_PERIOD_S) -> None:
        """Rank 0: a daemon thread sending :data:`PING` whenever no command went out for ``period_s`` (none while
        the followers are busy with a RUN: :meth:`send`)."""

        def loop() -> None:
            while not self._stop.wait(period_s / 4):
                if self._busy or time.monotonic() - self._last_send < period_s:
                    continue
                if not self._lock.acquire(blocking=False):
                    continue
                try:
                    # checked again under the lock: a busy command may have gone out since (send sets it there)
                    if self._busy or self.broken is not None or time.monotonic() - self._last_send < period_s:
                        continue
                    self._send_locked(Command(PING), None, True, ())
                except RankFailure:
                    return
                finally:
                    self._lock.release()

        self._keepalive = threading.Thread(target=loop, name="rank-keepalive", daemon=True)
        self._keepalive.start()

    def close(self, exit_followers: bool = True) -> None:
        """Rank 0: stop the keep-alive, tell the followers to exit (when the channel is healthy), leave the
        process groups. Followers: leave the groups. Never raises."""
        self._stop.set()
        t = self._keepalive
        if t is not None:
            t.join(timeout=self.timeout_s)
        if self.rank == 0 and exit_followers and self.broken is None:
            try:
                self.send(Command(EXIT))
            except RankFailure:
                pass
        if self.broken is None:
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError, AssertionError):  # already gone
                pass

    # -- followers ------------------------------------------------------------------------------------
    def recv(self) -> Command:
        """A follower: the next command of rank 0. Raises RankFailure when rank 0 is gone or times out."""
        t = torch.zeros(8, dtype=torch.float64)
        try:
            dist.broadcast(t, src=0, group=self.cmd)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: rank 0 is gone ({one_line(e)})") from None
        return Command.from_tensor(t)

    def wait_setup(self) -> Optional[int]:
        """A follower: skip keep-alives until rank 0's :data:`SETUP`; returns its vocabulary size (the model to
        build; whether to shard it is then :attr:`setup_shard`), or None when rank 0 sent :data:`EXIT` first.
        Raises RankFailure."""
        while True:
            cmd = self.recv()
            if cmd.op == SETUP:
                self.setup_shard = bool(cmd.step)
                return cmd.arg
            if cmd.op == EXIT:
                return None

    def recv_batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        """A follower: the STEP's int64 ``[batch_size, seq_len]`` batch. Raises RankFailure."""
        t = torch.empty(batch_size, seq_len, dtype=torch.int64)
        try:
            dist.broadcast(t, src=0, group=self.cmd)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: rank 0 is gone ({one_line(e)})") from None
        return t

    def recv_weights(self, model: torch.nn.Module) -> None:
        """A follower: rank 0's flat parameters into ``model``. Raises RankFailure."""
        with torch.no_grad():
            flat = parameters_to_vector(model.parameters())
            try:
                dist.broadcast(flat, src=0, group=self.main)
            except RuntimeError as e:
                raise RankFailure(f"rank {self.rank}: the weights' broadcast failed ({one_line(e)})") from None
            vector_to_parameters(flat, model.parameters())


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
