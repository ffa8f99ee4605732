"""The loss-gain test's second pass one module at a time (geomesh_p2p/trust/check_model.py ``subtracted``, issue 27,
session 24): the same row losses, bit for bit, as the whole private copy of ``theta - d`` it replaces (GPT-2 and
LLaMA presets, both with tied input/output embeddings), and at most the largest module's parameters of extra memory
(CPU allocations counted by torch's profiler) where the whole copy took ``4P`` bytes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from geomesh_p2p.data import load_dataset
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.trust import check_model as CM
from geomesh_p2p.trust import gain as G

SEQ = 32
KW = dict(seed=0, round=1, batch_size=2, seq_len=SEQ)
STREAMS = [("p0", 0), ("p0", 1), ("c", 0), ("c", 1)]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return load_dataset(None, seq_len=SEQ, cache_dir=tmp_path_factory.mktemp("gmcache"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32).clone()


def _packets(n: int, parts: int, block: int = 2048, seed: int = 3) -> list[tuple[int, compression.SignPacket]]:
    """A sign-coded contribution in ``parts`` pieces of whole blocks (as the collective's parts are), whose edges
    fall inside parameters: ``(start, packet)``."""
    g = torch.Generator().manual_seed(seed)
    size = -(-n // parts // block) * block
    return [
        (s, compression.encode(torch.randn(min(n, s + size) - s, generator=g) * 1e-2, block, 10))
        for s in range(0, n, size)
    ]


def _old_rows(model, ds, theta, pieces) -> list[list[float]]:
    """The second pass as it was: every moved parameter a private copy of ``theta - d`` (sub_flat_)."""
    hollow = CM.hollow_copy(model)
    CM.load_for_check(hollow, theta)
    CM.sub_flat_(hollow, ((s, compression.decode(p)) for s, p in pieces))
    return G.row_losses(hollow, ds, STREAMS, **KW)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_per_module_losses_equal_the_whole_copys_bit_for_bit(ds, preset):
    model = build_model(preset, vocab_size=ds.vocab_size, seed=0)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is emb.weight  # the tied preset: one parameter, two modules
    theta = flat_params(model).clone()
    n = theta.numel()
    pieces = _packets(n, 3)
    d = torch.cat([compression.decode(p) for _, p in pieces])
    want = _old_rows(model, ds, theta, pieces)
    kept = _bits(theta)
    hollow = CM.hollow_copy(model)
    CM.load_for_check(hollow, theta)
    seen: dict[str, torch.Tensor] = {}
    lo = sum(p.numel() for p in list(hollow.parameters())[: _index_of(hollow, hollow.get_input_embeddings().weight)])
    n_emb = emb.weight.numel()
    with CM.subtracted(hollow, pieces):
        # registered after subtracted's hooks, so these see the weights the module computes with
        for name, m in (("emb", hollow.get_input_embeddings()), ("head", hollow.get_output_embeddings())):
            m.register_forward_pre_hook(lambda mod, _a, name=name: _keep(seen, name, mod.weight))
        assert hollow.get_input_embeddings().weight.numel() == 0  # held by no module outside its calls
        got = G.row_losses(hollow, ds, STREAMS, **KW)
    assert got == want  # Python floats from the fp32 losses: equal means bitwise equal
    want_emb = _bits(theta[lo : lo + n_emb] - d[lo : lo + n_emb])
    assert torch.equal(seen["emb"], want_emb) and torch.equal(seen["head"], want_emb)  # both uses of the tied one
    assert torch.equal(_bits(theta), kept)  # theta is never written
    # after the block every parameter is a view of theta again
    a, b = theta.data_ptr(), theta.data_ptr() + 4 * n
    assert all(a <= p.data_ptr() < b for p in hollow.parameters())
    assert torch.equal(_bits(flat_params(hollow)), kept)
    # and the shipped gain test on the hollow model (packets) equals a whole deep copy's (decoded d, in place)
    streams = (STREAMS[:2], STREAMS[2:])
    assert G.gain_stats(hollow, ds, theta, pieces, *streams, **KW) == G.gain_stats(
        copy.deepcopy(model), ds, theta, d, *streams, **KW
    )


def _keep(seen: dict, name: str, w: torch.Tensor) -> None:
    seen.setdefault(name, _bits(w))  # None: a pre-hook's return value would replace the module's input


def _index_of(model, param) -> int:
    return next(i for i, p in enumerate(model.parameters()) if p is param)


def test_decode_span_is_bitwise_the_whole_decodes_slice():
    g = torch.Generator().manual_seed(5)
    for n, block in ((10_007, 2048), (5_003, 100), (4_000, 3), (37, 8)):
        p = compression.encode(torch.randn(n, generator=g), block, 0)
        whole = compression.decode(p)
        L = math.lcm(8, block)
        cuts = [(0, n), (1, n - 1), (0, 1), (n - 1, n), (L - 1, L + 1), (3, min(n, 2 * L + 5)), (n // 2, n // 2)]
        cuts += [tuple(sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())) for _ in range(20)]
        for a, b in cuts:
            if b > n:
                continue
            got = CM.decode_span(p, a, b, torch.empty(b - a))
            assert torch.equal(_bits(got), _bits(whole[a:b])), (n, block, a, b)
    with pytest.raises(ValueError, match="span"):
        CM.decode_span(p, 0, n + 1, torch.empty(n + 1))


def test_subtracted_refuses_what_it_cannot_do_and_restores_after_an_error(ds):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    n = theta.numel()
    d = torch.ones(n) * 1e-3
    with pytest.raises(ValueError, match="hollow"):
        with CM.subtracted(copy.deepcopy(model), [(0, d)]):
            pass
    hollow = CM.hollow_copy(model)
    with pytest.raises(ValueError, match="loaded"):
        with CM.subtracted(hollow, [(0, d)]):
            pass
    CM.load_for_check(hollow, theta)
    with pytest.raises(ValueError, match="overlapping"):
        with CM.subtracted(hollow, [(0, d[:100]), (50, d[:100])]):
            pass
    with pytest.raises(ValueError, match="outside"):
        with CM.subtracted(hollow, [(n - 1, d[:2])]):
            pass
    x = ds.sample_batch(peer_id="p0", step=0, **KW)
    with pytest.raises(RuntimeError, match="stop"):
        with CM.subtracted(hollow, [(0, d)]):
            hollow(input_ids=x)
            raise RuntimeError("stop")
    assert torch.equal(_bits(flat_params(hollow)), _bits(theta))  # views of theta again


def _peak_extra_bytes(fn) -> int:
    """Peak, over ``fn()``, of the CPU bytes allocated in it and not yet freed (torch's allocation events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_the_second_pass_holds_at_most_the_largest_modules_parameters_extra(ds):
    """The "small" preset (12.3M parameters; the largest module is the 4096 x 384 tied embedding, 12.8% of P): the
    second pass's peak of allocations over the first pass's (the same activations) is at most that module's
    bytes, plus 64 KiB for small scratch; the whole-copy path's was all 4P bytes."""
    model = build_model("small", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    n = theta.numel()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == 4096 * 384 and largest < n / 7
    pieces = _packets(n, 4)
    hollow = CM.hollow_copy(model)
    CM.load_for_check(hollow, theta)
    G.row_losses(hollow, ds, STREAMS, **KW)  # warm: first-call caches are not the pass's memory
    first = _peak_extra_bytes(lambda: G.row_losses(hollow, ds, STREAMS, **KW))

    def new() -> None:
        with CM.subtracted(hollow, pieces):
            G.row_losses(hollow, ds, STREAMS, **KW)

    def old() -> None:
        CM.sub_flat_(hollow, ((s, compression.decode(p)) for s, p in pieces))
        G.row_losses(hollow, ds, STREAMS, **KW)

    extra_new = _peak_extra_bytes(new) - first
    extra_old = _peak_extra_bytes(old) - first
    assert extra_new <= 4 * largest + 64 * 1024, (extra_new, 4 * largest)
    assert extra_old >= 4 * n, (extra_old, 4 * n)
