"""Outer optimizer, state digests and checkpoints (optim, state)."""

import os

import blake3
import numpy as np
import pytest
import torch

from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.state import (
    CheckpointError,
    StateError,
    digest,
    list_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
)

P = 10_007


def _inputs(seed, steps=20, n=P):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n, generator=g) * 0.05
    aggs = [torch.randn(n, generator=g) * 1e-3 for _ in range(steps)]
    return theta, aggs


# --- OuterNesterov -------------------------------------------------------------------


def test_outer_nesterov_matches_float64_reference():
    theta, aggs = _inputs(0)
    ref = theta.double()
    buf = torch.zeros(P, dtype=torch.float64)
    opt = OuterNesterov(lr=0.7, momentum=0.9)
    for g in aggs:
        opt.step(theta, g)
        buf = 0.9 * buf + g.double()
        ref = ref - 0.7 * (g.double() + 0.9 * buf)
    assert (theta.double() - ref).abs().max().item() < 1e-6
    assert (opt.buf.double() - buf).abs().max().item() < 1e-6
    assert opt.steps == len(aggs)


def test_outer_nesterov_equals_torch_sgd_semantics():
    theta, aggs = _inputs(1, steps=5)
    p = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterNesterov()
    for g in aggs:
        opt.step(theta, g)
        p.grad = g.clone()
        sgd.step()
    assert (theta - p.detach()).abs().max().item() < 1e-6


def test_outer_nesterov_bit_identical():
    theta_a, aggs = _inputs(2)
    theta_b = theta_a.clone()
    a, b = OuterNesterov(), OuterNesterov()
    # numpy float32 re-implementation: same six roundings -> same bits
    th_np = theta_a.numpy().copy()
    buf_np = np.zeros_like(th_np)
    mu, lr = np.float32(0.9), np.float32(0.7)
    for g in aggs:
        a.step(theta_a, g)
        b.step(theta_b, g.clone())
        gn = g.numpy()
        buf_np = mu * buf_np
        buf_np = buf_np + gn
        upd = mu * buf_np
        upd = gn + upd
        upd = lr * upd
        th_np = th_np - upd
    assert torch.equal(theta_a, theta_b) and torch.equal(a.buf, b.buf)
    assert np.array_equal(theta_a.numpy(), th_np) and np.array_equal(a.buf.numpy(), buf_np)
    assert digest(theta_a, a.buf) == digest(theta_b, b.buf)


def test_outer_state_dict_roundtrip_and_input_checks():
    theta, aggs = _inputs(3, steps=6)
    a = OuterNesterov()
    for g in aggs[:3]:
        a.step(theta, g)
    sd = a.state_dict()
    assert isinstance(sd["buf"], torch.Tensor) and sd["buf"].dtype == torch.float32
    b = OuterNesterov(lr=0.1)
    b.load_state_dict(sd)
    assert b.lr == 0.7 and b.steps == 3
    theta_b = theta.clone()
    for g in aggs[3:]:
        a.step(theta, g)
        b.step(theta_b, g)
    assert torch.equal(theta, theta_b)
    with pytest.raises(ValueError, match="fp32"):
        a.step(theta.double(), aggs[0].double())
    with pytest.raises(ValueError):
        a.step(theta, aggs[0][:-1])
    with pytest.raises(ValueError):
        OuterNesterov(momentum=1.0)


# --- digest --------------------------------------------------------------------------


def test_digest_definition_and_sensitivity():
    theta, (mom, *_) = _inputs(4, steps=1)
    d = digest(theta)
    assert len(d) == 32 and int(d, 16) >= 0
    # a tree of BLAKE3 over 8 MiB leaves (model/digest.py, 0.12.0); one leaf here: tests/unit/test_state_digest.py has more
    data = theta.numpy().astype("<f4").tobytes()

    def root(data: bytes) -> str:
        leaf = blake3.blake3(data).digest()
        head = b"geomesh-state-digest-v3" + len(data).to_bytes(8, "little") + (8 << 20).to_bytes(8, "little")
        return blake3.blake3(head + leaf).hexdigest()[:32]

    assert d == root(data)
    both = root(data + mom.numpy().astype("<f4").tobytes())
    assert digest(theta, mom) == both != d
    flipped = theta.clone()
    flipped.view(torch.int32)[123] ^= 1  # one bit of one element
    assert digest(flipped) != d
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    with pytest.raises(StateError):
        digest(theta.double())


# --- checkpoints ---------------------------------------------------------------------


def test_checkpoint_roundtrip_bitwise_and_atomic(tmp_path):
    assert load_latest_checkpoint(tmp_path / "none") is None
    assert load_latest_checkpoint(tmp_path) is None
    theta, (mom, *_) = _inputs(5, steps=1)
    theta[0] = -0.0
    for r in range(5):
        path = save_checkpoint(
            tmp_path, round=r, theta=theta + r, momentum=mom, meta={"run_config_hash": "abc123", "peer": "x"}, keep=2
        )
    assert path.name == "ckpt-00000004.json"
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "ckpt-00000003.json",
        "ckpt-00000003.safetensors",
        "ckpt-00000004.json",
        "ckpt-00000004.safetensors",
    ]  # keep=2, no temp files
    rnd, th, mo, rec = load_latest_checkpoint(tmp_path)
    assert rnd == 4 and torch.equal(th, theta + 4) and torch.equal(mo, mom)
    assert th.dtype == torch.float32
    assert rec["digest"] == digest(theta + 4, mom) and rec["run_config_hash"] == "abc123"
    assert rec["meta"]["peer"] == "x" and rec["round"] == 4 and rec["time"] > 0
    # without momentum, and bitwise -0.0 preserved
    save_checkpoint(tmp_path, round=7, theta=theta, momentum=None, meta={})
    rnd, th, mo, rec = load_latest_checkpoint(tmp_path)
    assert rnd == 7 and mo is None and torch.equal(th.view(torch.int32), theta.view(torch.int32))
    assert rec["run_config_hash"] is None
    assert [r for r, _ in list_checkpoints(tmp_path)] == [3, 4, 7]


def test_checkpoint_failed_write_leaves_previous(tmp_path, monkeypatch):
    theta, _ = _inputs(6, steps=0)
    save_checkpoint(tmp_path, round=1, theta=theta, momentum=None, meta={})

    def boom(*a, **k):
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, round=2, theta=theta + 1, momentum=None, meta={})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.json", "ckpt-00000001.safetensors"]
    assert load_latest_checkpoint(tmp_path)[0] == 1
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, round=3, theta=theta, momentum=None, meta={"x": object()})


def test_corrupt_checkpoint_rejected(tmp_path):
    theta, (mom, *_) = _inputs(7, steps=1)
    save_checkpoint(tmp_path, round=0, theta=theta, momentum=mom, meta={})
    w = tmp_path / "ckpt-00000000.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0x40  # a flipped bit in the tensor data
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest") as ei:
        load_latest_checkpoint(tmp_path)
    assert "ckpt-00000000.safetensors" in str(ei.value)
    w.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(CheckpointError, match="ckpt-00000000.safetensors"):
        load_latest_checkpoint(tmp_path)
    (tmp_path / "ckpt-00000000.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="ckpt-00000000.json"):
        load_latest_checkpoint(tmp_path)


# --- SyncAdamW (the ddp baseline's step) ---------------------------------------------------


def _adamw_reference(theta, aggs, mask, lrs, betas=(0.9, 0.95), eps=1e-8, wd=0.1):
    """torch.optim.AdamW, one param group per mask value, fed the same gradients."""
    p_dec = torch.nn.Parameter(theta[mask.bool()].clone())
    p_nod = torch.nn.Parameter(theta[~mask.bool()].clone())
    opt = torch.optim.AdamW(
        [{"params": [p_dec], "weight_decay": wd}, {"params": [p_nod], "weight_decay": 0.0}],
        lr=lrs[0],
        betas=betas,
        eps=eps,
        foreach=False,
    )
    for g, lr in zip(aggs, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        p_dec.grad, p_nod.grad = g[mask.bool()].clone(), g[~mask.bool()].clone()
        opt.step()
    out = theta.clone()
    out[mask.bool()], out[~mask.bool()] = p_dec.detach(), p_nod.detach()
    return out


def test_sync_adamw_matches_torch_adamw_and_is_bit_identical():
    from geomesh_p2p.model.optim import SyncAdamW

    theta, aggs = _inputs(3, steps=8, n=4099)
    mask = (torch.arange(4099) % 3 != 0).float()
    lrs = [1e-3 * (k + 1) / 4 if k < 4 else 1e-3 for k in range(8)]
    runs = []
    for _ in range(2):
        th = theta.clone()
        opt = SyncAdamW(lambda r: lrs[r], decay_mask=mask)
        for r, g in enumerate(aggs):
            opt.step(th, g, round=r)
        runs.append((th, opt.buf.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][1].numel() == 2 * 4099 and SyncAdamW.state_factor == 2
    ref = _adamw_reference(theta, aggs, mask, lrs)
    torch.testing.assert_close(runs[0][0], ref, rtol=1e-5, atol=1e-7)
    assert not torch.equal(runs[0][0], theta)


def test_sync_adamw_step_count_comes_from_the_round():
    """A peer that got the state of round 5 (m, v) steps exactly as one that ran rounds 0..5."""
    from geomesh_p2p.model.optim import SyncAdamW

    theta, aggs = _inputs(4, steps=6, n=257)
    a = SyncAdamW(lambda r: 1e-3)
    ta = theta.clone()
    for r, g in enumerate(aggs[:5]):
        a.step(ta, g, round=r)
    b = SyncAdamW(lambda r: 1e-3)
    b.buf, tb = a.buf.clone(), ta.clone()
    a.step(ta, aggs[5], round=5)
    b.step(tb, aggs[5], round=5)
    assert torch.equal(ta, tb)
    c = SyncAdamW(lambda r: 1e-3)
    c.buf = torch.zeros(257)  # a Nesterov-sized state: refused, not misread
    with pytest.raises(ValueError, match="2 x 257"):
        c.step(theta.clone(), aggs[0])


def test_checkpoint_holds_k_times_p_optimizer_state(tmp_path):
    theta = torch.randn(100)
    state = torch.randn(200)
    save_checkpoint(tmp_path, round=3, theta=theta, momentum=state)
    rnd, th, st, _ = load_latest_checkpoint(tmp_path)
    assert rnd == 3 and torch.equal(th, theta) and torch.equal(st, state)
    with pytest.raises(StateError, match="k x as many"):
        save_checkpoint(tmp_path, round=4, theta=theta, momentum=torch.randn(150))


def test_ddp_step_equals_adamw_on_the_union_of_the_peers_batches(tmp_path):
    """Two peers' gradients, token-weighted and averaged, then SyncAdamW: the same weights as one
    AdamW step on the gradient of both batches together (data parallelism, not an approximation)."""
    from geomesh_p2p.exchange import token_weighted_mean
    from geomesh_p2p.data import load_dataset
    from geomesh_p2p.model.optim import SyncAdamW
    from geomesh_p2p.model.build import build_model, flat_params
    from geomesh_p2p.model.training import InnerTrainer

    torch.set_num_threads(1)
    ds = load_dataset(None, seq_len=32, cache_dir=tmp_path)
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta0 = flat_params(model)
    trainers = [
        InnerTrainer(build_model("tiny", vocab_size=ds.vocab_size, seed=0), ds, seq_len=32, peer_id=f"p{i}")
        for i in range(2)
    ]
    grads = [t.gradient(round=0, batch_size=4)[0] for t in trainers]
    mean = token_weighted_mean([(128, g) for g in grads], theta0.numel(), clip_k=None, encoding="fp32")
    theta = theta0.clone()
    SyncAdamW(lambda r: 1e-3, decay_mask=trainers[0].decay_mask()).step(theta, mean, round=0)
    # reference: one model, both batches as one batch of 8, torch AdamW
    ref = InnerTrainer(model, ds, seq_len=32, peer_id="ref", lr=1e-3, grad_clip=0.0, warmup_steps=0)
    batch = torch.cat(
        [ds.sample_batch(seed=0, peer_id=f"p{i}", round=0, step=0, batch_size=4, seq_len=32) for i in range(2)]
    )
    ref.optimizer.zero_grad()
    ref.accumulate_grad(batch)
    ref._set_lr()
    ref.optimizer.step()
    # AdamW's first step is lr x g / (|g| + eps), 1e-3 wherever |g| >> eps; where |g| is near eps (1e-8) the two sums'
    # last bits move it by a few 1e-6 (an Intel AVX-512 box: 3.2e-6 on 1 of 937,472 elements), so 1 % of the step
    torch.testing.assert_close(theta, flat_params(model), rtol=1e-4, atol=1e-5)
    assert not torch.equal(theta, theta0)
