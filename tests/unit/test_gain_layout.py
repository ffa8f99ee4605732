"""Session 42 (helper poison42): the loss-gain test's row losses take the cross-entropy over ``[rows x cols,
vocab]`` (the vocabulary contiguous), not over the transposed ``[rows, vocab, cols]`` logits: a third less per
tiny-preset pass, the same losses to float rounding (checked against fp64)."""

from __future__ import annotations

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.model.build import build_model
from geomesh_p2p.trust import gain as G

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

SEQ = 32


def test_row_losses_over_the_contiguous_vocabulary_match_fp64(monkeypatch):
    ds = load_dataset(None, SEQ)
    model = build_model("tiny", vocab_size=ds.vocab_size, seed=0)
    streams = [("A", 0), ("A", 1), ("B", 4)]
    kw = dict(seed=0, round=2, batch_size=3, seq_len=SEQ)
    shapes = []
    real = torch.nn.functional.cross_entropy

    def spy(logits, target, **k):
        shapes.append(tuple(logits.shape))
        return real(logits, target, **k)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", spy)
    got = G.row_losses(model, ds, streams, **kw)
    monkeypatch.undo()
    vocab = model.config.vocab_size
    assert shapes == [(3 * (SEQ - 1), vocab)] * len(streams)  # the vocabulary last and contiguous
    assert model.training  # row_losses puts the model back as it found it
    with torch.no_grad():
        model.eval()
        for (peer, step), rows in zip(streams, got):
            x = ds.sample_batch(seed=0, peer_id=peer, round=2, step=step, batch_size=3, seq_len=SEQ)
            logits = model(input_ids=x).logits[:, :-1].double()
            want = real(logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="none").view(3, -1).mean(dim=1)
            assert len(rows) == 3 and max(abs(a - b) for a, b in zip(rows, want.tolist())) < 1e-5
