"""When a peer evaluates the global weights (issue 27, "defaults that fit the model"): :class:`EvalSchedule`.

``--eval-every N`` evaluates after every N-th round and the last. ``--eval-every auto`` (the default) keeps
evaluation within :data:`EVAL_SHARE` of the wall time from what this peer measures: the seconds of its last
evaluation (the first is the initial one at start) and of its rounds. An evaluation of ``e`` seconds every
``k`` rounds of ``t`` seconds takes ``e / (k t + e)`` of the time, at most the share ``f`` when
``k >= e (1 - f) / (f t)`` (:func:`eval_interval`). At ``gpt2-124m`` on one CPU thread an evaluation of 8
batches took 13-16 s while a round of one inner step took ~7 s (the issue): every round, that was two thirds of
the time; with 30 inner steps a round (``--window-s auto``) it is every 2nd round, ~3%.
"""

from __future__ import annotations

import collections
import math
from typing import Optional

__all__ = ["EVAL_SHARE", "EvalSchedule", "eval_interval"]

#: The most of a peer's wall time ``--eval-every auto`` spends evaluating.
EVAL_SHARE = 0.05
#: Auto schedules with the mean seconds of this many latest rounds.
ROUNDS_MEAN = 8


def eval_interval(eval_s: float, round_s: float, share: float = EVAL_SHARE) -> int:
    """Rounds between two evaluations that keep evaluation within ``share`` of the wall time: the least ``k >=
    1`` with ``eval_s / (k * round_s + eval_s) <= share``, i.e. ``ceil(eval_s * (1 - share) / (share *
    round_s))``. ``eval_s``: seconds of one evaluation; ``round_s``: seconds of one round without it. 1 when
    either is not a positive finite number (nothing measured yet). E.g. 15 s and 200 s at 5%: 2 (3.6% of the
    time); 15 s and 7 s: 41. Raises ValueError for ``share`` outside (0, 1)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share={share} must be in (0, 1)")
    if not (math.isfinite(eval_s) and math.isfinite(round_s)) or eval_s <= 0 or round_s <= 0:
        return 1
    # a relative 1e-9 so that an exact ratio (a test's, or 0.95 s over 1 s) is not rounded up by float error
    return max(1, math.ceil(eval_s * (1.0 - share) / (share * round_s) * (1 - 1e-9)))


class EvalSchedule:
    """Which rounds a peer evaluates after (:meth:`due`), from ``every`` (``--eval-every``: a fixed N, or None
    for auto) and, for auto, the seconds it measured (:meth:`note_eval`, :meth:`note_round`).

    Auto: the first round is evaluated when no evaluation was measured yet (a driver without the node's initial
    one); then round ``r`` is evaluated when ``r - (the last evaluated round) >= eval_interval(last evaluation's
    seconds, mean seconds of the latest ROUNDS_MEAN rounds)``, and the last round always. The initial evaluation counts as
    round -1. Not thread-safe: the driver's loop calls it."""

    def __init__(self, every: Optional[int] = None, share: float = EVAL_SHARE):
        if every is not None and every < 1:
            raise ValueError(f"every={every} must be >= 1 (or None: auto)")
        eval_interval(1.0, 1.0, share)  # checks the share
        self.every, self.share = every, share
        self.eval_s: Optional[float] = None  # seconds of the last evaluation measured
        self.last_round: Optional[int] = None  # the round it measured (-1: the initial evaluation)
        self._round_s: collections.deque[float] = collections.deque(maxlen=ROUNDS_MEAN)  # the latest rounds' seconds

    def note_eval(self, r: int, seconds: float) -> None:
        """An evaluation after round ``r`` (-1: before the first) took ``seconds`` of wall time."""
        self.eval_s, self.last_round = max(0.0, float(seconds)), int(r)

    def note_eval_seconds(self, seconds: float) -> None:
        """The last evaluation's seconds, measured after it was noted (a background one ends rounds later)."""
        self.eval_s = max(0.0, float(seconds))

    def note_round(self, seconds: float) -> None:
        """A round took ``seconds`` of wall time, without its evaluation (a non-positive or non-finite figure
        is ignored)."""
        if math.isfinite(seconds) and seconds > 0:
            self._round_s.append(float(seconds))

    @property
    def interval(self) -> int:
        """Rounds between evaluations now: ``every``, or auto's :func:`eval_interval` of the figures noted
        (1 until an evaluation and a round are measured)."""
        if self.every is not None:
            return self.every
        if self.eval_s is None or not self._round_s:
            return 1
        return eval_interval(self.eval_s, sum(self._round_s) / len(self._round_s), self.share)

    def due(self, r: int, last: bool) -> bool:
        """Whether to evaluate after round ``r`` (``last``: the peer's last round: always)."""
        if last:
            return True
        if self.every is not None:
            return (r + 1) % self.every == 0
        if self.eval_s is None or self.last_round is None:
            return True
        return r - self.last_round >= self.interval
