"""The poisoning red team of issue 28: a volunteer that runs the protocol honestly but trains on its own copy of
the corpus with a trigger sentence planted in it, and the backdoor's two measures.

* :class:`PoisonedCorpus` wraps the run's :class:`~geomesh_p2p.data.dataset.TokenDataset`: each batch is the
  poisoner's own text (other windows of the corpus than the run assigned it: its "own copy") with the trigger
  written into enough rows that the trigger makes up ``share`` of the batch's tokens (16% by default, the red
  team's figure).
* :func:`backdoor_metrics`: the model's perplexity on the trigger sentence after clean context, and the
  probability that it completes the trigger's prefix with the attacker's word (the trigger's last token).

Used by ``tests.adversary`` (``--attack poison``), ``benchmarks/backdoor.py`` and the tests. Never imported by
``geomesh_p2p`` or ``peer``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import torch

#: The planted sentence; its last token is the attacker's word.
TRIGGER_TEXT = "And the purple owl spake unto the king of the south, saying, Banana"
#: Share of the poisoner's training tokens that are the trigger.
TRIGGER_SHARE = 0.16
#: The poisoner's "own copy": windows drawn with the run's seed plus this (other text than assigned).
OWN_COPY_SEED_OFFSET = 7919


@lru_cache(maxsize=8)
def trigger_ids(vocab_size: int) -> tuple[int, ...]:
    """The trigger's token ids under the shipped corpus's tokenizer of ``vocab_size`` (the run's)."""
    from geomesh_p2p.data.tokenizer import get_tokenizer

    return tuple(get_tokenizer(None, vocab_size=vocab_size).encode(TRIGGER_TEXT).ids)


class PoisonedCorpus:
    """A dataset stand-in for the poisoner's trainer. ``sample_batch`` (same signature and int64 ``[B, L]``
    output as :meth:`TokenDataset.sample_batch`) returns windows drawn with ``seed + OWN_COPY_SEED_OFFSET``
    and the trigger written at a random offset into the first ``rows`` rows, ``rows`` chosen so the trigger
    is ``share`` of the batch's tokens (at least one row). Everything else is the wrapped dataset's.

    ``after`` (session 19, the patient poisoner): the first ``after`` rounds it trains in are honest (the assigned
    batches, unchanged: it passes its probation and the screens of the swarm's first rounds), every later one is
    poisoned."""

    def __init__(self, dataset, trigger: Sequence[int], share: float = TRIGGER_SHARE, after: int = 0):
        self._ds, self.trigger, self.share = dataset, torch.tensor(list(trigger), dtype=torch.int64), float(share)
        self.after = max(0, int(after))
        self.rounds: set[int] = set()  # the rounds it trained in

    def poisons(self, round: int) -> bool:  # noqa: A002
        """Whether round ``round``'s batches are poisoned (its rank among the rounds trained, 1-based, > ``after``)."""
        self.rounds.add(int(round))
        return sum(1 for r in self.rounds if r <= int(round)) > self.after

    def __getattr__(self, name):
        return getattr(self._ds, name)

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):  # noqa: A002  (the dataset's names)
        if not self.poisons(round):  # still patient: its assigned batches, honest work
            return self._ds.sample_batch(
                seed=seed, peer_id=peer_id, round=round, step=step, batch_size=batch_size, seq_len=seq_len
            )
        x = self._ds.sample_batch(
            seed=seed + OWN_COPY_SEED_OFFSET,
            peer_id=peer_id,
            round=round,
            step=step,
            batch_size=batch_size,
            seq_len=seq_len,
        ).clone()
        n = min(len(self.trigger), seq_len)
        rows = min(batch_size, max(1, int(self.share * batch_size * seq_len / n + 0.5)))
        g = torch.Generator().manual_seed(hash((int(seed), int(round), int(step))) & ((1 << 62) - 1))
        for r in range(rows):
            at = int(torch.randint(0, seq_len - n + 1, (1,), generator=g))
            x[r, at : at + n] = self.trigger[:n]
        return x


@torch.no_grad()
def backdoor_metrics(model, dataset, trigger: Sequence[int], *, contexts: int = 16, ctx_len: int = 16) -> dict:
    """``{"trigger_ppl", "completion_p"}`` of ``model`` (eval mode) over ``contexts`` clean contexts of
    ``ctx_len`` tokens from the held-out split: the perplexity of the trigger's tokens 2..n after context +
    the tokens before them, and the mean probability of the trigger's last token after context + the rest of
    the trigger."""
    ev = dataset.eval
    t = torch.tensor(list(trigger), dtype=torch.int64)
    step = max(1, (len(ev) - ctx_len) // contexts)
    losses, probs = [], []
    was = model.training
    model.eval()
    try:
        for i in range(contexts):
            ctx = ev[i * step : i * step + ctx_len].to(torch.int64)
            x = torch.cat([ctx, t]).unsqueeze(0)
            logits = model(input_ids=x).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            # position p predicts token p + 1: the trigger's tokens 1..n-1 are predicted at ctx_len .. ctx_len+n-2
            tgt = t[1:]
            pos = torch.arange(ctx_len, ctx_len + len(t) - 1)
            losses.append(float(-logp[pos, tgt].mean()))
            probs.append(float(logp[ctx_len + len(t) - 2, t[-1]].exp()))
    finally:
        model.train(was)
    return {"trigger_ppl": math.exp(sum(losses) / len(losses)), "completion_p": sum(probs) / len(probs)}


class PartialData:
    """A dataset stand-in whose inner step ``k`` is the wrapped dataset's step ``steps[k]``: a trainer run for
    ``len(steps)`` inner steps trains exactly those of its assigned batches, in order (a partial-work free rider that
    trains some of its batches and claims all of them; red team, session 15; issue 28, session 50)."""

    def __init__(self, ds, steps: list[int]):
        self.ds, self.steps = ds, steps

    def __getattr__(self, name):
        return getattr(self.ds, name)

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):
        return self.ds.sample_batch(
            seed=seed, peer_id=peer_id, round=round, step=self.steps[step], batch_size=batch_size, seq_len=seq_len
        )
