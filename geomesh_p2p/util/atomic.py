"""One atomic file write for the whole project (checkpoints, bootstrap state, token caches, tokenizers)."""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

try:  # POSIX; elsewhere a write holds no lock and nothing is swept
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "atomic_write",
    "bounded_write_s",
    "sweep_stale_writes",
    "try_lock",
    "open_unlocked",
    "MIN_DISK_BPS",
    "WRITE_TIMEOUT_MIN_S",
    "STALE_WRITE_AGE_S",
]

log = logging.getLogger(__name__)

#: A temporary file of :func:`atomic_write` at least this old (seconds since its last change) whose lock nobody holds
#: is a dead process's (:func:`sweep_stale_writes`); younger ones are left (the instant between its creation and lock)
STALE_WRITE_AGE_S = 60.0
#: the temporary files :func:`atomic_write` makes: ``.<name>.gm-<8 random characters>.tmp`` (``gm-``: a sweep of a
#: folder the user shares with other programs, ``--checkpoint-dir .``, never takes theirs; red team 43b)
_TMP_NAME = re.compile(r"^\..+\.gm-[a-z0-9_]{8}\.tmp$")

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
    fd, tmp = tempfile.mkstemp(prefix="." + p.name + ".gm-", suffix=".tmp", dir=p.parent)
    try:
        # held while the file is written: a process killed mid-write (a checkpoint, a 1 GB token file) leaves it
        # unlocked, and a later start removes it (sweep_stale_writes); the lock is the inode's, so write may reopen it
        # (a file system without flock: the write goes on unlocked, and a sweep there cannot lock it either)
        try_lock(fd)
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
    finally:
        os.close(fd)


def try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting. False when another open file holds it, or where the
    file system or platform has no ``flock`` (Lustre's default answers ENOSYS, NFS without its lock daemon ENOLCK)."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def open_unlocked(path: str) -> Optional[int]:
    """A descriptor of ``path`` with its exclusive ``flock`` taken (close it to release), or None when it cannot be
    opened (gone, not this user's, a link) or its lock is held: a live owner's (:func:`try_lock`). Never blocks."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    if not try_lock(fd):
        os.close(fd)
        return None
    return fd


def sweep_stale_writes(folder: str | os.PathLike, min_age_s: float = STALE_WRITE_AGE_S) -> list[str]:
    """Remove the temporary files :func:`atomic_write` left in ``folder`` when its process died mid-write (SIGKILL,
    the OOM killer, a power cut: a partial checkpoint or token file each time): ``.<name>.gm-<random>.tmp`` files
    unchanged for ``min_age_s`` seconds whose exclusive ``flock`` this call can take (a write under way, in any
    process, holds it). Logs one INFO line when it removed any.

    Returns the paths removed. Never raises (a file that vanished or resists removal is skipped)."""
    if fcntl is None:
        return []
    removed: list[str] = []
    freed = 0
    try:
        entries = [
            e
            for e in os.scandir(str(os.fspath(folder)))
            if _TMP_NAME.match(e.name) and e.is_file(follow_symlinks=False)
        ]
    except OSError:
        return []
    now = time.time()
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if now - st.st_mtime < min_age_s or (fd := open_unlocked(e.path)) is None:
            continue  # young, or being written (locked), or gone
        try:
            os.unlink(e.path)
        except OSError:
            continue
        finally:
            os.close(fd)
        removed.append(e.path)
        freed += st.st_size
    if removed:
        log.info("removed %d partial write(s) of ended processes in %s (%.1f MB)", len(removed), folder, freed / 1e6)
    return removed
