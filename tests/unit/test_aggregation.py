"""Aggregation rules (geomesh_p2p.exchange.robust): exact values, bounded influence, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import aggregate_part, bounded_weights, median_rows

B = 4  # block size of the hand-made packets


def _packet(values, tokens=100, block=B):
    return compression.encode(torch.tensor(values, dtype=torch.float32), block, tokens)


def test_bounded_weights_cap_at_the_median_in_integers():
    assert bounded_weights([10, 20, 30, 10**12], 1.0) == [10, 20, 25, 25]  # median of 4 = (20 + 30) // 2
    assert bounded_weights([10, 20, 10**12], 2.0) == [10, 20, 40]
    assert bounded_weights([0, 0, 7], 1.0) == [0, 0, 7]  # zeros stay zero and do not enter the median
    assert bounded_weights([5, 10**12], None) == [5, 10**12]


def test_median_rows_even_and_odd():
    x = torch.tensor([[1.0, 8.0], [3.0, 2.0], [2.0, 4.0]])
    assert median_rows(x).tolist() == [2.0, 4.0]
    assert median_rows(x[:2]).tolist() == [2.0, 5.0]


def test_meanmed_exact_values():
    # Three contributors, one block of 4: signs (+,+,+,+), (+,-,+,-), (+,+,-,-); scales 1, 2, 4 -> median 2.
    items = [(100, _packet([1, 1, 1, 1])), (100, _packet([2, -2, 2, -2])), (100, _packet([4, 4, -4, -4]))]
    out = aggregate_part(items, 4, rule="meanmed", min_agreement=None)
    w = torch.tensor(1 / 3, dtype=torch.float32)
    v = [w + w + w, w - w + w, w + w - w, w - w - w]
    assert out.tolist() == [(x * torch.tensor(2.0)).item() for x in v]


def test_vote_gives_the_majority_sign_times_the_median_scale():
    items = [(100, _packet([1, 1, 1, 1])), (100, _packet([2, -2, 2, -2])), (100, _packet([4, 4, -4, -4]))]
    out = aggregate_part(items, 4, rule="vote", min_agreement=None)
    assert out.tolist() == [2.0, 2.0, 2.0, -2.0]


def test_a_flipped_contribution_is_dropped_by_the_agreement_filter():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=g)
    honest = [base + 0.5 * torch.randn(4096, generator=g) for _ in range(3)]
    items = [(100, compression.encode(h, 2048, 100)) for h in honest]
    evil = (100, compression.encode(-1000 * honest[0], 2048, 10**9))
    alone = aggregate_part(items, 4096, rule="meanmed")
    dropped: list[int] = []
    attacked = aggregate_part(items + [evil], 4096, rule="meanmed", dropped=dropped)
    assert dropped == [3]
    assert torch.equal(alone, attacked)  # bitwise: the flipped one had no say at all
    # Without the filter it still cannot move the magnitude (median scale, weight capped) ...
    unfiltered = aggregate_part(items + [evil], 4096, rule="meanmed", min_agreement=None)
    assert unfiltered.abs().max() <= alone.abs().max()
    # ... while the first version's mean follows the attacker's 1000x scale and huge token claim.
    mean = aggregate_part(items + [evil], 4096, rule="mean", weight_cap=None)
    assert (mean * alone < 0).float().mean() > 0.8  # the honest ones agree with each other on ~90%


def test_the_mean_rule_is_the_token_weighted_mean():
    items = [(1, _packet([1, 1, 1, 1])), (3, _packet([-1, -1, -1, -1]))]
    out = aggregate_part(items, 4, rule="mean", weight_cap=None)
    assert out.tolist() == [-0.5] * 4


def test_zero_scale_blocks_abstain():
    # A zero contribution (free rider) votes nowhere: the result is the other two's.
    items = [(100, _packet([1, -1, 1, -1])), (100, _packet([0, 0, 0, 0])), (100, _packet([1, -1, 1, -1]))]
    out = aggregate_part(items, 4, rule="vote", min_agreement=None)
    assert out.tolist() == [1.0, -1.0, 1.0, -1.0]  # the two agree; median of the scales (1, 0, 1) is 1


@settings(max_examples=40, deadline=None)
@given(
    n_honest=st.integers(3, 6),
    seed=st.integers(0, 10**6),
    rule=st.sampled_from(["meanmed", "vote"]),
    evil_scale=st.floats(1e-3, 1e30),
    evil_tokens=st.integers(0, 10**15),
)
def test_a_minority_cannot_push_a_coordinate_beyond_the_honest_scales(n_honest, seed, rule, evil_scale, evil_tokens):
    """Bounded influence: whatever a minority sends (any signs, any scales, any token claim), every element
    of the aggregate stays within the largest honest block scale, and is finite."""
    g = torch.Generator().manual_seed(seed)
    numel = 3 * B + 1
    honest = [
        (int(torch.randint(1, 1000, (1,), generator=g)), compression.encode(torch.randn(numel, generator=g), B, 1))
        for _ in range(n_honest)
    ]
    n_evil = (n_honest - 1) // 2
    evil = [
        (evil_tokens, compression.encode(evil_scale * torch.randn(numel, generator=g), B, 1)) for _ in range(n_evil)
    ]
    items = honest + evil
    perm = torch.randperm(len(items), generator=g).tolist()
    out = aggregate_part([items[i] for i in perm], numel, rule=rule)
    bound = torch.stack([p.scales for _, p in honest]).max(dim=0).values.repeat_interleave(B)[:numel]
    assert torch.isfinite(out).all()
    assert bool((out.abs() <= bound).all())


def test_same_inputs_same_bits():
    g = torch.Generator().manual_seed(3)
    items = [(int(n), compression.encode(torch.randn(10_000, generator=g), 2048, 1)) for n in (5, 9, 100, 7)]
    a = aggregate_part(items, 10_000, rule="meanmed")
    b = aggregate_part(list(items), 10_000, rule="meanmed")
    assert a.numpy().tobytes() == b.numpy().tobytes()


def test_slice_packet_equals_encoding_the_slice():
    g = torch.Generator().manual_seed(5)
    v = torch.randn(5 * 2048 + 13, generator=g)
    p = compression.encode(v, 2048, 7)
    for s, e in [(0, 2048), (2048, 3 * 2048), (4 * 2048, v.numel())]:
        q = compression.slice_packet(p, s, e)
        assert q.to_bytes() == compression.encode(v[s:e].contiguous(), 2048, 7).to_bytes()
    try:
        compression.slice_packet(p, 100, 2048)
    except compression.CodecError as e:
        assert "not aligned" in str(e)
    else:
        raise AssertionError("a misaligned slice was accepted")


def test_open_runs_are_warned_about_trusting_settings():
    import argparse

    from peer.node_cli import trust_warning

    ns = argparse.Namespace(allow_peers=None, mode="reencode", method="geomesh", aggregation="mean")
    w = trust_warning(ns)
    assert "--mode reencode" in w and "--aggregation mean" in w and "docs/security.md" in w
    assert "Use the defaults (--mode auto" in w
    # with --eager the advice is not the relay mode eager refuses
    eager = trust_warning(
        argparse.Namespace(allow_peers=None, mode="reencode", method="geomesh", aggregation="meanmed", eager=True)
    )
    assert "--eager needs --mode reencode" in eager and "--mode relay" not in eager
    assert (
        trust_warning(argparse.Namespace(allow_peers=None, mode="relay", method="geomesh", aggregation="meanmed"))
        is None
    )
    assert (
        trust_warning(
            argparse.Namespace(allow_peers="peers.txt", mode="reencode", method="geomesh", aggregation="mean")
        )
        is None
    )


def test_abstaining_zero_contributions_do_not_shrink_the_update():
    """Two free riders of seven sending zeros used to scale every coordinate by 5/7 and pull the median
    scale down (1.23x clean perplexity in the 2-of-7 benchmark): now the mean and the median are over the
    items that vote in the block."""
    items = [
        (100, _packet([1, -1, 1, -1])),
        (100, _packet([0, 0, 0, 0])),
        (100, _packet([2, -2, 2, -2])),
        (100, _packet([0, 0, 0, 0])),
    ]
    out = aggregate_part(items, 4, rule="meanmed", min_agreement=None)
    assert out.tolist() == [1.5, -1.5, 1.5, -1.5]  # mean of signs 1, median of the positive scales (1, 2)


def test_mean_into_a_preallocated_buffer_is_bitwise_the_same():
    """``out=`` (the collective's part slice) gives the same bits as a fresh result, for sign and fp32."""
    from geomesh_p2p.exchange import fp32_view

    g = torch.Generator().manual_seed(7)
    vs = [torch.randn(5000, generator=g) * (k + 1) for k in range(3)]
    tokens = [100, 250, 0]
    packets = [compression.encode(v, 256, n) for v, n in zip(vs, tokens)]
    for items, enc in (
        ([(n, p) for n, p in zip(tokens, packets)], "sign"),
        ([(n, fp32_view(v.numpy().astype("<f4").tobytes(), 5000)) for n, v in zip(tokens, vs)], "fp32"),
    ):
        fresh = aggregate_part(items, 5000, rule="mean", encoding=enc, clip_k=4.0)
        buf = torch.full((6000,), 7.0)
        out = aggregate_part(items, 5000, rule="mean", encoding=enc, clip_k=4.0, out=buf[500:5500])
        assert out.data_ptr() == buf[500:5500].data_ptr()
        assert torch.equal(out, fresh) and bool((buf[:500] == 7).all()) and bool((buf[5500:] == 7).all())
    robust = [(n, p) for n, p in zip(tokens, packets)]
    buf = torch.empty(5000)
    assert torch.equal(
        aggregate_part(robust, 5000, rule="meanmed", out=buf), aggregate_part(robust, 5000, rule="meanmed")
    )


def test_fp32_view_reads_the_bytes_without_a_copy_and_refuses_bad_ones():
    from geomesh_p2p.exchange import fp32_view

    v = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    data = v.numpy().astype("<f4").tobytes()
    t = fp32_view(data, 3)
    assert torch.equal(t, v)
    with pytest.raises(compression.CodecError, match="wrong fp32 length"):
        fp32_view(data, 4)
    with pytest.raises(compression.CodecError, match="NaN or Inf"):
        fp32_view(torch.tensor([1.0, float("nan")]).numpy().tobytes(), 2)
