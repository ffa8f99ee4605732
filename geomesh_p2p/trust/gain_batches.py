"""The loss-gain test batch by batch: partial work (issue 28, session 50).

Why. The gain test's t (:mod:`geomesh_p2p.trust.gain`) is one Welch t over the rows of all the drawn batches, so one
strongly trained batch among the 8 drawn carries it: a contributor that trained only its last step of 20 (5% of the
work) and claimed all 20 measured t 3.30 and passed (red team, session 15). Claimed work larger than done work is also
what weights a contribution in the token-weighted mean (its token claim is ``steps x batch x seq_len``, and the steps
the test draws are those the claim implies), so this rule is what checks a token claim against the batches that show
a gain.

The statistic (``GainStats.low``, :func:`~geomesh_p2p.trust.gain.settled_low`): of the drawn batches with at least
``VerifyConfig.gain_settle_steps`` = 4 steps after them in the claim (AdamW applies a batch's gradient through its first
moment, 1 - 0.9^n of it after n steps, so an honest contribution's last steps are barely in it), the lower half by mean
row gain (at least 2 batches), Welch's t of their rows against every control row. An honest contribution trained on
every batch shows an excess on each, so on its lower half too; a partial one's lower half is text it never trained on.

The rule (:func:`low_outcome`): on a contribution whose whole t does not fail (``t >= gain_t_hard``), ``low <
gain_low_hard`` fails hard, ``low < gain_low_min`` is marginal, each only where the test has power batch by batch in
the round: the power reference (the checker's own contribution, or the borrowed ones) reaches a ``low`` at least
``gain_t_gap`` above the accused's (:func:`low_power`, the same scaling by steps as ``gain_decides``), and the
contribution holds ``gain_min_tokens``. Thresholds from ``benchmarks/verify_gain.py`` (tiny preset, rounds 2-11, H = 20
and 40, batch 8 and 4; docs/security.md, "Partial work passes"): honest ``low`` >= 1.64 (batch 8) and 0.55 (batch 4) in
1,600 draws each, partial work at f = 0.25 below 0 in 72-79 % of them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from geomesh_p2p.trust.gain import GainStats, welch_t
from geomesh_p2p.trust.verify_task import VerifyConfig

__all__ = ["low_kw", "low_fails", "low_power", "low_outcome", "settled_count", "half_may_pass"]


def low_kw(cfg: VerifyConfig) -> dict:
    """:func:`~geomesh_p2p.trust.gain.gain_of`'s (and ``gain_stats``') keywords for ``low`` under ``cfg``."""
    return {"settle": int(cfg.gain_settle_steps), "share": float(cfg.gain_low_share)}


def low_fails(cfg: VerifyConfig, gain: Optional[GainStats]) -> bool:
    """Whether ``gain`` does not fail the whole test hard (``t >= gain_t_hard``: a marginal t too) but fails the
    per-batch one (``low < gain_low_min``; a ``low`` of None, not measured, never fails)."""
    return gain is not None and gain.t >= cfg.gain_t_hard and gain.low is not None and gain.low < cfg.gain_low_min


def low_power(cfg: VerifyConfig, gain: GainStats, reference: Optional[GainStats], tokens: Optional[int] = None) -> bool:
    """Whether the per-batch statistic may decide in its round: ``reference`` (an honest contribution of the round,
    :func:`~geomesh_p2p.trust.verify_check.reference_gain`) reaches a ``low`` at least ``gain_t_gap`` above
    ``gain.low``, the reference scaled by ``sqrt(gain.steps / reference.steps)`` when it holds more steps (as
    :func:`~geomesh_p2p.trust.verify_check.gain_decides`); False without a reference or either ``low``, or under
    ``gain_min_tokens``."""
    if tokens is not None and tokens < cfg.gain_min_tokens:
        return False
    if reference is None or reference.low is None or gain.low is None:
        return False
    scale = math.sqrt(gain.steps / reference.steps) if gain.steps > 0 and reference.steps > gain.steps else 1.0
    return reference.low * scale >= gain.low + cfg.gain_t_gap


def low_outcome(
    cfg: VerifyConfig,
    gain: Optional[GainStats],
    reference: Optional[GainStats],
    tokens: Optional[int] = None,
    power: Optional[bool] = None,
) -> Optional[tuple[str, str]]:
    """``("fail" | "marginal" | "inconclusive", reason)`` of the per-batch rule (module docstring), or None where it
    does not apply (the whole t below ``gain_t_hard``, which its own rule decides, or ``low`` passing or not
    measured). ``power``: the reference's comparison as decided elsewhere (a staged screen's references), instead
    of ``reference``'s ``low``."""
    if gain is None or gain.low is None or not low_fails(cfg, gain):
        return None
    ref = f"; power reference low {reference.low:.2f}" if reference is not None and reference.low is not None else ""
    what = (
        f"its weakest settled batches show no loss gain: low t {gain.low:.2f} (whole t {gain.t:.2f}{ref}): "
        f"trained a part of the batches its {gain.steps} steps claim"
    )
    decided = power if power is not None else low_power(cfg, gain, reference, tokens)
    if tokens is not None and tokens < cfg.gain_min_tokens:
        decided = False
    if not decided:
        return "inconclusive", f"inconclusive: low t {gain.low:.2f}, but no power batch by batch this round{ref}"
    return ("fail" if gain.low < cfg.gain_low_hard else "marginal"), what


def settled_count(steps: Sequence[int], claimed: int, cfg: VerifyConfig) -> int:
    """How many of the drawn ``steps`` have at least ``gain_settle_steps`` steps after them in a claim of ``claimed``
    (the batches ``low`` is measured on)."""
    return sum(1 for j in steps if int(j) < claimed - cfg.gain_settle_steps)


def half_may_pass(
    cfg: VerifyConfig,
    assigned: Sequence[Sequence[float]],
    controls: Sequence[Sequence[float]],
    at: Sequence[int],
    order: Sequence[int],
    claimed: int,
) -> bool:
    """Whether a staged screen's first half (its ``assigned`` batches' row gains, steps ``at``, against ``controls``),
    whose t reaches the pass bound, may pass the screen on its own: the whole test measures no ``low`` (fewer than 2
    settled batches among the drawn ``order`` of a claim of ``claimed``), or every settled batch of the half shows
    its own excess, Welch's t of its rows against the half's control rows at ``gain_low_stage`` or more (else the
    rest runs and the whole test's ``low`` decides). A half's lower half would be 2 batches, one strongly trained
    batch carrying it as it carried the whole t (the unit test's free rider that trained 3 of 10 batches passed so)."""
    if settled_count(order, claimed, cfg) < 2:
        return True
    kept = [b for b, j in zip(assigned, at) if int(j) < claimed - cfg.gain_settle_steps]
    rows = [g for c in controls for g in c]
    if not kept or len(rows) < 2 or any(len(b) < 2 for b in kept):
        return False
    return min(welch_t(b, rows) for b in kept) >= cfg.gain_low_stage
