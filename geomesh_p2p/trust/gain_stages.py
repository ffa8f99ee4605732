"""A screen's loss-gain test in two stages (issue 28, session 43): half of its batches first, the rest only when
that half does not decide.

Why. A screen is ``2 x (k + m)`` forward passes (k = 8 of the newcomer's batches, m = 16 controls; ``2k + m`` with
the round's control losses cached), and a low t adds the screener's own contribution as the power reference (``2k +
m`` more). On two loaded cores the verify worker gets 0.12-0.19 CPU-s a second, so the backdoor poisoner's ~80
passes (~2.4 s of CPU) concluded 5 rounds after its round (docs/security.md, "Session 42"). Most screens are far
from the thresholds: an honest newcomer measures t 2.2-15.7 against a failure below 1.5, the poisoner t -1.0..-0.6.

The model. The screen's t is Welch's t over rows (:mod:`geomesh_p2p.trust.gain`); with both sides halved (the
first half of the drawn batches, :func:`~geomesh_p2p.trust.verify_task.gain_order`, and the first half of the
controls) the half's t is ``Z_f`` at information fraction f = 1/2 of a Brownian motion with drift: for a true
effect ``delta`` (the whole test's mean t), ``Z_f ~ N(delta sqrt(f), 1)`` and the whole's ``Z_1 = sqrt(f) Z_f +
N(delta (1 - f), 1 - f)``. The rule: a half decides that the whole's t falls below a threshold ``c`` when
``Z_f < sqrt(f) c - kappa``, at or above it when ``Z_f >= sqrt(f) c + kappa``; anything between runs the rest.

The bound. For any ``delta`` the probability that such an early decision contradicts the whole test is at most
:func:`disagreement` ``(kappa)``: the supremum over ``delta`` does not depend on ``c`` (shifting ``c`` by ``x`` is
shifting ``delta`` by ``x``) nor on a scale ``sigma`` of the statistic (its thresholds scale with it).
``VerifyConfig.gain_stage_kappa`` = 1.71 gives <= 1e-3 (about 9.8e-4). A screen has three early decisions, each
bounded so: pass (t >= ``gain_t_min``: whole t >= 1.75), fail (t < ``gain_t_hard``: whole t < 1.5) and the power
reference's gap (``s t_ref - t >= gain_t_gap``, a difference of two unit-variance t's: ``sigma = sqrt(1 + s^2)``). By
the union bound (Bonferroni over the early decisions) a staged screen's verdict differs from the whole screen's
with probability <= 3e-3 for any contribution, and it fails one the whole screen would not fail with probability
<= 2e-3 (the fail and the gap decisions): an honest newcomer's exclusion rate rises by at most 0.2 points over the
whole screen's, and at honest effects (mean t >= 4 measured) far less (it needs ``Z_f < -0.65`` where its mean is
>= 2.8: < 1.3e-4 even before the whole is taken into account). The thresholds of the whole (1.5, 1.75, 2.5) are
unchanged; what no half decides runs the whole screen on the same rows (the same t to the bit).

Numbers at f = 1/2, kappa = 1.71: a half fails below -0.65 (with the power reference's half at
``s t_ref - t >= 4.19`` when ``s`` = 1), passes at or above 2.95; the reference after a whole t ``g`` decides power
at ``t_ref >= 0.71 (g + 2.5) / s + 1.71``, none below ``0.71 (g + 2.5) / s - 1.71``.

What it assumes: the rows are exchangeable within each side (the whole test assumes it already), and the half's t
is normal (the half has 4 x B rows against 8 x B: at B = 8 ~32 rows a side, a Student t with ~40 degrees of freedom,
whose 1e-3 tail is ~6 % wider than the normal's; not corrected).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from geomesh_p2p.trust.gain import GainStats, gain_of
from geomesh_p2p.trust.gain_batches import half_may_pass, low_fails, low_kw, low_power
from geomesh_p2p.trust.verify_task import VerifyConfig, VerifyTask, gain_order

__all__ = ["STAGE_FRACTION", "stage_bounds", "disagreement", "halves", "can_stage", "Staged", "staged_gain", "RowsFn"]

#: ``rows(task, the contribution's packets, steps, control indices)``: the per-batch row gains of those batches (the
#: steps', then the controls'), nats, and the forward passes run (``verify_check._rows_of``)
RowsFn = Callable[[VerifyTask, Mapping[int, Any], Sequence[int], Sequence[int]], tuple[list[list[float]], int]]

#: The first stage's share of the batches on each side (its information fraction).
STAGE_FRACTION = 0.5


def stage_bounds(full: float, kappa: float, sigma: float = 1.0, f: float = STAGE_FRACTION) -> tuple[float, float]:
    """``(below, above)``: a stage at information fraction ``f`` whose statistic (standard deviation ``sigma``) is
    below ``below`` decides that the whole one falls below ``full``; at or above ``above``, that it reaches it."""
    mid = math.sqrt(f) * full
    return mid - kappa * sigma, mid + kappa * sigma


def disagreement(kappa: float, f: float = STAGE_FRACTION, drifts: Optional[Sequence[float]] = None) -> float:
    """The largest probability, over the true effect ``delta`` (``drifts``: the grid searched; default -2..8 by
    0.02, where the supremum lies: it is near 1e-8 past it), that a stage at fraction ``f`` decides ``Z_1 >= c`` (its ``Z_f >= sqrt(f) c + kappa``) while the whole
    finds ``Z_1 < c`` (module docstring; the same for the other direction by symmetry, and for every ``c`` and
    ``sigma``). Float64 numeric integration over ``Z_f`` (trapezoid, step 0.004 over 14 deviations)."""
    d = torch.tensor(list(drifts) if drifts is not None else [i * 0.02 - 2.0 for i in range(501)], dtype=torch.float64)
    lo = kappa  # c = 0 (the supremum does not depend on it)
    z = torch.arange(lo, lo + 14.0, 0.004, dtype=torch.float64)
    zd, dd = z[None, :], d[:, None]
    dens = torch.exp(-0.5 * (zd - dd * math.sqrt(f)) ** 2) / math.sqrt(2 * math.pi)
    # P(Z_1 < 0 | Z_f = z): the rest of the motion, N(delta (1 - f), 1 - f), below -sqrt(f) z
    rest = torch.special.ndtr((-math.sqrt(f) * zd - dd * (1 - f)) / math.sqrt(1 - f))
    return float(torch.trapezoid(dens * rest, z, dim=1).max())


def can_stage(k: int, m: int) -> bool:
    """Whether a test of ``k`` assigned and ``m`` control batches is staged: both even (halves of equal information,
    f = 1/2 exactly) and a half holds >= 2 batches a side (a t needs two)."""
    return k >= 4 and m >= 4 and k % 2 == 0 and m % 2 == 0


def halves(order: Sequence[int], m: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(assigned 1, assigned 2, controls 1, controls 2)``: the drawn steps ``order`` (in their drawn order, so
    either half is a uniform draw) split in two, each half sorted, and the control indices ``range(m)`` in two."""
    k1 = len(order) // 2
    return sorted(order[:k1]), sorted(order[k1:]), list(range(m // 2)), list(range(m // 2, m))


@dataclass(frozen=True)
class Staged:
    """What decided a staged screen: ``gain`` (the half's when a half decided, else the whole test's; ``passes``:
    every forward pass of the screen, the reference's included), the power ``reference`` measured (half or whole,
    None when not needed; of borrowed references the one that decided: the first without power, else the lowest),
    ``power`` (the gap as the stages decided it; None: compare ``reference``'s t as
    :func:`~geomesh_p2p.trust.verify_check.gain_decides` does) and ``stage`` (the verdict's note; "" for none)."""

    gain: GainStats
    reference: Optional[GainStats] = None
    power: Optional[bool] = None
    stage: str = ""
    #: borrowed references ``reference`` stands for, when they lent the power the checker's own lacked (0: none)
    borrowed: int = 0
    #: the per-batch statistic's power, where the whole t passed and ``low`` did not (session 50,
    #: :mod:`~.gain_batches`; None: not measured)
    low_power: Optional[bool] = None


def staged_gain(
    cfg: VerifyConfig,
    task: VerifyTask,
    rt: Optional[VerifyTask],
    packets: Mapping[str, Mapping[int, Any]],
    rows: RowsFn,
    cache: Optional[dict],
    *,
    tokens: int,
    borrowed: Sequence[VerifyTask] = (),
    fallback: Sequence[VerifyTask] = (),
) -> Staged:
    """A screen's loss-gain test in two stages (module docstring): the first half of the drawn batches against the
    first half of the controls; a half's t at or above ``gain_t_min``'s stage bound passes; one below
    ``gain_t_hard``'s fails when the power reference's half (``rt``: the checker's own contribution,
    :func:`~geomesh_p2p.trust.verify_task.reference_task`) clears the gap's stage bound and the contribution holds
    ``tokens`` >= ``gain_min_tokens``; anything else runs the whole test on the same rows (the same t as an unstaged
    screen, to the bit), then, below ``gain_t_min``, the reference a half at a time. Forward passes: ``2 x (k/2 +
    m/2)`` for a half that passes (``k + m/2`` with the controls cached), ``k + m/2`` more for the reference's
    half; a screen no half decides costs what an unstaged one does. ``cache``: the round's (control losses, the
    reference's half and whole).

    ``borrowed`` (``rt`` None: the checker sent nothing, session 44; :func:`~.verify_task.borrowed_references`):
    other contributions of the round, each measured as ``rt`` would be; the test has power only when every one of
    them shows it (each on its own bound, stopping at the first that does not), never otherwise. ``fallback``
    (session 45; ``rt`` given): the same borrowed references, measured only when the checker's own reference shows
    no power at the whole test (a reference of many more steps is scaled down to the accused's: a benchmark screener
    with a 5.05 reference passed the poisoner as inconclusive while the two others failed it); power then as for
    ``borrowed``. Raises what ``rows`` raises."""
    kappa = cfg.gain_stage_kappa
    refs = [rt] if rt is not None else list(borrowed)
    order = gain_order(task, cfg.gain_assigned)
    s1, s2, c1, c2 = halves(order, cfg.gain_controls)
    mine = packets[task.accused]
    got, passes = rows(task, mine, s1, c1)
    steps = int(task.steps_done)
    half = gain_of(got[: len(s1)], got[len(s1) :], steps=steps, passes=passes, at=s1, **low_kw(cfg))
    note = f"; decided on half its batches ({len(s1)} of {len(order)}, {len(c1)} of {cfg.gain_controls} controls)"
    if half.t >= stage_bounds(cfg.gain_t_min, kappa)[1] and half_may_pass(
        cfg, got[: len(s1)], got[len(s1) :], s1, order, steps
    ):
        return Staged(half, stage=note)
    ref_halves: dict[int, GainStats] = {}  # index in refs -> its first half, measured once
    ref_steps = [_reference_steps(cfg, r) for r in refs]
    fails = half.t < stage_bounds(cfg.gain_t_hard, kappa)[0] and tokens >= cfg.gain_min_tokens
    firsts = [st[0] for st in ref_steps if st is not None]
    if refs and len(firsts) == len(refs) and fails:
        early = []
        for i, r in enumerate(refs):
            ref_halves[i] = _reference_half(r, packets, rows, firsts[i], c1, cache, low_kw(cfg))
            passes += ref_halves[i].passes
            s = _scale(half.steps, ref_halves[i].steps)
            if s * ref_halves[i].t - half.t < stage_bounds(cfg.gain_t_gap, kappa, math.sqrt(1.0 + s * s))[1]:
                break
            early.append(ref_halves[i])
        if len(early) == len(refs):  # both halves decide (every reference's, when borrowed)
            low = min(early, key=lambda g: _scale(half.steps, g.steps) * g.t)
            return Staged(dataclasses.replace(half, passes=passes), low, True, note + _borrowed_note(borrowed, rt))
    more, extra = rows(task, mine, s2, c2)
    passes += extra
    by_step = dict(zip(s1 + s2, got[: len(s1)] + more[: len(s2)]))
    at = sorted(order)
    whole = gain_of([by_step[j] for j in at], got[len(s1) :] + more[len(s2) :], steps=steps, at=at, **low_kw(cfg))
    if (whole.t >= cfg.gain_t_min and not low_fails(cfg, whole)) or not refs:
        return Staged(dataclasses.replace(whole, passes=passes))
    if low_fails(cfg, whole):  # fails batch by batch: the references' low decide its power (session 50)
        lent = _low_power(cfg, refs, whole, packets, rows, c1, c2, cache)
        if rt is not None and not lent.power and fallback:  # as for the t: the others' may show the power
            more_lent = _low_power(cfg, fallback, whole, packets, rows, c1, c2, cache)
            lent = _Lent(more_lent.power, more_lent.reference, lent.passes + more_lent.passes)
        passes += lent.passes
        hard = lent.power and whole.low is not None and whole.low < cfg.gain_low_hard
        if whole.t >= cfg.gain_t_min or hard:  # (a hard per-batch failure outranks a marginal t: no t power needed)
            whole = dataclasses.replace(whole, passes=passes)
            return Staged(whole, lent.reference, stage=_borrowed_note(borrowed, rt), low_power=lent.power)
    if rt is None:  # borrowed: power only when every reference shows it
        lent = _lent_power(cfg, refs, whole, packets, rows, c1, c2, cache, ref_halves)
        whole = dataclasses.replace(whole, passes=passes + lent.passes)
        return Staged(whole, lent.reference, lent.power, _borrowed_note(borrowed, rt))
    ref, p, on_half, extra = _power(cfg, rt, ref_steps[0], ref_halves.get(0), whole, packets, rows, c1, c2, cache)
    whole = dataclasses.replace(whole, passes=passes + extra)
    if not p and fallback:  # the own reference has no power here: the others' may (both must show it)
        lent = _lent_power(cfg, fallback, whole, packets, rows, c1, c2, cache)
        whole = dataclasses.replace(whole, passes=whole.passes + lent.passes)
        if lent.power:
            return Staged(whole, lent.reference, True, _lent_note(fallback), borrowed=len(fallback))
    own = ref_steps[0]
    if on_half and own is not None:  # the reference's half decided the gap on its own
        n = len(own[0])
        return Staged(whole, ref, p, f"; power decided on half its own batches ({n} of {n + len(own[1])})")
    return Staged(whole, ref)


def _power(cfg, rt: VerifyTask, steps_, ref_half, whole: GainStats, packets, rows: RowsFn, c1, c2, cache):
    """``(the reference's test, whether it shows power against ``whole``, decided on its half, passes run)``: its
    half decides beyond the stage bounds of ``(whole.t + gain_t_gap) / s``, else its whole test (``gain_decides``'
    rule); a reference of an odd number of batches (``steps_`` None) is measured whole, as unstaged."""
    gap = cfg.gain_t_gap
    if steps_ is None:
        ref = _reference_whole(
            rt, packets, rows, (sorted(gain_order(rt, cfg.gain_assigned)), []), c1 + c2, [], cache, low_kw(cfg)
        )
        return ref, _scale(whole.steps, ref.steps) * ref.t >= whole.t + gap, False, ref.passes
    passes = 0
    if ref_half is None:
        ref_half = _reference_half(rt, packets, rows, steps_[0], c1, cache, low_kw(cfg))
        passes = ref_half.passes
    s = _scale(whole.steps, ref_half.steps)
    lo, hi = stage_bounds((whole.t + gap) / s, cfg.gain_stage_kappa)
    if ref_half.t >= hi or ref_half.t < lo:
        return ref_half, ref_half.t >= hi, True, passes
    ref = _reference_whole(rt, packets, rows, steps_, c1, c2, cache, low_kw(cfg))
    return ref, s * ref.t >= whole.t + gap, False, passes + ref.passes


@dataclass(frozen=True)
class _Lent:
    """Borrowed references measured against a whole test: ``power`` (every one showed it), the deciding
    ``reference`` (the lowest, or the first without power) and the forward ``passes`` they took."""

    power: bool
    reference: Optional[GainStats]
    passes: int


def _lent_power(
    cfg, refs: Sequence[VerifyTask], whole: GainStats, packets, rows: RowsFn, c1, c2, cache, halves=None
) -> _Lent:
    """:func:`_power` of each of ``refs`` against ``whole`` in turn, stopping at the first without power (``halves``:
    index in ``refs`` -> its first half, already measured)."""
    decided: list[GainStats] = []
    passes = 0
    for i, r in enumerate(refs):
        half = (halves or {}).get(i)
        ref, p, _, extra = _power(cfg, r, _reference_steps(cfg, r), half, whole, packets, rows, c1, c2, cache)
        passes += extra
        if not p:
            return _Lent(False, ref, passes)
        decided.append(ref)
    low = min(decided, key=lambda g: _scale(whole.steps, g.steps) * g.t) if decided else None
    return _Lent(bool(decided), low, passes)


def _low_power(cfg, refs: Sequence[VerifyTask], whole: GainStats, packets, rows: RowsFn, c1, c2, cache) -> _Lent:
    """The per-batch statistic's power (:func:`~.gain_batches.low_power`) of each of ``refs``' whole tests against
    ``whole``, stopping at the first without it: every one must show it (``_Lent``)."""
    passes, decided = 0, []
    for r in refs:
        halves_ = _reference_steps(cfg, r) or (sorted(gain_order(r, cfg.gain_assigned)), [])
        cs = (c1, c2) if halves_[1] else (c1 + c2, [])
        ref = _reference_whole(r, packets, rows, halves_, cs[0], cs[1], cache, low_kw(cfg))
        passes += ref.passes
        if not low_power(cfg, whole, ref):
            return _Lent(False, ref, passes)
        decided.append(ref)
    return _Lent(bool(decided), min(decided, key=lambda g: g.low or 0.0) if decided else None, passes)


def _lent_note(refs: Sequence[VerifyTask]) -> str:
    """The verdict's note when borrowed references lent the power the checker's own reference lacked."""
    return f"; power from {len(refs)} other contributions of the round (this checker's own had none at its steps)"


def _borrowed_note(borrowed: Sequence[VerifyTask], rt: Optional[VerifyTask]) -> str:
    """The verdict's note on borrowed references ("" for the checker's own)."""
    if rt is not None or not borrowed:
        return ""
    return f"; power from {len(borrowed)} other contributions of the round (this checker sent none)"


def _scale(steps: int, ref_steps: int) -> float:
    """``gain_decides``' scale of a reference of ``ref_steps`` steps against a contribution of ``steps``: in (0, 1]."""
    return math.sqrt(steps / ref_steps) if steps > 0 and ref_steps > steps else 1.0


def _reference_steps(cfg: VerifyConfig, rt: VerifyTask) -> Optional[tuple[list[int], list[int]]]:
    """The two halves of the reference's drawn steps; None when its test cannot be staged (then no half decides and
    the screen runs unstaged from the whole test on: its reference is left to ``reference_gain``'s rule)."""
    order = gain_order(rt, cfg.gain_assigned)
    if not can_stage(len(order), cfg.gain_controls):
        return None
    s1, s2, _, _ = halves(order, cfg.gain_controls)
    return s1, s2


def _ref_key(rt: VerifyTask) -> tuple:
    """``verify_check.reference_gain``'s cache key of ``rt`` (a whole reference measured either way is shared)."""
    return ("reference", rt.round, rt.accused, rt.parts, rt.batch_size, rt.seq_len, rt.element_seed)


def _reference_half(
    rt: VerifyTask, packets, rows: RowsFn, steps, controls, cache: Optional[dict], kw: Optional[dict] = None
) -> GainStats:
    """The reference's first half, kept in ``cache`` with its rows for the round's other screens and its whole
    (``passes`` 0 when it was kept)."""
    key = _ref_key(rt) + ("half",)
    if cache is not None and key in cache:
        return dataclasses.replace(cache[key], passes=0)
    got, passes = rows(rt, packets[rt.accused], steps, controls)
    ref = gain_of(got[: len(steps)], got[len(steps) :], steps=int(rt.steps_done), passes=passes, at=steps, **(kw or {}))
    if cache is not None:
        cache[key] = ref
        cache[key + ("rows",)] = got
    return ref


def _reference_whole(
    rt: VerifyTask, packets, rows: RowsFn, halves_, c1, c2, cache: Optional[dict], kw: Optional[dict] = None
) -> GainStats:
    """The reference's whole test (``reference_gain``'s statistic: the same rows in the same order), its first
    half's rows reused (``halves_``: its steps in two; the second empty when the reference is not staged, then ``c1``
    holds every control); kept in ``cache`` under ``reference_gain``'s key (``passes`` 0 when it was kept). ``kw``:
    :func:`~.gain_batches.low_kw` (``low`` as ``reference_gain`` measures it)."""
    key = _ref_key(rt)
    if cache is not None and key in cache:
        return dataclasses.replace(cache[key], passes=0)
    s1, s2 = halves_
    first = cache.get(key + ("half", "rows")) if cache is not None and s2 else None
    passes = extra = 0
    if first is None:
        first, passes = rows(rt, packets[rt.accused], s1, c1)
    more: list[list[float]] = []
    if s2 or c2:
        more, extra = rows(rt, packets[rt.accused], s2, c2)
    by_step = dict(zip(s1 + s2, first[: len(s1)] + more[: len(s2)]))
    at = sorted(s1 + s2)
    ref = gain_of(
        [by_step[j] for j in at], first[len(s1) :] + more[len(s2) :], steps=int(rt.steps_done),
        passes=passes + extra, at=at, **(kw or {}),
    )  # fmt: skip
    if cache is not None:
        cache[key] = ref
    return ref
