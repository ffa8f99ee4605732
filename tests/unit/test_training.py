"""Model building, flat parameters and the inner loop (geomesh_p2p.model.training)."""

import json
import math
import time

import pytest
import torch

import geomesh_p2p.model.training as training
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.data import TokenDataset, load_dataset
from geomesh_p2p.model.build import (
    PRESETS,
    ConfigError,
    build_model,
    count_params,
    flat_params,
    load_flat_,
    model_config,
    num_params,
)
from geomesh_p2p.model.training import InnerTrainer, lr_at

SEQ = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return load_dataset(None, seq_len=SEQ, cache_dir=tmp_path_factory.mktemp("gmcache"))


def _trainer(ds, **kw):
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=kw.pop("model_seed", 0))
    args = dict(
        device="cpu", seq_len=SEQ, lr=1e-3, weight_decay=0.1, warmup_steps=3, total_steps=200, seed=0, peer_id="p0"
    )
    args.update(kw)
    return InnerTrainer(model, ds, **args)


# --- models --------------------------------------------------------------------------


def test_presets_build_from_config_only():
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "llama-tiny"}
    tiny = build_model("tiny", vocab_size=4096)
    assert 0.8e6 < num_params(tiny) < 1.2e6
    assert tiny.config.n_layer in (2, 3, 4) and tiny.config.n_embd == 128
    assert tiny.config.n_head == 4 and tiny.config.n_positions == 128
    assert next(tiny.parameters()).dtype == torch.float32 and tiny.training
    llama = build_model("llama-tiny", vocab_size=4096)
    assert type(llama).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, 4096, (2, 16))
    assert math.isfinite(llama(input_ids=x, labels=x).loss.item())
    small = model_config("small", vocab_size=4096)
    assert small.n_embd * small.n_layer >= 384 * 6
    big = model_config("gpt2-124m")
    assert (big.n_layer, big.n_embd, big.n_head, big.n_positions, big.vocab_size) == (12, 768, 12, 1024, 50257)


def test_gpt2_takes_the_fused_tanh_gelu_which_keeps_a_quarter_of_its_activations(tmp_path):
    """Issue 27 (session 41): GPT-2's default "gelu_new" is written in Python, and autograd keeps four [B, T, 4d]
    tensors per layer for it; "gelu_pytorch_tanh" is the same function as one op and keeps one."""
    from transformers import AutoModelForCausalLM

    from geomesh_p2p.model.memory import _saved_activation_bytes

    cfg = model_config("tiny")
    assert cfg.activation_function == "gelu_pytorch_tanh"
    assert model_config("gpt2-124m").activation_function == "gelu_pytorch_tanh"
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"preset": "tiny", "activation_function": "relu"}))
    assert model_config(config_file=f).activation_function == "relu"  # another choice is the user's
    ours = build_model("tiny", seed=0)
    cfg.activation_function = "gelu_new"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        theirs = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    x = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    # 3 fewer fp32 [1, 32, 512] tensors in each of the 2 layers, exactly
    assert _saved_activation_bytes(theirs, x) - _saved_activation_bytes(ours, x) == 3 * 2 * 32 * 512 * 4
    with torch.no_grad():
        a, b = ours(input_ids=x).logits, theirs(input_ids=x).logits
    assert torch.equal(flat_params(ours), flat_params(theirs))  # the same weights: only the op differs
    assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_llama_150m_preset_and_exact_counts():
    # The paper's ~150M LLaMA-style model at the shipped tokenizer's vocabulary (4096, tied
    # embeddings): 12 layers x (4 x 1024^2 attention + 3 x 1024 x 2688 SwiGLU + 2 x 1024 norms)
    # + 4096 x 1024 embedding + 1024 final norm.
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2688 + 2 * 1024
    assert count_params("llama-150m", vocab_size=4096) == 12 * per_layer + 4096 * 1024 + 1024 == 153_641_984
    cfg = model_config("llama-150m", vocab_size=4096)
    assert type(cfg).__name__ == "LlamaConfig" and cfg.tie_word_embeddings and cfg.use_cache is False
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.max_position_embeddings,
    ) == (1024, 2688, 12, 16, 1024)
    assert count_params("gpt2-124m", vocab_size=4096) == 88_988_160
    assert count_params("gpt2-124m") == 124_439_808  # at GPT-2's own vocabulary, 50257
    assert count_params("tiny", vocab_size=4096) == 937_472 == num_params(build_model("tiny", vocab_size=4096))
    assert (
        count_params("llama-tiny", vocab_size=4096) == 926_336 == num_params(build_model("llama-tiny", vocab_size=4096))
    )
    with pytest.raises(ConfigError, match="llama-9b"):
        count_params("llama-9b")


def test_init_deterministic_from_seed():
    a = flat_params(build_model("tiny", seed=7))
    rng_before = torch.random.get_rng_state()
    b = flat_params(build_model("tiny", seed=7))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller RNG untouched
    assert torch.equal(a, b)
    assert not torch.equal(a, flat_params(build_model("tiny", seed=8)))


def test_json_config_files(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"preset": "tiny", "n_layer": 1}))
    m = build_model(config_file=str(f), vocab_size=512)
    assert m.config.n_layer == 1 and m.config.vocab_size == 512
    hf = tmp_path / "config.json"
    hf.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_layer": 1,
                "n_embd": 64,
                "n_head": 2,
                "n_positions": 32,
                "vocab_size": 300,
            }
        )
    )
    m2 = build_model(config_file=hf)
    assert m2.config.n_embd == 64 and m2.config.eos_token_id == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"preset": "tiny",,}')
    with pytest.raises(ConfigError, match="bad.json") as ei:
        build_model(config_file=bad)
    assert isinstance(ei.value, ValueError) and "line 1" in str(ei.value)
    with pytest.raises(ConfigError, match="nothere.json"):
        build_model(config_file=tmp_path / "nothere.json")
    with pytest.raises(ConfigError, match="huge"):
        build_model("huge")
    notype = tmp_path / "notype.json"
    notype.write_text('{"n_layer": 2}')
    with pytest.raises(ConfigError, match="model_type"):
        build_model(config_file=notype)
    badshape = tmp_path / "badshape.json"
    badshape.write_text('{"preset": "tiny", "n_embd": 130, "n_head": 4}')
    with pytest.raises(ConfigError, match="badshape.json"):
        build_model(config_file=badshape)


def test_flat_params_roundtrip_bitwise():
    m = build_model("tiny", seed=1)
    flat = flat_params(m)
    assert flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.dim() == 1
    # tied lm_head / wte counted once; order = named_parameters order
    assert m.lm_head.weight is m.transformer.wte.weight
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names and names[0] == "transformer.wte.weight"
    assert flat.numel() == num_params(m)
    assert torch.equal(flat[: m.transformer.wte.weight.numel()], m.transformer.wte.weight.detach().reshape(-1))
    other = build_model("tiny", seed=2)
    assert not torch.equal(flat_params(other), flat)
    load_flat_(other, flat)
    assert torch.equal(flat_params(other), flat)
    assert torch.equal(other.lm_head.weight, m.lm_head.weight)
    load_flat_(other, flat.double())  # any dtype
    assert torch.equal(flat_params(other), flat)
    with pytest.raises(ValueError, match="elements"):
        load_flat_(other, flat[:-1])
    flat[0] += 1  # a copy, not a view
    assert not torch.equal(flat_params(m), flat)


def test_lr_schedule():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1) == lr_at(500, **kw)


# --- inner loop ----------------------------------------------------------------------


def test_inner_training_lowers_loss_and_perplexity(ds):
    tr = _trainer(ds)
    ppl0 = tr.evaluate(max_batches=4, batch_size=8)
    assert ppl0 == tr.evaluate(max_batches=4, batch_size=8)  # deterministic
    assert 2000 < ppl0 < 10000  # ~ vocab size at init
    seen = []
    res = tr.run(round=0, inner_steps=30, batch_size=8, progress=lambda s, loss, tps: seen.append((s, loss, tps)))
    assert res.steps_done == 30 and not res.stopped_early
    assert res.tokens == 30 * 8 * SEQ
    assert [s for s, _, _ in seen] == list(range(1, 31)) and all(t > 0 for _, _, t in seen)
    first = sum(l for _, l, _ in seen[:5]) / 5
    last = sum(l for _, l, _ in seen[-5:]) / 5
    assert last < first - 1.0
    assert res.last_loss == seen[-1][1] and res.compute_s > 0
    ppl1 = tr.evaluate(max_batches=4, batch_size=8)
    assert ppl1 < ppl0 / 3
    # inner optimizer state persists across rounds; the schedule follows global steps
    assert tr.global_step == 30 and len(tr.optimizer.state) > 0
    state_before = {id(p): float(s["step"]) for p, s in tr.optimizer.state.items()}
    load_flat_(tr.model, flat_params(build_model("tiny", vocab_size=ds.vocab_size)))
    tr.run(round=1, inner_steps=2, batch_size=4)
    assert tr.global_step == 32
    assert all(float(tr.optimizer.state[p]["step"]) == float(state_before[id(p)]) + 2 for p in tr.optimizer.state)


def test_same_inputs_same_weights(ds):
    a, b = _trainer(ds), _trainer(ds)
    a.run(round=2, inner_steps=3, batch_size=4)
    b.run(round=2, inner_steps=3, batch_size=4)
    assert torch.equal(flat_params(a.model), flat_params(b.model))
    c = _trainer(ds, peer_id="p1")
    c.run(round=2, inner_steps=3, batch_size=4)
    assert not torch.equal(flat_params(a.model), flat_params(c.model))


def test_deadline_stops_early_and_reports_real_tokens(ds, monkeypatch):
    """No step starts at or past the deadline. Swarm time is a virtual clock here that each step moves on by
    ``step_s``: the deadline 6 steps away stops the run after exactly 6, however long the real steps take (a
    loaded machine's), and the estimate of the next step's end (real seconds, far under ``step_s``) stops none
    before that."""
    tr = _trainer(ds)
    tr.run(round=0, inner_steps=2, batch_size=4)  # warm up kernels, measure a step
    step_s, now = 100.0, [swarm_time()]
    monkeypatch.setattr(training, "swarm_time", lambda: now[0])
    real_step_batch = tr._step_batch

    def step_batch(round, step, batch_size):  # a step's batch is taken right after its deadline check
        now[0] += step_s
        return real_step_batch(round, step, batch_size)

    tr._step_batch = step_batch  # type: ignore[method-assign]
    res = tr.run(round=1, inner_steps=100, batch_size=4, deadline=now[0] + 6 * step_s)
    assert res.stopped_early and res.steps_done == 6
    assert res.tokens == res.steps_done * 4 * SEQ
    assert tr.global_step == 2 + res.steps_done
    monkeypatch.undo()
    del tr._step_batch  # the class method again
    # a deadline already past: nothing is done
    res2 = tr.run(round=2, inner_steps=5, batch_size=4, deadline=time.time() - 1)
    assert res2.steps_done == 0 and res2.tokens == 0 and res2.stopped_early
    assert math.isnan(res2.mean_loss)
    # should_stop
    calls = []
    res3 = tr.run(round=3, inner_steps=5, batch_size=4, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert res3.steps_done == 2 and res3.stopped_early


def test_the_token_floors_steps_run_past_the_deadline_within_their_grace(ds):
    """``floor_steps`` / ``floor_grace_s`` (issue 28's token floor, session 34): a deadline already past stops the
    steps at 0 (above); with a floor of 3 steps and a grace the steps run on to exactly 3 (the floor), not to the
    plan's 5; a grace already spent too stops them at 0, like the deadline alone; the floor's steps train the same
    batches and learning rates as steps within the window (the weights equal a run without any deadline)."""
    tr = _trainer(ds)
    past = swarm_time() - 1.0
    res = tr.run(round=0, inner_steps=5, batch_size=4, deadline=past, floor_steps=3, floor_grace_s=600.0)
    assert (res.steps_done, res.tokens, res.stopped_early) == (3, 3 * 4 * SEQ, True)
    spent = tr.run(round=1, inner_steps=5, batch_size=4, deadline=past, floor_steps=3, floor_grace_s=0.5)
    assert spent.steps_done == 0 and spent.stopped_early
    # the same 3 steps with no deadline at all: the same weights, bit for bit
    ref = _trainer(ds)
    ref.run(round=0, inner_steps=5, batch_size=4, should_stop=lambda: ref.global_step >= 3)
    assert ref.global_step == tr.global_step == 3
    assert torch.equal(flat_params(ref.model), flat_params(tr.model))


def test_a_stop_request_holds_once_the_token_floors_steps_are_done(ds):
    """``round.steps.stop_after_floor`` (session 35: 2 of 3 peers stopped together after 1 and 3 steps, under their
    floor of 5; both counted 0 tokens, no part met its quorum and the survivor's round was thrown away): a stop
    requested before the first step still lets the floor's 3 steps run (not the plan's 8), counted by the trainer's
    progress calls, which still reach the live line; with no floor it stops at once, as before; past a spent
    deadline and grace the floor's steps stop too (the stop adds no time of its own)."""
    import asyncio
    from types import SimpleNamespace

    from geomesh_p2p.round.steps import StepsDone, stop_after_floor

    stop = asyncio.Event()
    stop.set()  # Ctrl+C before the steps
    drv = SimpleNamespace(stop=stop)
    shown: list[int] = []
    tr = _trainer(ds)
    done = StepsDone(lambda k, loss, tps: shown.append(k))
    res = tr.run(round=0, inner_steps=8, batch_size=4, should_stop=stop_after_floor(drv, done, 3), progress=done)
    assert (res.steps_done, res.tokens, res.stopped_early) == (3, 3 * 4 * SEQ, True)
    assert done.steps == 3 and shown == [1, 2, 3]
    none = StepsDone()
    res0 = tr.run(round=1, inner_steps=8, batch_size=4, should_stop=stop_after_floor(drv, none, 0), progress=none)
    assert (res0.steps_done, none.steps) == (0, 0)
    past = swarm_time() - 1.0
    spent = StepsDone()
    cut = tr.run(
        round=2,
        inner_steps=8,
        batch_size=4,
        deadline=past,
        floor_steps=3,
        floor_grace_s=0.5,
        should_stop=stop_after_floor(drv, spent, 3),
        progress=spent,
    )
    assert cut.steps_done == 0 and cut.stopped_early


def test_an_emulated_slow_down_never_sleeps_past_the_train_deadline(ds, monkeypatch):
    """speed_factor f < 1 sleeps (1/f - 1) x the step's measured compute; a step the peer was stopped in (SIGSTOP)
    measures the stall as compute, and sleeping it again kept a resumed peer asleep through its exchange
    (tests/e2e/test_stalled_peer_procs.py: 42 s). With a deadline the sleep ends at it; without one it is whole."""
    import threading

    tr = _trainer(ds, speed_factor=0.5)
    tr.run(round=0, inner_steps=1, batch_size=4)  # warm up kernels
    step = tr.accumulate_fitting

    def stalled(*a, **kw):  # the step, then 0.3 s not running: measured as the step's compute
        out = step(*a, **kw)
        threading.Event().wait(0.3)
        return out

    monkeypatch.setattr(tr, "accumulate_fitting", stalled)
    sleeps: list[float] = []
    monkeypatch.setattr(training.time, "sleep", sleeps.append)
    res = tr.run(round=1, inner_steps=5, batch_size=4, deadline=swarm_time() + 0.1)
    assert res.steps_done == 1 and res.stopped_early  # the deadline passed during the first step
    assert sleeps == [0.0]  # nothing slept past the deadline
    sleeps.clear()
    tr.run(round=2, inner_steps=1, batch_size=4)  # no deadline: the whole emulated slow-down
    assert len(sleeps) == 1 and sleeps[0] >= 0.3


def test_grad_accumulation_matches_full_batch(ds):
    tr = _trainer(ds)
    batch = ds.sample_batch(seed=0, peer_id="p0", round=0, step=0, batch_size=4, seq_len=SEQ)
    tr.optimizer.zero_grad(set_to_none=True)
    loss_full = tr.accumulate_grad(batch, micro_batch=4)
    g_full = torch.cat([p.grad.reshape(-1).clone() for p in tr.model.parameters()])
    tr.optimizer.zero_grad(set_to_none=True)
    loss_acc = tr.accumulate_grad(batch, micro_batch=2)
    g_acc = torch.cat([p.grad.reshape(-1).clone() for p in tr.model.parameters()])
    assert abs(loss_full - loss_acc) < 1e-5
    assert (g_full - g_acc).abs().max().item() < 1e-5
    tr.optimizer.zero_grad(set_to_none=True)
    tr.accumulate_grad(batch, micro_batch=3)  # uneven split: rows weighted
    g3 = torch.cat([p.grad.reshape(-1).clone() for p in tr.model.parameters()])
    assert (g_full - g3).abs().max().item() < 1e-5
    # whole run with accumulation == without, up to float noise
    a, b = _trainer(ds), _trainer(ds)
    ra = a.run(round=0, inner_steps=2, batch_size=4, micro_batch=2)
    rb = b.run(round=0, inner_steps=2, batch_size=4)
    assert abs(ra.mean_loss - rb.mean_loss) < 1e-4
    assert (flat_params(a.model) - flat_params(b.model)).abs().max().item() < 1e-4


def test_speed_factor_sleeps_proportionally(ds, monkeypatch):
    slept = []
    monkeypatch.setattr(training.time, "sleep", lambda s: slept.append(s))
    tr = _trainer(ds, speed_factor=0.25)
    res = tr.run(round=0, inner_steps=3, batch_size=2)
    assert len(slept) == 3 and all(s > 0 for s in slept)
    assert res.steps_done == 3
    slept.clear()
    _trainer(ds, speed_factor=1.0).run(round=0, inner_steps=2, batch_size=2)
    assert slept == []
    with pytest.raises(ValueError):
        _trainer(ds, speed_factor=0)


def test_lion_and_errors(ds):
    pytest.importorskip("lion_pytorch")
    tr = _trainer(ds, optimizer="lion", lr=1e-4)
    before = flat_params(tr.model)
    res = tr.run(round=0, inner_steps=2, batch_size=2)
    assert res.steps_done == 2 and not torch.equal(before, flat_params(tr.model))
    with pytest.raises(ValueError, match="sgd"):
        _trainer(ds, optimizer="sgd")
    with pytest.raises(ValueError, match="context"):
        _trainer(ds, seq_len=256)
    with pytest.raises(ValueError, match="vocabulary"):
        InnerTrainer(build_model("tiny", vocab_size=100), ds, seq_len=SEQ)


def test_nonfinite_loss_raises():
    d = TokenDataset(torch.arange(2000) % 50, vocab_size=50)
    m = build_model("tiny", vocab_size=50)
    tr = InnerTrainer(m, d, device="cpu", seq_len=16, lr=1e-3, seed=0, peer_id="x")
    load_flat_(m, torch.full((num_params(m),), float("nan")))
    before = flat_params(m)
    with pytest.raises(FloatingPointError, match="non-finite"):
        tr.run(round=0, inner_steps=1, batch_size=2)
    assert torch.equal(before.isnan(), flat_params(m).isnan())


def test_one_stall_does_not_keep_a_peer_at_zero_steps(ds):
    """A stall (SIGSTOP, swap) inflated the per-row estimate; the next rounds' deadline check then skipped
    every step before it ran, so the estimate never came down (an adversarial review: 0/8 steps for 100
    rounds). The round's first step runs whenever the deadline is not past, and re-measures."""
    tr = _trainer(ds)
    tr.run(round=0, inner_steps=1, batch_size=4)
    normal = tr._row_time_ema
    tr._row_time_ema = 1e6  # as if the last step had been frozen for days
    res = tr.run(round=1, inner_steps=3, batch_size=4, deadline=swarm_time() + 3600)
    assert res.steps_done == 3
    assert tr._row_time_ema < 100 * normal + 1.0
    # a deadline already past still does nothing
    assert tr.run(round=2, inner_steps=3, batch_size=4, deadline=swarm_time() - 1).steps_done == 0


def test_a_cpu_round_returns_the_exchanges_freed_memory_before_its_first_step(ds, monkeypatch):
    """Session 41: the exchange, the outer step and the digest free their slices into glibc's heap, resident until a
    trim; the next round's steps ran beside them. Now the inner steps trim first, and once more when they end."""
    tr = _trainer(ds)
    events: list[str] = []
    monkeypatch.setattr(training, "release_freed_memory", lambda: events.append("trim"))
    real = tr.accumulate_fitting
    monkeypatch.setattr(tr, "accumulate_fitting", lambda *a, **k: (events.append("step"), real(*a, **k))[1])
    tr.run(round=0, inner_steps=2, batch_size=2)
    assert events == ["trim", "step", "step", "trim"]
