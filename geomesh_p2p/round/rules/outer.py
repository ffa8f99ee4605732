"""The outer step of a round, part by part (:class:`OuterStepRule`): the optimizer maths is
:func:`geomesh_p2p.model.optim.outer_step_per_part`; this rule picks the parts (the plan's owner ranges),
leaves the idle ranges unchanged and says what it skipped (events ``idle_parts_unchanged``,
``outer_step_skipped``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.round.rules.state import RoundState
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
    ):
        self.state = state
        self._theta = theta
        self._outer = outer

    def apply(self, r: int, plan, aggregate: torch.Tensor, idle=()) -> None:
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
