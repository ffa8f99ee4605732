"""Mark compute threads ``SCHED_BATCH`` so that the event loop's thread wins a contended CPU (issue 27, session 47).

Linux keeps a scheduling policy per thread (``sched_setscheduler(0, ...)`` acts on the calling thread), and a thread
takes its creator's policy, so a worker thread marked before its first torch call also marks the OpenMP team that
torch starts from it. ``SCHED_BATCH`` keeps the thread's weight (its nice, hence its CPU share, is unchanged: no
priority inversion through the GIL as with a raised nice, session 27) and only stops it from preempting others when it
wakes. It is reversible without privileges (back to ``SCHED_OTHER``), unlike a raised nice under ``RLIMIT_NICE`` 0.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

__all__ = ["ENV", "mark_current_thread", "policy_of", "wanted"]

log = logging.getLogger(__name__)

#: Environment switch: "batch" marks compute threads, "off" (or anything else) leaves every thread as it is.
ENV = "GEOMESH_COMPUTE_SCHED"

_refused_lock = threading.Lock()
_refused_logged = False


def wanted() -> bool:
    """True when :data:`ENV` asks for ``SCHED_BATCH`` compute threads."""
    return os.environ.get(ENV, "").strip().lower() == "batch"


def mark_current_thread() -> bool:
    """Set the calling thread's policy to ``SCHED_BATCH`` (priority 0); True when set. Never raises: where the OS
    refuses (no ``sched_setscheduler``, ``EPERM`` under seccomp, ``EINVAL``) it logs one INFO line per process and
    returns False."""
    global _refused_logged
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # type: ignore[attr-defined]
        return True
    except (AttributeError, OSError, ValueError) as e:
        with _refused_lock:
            first, _refused_logged = not _refused_logged, True
        if first:
            log.info("compute threads stay at the default scheduling policy: the OS refused SCHED_BATCH (%s)", e)
        return False


def policy_of(tid: Optional[int] = None) -> Optional[int]:
    """The scheduling policy (``os.SCHED_*``) of the thread with native id ``tid`` (the calling thread when None), or
    None where it cannot be read."""
    try:
        return os.sched_getscheduler(0 if tid is None else tid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
