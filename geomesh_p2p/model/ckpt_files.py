"""Which files of a folder are checkpoints (``ckpt-NNNNNNNN.json`` beside its ``.safetensors``), without torch:
``geomesh-peer checkpoints / export / generate`` check their folder before torch's import (a missing folder was
named after ~27 s of imports on a loaded 2-core machine, session 35). :mod:`~geomesh_p2p.model.state` writes and
reads them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

_CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.json$")


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``[(round, metadata_path)]`` of the committed checkpoints in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _CKPT_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def checkpoint_dir_problem(directory: str | os.PathLike) -> Optional[str]:
    """Why ``directory`` (``~`` expanded) holds no checkpoint to read, in one line naming it (``"D: no such
    directory"``, ``"D: not a directory"``, ``"D: no checkpoint (ckpt-NNNNNNNN.json) in this directory"``, ``"D: cannot
    be read (Permission denied)"``), or None when it holds one."""
    try:
        d = Path(directory).expanduser()
    except RuntimeError:  # "~name/..." where no user is called name (red team 42: a traceback)
        return f"{directory}: no such directory"
    try:
        if not d.exists():
            return f"{d}: no such directory"
        if not d.is_dir():
            return f"{d}: not a directory"
        if not list_checkpoints(d):
            return f"{d}: no checkpoint (ckpt-NNNNNNNN.json) in this directory"
    except OSError as e:  # a folder, or one above it, this user may not read (red team 42: a traceback)
        return f"{d}: cannot be read ({e.strerror or e})"
    return None
