"""Exact undo of a proven forged part (issue 26, "the affected part is repaired"): :class:`UndoLog`.

Accountable mode proves a forged part one to three rounds after it was applied (the validator's publication,
then the plan check's grace). Every honest reader applied the owner's signed bytes, so the forged update sits
in every honest peer's weights and outer momentum alike. To take it out exactly, each peer keeps, for the last
:data:`UNDO_ROUNDS` rounds it applied, what the outer step consumed and started from:

* the round's start weights θ (fp32 ``[P]``) and the outer optimizer's state (``outer.buf``: Nesterov momentum,
  ``[P]``; AdamW m and v, ``[2P]``) and its step count;
* the round's applied aggregate (fp32 ``[P]``), its parts (the plan's owner ranges) and its idle ranges.

The P-sized items are written to raw fp32 files and read back memory-mapped
(:class:`~geomesh_p2p.trust.kept_weights.KeptWeights`, the store verified work keeps its start weights in),
so they cost disk, not RSS: ``4P (θ) + 4kP (optimizer state, k = 1 for Nesterov) + 4P (aggregate)`` bytes per
kept round, 12P for Nesterov (at ``gpt2-124m``, 1.49 GB per round, 4.5 GB for 3 rounds); while a replay runs it
maps one round's files at a time (pages faulted in as read, released when dropped).

:meth:`UndoLog.undo` rewinds θ and the optimizer to the kept start of the oldest forged round and replays the
outer steps with each forged range idle in its round (weights and momentum unchanged there, as an idle range
is), then the later rounds' aggregates unchanged. The ops and their order are those of the original steps, so
the result is bitwise the state of a run in which those ranges had been idle from the start. The kept starts
of the replayed rounds are rewritten, and the forged ranges stay idle in the kept record, so a later undo (or
the same one listed again) replays from corrected state: listing an undo twice changes nothing.

Blocking (file I/O, P-sized compute): call it from the driver's worker thread, under the state's lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.trust.kept_weights import KeptWeights

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["UNDO_ROUNDS", "UndoLog", "replay_step", "undo_bytes_per_round"]

#: Rounds kept for an undo: a forgery's proof reaches the plans up to ~3 rounds after the forged round (one round
#: for the validator's publication, up to two for the plan check's grace; docs/collective.md).
UNDO_ROUNDS = 3

Range = tuple[int, int]
#: ``step(round, parts, aggregate, idle)``: one outer step in place, as the round applied it.
StepFn = Callable[[int, Sequence[Range], torch.Tensor, Sequence[Range]], None]


def undo_bytes_per_round(numel: int, state_factor: int = 1) -> int:
    """Disk bytes one kept round costs: θ, the optimizer state (``state_factor`` x P) and the aggregate, fp32."""
    return 4 * int(numel) * (2 + int(state_factor))


@dataclass
class _Round:
    steps: int  # outer.steps at the round's start
    has_buf: bool  # the optimizer state existed at the start (None before the first step)
    parts: Optional[list[Range]] = None  # set once the round was applied (record)
    idle: list[Range] = field(default_factory=list)


def replay_step(outer: Any, theta: torch.Tensor, r: int, parts: Sequence[Range], aggregate: torch.Tensor, idle) -> None:
    """One outer step exactly as :meth:`~geomesh_p2p.round.rules.outer.OuterStepRule.apply` takes it (no
    events): nothing when ``idle`` covers the whole vector, else
    :func:`~geomesh_p2p.model.optim.outer_step_per_part` over ``parts`` (``[(0, P)]`` when empty)."""
    p = theta.numel()
    if idle and sum(e - s for s, e in idle) >= p:
        return
    outer_step_per_part(outer, theta, aggregate, list(parts) or [(0, p)], r, idle)


class UndoLog:
    """The last ``keep_rounds`` rounds' starts and applied steps, on disk (module doc).

    Args:
        keep_rounds: rounds kept (:data:`UNDO_ROUNDS`).
        dir: folder for the private temporary directories (None: the system's temp folder).

    Raises:
        OSError: the directories cannot be made.
    """

    def __init__(self, keep_rounds: int = UNDO_ROUNDS, dir: Optional[str] = None):
        self.keep_rounds = int(keep_rounds)
        self._theta = KeptWeights(dir)
        self._state = KeptWeights(dir)
        self._agg = KeptWeights(dir)
        self._rounds: dict[int, _Round] = {}
        self._mu = threading.RLock()
        self._too_old: set[tuple[int, int, int]] = set()  # forgeries logged as past the kept rounds (once each)
        self._after: Optional[tuple[int, tuple]] = None  # (round, state key) right after the newest recorded step

    @staticmethod
    def _key(theta: torch.Tensor, outer: Any) -> tuple:
        """What changes when anything but the recorded steps writes the state: torch's in-place version counters
        (a re-sync, a catch-up's update, a checkpoint load) or a new buffer, and the step count."""
        buf = getattr(outer, "buf", None)
        b = (buf.data_ptr(), buf._version) if buf is not None else None
        return (theta.data_ptr(), theta._version, b, int(outer.steps))

    def begin(self, r: int, theta: torch.Tensor, outer: Any) -> None:
        """Round ``r``'s outer step is next: unless the state is exactly where round ``r - 1``'s recorded step
        left it (the same buffers, unwritten since), forget every kept round: a replay from them would rebuild
        another line than the state's (this peer re-synced, caught up or skipped a round)."""
        with self._mu:
            after, self._after = self._after, None
            if after is not None and after == (r - 1, self._key(theta, outer)):
                return
            for old in list(self._rounds):
                self._drop(old)

    # -- keeping -------------------------------------------------------------------------------------------
    def keep_start(self, r: int, theta: torch.Tensor, outer: Any) -> None:
        """Keep round ``r``'s start (``theta`` fp32 ``[P]`` and ``outer``'s state) before its outer step; drops
        rounds older than ``keep_rounds``. Raises OSError when a write fails (round ``r`` is then not kept)."""
        with self._mu:
            self._drop(r)
            buf = getattr(outer, "buf", None)
            try:
                self._theta.put(r, theta)
                if buf is not None:
                    self._state.put(r, buf)
            except BaseException:
                self._drop(r)
                raise
            self._rounds[int(r)] = _Round(int(outer.steps), buf is not None)
            for old in [x for x in self._rounds if x <= r - self.keep_rounds]:
                self._drop(old)

    def record(self, r: int, parts: Sequence[Range], idle: Sequence[Range], aggregate: torch.Tensor) -> None:
        """Round ``r`` applied ``aggregate`` (fp32 ``[P]``) over ``parts`` with ``idle`` ranges unchanged (after
        :meth:`keep_start` of ``r``; otherwise nothing is kept). Raises OSError when the write fails (the round
        is then not kept)."""
        with self._mu:
            k = self._rounds.get(int(r))
            if k is None:
                return
            try:
                self._agg.put(r, aggregate.detach().to(torch.float32))
            except BaseException:
                self._drop(r)
                raise
            k.parts = [(int(s), int(e)) for s, e in parts]
            k.idle = [(int(s), int(e)) for s, e in idle]

    def after_step(self, r: int, theta: torch.Tensor, outer: Any) -> None:
        """Round ``r``'s step is done and recorded: note the state's key (:meth:`begin` of ``r + 1`` checks it)."""
        with self._mu:
            self._after = (int(r), self._key(theta, outer))

    def rounds(self) -> list[int]:
        """Rounds kept complete (start and applied step), ascending."""
        with self._mu:
            return sorted(r for r, k in self._rounds.items() if k.parts is not None)

    def can_undo(self, forged_round: int, now: int) -> bool:
        """True when the kept rounds let a forgery of ``forged_round`` be undone at the start of round ``now``:
        every round ``forged_round .. now - 1`` is kept complete."""
        kept = set(self.rounds())
        return forged_round < now and all(x in kept for x in range(forged_round, now))

    # -- undo ----------------------------------------------------------------------------------------------
    def undo(
        self,
        forged: Sequence[tuple[int, int, int]],
        now: int,
        theta: torch.Tensor,
        outer: Any,
        step: Optional[StepFn] = None,
    ) -> list[tuple[int, int, int]]:
        """Take the forged ranges out of the state at the start of round ``now`` (``theta`` fp32 ``[P]`` and
        ``outer``, changed in place): ``forged`` lists ``(round, start, end)``. Forgeries whose round is not
        kept back to ``now - 1`` are left applied (one INFO line each, once). ``step``: the outer step
        (default :func:`replay_step`). Returns the forgeries undone (none: the state is untouched).

        Raises:
            OSError: a kept file cannot be read (the state may then be half-replayed: the caller re-syncs).
        """
        if step is None:
            step = lambda r, parts, agg, idle: replay_step(outer, theta, r, parts, agg, idle)  # noqa: E731
        with self._mu:
            ok = [f for f in forged if self.can_undo(int(f[0]), now)]
            for f in forged:
                key = (int(f[0]), int(f[1]), int(f[2]))
                if f not in ok and key not in self._too_old:
                    self._too_old.add(key)
                    log.info(
                        "round %d: forged part [%d, %d) of round %d is older than the kept rounds %s: left applied",
                        now,
                        f[1],
                        f[2],
                        f[0],
                        self.rounds(),
                    )
            if not ok:
                return []
            for r, s, e in ok:
                k = self._rounds[int(r)]
                if (int(s), int(e)) not in k.idle:
                    k.idle.append((int(s), int(e)))
            r0 = min(int(f[0]) for f in ok)
            self._restore(r0, theta, outer)
            for r in range(r0, now):
                if r > r0:  # the replayed start of a later round replaces the one kept when it ran
                    self._theta.put(r, theta)
                    if outer.buf is not None:
                        self._state.put(r, outer.buf)
                    self._rounds[r].steps, self._rounds[r].has_buf = int(outer.steps), outer.buf is not None
                k = self._rounds[r]
                agg = self._agg.get(r)
                assert agg is not None and k.parts is not None  # can_undo: every round kept complete
                step(r, k.parts, agg, sorted(k.idle))
                del agg  # the mapping's pages leave with it
            return [tuple(map(int, f)) for f in ok]  # type: ignore[misc]

    def _restore(self, r: int, theta: torch.Tensor, outer: Any) -> None:
        """θ and the optimizer back to round ``r``'s kept start, in place."""
        k = self._rounds[r]
        kept = self._theta.get(r)
        assert kept is not None
        theta.copy_(kept)
        del kept
        if k.has_buf:
            buf = self._state.get(r)
            assert buf is not None and outer.buf is not None
            outer.buf.copy_(buf)
        elif outer.buf is not None:
            outer.buf = None  # no step had run before round r: the first one makes zeros again
        outer.steps = k.steps
        if hasattr(outer, "_fused_bound"):
            del outer._fused_bound  # θ and the state were written: the fused step's cached bound is stale

    def _drop(self, r: int) -> None:
        self._rounds.pop(int(r), None)
        for store in (self._theta, self._state, self._agg):
            store.drop(r)

    def close(self) -> None:
        """Delete every kept file. Safe to call twice."""
        with self._mu:
            self._rounds.clear()
            for store in (self._theta, self._state, self._agg):
                store.close()
