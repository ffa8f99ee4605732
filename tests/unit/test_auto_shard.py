"""Issue 30, "FSDP when the model does not fit": a multi-rank peer whose whole copy of the training state does
not fit a rank's budget trains sharded (FSDP2) by itself, its start-up profile counts the shard, and a budget
that not even the shard fits is refused at start (exit 2). The decision (``choose_sharding``) at exact byte
thresholds, the profile's ``state_bytes``, and the node's start path with a stand-in for the ranks (the
processes themselves: tests/e2e/test_multi_rank_procs.py)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.model.memory import MemoryEstimate
from geomesh_p2p.model.profile import TrainingProfile, _held_bytes, profile_training, stateless_optimizer
from geomesh_p2p.model.device import MeasureSession
from geomesh_p2p.model.run_memory import ShardChoice, choose_sharding
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node import training
from geomesh_p2p.node.peer import PeerNode
from geomesh_p2p.util.errors import StartInputError
from peer.node_cli import start_error_status
from tests.unit.test_capability import FakeMemory

pytestmark = pytest.mark.timeout(120)

GIB, MIB = 2**30, 2**20

# A rank: 1,000 bytes in use, parameters of 400 bytes, 100 bytes of the rest of the run, 2 ranks, AdamW:
# a whole copy counts 400 gradients + 800 moments = 1,200 (needs 2,300); a shard (400 + 400 + 800) / 2 = 800
# (needs 1,900).
IN_USE, PARAMS, EXTRA = 1000, 400, 100


def _choose(budget: int, ranks: int = 2, **kw) -> ShardChoice:
    return choose_sharding(IN_USE, PARAMS, budget, ranks, extra_bytes=EXTRA, **kw)


def test_whole_copy_when_it_fits_sharded_when_only_that_fits_else_an_error():
    ddp = _choose(2301)
    assert (ddp.shard, ddp.auto, ddp.whole_bytes, ddp.sharded_bytes, ddp.state_bytes) == (
        False,
        False,
        2300,
        1900,
        1200,
    )
    # a need equal to the budget does not fit (the profile refuses a static part that reaches its budget)
    for budget in (2300, 1901):
        fsdp = _choose(budget)
        assert (fsdp.shard, fsdp.auto, fsdp.state_bytes, fsdp.budget_bytes) == (True, True, 800, budget)
    assert fsdp.describe() == (
        "a whole copy needs 0.000 GiB per rank (2,300 bytes), a rank's budget is 0.000 GiB (1,901 bytes): "
        "training sharded over 2 ranks (FSDP2), 0.000 GiB per rank (1,900 bytes) before activations"
    )
    with pytest.raises(ValueError) as e:
        _choose(1900)
    assert str(e.value) == (
        "a rank's memory budget of 0.000 GiB (1,900 bytes) cannot hold training this model before any activation, "
        "not even sharded: sharded over 2 ranks it needs 1,900 (1,000 in use + 800 its shard of the parameters, "
        "gradients and optimizer state + 100 the rest of the run's static memory); a whole copy needs 2,300 "
        "(1,000 in use + 1,200 gradients and optimizer state + 100 the rest of the run's static memory)"
    )


def test_shard_flag_counts_the_shard_and_one_rank_never_shards():
    manual = _choose(1901, shard=True)
    assert (manual.shard, manual.auto, manual.state_bytes) == (True, False, 800)
    assert _choose(10**6, shard=True).shard  # --shard shards even where a whole copy fits
    with pytest.raises(ValueError, match=r"not even sharded: sharded over 2 ranks it needs 1,900 \(") as e:
        _choose(1900, shard=True)
    assert "a whole copy" not in str(e.value)  # not asked for
    # 3 ranks, Lion (one moment): the shard is (400 + 400 + 400) / 3 = 400; uneven sizes round up
    lion = _choose(1601, ranks=3, optimizer_bytes=PARAMS)
    assert (lion.shard, lion.auto, lion.whole_state_bytes, lion.sharded_state_bytes) == (True, True, 800, 400)
    assert choose_sharding(0, 401, 10**6, 3).sharded_state_bytes == 535  # ceil(1604 / 3)
    # the ddp baseline: no inner optimizer state
    assert _choose(10**6, optimizer_bytes=0).whole_state_bytes == 400
    # one rank: a whole copy or nothing, never sharded, whatever would fit sharded
    assert not _choose(2301, ranks=1).shard
    with pytest.raises(ValueError, match=r"cannot hold training this model before any activation: a whole copy"):
        _choose(2300, ranks=1)
    with pytest.raises(ValueError, match="sharding needs >= 2 ranks, this peer has 1"):
        _choose(10**6, ranks=1, shard=True)
    for bad in (dict(budget=0), dict(budget=10, ranks=0), dict(budget=10, optimizer_bytes=-1)):
        budget = bad.pop("budget")
        with pytest.raises(ValueError, match="need ranks >= 1"):
            _choose(budget, **bad)


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    )


def test_profile_counts_the_state_bytes_it_is_given(one_thread):
    m = _model()
    p = 4 * m.num_parameters()
    fake = FakeMemory(m, base=GIB, per_seq=10 * MIB)  # its steps allocate a whole copy's gradients + AdamW
    shard = 2 * p  # 2 ranks: half of weights, gradients and AdamW's two moments
    budget = GIB + shard + 4 * fake.per_seq + 1
    prof = profile_training(
        m,
        64,
        "cpu",
        budget,
        vocab_size=256,
        batch_sizes=[1, 2],
        steps=1,
        memory_probe=fake,
        extra_bytes=0,
        state_bytes=shard,
    )
    # the static part counts the shard, not a whole copy's 3P; the measured gradients and moments are not
    # charged to the sequences
    assert prof.memory.static_bytes == GIB + shard and prof.memory.per_sequence_bytes == 10 * MIB
    assert prof.max_batch == 4
    with pytest.raises(ValueError, match="before any activation"):
        profile_training(m, 64, "cpu", GIB + shard, vocab_size=256, memory_probe=fake, extra_bytes=0, state_bytes=shard)
    with pytest.raises(ValueError, match="state_bytes=-1"):
        profile_training(m, 64, "cpu", budget, vocab_size=256, memory_probe=fake, state_bytes=-1)


def test_a_stateless_measuring_step_holds_the_gradients_only(one_thread):
    m = _model()
    before = [q.detach().clone() for q in m.parameters()]
    x = torch.randint(0, 256, (2, 16))
    with MeasureSession(m, torch.device("cpu"), stateless_optimizer) as sess:
        sess.step(x)
        assert _held_bytes(sess) == 4 * m.num_parameters()  # gradients, no optimizer state
    with MeasureSession(m, torch.device("cpu"), None) as sess:  # the default lr=0 AdamW: gradients + 2 moments
        sess.step(x)
        assert _held_bytes(sess) == 3 * 4 * m.num_parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # lr=0: weights untouched


class _FakeTransport:
    config = types.SimpleNamespace(max_message_bytes=1 << 30)

    def set_payload_limit(self, method, n):
        pass


def _start(monkeypatch, per_rank: int, shard: bool = False, in_use: int = 300 * MIB) -> tuple[PeerNode, dict]:
    """The node's training build of a 2-rank CPU peer with ``per_rank`` bytes per rank (its budget is twice that):
    the memory in use, the profile and the ranked trainer are stand-ins that record what they were given."""
    seen: dict = {}

    def profile(model, seq_len, device, memory_bytes, **kw):
        seen["profile"] = dict(kw, memory_bytes=memory_bytes)
        return TrainingProfile({1: 100.0}, 1, MemoryEstimate(0, 1, 1), memory_bytes, {1: 1}, [], 0.1)

    class Ranked:
        def __init__(self, model, dataset, *, channel, shard, **kw):
            seen["trainer_shard"] = shard

    monkeypatch.setattr(training, "memory_in_use", lambda device: in_use)
    monkeypatch.setattr(training, "profile_training", profile)
    monkeypatch.setattr(training, "RankedTrainer", Ranked)
    node = PeerNode(
        RunConfig(seq_len=32, method="diloco"),
        NodeConfig(device="auto", memory_budget_bytes=2 * per_rank, shard=shard),
        identity=Identity.generate(),
    )
    node.transport = _FakeTransport()
    node.state_server = types.SimpleNamespace(serve=lambda gs: None)
    node.rank_channel = types.SimpleNamespace(world=2, device=torch.device("cpu"), rank_memory_bytes=None)
    node.rank_device_share = 2
    node._build_training()
    return node, seen


def _needs(node: PeerNode, in_use: int = 300 * MIB) -> tuple[int, int, int]:
    """(whole copy, sharded, the rest of the run) bytes per rank of ``node``'s model, fp32 AdamW, 2 ranks."""
    p = 4 * node.numel
    extra = training.run_memory(node.run_cfg, node.cfg, node.numel).profile_extra("cpu")
    return in_use + 3 * p + extra, in_use + 2 * p + extra, extra


def test_the_start_path_shards_by_itself_and_the_profile_counts_the_shard(monkeypatch, caplog, one_thread):
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer")
    node, seen = _start(monkeypatch, 2 * GIB)  # fits a whole copy: DDP, the profile counts 3P
    whole, sharded, extra = _needs(node)
    assert seen["trainer_shard"] is False and seen["profile"]["optimizer_factory"] is None
    assert seen["profile"]["state_bytes"] == 3 * 4 * node.numel and seen["profile"]["extra_bytes"] == extra
    assert "training sharded" not in caplog.text
    node, seen = _start(monkeypatch, whole)  # a whole copy needs exactly the budget: sharded, by itself
    assert seen["trainer_shard"] is True and seen["profile"]["memory_bytes"] == whole
    assert seen["profile"]["state_bytes"] == 2 * 4 * node.numel
    assert seen["profile"]["optimizer_factory"] is stateless_optimizer
    lines = [r.getMessage() for r in caplog.records if "training sharded" in r.getMessage()]
    assert lines == [
        f"a whole copy needs {whole / GIB:.3f} GiB per rank ({whole:,} bytes), a rank's budget is {whole / GIB:.3f} "
        f"GiB ({whole:,} bytes): training sharded over 2 ranks (FSDP2), {sharded / GIB:.3f} GiB per rank "
        f"({sharded:,} bytes) before activations"
    ]
    caplog.clear()
    node, seen = _start(monkeypatch, 2 * GIB, shard=True)  # --shard: sharded, counted so, no line
    assert seen["trainer_shard"] is True and seen["profile"]["state_bytes"] == 2 * 4 * node.numel
    assert "training sharded" not in caplog.text


def test_the_start_path_refuses_a_budget_not_even_the_shard_fits(monkeypatch):
    node, _ = _start(monkeypatch, 2 * GIB)
    _, sharded, _ = _needs(node)
    with pytest.raises(StartInputError) as e:
        _start(monkeypatch, sharded)
    msg = str(e.value)
    assert msg.startswith(f"cannot train tiny on 2 ranks here: a rank's memory budget of {sharded / GIB:.3f} GiB")
    assert f"sharded over 2 ranks it needs {sharded:,} ({300 * MIB:,} in use" in msg
    assert f"--memory-budget-gb {2 * sharded / GIB:.3g} is divided by the ranks sharing a device" in msg
    assert start_error_status(e.value) == 2  # a bad flag value: exit 2, as argparse's
