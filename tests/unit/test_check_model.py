"""Verified work's hollow model (geomesh_p2p/trust/check_model.py, issue 27): no weights held between checks,
the round's weights bound as views (never written), the contribution subtracted bitwise as ``theta - d`` without a
``[P]`` of it, and the same gradients, gains and verdicts as a whole deep copy."""

from __future__ import annotations

import copy

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.trust import check_model as CM
from geomesh_p2p.trust import gain as G
from geomesh_p2p.trust import verify_check

SEQ = 32
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return load_dataset(None, seq_len=SEQ, cache_dir=tmp_path_factory.mktemp("gmcache"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32).clone()


def test_a_hollow_copy_holds_no_weights_and_binds_views(ds):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    hollow = CM.hollow_copy(model)
    assert CM.is_hollow(hollow) and not CM.is_hollow(model)
    assert sum(p.numel() for p in hollow.parameters()) == 0
    assert [n for n, _ in hollow.named_parameters()] == [n for n, _ in model.named_parameters()]  # tied stay tied
    assert sum(p.numel() for p in model.parameters()) == theta.numel()  # the original is untouched
    CM.load_for_check(hollow, theta)
    lo, hi = theta.data_ptr(), theta.data_ptr() + 4 * theta.numel()
    assert all(lo <= p.data_ptr() < hi for p in hollow.parameters())  # views of theta, no copy
    assert torch.equal(flat_params(hollow), theta)
    CM.release_(hollow)
    assert sum(p.numel() for p in hollow.parameters()) == 0
    with pytest.raises(ValueError, match="elements"):
        CM.load_for_check(hollow, theta[:-1])
    with pytest.raises(ValueError, match="fp32 CPU"):
        CM.hollow_copy(model.to(torch.float64))


def test_sub_flat_is_bitwise_theta_minus_d_and_never_writes_theta(ds):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    g = torch.Generator().manual_seed(1)
    n = theta.numel()
    cuts = [(0, 1000), (n // 3, n // 3 + 5000), (n - 777, n)]  # pieces across parameter boundaries
    d = torch.zeros(n)
    for s, e in cuts:
        d[s:e] = torch.randn(e - s, generator=g) * 1e-3
    want = theta - d
    kept = _bits(theta)
    for m in (CM.hollow_copy(model), copy.deepcopy(model)):
        CM.load_for_check(m, theta)
        CM.sub_flat_(m, ((s, d[s:e]) for s, e in cuts))
        assert torch.equal(_bits(flat_params(m)), _bits(want))
        assert torch.equal(_bits(theta), kept)  # theta itself is never written
    hollow = CM.hollow_copy(model)
    CM.load_for_check(hollow, theta)
    CM.sub_flat_(hollow, [(0, d[:10])])  # only the parameter the piece touches is copied
    lo, hi = theta.data_ptr(), theta.data_ptr() + 4 * n
    inside = [lo <= p.data_ptr() < hi for _, p in hollow.named_parameters()]
    assert inside[0] is False and all(inside[1:])
    with pytest.raises(ValueError, match="outside"):
        CM.sub_flat_(hollow, [(n - 1, d[:2])])


def test_gains_and_gradients_of_a_hollow_model_equal_a_whole_copys(ds):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    n = theta.numel()
    d = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    kw = dict(seed=0, round=1, batch_size=4, seq_len=SEQ)
    streams = ([("p0", 0), ("p0", 1)], [("c", 0), ("c", 1)])
    whole = G.gain_stats(copy.deepcopy(model), ds, theta, d, *streams, **kw)
    hollow = CM.hollow_copy(model)
    pieces = [(0, d[: n // 2]), (n // 2, d[n // 2 :])]
    assert G.gain_stats(hollow, ds, theta, pieces, *streams, **kw) == whole
    assert G.gain_stats(hollow, ds, theta, d, *streams, **kw) == whole
    # the old way: the whole copy loaded with theta - d
    ref = copy.deepcopy(model)
    load_flat_(ref, theta - d)
    assert torch.equal(_bits(flat_params(ref)), _bits(theta - d))
    index = torch.cat([torch.arange(0, n, 97), torch.tensor([n - 1, 0, 5])])  # any order, repeats
    want = verify_check.batch_gradients(copy.deepcopy(model), ds, theta, streams[0], index=index, **kw)
    got = verify_check.batch_gradients(hollow, ds, theta, streams[0], index=index, **kw)
    assert torch.equal(_bits(got), _bits(want))
    # the flat gradient gathered as before: torch.cat of every parameter's gradient, then indexed
    ref = copy.deepcopy(model)
    load_flat_(ref, theta)
    ref.train()
    ref.zero_grad(set_to_none=True)
    x = ds.sample_batch(seed=0, peer_id="p0", round=1, step=0, batch_size=4, seq_len=SEQ)
    ref(input_ids=x, labels=x).loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for _, p in ref.named_parameters()])
    assert torch.equal(_bits(got[0]), _bits(flat[index]))
    with pytest.raises(ValueError, match="outside"):
        verify_check.batch_gradients(hollow, ds, theta, streams[0], index=torch.tensor([n]), **kw)


def test_sample_elements_draws_the_same_elements_as_the_int64_permutation():
    """The int32 permutation (half the memory at real size) picks the elements the int64 one picked: the same
    checks on peers of either version (the selection is part of the evidence others re-check)."""
    from geomesh_p2p.trust.verify_task import sample_elements

    ranges = [(0, 3000), (5000, 90_001), (100_000, 100_017)]
    total = 3000 + 85_001 + 17
    for seed in (0, 7, 123):
        g = torch.Generator().manual_seed(seed)
        pos = torch.randperm(total, generator=g)[:1000].sort().values
        starts, offsets = torch.tensor([0, 5000, 100_000]), torch.tensor([0, 3000, 88_001])
        which = torch.searchsorted(offsets, pos, right=True) - 1
        assert torch.equal(sample_elements(ranges, 1000, seed), starts[which] + (pos - offsets[which]))


def test_the_permutations_prefix_is_torchs_without_the_permutation(monkeypatch):
    """Session 41: ``sample_elements`` draws its elements without ``torch.randperm``'s ``[total]`` (356 MB at 89M
    elements, the rest of a check's peak): the same first values for any seed torch takes (its MT19937 keeps the low
    32 bits), and ``randperm`` is not called below 2^31 elements."""
    from geomesh_p2p.trust import verify_task as VT

    for total, n, seed in [(1000, 999, 0), (5_000_000, 4096, 2**40 + 5), (20_000_000, 512, 2**63 - 1), (17, 16, 3)]:
        want = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n].tolist()
        assert VT._randperm_prefix(total, n, seed).tolist() == want, (total, n, seed)
    ranges = [(0, 3000), (5000, 90_001)]
    want = VT.sample_elements(ranges, 1000, 11)

    def no_randperm(*a, **k):
        raise AssertionError("randperm called")

    monkeypatch.setattr(VT.torch, "randperm", no_randperm)
    assert torch.equal(VT.sample_elements(ranges, 1000, 11), want) and want.dtype == torch.int64


@pytest.mark.timeout(120)
def test_a_check_holds_one_parameters_gradient_at_a_time_with_the_same_bits(ds, monkeypatch):
    """Issue 27 (session 39): each parameter's gradient is read at its sampled elements and dropped as soon as it is
    accumulated (the check runs beside the inner steps and their [P] of gradients); summed over micro-batches in
    the gradient's dtype, the rows keep the bits of the whole accumulated gradient indexed."""
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model)
    n = theta.numel()
    index = torch.cat([torch.arange(3, n, 89), torch.tensor([n - 1, 0])])
    kw = dict(seed=0, round=2, batch_size=4, seq_len=SEQ, micro_batch=2)
    held: list[int] = []
    accumulate = verify_check._accumulate

    def counted(m, x, mb, device, use_amp):
        accumulate(m, x, mb, device, use_amp)
        held.append(sum(p.grad is not None for p in m.parameters()))

    monkeypatch.setattr(verify_check, "_accumulate", counted)
    got = verify_check.batch_gradients(CM.hollow_copy(model), ds, theta, [("p0", 0), ("p0", 1)], index=index, **kw)
    assert held == [0, 0]  # no gradient left once a batch's backward passes are over
    for i, step in enumerate([0, 1]):  # the old way: the whole gradient accumulated over the micro-batches
        ref = copy.deepcopy(model)
        load_flat_(ref, theta)
        ref.train()
        x = ds.sample_batch(seed=0, peer_id="p0", round=2, step=step, batch_size=4, seq_len=SEQ)
        accumulate(ref, x, 2, torch.device("cpu"), False)
        flat = torch.cat([p.grad.reshape(-1) for _, p in ref.named_parameters()])
        assert torch.equal(_bits(got[i]), _bits(flat[index]))


def _old_sample_positions(total: int, n: int, seed: int) -> torch.Tensor:
    """Session 41's positions (a list, ``sorted``, ``torch.tensor``): what session 47 changed holds the same bits."""
    import numpy as np

    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 2**32, size=n, dtype=np.uint64).tolist()
    moved: dict[int, int] = {}
    out = []
    for i, d in enumerate(draws):
        j = i + d % (total - i)
        vi, vj = moved.get(i, i), moved.get(j, j)
        moved[j] = vi
        out.append(vj)
    return torch.tensor(sorted(out), dtype=torch.int64)


@pytest.mark.timeout(120)
def test_sample_elements_at_gpt2_size_draws_what_the_list_version_drew():
    """Session 47: the draw without a GIL-holding ``sorted``/``torch.tensor`` over 2^18 values picks the same elements
    (same bits, same dtype) as before, at gpt2-124m's size, and across several draw chunks."""
    from geomesh_p2p.trust import verify_task as VT

    total, n = 124_439_808, 1 << 18
    ranges = [(0, 50_000_000), (60_000_000, 134_439_808)]
    for seed in (0, 2**40 + 5, 2**63 - 1):
        pos = _old_sample_positions(total, n, seed)
        starts, offsets = torch.tensor([0, 60_000_000]), torch.tensor([0, 50_000_000])
        which = torch.searchsorted(offsets, pos, right=True) - 1
        got = VT.sample_elements(ranges, n, seed)
        assert got.dtype == torch.int64 and torch.equal(got, starts[which] + (pos - offsets[which])), seed
    assert VT._randperm_prefix(100, 0, 1).shape == (0,)
    for n in (1, VT._DRAW_CHUNK - 1, VT._DRAW_CHUNK, VT._DRAW_CHUNK + 1):
        assert torch.equal(VT._randperm_prefix(10**6, n, 9).sort().values, _old_sample_positions(10**6, n, 9)), n
