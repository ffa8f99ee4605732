"""Start-up checks of the path flags of ``geomesh-peer``'s commands, before torch's import: each names its flag in
one line, and the command exits 2 for it (README: "2 a bad flag or file"; fresh user 49: a missing
``--checkpoint-dir`` of ``generate`` / ``checkpoints`` exited 1, and ``join --checkpoint-dir /proc/nope`` failed
with 1 after torch's import).

No torch, no transformers here: these run before the slow imports. Nothing is left behind: a folder a check
creates to find out whether it can be created is removed again.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from geomesh_p2p.model.ckpt_files import checkpoint_dir_problem

#: Exit status of a command whose flag or file is bad (as argparse's).
BAD_INPUT = 2


def checkpoint_source_problem(flag: str, directory: str) -> Optional[str]:
    """Why ``directory`` (the value of ``flag``: ``--checkpoint-dir``, or ``checkpoints``' DIR) holds no checkpoint to
    read, one line starting with the flag (``"--checkpoint-dir nosuchdir: no such directory"``), or None."""
    problem = checkpoint_dir_problem(directory)
    return None if problem is None else f"{flag} {problem}"


def writable_dir_problem(flag: str, path: str, *, parents: bool = True) -> Optional[str]:
    """Why a folder cannot be made (if absent) at ``path`` and written into, one line naming ``flag``
    (``"--checkpoint-dir /proc/nope: cannot write there (No such file or directory)"``), or None. ``parents``
    False: only the last folder may be made, a missing parent is refused (a mistyped path silently became a new
    folder chain and an empty checkpoint folder: fresh user 50)."""
    try:
        d = Path(path).expanduser()
    except RuntimeError:  # ~NAME of nobody
        return f"{flag} {path}: no such user's home folder"
    if not parents and not d.exists() and not d.parent.exists():
        return f"{flag} {path}: {_missing_folder(d.parent, 'its parent folder')} (only the last folder is created: check the path)"
    reason = _dir_reason(d)
    return None if reason is None else f"{flag} {path}: {reason}"


def _dir_reason(d: Path) -> Optional[str]:
    """Why folder ``d`` cannot be made (if absent) and written into, in a few words, or None. Found by doing it: the
    missing folders are created, a temporary file written there, and both removed again (a permission check alone
    says yes to root in ``/proc``, where mkdir then fails)."""
    if d.exists() and not d.is_dir():
        return "exists and is not a folder"
    made = [p for p in (d, *d.parents) if not p.exists()]  # deepest first
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
            pass
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
    return None


def _missing_folder(d: Path, what: str = "its folder") -> str:
    """``d`` (absent, or not a folder) in a few words: what is wrong with it or the first ancestor that exists."""
    there = next((a for a in (d, *d.parents) if a.exists()), None)
    if there is not None and not there.is_dir():
        return f"{what} {d} cannot be made: {there} exists and is not a folder"
    return f"{what} {d} does not exist"


def is_default_key(path: str, default: str) -> bool:
    """Whether ``path`` (an ``--identity`` value) names the ``default`` key file, typed or not: a shell expands
    ``--identity ~/.geomesh/identity.key`` before the peer reads it, and that typed default's folder is made as the
    default's is (red team 50b: compared as text, the expanded default was refused on a machine without ``~/.geomesh``,
    exit 2). ``~NAME`` of nobody: not the default."""
    try:
        return path == default or Path(path).expanduser().absolute() == Path(default).expanduser().absolute()
    except RuntimeError:
        return False


def key_file_problem(flag: str, path: str, *, make_folder: bool = True) -> Optional[str]:
    """Why ``path`` (a key file that is loaded, or created with its folders when absent) cannot be used, one line
    naming ``flag``, or None: a folder there, an unreadable file, or a folder it cannot be created in
    (``"--identity /proc/nope/k.key: cannot create its folder /proc/nope (No such file or directory)"``).
    ``make_folder`` False (a path the user typed): an absent key file's folder must exist (fresh user 50: a
    mistyped folder silently became a new identity); the default ``~/.geomesh`` is still made."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:
        return f"{flag} {path}: no such user's home folder"
    if p.is_dir():
        return f"{flag} {path}: is a folder, expected a key file"
    if p.exists():
        return None if os.access(p, os.R_OK) else f"{flag} {path}: cannot be read (permission denied)"
    if not make_folder and not p.parent.exists():
        return (
            f"{flag} {path}: {_missing_folder(p.parent)} (a new key file is created, its folder is not: check the path)"
        )
    reason = _dir_reason(p.parent)
    if reason is None:
        return None
    return f"{flag} {path}: its folder {p.parent} {reason.replace('cannot write there', 'cannot be written')}"


def data_file_problem(flag: str, value: Optional[str]) -> Optional[str]:
    """Why ``value`` of ``--data`` (a file path; an ``hf:`` spec is not a path) is no readable file, or None."""
    if not value or value.startswith("hf:"):
        return None
    p = Path(value).expanduser()
    if not p.exists():
        return f"{flag} {value}: no such file"
    if not p.is_file():
        return f"{flag} {value}: not a file"
    return None


def out_dir_problem(flag: str, path: str) -> Optional[str]:
    """Why ``path`` (export's ``--out``, made if absent) cannot be written, or None. Whether a folder that is there is
    empty or an earlier export is export's own check (it names ``--force``)."""
    return writable_dir_problem(flag, path)
