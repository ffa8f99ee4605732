"""Round planning: what the round's policy calls (:mod:`geomesh_p2p.round.policy`).

The round leader turns the members' announced :class:`~geomesh_p2p.schema.peer.PeerRecord` s into a
:class:`~geomesh_p2p.plan.schema.RoundPlan` (DESIGN.md, "Round r", step 2). Everything in :mod:`geomesh_p2p.plan`
but agreement (:mod:`.agree`) is a pure, deterministic function of its inputs (no clock, no I/O, no
randomness): the same records and config give the same plan bytes whatever the order of the records.

:func:`make_plan` plans by the run's method: AWB (:mod:`.awb`) or the uniform DiLoCo baseline
(:mod:`.uniform`); the per-peer time model is :mod:`.cost`, the partition and assignments
:mod:`.assign`, the plan's schema :mod:`.schema`, the bounds on untrusted records :mod:`.bounds`.
Here: the leader's window exclusion (:func:`window_exclusions`), the follower's check of a plan
(:func:`check_plan`), and the exchange's time budget (:func:`exchange_timeout`).
"""

from __future__ import annotations

import math
import statistics
from typing import Collection, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from geomesh_p2p.trust.probation import PROBATION_BUDGET_FACTOR
from geomesh_p2p.config import method as _method
from geomesh_p2p.plan.awb import auto_window, choose_window, plan_round, window_fit
from geomesh_p2p.plan.bounds import (
    BATCH_SPREAD_CAP,
    BOUND_RANKS_MAX,
    MAX_CLOCK_SKEW_S,
    MAX_PLAN_AGE_S,
    PLAN_CHECK_TOLERANCE,
    THROUGHPUT_SPREAD_CAP,
    UNDER_PLAN_TOLERANCE,
    bound_records,
    bound_ranks,
    budget_limit,
    check_records,
    evidence_ceiling_range,
    evidence_ceilings,
    usable_rates,
)
from geomesh_p2p.plan.cost import (
    PeerModel,
    accum_steps_for,
    best_micro_batch,
    peer_uniform_micro,
    rank_micro,
    ranks_of,
    step_and_comm,
    uniform_micro,
)
from geomesh_p2p.plan.budgets import budget_problem as _budget_problem
from geomesh_p2p.plan.budgets import over_budget as _over_budget
from geomesh_p2p.plan.budgets import over_probation as over_probation
from geomesh_p2p.plan.budgets import ownership_problem as _ownership_problem
from geomesh_p2p.plan.budgets import probation_problem as _probation_problem
from geomesh_p2p.plan.schema import ContentRefusal, PeerAssignment, PlanConfig, RoundPlan
from geomesh_p2p.plan.uniform import plan_uniform
from geomesh_p2p.plan.views import (
    accumulation_problem,
    compute_problems,
    link_slowdown,
    lowest_ceilings,
    min_steps_tokens,
    plan_min_steps,
    records_at_stated_links,
    throughput_problem,
    uniform_micro_problem,
)
from geomesh_p2p.schema.peer import PeerRecord

#: Element passes of a round's collective on one peer besides the reading of the results: encoding and
#: signing its whole vector (1), and, as an owner, checking its part's contributions (about 1: n
#: contributions of 1/n of the vector).
EXCHANGE_BASE_PASSES = 2


#: The exchange window is this many times the predicted exchange (network + CPU): a peer shares its
#: cores with its own serving, with the other peers' pushes and pulls, and the prediction is a mean.
EXCHANGE_SAFETY = 3.0


def exchange_passes(n_participants: int, mode: str, validators: int = 1) -> int:
    """Whole-vector element passes of one peer's side of a round's collective (a count, >= 3).

    Encoding + signing its vector and checking the contributions of the part it owns
    (:data:`EXCHANGE_BASE_PASSES`), then reading the results: ``"relay"`` re-verifies and aggregates
    every participant's contribution to every part (``n_participants`` passes), ``"reencode"``
    decodes one aggregate (1 pass), ``"accountable"`` decodes one aggregate and, as a validator, re-runs the
    rule over one part's inputs per validation (``validators`` passes on average, off the critical path but on
    the same cores). Raises ValueError for another mode or ``n_participants < 1``.
    """
    if n_participants < 1:
        raise ValueError(f"n_participants={n_participants} must be >= 1")
    if mode == "auto":  # a run's mode: the round's (callers that know the method pass the round's mode)
        mode = _method.round_mode(mode, n_participants)
    if mode == "relay":
        return EXCHANGE_BASE_PASSES + int(n_participants)
    if mode == "reencode":
        return EXCHANGE_BASE_PASSES + 1
    if mode == "accountable":
        return EXCHANGE_BASE_PASSES + 1 + max(0, int(validators))
    raise ValueError(f"unknown mode {mode!r} (relay, reencode, accountable)")


def exchange_cpu_s(numel: int, n_participants: int, mode: str, seconds_per_element: float) -> float:
    """Predicted CPU seconds of one peer's side of a round's collective besides the network:
    ``numel * seconds_per_element * exchange_passes(n_participants, mode)``.

    ``seconds_per_element``: the peer's measured cost of one element pass (encode + sign, or verify +
    aggregate; :func:`geomesh_p2p.exchange.profile.measure_codec`, then the EMA of its own exchanges). It grows
    linearly with the model: ~0.9 s for gpt2-124m in relay mode with 3 peers at 3.4 ns per element pass.
    Raises ValueError on a negative size or cost.
    """
    if numel < 0 or not seconds_per_element >= 0:
        raise ValueError(f"numel={numel} and seconds_per_element={seconds_per_element} must be >= 0")
    return float(numel) * float(seconds_per_element) * exchange_passes(n_participants, mode)


def exchange_timeout(comm_s: float, cpu_s: float, floor_s: float, safety: float = EXCHANGE_SAFETY) -> float:
    """Seconds from the train deadline to the exchange deadline: ``max(floor_s, safety * (comm_s + cpu_s))``.

    ``comm_s``: the slowest participant's predicted network time (:func:`comm_time`); ``cpu_s``:
    :func:`exchange_cpu_s`. The collective's pushes must arrive within the first three quarters
    (``PeerNode._collective_spec``), so the CPU time that grows with the model is in the window,
    not only the bytes. Raises ValueError on negative inputs.
    """
    if comm_s < 0 or cpu_s < 0 or floor_s < 0 or safety <= 0:
        raise ValueError(f"comm_s={comm_s}, cpu_s={cpu_s}, floor_s={floor_s} must be >= 0, safety={safety} > 0")
    return max(float(floor_s), float(safety) * (float(comm_s) + float(cpu_s)))


def make_plan(records: Sequence[PeerRecord], cfg: PlanConfig, **kwargs) -> RoundPlan:
    """Plan by ``cfg.method``: ``geomesh``/``awb`` -> :func:`plan_round`; ``diloco``/``css`` ->
    :func:`plan_uniform`; ``ddp`` -> :func:`plan_uniform` with one inner step (a sync every step).
    Keyword arguments as for :func:`plan_round` (``supported_tokens_per_s``, ``late_tokens_per_s``: AWB only:
    uniform plans give every peer the same steps)."""
    rule = _method_rule(cfg)
    if rule.balanced:
        return plan_round(records, cfg, **kwargs)
    kwargs.pop("supported_tokens_per_s", None)
    kwargs.pop("late_tokens_per_s", None)
    return plan_uniform(records, cfg, inner_steps=rule.uniform_inner_steps, **kwargs)


def _method_rule(cfg: PlanConfig) -> "_method.MethodRule":
    """The :class:`~geomesh_p2p.config.method.MethodRule` of ``cfg.method`` (balanced or not, uniform steps)."""
    return _method.MethodRule.of(cfg.method, mode=cfg.mode, uniform_inner_steps=cfg.uniform_inner_steps)


def reference_window(records: Sequence[PeerRecord], cfg: PlanConfig) -> float:
    """The window (seconds) an honest leader plans for these records and ``cfg``: what
    :func:`make_plan` would choose (claims bounded by :func:`bound_records`). Raises ValueError like
    :func:`plan_round` for records it cannot plan."""
    recs = bound_records(check_records(records))
    rule = _method_rule(cfg)
    if rule.balanced:
        models = [PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
        s, c = step_and_comm(models)
        return choose_window(s, c, np.array([m.batch * cfg.seq_len for m in models], dtype=np.int64), cfg)
    H = rule.uniform_inner_steps
    assert H is not None  # every method that is not balanced has one H for all peers (MethodRule.of)
    micro = uniform_micro(recs, cfg)
    return max(H * m.step_s + m.comm_s for m in (PeerModel(r, cfg, peer_uniform_micro(micro, r)) for r in recs))


#: The window exclusion (:func:`window_exclusions`): a peer new to the plan is left out when including it would
#: make the round longer by more than this share of the round without it (the window, or longer); a peer of
#: the last round's plan only past ``EXCLUDE_KEPT_SHARE``: one noisy link figure must not flap it in and out.
EXCLUDE_NEW_SHARE = 0.5


EXCLUDE_KEPT_SHARE = 1.0


class WindowExclusion(NamedTuple):
    """What :func:`window_exclusions` decided, with the figures it decided on (seconds).

    Attributes:
        excluded: PeerIDs to plan without, slowest first.
        need_s: peer -> seconds the round needs for it: its exchange (measured when given, else
            :func:`comm_time`) plus its minimum compute (``min_inner_steps`` steps for AWB, the uniform ``H``
            steps for uniform plans).
        comm_s: peer -> the exchange seconds used in ``need_s``.
        measured: PeerIDs whose exchange figure was measured rather than predicted from the link figures.
        window_s: the window the rule compared with: ``cfg.window_s``, or with ``--window-s auto``
            (``cfg.target_inner_steps``, AWB) :func:`~geomesh_p2p.plan.awb.auto_window` of all the peers
            (0: none).
    """

    excluded: tuple[str, ...]
    need_s: dict[str, float]
    comm_s: dict[str, float]
    measured: frozenset
    window_s: float = 0.0


def window_exclusions(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    kept: Collection[str] = (),
    measured_comm_s: Optional[Mapping[str, float]] = None,
    keep_at_least: int = 2,
) -> WindowExclusion:
    """Which peers to plan without because including them would stretch the round (the exclusion rule).

    For each peer the round needs ``need_i = c_i + k * s_i`` seconds: ``c_i`` its exchange (``measured_comm_s``
    when it has a positive finite figure -- what the leader saw of its recent exchanges -- else
    :func:`comm_time` from its link figures), ``s_i`` its step time (:func:`best_micro_batch`, or the uniform
    micro-batch), ``k`` = ``min_inner_steps`` (AWB) or the uniform ``H``. Repeatedly, the peer with the
    largest need is left out when the round with it would be longer than without it by more than
    ``EXCLUDE_NEW_SHARE`` (a peer not in ``kept``, the last round's participants) or ``EXCLUDE_KEPT_SHARE`` x
    the round without it, ``max(window, largest need of the others)`` (``window``: ``cfg.window_s``, or with
    ``--window-s auto`` the :func:`~geomesh_p2p.plan.awb.auto_window` of all the peers); it stops at the first peer kept,
    and never leaves fewer than ``keep_at_least`` peers. Before that, a peer whose need exceeds
    ``cfg.max_window_s`` is left out whatever the others need (kept or not): its minimum steps do not fit any
    window followers accept (issue 25: 32 processes on 2 cores). A peer whose exchange is long but fits the window
    with its minimum steps costs the round nothing (AWB gives it fewer steps) and is kept. Claims are
    bounded first (:func:`bound_records`). Pure; raises ValueError like :func:`plan_round` on bad records.
    """
    recs = bound_records(check_records(records))
    rule = _method_rule(cfg)
    if rule.balanced:
        models = [PeerModel(r, cfg, best_micro_batch(r)) for r in recs]
        k = cfg.min_inner_steps
    else:
        micro = uniform_micro(recs, cfg)
        models = [PeerModel(r, cfg, peer_uniform_micro(micro, r)) for r in recs]
        k = int(rule.uniform_inner_steps or 1)
    measured = {
        pid: float(v)
        for pid, v in (measured_comm_s or {}).items()
        if v is not None and math.isfinite(float(v)) and float(v) > 0
    }
    comm = {m.peer_id: measured.get(m.peer_id, m.comm_s) for m in models}
    need = {m.peer_id: comm[m.peer_id] + k * m.step_s for m in models}
    window = float(cfg.window_s or 0.0)
    if cfg.window_s is None and cfg.target_inner_steps is not None and rule.balanced and models:
        # --window-s auto: the window the median peer's target steps need (robust to the slow ones it judges)
        window = auto_window(
            np.array([m.step_s for m in models], dtype=np.float64),
            np.array([comm[m.peer_id] for m in models], dtype=np.float64),
            cfg,
        )
    kept_ids = set(kept)
    remaining = sorted(need, key=lambda p: (-need[p], p))
    excluded: list[str] = []
    cap = cfg.max_window_s
    while cap is not None and len(remaining) > max(1, keep_at_least) and need[remaining[0]] > cap:
        excluded.append(remaining[0])
        remaining = remaining[1:]
    while len(remaining) > max(1, keep_at_least):
        pid, others = remaining[0], remaining[1:]
        without = max(window, max(need[p] for p in others))
        share = EXCLUDE_KEPT_SHARE if pid in kept_ids else EXCLUDE_NEW_SHARE
        if need[pid] - without <= share * without:
            break
        excluded.append(pid)
        remaining = others
    return WindowExclusion(tuple(excluded), need, comm, frozenset(p for p in measured if p in need), window)


def check_plan(
    plan: RoundPlan,
    records: Mapping[str, PeerRecord],
    cfg: PlanConfig,
    *,
    now: float,
    barred: Collection[str] = (),
    supported: Optional[Mapping[str, float]] = None,
    unseen: Optional[Mapping[str, float]] = None,
    late: Optional[Mapping[str, float]] = None,
) -> Optional[str]:
    """Why a follower must refuse ``plan`` (a one-line reason), or None when it is within bounds.

    A pure function of the plan, the follower's view of the records (``peer_id -> PeerRecord``), the
    :class:`PlanConfig` the run implies (the one the follower would plan with for these participants)
    and ``now`` (unix seconds); ``supported`` / ``unseen``: this follower's delivered-rate map of the last round and
    the planned rates of the participants whose delivery it missed, ``late`` its late ceilings (peers that contributed
    to no part of a recent round: :func:`evidence_ceiling_range` lets a leader plan them that low). Every plan that
    :func:`make_plan` makes from the same records and config passes; a rogue or broken leader's plan is refused when any of these fails:

    * settings: ``seq_len`` / ``method`` / ``mode`` as in ``cfg``; every participant has a record;
    * batch: ``micro_batch`` within the record's bounded ``max_batch`` (:func:`bound_records`:
      what it announces, at most ``BATCH_SPREAD_CAP`` x the lower median, x ``ranks``); ``accum_steps`` exactly
      what ``target_batch`` implies; uniform methods: the same micro-batch for all, the fixed ``H``;
    * steps: every participant gets ``min_inner_steps..max_inner_steps`` (AWB), a contributor the round screens at
      least the steps its loss-gain test needs (:func:`~geomesh_p2p.plan.views.min_steps_of`). No peer is planned
      with 0 steps: the stated rule for a peer that cannot keep up is to leave it out of the plan
      (``PlanRules.build_plan``: exchange or one sequence longer than half the window); and none far under what
      its window fits when no cap of the plan explains it (AWB, session 36: :func:`_under_plan_problem`);
    * window: ``window_s`` within ``PLAN_CHECK_TOLERANCE`` x (either way) of :func:`reference_window`,
      ``train_deadline = created_at + window_s``, ``created_at`` at most ``MAX_CLOCK_SKEW_S`` ahead and at most
      ``MAX_PLAN_AGE_S`` behind ``now``;
    * budgets: each at most ``PLAN_CHECK_TOLERANCE`` x (bounded best tokens/s x ``window_s``) and at
      most ``BUDGET_MEDIAN_FACTOR`` x the plan's lower-median budget, unless (either bound) it is
      ``min_inner_steps`` steps of its own batch (a slow peer kept under a window capped at
      ``max_window_s`` still gets them: :func:`~geomesh_p2p.plan.views.min_steps_tokens`); hence a share of the total at most
      :func:`max_token_share`; both per device (x ``ranks`` for a multi-rank peer, issue 30);
    * ownership: no owner without an address in its record, none with more than
      :func:`max_owner_units` x ``part_align`` elements, counting as possible owners the
      participants whose record has an address, less ``barred`` (peers this follower itself bars
      from owning, e.g. after a part they owned had no valid result: a leader that bars them too
      plans them as client-only; one that bars others cannot shrink the count);
    * probation (:mod:`geomesh_p2p.trust.probation`): at most ``probation_slots(established)`` participants
      marked ``probation``, none of them owning a part, each budget at most ``PLAN_CHECK_TOLERANCE x
      PROBATION_BUDGET_FACTOR`` x the established participants' lower-median budget, x ``ranks`` for a multi-rank
      peer (per device: :func:`probation_limit`), or its ``min_inner_steps`` steps; they do not count as possible owners. Whether the marking matches this
      follower's view of standing is checked by ``probation.marking_problem`` (the node's).
    """
    reason = _settings_problem(plan, cfg)
    if reason is not None:
        return reason
    missing = [pid[:10] for pid in plan.participants() if pid not in records]
    if missing:
        return f"it names peers without a record: {missing}"
    recs = [records[pid] for pid in plan.participants()]
    try:
        T_ref = reference_window(recs, cfg)
    except ValueError as e:
        return f"its participants' records cannot be planned ({e})"
    by_id = {r.peer_id: r for r in bound_records(recs)}
    rule = _method_rule(cfg)
    balanced, uniform_H = rule.balanced, rule.uniform_inner_steps
    micro_u = uniform_micro(list(by_id.values()), cfg)
    for a in plan.assignments:
        r, who = by_id[a.peer_id], a.peer_id[:10]
        if a.micro_batch > r.max_batch:
            return f"micro-batch {a.micro_batch} for {who} exceeds the {r.max_batch} its record supports"
        reason = accumulation_problem(a, r, cfg)  # the target batch is a floor per device: K x for a K-rank peer
        if reason is not None:
            return reason
        if balanced and not plan_min_steps(a, cfg, plan, strict=True) <= a.inner_steps <= cfg.max_inner_steps:
            return ContentRefusal(
                f"{a.inner_steps} inner steps for {who}, outside {plan_min_steps(a, cfg, plan, strict=True)}..{cfg.max_inner_steps}"
                " (a peer that cannot keep up is left out of the plan, not given 0 steps; a screened one gets the"
                " screen's steps)"
            )
        want = rank_micro(peer_uniform_micro(micro_u, r), r)
        if not balanced and a.inner_steps != uniform_H:
            # the plan and the run config alone: every honest follower refuses it, so it is bypassed (a rogue
            # leader's 0 steps for everyone else in a css run blocked the honest followers, session 28)
            return ContentRefusal(f"{who} gets {a.inner_steps} steps; method {cfg.method} gives everyone {uniform_H}")
        if not balanced and a.micro_batch != want:
            return (
                f"{who} gets {a.inner_steps} steps of micro-batch {a.micro_batch}; method {cfg.method} gives "
                f"everyone {uniform_H} of {micro_u} per device ({want} for this peer)"
            )
        if a.owns_part and records[a.peer_id].address is None:
            return f"client-only peer {who} owns a part"
    T = plan.window_s
    if not T_ref / PLAN_CHECK_TOLERANCE <= T <= T_ref * PLAN_CHECK_TOLERANCE:
        # the leader's read of a link may be one update apart (session 38): the window of the links the plan states
        T_view = reference_window(records_at_stated_links(plan, recs, cfg), cfg)
        if not T_view / PLAN_CHECK_TOLERANCE <= T <= T_view * PLAN_CHECK_TOLERANCE:
            return f"its window {T:.3g} s is far from the {T_ref:.3g} s the records support"
    if abs(plan.train_deadline - plan.created_at - T) > 1e-6 * T + 1e-3:
        return ContentRefusal("its train deadline is not its start plus its window")
    if plan.created_at - now > MAX_CLOCK_SKEW_S:
        return f"it starts {plan.created_at - now:.0f} s in the future"
    if now - plan.created_at > MAX_PLAN_AGE_S:
        return _too_old(plan, now)
    for a in plan.assignments:
        reason = throughput_problem(a, by_id[a.peer_id], cfg, plan, balanced, "its bounded throughput")
        if reason is not None:
            return reason
    ranks = {r.peer_id: ranks_of(r) for r in recs}
    reason = (
        _budget_problem(plan, cfg, ranks)
        or _probation_problem(plan, cfg, ranks)
        or _evidence_problem(plan, cfg, supported, unseen)
        or _under_plan_problem(plan, cfg, by_id, ranks, supported, unseen, late)
        or compute_problems(
            plan, cfg, balanced, by_id, lowest_ceilings(plan, supported, unseen, balanced, late), "its bounded record"
        )
    )
    if reason is not None:
        return reason
    on_probation = set(plan.probation())
    possible = {r.peer_id for r in recs if r.address is not None and r.peer_id not in on_probation}
    return _ownership_problem(plan, cfg, possible, barred)


def records_needed(plan: RoundPlan, cfg: PlanConfig) -> list[str]:
    """The participants of ``plan`` whose assignment the plan alone cannot check, so a light follower reads their
    records (issue 25): an accumulation other than a one-device peer's for its micro-batch (a K-rank peer's target
    batch is K x ``cfg.target_batch``; a light follower must see every such lie, not a sample, or it follows a plan
    the full-view peers bypass), a budget over the one-device (probation) bounds of :func:`check_plan`, fewest steps
    included (the floor is of the plan's batch: red team 53b), and under a uniform method a micro-batch over the
    target batch: only a multi-rank peer may hold one, and only its record says so (sessions 53, 53b)."""
    over = {**_over_budget(plan, cfg, {}, floors=False), **over_probation(plan, cfg, {}, floors=False)}
    most = math.inf if _method_rule(cfg).balanced else cfg.target_batch  # uniform: one device's micro-batch
    accums = {a.peer_id: accum_steps_for(a.micro_batch, cfg.target_batch) for a in plan.assignments}
    return [
        a.peer_id
        for a in plan.assignments
        if a.accum_steps != accums[a.peer_id] or a.peer_id in over or a.micro_batch > most
    ]


def check_plan_sampled(
    plan: RoundPlan,
    sampled: Mapping[str, PeerRecord],
    cfg: PlanConfig,
    *,
    now: float,
    barred: Collection[str] = (),
    supported: Optional[Mapping[str, float]] = None,
    unseen: Optional[Mapping[str, float]] = None,
    late: Optional[Mapping[str, float]] = None,
) -> Optional[str]:
    """:func:`check_plan` for a light follower (issue 25) that holds the records of a sample of the plan's
    participants only (``sampled``: ``peer_id -> PeerRecord``, each a participant). One-line reason, or None.

    Checked over the whole plan, from the plan and ``cfg`` alone: settings, step bounds (AWB) or the fixed H
    (uniform methods), the train deadline against the window and ``now``, every budget against the plan's
    median and the largest share (per device at the K of a sampled participant's record, at ``BOUND_RANKS_MAX`` for
    one not sampled: :func:`records_needed` names those over the one-device bounds, which a light follower reads
    before it follows), probation counts, and ownership (each owner under
    :func:`max_owner_units` among the participants the plan gives an address, less ``barred``). Checked for
    the sampled participants, against their records as announced (not bounded by the median of all, which
    needs every record; the announced figure is the looser bound, so a plan :func:`make_plan` makes always
    passes): the address the plan gives them (none is accepted for a participant on probation or in ``barred``:
    client-only by the leader's rules), micro-batch within ``max_batch``, ``accum_steps`` for the
    target batch, token budget within ``PLAN_CHECK_TOLERANCE`` x best tokens/s x window (or ``min_inner_steps``
    steps of its batch, as in :func:`check_plan`), and no participant far under what its window fits
    (:func:`_under_plan_problem`: the plan's own times for all, the records of sampled ones within the spread caps
    of the plan's figures, :func:`_bounded_by_plan`). What it cannot
    see: the window against the slowest record, and a lie about an unsampled participant's figures; a lie
    about one participant is seen by each follower with probability (sample size / participants), and the
    full-view peers check it all (docs/round.md, "Light followers").
    """
    reason = _settings_problem(plan, cfg)
    if reason is not None:
        return reason
    rule = _method_rule(cfg)
    T = plan.window_s
    for a in plan.assignments:
        who = a.peer_id[:10]
        if rule.balanced and not plan_min_steps(a, cfg, plan, strict=True) <= a.inner_steps <= cfg.max_inner_steps:
            return ContentRefusal(
                f"{a.inner_steps} inner steps for {who}, outside {plan_min_steps(a, cfg, plan, strict=True)}..{cfg.max_inner_steps}"
            )
        if not rule.balanced and a.inner_steps != rule.uniform_inner_steps:
            return ContentRefusal(
                f"{who} gets {a.inner_steps} steps; method {cfg.method} gives everyone {rule.uniform_inner_steps}"
            )
        if a.owns_part and a.address is None:
            return f"{who} owns a part and has no address in the plan"
        r = sampled.get(a.peer_id)
        if r is None:
            continue
        # client-only with an address in its record: the leader's owner bar (or probation), as make_plan does; it
        # still counts as a possible owner below, so only the full check's minority of leader's bars passes (red
        # team 37: a light follower that did not bar it refused every plan of a leader that did)
        if a.address != r.address and a.address is not None:
            return f"{who} is placed at {a.address}, its record says {r.address}"
        if a.micro_batch > r.max_batch:
            return f"micro-batch {a.micro_batch} for {who} exceeds the {r.max_batch} its record supports"
        reason = accumulation_problem(a, r, cfg) or uniform_micro_problem(a, r, cfg, rule.balanced)
        reason = reason or throughput_problem(a, r, cfg, plan, rule.balanced, "its record")
        if reason is not None:
            return reason
    if abs(plan.train_deadline - plan.created_at - T) > 1e-6 * T + 1e-3:
        return ContentRefusal("its train deadline is not its start plus its window")
    if plan.created_at - now > MAX_CLOCK_SKEW_S:
        return f"it starts {plan.created_at - now:.0f} s in the future"
    if now - plan.created_at > MAX_PLAN_AGE_S:
        return _too_old(plan, now)
    # a multi-rank peer's budget may pass the one-device bounds only with its record read (records_needed); one not
    # read may be of any K the bounds count (fresh user 53: the agreement's record-less check refused a 2-rank
    # newcomer's plan, the light follower came too late to the full path and was benched as a no-show)
    ranks = {pid: ranks_of(r) for pid, r in sampled.items()}
    any_k = {a.peer_id: ranks.get(a.peer_id, BOUND_RANKS_MAX) for a in plan.assignments}
    unclamped = _bounded_by_plan(plan, cfg, sampled)
    lows = lowest_ceilings(plan, supported, unseen, rule.balanced, late)
    reason = (
        _budget_problem(plan, cfg, any_k)
        or _probation_problem(plan, cfg, any_k)
        or _evidence_problem(plan, cfg, supported, unseen)
        or _under_plan_problem(plan, cfg, unclamped, ranks, supported, unseen, late)
        # the rate's lower end only where the leader cannot have clamped the record (the spread caps of the plan)
        or compute_problems(
            plan, cfg, rule.balanced, sampled, {p: lows[p] if p in unclamped else 0.0 for p in lows}, "its record"
        )
    )
    if reason is not None:
        return reason
    on_probation = set(plan.probation())
    placed = {
        a.peer_id: a.address or (sampled[a.peer_id].address if a.peer_id in sampled else None) for a in plan.assignments
    }
    possible = {pid for pid, addr in placed.items() if addr is not None and pid not in on_probation}
    return _ownership_problem(plan, cfg, possible, barred)


def _too_old(plan: RoundPlan, now: float) -> str:
    """The refusal of a plan made more than ``MAX_PLAN_AGE_S`` before ``now`` (see that constant)."""
    return (
        f"it was made {now - plan.created_at:.0f} s in the past (at most {MAX_PLAN_AGE_S:.0f} s): its window is "
        "spent before anyone trains"
    )


def _settings_problem(plan: RoundPlan, cfg: PlanConfig) -> Optional[str]:
    """``seq_len`` / ``method`` / ``mode`` of the plan against ``cfg``'s (the round's mode of ``cfg.mode``:
    :func:`~geomesh_p2p.config.method.round_mode` of the plan's participant count)."""
    mode = _method.round_mode(cfg.mode, len(plan.assignments), cfg.method)
    if plan.seq_len != cfg.seq_len or plan.method != cfg.method or plan.mode != mode:
        return (
            f"its seq_len/method/mode {plan.seq_len}/{plan.method}/{plan.mode} differ from the run's "
            f"{cfg.seq_len}/{cfg.method}/{mode}"
        )
    return None


def _evidence_problem(
    plan: RoundPlan,
    cfg: PlanConfig,
    supported: Optional[Mapping[str, float]],
    unseen: Optional[Mapping[str, float]] = None,
) -> Optional[str]:
    """Budgets against what delivered work supports (see :func:`check_plan`), at the highest ceiling an honest leader
    may use (:func:`evidence_ceiling_range`); None for uniform methods and when ``supported`` has no usable rate."""
    if not _method_rule(cfg).balanced:
        return None
    ceilings = evidence_ceiling_range(plan.participants(), supported, unseen)
    if not ceilings:
        return None
    T = plan.window_s
    own = evidence_ceilings(plan.participants(), supported)
    for a in plan.assignments:
        limit = PLAN_CHECK_TOLERANCE * ceilings[a.peer_id][1] * T
        floor = min_steps_tokens(a, cfg, plan)
        if a.token_budget > max(limit, floor):
            rate = (supported or {}).get(a.peer_id)
            basis = f"{rate:.0f} tokens/s delivered last round" if rate else "a newcomer: the median delivered rate"
            return (
                f"token budget {a.token_budget} for {a.peer_id[:10]} exceeds the {limit:.0f} its delivered work "
                f"supports in {T:.3g} s ({basis})"
            )
    # a leader's map lacks one entry at most: one rated peer planned over its own ceiling (red team 37b: every one)
    rated = usable_rates(supported)
    over = [a.peer_id for a in plan.assignments if a.peer_id in rated and a.token_budget > max(
        PLAN_CHECK_TOLERANCE * own[a.peer_id] * T, min_steps_tokens(a, cfg, plan))]  # fmt: skip
    if len(over) > 1:
        return f"{len(over)} peers ({', '.join(p[:10] for p in over[:4])}) get more than their delivered work supports"
    return None


def _under_plan_problem(
    plan: RoundPlan,
    cfg: PlanConfig,
    records: Mapping[str, PeerRecord],
    ranks: Mapping[str, int],
    supported: Optional[Mapping[str, float]],
    unseen: Optional[Mapping[str, float]] = None,
    late: Optional[Mapping[str, float]] = None,
) -> Optional[str]:
    """A participant planned far fewer tokens than it fits in the plan's window when no cap of the plan explains
    it (session 36; red team of session 34, #3: a rogue leader planned its partner at 4 steps and every honest
    peer at 1, so the partner held most of the round's weight). None for uniform methods.

    Each participant's expected budget is ``min(fit, caps)`` in tokens: ``fit`` what its window holds, the caps
    those an honest leader applies after it and a follower can recompute from the plan, each rounded down to whole
    steps of the plan's batch: :func:`budget_limit` of the plan's lower-median budget (x ``ranks``), and for a
    participant marked ``probation`` ``PROBATION_BUDGET_FACTOR`` x the established participants' lower median.
    Both are at most what the leader capped with (a cap lowers budgets over the median only, so the plan's median
    is the one of the last cap; probation's median is taken before the last cap lowers it). It is refused when
    ``tolerance x (budget + one step) <= expected``, one step being the larger of the plan's and the fit's, so
    that whole steps cannot refuse an honest plan. Two fits, in this order:

    * the plan's own figures (``tolerance`` ``PLAN_CHECK_TOLERANCE``): ``inner_steps`` plus the whole steps of
      ``predicted_compute_s / inner_steps`` its ``predicted_idle_s`` holds. Plan and config alone: a
      :class:`ContentRefusal` (every honest follower gives it and bypasses the plan).
    * ``records`` (bounded as the leader's), every tokens/s figure divided by ``UNDER_PLAN_TOLERANCE`` (a leader
      may hold the record one update older, at most 2x slower), and no further tolerance:
      :func:`~geomesh_p2p.plan.awb.window_fit` at the lowest ceiling of ``evidence_ceiling_range(supported)``, what an honest
      leader holding that slower record plans before the caps (the fit is monotone in the figures, so a leader
      with a faster view plans as many tokens or more, up to a step). Only with usable ``supported`` rates:
      without them this follower cannot tell a leader's evidence cap (a peer that delivered little is planned at
      twice that) from an under-plan. It depends on the view: a plain str (the follower sits the round out).
    """
    if not _method_rule(cfg).balanced:
        return None
    T = plan.window_s
    found = _under_planned(plan, cfg, _plan_fits(plan, cfg), {}, PLAN_CHECK_TOLERANCE)
    if found is not None:
        a, expected = found
        return ContentRefusal(
            f"{a.peer_id[:10]} gets {a.inner_steps} inner steps ({a.token_budget} tokens), under "
            f"1/{PLAN_CHECK_TOLERANCE:g} of the {expected} its own predicted times fit in the {T:.3g} s window, "
            "and no cap of the plan explains fewer"
        )
    ceilings = evidence_ceiling_range(plan.participants(), supported, unseen, late)  # the lowest (red team 37, F2)
    if not ceilings:
        return None
    fits: dict[str, tuple[int, int]] = {}
    own, own_fits, rated = evidence_ceilings(plan.participants(), supported, late), {}, usable_rates(supported)
    assigned = {a.peer_id: a for a in plan.assignments}
    for pid, r in records.items():
        try:
            # the oldest view of the record a leader may plan from: every figure UNDER_PLAN_TOLERANCE x slower
            slower = {b: v / UNDER_PLAN_TOLERANCE for b, v in check_records([r])[0].tokens_per_s.items()}
            # and its exchange as long as the plan states it, up to UNDER_PLAN_LINK_TOLERANCE x what the record
            # gives: a link figure moves up to that much per update, so a leader's older read may give the exchange
            # more time (red team 36, F1: 92 of 400 honest swarms refused after one link update, links as read)
            k = link_slowdown(r, assigned.get(pid), cfg)
            older = r.model_copy(
                update={"tokens_per_s": slower, "upload_bps": r.upload_bps / k, "download_bps": r.download_bps / k}
            )
            if ceilings.get(pid, (1.0, 1.0))[0] <= 0:
                continue  # a rate this follower did not see (unseen): any up to its ceiling may be the leader's
            fits[pid] = window_fit(older, T, cfg, ceilings[pid][0] if pid in ceilings else None)
            if ceilings.get(pid, (0.0, 0.0))[0] < own.get(pid, 0.0) and pid in rated:
                own_fits[pid] = window_fit(older, T, cfg, own[pid])
        except (ValueError, ArithmeticError):
            continue  # a record the planner cannot plan: the other checks judge it
    found = _under_planned(plan, cfg, fits, ranks, 1.0)
    if found is not None:
        a, expected = found
        return (
            f"{a.peer_id[:10]} gets {a.inner_steps} inner steps ({a.token_budget} tokens), under the {expected} "
            f"its record at 1/{UNDER_PLAN_TOLERANCE:g} of its tokens/s and its delivered work fit in the {T:.3g} s "
            "window, and no cap of the plan explains fewer"
        )
    # a leader's map lacks one entry at most: one rated peer under its own fit (red team 37b: a rogue took every one)
    under = [p for p in own_fits if _under_planned(plan, cfg, {p: own_fits[p]}, ranks, 1.0) is not None]
    if len(under) > 1:
        return f"{len(under)} peers ({', '.join(p[:10] for p in under[:4])}) get fewer tokens than their work fits"
    return None


def _plan_fits(plan: RoundPlan, cfg: PlanConfig) -> dict[str, tuple[int, int]]:
    """peer id -> (inner steps its plan's own predicted times fit in the window, tokens per step): ``inner_steps``
    plus the whole steps of ``predicted_compute_s / inner_steps`` in ``predicted_idle_s``, at most
    ``max_inner_steps`` (an honest plan's idle is under one step unless a cap lowered the steps)."""
    out = {}
    for a in plan.assignments:
        if a.inner_steps < 1:
            continue  # refused by the step range
        step_s = a.predicted_compute_s / a.inner_steps
        more = a.predicted_idle_s / step_s if step_s > 0 else math.inf
        steps = a.inner_steps + math.floor(more + 1e-9) if more < cfg.max_inner_steps else cfg.max_inner_steps
        out[a.peer_id] = (min(cfg.max_inner_steps, steps), int(a.batch_size) * cfg.seq_len)
    return out


def _under_planned(
    plan: RoundPlan,
    cfg: PlanConfig,
    fits: Mapping[str, tuple[int, int]],
    ranks: Mapping[str, int],
    tolerance: float,
) -> Optional[tuple[PeerAssignment, int]]:
    """The first participant with a fit in ``fits`` (peer id -> (steps, tokens per step)) whose budget is under
    ``1 / tolerance`` of its expected one (see :func:`_under_plan_problem`), with that expected budget (tokens)."""
    median = statistics.median_low([a.token_budget for a in plan.assignments])
    est = [a.token_budget for a in plan.assignments if not a.probation]
    for a in plan.assignments:
        fit = fits.get(a.peer_id)
        step = int(a.batch_size) * cfg.seq_len
        if fit is None or step < 1:
            continue
        caps = [budget_limit(median, ranks.get(a.peer_id, 1))]
        if a.probation and est:
            # the leader's cap is per peer (awb._cap_probation: what every 0.19 follower accepts), under the check's
            caps.append(PROBATION_BUDGET_FACTOR * statistics.median_low(est))
        expected = min([fit[0] * fit[1]] + [math.floor(c / step) * step for c in caps])
        if tolerance * (a.token_budget + max(step, fit[1])) <= expected:
            return a, expected
    return None


def _bounded_by_plan(plan: RoundPlan, cfg: PlanConfig, sampled: Mapping[str, PeerRecord]) -> dict[str, PeerRecord]:
    """The ``sampled`` records (as announced) that :func:`bound_records` leaves as they are whatever the records
    this light follower did not read, for :func:`_under_plan_problem`: best tokens/s at most ``THROUGHPUT_SPREAD_CAP``
    x the lower median of the rates the plan implies (``batch_size x seq_len x inner_steps / predicted_compute_s``:
    an honest plan's rate is at most the bounded best one, so that median is at most the records'), ``max_batch``
    at most ``BATCH_SPREAD_CAP`` x the plan's lower-median micro-batch, both x ``ranks``. A record over either may be
    clamped by the leader (not in proportion: a tokens/s figure to a cap, the others kept), so it is left to the
    full-view peers. Bandwidths stay as announced (their cap, 64x the median,
    moves a window fit by less than the tolerance). Empty when the plan implies no rate."""
    rates = [
        a.batch_size * cfg.seq_len * a.inner_steps / a.predicted_compute_s
        for a in plan.assignments
        if a.predicted_compute_s > 0
    ]
    if not rates:
        return {}
    tps_cap = THROUGHPUT_SPREAD_CAP * statistics.median_low(rates)
    batch_cap = BATCH_SPREAD_CAP * statistics.median_low([a.micro_batch for a in plan.assignments])
    out = {}
    for pid, r in sampled.items():
        k = bound_ranks(ranks_of(r))
        if r.tokens_per_s and r.best_tokens_per_s() <= k * tps_cap and r.max_batch <= k * batch_cap:
            out[pid] = r
    return out
