"""Log a line once per key (issue 15: one log-once helper for the whole package).

A peer polled every 0.2 s, a misbehaving caller sending the same bad message in a loop, or a DHT
record that stays malformed must not turn into one log line per poll. Call sites hold a
:class:`LogOnce` and hand it a hashable key (who, what went wrong); the first call with a key logs,
the next ones with the same key do not. The memory of keys is an LRU of ``capacity`` entries, so a
flood of distinct keys (spoofed peer ids) cannot grow it: the least recently seen key is forgotten
and would log again.

Where the call site records a structured event (:mod:`geomesh_p2p.telemetry.events`), pass ``event=`` and the
event fields: the line is then logged through :func:`geomesh_p2p.telemetry.events.emit`, once per key as well.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Hashable, Optional

from geomesh_p2p.telemetry import events


class LogOnce:
    """Logs each key once, remembering at most ``capacity`` keys (least recently seen forgotten first).

    ``logger``: where the lines go. ``capacity``: number of keys kept (>= 1), else ValueError.
    Thread-safe; cheap enough for the event loop (a dict look-up per call).
    """

    def __init__(self, logger: logging.Logger, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.logger, self.capacity = logger, capacity
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is seen (it is then remembered), False while it is remembered.
        A repeat refreshes the key (LRU), so a key that keeps coming back is never logged twice."""
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return True

    def __call__(
        self, key: Hashable, level: int, msg: str, *args: Any, event: Optional[str] = None, **fields: Any
    ) -> bool:
        """Log ``msg % args`` at ``level`` the first time ``key`` is seen; returns whether it logged.

        With ``event``: logs through ``events.emit(logger, level, event, msg, *args, **fields)`` so the
        sinks get the event too (once per key, like the line). Without it ``fields`` must be empty
        (TypeError otherwise: fields with no event would be silently lost).
        """
        if fields and event is None:
            raise TypeError("LogOnce: event fields given without event=")
        if not self.first(key):
            return False
        if event is None:
            self.logger.log(level, msg, *args, stacklevel=2)  # the record names the call site
        else:
            events.emit(self.logger, level, event, msg, *args, stacklevel=2, **fields)  # names the call site too
        return True

    def __len__(self) -> int:
        """Number of keys remembered (<= capacity)."""
        return len(self._seen)


class LogOnChange:
    """The failures of one resource (a disk, a file, a remote service), logged once per change of state.

    A resource that fails the same way at every try (a full disk at each round's checkpoint, a bootstrap
    down at each refresh) must not print the same WARNING each time (issue 29 #7: 46 identical lines), and
    when it comes back the operator must read that it did. :meth:`failed` logs at ``level`` when the
    resource was fine before or fails another way (its ``kind`` differs), at DEBUG otherwise;
    :meth:`recovered` logs one INFO line when it was failing. Thread-safe.

    Attributes:
        failing: the ``kind`` of the current failure, None while the resource works.
        repeats: failures since the last line logged at ``level`` (0 after it).
    """

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING):
        self.logger, self.level = logger, level
        self.failing: Optional[Hashable] = None
        self.repeats = 0
        self.failures = 0  # since the resource last worked
        self._lock = threading.Lock()

    def failed(self, kind: Hashable, msg: str, *args: Any, event: Optional[str] = None, **fields: Any) -> bool:
        """One failure of kind ``kind`` (e.g. ``("OSError", errno)``): ``msg % args`` at ``level`` when the
        state changed, else at DEBUG (with ``event``: through :func:`events.emit`, the event recorded each
        time with a ``repeat`` field). Returns whether it logged at ``level``."""
        with self._lock:
            changed = kind != self.failing
            self.failing = kind
            self.failures += 1
            self.repeats = 0 if changed else self.repeats + 1
            repeat = self.repeats
        level = self.level if changed else logging.DEBUG
        if event is None:
            self.logger.log(level, msg, *args, stacklevel=2)
        else:
            events.emit(self.logger, level, event, msg, *args, stacklevel=2, repeat=repeat, **fields)
        return changed

    def recovered(self, msg: str, *args: Any, event: Optional[str] = None, **fields: Any) -> bool:
        """The resource works again: ``msg % args`` at INFO when it was failing (read :attr:`failures` first
        to say after how many), nothing otherwise. Returns whether it logged."""
        with self._lock:
            was = self.failing is not None
            self.failing, self.repeats, self.failures = None, 0, 0
        if not was:
            return False
        if event is None:
            self.logger.info(msg, *args, stacklevel=2)
        else:
            events.emit(self.logger, logging.INFO, event, msg, *args, stacklevel=2, **fields)
        return True
