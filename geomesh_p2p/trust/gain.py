"""Loss gain on assigned data: did a contribution train on the batches the run assigned to its sender? (issue 28)

Every contributor's batches are a pure function of the run's seed, the round, its PeerID and the step
(:func:`geomesh_p2p.data.dataset.batch_seed`), so a checker can rebuild them. A pseudo-gradient ``d`` trained on
them lowers the loss on those exact batches more than on text it never saw (memorisation at one pass), while a
contribution trained on other text (a free rider copying a peer, a poisoner training on its own copy of the
corpus) lowers both alike. The statistic, after Templar's Gauntlet (which scores a peer by the loss change its
update causes on the peer's assigned data against random data):

    gain(b)  = loss(theta, b) - loss(theta - d, b)          per batch b, nats per token
    excess   = mean gain over k assigned batches - mean gain over m control batches
    t        = Welch's t of that difference over the batches' rows (each row a window of its own: the rows'
               spread is the unit, so no threshold is in nats)

and, batch by batch (session 50, partial work: :mod:`geomesh_p2p.trust.gain_batches`), ``low``: the same t over the
lower half (by mean gain) of the drawn batches with at least 4 steps after them in the claim, so that one strongly
trained batch among the drawn cannot carry the test for the others.

``theta`` is the round's start weights, ``d`` the contribution decoded from its sign packets (what the owners
received), restricted to the checked parts when the check covers only some. Each batch's loss is taken at both
weights, so the batch-to-batch spread of the loss itself cancels in every gain.

Measured (``benchmarks/verify_gain.py``, tiny preset, 4 peers with persistent inner AdamW, k = m = 8): honest
excess 0.039-0.075 nats at H = 5, 0.097-0.147 at H = 20, 0.108-0.184 at H = 40; wrong data -0.019..+0.050,
a poisoner's own corpus copy -0.029..+0.043, stale -0.145..+0.024 (docs/security.md, "Loss gain on assigned
data").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from geomesh_p2p.trust.check_model import Piece, is_hollow, load_for_check, sub_flat_, subtracted

__all__ = [
    "GainStats",
    "lower_t",
    "settled_low",
    "row_losses",
    "gain_rows",
    "cached_gain_rows",
    "gain_of",
    "gain_stats",
    "welch_t",
]


@dataclass(frozen=True)
class GainStats:
    """``assigned`` / ``control``: mean loss gain (nats per token) of the contribution on the sender's assigned
    batches / on control batches; ``t``: Welch's t of ``assigned - control`` (0.0 when both spreads are 0);
    ``k`` / ``m``: batches on each side; ``steps``: the inner steps the contribution holds (its task's
    ``steps_done``; 0: not known), what :func:`~geomesh_p2p.trust.verify_check.gain_decides` compares t's at;
    ``passes``: forward passes this measurement ran (fewer with a warm cache: not part of the statistic, so two
    measurements of the same rows compare equal whatever they cost)."""

    assigned: float
    control: float
    t: float
    k: int
    m: int
    steps: int = 0
    passes: int = field(default=0, compare=False)
    #: the per-batch statistic (:func:`lower_t`): Welch's t of the rows of the drawn batches of lowest mean gain (the
    #: lower half) against the controls'; None: not measured (a hand-made or older value), never decides
    low: Optional[float] = None

    @property
    def excess(self) -> float:
        """``assigned - control``, nats per token."""
        return self.assigned - self.control


def welch_t(a: Sequence[float], b: Sequence[float]) -> float:
    """Welch's t statistic of ``mean(a) - mean(b)`` (float64; unbiased variances). 0.0 when the standard
    error is 0; +-inf never (a zero error with a non-zero difference also gives 0.0: nothing to weigh).

    Raises:
        ValueError: fewer than 2 values on either side.
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"welch_t needs >= 2 values a side, got {len(a)} and {len(b)}")
    ta, tb = torch.tensor(list(a), dtype=torch.float64), torch.tensor(list(b), dtype=torch.float64)
    se = math.sqrt(float(ta.var()) / len(a) + float(tb.var()) / len(b))
    return float(ta.mean() - tb.mean()) / se if se > 0 else 0.0


@torch.no_grad()
def row_losses(
    model,
    dataset,
    streams: Sequence[tuple[str, int]],
    *,
    seed: int,
    round: int,
    batch_size: int,
    seq_len: int,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
) -> list[list[float]]:
    """Per batch, per row: the mean next-token loss (nats) of ``model`` as loaded, in eval mode, on each
    ``(peer_id, step)`` batch ``dataset.sample_batch(seed, peer_id, round, step, batch_size, seq_len)`` (int64
    ``[batch_size, seq_len]``; row r's ``seq_len - 1`` predictions). ``pace()`` is called between two batches.

    Raises:
        TimeoutError: ``deadline`` (unix seconds) passed between two batches.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout: the same weights give the same loss on both sides of a gain
    try:
        out = []
        for i, (peer, step) in enumerate(streams):
            if pace is not None and i > 0:
                pace()
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"past the deadline after {i} of {len(streams)} batches")
            x = dataset.sample_batch(
                seed=seed, peer_id=peer, round=round, step=step, batch_size=batch_size, seq_len=seq_len
            ).to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            rows, cols, vocab = logits.shape
            # over [rows x cols, vocab], the vocabulary contiguous: a third of a tiny-preset pass less than over the
            # transposed [rows, vocab, cols] (session 42: a screen is ~80 of these passes; the same losses to ~2e-6
            # nats, as far from fp64 as before)
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(rows * cols, vocab), x[:, 1:].reshape(-1), reduction="none"
            ).view(rows, cols)
            out.append([float(v) for v in nll.mean(dim=1).cpu()])
        return out
    finally:
        model.train(was_training)


def gain_rows(
    model,
    dataset,
    theta: torch.Tensor,
    contribution: Union[torch.Tensor, Iterable[Piece]],
    assigned: Sequence[tuple[str, int]],
    controls: Sequence[tuple[str, int]],
    *,
    seed: int,
    round: int,
    batch_size: int,
    seq_len: int,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
    cache: Optional[dict] = None,
) -> tuple[list[list[float]], int]:
    """Per batch (``assigned`` then ``controls``, in order), per row: the loss gain of the module docstring, nats;
    and the forward passes run. Arguments as for :func:`gain_stats`, but either side may be empty (a stage of a
    test measured in parts: :mod:`geomesh_p2p.trust.gain_stages`). ``cache`` keeps each control batch's losses
    at ``theta`` under its own key, so any subset of a round's controls is reused.

    Raises:
        ValueError: no stream at all, or a vector of the wrong size.
        TimeoutError: ``deadline`` passed.
    """
    streams = list(assigned) + list(controls)
    if not streams:
        raise ValueError("a gain needs at least one batch")
    kw: dict[str, Any] = dict(
        seed=seed, round=round, batch_size=batch_size, seq_len=seq_len, deadline=deadline, pace=pace
    )
    if isinstance(contribution, torch.Tensor):
        if contribution.numel() != theta.numel():
            raise ValueError(f"the contribution has {contribution.numel()} elements, theta {theta.numel()}")
        pieces: Iterable[Piece] = [(0, contribution)]
    else:
        pieces = contribution
    load_for_check(model, theta)
    keys = [("control", c, int(batch_size), int(seq_len), int(seed), int(round)) for c in controls]
    known = [cache.get(key) if cache is not None else None for key in keys]
    todo = list(assigned) + [c for c, got in zip(controls, known) if got is None]
    fresh = iter(row_losses(model, dataset, todo, **kw))
    before = [next(fresh) for _ in assigned]
    for key, got in zip(keys, known):
        if got is None:
            got = next(fresh)
            if cache is not None:
                cache[key] = list(got)
        before.append(list(got))
    if is_hollow(model):
        with subtracted(model, pieces):
            after = row_losses(model, dataset, streams, **kw)
    else:
        sub_flat_(model, pieces)
        after = row_losses(model, dataset, streams, **kw)
    # Each row is its own window of the corpus: one sample of the gain (a batch's rows were trained on
    # together, but each is memorised on its own); a row-level t has B times the samples of a batch-level one.
    return [[b - a for b, a in zip(rb, ra)] for rb, ra in zip(before, after)], len(todo) + len(streams)


def lower_t(assigned: Sequence[Sequence[float]], controls: Sequence[Sequence[float]], share: float = 0.5) -> float:
    """The per-batch statistic (partial work, issue 28): sort the ``assigned`` batches by their mean row gain, keep the
    ``ceil(share x k)`` lowest (at least 2; ties in the order given), and take Welch's t of their rows against every
    control row (nats per token; float64, :func:`welch_t`). An honest contribution trained on every drawn batch shows
    an excess on each, so its lower half too; one that trained only a share of its batches and claimed all shows
    its whole excess on the few it trained, and its lower half is untrained text (t ~ -1: the lowest of a null
    sample). Raises ValueError with fewer than 2 batches a side."""
    if len(assigned) < 2 or len(controls) < 2:
        raise ValueError(f"a gain needs >= 2 batches a side, got {len(assigned)} assigned, {len(controls)} control")
    means = [sum(b) / len(b) for b in assigned]
    order = sorted(range(len(assigned)), key=lambda j: (means[j], j))
    keep = order[: max(2, math.ceil(share * len(assigned) - 1e-9))]
    return welch_t([g for j in keep for g in assigned[j]], [g for batch in controls for g in batch])


def settled_low(
    assigned: Sequence[Sequence[float]],
    controls: Sequence[Sequence[float]],
    at: Sequence[int],
    steps: int,
    settle: int,
    share: float,
) -> Optional[float]:
    """:func:`lower_t` over the ``assigned`` batches whose step (``at``, 0-based, one per batch) has at least
    ``settle`` steps after it in a contribution of ``steps``: ``at[i] < steps - settle``. Why: AdamW applies a batch's
    gradient through its first moment (beta1 0.9), 1 - 0.9^n of it after n steps, so an honest contribution's last
    steps are barely in it (tiny preset, ``benchmarks/verify_gain.py``: the last step's batch measured z -0.7..+0.4
    against controls, the others 1-12). None with fewer than 2 such batches or ``steps`` unknown (0)."""
    if steps <= 0 or len(at) != len(assigned):
        return None
    kept = [b for b, j in zip(assigned, at) if int(j) < steps - settle]
    return lower_t(kept, controls, share) if len(kept) >= 2 and len(controls) >= 2 else None


def gain_of(
    assigned: Sequence[Sequence[float]],
    controls: Sequence[Sequence[float]],
    *,
    steps: int = 0,
    passes: int = 0,
    at: Optional[Sequence[int]] = None,
    settle: int = 4,
    share: float = 0.5,
) -> GainStats:
    """The statistic of the module docstring over per-batch row gains (:func:`gain_rows`): the rows of every
    ``assigned`` batch against those of every control batch, in the order given (the same rows in the same order
    give the same bits); with ``at`` (the assigned batches' steps) and ``steps`` (the contribution's), also the
    per-batch statistic ``low`` (:func:`settled_low` with ``settle`` and ``share``; else None). Raises ValueError with
    fewer than 2 batches a side."""
    if len(assigned) < 2 or len(controls) < 2:
        raise ValueError(f"a gain needs >= 2 batches a side, got {len(assigned)} assigned, {len(controls)} control")
    ga = [g for batch in assigned for g in batch]
    gc = [g for batch in controls for g in batch]
    low = None if at is None else settled_low(assigned, controls, at, steps, settle, share)
    return GainStats(
        assigned=sum(ga) / len(ga),
        control=sum(gc) / len(gc),
        t=welch_t(ga, gc),
        k=len(assigned),
        m=len(controls),
        steps=int(steps),
        passes=int(passes),
        low=low,
    )


def gain_stats(
    model,
    dataset,
    theta: torch.Tensor,
    contribution: Union[torch.Tensor, Iterable[Piece]],
    assigned: Sequence[tuple[str, int]],
    controls: Sequence[tuple[str, int]],
    *,
    seed: int,
    round: int,
    batch_size: int,
    seq_len: int,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
    cache: Optional[dict] = None,
    steps: int = 0,
    settle: int = 4,
    share: float = 0.5,
) -> GainStats:
    """The loss gains of the module docstring. ``theta``: the round's start weights, fp32 ``[P]``;
    ``contribution``: the pseudo-gradient as received (decoded; zero outside the checked parts), fp32 ``[P]``,
    or its non-zero pieces as ``(start, values)`` pairs, ``values`` fp32 or the sign packet itself
    (:data:`~geomesh_p2p.trust.check_model.Piece`; non-overlapping);
    ``assigned`` / ``controls``: ``(peer_id, step)`` batch streams (at least 2 each). ``model`` (a copy nobody
    else uses) is loaded with ``theta`` (:func:`~geomesh_p2p.trust.check_model.load_for_check`: a hollow copy's
    parameters become views of it), then the second pass runs at bitwise ``theta - contribution`` (one fp32
    subtraction per element; ``theta`` itself is never written): a hollow model builds it one module at a time,
    around each module's forward (:func:`~geomesh_p2p.trust.check_model.subtracted`: the extra memory is the
    largest module's parameters, not ``[P]``; the pieces are kept for the pass, a packet decoded a span at a
    time), any other model has it subtracted in place (:func:`~geomesh_p2p.trust.check_model.sub_flat_`).
    ``pace``: see :func:`row_losses`. Cost: 2 x (k + m) forward passes of ``batch_size`` rows, no backward, no
    temporary ``[P]`` (issue 27); a hollow model's second pass also subtracts (and decodes) the moved
    parameters at each forward (~2 passes over them a batch).
    ``cache``: a dict the caller keeps for one ``theta`` (one round): the control batches' losses at ``theta`` are
    kept there, a batch at a time, and reused by the next call with the same control batch, batch size and sequence
    length (the same bits: the same weights and batches), so screening a round's second contributor costs ``2k + m``
    passes.
    ``steps``: the inner steps the contribution claims (0: not known); with it, ``low`` is measured over the
    ``assigned`` streams' steps (:func:`gain_of`, ``settle`` and ``share``).

    Raises:
        ValueError: fewer than 2 streams on a side, or a vector of the wrong size.
        TimeoutError: ``deadline`` passed.
    """
    if len(assigned) < 2 or len(controls) < 2:
        raise ValueError(f"a gain needs >= 2 batches a side, got {len(assigned)} assigned, {len(controls)} control")
    rows, passes = gain_rows(
        model, dataset, theta, contribution, assigned, controls, seed=seed, round=round, batch_size=batch_size,
        seq_len=seq_len, deadline=deadline, pace=pace, cache=cache,
    )  # fmt: skip
    k = len(assigned)
    at = [int(j) for _, j in assigned]
    return gain_of(rows[:k], rows[k:], passes=passes, steps=steps, at=at, settle=settle, share=share)


def cached_gain_rows(
    model,
    dataset,
    theta: torch.Tensor,
    contribution: Union[torch.Tensor, Iterable[Piece]],
    assigned: Sequence[tuple[str, int]],
    controls: Sequence[tuple[str, int]],
    *,
    row_key: tuple,
    cache: Optional[dict],
    seed: int,
    round: int,
    batch_size: int,
    seq_len: int,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
) -> tuple[list[list[float]], int]:
    """:func:`gain_rows`, each batch's row gains kept in ``cache`` under ``("rows", *row_key, stream, index, batch,
    seq_len, seed, round)`` (``row_key``: what names the contribution, e.g. its sender and parts), so a test measured
    in parts (session 47: a screen's probe, then its half) computes each batch once: the same rows as one call (each
    batch is its own forward pass, :func:`row_losses`); the passes returned are those run now. ``cache`` None: no
    keeping. Raises what :func:`gain_rows` raises."""
    kw: dict[str, Any] = dict(
        seed=seed, round=round, batch_size=batch_size, seq_len=seq_len, deadline=deadline, pace=pace, cache=cache
    )
    if cache is None:
        return gain_rows(model, dataset, theta, contribution, assigned, controls, **kw)
    streams = list(assigned) + list(controls)
    keys = [("rows", *row_key, s, int(i), int(batch_size), int(seq_len), int(seed), int(round)) for s, i in streams]
    known = [cache.get(k) for k in keys]
    n = len(assigned)
    a_todo = [s for s, got in zip(assigned, known[:n]) if got is None]
    c_todo = [s for s, got in zip(controls, known[n:]) if got is None]
    passes = 0
    if a_todo or c_todo:
        fresh, passes = gain_rows(model, dataset, theta, contribution, a_todo, c_todo, **kw)
        it = iter(fresh)
        for i, got in enumerate(known):
            if got is None:
                row = next(it)
                known[i] = row
                cache[keys[i]] = list(row)
    return [list(r) for r in known if r is not None], passes
