"""Red team (session 40) on FlatGradBuffer's hooks (post-accumulate marks, the optimizer's step pre-hook): the clip
before the step, an optimizer other than the first, and a trainer dropped while its hooks stay on the parameters."""

from __future__ import annotations

import copy
import gc
import types
import weakref

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model
from geomesh_p2p.model.grad_buffer import FlatGradBuffer
from geomesh_p2p.model.training import InnerTrainer
from geomesh_p2p.trust.check_model import hollow_copy
from tests.unit.test_redteam_mem39 import _Branchy

# one intra-op thread (conftest's one_thread): spin-waiting OpenMP threads under make test's load made this
# file's CPU steps many times slower (CI: 59 s / 36 s for its slowest test); the assertions compare bits of runs in
# the same process, so they hold at any thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

SEQ = 16


class _Skippy(torch.nn.Module):
    """A language model whose ``skip`` layer takes part only while ``use_skip``: a parameter (second and third in
    order, so the clip's list of norms shifts) that gets no gradient in later steps."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab)
        self.use_skip = True
        self.emb = torch.nn.Embedding(vocab, 16)
        self.skip = torch.nn.Linear(16, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(12))
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        h = self.emb(input_ids)
        if self.use_skip:
            h = self.skip(h)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = self.head(h)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss)


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_the_clip_sees_no_gradient_where_the_step_did_not_reach_a_parameter(micro_batch):
    """The clip runs before the step's pre-hook: it saw the unreached parameter's zeroed view, its norm (0.0)
    inserted into the list of per-tensor norms, whose sum then adds in another order: the total norm, the clip's
    factor and so the weights differed in their last bits from training without the buffer."""
    ds = load_dataset(None, SEQ)
    torch.manual_seed(0)
    base = _Skippy(ds.vocab_size)
    out = []
    for flat in (True, False):
        t = InnerTrainer(copy.deepcopy(base), ds, seq_len=SEQ, lr=1e-2, weight_decay=0.1, grad_clip=1e-3)
        t.grads.enabled = t.grads.enabled and flat
        t.run(round=0, inner_steps=2, batch_size=4, micro_batch=micro_batch)
        t.model.use_skip = False
        for r in (1, 2):
            t.run(round=r, inner_steps=3, batch_size=4, micro_batch=micro_batch)
        assert t.grads.enabled == flat and t.grads.allocations == (1 if flat else 0)
        out.append(torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]))
    assert torch.equal(out[0], out[1])


def _train_rebuilt(flat: bool) -> tuple[torch.Tensor, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = _Branchy()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)]
    buf = FlatGradBuffer(list(m.parameters()), enabled=flat)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for k, use_b in enumerate((True, True, True, False, False)):
        if k == 3:  # the optimizer rebuilt from a checkpoint of its state (a resume)
            opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
            opts[-1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
        buf.zero(opts[-1])
        m(x, use_b).backward()
        opts[-1].step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]), opts


def test_an_optimizer_other_than_the_first_gets_the_step_pre_hook():
    """The pre-hook was registered once, on the first optimizer :meth:`FlatGradBuffer.zero` saw: a rebuilt one
    stepped ``b``'s zeroed view (AdamW's decay and moments) where training without the buffer skips it; the old
    optimizer kept a hook into the buffer."""
    got, opts = _train_rebuilt(True)
    want, _ = _train_rebuilt(False)
    assert torch.equal(got, want)
    assert not opts[0]._optimizer_step_pre_hooks and len(opts[1]._optimizer_step_pre_hooks) == 1


def test_a_dropped_trainer_frees_its_model_and_gradient_buffer():
    """A parameter's post-accumulate hooks are not seen by Python's cycle collector: the hooks held the buffer, the
    buffer the parameters, so a dropped trainer's parameters ([P] of weights) and its buffer ([P]) were never freed
    (every deep-copied model a simulation or benchmark trained and let go); a model given to a second trainer kept
    the first one's hooks and buffer too."""
    ds = load_dataset(None, SEQ)
    base = build_model("tiny", vocab_size=ds.vocab_size, seed=0)

    def trained(model: torch.nn.Module) -> InnerTrainer:
        t = InnerTrainer(model, ds, seq_len=SEQ, lr=1e-3, total_steps=50)
        for r in range(2):
            t.run(round=r, inner_steps=2, batch_size=2)
        return t

    t = trained(copy.deepcopy(base))
    assert t.grads._buf is not None and all(len(p._post_accumulate_grad_hooks) == 1 for p in t.model.parameters())
    held = [weakref.ref(x) for x in (t.grads, t.grads._buf, next(t.model.parameters()))]
    del t
    gc.collect()
    assert [w() for w in held] == [None] * 3

    model = copy.deepcopy(base)
    t = trained(model)
    held = [weakref.ref(t.grads), weakref.ref(t.grads._buf)]
    del t
    gc.collect()
    assert [w() for w in held] == [None, None]
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    t = trained(model)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
    # copies never carry the hooks (verified work's hollow copy, the evaluation snapshot's deepcopy)
    for c in (copy.deepcopy(model), hollow_copy(model)):
        assert all(not p._post_accumulate_grad_hooks for p in c.parameters())
    # a checkpoint's optimizer state loaded into the trainer's optimizer keeps its pre-hook
    t.load_state_dict(copy.deepcopy(t.state_dict()))
    assert len(t.optimizer._optimizer_step_pre_hooks) == 1
