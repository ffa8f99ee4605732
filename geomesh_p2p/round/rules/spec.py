"""The collective's spec of a round's plan (:func:`collective_spec`): the owners' parts (cut to what one gRPC
message carries), the participants' token budgets and the run's aggregation settings.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from geomesh_p2p import exchange as collective
from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.model.training import swarm_lr_at
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.trust.verify_task import VerifyConfig, claim_floor_steps

if TYPE_CHECKING:
    from geomesh_p2p.config.models import RunConfig

__all__ = [
    "collective_spec",
    "aggregate_scale_bound",
    "round_lr_sum",
    "PULL_SHARE_OF_EXCHANGE",
    "AGGREGATE_SCALE_FACTOR",
]

#: The pushes close this share of the exchange before its deadline: the last part is left to the pulls.
PULL_SHARE_OF_EXCHANGE = 0.25

#: Per inner step, the largest mean |delta| of a block an honest aggregate may reach, in units of the inner lr (plus
#: weight decay's share): twice verified work's bound for one contribution (``VerifyConfig.scale_factor`` 1.5; honest
#: contributions peaked at 0.92 x H x lr, trust/verify.py), so a peer that ran more steps than planned (an eager
#: peer's adopted speculative steps) or a round of larger steps stays inside.
AGGREGATE_SCALE_FACTOR = 3.0
#: The inner optimizer's weight decay (node/training.py's, the same on every peer)
INNER_WEIGHT_DECAY = 0.1


def round_lr_sum(run_cfg: "RunConfig", round: int, steps: int) -> float:
    """The sum of the inner learning rates of ``steps`` inner steps of round ``round`` (a peer planned ``steps``):
    the swarm's schedule (:func:`~geomesh_p2p.model.training.swarm_lr_at`), a function of the round only, so every
    peer computes the same sum. A peer planned fewer steps samples the same curve over the round: its sum is
    smaller."""
    return sum(
        swarm_lr_at(
            round,
            i,
            steps,
            steps_per_round=run_cfg.uniform_inner_steps,
            lr=run_cfg.inner_lr,
            warmup_steps=run_cfg.warmup_steps,
            total_steps=run_cfg.total_inner_steps,
        )
        for i in range(steps)
    )


def aggregate_scale_bound(plan, run_cfg: "RunConfig", theta_maxabs: Optional[float]) -> Optional[float]:
    """The largest block scale (mean ``|x|`` of a block of the pseudo-gradient, fp32 units of the weights) an honest
    ``"sign"`` aggregate of ``plan`` can have: ``L x (AGGREGATE_SCALE_FACTOR + wd x max|theta|)``, ``L`` the sum of the
    inner learning rates of the most inner steps the plan gives anyone (:func:`round_lr_sum`: the warm-up's rounds
    get a bound as small as their steps), ``theta_maxabs`` max ``|theta|`` of the round's start state.

    Why it holds: AdamW or Lion move a weight by at most about lr per step plus ``lr x wd x |theta|`` (the mean of a
    block by less), each contribution is bounded so, and every rule (the token-weighted mean, meanmed, the filters)
    and the sign re-encoding (a block's mean |x|) take a convex combination or less. The same on every peer that
    holds the start state: the plan, the run config and ``theta`` are. None (no bound) with error feedback (a
    residual carries earlier rounds' steps), without a committed state, or when the plan trains nothing."""
    if theta_maxabs is None or run_cfg.error_feedback or not math.isfinite(theta_maxabs):
        return None
    steps = max((a.inner_steps for a in plan.assignments), default=0)
    if steps <= 0:
        return None
    return round_lr_sum(run_cfg, plan.round, steps) * (AGGREGATE_SCALE_FACTOR + INNER_WEIGHT_DECAY * theta_maxabs)


def screen_token_floor(plan, push_encoding: str) -> dict[str, int]:
    """PeerID -> fewest tokens its contribution must claim to count in the aggregate of ``plan``'s round, for every
    peer planned at least ``VerifyConfig.min_steps`` steps, in the modes where verified work checks contributions
    (relay and accountable rounds of a sign-compressed method); empty otherwise. The tokens of
    ``verify_task.claim_floor_steps`` steps at the peer's planned batch (``steps x batch_size x seq_len``): from
    ``gain_first_round`` on, the loss-gain test's ``S = max(min_steps, ceil(gain_min_tokens / (batch x seq_len)))``
    steps (1,792 tokens: 7 steps at 8 x 32) for a peer planned ``S`` or more; ``min_steps`` steps otherwise.

    Why (issue 28, the ``min_steps`` dodge): a check or screen is drawn only over contributions of at least
    ``min_steps`` steps (its thresholds are measured there, :func:`geomesh_p2p.trust.verify_task._eligible`), so a
    contributor planned 20 steps could claim 4 steps' tokens and never be checked, whatever it sent. A claim below
    the floor now counts 0 tokens (:meth:`~geomesh_p2p.exchange.partition.CollectiveSpec.counted_tokens`): what no
    check can screen has no weight. An honest peer reaches it unless the deadline stopped it within its first
    floor steps and the floor's grace (``round.steps.floor_steps``); that round's work is then left out and counts
    as no delivered work (:class:`~geomesh_p2p.round.rules.profiling.Reprofiler` evidence), as a straggler's would.

    The gain test's floor: session 45 gave it to the contributors a round screens (``verify_task.
    screened_in_round``; an AWB leader plans them at least ``S`` steps, ``plan.views.min_steps_of``); session 46 to
    every contributor planned ``S`` or more, because sampled screens and sampled full checks draw established
    contributors too and their gain test cannot decide a claim under 1,792 tokens: an established peer planned 7
    steps could claim 5-6 and count, undecidable. The sampled draws use the same floor (``_eligible``)."""
    if push_encoding != "sign" or plan.mode not in ("relay", "accountable"):
        return {}
    cfg, L, r = VerifyConfig(), int(plan.seq_len), int(plan.round)
    out = {}
    for a in plan.assignments:
        b = int(a.batch_size)
        k = claim_floor_steps(cfg, round=r, inner_steps=int(a.inner_steps), batch_size=b, seq_len=L)
        if k > 0:
            out[a.peer_id] = k * b * L
    return out


def screen_token_cap(plan, push_encoding: str) -> dict[str, int]:
    """PeerID -> most tokens its contribution counts for in ``plan``'s round, for the peers planned fewer than
    ``VerifyConfig.min_steps`` (but some) steps whose batch is larger than the plan's lower-median batch, in the modes
    of :func:`screen_token_floor` (relay and accountable rounds of a sign-compressed method); empty otherwise. The cap
    is their steps at the lower-median batch: ``inner_steps x median batch x seq_len``.

    Why (issue 28, red team of session 34): no check or screen draws a contribution of fewer than ``min_steps`` steps,
    and the plan checks exempt ``min_inner_steps`` steps of a peer's *own* batch from every budget bound, so a newcomer
    announcing a batch at the spread cap (x its ranks: 64x the median) was planned 1 step and weighed as much as an
    honest peer's whole round, unscreened; 30 such identities held 0.88 of the aggregate's weight after 40 rounds in
    a simulation of the leader's rules. Capped, an unscreenable step weighs what an ordinary step does. An honest peer
    planned under ``min_steps`` steps at an ordinary batch is not capped."""
    if push_encoding != "sign" or plan.mode not in ("relay", "accountable"):
        return {}
    steps = VerifyConfig.min_steps
    batches = sorted(int(a.batch_size) for a in plan.assignments)
    if not batches:
        return {}
    median = batches[(len(batches) - 1) // 2]  # lower median: half the plan's peers at or above it
    L = int(plan.seq_len)
    return {
        a.peer_id: int(a.inner_steps) * median * L
        for a in plan.assignments
        if 0 < int(a.inner_steps) < steps and int(a.batch_size) > median
    }


def collective_spec(
    plan, run_cfg: RunConfig, numel: int, max_message_bytes: int, theta_maxabs: Optional[float] = None
) -> collective.CollectiveSpec:
    """The collective's spec for ``plan`` (``numel``: P, the model's parameters; ``max_message_bytes``: the
    transport's largest gRPC message; ``theta_maxabs``: max ``|theta|`` of the start state, for a ``"sign"``
    aggregate's scale bound, :func:`aggregate_scale_bound`). Raises ValueError when the plan cannot be executed."""
    r = plan.round
    rule = MethodRule.from_run(run_cfg)
    push, agg = rule.push_encoding, rule.aggregate_encoding
    # Owners' addresses come from the plan (the leader's view), so every peer dials the same ones.
    addresses = {x.peer_id: x.address for x in plan.assignments}
    owners = [
        collective.PartOwner(peer_id=pid, address=addresses.get(pid) or "", start=start, end=end)
        for pid, start, end in plan.owners()
    ]
    # A part too big for one gRPC message (fp32 baselines of large models) is cut into several.
    owners = collective.split_owners(
        owners,
        collective.max_part_elements(
            push_encoding=push,
            mode=plan.mode,
            aggregate_encoding=agg,
            n_participants=len(plan.assignments),
            block_size=run_cfg.block_size,
            max_message_bytes=max_message_bytes,
        ),
    )
    return collective.CollectiveSpec(
        run_id=run_cfg.run_id,
        round=r,
        participants=_capped_budgets(plan, push),
        owners=owners,  # type: ignore[arg-type]  # split_owners' list, as the spec always got
        numel=numel,
        mode=plan.mode,
        aggregate_encoding=agg,
        push_encoding=push,
        block_size=run_cfg.block_size,
        clip_k=run_cfg.clip_k,
        rule=rule.rule,
        weight_cap=run_cfg.weight_cap,
        min_agreement=run_cfg.min_agreement,
        min_support=run_cfg.min_support,
        support_z=run_cfg.support_z,
        quorum=run_cfg.quorum,
        probation=plan.probation(),
        grace_s=pb.early_close_grace_s(plan.window_s),
        validators_per_part=run_cfg.validators_per_part,
        deadline=plan.exchange_deadline - PULL_SHARE_OF_EXCHANGE * (plan.exchange_deadline - plan.train_deadline),
        pull_deadline=plan.exchange_deadline,
        token_floor=screen_token_floor(plan, push),
        max_scale=aggregate_scale_bound(plan, run_cfg, theta_maxabs)
        if agg == "sign" and plan.mode != "relay"
        else None,
    )


def _capped_budgets(plan, push_encoding: str) -> dict[str, int]:
    """PeerID -> tokens its claim may count for: its plan budget, at most :func:`screen_token_cap`."""
    cap = screen_token_cap(plan, push_encoding)
    return {x.peer_id: min(int(x.token_budget), cap.get(x.peer_id, int(x.token_budget))) for x in plan.assignments}
