"""The outer step of a round, part by part (:class:`OuterStepRule`): the optimizer maths is
:func:`geomesh_p2p.model.optim.outer_step_per_part`; this rule picks the parts (the plan's owner ranges),
leaves the idle ranges unchanged and says what it skipped (events ``idle_parts_unchanged``,
``outer_step_skipped``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

import torch

from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.round.rules.undo import UndoLog
from geomesh_p2p.telemetry import events

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["OuterStepRule"]


class OuterStepRule:
    """Round ``r``'s outer step on the global state.

    Args:
        state: this peer's :class:`RoundState` (``me``, named in the events).
        theta: the global weights, [P] fp32 CPU (modified in place); None until the state exists.
        outer: the outer optimizer (OuterNesterov / SyncAdamW, its ``buf`` the optimizer state).
    """

    def __init__(
        self,
        state: RoundState,
        theta: Callable[[], Optional[torch.Tensor]],
        outer: Callable[[], Any],
        undo: Optional[UndoLog] = None,
        forged: Callable[[], Mapping[tuple[int, int], tuple[int, int]]] = dict,
        undone: Callable[[], set] = set,
    ):
        self.state = state
        self._theta = theta
        self._outer = outer
        #: exact undo of proven forged parts (RunConfig.undo_forged; None: off): :mod:`.undo`
        self.undo = undo
        self._forged = forged  # (round, part) -> [start, end): forgeries re-checked here (Accountability.forged)
        self._undone = undone  # (round, part) this peer's state no longer holds (Accountability.undone)

    @classmethod
    def for_node(cls, node) -> "OuterStepRule":
        """The node's rule over its state (``node.theta``, ``node.outer``), with the exact undo when its run config
        sets ``undo_forged`` (the forgeries from ``node.accountable``, late-bound)."""
        return cls(
            node.rs,
            theta=lambda: node.theta,
            outer=lambda: node.outer,
            # not with eager updates: their next round trains from the un-undone state already
            undo=UndoLog() if node.run_cfg.undo_forged and not node.run_cfg.eager else None,
            forged=lambda: node.accountable.forged,
            undone=lambda: node.accountable.undone,
        )

    def apply(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """:meth:`step`, with the exact undo around it when on (:meth:`undo_listed` first, the round kept for later
        undos: :class:`~geomesh_p2p.round.rules.undo.UndoLog`). A failure to keep a round is logged (WARNING) and
        leaves it out of later undos; the step itself goes on."""
        undo = self.undo
        theta = self._theta()
        if undo is None or theta is None or getattr(plan, "mode", None) != "accountable":
            return self.step(r, plan, aggregate, idle)
        outer = self._outer()
        undo.begin(r, theta, outer)
        self.undo_listed(r, plan, theta, outer)
        try:
            undo.keep_start(r, theta, outer)
        except OSError as e:
            log.warning("round %d: its start could not be kept for an undo (%s): a forgery of it stays applied", r, e)
        self.step(r, plan, aggregate, idle)
        try:
            undo.record(r, [(s, e) for _, s, e in plan.owners()], idle, aggregate)
        except OSError as e:
            log.warning("round %d: its step could not be kept for an undo (%s): a forgery of it stays applied", r, e)
        undo.after_step(r, theta, outer)

    def undo_listed(self, r: int, plan, theta: torch.Tensor, outer) -> None:
        """Undo the forgeries ``plan.undo`` lists (``(round, part)``; the plan check made sure this peer re-checked
        each one's proof) that this peer's state still holds: :meth:`UndoLog.undo` to the start of round ``r``.
        One WARNING line per undo (event ``forged_part_undone``). A read error of the kept files leaves the state
        half-replayed: the digest check then finds it off the swarm's and the peer re-syncs."""
        assert self.undo is not None
        listed = [(int(a), int(b)) for a, b in (getattr(plan, "undo", None) or [])]
        forged, undone = self._forged(), self._undone()
        todo = [(k, forged[k]) for k in listed if k not in undone and k in forged]
        if not todo:
            return
        try:
            done = self.undo.undo([(k[0], s, e) for k, (s, e) in todo], r, theta, outer)
        except OSError as e:
            log.error("round %d: the undo of %s failed reading the kept rounds: %s", r, [k for k, _ in todo], e)
            return
        for k, _ in todo:
            undone.add(k)  # undone here, or older than the kept rounds (left applied): never tried again
        if done:
            events.emit(
                log,
                logging.WARNING,
                "forged_part_undone",
                "round %d: forged part(s) %s undone: outer steps of rounds %d..%d replayed with them idle",
                r,
                [[a, b, c] for a, b, c in done],
                min(a for a, _, _ in done),
                r - 1,
                peer=self.state.me,
                round=r,
                undone=[[a, b, c] for a, b, c in done],
            )

    def step(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
        """Apply the outer step to the global weights and the outer optimizer's state part by part
        (:func:`~geomesh_p2p.model.optim.outer_step_per_part`): parts whose aggregate has a non-finite value,
        or whose new weights or optimizer state would not be finite, keep their values (one WARNING line).
        Every honest peer holds the same weights, state and aggregate bytes, so every one skips the same parts
        and the digests stay equal. Parts: the plan's owner ranges, ``[start, end)`` elements of ``[P]``.

        ``idle``: ranges that aggregated no token (missing parts, rounds nobody trained in): weights and
        outer momentum stay as they were there (issue 14 #8: momentum alone must not move the model
        through rounds that trained nothing); one INFO line. Synchronous: the driver runs it in a thread.

        Raises:
            RuntimeError: the global state does not exist yet.
        """
        theta = self._theta()
        if theta is None:
            raise RuntimeError("the global weights do not exist yet (the node has not built its training state)")
        me = self.state.me
        p = theta.numel()
        if idle:
            n_idle = sum(e - s for s, e in idle)
            events.emit(
                log,
                logging.INFO,
                "idle_parts_unchanged",
                "round %d: %d of %d elements aggregated no token (%s); weights and outer momentum unchanged there",
                r,
                n_idle,
                p,
                "the whole model" if n_idle >= p else f"{len(idle)} part(s)",
                peer=me,
                round=r,
                idle=[[s, e] for s, e in idle],
                idle_elements=n_idle,
                elements=p,
            )
            if n_idle >= p:
                return
        ranges = [(start, end) for _, start, end in plan.owners()] or [(0, p)]
        bad, bad_in = outer_step_per_part(self._outer(), theta, aggregate, ranges, r, idle)
        if bad:
            events.emit(
                log,
                logging.WARNING,
                "outer_step_skipped",
                "round %d: outer step skipped on %d of %d parts (%d of %d elements): %d with non-finite "
                "aggregate values, %d where the step would overflow",
                r,
                len(bad),
                len(ranges),
                sum(e - s for s, e in bad),
                p,
                len(bad_in),
                len(bad) - len(bad_in),
                peer=me,
                round=r,
                skipped=[[s, e] for s, e in bad],
                not_finite=[[s, e] for s, e in bad_in],
                parts=len(ranges),
                elements=p,
            )
