"""Which files of a folder are checkpoints (``ckpt-NNNNNNNN.json`` beside its ``.safetensors``), without torch:
``geomesh-peer checkpoints / export / generate`` check their folder before torch's import (a missing folder was
named after ~27 s of imports on a loaded 2-core machine, session 35). :mod:`~geomesh_p2p.model.state` writes and
reads them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

_CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.json$")

#: The suffix of a checkpoint's weights file (``ckpt-NNNNNNNN.safetensors``).
WEIGHTS_SUFFIX = ".safetensors"


#: The most bytes of one file name (NAME_MAX of Linux's and macOS's file systems).
NAME_MAX_BYTES = 255


class WeightsNameError(ValueError):
    """A checkpoint record names a weights file outside its folder (an absolute path, ``../``, a subfolder) or one
    that is no ``.safetensors`` file; the message says which name and why."""


def weights_path(meta_path: Path, record: Mapping[str, Any]) -> Path:
    """The weights file of the checkpoint whose JSON record ``record`` was read from ``meta_path``: its ``weights``
    field (absent or null: the record's name with :data:`WEIGHTS_SUFFIX`), a file of the record's own folder.

    Raises:
        WeightsNameError: the field is no text, names a path (absolute, ``..``, a folder part, with ``/`` or ``\\``),
            a file without the suffix, or a name no file can have (not in the file system's encoding, over
            :data:`NAME_MAX_BYTES`): a record could otherwise have a resume, ``checkpoints``, ``export`` or
            ``generate`` read (and its size, ``stat``) any file of the machine as the weights.
    """
    name = record.get("weights")
    if name is None:
        name = meta_path.stem + WEIGHTS_SUFFIX
    if not isinstance(name, str):
        raise WeightsNameError(f"its weights file {_shown(name)} is not a file name")
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or Path(name).name != name:
        raise WeightsNameError(
            f"its weights file {_shown(name)} is not in the checkpoint's folder (a file name, without a folder part)"
        )
    if not name.endswith(WEIGHTS_SUFFIX) or name == WEIGHTS_SUFFIX:
        raise WeightsNameError(f"its weights file {_shown(name)} is not a {WEIGHTS_SUFFIX} file")
    try:
        spelt = os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): its stat raised it, a traceback (red team 44)
        raise WeightsNameError(f"its weights file {_shown(name)} is not a file name this system can spell") from None
    if len(spelt) > NAME_MAX_BYTES:  # its stat's ENAMETOOLONG read as "missing"
        raise WeightsNameError(
            f"its weights file {_shown(name)} is longer than a file name may be ({NAME_MAX_BYTES} bytes)"
        )
    return meta_path.parent / name


def _shown(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` (a hand-edited record may hold a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
