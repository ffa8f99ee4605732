"""Verified work's kept start weights, off the heap (issue 27, "memory at the minimum").

A verifier keeps the start weights of its last ``keep_rounds`` rounds to check and re-check contributions
against them (:class:`~geomesh_p2p.trust.verify.WorkVerifier`). Held as clones they cost ``4P`` bytes of
RSS each (three rounds: 1.07 GB at ``gpt2-124m``) for data read only when a check or re-check runs. Here
each round's weights are written once to a raw fp32 file in a private temporary directory and read back
through a copy-on-write memory map (:func:`torch.from_file`, ``shared=False``): pages are faulted in only
while a check reads them and leave the process when the returned tensor is dropped.

The directory is made by :class:`tempfile.TemporaryDirectory` under ``dir`` (default: the system's, i.e.
``$TMPDIR`` or ``/tmp``); it is removed by :meth:`KeptWeights.close`, and, if nobody calls that, when the
store is garbage-collected or the interpreter exits (the class's finalizer). On a tmpfs ``/tmp`` the files
still take RAM (shared memory, outside the process's RSS): point ``TMPDIR`` at a disk there.

A process that dies without either (SIGKILL, the kernel's OOM killer, a power cut) left its files behind: up to
``keep_rounds`` x 4P bytes (1.4 GB at ``gpt2-124m``; on a tmpfs ``/tmp``, RAM until a reboot, after an OOM kill of all
things), again at every crash of a restarted peer (132 such folders, up to 340 MB each, had piled up in this machine's
``/tmp`` from killed test peers). So, where the system has them (Linux: ``O_TMPFILE`` and ``/proc/self/fd``), the
files have **no name** (:attr:`KeptWeights.unnamed`): each is an open descriptor of this process, mapped through
``/proc/self/fd/N``, and the kernel frees it when the process ends, however it ends (fresh user 54: 34 MB of killed
peers' folders in ``/tmp``). Elsewhere the files are named, and each store holds an exclusive ``flock`` on a lock file
in its directory while it is open (the kernel releases it when the process dies, however it dies, and across PID
namespaces), and a new store removes the sibling directories whose lock it can take (:func:`sweep_orphans`); both
kinds of store hold the lock, so a killed unnamed store's empty directory is swept the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from geomesh_p2p.util.atomic import open_unlocked, try_lock

__all__ = ["KeptWeights", "FILE_MAP_ATTR", "file_map_range", "sweep_orphans", "PREFIX", "LOCK_NAME"]

log = logging.getLogger(__name__)

#: the name prefix of a store's private directory
PREFIX = "geomesh-verify-"
#: the file in a store's directory its process holds an exclusive ``flock`` on while the store is open
LOCK_NAME = ".owner.lock"

#: the parent folders this process's stores have swept (:func:`sweep_orphans`)
_SWEPT: set[str] = set()

#: attribute of a tensor :meth:`KeptWeights.get` returned: ``(lo, hi)``, the bytes of its private file mapping
FILE_MAP_ATTR = "_geomesh_file_map"

#: the tensors :meth:`KeptWeights.get` returned and that live, by ``id``: a tensor's ``__dict__`` (and so
#: :data:`FILE_MAP_ATTR`) travels with ``copy.deepcopy`` and pickle, the map does not (red team 41)
_MAPS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def file_map_range(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(lo, hi)`` byte addresses of ``t``'s copy-on-write file mapping when ``t`` is a tensor
    :meth:`KeptWeights.get` returned (not a view or copy of it) and still holds that mapping, else None."""
    r = getattr(t, FILE_MAP_ATTR, None)
    if not (isinstance(r, tuple) and len(r) == 2) or _MAPS.get(id(t)) is not t:
        # a copy (deepcopy, pickle, torch.save) carries the attribute, not the map: its memory is anonymous, and
        # after the map is gone it may even lie at the map's addresses, where a page drop would zero it
        return None
    s = t.untyped_storage()
    if t.data_ptr() != r[0] or s.data_ptr() != r[0] or s.nbytes() != r[1] - r[0]:
        return None  # another storage since (set_, .data =): not the map any more
    return r


class KeptWeights:
    """Start weights by round, one raw fp32 file each (native byte order), under a private temp directory.

    Blocking (file writes and reads): call it off the event loop. Thread-safe.

    Args:
        dir: the folder to make the private directory in (None: the system's temp folder).

    Raises:
        OSError: the directory cannot be made.
    """

    def __init__(self, dir: Optional[str] = None):
        self._tmp: Optional[tempfile.TemporaryDirectory] = tempfile.TemporaryDirectory(prefix=PREFIX, dir=dir)
        self.path = self._tmp.name
        fd = _hold_lock(self.path)
        # the lock's descriptor is closed by close(), or when the store is collected (as the directory is)
        self._unlock = weakref.finalize(self, os.close, fd) if fd is not None else None
        parent = os.path.dirname(self.path)
        if parent not in _SWEPT:  # once a folder per process: a process makes ~5 stores (undo log, spill, verifier)
            _SWEPT.add(parent)
            sweep_orphans(parent)
        self._numel: dict[int, int] = {}
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # held through a file's write and close's removal (:meth:`_write`)
        #: the unnamed files' descriptors by file name (``theta-R.f32``, ``blob-R.bin``); None: named files
        self._fds: Optional[dict[str, int]] = {} if _unnamed_supported(self.path) else None
        if self._fds is not None:  # a store collected without close(): its descriptors with it (as its directory)
            weakref.finalize(self, _close_all, self._fds)

    def _file(self, round: int) -> str:
        return os.path.join(self.path, f"theta-{int(round)}.f32")

    def put(self, round: int, theta: torch.Tensor) -> int:
        """Write ``theta`` (any shape, fp32 CPU; read as its flat contiguous copy) as round ``round``'s
        weights, replacing any kept before. Returns the bytes written (``4 x numel``).

        Raises:
            ValueError: ``theta`` is not fp32 on the CPU.
            RuntimeError: the store is closed.
            OSError: the write failed (disk full: the round is not kept).
        """
        if theta.dtype != torch.float32 or theta.device.type != "cpu":
            raise ValueError(f"kept weights must be fp32 on the CPU, got {theta.dtype} on {theta.device}")
        path = self._file(round)
        flat = theta.detach().reshape(-1)  # a view when contiguous: written without a copy

        def kept() -> None:  # under the write lock with the file: get() never maps a file of another size
            with self._lock:
                self._numel[int(round)] = int(flat.numel())

        def failed() -> None:  # the round is not kept (a failed rewrite left no file of it either)
            with self._lock:
                self._numel.pop(int(round), None)

        self._write(path, flat.numpy().tofile, kept, failed)
        return 4 * int(flat.numel())

    def get(self, round: int) -> Optional[torch.Tensor]:
        """Round ``round``'s weights: fp32 CPU ``[numel]`` mapped from its file copy-on-write (writes to
        it never reach the file), bitwise what :meth:`put` was given; None when not kept. The pages are
        read on first touch and leave the process's memory when the tensor is dropped. Never write it: a check
        hands its pages back to the page cache between uses (:func:`file_map_range`), which would lose a write."""
        with self._writing:  # a file is replaced (its size with it) or its descriptor closed only under this lock
            with self._lock:
                n = self._numel.get(int(round))
            if n is None:
                return None
            if n == 0:
                return torch.empty(0, dtype=torch.float32)
            path = self._readable(self._file(round))
            if path is None:
                return None
            t = torch.from_file(path, shared=False, size=n, dtype=torch.float32)
        # marks the map for load_for_check, which hands a check's pages back between its uses (issue 27)
        setattr(t, FILE_MAP_ATTR, (t.data_ptr(), t.data_ptr() + 4 * n))
        _MAPS[id(t)] = t
        return t

    def _blob_file(self, round: int) -> str:
        return os.path.join(self.path, f"blob-{int(round)}.bin")

    def put_blob(self, round: int, data: bytes) -> int:
        """Write ``data`` beside round ``round``'s weights (replacing any before; verified work keeps a round's
        contributions there once they leave memory). Returns the bytes written; deleted with the round
        (:meth:`drop`). Raises RuntimeError when closed, OSError when the write fails (nothing is kept then)."""

        def write(part: str) -> None:
            with open(part, "wb") as f:
                f.write(data)

        self._write(self._blob_file(round), write)
        return len(data)

    @property
    def unnamed(self) -> bool:
        """Whether this store's files have no name (freed by the kernel when the process ends; module docstring)."""
        return self._fds is not None

    def _readable(self, path: str) -> Optional[str]:
        """A path that opens the file :meth:`_write` put at ``path``: ``path`` itself, or for an unnamed file its
        ``/proc/self/fd/N`` (None when there is none). Call it holding ``_writing``."""
        if self._fds is None:
            return path
        fd = self._fds.get(os.path.basename(path))
        return None if fd is None else f"/proc/self/fd/{fd}"

    def _write(
        self,
        path: str,
        write: Callable[[str], Any],
        done: Optional[Callable[[], None]] = None,
        failed: Optional[Callable[[], None]] = None,
    ) -> None:
        """``write(part)`` a new file, then put it in ``path``'s place, under the store's write lock; ``done()`` or
        (the write failed: no file of ``path`` is left, old or new) ``failed()`` under it too.

        A new file, not the old one truncated and written again: a tensor :meth:`get` returned maps the old one,
        whose pages a truncation takes away (a read past the new end is a SIGBUS, later ones read the new weights
        under a check of the old; red team 41). The lock keeps :meth:`close` from removing the directory while a
        write is under way (its removal then failed with "Directory not empty", and the peer's exit with it:
        session 41). Raises RuntimeError when closed, OSError when the write fails (nothing is kept then)."""
        with self._writing:
            if self._tmp is None:
                raise RuntimeError("the kept weights' store is closed")
            if self._fds is not None:
                name, fd = os.path.basename(path), None
                try:
                    fd = os.open(self.path, os.O_TMPFILE | os.O_RDWR, 0o600)
                    write(f"/proc/self/fd/{fd}")
                except BaseException:
                    if fd is not None:
                        os.close(fd)
                    self._close_fd(name)  # as the named store's: the replaced file goes too (red team 54c)
                    if failed is not None:
                        failed()
                    raise
                self._close_fd(name)  # a tensor mapping it keeps the file (the map holds the inode), as a rename did
                self._fds[name] = fd
                if done is not None:
                    done()
                return
            part = path + ".part"
            try:
                write(part)
                os.replace(part, path)
            except BaseException:
                _unlink(part)
                _unlink(path)
                if failed is not None:
                    failed()
                raise
            if done is not None:
                done()

    def get_blob(self, round: int) -> Optional[bytes]:
        """The bytes of :meth:`put_blob` for ``round``, or None (none written, or dropped)."""
        with self._writing:
            path = self._readable(self._blob_file(round))
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except (FileNotFoundError, TypeError):
                return None

    def drop(self, round: int) -> None:
        """Forget round ``round`` and delete its files (a tensor :meth:`get` returned stays readable until
        dropped: the mapping outlives the name)."""
        with self._lock:
            had = self._numel.pop(int(round), None)
        if had is not None:
            self._remove(self._file(round))
        self._remove(self._blob_file(round))

    def _remove(self, path: str) -> None:
        """Delete the file :meth:`_write` put at ``path`` (close an unnamed one's descriptor); nothing when none."""
        if self._fds is not None:
            with self._writing:
                self._close_fd(os.path.basename(path))
            return
        _unlink(path)

    def _close_fd(self, name: str) -> None:
        """Forget and close the unnamed file ``name``'s descriptor, if any (its file goes when nothing maps it). Call it
        holding ``_writing``: a descriptor number is reused only once closed."""
        fd = self._fds.pop(name, None) if self._fds is not None else None
        if fd is not None:
            os.close(fd)

    def rounds(self) -> list[int]:
        """The rounds kept, ascending."""
        with self._lock:
            return sorted(self._numel)

    def files(self) -> list[str]:
        """The names of the rounds' files (for tests and diagnostics): in the store's directory, the lock file left
        out, or an unnamed store's (the names it keeps them by)."""
        if self._fds is not None:
            with self._writing:
                return sorted(self._fds)
        return sorted(n for n in os.listdir(self.path) if n != LOCK_NAME) if os.path.isdir(self.path) else []

    def nbytes(self) -> int:
        """Bytes the store's files hold now (for tests and diagnostics)."""
        with self._writing:
            if self._fds is not None:
                return sum(os.fstat(fd).st_size for fd in self._fds.values())
        return sum(os.path.getsize(os.path.join(self.path, n)) for n in self.files())

    @property
    def closed(self) -> bool:
        return self._tmp is None

    def close(self) -> None:
        """Delete every file and the directory. Safe to call twice."""
        with self._writing:  # after a write under way (:meth:`_write`)
            tmp, self._tmp = self._tmp, None
            if self._fds is not None:
                _close_all(self._fds)
        with self._lock:
            self._numel.clear()
        if tmp is not None:
            tmp.cleanup()
        if self._unlock is not None:
            self._unlock()  # after the removal (once): a sweeper never takes the lock of a directory being emptied


def _close_all(fds: dict[str, int]) -> None:
    """Close an unnamed store's descriptors (its files go with them) and forget them."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unnamed_supported(directory: str) -> bool:
    """Whether files without a name can be made in ``directory`` and opened again by this process through
    ``/proc/self/fd`` (Linux's ``O_TMPFILE`` on a file system that has it, and procfs mounted)."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return False
    try:
        fd = os.open(directory, flag | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, b"x")
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            return f.read() == b"x"
    except OSError:
        return False
    finally:
        os.close(fd)


def _hold_lock(path: str) -> Optional[int]:
    """Make ``path``/:data:`LOCK_NAME` already locked (exclusive ``flock``): locked under a temporary name, then
    renamed (the lock is the inode's), so a sweeper never finds the name unlocked. Returns the descriptor to keep
    open while the store lives; None where ``flock`` is missing or fails (the store works, nobody can sweep it)."""
    part = os.path.join(path, LOCK_NAME + ".part")
    try:
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        if not try_lock(fd):
            raise OSError("no flock here")
        os.replace(part, os.path.join(path, LOCK_NAME))
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_orphans(parent: str) -> list[str]:
    """Remove the store directories under ``parent`` (``geomesh-verify-*``) whose owner died without closing them:
    those with a :data:`LOCK_NAME` whose exclusive ``flock`` this call can take (a live store holds its own until
    :meth:`KeptWeights.close`). Directories without a lock file (made before 0.12.4, or by a store on a system without
    ``flock``) and those this user cannot open are left alone. Logs one INFO line when it removed any.

    Returns the paths removed. Never raises (a directory that vanished or resists removal is skipped)."""
    removed, freed = [], 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        d = os.path.join(parent, name)
        fd = open_unlocked(os.path.join(d, LOCK_NAME))
        if fd is None:
            continue  # its owner lives, or no lock file (an older store, or not ours to open)
        try:
            size = sum(e.stat().st_size for e in os.scandir(d) if e.is_file(follow_symlinks=False))
            shutil.rmtree(d)
        except OSError:
            continue
        finally:
            os.close(fd)
        removed.append(d)
        freed += size
    if removed:
        log.info(
            "removed %d kept-weights folder(s) of ended processes under %s (%.1f MB)", len(removed), parent, freed / 1e6
        )
    return removed
