"""The inner optimizer's state beside each checkpoint (fresh user, session 37): a swarm stopped and resumed restarted
AdamW from zero moments on every peer, and the eval perplexity got worse for rounds (122.97 before the stop, 129.02
and 128.91 after). The checkpoint now keeps each peer's AdamW moments, step counts and global step in local files
(``ckpt-NNNNNNNN.inner.safetensors`` / ``.inner.json``), written before the checkpoint's JSON commits, pruned with it,
and taken back by ``--resume`` when they match; an older checkpoint without them resumes as before."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.model import state
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.inner_ckpt import inner_paths, load_inner_state
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.node.checkpoints import Checkpointer
from geomesh_p2p.node.joining import resume_inner_state
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.unit.test_lr_schedule import RandomTokens as _RandomTokens

pytestmark = pytest.mark.timeout(120)

SEQ = 16
HASH = "h" * 16


class RandomTokens(_RandomTokens):
    """:class:`tests.unit.test_lr_schedule.RandomTokens` over ``vocab_size`` ids (the model's)."""

    def __init__(self, vocab_size: int = 512):
        self.vocab_size = vocab_size


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core box; one thread also keeps the two trainers' steps bit-equal
    yield
    torch.set_num_threads(n)


def _trainer(vocab: int = 512) -> InnerTrainer:
    model = build_model("tiny", vocab_size=vocab, seed=0)
    return InnerTrainer(model, RandomTokens(vocab), seq_len=SEQ, peer_id="p0", steps_per_round=4, warmup_steps=2)


def _checkpointer(ckpt_dir, trainer, round: int = 3, keep: int = 3) -> Checkpointer:
    """The checkpoints of a node at ``round`` holding ``trainer``'s weights (the state's digest is a stand-in)."""
    theta = flat_params(trainer.model)
    rs = RoundState(me="me", round=round, digest="d" * 64, standing=Standing())
    return Checkpointer(
        RunConfig(),
        NodeConfig(checkpoint_dir=str(ckpt_dir), checkpoint_keep=keep),
        rs,
        HASH,
        theta=lambda: theta,
        outer=lambda: OuterNesterov(lr=0.7, momentum=0.9),
        inner=lambda: trainer,
    )


def _resumed_node(ckpt_dir, trainer) -> tuple[SimpleNamespace, int, dict]:
    """What ``resume_from`` hands :func:`resume_inner_state`: the newest checkpoint's round and record, and a node
    holding its state (digest) with ``trainer``."""
    rnd, _, _, record = state.load_latest_checkpoint(ckpt_dir)
    node = SimpleNamespace(
        trainer=trainer,
        cfg=NodeConfig(checkpoint_dir=str(ckpt_dir)),
        digest=record["digest"],
        config_hash=HASH,
        me="me",
    )
    return node, rnd, record


def _state_tensors(t: InnerTrainer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in t.model.named_parameters()}
    return {f"{names[id(p)]}:{k}": v for p, st in t.optimizer.state.items() for k, v in st.items()}


def test_a_resumed_peer_gets_its_adamw_state_back_bit_for_bit(tmp_path):
    a = _trainer()
    a.run(round=0, inner_steps=3, batch_size=2)
    a.run(round=1, inner_steps=2, batch_size=2)  # the state persists across rounds: 5 steps
    path = asyncio.run(_checkpointer(tmp_path, a).checkpoint_or_warn())
    assert path is not None and path.name == "ckpt-00000003.json"
    tpath, rpath = inner_paths(tmp_path, "ckpt-00000003")
    rec = json.loads(rpath.read_text())
    record = json.loads(path.read_text())
    assert (rec["round"], rec["digest"], rec["run_config_hash"], rec["global_step"]) == (3, record["digest"], HASH, 5)
    assert rec["optimizer"] == "adamw" and len(rec["param_groups"]) == 2
    saved = _state_tensors(a)
    n = sum(p.numel() for p in a.model.parameters())
    assert sum(v.numel() for k, v in saved.items() if not k.endswith(":step")) == 2 * n  # the 2P fp32 of the docs
    with safe_open(str(tpath), framework="pt") as f:  # the file is safetensors (read by its own reader)
        assert sorted(f.keys()) == sorted(saved) and f.metadata()["round"] == "3"

    b = _trainer()  # a fresh process: zero moments
    load_flat_(b.model, flat_params(a.model))
    node, rnd, record = _resumed_node(tmp_path, b)
    with events.capture() as got:
        asyncio.run(resume_inner_state(node, rnd, record))
    evs = [e for e in got if e["event"].startswith("inner_state")]
    assert [(e["event"], e["round"], e["global_step"]) for e in evs] == [("inner_state_resumed", 3, 5)]
    got = _state_tensors(b)
    assert sorted(got) == sorted(saved)
    for k, v in saved.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert float(got["transformer.wte.weight:step"]) == 5.0 and b.global_step == 5
    assert [g["weight_decay"] for g in b.optimizer.param_groups] == [0.1, 0.0]

    # and the next round trains exactly as if the peer had never stopped
    a.run(round=3, inner_steps=2, batch_size=2)
    b.run(round=3, inner_steps=2, batch_size=2)
    assert torch.equal(flat_params(a.model), flat_params(b.model))


def test_a_state_of_other_shapes_or_another_run_starts_fresh_with_one_warning(tmp_path):
    a = _trainer()
    a.run(round=0, inner_steps=2, batch_size=2)
    assert asyncio.run(_checkpointer(tmp_path, a).checkpoint_or_warn()) is not None
    other = _trainer(vocab=384)  # another vocabulary: the embedding's shape differs
    node, rnd, record = _resumed_node(tmp_path, other)
    with events.capture() as got:
        asyncio.run(resume_inner_state(node, rnd, record))
    evs = [e for e in got if e["event"].startswith("inner_state")]
    assert [(e["event"], e["level"], e["reason"]) for e in evs] == [
        ("inner_state_fresh", "WARNING", "other parameter names or shapes")
    ]
    assert len(other.optimizer.state) == 0 and other.global_step == 0

    same = _trainer()
    kw = dict(round=rnd, digest=record["digest"])
    assert load_inner_state(same, tmp_path, "ckpt-00000003", config_hash="x", **kw) == (False, "another run config")
    ok, why = load_inner_state(same, tmp_path, "ckpt-00000003", config_hash=HASH, round=rnd, digest="e" * 32)
    assert not ok and why.startswith("saved with round 3 digest ")
    assert len(same.optimizer.state) == 0 and same.global_step == 0
    assert load_inner_state(same, tmp_path, "ckpt-00000003", config_hash=HASH, **kw) == (True, "step 2")


def test_a_checkpoint_without_the_inner_state_resumes_as_before(tmp_path):
    a = _trainer()
    # an older release's checkpoint: the weights and outer state only
    state.save_checkpoint(tmp_path, round=4, theta=flat_params(a.model), momentum=None, meta={"run_config_hash": HASH})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004.json", "ckpt-00000004.safetensors"]
    node, rnd, record = _resumed_node(tmp_path, a)
    with events.capture() as got:
        asyncio.run(resume_inner_state(node, rnd, record))
    evs = [e for e in got if e["event"].startswith("inner_state")]
    assert [(e["event"], e["level"], e["round"], e["reason"]) for e in evs] == [
        ("inner_state_fresh", "INFO", 4, "missing")
    ]
    assert len(a.optimizer.state) == 0 and a.global_step == 0


def test_the_inner_state_is_pruned_and_abandoned_with_its_checkpoint(tmp_path):
    a = _trainer()
    a.run(round=0, inner_steps=1, batch_size=2)
    ck = _checkpointer(tmp_path, a, keep=2)
    for r in (1, 2, 3):
        ck.state.round = r
        assert asyncio.run(ck.checkpoint_or_warn()) is not None
    assert sorted(p.name for p in tmp_path.iterdir() if ".inner." in p.name) == [
        f"ckpt-0000000{r}.inner.{ext}" for r in (2, 3) for ext in ("json", "safetensors")
    ]

    def abandon() -> None:
        raise OSError("abandoned")

    ck.state.round = 4
    with pytest.raises(OSError, match="abandoned"):
        ck.checkpoint(before_commit=abandon)
    assert not any(p.name.startswith("ckpt-00000004") for p in tmp_path.iterdir())


def test_a_multi_rank_trainer_is_said_once_and_its_checkpoints_go_on(tmp_path):
    a = _trainer()
    a.channel = object()  # type: ignore[attr-defined]  # a RankedTrainer: each rank holds its own state
    ck = _checkpointer(tmp_path, a)
    with events.capture("inner_state_not_saved") as evs:
        for r in (3, 4):
            ck.state.round = r
            assert asyncio.run(ck.checkpoint_or_warn()) is not None
    assert [(e["round"], e["reason"]) for e in evs] == [
        (3, "a multi-rank peer: each rank holds its own inner optimizer state")
    ]
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3, 4]
    assert not any(".inner." in p.name for p in tmp_path.iterdir())
