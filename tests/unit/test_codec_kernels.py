"""The chunked sign-codec kernels (issue 17) against a straightforward whole-vector reference.

The reference does each step once over the whole vector with the plainest ops (numpy
``packbits`` for the signs, one fp32 ``abs().sum`` per block row for the scales, numpy
``unpackbits`` and one multiply for the decode), so any chunk, worker, tail or fallback path of
``geomesh_p2p.exchange.codec.sign`` must give bitwise the same bytes and values. Comparisons are on
the int32 bit patterns, so ``+0.0`` / ``-0.0`` count as different.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geomesh_p2p.exchange.codec import CodecError, SignPacket, decode, encode
from geomesh_p2p.exchange.codec import sign as sign_mod

pytestmark = pytest.mark.timeout(120)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ref_encode(v: torch.Tensor, B: int) -> tuple[bytes, np.ndarray]:
    """(packed sign bytes, fp32 scales [ceil(P/B)]) of fp32 [P]: whole-vector, unchunked."""
    P = v.numel()
    signs = np.packbits((v < 0).numpy(), bitorder="little").tobytes()
    nfull = P // B
    parts = []
    if nfull:
        parts.append(v[: nfull * B].abs().view(nfull, B).sum(1).numpy() / np.float32(B))
    if nfull * B < P:
        tail = v[nfull * B :]
        parts.append(np.array([tail.abs().sum().item()], dtype=np.float32) / np.float32(P - nfull * B))
    scales = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    return signs, scales


def ref_decode(p: SignPacket) -> torch.Tensor:
    """fp32 [P]: (1 - 2 * bit) * scale, element by element, unchunked."""
    bits = np.unpackbits(p.signs.numpy(), bitorder="little")[: p.numel]
    sign = 1.0 - 2.0 * bits.astype(np.float32)
    scale = np.repeat(p.scales.numpy(), p.block_size)[: p.numel]
    return torch.from_numpy((sign * scale).astype(np.float32))


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def random_vector(P: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(P, generator=g) * 2
    v[::89] = 0.0
    v[7::89] = -0.0
    v[11::131] *= 1e30  # large and tiny magnitudes in the same block
    v[13::131] *= 1e-30
    return v


# (P, B): paths of sign._plan. lcm(8, B) small -> chunks of < 32768 on worker threads, with tails
# not a multiple of the chunk, the block or 8; lcm >= 32768 -> OpenMP chunks; lcm > 2**22 -> one
# unchunked segment; P < 2 lcm -> one segment.
CASES = [
    (0, 2048),
    (1, 2048),
    (7, 2048),
    (9, 4),
    (333, 1),
    (1000, 7),
    (4096, 8),
    (2049, 2048),
    (300_007, 2048),
    (2 * 32760 + 5, 24),
    (200_001, 5),
    (123_457, 3),
    (100_003, 40_000),
    (2_000_003, 1 << 20),
    (70_001, (1 << 22) + 1),
]


@pytest.mark.parametrize("P,B", CASES)
def test_encode_matches_whole_vector_reference(P, B):
    v = random_vector(P, P * 7 + B)
    p = encode(v, B, tokens=5)
    signs, scales = ref_encode(v, B)
    assert p.signs.numpy().tobytes() == signs
    assert p.scales.numpy().view(np.int32).tolist() == scales.view(np.int32).tolist()


@pytest.mark.parametrize("P,B", CASES)
def test_decode_and_accumulate_match_reference(P, B):
    v = random_vector(P, P * 3 + B)
    p = encode(v, B)
    ref = ref_decode(p)
    assert torch.equal(bits_of(decode(p)), bits_of(ref))
    out = torch.full((P,), float("nan"))  # every element must be overwritten
    assert decode(p, out=out) is out
    assert torch.equal(bits_of(out), bits_of(ref))
    g = torch.Generator().manual_seed(P)
    acc = torch.randn(P, generator=g)
    expect = acc.clone().add_(ref)
    assert decode(p, out=acc, accumulate=True) is acc
    assert torch.equal(bits_of(acc), bits_of(expect))


@pytest.mark.parametrize("P,B", [(300_007, 2048), (200_001, 5), (65_541, 24)])
def test_random_packets_decode_bitwise(P, B):
    """Any valid sign bytes and scales (not only encode's): zero, huge and tiny scales."""
    g = torch.Generator().manual_seed(B)
    signs = torch.randint(0, 256, (ceil_div(P, 8),), generator=g, dtype=torch.uint8)
    if P % 8:
        signs[-1] &= (1 << (P % 8)) - 1  # padding bits are 0
    nb = ceil_div(P, B)
    scales = torch.rand(nb, generator=g) * 10
    scales[::5] = 0.0
    scales[1::7] = torch.finfo(torch.float32).max
    scales[2::7] = torch.finfo(torch.float32).tiny / 8  # subnormal
    p = SignPacket(P, B, 0, signs, scales)
    ref = ref_decode(p)
    assert torch.equal(bits_of(decode(p)), bits_of(ref))
    # scale 0 with bit 1 decodes to -0.0, as 0.0 * -1.0 does
    assert bool(
        (torch.signbit(ref) == torch.from_numpy(np.unpackbits(signs.numpy(), bitorder="little")[:P].astype(bool))).all()
    )
    acc = torch.zeros(P)
    decode(p, out=acc, accumulate=True)
    assert torch.equal(bits_of(acc), bits_of(torch.zeros(P).add_(ref)))


def test_zeros_encode_to_plus_zero():
    for P, B in [(5, 2048), (300_001, 2048)]:
        v = torch.zeros(P)
        v[1::2] = -0.0
        p = encode(v, B)
        assert set(p.signs.tolist()) == {0}
        assert p.scales.numpy().view(np.int32).tolist() == [0] * ceil_div(P, B)
        assert torch.equal(bits_of(decode(p)), torch.zeros(P, dtype=torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("P,where", [(10, 3), (300_007, 300_006), (300_007, 40_000)])
def test_non_finite_refused(bad, P, where):
    v = torch.randn(P)
    v[where] = bad
    with pytest.raises(CodecError, match="non-finite"):
        encode(v)


def test_workers_and_fallback_give_same_bytes(monkeypatch):
    v = random_vector(400_003, 1)
    a = encode(v)
    d = decode(a)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert encode(v).to_bytes() == a.to_bytes()
    assert torch.equal(bits_of(decode(a)), bits_of(d))
    monkeypatch.setattr(sign_mod, "_MAX_ALIGN", 1)  # one unchunked segment
    assert encode(v).to_bytes() == a.to_bytes()
    assert torch.equal(bits_of(decode(a)), bits_of(d))


def test_accumulate_needs_out():
    p = encode(torch.ones(10))
    with pytest.raises(CodecError, match="accumulate"):
        decode(p, accumulate=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("P,B", [(300_007, 2048), (200_001, 5), (2_000_003, 1 << 20), (33_554_441, 2048)])
def test_cuda_decode_matches_cpu_bitwise(P, B):
    v = random_vector(P, P)
    p = encode(v, B)
    ref = ref_decode(p)
    dev = torch.device("cuda")
    assert torch.equal(bits_of(decode(p, device=dev).cpu()), bits_of(ref))
    acc = torch.randn(P)
    expect = acc.clone().add_(ref)
    acc_d = acc.to(dev)
    decode(p, out=acc_d, accumulate=True)
    assert torch.equal(bits_of(acc_d.cpu()), bits_of(expect))
    q = encode(v.to(dev), B)
    assert q.signs.numpy().tobytes() == p.signs.numpy().tobytes()  # signs are exact on any device
    np.testing.assert_allclose(q.scales.numpy(), p.scales.numpy(), rtol=1e-5)


# ---- serial worker threads (chunks of _SERIAL_CHUNK on pool threads whose OpenMP count is 1)

serial_only = pytest.mark.skipif(
    not sign_mod._serial_threads_work(), reason="torch's OpenMP runtime does not take a per-thread thread count here"
)


@serial_only
@pytest.mark.parametrize(
    "P,B,chunk",
    [
        (100_003, 2048, 8192),  # 12 chunks of 4 blocks, a partial last chunk with a partial block
        (99_999, 24, 4800),  # lcm(8, 24) = 24: chunk a multiple of 24, tail not a multiple of 8
        (65_536 + 3, 5, 4000),  # B not a divisor of 8, odd tail
        (40_960, 2048, 8192),  # exactly 5 chunks, no tail
        (300_007, 1 << 15, 1 << 15),  # one block per chunk
    ],
)
def test_serial_chunks_match_reference(monkeypatch, P, B, chunk):
    monkeypatch.setattr(sign_mod, "_SERIAL_CHUNK", chunk)
    monkeypatch.setattr(sign_mod, "_SERIAL_MIN", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # more workers than cores
    got = sign_mod._plan(torch.device("cpu"), P, B)
    assert got[2] is True and got[0] % B == 0 and got[0] % 8 == 0 and P // got[0] >= 2
    v = random_vector(P, P + B)
    p = encode(v, B, tokens=1)
    signs, scales = ref_encode(v, B)
    assert p.signs.numpy().tobytes() == signs
    assert p.scales.numpy().view(np.int32).tolist() == scales.view(np.int32).tolist()
    ref = ref_decode(p)
    out = torch.full((P,), float("nan"))
    assert torch.equal(bits_of(decode(p, out=out)), bits_of(ref))
    acc = torch.randn(P, generator=torch.Generator().manual_seed(B))
    expect = acc.clone().add_(ref)
    decode(p, out=acc, accumulate=True)
    assert torch.equal(bits_of(acc), bits_of(expect))


@serial_only
def test_serial_fallback_and_single_thread_give_the_same_bytes(monkeypatch):
    v = random_vector(700_001, 3)
    monkeypatch.setattr(sign_mod, "_SERIAL_CHUNK", 1 << 16)
    assert sign_mod._plan(torch.device("cpu"), v.numel(), 2048) == (1 << 16, 2, True)
    a = encode(v)
    d = decode(a)
    monkeypatch.setattr(sign_mod, "_SERIAL_OK", False)  # no per-thread OpenMP count: small inline chunks
    assert sign_mod._plan(torch.device("cpu"), v.numel(), 2048) == ((32767 // 2048) * 2048, 2, False)
    assert encode(v).to_bytes() == a.to_bytes()
    assert torch.equal(bits_of(decode(a)), bits_of(d))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # big chunks in the caller's thread
    assert sign_mod._plan(torch.device("cpu"), v.numel(), 2048) == (1 << 16, 1, False)
    assert encode(v).to_bytes() == a.to_bytes()
    assert torch.equal(bits_of(decode(a)), bits_of(d))


@serial_only
def test_make_thread_serial_changes_only_its_own_thread():
    import threading

    before = torch.get_num_threads()
    seen: dict[str, int] = {}

    def serial() -> None:
        seen["ok"] = sign_mod._make_thread_serial()
        seen["serial"] = torch.get_num_threads()

    def plain() -> None:
        seen["plain"] = torch.get_num_threads()

    for fn in (serial, plain):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    assert seen == {"ok": True, "serial": 1, "plain": before}
    assert torch.get_num_threads() == before


def test_run_serial_runs_each_task_once_and_raises():
    done: list[int] = []

    def setup():
        return done.append

    sign_mod._run_serial(setup, 37, 3)
    assert sorted(done) == list(range(37))

    def failing():
        def step(i: int) -> None:
            if i == 5:
                raise ValueError("task 5")

        return step

    with pytest.raises(ValueError, match="task 5"):
        sign_mod._run_serial(failing, 9, 2)


def test_negated_view_encodes_like_its_values():
    v = random_vector(100_003, 9)
    neg_view = torch._neg_view(v)
    assert neg_view.is_neg()
    assert encode(neg_view).to_bytes() == encode(-v).to_bytes()
