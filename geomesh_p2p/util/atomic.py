"""One atomic file write for the whole project (checkpoints, bootstrap state, token caches, tokenizers)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], mode: int = 0o644) -> None:
    """Write ``path`` so that a reader sees the old file or the new one, never a part: ``write(tmp)`` fills
    a temporary file in the same directory (created with ``mode``), which is fsynced and renamed over
    ``path`` (``os.replace``). The parent directory is created if missing. Blocking file I/O: call it in
    a worker thread from async code.

    Raises:
        OSError: the directory cannot be written, the disk is full, ...; the temporary file is removed
            and the previous ``path`` stays as it was. Whatever ``write`` raises, likewise.
    """
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
