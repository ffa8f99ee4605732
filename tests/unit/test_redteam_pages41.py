"""Red team (session 41) on the kept weights' page drops (``madvise(MADV_DONTNEED)``, which zeroes anonymous memory):
a copy of a loaded check model keeps the drop hooks (the modules' hook dicts travel with ``copy.deepcopy``) and
fired them on the map's old addresses once the map was gone; a copy of a kept tensor carried its map's address
range; and ``abs_max`` skipped a NaN that ``aminmax`` over the whole (the scale bound before it) propagated."""

from __future__ import annotations

import copy
import ctypes
import gc
import math
import pickle
import sys

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.trust import check_model as CM
from geomesh_p2p.trust import verify_check as VC
from geomesh_p2p.trust import verify_task as VT
from geomesh_p2p.trust.kept_weights import KeptWeights, file_map_range
from geomesh_p2p.util.pages import PAGE_BYTES

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("one_thread"),  # conftest: one intra-op thread
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise and mmap"),
]

_PROT_RW, _MAP_PRIVATE_ANON, _MAP_FIXED_NOREPLACE = 0x3, 0x02 | 0x20, 0x100000


@pytest.fixture
def kept(tmp_path):
    k = KeptWeights(str(tmp_path))
    yield k
    k.close()


def _anonymous_at(addr: int, nbytes: int):
    """``(libc, size)`` after mapping ``nbytes`` (whole pages) of anonymous memory exactly at ``addr``; skips when the
    range is taken already or the kernel lacks MAP_FIXED_NOREPLACE (it then maps elsewhere: unmapped again)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
    got = libc.mmap(addr, size, _PROT_RW, _MAP_PRIVATE_ANON | _MAP_FIXED_NOREPLACE, -1, 0)
    if got != addr:
        if got not in (None, ctypes.c_void_p(-1).value):
            libc.munmap(got, size)
        pytest.skip("the map's old addresses could not be mapped again here")
    return libc, size


def test_a_copy_of_a_loaded_check_model_never_zeroes_what_took_the_maps_addresses(kept):
    """``copy.deepcopy`` of a hollow model loaded from a kept map copies its modules' forward hooks (the same
    closures: the original's parameters, their addresses in the map). Once the original lets go of the map
    (``release_``), anonymous memory can take its addresses, and each forward call of the copy zeroed it."""
    model = build_model("tiny", vocab_size=512, seed=0)
    kept.put(1, flat_params(model).clone())
    t = kept.get(1)
    lo, hi = file_map_range(t)
    hollow = CM.hollow_copy(model)
    CM.load_for_check(hollow, t)
    twin = copy.deepcopy(hollow)  # e.g. a second checker made from a loaded one
    assert any(len(m._forward_hooks) for m in twin.modules())  # the hooks came along
    CM.release_(hollow)
    del t
    gc.collect()  # the map is unmapped now
    libc, size = _anonymous_at(lo, hi - lo)
    try:
        mem = torch.frombuffer((ctypes.c_float * ((hi - lo) // 4)).from_address(lo), dtype=torch.float32)
        mem.fill_(7.0)
        x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            twin(input_ids=x)
        zeroed = int((mem != 7.0).sum())
        del mem
    finally:
        libc.munmap(lo, size)
    assert zeroed == 0, f"{zeroed} floats of anonymous memory zeroed by the copy's page drops"


def test_a_copy_of_a_kept_tensor_names_no_file_map(kept):
    """:func:`file_map_range` names the map of the tensor :meth:`KeptWeights.get` returned, "not a view or copy of
    it": but the range lived in the tensor's ``__dict__``, which ``copy.deepcopy``, pickle and ``torch.save`` copy.
    A copy is anonymous memory; made after the map is gone it can lie at the map's addresses, where ``abs_max``
    (or a check's hooks) would zero it. A tensor whose storage was swapped (``set_``) is not the map either."""
    n = 1 << 18
    kept.put(2, torch.randn(n, generator=torch.Generator().manual_seed(0)))
    t = kept.get(2)
    assert file_map_range(t) == (t.data_ptr(), t.data_ptr() + 4 * n)
    assert file_map_range(copy.deepcopy(t)) is None
    assert file_map_range(pickle.loads(pickle.dumps(t))) is None
    u = kept.get(2)
    u.set_(torch.zeros(n))
    assert file_map_range(u) is None
    assert torch.equal(t, kept.get(2))  # the map itself is untouched


def _old_abs_max(theta: torch.Tensor) -> float:
    lo, hi = torch.aminmax(theta)  # the scale bound's max |theta| before session 41
    return max(-float(lo), float(hi))


@pytest.mark.parametrize("at", [0, 5, 11])
def test_abs_max_keeps_aminmaxs_nan(monkeypatch, at):
    """``max(out, -lo, hi)`` with Python's ``max`` skips a NaN (``nan > x`` is False), so a slice holding a NaN
    counted as nothing: the scale bound of a NaN weight was finite where it was NaN before (a NaN bound fails every
    contribution's scale test; a finite one passes some), a verdict that differed from 0.12.1's."""
    monkeypatch.setattr(CM, "_SLICE", 4)  # three slices
    theta = torch.tensor([0.5, -2.0, 1.0, 0.25, 3.0, -0.5, 0.125, 1.5, -1.0, 0.75, 2.5, 0.0])
    assert CM.abs_max(theta) == _old_abs_max(theta) == 3.0
    theta[at] = float("nan")
    assert math.isnan(_old_abs_max(theta))
    assert math.isnan(CM.abs_max(theta))


def test_a_nan_weight_fails_the_scale_test_as_before(kept):
    n = 4096
    theta = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02
    theta[n - 1] = float("nan")
    kept.put(3, theta)
    delta = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 1e-5
    task = VT.VerifyTask(round=3, verifier="v", accused="a", parts=(0,), ranges=((0, n),), steps_done=10, steps=(),
                         controls=4, batch_size=8, seq_len=64, element_seed=1, n_elements=0, full_test=False)  # fmt: skip
    packets = {"a": {0: compression.encode(delta, 2048, 10 * 8 * 64)}}
    cfg = VT.VerifyConfig()
    bound = VC.scale_bound(10, 1e-3, 0.1, _old_abs_max(theta), cfg.scale_factor)
    assert math.isnan(bound)  # before: NaN, so "not max_scale <= bound" held
    for th in (theta, kept.get(3)):
        v = VC.quick_verdict(cfg, task, packets=packets, theta=th, lr=1e-3, weight_decay=0.1)
        assert v is not None and v.outcome == VC.FAIL and v.reason.startswith("scale:"), v


def test_rewriting_a_kept_round_leaves_a_live_map_as_it_was(kept):
    """``put`` of a round kept already (``keep_round`` writes its weights whether or not the round is kept, while a
    background check may hold its map) truncated the mapped file and wrote it again: the map then read the new
    weights (and a read during the write, past the new end, is a SIGBUS). Pre-existing, with the page drops more
    of a check's reads go back to the file."""
    a, b = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    kept.put(4, a)
    t = kept.get(4)
    kept.put(4, b)
    assert torch.equal(t, a)
    assert torch.equal(kept.get(4), b) and kept.files() == ["theta-4.f32"]
