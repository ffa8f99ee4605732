"""Issue 27 (session 42): a check's gradient pass hands the heap's freed gradients back as it goes
(``verify_check._PickedGrads``, every ``TRIM_EVERY_BYTES`` of dropped CPU gradients), with the same bits."""

from __future__ import annotations

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model, flat_params
from geomesh_p2p.trust import verify_check

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

SEQ = 32


def test_a_check_pass_trims_every_threshold_of_dropped_gradients_with_the_same_bits(monkeypatch):
    ds = load_dataset(None, SEQ)
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    theta = flat_params(model).clone()
    grad_bytes = 4 * theta.numel()  # one pass drops every parameter's fp32 gradient once (tied ones once)
    n_params = len(list(model.parameters()))
    index = torch.cat([torch.arange(0, theta.numel(), 97), torch.tensor([theta.numel() - 1])])
    streams = [("p0", 0), ("p1", 3), ("p0", 2)]
    args = dict(seed=0, round=1, batch_size=2, seq_len=SEQ, index=index)
    trims: list[int] = []
    monkeypatch.setattr(verify_check, "release_freed_memory", lambda: trims.append(1) or True)

    def run(every: int) -> torch.Tensor:
        monkeypatch.setattr(verify_check, "TRIM_EVERY_BYTES", every)
        trims.clear()
        return verify_check.batch_gradients(model, ds, theta, streams, **args)

    want = run(grad_bytes + 4)  # never reached within a pass: no trim
    assert trims == []
    assert torch.equal(run(grad_bytes), want) and len(trims) == len(streams)  # once a pass, at its last gradient
    assert torch.equal(run(1), want) and len(trims) == len(streams) * n_params  # after every gradient
    assert want.shape == (len(streams), index.numel()) and bool(want.abs().sum() > 0)
