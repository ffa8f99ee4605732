"""glibc's malloc arenas (torch-free, so that a CLI sets them before anything else runs; issue 27).

A peer's worker threads each get a malloc arena of their own, and memory freed in one arena is reused by that
arena only: :func:`limit_malloc_arenas` caps them; :mod:`geomesh_p2p.model.memory` trims them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Optional

__all__ = ["MALLOC_ARENAS", "libc", "limit_malloc_arenas"]

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8

#: glibc malloc arenas a peer process uses at most (:func:`limit_malloc_arenas`).
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for the rest of this process (``mallopt(M_ARENA_MAX)``), unless
    the environment sets ``MALLOC_ARENA_MAX`` (the user's value wins). True when the cap was set.

    glibc gives threads that allocate at once their own arenas (up to 8 per core), and memory freed in one
    arena is reused by that arena only: a peer's worker threads (encoding, verification, evaluation, the
    outer step) each keep freed tensors' memory resident. On ``benchmarks/real_size.py --quick`` (gpt2-124m,
    3 peers on 2 cores) two arenas lowered the peak RSS per peer from 6.75-6.86 to 6.30-6.38 GiB with the
    same step and round times (docs/real-size.md, session 11). Call it first thing in the process, before any
    second thread allocates: glibc fixes its arena limit when it first makes a second arena, after which
    ``mallopt`` changes nothing (a process whose thread pool had allocated before the call still made 9; peers
    capped after their imports peaked at 1.65-1.70x the minimum where ``MALLOC_ARENA_MAX=2`` gave 1.59x, one
    run each: session 41). Other C libraries: nothing happens, False."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))


@functools.cache
def libc() -> Optional[ctypes.CDLL]:
    """The C library, loaded once (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _glibc() -> Optional[ctypes.CDLL]:
    """The C library when it has glibc's ``malloc_trim`` and ``mallopt``; None elsewhere (musl, macOS)."""
    lib = libc()
    return lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
