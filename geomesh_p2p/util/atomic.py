"""One atomic file write for the whole project (checkpoints, bootstrap state, token caches, tokenizers)."""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

__all__ = ["atomic_write", "bounded_write_s", "MIN_DISK_BPS", "WRITE_TIMEOUT_MIN_S"]

#: A write that is allowed to fail (a cache) may take at least this long (seconds) ...
WRITE_TIMEOUT_MIN_S = 60.0
#: ... or its bytes at this rate (a slow network file system), whichever is longer (:func:`bounded_write_s`).
MIN_DISK_BPS = 10e6


def bounded_write_s(nbytes: int) -> float:
    """Seconds a write of ``nbytes`` bytes may take before it counts as hung: ``max(WRITE_TIMEOUT_MIN_S,
    nbytes / MIN_DISK_BPS)``."""
    return max(WRITE_TIMEOUT_MIN_S, nbytes / MIN_DISK_BPS)


def atomic_write(
    path: str | os.PathLike, write: Callable[[str], None], mode: int = 0o644, timeout_s: Optional[float] = None
) -> None:
    """Write ``path`` so that a reader sees the old file or the new one, never a part: ``write(tmp)`` fills
    a temporary file in the same directory (created with ``mode``), which is fsynced and renamed over
    ``path`` (``os.replace``). The parent directory is created if missing. Blocking file I/O: call it in
    a worker thread from async code.

    ``timeout_s``: for a write that may fail (a cache): it runs in a thread of its own, and when it has not
    finished after that many seconds (a file system that does not answer, issue 29 #5) TimeoutError (an
    OSError, ``ETIMEDOUT``) is raised while the thread goes on; it may still complete the file later.

    Raises:
        OSError: the directory cannot be written, the disk is full, ...; the temporary file is removed
            and the previous ``path`` stays as it was. Whatever ``write`` raises, likewise.
    """
    if timeout_s is not None:
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                atomic_write(path, write, mode)
            except BaseException as e:  # handed to the caller below
                outcome.append(e)

        t = threading.Thread(target=run, name=f"write:{Path(path).name}", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(errno.ETIMEDOUT, f"no answer from the file system in {timeout_s:.0f} s", str(path))
        if outcome:
            raise outcome[0]
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + p.name + ".", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
