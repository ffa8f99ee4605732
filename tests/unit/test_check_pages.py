"""A check's reads of the kept weights' file map give their pages back (issue 27, session 41): the map's resident
bytes (``/proc/self/smaps``) after a screen's gain passes, a check's gradient passes and ``abs_max``, with the same
bits as a model loaded by copy; ``drop_file_pages`` never leaves the mapping it is given."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.trust import check_model as CM
from geomesh_p2p.trust import gain as G
from geomesh_p2p.trust import verify_check
from geomesh_p2p.trust.kept_weights import KeptWeights, file_map_range
from geomesh_p2p.util.pages import PAGE_BYTES, drop_file_pages

SEQ = 32
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: one intra-op thread
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"),
]


def _map_rss(lo: int) -> int:
    """Resident bytes of the mapping that starts at address ``lo`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                start = int(head.split("-")[0], 16)
                inside = start == lo
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {lo:#x}")


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return load_dataset(None, seq_len=SEQ, cache_dir=tmp_path_factory.mktemp("gmcache"))


@pytest.fixture
def kept(tmp_path):
    k = KeptWeights(str(tmp_path))
    yield k
    k.close()


def test_dropped_pages_read_back_the_same_bytes_and_leave_the_rss(kept):
    n = 4 << 20  # 16 MiB
    theta = torch.randn(n, generator=torch.Generator().manual_seed(0))
    kept.put(3, theta)
    t = kept.get(3)
    lo, hi = file_map_range(t)
    assert (lo, hi) == (t.data_ptr(), t.data_ptr() + 4 * n) and lo % PAGE_BYTES == 0
    assert file_map_range(t.reshape(-1)) is None and file_map_range(theta) is None  # only the map itself
    assert torch.equal(t, theta)  # every page read
    assert _map_rss(lo) == 4 * n
    assert drop_file_pages(lo + 4 * 1000, 4 * (n // 2), lo, hi)  # widened to whole pages
    # (the page cache may hold the file in large folios, whose mapped pages the kernel counts as a whole: how many
    # of the other half stay counted is the kernel's business, so only "fewer, then none" is asserted)
    assert _map_rss(lo) < 4 * n
    assert torch.equal(t, theta)  # read back from the file: the same bits
    assert drop_file_pages(lo, 4 * n, lo, hi) and _map_rss(lo) == 0
    # nothing outside the mapping it names, nothing empty
    assert not drop_file_pages(lo - PAGE_BYTES, PAGE_BYTES, lo, hi)
    assert not drop_file_pages(hi - 4, 8, lo, hi)
    assert not drop_file_pages(lo, 0, lo, hi)


def test_abs_max_over_the_map_is_aminmaxs_and_leaves_it_unresident(kept):
    theta = torch.randn(9 << 20, generator=torch.Generator().manual_seed(1))  # over two slices
    theta[7 << 20] = -123.5  # the largest |x|, negative, in the last slice
    kept.put(1, theta)
    t = kept.get(1)
    lo, hi = torch.aminmax(theta)
    assert CM.abs_max(t) == max(-float(lo), float(hi)) == 123.5
    assert _map_rss(t.data_ptr()) == 0
    assert CM.abs_max(theta) == 123.5 and CM.abs_max(torch.empty(0)) == 0.0


def test_a_checks_passes_leave_the_map_unresident_with_the_same_bits(ds, kept):
    model = build_model("small", vocab_size=ds.vocab_size, seed=0)  # 49 MB of weights, 6 layers
    theta = flat_params(model).clone()
    n = theta.numel()
    kept.put(1, theta)
    t = kept.get(1)
    lo = t.data_ptr()
    d = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    kw = dict(seed=0, round=1, batch_size=1, seq_len=SEQ)
    streams = ([("p0", 0), ("p0", 1)], [("c", 0), ("c", 1)])
    hollow = CM.hollow_copy(model)
    want = G.gain_stats(copy.deepcopy(model), ds, theta, d, *streams, **kw)
    pieces = [(0, d[: n // 2]), (n // 2, d[n // 2 :])]
    assert G.gain_stats(hollow, ds, t, pieces, *streams, **kw) == want
    # each module's pages go back after its call: what stays mapped is the kernel's fault-around and large folios
    # (a few MiB here), not the 49 MB every pass reads
    assert _map_rss(lo) <= 4 * n // 4, _map_rss(lo)
    index = torch.cat([torch.arange(0, n, 97), torch.tensor([n - 1, 0, 5])])
    ref = verify_check.batch_gradients(copy.deepcopy(model), ds, theta, streams[0], index=index, **kw)
    got = verify_check.batch_gradients(hollow, ds, t, streams[0], index=index, **kw)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert _map_rss(lo) <= 4 * n // 4, _map_rss(lo)
    assert torch.equal(t, theta)  # the map's bytes are the kept weights still
    # a theta that is not a kept map (a private copy, a view) gets no drops: its pages are anonymous memory
    CM.load_for_check(hollow, theta)
    assert getattr(hollow, CM._DROPS) == ()
    CM.load_for_check(hollow, t)
    assert len(getattr(hollow, CM._DROPS)) > 0
    # no parameter views the map any more, and the caller drops it: the hooks keep it mapped, so a drop can only
    # ever hand back the map's own pages (an unmapped range could be anonymous memory by then)
    CM.sub_flat_(hollow, [(0, torch.zeros(n))])
    assert getattr(hollow, CM._DROPS_MAP).data_ptr() == lo
    del t
    x = ds.sample_batch(seed=0, peer_id="p0", round=1, step=0, batch_size=1, seq_len=SEQ)
    with torch.no_grad():
        hollow(input_ids=x)  # every hook fires on the still-mapped range
    CM.release_(hollow)
    assert getattr(hollow, CM._DROPS) == () and getattr(hollow, CM._DROPS_MAP) is None


def test_close_waits_for_a_write_under_way_and_then_removes_everything(tmp_path, monkeypatch):
    """Session 41: a peer's exit failed with "[Errno 39] Directory not empty" when the store was closed while the
    start weights were still being written beside it; close now waits for the write and removes its file too."""
    import os
    import threading

    import geomesh_p2p.trust.kept_weights as KW

    monkeypatch.setattr(KW, "_unnamed_supported", lambda d: False)  # named files: the write's rename is the hold-up
    k = KeptWeights(str(tmp_path))
    inside, go = threading.Event(), threading.Event()
    real = os.replace

    def slow_replace(a, b):
        inside.set()
        assert go.wait(30)
        real(a, b)

    monkeypatch.setattr(KW.os, "replace", slow_replace)
    errors: list[BaseException] = []
    writer = threading.Thread(target=lambda: k.put(7, torch.ones(1000)))
    writer.start()
    assert inside.wait(30)

    def close() -> None:
        try:
            k.close()
        except BaseException as e:  # noqa: BLE001  (the failure this test is about)
            errors.append(e)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # held back by the write under way
    go.set()
    writer.join(30)
    closer.join(30)
    assert not closer.is_alive() and errors == []
    assert not os.path.exists(k.path) and k.closed
    with pytest.raises(RuntimeError, match="closed"):
        k.put(8, torch.ones(10))
