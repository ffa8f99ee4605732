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

__all__ = ["MALLOC_ARENAS", "LOW_MEMORY_MMAP_MIB", "libc", "limit_malloc_arenas", "set_mmap_threshold"]

#: glibc mallopt parameters (malloc.h).
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8

#: glibc malloc arenas a peer process uses at most (:func:`limit_malloc_arenas`).
MALLOC_ARENAS = 2

#: ``geomesh-peer join``'s mmap threshold, MiB, when ``--memory-budget-gb`` is given and ``--mmap-threshold-mib``
#: is not (:func:`set_mmap_threshold`).
LOW_MEMORY_MMAP_MIB = 4.0


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
    return _mallopt(_M_ARENA_MAX, int(arenas), "MALLOC_ARENA_MAX")


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (``mallopt(M_MMAP_THRESHOLD)``, 1 .. 32 MiB) for the rest of this
    process, unless the environment sets ``MALLOC_MMAP_THRESHOLD_`` (the user's value wins). True when set.

    glibc serves a block under its threshold from the heap; the threshold starts at 128 KiB and rises, up to 32
    MiB, to the size of each mapped block freed, so a peer's 2-30 MiB tensors (a weight's gradient, a codec
    slice) soon all come from the heap, where a freed block is split for smaller ones and the next big one takes
    fresh heap: free but resident memory, 0.3-0.6 GiB of a ``gpt2-124m`` peer (``mallinfo2``'s free bytes,
    docs/real-size.md session 42). At a fixed threshold every block from ``nbytes`` on is mapped, and unmapped
    when freed. The price: those blocks are faulted in afresh each time (an inner step 1.2x slower at
    ``gpt2-124m`` with 64-token rows and at the tiny preset, 1.03x at 1,024-token rows, 4 MiB; a 1 MiB threshold
    made tiny-preset steps 1.5-3x slower, session 11). Other C libraries: nothing happens, False.

    Raises:
        ValueError: ``nbytes`` outside 1 .. 32 MiB (glibc's own bound on 64-bit).
    """
    if not 0 < int(nbytes) <= 32 << 20:
        raise ValueError(f"an mmap threshold of {nbytes} bytes is outside 1 .. 32 MiB")
    return _mallopt(_M_MMAP_THRESHOLD, int(nbytes), "MALLOC_MMAP_THRESHOLD_")


@functools.cache
def libc() -> Optional[ctypes.CDLL]:
    """The C library, loaded once (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt(param: int, value: int, env: str) -> bool:
    """``mallopt(param, value)`` unless the environment variable ``env`` (glibc's own spelling of the same setting)
    is set: the user's value wins. True when glibc took it."""
    if os.environ.get(env):
        return False
    lib = _glibc()
    return lib is not None and bool(lib.mallopt(param, value))


def _glibc() -> Optional[ctypes.CDLL]:
    """The C library when it has glibc's ``malloc_trim`` and ``mallopt``; None elsewhere (musl, macOS)."""
    lib = libc()
    return lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
