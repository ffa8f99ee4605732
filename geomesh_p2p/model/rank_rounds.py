"""Ranks that meet once a round (``--rank-sync round``, issue 30): local SGD inside one multi-rank peer.

Under ``--rank-sync step`` (the default, :class:`~geomesh_p2p.model.ranks.RankedTrainer` with DDP) the ranks
meet at every inner step's gradient all-reduce, so each step waits for the slowest rank: on devices that other
processes share (a volunteer's desktop, a CPU box) a descheduled rank holds the others back, and a 2-rank peer
trained 0.61-0.87 of the tokens of two one-rank peers on the same cores (docs/multi-rank.md, "Measured").

Here each rank runs the round's inner steps on its own, as a one-rank peer would, and the ranks meet once at the
end. For a run of ``H`` steps of ``B`` rows (the peer's plan):

* rank 0 samples the ``H`` batches exactly as a one-device peer would (the dataset's pure function of seed, peer,
  round and step: what verified work re-computes) and sends them once, int64 ``[H, B, seq_len]`` on the command
  channel after a :data:`~geomesh_p2p.model.ranks.RUN` command, not waited for;
* rank ``r`` trains on its rows of every step's batch (:func:`rank_split`: in proportion to each rank's tokens/s
  measured at the earlier meetings, even shares at first, so that a slower rank, or rank 0 busy with the node's
  exchange and verified work besides, finishes with the others; the rows per rank follow the batches), with
  its own inner optimizer (kept across rounds, DiLoCo-style, as every peer keeps its own), up to ``H`` steps or
  the plan's train deadline, whichever comes first (each rank times its own steps);
* then one all-reduce of ``[tokens, loss x steps, steps]`` and one of the weights, each rank's scaled by its
  share of the tokens: rank 0's model becomes the token-weighted mean of the ranks' trained weights, so the peer's
  pseudo-gradient is the token-weighted mean of its ranks' pseudo-gradients (the swarm's own aggregation rule,
  applied inside the peer first). A rank that trained nothing, or hit a non-finite loss, has weight 0.

What it changes for the swarm: nothing on the wire (one peer, one pseudo-gradient, its tokens). What differs
from one device: ``K`` trajectories of ``B / K`` rows averaged once, instead of one trajectory of ``B`` rows
(DiLoCo's own trade, at a scale of ``K`` workers sharing one start); the inner optimizer states differ per rank.
Verified work draws steps among those the token claim implies; when the ranks stop at different steps (the
deadline), a drawn step may have been trained by some ranks only. Memory: rank 0 holds the run's batches,
``8 x H x B x seq_len`` bytes, until the followers took them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from geomesh_p2p.model.rank_channel import RUN, Command, RankFailure, one_line, split_rows
from geomesh_p2p.model.training import InnerResult, InnerTrainer
from geomesh_p2p.net.swarm_time import swarm_time

if TYPE_CHECKING:
    from geomesh_p2p.model.ranks import RankedTrainer

__all__ = [
    "independent_ranks",
    "run_independent",
    "follow_run",
    "rank_split",
    "update_speeds",
    "NO_DEADLINE",
    "SPEED_EMA",
]

#: ``Command.lr`` of a RUN without a train deadline (the field carries the seconds left until it otherwise).
NO_DEADLINE = -1.0


#: Weight of the newest run in a rank's speed estimate (:func:`update_speeds`).
SPEED_EMA = 0.5


def independent_ranks(rank_sync: str, device_share: int, shard: bool) -> bool:
    """Whether a multi-rank peer's ranks meet once a round (True) or at every inner step (False), from
    ``--rank-sync`` (``"round"``, ``"step"`` or ``"auto"``), the ranks on rank 0's device (``device_share``: CPU
    ranks share the machine's cores, ``cuda:0,cuda:0`` one GPU) and ``shard`` (FSDP: one model over the ranks, so
    every step). ``auto``: once a round where ranks share a device (a per-step meeting then waits for whichever
    rank the scheduler set back: docs/multi-rank.md, "Measured"), every step where each rank has a device of its
    own (the one-device trajectory; NCCL overlaps the meeting with the backward pass). Raises ValueError for
    another ``rank_sync``."""
    if rank_sync not in ("auto", "step", "round"):
        raise ValueError(f"rank_sync {rank_sync!r}: use auto, step or round")
    if shard or rank_sync == "step":
        return False
    return rank_sync == "round" or device_share > 1


def rank_split(batch_size: int, speeds: Optional[Sequence[float]], world: int) -> list[int]:
    """Rows of every step's ``batch_size``-row batch per rank: proportional to ``speeds`` (each rank's measured
    tokens/s, rank 0 first), so that ranks of different speeds (another device, or rank 0 busy with the node's
    exchange and verified work besides) finish their steps together; largest remainders, ties to the lower rank;
    every rank at least one row when ``batch_size >= world``. Equal shares (:func:`split_rows`) while the speeds
    are unknown (None, a length other than ``world``, or one not finite and positive). Sums to ``batch_size``.
    Raises ValueError for ``world < 1`` or ``batch_size < 0``."""
    if world < 1 or batch_size < 0:
        raise ValueError(f"{batch_size} rows over {world} ranks: need world >= 1 and batch_size >= 0")
    even = [e - s for s, e in (split_rows(batch_size, world, r) for r in range(world))]
    if speeds is None or len(speeds) != world or not all(math.isfinite(v) and v > 0 for v in speeds):
        return even
    floor = 1 if batch_size >= world else 0
    spare = batch_size - floor * world
    top = max(speeds)
    weights = [v / top for v in speeds]  # in (0, 1]: no sum or product overflows (speeds near 1e308)
    total = sum(weights)
    exact = [spare * (w / total) for w in weights]
    rows = [int(x) for x in exact]
    order = sorted(range(world), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[: spare - sum(rows)]:
        rows[r] += 1
    return [floor + n for n in rows]


def update_speeds(old: Optional[list[float]], tokens: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """Each rank's speed estimate (tokens/s) after a run: ``SPEED_EMA`` of this run's ``tokens / seconds`` and the
    rest of ``old``; a rank without a measurement this run (no token, no time, a rate not finite) keeps its old figure (the mean of
    the others' when it has none)."""
    new = [t / s if t > 0 and s > 0 and math.isfinite(t / s) else None for t, s in zip(tokens, seconds)]
    known = [v for v in new if v is not None]
    fill = sum(known) / len(known) if known else 1.0
    out = []
    for r, v in enumerate(new):
        prev = old[r] if old is not None and r < len(old) else None
        if v is None:
            out.append(prev if prev is not None else fill)
        else:
            out.append(v if prev is None else SPEED_EMA * v + (1 - SPEED_EMA) * prev)
    return out


def _rank_micro(micro_batch: Optional[int], world: int) -> Optional[int]:
    """One rank's micro-batch (rows per forward pass) from the peer's (a multiple of the ranks, planned for all of
    them together): ``micro_batch // world``, at least 1; None (the whole batch) stays None."""
    if not micro_batch:
        return None
    return max(1, int(micro_batch) // world)


def run_independent(
    t: "RankedTrainer",
    *,
    round: int,
    inner_steps: int,
    batch_size: int,
    micro_batch: Optional[int] = None,
    deadline: Optional[float] = None,
    progress: Optional[Callable[[int, float, float], None]] = None,
    should_stop: Optional[Callable[[], bool]] = None,
    floor_steps: int = 0,
    floor_grace_s: float = 0.0,
) -> InnerResult:
    """Rank 0: one run of inner steps with the ranks stepping on their own (module docstring); every rank's first
    ``floor_steps`` steps may run ``floor_grace_s`` past ``deadline`` (the token floor, :meth:`InnerTrainer.run`:
    the peer's tokens reach the floor only when every rank trained its steps). Returns the
    peer's :class:`InnerResult`: the ranks' tokens summed (``steps_done``: their steps' worth, rounded up), the
    loss the mean over every rank's steps, ``compute_s`` rank
    0's from its first step to the end of the meeting. ``progress(k, loss, tokens/s)`` reports rank 0's steps at
    the peer's rate (``K x`` its own). Raises RankFailure (the channel's ``on_failure`` was called) when a
    collective fails; FloatingPointError when rank 0's loss is non-finite, or its weights are and no rank's are
    finite, and any other error of rank 0's own steps (each after the meeting, where rank 0 counted 0 tokens, so
    the followers never wait for it at a meeting rank 0 skipped)."""
    ch = t.channel
    H, B = int(inner_steps), int(batch_size)
    t0 = time.perf_counter()
    if H <= 0:  # nothing to train: no RUN, no meeting
        return InnerResult(0, 0, float("nan"), float("nan"), 0.0, False)
    split = rank_split(B, t.rank_speeds, ch.world)
    rows = torch.stack([InnerTrainer._step_batch(t, round, k, B) for k in range(H)]).to(torch.int64)
    left = NO_DEADLINE if deadline is None else max(0.0, float(deadline) - swarm_time())
    cmd = Command(
        RUN,
        round=round,
        step=H,
        batch_size=B,
        micro_batch=int(micro_batch or 0),
        seq_len=t.seq_len,
        lr=left,
        arg=t.global_step,
    )
    # the followers start as soon as they take it; rank 0 trains meanwhile
    # busy: no keep-alive until the meeting (the followers take no command meanwhile: RankChannel.send)
    # the rows per rank, then the token floor's steps and its grace in microseconds (follow_run reads them)
    grace = float(floor_grace_s)
    extra = [max(0, int(floor_steps)), int(min(grace, 1e6) * 1e6) if grace > 0 else 0]  # (NaN: none)
    ch.send(cmd, rows, wait=False, more=(torch.tensor(split + extra, dtype=torch.int64),), busy=True)
    world = ch.world

    def peer_rate(k: int, loss: float, tps: float) -> None:
        if progress is not None:
            progress(k, loss, tps * world)

    floor = (int(floor_steps), float(floor_grace_s))
    own, error = _train_share(t, rows, split, round, H, micro_batch, deadline, peer_rate, should_stop, floor)
    del rows
    try:
        steps, tokens, loss_sum, per_rank, own_finite = _meet(t, own)
        t.rank_speeds = update_speeds(t.rank_speeds, per_rank[:, 1].tolist(), per_rank[:, 3].tolist())
        if error is None and not own_finite and tokens == 0:
            # no rank has finite weights to give rank 0's model: what a non-finite loss gives (steps.py resets)
            error = FloatingPointError(f"non-finite weights after round {round}'s inner steps on every rank")
    except RankFailure:
        # on_failure was called (the node leaves); rank 0's own steps are in its model: they are the peer's.
        steps, tokens, loss_sum = own.steps_done, own.tokens, own.mean_loss * own.steps_done
        own = dataclasses.replace(own, stopped_early=True)
    finally:
        ch.met()
    t.optimizer.zero_grad(set_to_none=True)
    if error is not None:
        raise error
    per_step = B * t.seq_len
    return InnerResult(
        # the peer's steps' worth of tokens, rounded up (ranks may stop at different steps at the deadline):
        # what its telemetry compares with the plan, and a bound on how far the mean of the ranks moved
        steps_done=-(-tokens // per_step) if per_step else 0,
        tokens=tokens,
        mean_loss=loss_sum / steps if steps else float("nan"),  # over every rank's steps
        last_loss=own.last_loss,
        compute_s=time.perf_counter() - t0,
        stopped_early=own.stopped_early or tokens < H * per_step,
    )


def follow_run(t: "RankedTrainer", cmd: Command) -> None:
    """A follower: take a RUN's batches and rows per rank, train this rank's rows, meet rank 0. Raises RankFailure
    when a collective fails or rank 0's split does not add up to the batch."""
    ch = t.channel
    H, B = cmd.step, cmd.batch_size  # a RUN has H >= 1 (run_independent sends none for 0 steps)
    rows = torch.empty(H, B, cmd.seq_len, dtype=torch.int64)
    split_t = torch.zeros(ch.world + 2, dtype=torch.int64)  # the rows per rank, the floor's steps and grace (µs)
    try:
        dist.broadcast(rows, src=0, group=ch.cmd)
        dist.broadcast(split_t, src=0, group=ch.cmd)
    except RuntimeError as e:
        raise RankFailure(f"rank {ch.rank}: rank 0 is gone ({one_line(e)})") from None
    split = [int(v) for v in split_t[: ch.world].tolist()]
    floor = (max(0, int(split_t[ch.world])), max(0, int(split_t[ch.world + 1])) / 1e6)
    if sum(split) != B or min(split) < 0:
        raise RankFailure(f"rank {ch.rank}: rank 0 split {B} rows as {split}")
    t.global_step = cmd.arg  # the lr schedule of the peer's steps (lr_for), as rank 0's
    deadline = None if cmd.lr < 0 else swarm_time() + cmd.lr
    own, error = _train_share(t, rows, split, cmd.round, H, cmd.micro_batch or None, deadline, None, None, floor)
    _meet(t, own)
    t.optimizer.zero_grad(set_to_none=True)
    if error is not None and not isinstance(error, FloatingPointError):
        raise error  # after the meeting (rank 0 got this rank's 0 tokens); the follower then exits (follow)


def _train_share(
    t: "RankedTrainer",
    rows: torch.Tensor,
    split: list[int],
    round: int,
    H: int,
    micro_batch: Optional[int],
    deadline: Optional[float],
    progress: Optional[Callable[[int, float, float], None]],
    should_stop: Optional[Callable[[], bool]],
    floor: tuple[int, float] = (0, 0.0),
) -> tuple[InnerResult, Optional[BaseException]]:
    """This rank's inner steps on its rows of ``rows`` (int64 ``[H, B, seq_len]``; ``split[r]`` rows for rank ``r``,
    in rank order): :meth:`InnerTrainer.run` with the step's batch read from ``rows``, ``floor`` its ``(floor_steps,
    floor_grace_s)`` (seconds). Returns its result (0 steps
    when it raised) and the error to raise after the meeting: a non-finite loss, or any other error of the steps
    (a rank that skipped the meeting would leave the others waiting in it, then every later command of rank 0
    out of step with them, until the collective timeout failed the peer)."""
    ch = t.channel
    start = sum(split[: ch.rank])
    stop = start + split[ch.rank]
    if H <= 0 or stop <= start:
        return InnerResult(0, 0, float("nan"), float("nan"), 0.0, H > 0), None
    t._local_rows = rows[:, start:stop]
    try:
        result = InnerTrainer.run(
            t,
            round=round,
            inner_steps=H,
            batch_size=stop - start,
            micro_batch=_rank_micro(micro_batch, ch.world),
            deadline=deadline,
            progress=progress,
            should_stop=should_stop,
            floor_steps=floor[0],
            floor_grace_s=floor[1],
        )
        return result, None
    except Exception as e:  # noqa: BLE001 - raised again after the meeting
        return InnerResult(0, 0, float("nan"), float("nan"), 0.0, True), e
    finally:
        t._local_rows = None


@torch.no_grad()
def _meet(t: "RankedTrainer", own: InnerResult) -> tuple[int, int, float, torch.Tensor, bool]:
    """The ranks' one meeting of a run: each rank's ``[steps, tokens, loss x steps, compute seconds]`` to every rank
    (one all-reduce of a ``[K, 4]`` float64 table, each rank filling its row), then make every rank's model the
    token-weighted mean of their trained weights (a rank of 0 tokens adds zeros: its weights may be non-finite).
    A rank whose trained weights are not all finite (a step that overflowed after a finite loss) counts 0 steps and
    0 tokens, and its inner optimizer starts afresh (its state is likely non-finite too, and would poison every
    later run). Returns the sums ``(steps, tokens, loss x steps)``, the table (CPU) and whether this rank's
    weights were finite. Raises RankFailure."""
    ch = t.channel
    dev = t.device
    params = list(t.model.parameters())
    flat = parameters_to_vector(params)
    finite = bool(torch.isfinite(flat).all())
    if not finite:
        own = dataclasses.replace(own, steps_done=0, tokens=0)
        t.optimizer.state.clear()
    loss_sum = own.mean_loss * own.steps_done if own.steps_done else 0.0
    if not math.isfinite(loss_sum):
        loss_sum = 0.0
    table = torch.zeros(ch.world, 4, dtype=torch.float64, device=dev)
    table[ch.rank] = torch.tensor([float(own.steps_done), float(own.tokens), loss_sum, own.compute_s])
    try:
        dist.all_reduce(table, group=ch.main)
        table = table.cpu()
        steps, tokens, total_loss = (float(v) for v in table[:, :3].sum(dim=0).tolist())
        if tokens > 0:
            if own.tokens:
                flat.mul_(own.tokens / tokens)
            else:
                flat.zero_()
            dist.all_reduce(flat, group=ch.main)
            vector_to_parameters(flat, params)
    except RuntimeError as e:
        raise ch.fail("the ranks' end-of-round meeting failed", e) from None
    return int(steps), int(tokens), total_loss, table, finite
