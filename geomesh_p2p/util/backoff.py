"""Capped exponential backoff for the round's DHT reads (no fixed-period polling)."""

from __future__ import annotations

__all__ = ["Backoff"]


class Backoff:
    """Delays ``first, first*factor, ...`` capped at ``cap`` (seconds); :meth:`reset` restarts at ``first``
    (call it when what is polled changed: the next change is likely soon).

    Raises:
        ValueError: ``first`` <= 0, ``cap`` < ``first`` or ``factor`` < 1.
    """

    def __init__(self, first: float = 0.05, cap: float = 1.0, factor: float = 1.5):
        if first <= 0 or cap < first or factor < 1:
            raise ValueError(f"bad backoff: first={first}, cap={cap}, factor={factor}")
        self.first, self.cap, self.factor = float(first), float(cap), float(factor)
        self._next = self.first

    def next(self) -> float:
        """The delay to wait now (seconds); the one after it grows by ``factor`` up to ``cap``."""
        d = self._next
        self._next = min(self.cap, self._next * self.factor)
        return d

    def reset(self) -> None:
        """Start again at ``first``."""
        self._next = self.first
