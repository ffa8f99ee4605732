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


#: Environment switch for an experiment (session 47): the event loop thread's EEVDF slice in microseconds (Linux >=
#: 6.12 reads ``sched_runtime`` of a ``SCHED_OTHER`` thread as its requested slice; 100-100,000 us; default ~0.7-3 ms).
#: A shorter slice gives the thread an earlier deadline, so it preempts a longer-slice thread when it wakes, and the
#: kernel carries the shortest slice of a group up to the group (an autogroup: the whole peer process).
SLICE_ENV = "GEOMESH_LOOP_SLICE_US"

_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SYS_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}
_ATTR = "IIQiIQQQII"  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)


def _attr_syscall(number: int, tid: int, buf, size_or_flags: int, flags: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, tid, buf, size_or_flags, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def sched_attr(tid: int = 0) -> tuple:
    """The thread's ``struct sched_attr`` as a tuple (size, policy, flags, nice, priority, runtime ns, deadline ns,
    period ns, util min, util max). Raises OSError (or KeyError off x86_64/aarch64)."""
    import ctypes
    import platform
    import struct

    buf = ctypes.create_string_buffer(struct.calcsize(_ATTR))
    _attr_syscall(_SYS_SCHED_GETATTR[platform.machine()], tid, buf, len(buf), 0)
    return struct.unpack(_ATTR, buf.raw)


def set_slice_us(us: int, tid: int = 0) -> bool:
    """Request an EEVDF slice of ``us`` microseconds for thread ``tid`` (0: the caller), keeping its policy, nice and
    priority; True when set. Never raises: one INFO line and False where the OS refuses."""
    import ctypes
    import platform
    import struct

    try:
        _, pol, _, nice, prio, *_ = sched_attr(tid)
        buf = ctypes.create_string_buffer(
            struct.pack(_ATTR, struct.calcsize(_ATTR), pol, 0, nice, prio, us * 1000, 0, 0, 0, 0)
        )
        _attr_syscall(_SYS_SCHED_SETATTR[platform.machine()], tid, buf, 0, 0)
        return True
    except (OSError, KeyError, AttributeError) as e:
        log.info("the event loop's thread keeps the default scheduler slice: the OS refused a %d us slice (%s)", us, e)
        return False
