"""The verified-work check itself: the batch gradients at the round's start weights
(:func:`batch_gradients`), the statistics compared with the contribution (:func:`work_statistics`:
``plain`` and ``trace``) and the decision (:func:`judge`, :func:`quick_verdict`); :func:`check_contribution`
runs one :class:`~geomesh_p2p.trust.verify_task.VerifyTask`. The thresholds and how they were measured:
:mod:`geomesh_p2p.trust.verify`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.model.device import free_after_oom, is_oom
from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.trust.check_model import abs_max, is_hollow, load_for_check, release_
from geomesh_p2p.trust.gain import GainStats, cached_gain_rows, gain_stats
from geomesh_p2p.trust.gain_batches import low_fails, low_kw, low_outcome
from geomesh_p2p.trust.gain_stages import RowsFn, can_stage, staged_gain
from geomesh_p2p.trust.verify_commit import Committed
from geomesh_p2p.trust.verify_task import (
    CONTROL_STREAM,
    SCREEN,
    VerifyConfig,
    VerifyTask,
    borrowed_references,
    gain_steps,
    gather,
    reference_task,
    sample_elements,
)

log = logging.getLogger(__name__)

__all__ = [
    "WorkStats",
    "Verdict",
    "VerifyTimeout",
    "PASS",
    "MARGINAL",
    "FAIL",
    "batch_gradients",
    "work_statistics",
    "scale_bound",
    "judge",
    "quick_verdict",
    "check_contribution",
    "screen_contribution",
    "judge_screen",
    "gain_decides",
    "covers_whole",
    "reference_gain",
]


PASS, MARGINAL, FAIL = "pass", "marginal", "fail"


class VerifyTimeout(RuntimeError):
    """A check ran past its deadline and was abandoned."""


def batch_gradients(
    model,
    dataset,
    theta: torch.Tensor,
    streams: Sequence[tuple[str, int]],
    *,
    seed: int,
    round: int,
    batch_size: int,
    seq_len: int,
    index: torch.Tensor,
    micro_batch: Optional[int] = None,
    amp: bool = False,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """fp32 CPU ``[len(streams), len(index)]``: for each ``(peer_id, step)``, the gradient at ``theta`` of
    ``dataset.sample_batch(seed, peer_id, round, step, batch_size, seq_len)`` (mean token loss, as the
    inner trainer computes it, accumulated over ``micro_batch`` rows) at the flat elements ``index``.
    ``model`` is loaded with ``theta`` (it must be a copy nobody else uses; a hollow copy's parameters become
    views of ``theta``: :func:`~geomesh_p2p.trust.check_model.load_for_check`). The sampled elements are
    gathered parameter by parameter: no flat ``[P]`` gradient is assembled. Raises VerifyTimeout when
    ``deadline`` (unix seconds) passes between two batches. ``pace()``, when given, is called between two
    batches (the background queue's :class:`~geomesh_p2p.trust.verify_queue.Pacer`: it sleeps to keep the
    check within its share of the device)."""
    load_for_check(model, theta)
    model.train()
    device = next(model.parameters()).device
    params = [p for _, p in model.named_parameters()]
    picks = _picks(params, index)
    out = torch.empty(len(streams), index.numel(), dtype=torch.float32)
    use_amp = amp and device.type == "cuda"
    for i, (peer, step) in enumerate(streams):
        if pace is not None and i > 0:
            pace()
        if deadline is not None and time.time() > deadline:
            raise VerifyTimeout(f"past the deadline after {i} of {len(streams)} batches")
        for p in params:
            p.grad = None
        x = dataset.sample_batch(
            seed=seed, peer_id=peer, round=round, step=step, batch_size=batch_size, seq_len=seq_len
        )
        mb = batch_size if not micro_batch or micro_batch >= batch_size else int(micro_batch)
        while True:
            picked = _PickedGrads(params, picks)
            try:
                _accumulate(model, x, mb, device, use_amp)
                break
            except (RuntimeError, MemoryError) as e:
                # Out of memory is a condition (issue 27): the same batch again in halves, down to one row
                # (then the MemoryError ends this check: VerifiedWork abandons it like a timeout).
                if not is_oom(e):
                    raise
                for p in params:
                    p.grad = None
                picked.sums.clear()
                free_after_oom(device)
                if mb <= 1:
                    raise MemoryError(f"verified work ran out of memory at micro-batch 1 on {device}") from None
                log.warning("verified work ran out of memory at micro-batch %d; checking at %d", mb, mb // 2)
                micro_batch = mb = mb // 2  # the later batches of this check too
            finally:
                picked.remove()
        with torch.no_grad():
            row = out[i]
            for p, where, _ in picks:
                got = picked.sums.get(id(p))
                row[where] = 0.0 if got is None else got.float().cpu()  # no gradient: zeros, as the flat one had
    for p in params:
        p.grad = None
    return out


#: A check's gradient pass returns the heap's free pages to the OS each time this many bytes of CPU gradients were
#: dropped (:class:`_PickedGrads`): ~11 trims a pass at gpt2-124m (P = 89M), each ~1 ms plus its pages faulted in
#: again. `benchmarks/verify_check_rss.py --model gpt2-124m`: a check's peak over its start 1.05-1.11p -> 0.48-0.50p
#: (p = 4P bytes); 64 MiB gave 0.61-0.68p, 16 MiB 0.47p (session 42).
TRIM_EVERY_BYTES = 32 << 20


class _PickedGrads:
    """Each parameter's gradient at its picked elements, summed over the micro-batches in the gradient's dtype (the
    bits ``.grad`` accumulated in place held there), its ``.grad`` dropped as soon as it is accumulated: a check
    holds one parameter's gradient at a time instead of the model's ``[P]`` (issue 27, session 39: the check runs
    beside the inner steps, whose gradients are the peer's own ``[P]``)."""

    def __init__(self, params: Sequence[torch.Tensor], picks) -> None:
        self.local = {id(p): local for p, _, local in picks}
        self.sums: dict[int, torch.Tensor] = {}
        self.freed = 0  # bytes of CPU gradients dropped since the last trim
        self.trims = 0
        self.handles = [
            p.register_post_accumulate_grad_hook(self._hook) for p in params if p.requires_grad and p.is_leaf
        ]

    def _hook(self, p: torch.Tensor) -> None:
        g, p.grad = p.grad, None
        local = self.local.get(id(p))
        if g is None:
            return
        if local is not None:
            with torch.no_grad():
                vals = g.reshape(-1)[local.to(g.device)]
                prev = self.sums.get(id(p))
                self.sums[id(p)] = vals if prev is None else prev + vals
        if g.device.type == "cpu":
            self.freed += g.numel() * g.element_size()
            del g
            if self.freed >= TRIM_EVERY_BYTES:
                # glibc splits each freed gradient for the pass's smaller blocks and takes the next gradient from
                # fresh heap: free but resident heap grew ~0.7p over one gpt2-124m pass (session 42: mallinfo's
                # free bytes, RssAnon +0.7p while the bytes in use stayed flat), the peak of a check beside the
                # inner steps. A trim every TRIM_EVERY_BYTES hands it back as it grows.
                release_freed_memory()
                self.freed = 0
                self.trims += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _picks(
    params: Sequence[torch.Tensor], index: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each parameter holding some of the flat elements ``index`` (int64, any order, layout of
    :func:`~geomesh_p2p.model.build.flat_params`): ``(param, positions in index, offsets in the param)``."""
    idx = index.reshape(-1).to("cpu", torch.int64)
    order = torch.argsort(idx, stable=True)
    ordered = idx[order]
    out, off = [], 0
    for p in params:
        n = p.numel()
        lo = int(torch.searchsorted(ordered, off))
        hi = int(torch.searchsorted(ordered, off + n))
        if hi > lo:
            out.append((p, order[lo:hi], ordered[lo:hi] - off))
        off += n
    if sum(len(w) for _, w, _ in out) != idx.numel():
        raise ValueError(f"element indices outside the model's {off} elements")
    return out


def _accumulate(model, x: torch.Tensor, mb: int, device: torch.device, use_amp: bool) -> None:
    """Forward/backward int64 batch ``x`` ``[B, seq_len]`` into ``.grad`` in ``mb``-row slices, each loss
    scaled by ``rows / B`` (the inner trainer's accumulation)."""
    b = x.shape[0]
    for a in range(0, b, mb):
        xm = x[a : a + mb].to(device)
        if use_amp:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(input_ids=xm, labels=xm).loss
        else:
            loss = model(input_ids=xm, labels=xm).loss
        (loss * (xm.shape[0] / b)).backward()


@dataclass(frozen=True)
class WorkStats:
    """``plain``: sign agreement with the summed normalised batch gradients; ``trace``: |d|-weighted
    sign agreement with their part orthogonal to the controls and the checker's own contribution;
    ``basis``: vectors projected out; ``gain``: the loss-gain test on assigned vs control batches
    (:class:`~geomesh_p2p.trust.gain.GainStats`), None when it did not run."""

    plain: float
    trace: float
    basis: int
    gain: Optional[GainStats] = None


def _total(vs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``0 + v0 + v1 + ...`` in order, as the builtin ``sum`` adds them (same bits), typed as a tensor.

    Raises:
        ValueError: ``vs`` is empty (no gradient to sum: a task with no step).
    """
    it = iter(vs)
    try:
        total = 0 + next(it)
    except StopIteration:
        raise ValueError("no gradient to sum") from None
    for v in it:
        total = total + v
    return total


def work_statistics(
    c: torch.Tensor, own: torch.Tensor, ctrl: torch.Tensor, others: Sequence[torch.Tensor] = ()
) -> WorkStats:
    """The statistics of the module docstring for a decoded contribution ``c`` ``[n]``, its own batch
    gradients ``own`` ``[k, n]``, control gradients ``ctrl`` ``[m, n]`` and trusted contributions to
    project out too (decoded, ``[n]`` each; the checker's own) on the same elements. Float64."""
    c = c.double()
    sc = torch.sign(c)
    own = own.double()

    def unit(v: torch.Tensor) -> torch.Tensor:
        rms = v.pow(2).mean().sqrt()
        return v / rms if rms > 0 else v

    # elements no batch moved (summed gradient exactly 0: position rows past seq_len, a dead unit) carry no trace of
    # the batches: the contribution's sign there is weight decay or old momentum, and counting it as a disagreement
    # lowered honest and random alike (session 35)
    signs = torch.sign(_total(unit(g) for g in own))
    moved = signs != 0
    plain = float((sc[moved] == signs[moved]).double().mean()) if bool(moved.any()) else 0.5
    basis = [unit(g) for g in ctrl.double()] + [unit(o.double()) for o in others if bool((o != 0).any())]
    if basis:
        q, _ = torch.linalg.qr(torch.stack(basis, 1))
        resid = [g - q @ (q.T @ g) for g in own]
    else:
        resid = list(own)
    d = _total(unit(r) for r in resid)
    w = d.abs()
    total = float(w.sum())
    trace = float((w * (sc == torch.sign(d))).sum()) / total if total > 0 else 0.5
    return WorkStats(plain=plain, trace=trace, basis=len(basis))


@dataclass(frozen=True)
class Verdict:
    """``outcome``: :data:`PASS`, :data:`MARGINAL` or :data:`FAIL`; ``reason``: one line."""

    outcome: str
    reason: str


def scale_bound(steps: int, lr: float, weight_decay: float, theta_maxabs: float, factor: float) -> float:
    """Largest mean |delta| of a block that ``steps`` AdamW steps at learning rate <= ``lr`` can produce."""
    return steps * lr * (factor + weight_decay * theta_maxabs)


def covers_whole(task: VerifyTask, packets: Mapping[str, Mapping[int, Any]]) -> bool:
    """Whether ``task`` covers every part the accused contributed (``packets[task.accused]``: held sign packets or, in
    accountable mode, their commitments' stand-ins; what :func:`~.verify_task.derive_task` draws from). The loss-gain
    test runs only then (issue 28, session 31): its thresholds and the power reference were measured on whole
    contributions, and its power is not spread evenly over the parameters (tiny preset, honest work,
    ``benchmarks/gain_parts.py``: t 3.50-14.86 on the two parts of 4 that hold the token embedding, -0.62 to 3.39 on
    the last two; session 29's lone false positive, t -0.12 against the screener's own 3.36, was such a pair).
    Accountable mode's sampled checks cover 2 parts (:func:`~.verify_commit.narrow`), so their sign statistics decide;
    its screens cover the whole contribution."""
    sent = {j for j, p in packets.get(task.accused, {}).items() if isinstance(p, (compression.SignPacket, Committed))}
    return set(task.parts) >= sent


def gain_decides(
    cfg: VerifyConfig,
    gain: GainStats,
    reference: Optional[GainStats],
    tokens: Optional[int] = None,
    power: Optional[bool] = None,
) -> bool:
    """Whether the loss-gain test ``gain`` may fail or mark a contribution in its round: the checker's own
    contribution's test (``reference``, :func:`reference_gain`), brought to the accused's steps, reaches a t at
    least ``cfg.gain_t_gap`` above ``gain.t``. False without a reference: a low t then says nothing (at the first
    rounds honest work measures t ~1: the update is what any text teaches; ``VerifyConfig.gain_t_gap``).

    Honest t grows with the steps a contribution holds (``benchmarks/verify_gain.py``, honest minima 2.24 / 4.09 /
    5.15 at H = 5 / 20 / 40), so a reference of more steps than the accused's is scaled by
    ``sqrt(gain.steps / reference.steps)``: below what was measured between those H (the sqrt predicts 1.82 at H = 5
    from 5.15 at 40), so it errs towards no decision. Session 35 (red team): an honest peer that trained 5 of its 26
    planned steps under load measured t 0.91 against a screener's 14-step reference at t 5.60 and failed hard;
    scaled, the reference is 3.35, under 0.91 + 2.5: no decision. Steps unknown (0) on either side: no scaling.

    ``tokens``: what the accused's contribution was trained on (steps x batch x seq_len); under
    ``cfg.gain_min_tokens`` the test decides nothing. Its t is over rows, so a small batch has little power: at
    batch 4 x 32 honest 5-step contributions measured t down to 0.96 and failed in 10-18% of draws whatever the
    reference's steps, 14-step ones (1,792 tokens) never (red team, ``benchmarks/gain_parts.py``, session 35).

    ``power``: the reference's comparison as a staged screen decided it (:mod:`~.gain_stages`: on half the
    reference's batches, or half of both sides'), instead of ``reference``'s t; the token floor still applies."""
    if tokens is not None and tokens < cfg.gain_min_tokens:
        return False
    if power is not None:
        return power
    if reference is None:
        return False
    scale = 1.0
    if gain.steps > 0 and reference.steps > gain.steps:
        scale = math.sqrt(gain.steps / reference.steps)
    return reference.t * scale >= gain.t + cfg.gain_t_gap


def _tokens(task: VerifyTask) -> int:
    """Tokens the task's contribution holds: its steps x batch x seq_len."""
    return int(task.steps_done) * int(task.batch_size) * int(task.seq_len)


def _reference_note(reference: Optional[GainStats], borrowed: int = 0) -> str:
    if reference is None:
        return ""
    if borrowed:
        return f"; {borrowed} other contributions of the round (borrowed), the deciding one: t {reference.t:.2f}"
    return f"; this checker's own contribution: t {reference.t:.2f} on its own batches"


def judge(
    cfg: VerifyConfig,
    task: VerifyTask,
    stats: WorkStats,
    *,
    all_zero: bool,
    max_scale: float,
    bound: float,
    reference: Optional[GainStats] = None,
    whole: bool = True,
) -> Verdict:
    """Pass, marginal or fail (see the module docstring). The loss-gain rules apply only when the test has power
    in the round (:func:`gain_decides` with the checker's own ``reference``). ``whole``: the task covers every part
    the accused sent (:func:`covers_whole`). When it does not (accountable mode's bounded check, 2 parts), only the
    hard tests a part pair still separates decide: zeros, scale and ``plain`` < ``plain_hard``. The trace and the
    plain marginal band were measured on whole contributions; over a pair of parts honest work measured trace 0.465-
    0.497 and plain 0.536-0.544 at the tiny preset (session 35: the red team's ``benchmarks/plain_parts.py``, and a
    CI run in which two honest peers failed each other's 40-step contributions on plain 0.544 / 0.548)."""
    if all_zero:
        return Verdict(FAIL, f"zeros: every block scale is 0 while it claims {task.steps_done} steps")
    if not max_scale <= bound:
        return Verdict(
            FAIL,
            f"scale: a block scale of {max_scale:.3g} exceeds what {task.steps_done} inner "
            f"steps can move ({bound:.3g})",
        )
    g = stats.gain if stats.gain is not None and gain_decides(cfg, stats.gain, reference, _tokens(task)) else None
    if g is not None and g.t < cfg.gain_t_hard:  # decided without the gradient passes (plain, trace not measured)
        return Verdict(
            FAIL,
            f"no loss gain on its own batches: t {g.t:.2f} < {cfg.gain_t_hard} (gain {g.assigned:+.4f} on its "
            f"assigned batches vs {g.control:+.4f} on controls{_reference_note(reference)}): not trained on them "
            f"(other data, stale, flipped or noise)",
        )
    low = low_outcome(cfg, stats.gain, reference, _tokens(task))  # partial work (session 50): each batch's own gain
    if low is not None and low[0] == "fail":
        return Verdict(FAIL, low[1])
    if stats.plain < cfg.plain_hard:
        return Verdict(
            FAIL,
            f"signs: plain agreement {stats.plain:.3f} with its own batches' gradients "
            f"(< {cfg.plain_hard}: flipped or random)",
        )
    if not whole:  # (no gain test either: it runs on whole contributions only, covers_whole)
        return Verdict(PASS, f"plain {stats.plain:.3f} on {len(task.parts)} of its parts")
    if task.full_test and stats.trace < cfg.trace_hard:
        return Verdict(FAIL, f"no trace of its own batches: trace {stats.trace:.3f} < {cfg.trace_hard}")
    if stats.plain < cfg.plain_min:
        return Verdict(
            MARGINAL,
            f"signs: weak plain agreement {stats.plain:.3f} with its own batches' gradients (< {cfg.plain_min})",
        )
    if g is not None and g.t < cfg.gain_t_min:
        return Verdict(
            MARGINAL,
            f"weak loss gain on its own batches: t {g.t:.2f} < {cfg.gain_t_min} (gain {g.assigned:+.4f} vs "
            f"{g.control:+.4f} on controls{_reference_note(reference)})",
        )
    if task.full_test and stats.trace < cfg.trace_min:
        return Verdict(MARGINAL, f"weak trace of its own batches: trace {stats.trace:.3f} < {cfg.trace_min}")
    if low is not None and low[0] == "marginal":
        return Verdict(MARGINAL, low[1])
    gain = f", gain t {g.t:.2f}" if g is not None else ""
    return Verdict(PASS, f"plain {stats.plain:.3f}, trace {stats.trace:.3f}{gain}")


def packet_digest(packet) -> str:
    return hashlib.sha256(packet.to_bytes()).hexdigest()


def _scales(
    cfg: VerifyConfig,
    task: VerifyTask,
    packets: Mapping[str, Mapping[int, Any]],
    theta: torch.Tensor,
    lr: float,
    weight_decay: float,
) -> tuple[bool, float, float]:
    """(all scales zero while tokens are claimed, largest block scale, the scale bound) of the task."""
    mine = packets[task.accused]
    scales = torch.cat([mine[j].scales for j in task.parts])
    tokens = max(mine[j].tokens for j in task.parts)
    all_zero = tokens > 0 and scales.numel() > 0 and not bool((scales > 0).any())
    bound = scale_bound(task.steps_done, lr, weight_decay, abs_max(theta), cfg.scale_factor)
    return all_zero, float(scales.max()) if scales.numel() else 0.0, bound


def quick_verdict(
    cfg: VerifyConfig,
    task: VerifyTask,
    *,
    packets: Mapping[str, Mapping[int, Any]],
    theta: torch.Tensor,
    lr: float,
    weight_decay: float,
) -> Optional[Verdict]:
    """The verdict of the tests that need no computation (zero scales, the scale bound), or None."""
    all_zero, max_scale, bound = _scales(cfg, task, packets, theta, lr, weight_decay)
    if all_zero or not max_scale <= bound:
        return judge(cfg, task, WorkStats(0.0, 0.0, 0), all_zero=all_zero, max_scale=max_scale, bound=bound)
    return None


def check_contribution(
    cfg: VerifyConfig,
    task: VerifyTask,
    *,
    model,
    dataset,
    theta: torch.Tensor,
    seed: int,
    packets: Mapping[str, Mapping[int, Any]],
    lr: float,
    weight_decay: float,
    checker: Optional[str] = None,
    micro_batch: Optional[int] = None,
    amp: bool = False,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
    plan=None,
    cache: Optional[dict] = None,
) -> tuple[WorkStats, Verdict, list[tuple[str, str]]]:
    """Run ``task`` (heavy: ``task.passes()`` forward/backward passes, unless :func:`quick_verdict`
    decides it) as peer ``checker``, whose own contribution (if any, in every part of the task) joins
    the projection basis and, with the round's ``plan``, is the loss-gain test's power reference
    (:func:`reference_gain`, measured only when the accused's t is low; ``cache``: the round's gain cache).
    Returns the statistics, the verdict and that basis contribution (``[(peer, sha256 of its packets)]``, or
    []). ``deadline`` / ``pace``: as for :func:`batch_gradients`."""
    quick = quick_verdict(cfg, task, packets=packets, theta=theta, lr=lr, weight_decay=weight_decay)
    if quick is not None:
        return WorkStats(0.0, 0.0, 0), quick, []
    all_zero, max_scale, bound = _scales(cfg, task, packets, theta, lr, weight_decay)
    mine = packets[task.accused]
    # The loss-gain test first (forward passes only): a contribution not trained on its batches fails it
    # hard, and then the gradient passes are not needed. What a check of a free rider or a poisoner costs
    # halves, and the background queue (paced to a share of the device) concludes it rounds sooner.
    # (not on a fresh model's first rounds, where it has no power: VerifyConfig.gain_first_round; not on some of the
    # contribution's parts, accountable mode's bounded check: its t is calibrated on the whole only, covers_whole)
    gain = None
    if task.round >= cfg.gain_first_round and covers_whole(task, packets):
        gain = _gain(cfg, task, model, dataset, theta, mine, seed=seed, deadline=deadline, pace=pace)
    reference = None
    if gain is not None and (gain.t < cfg.gain_t_min or low_fails(cfg, gain)):  # counts only with power (both rules)
        reference = reference_gain(
            cfg, task, model, dataset, theta, packets, plan=plan, checker=checker, seed=seed, deadline=deadline,
            pace=pace, cache=cache,
        )  # fmt: skip
    if gain is not None and gain.t < cfg.gain_t_hard and gain_decides(cfg, gain, reference, _tokens(task)):
        early = WorkStats(0.0, 0.0, 0, gain)
        return early, judge(cfg, task, early, all_zero=False, max_scale=max_scale, bound=bound, reference=reference), []
    if is_hollow(model):
        release_(model)  # the gain's private copies go before the gradient passes (issue 27)
        release_freed_memory()
    index = sample_elements(task.ranges, task.n_elements, task.element_seed)
    c = gather(mine, task, index)
    streams = [(task.accused, j) for j in task.steps] + [(CONTROL_STREAM, i) for i in range(task.controls)]
    g = batch_gradients(
        model, dataset, theta, streams, seed=seed, round=task.round, batch_size=task.batch_size,
        seq_len=task.seq_len, index=index, micro_batch=micro_batch, amp=amp, deadline=deadline, pace=pace,
    )  # fmt: skip
    k = len(task.steps)
    others: list[torch.Tensor] = []
    used: list[tuple[str, str]] = []
    own = packets.get(checker) if checker not in (None, task.accused) else None
    if checker is not None and own and all(isinstance(own.get(j), compression.SignPacket) for j in task.parts):
        others.append(gather(own, task, index))
        used.append(
            (checker, hashlib.sha256(b"".join(bytes.fromhex(packet_digest(own[j])) for j in task.parts)).hexdigest())
        )
    stats = work_statistics(c, g[:k], g[k:], others)
    stats = WorkStats(stats.plain, stats.trace, stats.basis, gain)
    verdict = judge(
        cfg, task, stats, all_zero=False, max_scale=max_scale, bound=bound, reference=reference,
        whole=covers_whole(task, packets),
    )  # fmt: skip
    return stats, verdict, used


def judge_screen(
    cfg: VerifyConfig,
    task: VerifyTask,
    gain: GainStats,
    reference: Optional[GainStats] = None,
    *,
    power: Optional[bool] = None,
    stage: str = "",
    borrowed: int = 0,
    low_power: Optional[bool] = None,
) -> Verdict:
    """The verdict of a screening check (the loss-gain test alone): fail below ``gain_t_hard`` (hard, as in a
    full check), marginal below ``gain_t_min``, else pass. The thresholds are the full check's, measured on the
    same statistic with the same batch counts (``benchmarks/verify_gain.py``). A low t without power in the
    round (:func:`gain_decides` with the checker's own ``reference``) passes as inconclusive: the newcomer's next
    screened round decides. ``power`` / ``stage``: a staged screen's decision on the reference and the note on
    what decided (:func:`~geomesh_p2p.trust.gain_stages.staged_gain`; ``gain`` is the half's when a half decided).
    ``borrowed``: the number of other contributions ``reference`` stands for (the checker sent none; ``power`` then
    says whether all of them showed it), 0 for the checker's own. A whole t that passes then meets the per-batch
    rule (:func:`~.gain_batches.low_outcome`; ``low_power``: its power as a staged screen decided it)."""
    head = f"screening (loss gain alone): {task.steps_done} steps{stage}"
    note = _reference_note(reference, borrowed)
    low = low_outcome(cfg, gain, reference, _tokens(task), low_power)  # partial work (session 50)
    if low is not None and low[0] == "fail":  # outranks a marginal t, or one without power
        return Verdict(FAIL, f"{low[1]} ({head})")
    if gain.t < cfg.gain_t_min and not gain_decides(cfg, gain, reference, _tokens(task), power):
        if _tokens(task) < cfg.gain_min_tokens:  # the floor, whatever the reference (session 44: logs read "no power")
            return Verdict(
                PASS,
                f"inconclusive: gain t {gain.t:.2f}, but its {_tokens(task)} tokens are under the test's floor "
                f"({cfg.gain_min_tokens}; {head})",
            )
        own = "no contribution of its own"
        if reference is not None:
            own = note[2:] if borrowed else f"this checker's own contribution t {reference.t:.2f}"
        return Verdict(
            PASS,
            f"inconclusive: gain t {gain.t:.2f}, but the test has no power this round ({own}, needs "
            f">= t + {cfg.gain_t_gap}; {head})",
        )
    if gain.t < cfg.gain_t_hard:
        return Verdict(
            FAIL,
            f"no loss gain on its own batches: t {gain.t:.2f} < {cfg.gain_t_hard} (gain {gain.assigned:+.4f} on its "
            f"assigned batches vs {gain.control:+.4f} on controls{note}): not trained on them ({head})",
        )
    if gain.t < cfg.gain_t_min:
        return Verdict(
            MARGINAL,
            f"weak loss gain on its own batches: t {gain.t:.2f} < {cfg.gain_t_min} (gain {gain.assigned:+.4f} vs "
            f"{gain.control:+.4f} on controls{note}; {head})",
        )
    if low is not None:
        return Verdict(MARGINAL if low[0] == "marginal" else PASS, f"{low[1]} ({head})")
    return Verdict(PASS, f"gain t {gain.t:.2f} ({head})")


def screen_contribution(
    cfg: VerifyConfig,
    task: VerifyTask,
    *,
    model,
    dataset,
    theta: torch.Tensor,
    seed: int,
    packets: Mapping[str, Mapping[int, Any]],
    lr: float,
    weight_decay: float,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
    cache: Optional[dict] = None,
    plan=None,
    checker: Optional[str] = None,
) -> tuple[WorkStats, Verdict]:
    """Run the screening ``task`` (:func:`~geomesh_p2p.trust.verify_task.derive_screen`): the checks that need
    no computation (:func:`quick_verdict`), then the loss-gain test alone on ``cfg.gain_assigned`` of its steps
    against ``cfg.gain_controls`` control batches: ``2 x (k + m)`` forward passes of ``task.batch_size`` rows, no
    backward (``2k + m`` with the round's control losses in ``cache``, :func:`~geomesh_p2p.trust.gain.gain_stats`).
    Returns the statistics (``plain`` / ``trace`` 0: not measured) and :func:`judge_screen`'s verdict, with
    ``checker``'s own contribution in ``plan``'s round as the power reference (:func:`reference_gain`, measured
    only when the newcomer's t is low).
    ``deadline`` / ``pace``: as for :func:`batch_gradients`. Raises ValueError when ``task`` is not a screen."""
    if task.kind != SCREEN:
        raise ValueError(f"screen_contribution runs screening tasks, got a {task.kind!r}")
    quick = quick_verdict(cfg, task, packets=packets, theta=theta, lr=lr, weight_decay=weight_decay)
    if quick is not None:
        return WorkStats(0.0, 0.0, 0), quick
    if not covers_whole(task, packets):  # a t over some parts only is not the calibrated statistic (covers_whole)
        n = len(packets.get(task.accused, {}))
        return WorkStats(0.0, 0.0, 0), Verdict(
            PASS, f"inconclusive: the screen covers {len(task.parts)} of the {n} parts contributed, not measured"
        )
    rows = _rows_of(cfg, model, dataset, theta, seed=seed, deadline=deadline, pace=pace, cache=cache)
    k = len(gain_steps(task, cfg.gain_assigned))
    if cfg.gain_staged and can_stage(k, cfg.gain_controls):
        rt = (
            None
            if plan is None or checker is None
            else reference_task(cfg, task, plan=plan, packets=packets, checker=checker)
        )
        borrowed = _borrowed(cfg, task, plan, packets, checker)  # lent when the own reference has no power
        own_ref = rt is not None
        st = staged_gain(
            cfg, task, rt, packets, rows, cache, tokens=_tokens(task), borrowed=[] if own_ref else borrowed,
            fallback=borrowed if own_ref else (),
        )  # fmt: skip
        return WorkStats(0.0, 0.0, 0, st.gain), judge_screen(
            cfg,
            task,
            st.gain,
            st.reference,
            power=st.power,
            stage=st.stage,
            borrowed=st.borrowed or (0 if own_ref else len(borrowed)),
            low_power=st.low_power,
        )
    gain = _gain(
        cfg, task, model, dataset, theta, packets[task.accused], seed=seed, deadline=deadline, pace=pace, cache=cache
    )
    reference = None
    if gain.t < cfg.gain_t_min or low_fails(cfg, gain):  # (unstaged: the own reference alone decides low's power)
        reference = reference_gain(
            cfg, task, model, dataset, theta, packets, plan=plan, checker=checker, seed=seed, deadline=deadline,
            pace=pace, cache=cache,
        )  # fmt: skip
    power = None
    if gain.t < cfg.gain_t_min and (reference is None or not gain_decides(cfg, gain, reference)):
        # the checker sent nothing, or its own reference has no power at the accused's steps (session 45): other
        # contributions, measured whole; every one must show power, the first that does not ends it
        own, borrowed = reference, _borrowed(cfg, task, plan, packets, checker)
        for rt in borrowed:
            reference = _reference_of(cfg, rt, model, dataset, theta, packets, seed=seed, deadline=deadline,
                                      pace=pace, cache=cache)  # fmt: skip
            power = gain_decides(cfg, gain, reference)
            if not power:
                break
        if own is not None and not power:  # lent nothing: the verdict is the own reference's, as before
            return WorkStats(0.0, 0.0, 0, gain), judge_screen(cfg, task, gain, own)
        return WorkStats(0.0, 0.0, 0, gain), judge_screen(
            cfg, task, gain, reference, power=power, borrowed=len(borrowed)
        )
    return WorkStats(0.0, 0.0, 0, gain), judge_screen(cfg, task, gain, reference)


def _borrowed(cfg, task: VerifyTask, plan, packets, checker) -> list[VerifyTask]:
    """:func:`~.verify_task.borrowed_references` of ``checker`` for ``task`` (used where it sent no contribution of
    its own, or its own shows no power); [] without a plan or checker, and under ``cfg.gain_min_tokens`` too: the screen passes there whatever the reference (:func:`judge_screen`'s
    floor), so measuring 2 other contributions for it was 2 references' batches for nothing (red team 45)."""
    if plan is None or checker is None or _tokens(task) < cfg.gain_min_tokens:
        return []
    return borrowed_references(cfg, task, plan=plan, packets=packets, checker=checker)


def _rows_of(cfg, model, dataset, theta, *, seed, deadline, pace, cache) -> RowsFn:
    """The row gains of a task's contribution on some of its steps and controls (:func:`~.gain.gain_rows`, the
    controls' losses at ``theta`` shared through ``cache``). Raises VerifyTimeout past ``deadline``."""

    def rows(task: VerifyTask, mine, steps, controls) -> tuple[list[list[float]], int]:
        pieces = [(s, _sign_packet(mine[j])) for j, (s, _) in zip(task.parts, task.ranges)]
        try:
            return cached_gain_rows(
                model, dataset, theta, pieces, [(task.accused, j) for j in steps],
                [(CONTROL_STREAM, i) for i in controls], seed=seed, round=task.round, batch_size=task.batch_size,
                seq_len=task.seq_len, deadline=deadline, pace=pace, cache=cache, row_key=(task.accused, task.parts),
            )  # fmt: skip
        except TimeoutError as e:
            raise VerifyTimeout(str(e)) from None

    return rows


def reference_gain(
    cfg: VerifyConfig,
    task: VerifyTask,
    model,
    dataset,
    theta: torch.Tensor,
    packets: Mapping[str, Mapping[int, Any]],
    *,
    plan,
    checker: Optional[str],
    seed: int,
    deadline: Optional[float] = None,
    pace: Optional[Callable[[], None]] = None,
    cache: Optional[dict] = None,
) -> Optional[GainStats]:
    """The loss-gain test of ``checker``'s own contribution in ``plan``'s round over ``task``'s parts
    (:func:`~geomesh_p2p.trust.verify_task.reference_task`): what honest work measures in that round, at those
    weights, so that a low t of the accused counts only when the test has power (:func:`gain_decides`). An
    honest checker's reference is honest by construction; a dishonest one can only harm its own verdicts, which
    the others re-check with their own references. ``2k + m`` forward passes (``2k`` with the round's control
    losses in ``cache``), kept in ``cache`` for the round's other accused over the same parts. None without a
    plan, a checker, or a checkable contribution of the checker's that covers the task's parts.

    Raises:
        VerifyTimeout: ``deadline`` passed.
    """
    if plan is None or checker is None:
        return None
    rt = reference_task(cfg, task, plan=plan, packets=packets, checker=checker)
    if rt is None:
        return None
    return _reference_of(cfg, rt, model, dataset, theta, packets, seed=seed, deadline=deadline, pace=pace, cache=cache)


def _reference_of(cfg, rt: VerifyTask, model, dataset, theta, packets, *, seed, deadline, pace, cache) -> GainStats:
    """The loss-gain test of the reference task ``rt`` (its contributor's own or a borrowed one's), kept in
    ``cache`` (the key names its batches' seed: a borrowed reference draws them per screen)."""
    key = ("reference", rt.round, rt.accused, rt.parts, rt.batch_size, rt.seq_len, rt.element_seed)
    if cache is not None and key in cache:
        return cache[key]
    ref = _gain(
        cfg, rt, model, dataset, theta, packets[rt.accused], seed=seed, deadline=deadline, pace=pace, cache=cache
    )
    if cache is not None:
        cache[key] = ref
    return ref


def _sign_packet(p) -> compression.SignPacket:
    """``p`` if it is a sign packet (the only kind a contribution has), else CodecError as a decode raises."""
    if not isinstance(p, compression.SignPacket):
        raise compression.CodecError(f"a contribution is a SignPacket, got {type(p).__name__}")
    return p


def _gain(
    cfg, task: VerifyTask, model, dataset, theta: torch.Tensor, mine, *, seed: int, deadline, pace=None, cache=None
) -> GainStats:
    """The loss-gain test of ``task`` (:mod:`geomesh_p2p.trust.gain`): the contributor's packets of the task's
    parts, subtracted from the loaded weights (:func:`~geomesh_p2p.trust.gain.gain_stats`; the parts it did not
    send, or the check does not hold, stay 0),
    ``cfg.gain_assigned`` of its steps (:func:`gain_steps`) against ``cfg.gain_controls`` control batches;
    ``pace()`` between two batches (the background queue's pacing). Raises VerifyTimeout past ``deadline``."""
    # The contribution's parts as received (issue 27: no [P] of it, decoded a span at a time where a module needs
    # it; zero elsewhere, as the gain test reads it)
    pieces = [(s, _sign_packet(mine[j])) for j, (s, _) in zip(task.parts, task.ranges)]
    steps = gain_steps(task, cfg.gain_assigned)
    if len(steps) < 2:  # below min_steps anyway; a t needs two batches a side
        raise ValueError(f"a loss-gain test needs >= 2 steps, the task has {task.steps_done}")
    try:  # with the claim's steps: the per-batch ``low`` too (session 50, gain_batches)
        return gain_stats(
            model, dataset, theta, pieces, [(task.accused, j) for j in steps],
            [(CONTROL_STREAM, i) for i in range(cfg.gain_controls)], seed=seed, round=task.round,
            batch_size=task.batch_size, seq_len=task.seq_len, deadline=deadline, pace=pace, cache=cache,
            steps=int(task.steps_done), **low_kw(cfg),
        )  # fmt: skip
    except TimeoutError as e:
        raise VerifyTimeout(str(e)) from None
