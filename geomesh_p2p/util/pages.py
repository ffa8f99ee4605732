"""Resident pages of a read-only file mapping handed back to the page cache (issue 27).

A process's RSS counts the pages of a file mapping it touched until they are unmapped. Verified work reads a
round's kept start weights (4P bytes, :class:`~geomesh_p2p.trust.kept_weights.KeptWeights`) through a
copy-on-write map: one forward pass touches all of them, so a check pass held the whole round's weights in RSS
on top of its activations (+0.34 GiB at ``gpt2-124m``, session 39). ``madvise(MADV_DONTNEED)`` unmaps such
pages; the next read faults them back from the page cache (a minor fault, with the kernel's fault-around:
no disk read while the cache keeps them) and the kernel may reclaim them meanwhile.

Only for a *private file mapping that is never written*: there a dropped page reads back the file's bytes,
which are the mapping's. On anonymous memory, or on a page written since it was mapped, it would lose data
(zeros, or the file's older bytes): callers pass only ranges of such a mapping.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Optional

from geomesh_p2p.util.malloc import libc

__all__ = ["PAGE_BYTES", "drop_file_pages"]

#: the system's page size (bytes)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


@functools.cache
def _madvise() -> Optional[Callable[..., int]]:
    """libc's ``madvise`` with its C signature (set once, here: its only caller), or None where it is missing."""
    lib = libc()
    fn = getattr(lib, "madvise", None) if lib is not None else None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def drop_file_pages(addr: int, nbytes: int, lo: int, hi: int) -> bool:
    """Unmap the resident pages of ``[addr, addr + nbytes)`` (bytes), widened to whole pages but clipped to the
    mapping ``[lo, hi)`` (``lo`` page-aligned, as ``mmap`` returns it): they are read back from the file on next
    touch. The range must lie in a private file mapping never written (module docstring). True when done; False
    for an empty or outside range, or where ``madvise`` is missing or refuses (nothing changes then)."""
    if nbytes <= 0 or addr < lo or addr + nbytes > hi:
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    start = max(lo, addr // PAGE_BYTES * PAGE_BYTES)
    end = min(-(-hi // PAGE_BYTES) * PAGE_BYTES, -(-(addr + nbytes) // PAGE_BYTES) * PAGE_BYTES)
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0
