"""Adaptive workload balancing (AWB): :func:`plan_round`.

AWB is the "adaptive workload balancing" half of GeoMesh (arXiv 2609.18388, "GeoMesh:
Workload-Balanced and Sign-Compressed Geo-Distributed LLM Training"); DESIGN.md, "Round r", step 2.
The round leader turns the members' announced :class:`~geomesh_p2p.schema.peer.PeerRecord` s into a
:class:`~geomesh_p2p.plan.schema.RoundPlan`: per peer a batch size and a number of inner steps such that every peer's
compute plus its own communication fills the same sync window ``T``, so that fast GPUs do more
useful work instead of idling at the barrier. Everything here is a pure, deterministic function
of its inputs (no clock, no I/O, no randomness): the same records and config give the same plan
bytes whatever the order of the records.

The model (units: sequences, tokens, seconds, bytes, bytes/s)
--------------------------------------------------------------
For each peer ``i`` (records sorted by ``peer_id``):

* **Micro-batch** ``m_i``: the measured batch size with the highest tokens/s among those that fit
  in memory (``<= max_batch``); ties go to the larger batch. With no measured batch that fits,
  ``m_i = max_batch`` with interpolated throughput (see :func:`interpolate_tokens_per_s`).
* **Batch per inner step** ``b_i = m_i * a_i`` with ``a_i = ceil(target_batch / m_i)`` gradient
  accumulation steps: ``target_batch`` is a floor on the sequences per optimizer step (micro-batched
  when it does not fit or when a smaller micro-batch is faster); a peer whose best micro-batch is
  larger than ``target_batch`` uses it whole (the paper's "batch that fits its memory").
* **Step time** ``s_i = b_i * seq_len / tps_i(m_i)`` seconds.
* **Communication time** ``c_i = 2 * latency_s + payload_bytes / upload_bps_i +
  payload_bytes / download_bps_i``. The sum, not the max: the collective has two *sequential*
  phases (push the parts to their owners, then pull the aggregates, which exist only once every
  contribution to a part has arrived), the first bound by the upload link and the second by the
  download link, each paying one request latency. Overlap of the two directions happens only on
  the owners' side and is already counted by the caller in ``payload_bytes``.
* **Window** ``T``:

  - ``target_tokens_per_round`` set: the smallest ``T`` at which the planned budgets sum to at least
    the target (``window_s``, if also set, caps it);
  - else ``window_s`` set: that window;
  - else ``target_inner_steps`` set (the run's ``--window-s auto``): :func:`auto_window`, the time the
    median peer needs for that many steps plus its communication, at least ``AUTO_WINDOW_MIN_S``;
  - else ``T = max_i c_i / comm_share`` (communication over the slowest link is ``comm_share`` of
    the round);

  and always ``T >= max_i (c_i + min_inner_steps * s_i)`` so that the slowest peer fits its minimum
  number of steps (an explicit ``window_s`` that is too short is stretched). Whole steps leave each
  peer up to one step of slack; the planner then moves ``T`` within ``window_slack`` of that value
  (never above an explicit ``window_s``, nor above a token target that the minimum steps already
  exceed) to the candidate that minimises the largest idle fraction.
  Candidates are the instants where some peer finishes a whole step, so the last finisher ends
  exactly at ``T``.
* **Inner steps** ``H_i = clip(floor((T - c_i) / s_i), min_inner_steps, max_inner_steps)``, token
  budget ``b_i * seq_len * H_i``, predicted idle ``idle_i = T - (H_i * s_i + c_i)`` and straggler
  idle fraction ``idle_i / T``. Unclipped, ``0 <= idle_i < s_i``.
"""

from __future__ import annotations

import math
import statistics
from typing import Collection, Iterable, Mapping, Optional, Sequence

import numpy as np

from geomesh_p2p.config import method as _method
from geomesh_p2p.plan.assign import PlanMeta, build_plan, probation_ids
from geomesh_p2p.plan.bounds import bound_records, budget_limit, check_records, evidence_ceilings
from geomesh_p2p.plan.cost import (
    PeerModel,
    best_micro_batch,
    inner_steps,
    interpolate_tokens_per_s,
    ranks_of,
    step_and_comm,
)
from geomesh_p2p.plan.schema import PlanConfig, RoundPlan
from geomesh_p2p.plan.views import FLOOR_REACH_SLACK, floor_grace_of, min_steps_of
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR

_MAX_BREAKPOINTS_PER_PEER = 1000

#: The shortest window :func:`auto_window` chooses, seconds (the fixed default before it, issue 27): a round's
#: own costs (gather, plan, digest check) are a second or two, so a tiny model's round stays mostly compute.
AUTO_WINDOW_MIN_S = 6.0


def auto_window(s: np.ndarray, c: np.ndarray, cfg: PlanConfig) -> float:
    """The base window (seconds) of ``--window-s auto`` (issue 27, "defaults that fit the model"):
    ``max(AUTO_WINDOW_MIN_S, median_low_i(c_i + H * s_i))`` with ``H = cfg.target_inner_steps``, ``s_i`` the
    peers' step times and ``c_i`` their communication times (float64 arrays, seconds). The median (the
    lower one for an even count) peer then fits ``H`` steps; faster peers fit more, slower ones fewer, and
    half the peers or fewer claiming to be slow cannot stretch the round (claims are bounded before, ``bound_records``).
    E.g. one peer at 6.6 s a step (gpt2-124m on one CPU thread, batch 8) and 0.5 s of exchange, H = 30:
    198.5 s. Raises ValueError when ``cfg.target_inner_steps`` is None or there is no peer."""
    H = cfg.target_inner_steps
    if H is None or len(s) == 0:
        raise ValueError("auto_window needs cfg.target_inner_steps and at least one peer")
    need = sorted(float(ci + H * si) for si, ci in zip(s, c))
    # The lower median: exactly half the peers claiming to be slow (bound_records caps claims from above
    # only) stretched everyone's window with the upper one (red team, session 15: 2 of 4 claiming 15 s a step
    # gave 427.5 s against 60 s).
    return max(AUTO_WINDOW_MIN_S, statistics.median_low(need))


def _best_in_window(record: PeerRecord, current: "PeerModel", T: float, cfg: PlanConfig) -> "PeerModel":
    """The micro-batch (among measured ones that fit memory) training the most tokens within ``T``."""
    best, best_tokens = current, None
    for micro in sorted(b for b in record.tokens_per_s if b <= record.max_batch):
        m = current if micro == current.micro else PeerModel(record, cfg, micro)
        h = int(inner_steps(np.float64(T), np.array([m.step_s]), np.array([m.comm_s]), cfg)[0])
        if h * m.step_s + m.comm_s > T * (1 + 1e-9):
            continue  # does not fit even its minimum steps
        tokens = h * m.batch
        if best_tokens is None or tokens > best_tokens or (tokens == best_tokens and m is current):
            best, best_tokens = m, tokens
    return best


def _window_for_tokens(s, c, tokens_per_step, T_lo: float, cfg: PlanConfig) -> float:
    """Smallest T >= T_lo whose planned budgets sum to >= the target (or all peers at max steps)."""
    target = cfg.target_tokens_per_round
    assert target is not None  # called only for a run with a token target (choose_window)

    def tokens(T: float) -> int:
        return int((inner_steps(np.float64(T), s, c, cfg) * tokens_per_step).sum())

    T_hi = float(np.max(c + cfg.max_inner_steps * s))
    if T_hi <= T_lo or tokens(T_lo) >= target:
        return T_lo
    if tokens(T_hi) < target:
        return T_hi
    lo, hi = T_lo, T_hi  # tokens(lo) < target <= tokens(hi)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if tokens(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def choose_window(s: np.ndarray, c: np.ndarray, tokens_per_step: np.ndarray, cfg: PlanConfig) -> float:
    """The sync window T (seconds) for AWB; see the module docstring. At most ``cfg.max_window_s``: a window
    stretched for the slowest peer's minimum steps past what followers accept made every follower (the leader
    too) refuse every plan, and 32 peer processes on 2 cores (re-profiled at a few tokens/s) split into two
    lineages (issue 25); capped, the slowest peers train fewer steps than their minimum (the train deadline
    stops them) and the round is long but held."""
    T = _choose_window(s, c, tokens_per_step, cfg)
    return T if cfg.max_window_s is None else min(T, cfg.max_window_s)


def _choose_window(s: np.ndarray, c: np.ndarray, tokens_per_step: np.ndarray, cfg: PlanConfig) -> float:
    T_feasible = float(np.max(c + cfg.min_inner_steps * s))
    slack = cfg.window_slack
    if cfg.target_tokens_per_round is not None:
        T_base = _window_for_tokens(s, c, tokens_per_step, T_feasible, cfg)
        lo, hi = T_base * (1 - slack), T_base * (1 + slack)
        if T_base <= T_feasible:
            hi = T_base  # the minimum steps already overshoot the target: do not add more
        if cfg.window_s is not None:
            T_base = min(T_base, cfg.window_s)
            hi = min(hi, cfg.window_s)
            lo = min(lo, hi)
    elif cfg.window_s is not None:
        T_base = cfg.window_s
        lo, hi = T_base * (1 - slack), T_base
    elif cfg.target_inner_steps is not None:
        T_base = auto_window(s, c, cfg)
        lo, hi = max(AUTO_WINDOW_MIN_S, T_base * (1 - slack)), T_base * (1 + slack)  # never under the floor
    else:
        T_base = float(np.max(c)) / cfg.comm_share
        lo, hi = T_base * (1 - slack), T_base * (1 + slack)
    lo = max(lo, T_feasible)
    hi = max(hi, lo)
    T_base = min(max(T_base, lo), hi)
    if hi == lo:
        return lo

    # candidate windows: the instants at which some peer completes a whole step, within [lo, hi]
    cands = [lo, hi, T_base]
    for s_i, c_i in zip(s, c):
        k_lo = max(math.ceil((lo - c_i) / s_i), cfg.min_inner_steps)
        k_hi = min(math.floor((hi - c_i) / s_i), cfg.max_inner_steps)
        if k_hi < k_lo or k_hi - k_lo > _MAX_BREAKPOINTS_PER_PEER:
            continue  # none in range, or so many that this peer's idle is negligible anyway
        cands.extend((c_i + np.arange(k_lo, k_hi + 1) * s_i).tolist())
    Ts = np.unique(np.clip(np.asarray(cands, dtype=np.float64), lo, hi))
    H = inner_steps(Ts[:, None], s[None, :], c[None, :], cfg)
    finish = H * s[None, :] + c[None, :]
    ok = np.all(finish <= Ts[:, None] * (1 + 1e-9), axis=1)
    worst = np.max((Ts[:, None] - finish) / Ts[:, None], axis=1)
    worst = np.where(ok, worst, np.inf)
    best = float(np.min(worst))
    if not math.isfinite(best):
        return T_base
    # among the (near-)best, prefer the one closest to the base window, then the shorter
    pick = min(
        (i for i in range(len(Ts)) if worst[i] <= best + 1e-12),
        key=lambda i: (abs(Ts[i] - T_base), Ts[i]),
    )
    return float(Ts[pick])


def plan_round(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    run_id: str,
    round: int,
    leader: str,
    numel: int,
    start_time: float,
    start_digest: Optional[str] = None,
    created_at: Optional[float] = None,
    supported_tokens_per_s: Optional[Mapping[str, float]] = None,
    probation: Collection[str] = (),
    share_among: Optional[int] = None,
    late_tokens_per_s: Optional[Mapping[str, float]] = None,
) -> RoundPlan:
    """Plan a round with adaptive workload balancing (GeoMesh's AWB; see the module docstring).

    Every peer gets the batch size that fits its memory at its best measured tokens/s and the
    number of inner steps ``H_i = clip(floor((T - c_i) / s_i), min, max)`` that fills the common
    window ``T`` (seconds) with its compute (``H_i * s_i``) plus its communication (``c_i``), so
    its predicted idle ``T - H_i s_i - c_i`` is under one step. ``numel``: elements of the flat
    parameter vector to partition; ``start_time``: unix seconds the round starts (deadlines are
    ``start_time + T`` and that ``+ exchange_timeout_s``); ``created_at`` defaults to
    ``start_time`` so that the plan is a pure function of its inputs.

    Claims are bounded first (:func:`bound_records`). ``supported_tokens_per_s`` (peer_id ->
    tokens/s), when the leader has it, is what each peer's last delivered contribution supports
    (tokens delivered / compute seconds planned for it); a peer is then planned at no more than
    ``EVIDENCE_GROWTH`` x that rate, and a peer without one (a newcomer) at no more than the lower
    median of those rates (:func:`~geomesh_p2p.plan.bounds.evidence_ceilings`; followers check it):
    ``late_tokens_per_s`` (peer id -> tokens/s) lowers the ceiling of the peers that contributed to no part of a recent
    round (late pushes, no-shows: :func:`~geomesh_p2p.plan.bounds.late_ceiling`), so a late peer gets less work;
    its ``H_i`` is lowered, the window ``T`` is not (followers recompute ``T`` from the records alone). Finally no budget exceeds ``BUDGET_MEDIAN_FACTOR`` x the
    lower-median budget (x ``ranks`` for a multi-rank peer: per device) unless it is ``min_inner_steps`` steps of its batch.
    ``share_among``: no owner's part over a fair share among that many (the possible owners a follower that holds
    none of the leader's owner bars counts: :func:`~geomesh_p2p.plan.bounds.follower_owner_count`), where the owners
    can hold the vector at that cap.

    The result does not depend on the order of ``records``. Raises ValueError for no peers, a
    duplicate peer_id, a peer with no measured throughput or a non-positive bandwidth (the message
    names the peer and field), no peer that accepts connections, or ``numel < 0``.
    """
    recs = bound_records(check_records(records))
    models = [PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
    s, c = step_and_comm(models)
    tokens_per_step = np.array([m.batch * cfg.seq_len for m in models], dtype=np.int64)
    T = choose_window(s, c, tokens_per_step, cfg)
    # Step granularity: with few, long steps a peer can lose most of a step to rounding. Once T is
    # known, each peer takes the measured micro-batch that trains the most tokens inside T (ties:
    # the throughput-optimal one), which can be a smaller, slightly less efficient batch.
    models = [_best_in_window(r, m, T, cfg) for r, m in zip(recs, models)]
    if supported_tokens_per_s:
        models = _bound_by_evidence(recs, models, supported_tokens_per_s, cfg, late_tokens_per_s)
    s, c = step_and_comm(models)
    probation = probation_ids(recs, probation)
    # a contributor the round screens gets the steps its loss-gain test needs (session 45), before the caps (which
    # keep them) so that the plan's median is the one the caps used (the followers' under-plan check recomputes it)
    # ... where those steps end by the train deadline plus the floor's grace (red team of session 45: a floor no
    # honest peer reaches counted every claim of the round 0)
    mode = _method.round_mode(cfg.mode, len(recs), cfg.method)
    reach_s = T + floor_grace_of(T, cfg.exchange_timeout_s)
    median_batch = statistics.median_low([m.batch for m in models])  # over it: no raise past the caps
    floors = [
        min_steps_of(
            cfg,
            round=round,
            mode=mode,
            probation=m.peer_id in probation,
            batch_size=m.batch,
            step_s=m.step_s,
            comm_s=m.comm_s,
            reach_s=reach_s,
            slack=FLOOR_REACH_SLACK,
            median_batch=median_batch,
        )
        for m in models
    ]
    H = np.maximum(inner_steps(np.float64(T), s, c, cfg), np.asarray(floors, dtype=np.int64))
    ranks = [ranks_of(r) for r in recs]
    H = _cap_budgets(models, H, cfg, ranks, floors)
    if probation:
        H = _cap_budgets(models, _cap_probation(models, H, cfg, probation, floors), cfg, ranks, floors)
    meta = PlanMeta(run_id, round, leader, numel, start_time, start_digest, created_at, share_among)
    return build_plan(recs, models, H, T, cfg, meta, probation, equal=False)


def _bound_by_evidence(
    recs: Sequence[PeerRecord],
    models: list[PeerModel],
    supported: Mapping[str, float],
    cfg: PlanConfig,
    late: Optional[Mapping[str, float]] = None,
) -> list[PeerModel]:
    """Models whose step time is at least what the peer's delivered work allows (:func:`evidence_ceilings`:
    ``EVIDENCE_GROWTH`` x its delivered rate, a newcomer the lower median of the delivered rates). Longer
    steps only: the record can only lower the rate; with no usable evidence at all the models stay."""
    ceilings = evidence_ceilings([r.peer_id for r in recs], supported, late)
    return [_at_evidence(r, m, ceilings.get(r.peer_id), cfg) for r, m in zip(recs, models)]


def _at_evidence(record: PeerRecord, m: PeerModel, ceiling: Optional[float], cfg: PlanConfig) -> PeerModel:
    """``m`` at a step time of at least ``m.batch x seq_len / ceiling`` (tokens/s; None: ``m`` as it is)."""
    if ceiling is not None and interpolate_tokens_per_s(record.tokens_per_s, m.micro) > ceiling:
        return m.with_step_s(m.batch * cfg.seq_len / ceiling)
    return m


def window_fit(record: PeerRecord, T: float, cfg: PlanConfig, ceiling: Optional[float] = None) -> tuple[int, int]:
    """(whole steps, tokens per step) the peer of ``record`` fits in window ``T`` (seconds) as :func:`plan_round`
    plans it before the budget caps (the 8x median, probation): the micro-batch that trains the most tokens in
    ``T``, its step time at no less than ``ceiling`` tokens/s allows (delivered work, ``evidence_ceilings``; None:
    none), then ``floor((T - c) / s)`` up to ``max_inner_steps``, *not* raised to ``min_inner_steps``: 0 steps
    when that micro-batch does not fit its minimum steps (the leader then plans the minimum steps of whichever
    micro-batch, a budget no window bounds). ``record`` is bounded as the leader's are (:func:`bound_records`).
    The steps are monotone in the record's figures (a faster record fits as many tokens or more), so followers
    check each participant against this fit at a slower view of its record
    (:func:`~geomesh_p2p.plan.planner.check_plan`, session 36)."""
    m = _best_in_window(record, PeerModel(record, cfg, best_micro_batch(record)), T, cfg)
    tokens = m.batch * cfg.seq_len
    if cfg.min_inner_steps * m.step_s + m.comm_s > T * (1 + 1e-9):
        return 0, tokens
    m = _at_evidence(record, m, ceiling, cfg)
    raw = math.floor((T - m.comm_s) / m.step_s + 1e-9)
    return int(min(max(raw, 0), cfg.max_inner_steps)), tokens


def _cap_budgets(
    models: Sequence[PeerModel],
    H: np.ndarray,
    cfg: PlanConfig,
    ranks: Sequence[int],
    floors: Optional[Sequence[int]] = None,
) -> np.ndarray:
    """``H`` lowered so that no budget exceeds :func:`~geomesh_p2p.plan.bounds.budget_limit` of the
    lower-median budget (``BUDGET_MEDIAN_FACTOR`` x it, x ``ranks[i]`` for a multi-rank peer: the cap is per
    device), never below each peer's fewest steps (``floors``: :func:`~geomesh_p2p.plan.views.min_steps_of`; None:
    ``min_inner_steps``). The lower median is unchanged by the cap (a capped budget stays >= half the limit >= the
    median, since the factor is >= 2), so one pass suffices."""
    step_tokens = [m.batch * cfg.seq_len for m in models]
    budgets = [int(h) * t for h, t in zip(H.tolist(), step_tokens)]
    median = statistics.median_low(budgets)
    limits = [budget_limit(median, k) for k in ranks]
    return _lowered_to(H, step_tokens, limits, range(len(models)), _floors(cfg, models, floors))


def _floors(cfg: PlanConfig, models: Sequence[PeerModel], floors: Optional[Sequence[int]]) -> list[int]:
    """Each peer's fewest steps: ``floors``, or ``cfg.min_inner_steps`` for every one."""
    return [cfg.min_inner_steps] * len(models) if floors is None else [int(f) for f in floors]


def _lowered_to(
    H: np.ndarray, step_tokens: Sequence[int], limits: Sequence[float], among: Iterable[int], floors: Sequence[int]
) -> np.ndarray:
    """A copy of ``H`` in which each peer of index ``i`` in ``among`` whose budget ``H_i x step_tokens_i``
    exceeds ``limits[i]`` tokens gets ``floor(limits[i] / step_tokens_i)`` steps, never below ``floors[i]``."""
    out = H.copy()
    for i in among:
        t, limit = step_tokens[i], limits[i]
        if int(H[i]) * t > limit:
            out[i] = max(int(floors[i]), math.floor(limit / t))
    return out


def _cap_probation(
    models: Sequence[PeerModel],
    H: np.ndarray,
    cfg: PlanConfig,
    probation: Collection[str],
    floors: Optional[Sequence[int]] = None,
) -> np.ndarray:
    """``H`` lowered so that no probation peer's budget exceeds ``PROBATION_BUDGET_FACTOR`` x the
    lower-median budget of the established peers, never below each peer's fewest steps (``floors``, as
    :func:`_cap_budgets`)."""
    if not probation:
        return H
    step_tokens = [m.batch * cfg.seq_len for m in models]
    est = [int(h) * t for m, h, t in zip(models, H.tolist(), step_tokens) if m.peer_id not in probation]
    if not est:
        return H
    limit = PROBATION_BUDGET_FACTOR * statistics.median_low(est)
    among = [i for i, m in enumerate(models) if m.peer_id in probation]
    return _lowered_to(H, step_tokens, [limit] * len(models), among, _floors(cfg, models, floors))
