"""Red team 54c: the kept weights' unnamed files (commits 1ef8be3d, ff81b03d: ``O_TMPFILE``, mapped through
``/proc/self/fd/N``). Each test runs on both kinds of store: ``named`` forces the files with a name (as where
``O_TMPFILE`` is missing), the other is the system's default (unnamed on Linux)."""

from __future__ import annotations

import errno
import sys
import threading

import pytest
import torch

from geomesh_p2p.trust import kept_weights
from geomesh_p2p.trust.kept_weights import KeptWeights

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_TMPFILE and /proc/self/fd are Linux's"),
]


def _store(tmp_path, monkeypatch, named: bool) -> KeptWeights:
    if named:
        monkeypatch.setattr(kept_weights, "_unnamed_supported", lambda d: False)
    k = KeptWeights(str(tmp_path))
    assert k.unnamed is (not named)
    return k


class _DiskFull:
    """``theta.numpy()`` whose ``tofile`` writes half, then fails as a full disk does."""

    def __init__(self, arr) -> None:
        self.arr = arr

    def tofile(self, path) -> None:
        self.arr[: self.arr.size // 2].tofile(path)
        raise OSError(errno.ENOSPC, "No space left on device")


def _fails_disk_full(monkeypatch, k: KeptWeights, r: int, theta: torch.Tensor) -> None:
    real = torch.Tensor.numpy
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "numpy", lambda self, *a, **kw: _DiskFull(real(self, *a, **kw)))
        with pytest.raises(OSError):
            k.put(r, theta)


@pytest.mark.parametrize(
    "named",
    [
        pytest.param(True, id="named"),
        pytest.param(False, id="unnamed"),
    ],
)
def test_a_failed_rewrite_keeps_no_file_of_the_round(tmp_path, monkeypatch, named):
    k = _store(tmp_path, monkeypatch, named)
    try:
        old, new = torch.full((1 << 16,), 1.0), torch.full((1 << 16,), 2.0)
        k.put(5, old)  # e.g. verified work's early write of round 5's start weights
        _fails_disk_full(monkeypatch, k, 5, new)  # keep_round writes them again (a re-sync changed them): disk full
        assert k.nbytes() == 0, f"{k.nbytes()} bytes of round 5's replaced weights still kept ({k.files()})"
    finally:
        k.close()


class _PutBetween:
    """The store's write lock, which the first time it is taken runs ``put(round, theta)`` in another thread
    before (that put lands between :meth:`KeptWeights.get`'s read of the round's size and its map)."""

    def __init__(self, k: KeptWeights, round: int, theta: torch.Tensor) -> None:
        self.k, self.lock, self.job = k, k._writing, (round, theta)

    def __enter__(self):
        if self.job is not None:
            job, self.job = self.job, None
            th = threading.Thread(target=self.k.put, args=job)
            th.start()
            th.join()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_get_while_put_replaces_the_round_with_another_size(tmp_path, monkeypatch, named):
    k = _store(tmp_path, monkeypatch, named)
    try:
        k.put(7, torch.ones(1 << 16))
        k._writing = _PutBetween(k, 7, torch.full((100,), 2.0))  # type: ignore[assignment]
        t = k.get(7)
        k._writing = k._writing.lock  # type: ignore[attr-defined]
        assert t is None or torch.equal(t, torch.ones(1 << 16)) or torch.equal(t, torch.full((100,), 2.0))
    finally:
        k.close()
