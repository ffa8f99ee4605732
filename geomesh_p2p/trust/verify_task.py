"""What a verified-work check recomputes (:mod:`geomesh_p2p.trust.verify`): the run's settings
(:class:`VerifyConfig`), the draw of a check from the verifier's selection signature
(:func:`selection_message`, :func:`derive_task` -> :class:`VerifyTask`: whose contribution, which parts,
steps and control batches) and the elements compared (:func:`sample_elements`). Pure functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from array import array
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust.verify_commit import Committed

__all__ = [
    "VerifyConfig",
    "VerifyTask",
    "CONTROL_STREAM",
    "selection_message",
    "derive_task",
    "sample_elements",
    "evidence_lifetime_s",
    "CHECK",
    "SCREEN",
    "screen_candidates",
    "screened_in_round",
    "screen_steps",
    "gain_floor_steps",
    "claim_floor_steps",
    "sample_probability",
    "sampled_candidates",
    "gain_order",
    "screen_seed",
    "screeners_of",
    "derive_screen",
    "reference_task",
    "borrowed_references",
    "BORROWED_REFERENCES",
]


#: Stream name of the control batches (``sample_batch(seed, CONTROL_STREAM, round, i, ...)``): no peer
#: trains on it (PeerIDs are base58 strings without "/").
CONTROL_STREAM = "geomesh-verify/control"


_SELECT_DOMAIN = b"geomesh-p2p/verify-select/v1\x00"
_SCREEN_DOMAIN = b"geomesh-p2p/verify-screen/v1\x00"

#: :attr:`VerifyTask.kind` of an ordinary sampled check (drawn by the verifier's selection signature) and of a
#: screening check (the loss-gain test alone, run on every newcomer: :func:`derive_screen`).
CHECK, SCREEN = "check", "screen"


@dataclass(frozen=True)
class VerifyConfig:
    """Verified work settings; every peer of a run must use the same ones (thresholds are measured,
    see the module docstring).

    Attributes:
        share: mean share of its own compute a peer draws for checks (sets the check probability; below
            ``duty``, so that the background worker keeps up on average: utilisation ``share / duty``).
        duty: largest share of the wall time the background worker computes
            (:class:`~geomesh_p2p.trust.verify_queue.CheckQueue`: it sleeps between passes to stay under it).
        max_pending: checks and re-checks that may wait in the background queue; past it the oldest is
            dropped (counted) and its round's kept weights released. 6: measured by a queue simulation at the
            default share and duty, 0.3% of the checks dropped when one check costs 1.6 rounds of the peer's
            own compute (H = 5), 0.03% at H = 20, none from H = 40 on.
        k_fraction, k_min, k_max: own batches checked: ``clamp(ceil(k_fraction x steps), k_min, k_max)``,
            at most ``steps``.
        controls: control batches (``m``).
        sample_elements: elements compared (sampled over every part the contributor sent; all of them
            when fewer).
        min_steps: contributions with fewer steps are not checked (below the measured range).
        max_full_steps: above this, ``k < steps/4``: only the scale and plain tests run.
        plain_hard, plain_min: ``plain`` below ``plain_hard`` fails (hard: flipped or random); from it to
            ``plain_min`` it is marginal. Session 35: ``plain_min`` (0.55) alone was hard, and an honest 40-step
            contribution measured 0.544 in a CI run (accountable mode: a check reads 2 of 4 parts). ``plain`` is
            the same at every re-checker (it does not depend on the basis), so one low draw confirmed everywhere
            would exclude an honest peer for good. Noise measures 0.49-0.51 and a flipped contribution
            ``1 - plain`` of its honest self (<= 0.47), so 0.52 keeps them hard.
        trace_hard: ``trace`` below it fails (hard).
        trace_min: ``trace`` below it is a marginal failure.
        scale_factor: block scale bound ``steps x lr x (scale_factor + weight_decay x max|theta|)``.
        refute_margin: a re-check of a hard accusation passing every threshold by this much refutes it
            (``gain_refute_margin`` for the loss-gain test's t).
        gain_assigned, gain_controls: batches of the loss-gain test (:mod:`geomesh_p2p.trust.gain`): of the
            contributor's (at most its steps; drawn by :func:`gain_steps`) and control batches.
        gain_t_hard, gain_t_min: the gain test's Welch t below ``gain_t_hard`` fails (hard: trained on other
            data than assigned), below ``gain_t_min`` is a marginal failure. Measured (``benchmarks/verify_gain.py``,
            tiny preset, rounds 2-11, H = 5/20/40): honest t >= 2.24 / 4.09 / 5.15; wrong data, a poisoner's own
            corpus <= 1.88, below 1.5 in 96-100% of draws.
        gain_t_gap: the gain test decides (fails or marks marginal) only when it has power in that round: the
            checker's own contribution of the round, on its own assigned batches over the same parts
            (:func:`reference_task`), reaches a t at least ``gain_t_gap`` above the accused's. At the swarm's first
            rounds an honest update is mostly what any text teaches (a freshly initialised model learns the
            token statistics first), so honest contributions measured t 0.8-1.25 there (seq_len 128, 33-42
            steps: ``benchmarks/multi_rank.py``, session 17) and were excluded as "not trained on its batches";
            without a reference (the checker sent nothing that round) a check's gain test decides nothing, and a
            screen's borrows 2 other contributions of the round (:func:`borrowed_references`, session 44: power
            only when both show it). 2.5: about 1.8 standard deviations of the difference of two unit-variance t's.
        gain_min_tokens: the gain test decides nothing on a contribution trained on fewer tokens (steps x batch x
            seq_len): its row-level t has too little power there (session 35: honest 5-step contributions at batch
            4 x 32 failed in 10-18% of draws, 14-step ones, 1,792 tokens, never; ``benchmarks/gain_parts.py``).
            Such a contribution weighs its few tokens in the token-weighted mean.
        marginal_needed, marginal_window: marginal failures (distinct rounds within the window) that
            exclude.
        keep_rounds: rounds whose start weights and contributions are kept for re-checks.
        time_share: the first version skipped a check that would not end within this share of the plan's
            window after the exchange (at least 1 s); now such a check runs on and counts as ``late``.
        evidence_ttl_s: shortest lifetime of evidence in the DHT, seconds; evidence lives longer when rounds
            are long (:func:`evidence_lifetime_s`: the peers keep a round for re-checks ``keep_rounds`` rounds).
        max_rechecks: evidence re-checked per round at most (the rest waits for the next round).
        recheck_rounds: rounds whose start weights and contributions stay kept (re-checkable) in all: the
            newest ``keep_rounds`` with their contributions in memory, the older ones with their contributions
            written beside their start weights (disk, ``4P + contributors x P/8`` bytes a round; issue 28: a late
            verdict must find its round still kept at the others). 12: a sampled check concludes within ~11
            rounds at H = 5 (the slowest measured), a screening check within 2-4.
        gain_first_round: the loss-gain test runs (in checks and screens) on contributions of this round on only.
            The swarm's first rounds train a freshly initialised model, whose update is mostly what any text teaches
            (the token statistics): honest contributions of round 0 measured t 0.68-1.25 (seq_len 128, 33-44
            steps, ``benchmarks/multi_rank.py``, sessions 16-17) and honest peers excluded each other, while a peer
            of the same round with 7 steps measured t 4.61. The thresholds were measured from round 2 on
            (``benchmarks/verify_gain.py``); before it the sign statistics decide alone, and screening starts there.
        screen_rounds: every contributor of the ``screen_rounds`` rounds from ``gain_first_round`` is screened (everybody is
            new then); later, the contributors a plan marks as on probation (new identities, until they delivered
            :data:`~geomesh_p2p.trust.probation.PROBATION_ROUNDS` rounds). See :func:`screen_candidates`.
        screeners: verifiers that screen each newcomer in a round (drawn by :func:`screeners_of` after the round;
            all participants when fewer).
        max_screens: screening jobs that may wait in the background queue (ahead of the sampled checks); past it
            the oldest is dropped (counted).
        burst_rounds: the background worker holds its duty over any ``burst_rounds`` rounds of wall time rather than
            per pass (:class:`~geomesh_p2p.trust.verify_queue.Pacer`, ``window_s``): a round's screens run at once when
            it was quiet before, and over every such window it computes at most ``duty`` of it (session 19: paced
            per pass at 15%, the swarm's first screens concluded 5-7 rounds after their round).
        sample_share, sample_screeners: sampled screens of established contributors (session 19, the patient
            poisoner: honest while on probation, poisoning after): every round from ``gain_first_round`` each
            established checkable contributor is screened with the probability :func:`sample_probability` sets so
            that these screens take ``sample_share`` of the participants' own compute on average, drawn from the
            round's screening seed (the same contributors at every participant, unknown while they trained), by
            ``sample_screeners`` of them (:func:`screeners_of`; two, so that one screener's failure is confirmed by
            the other's identical measurement). The same screen and thresholds as a newcomer's. ``share`` (the
            sampled full checks) went from 0.1 to 0.05 with it: draws stay at 0.1 / 0.15 of the worker's duty.
        gain_staged, gain_stage_kappa: a screen's loss-gain test runs in two stages (session 43,
            :mod:`~geomesh_p2p.trust.gain_stages`): half of its batches first, the rest only when that half does
            not decide. A half decides a threshold ``c`` of the whole when its t is beyond ``sqrt(1/2) c`` by
            ``gain_stage_kappa`` standard deviations; 1.71 bounds the probability that such an early decision
            differs from the whole screen's by 1e-3 for any true effect (:func:`~.gain_stages.disagreement`).
        gain_settle_steps, gain_low_share, gain_low_hard, gain_low_min, gain_low_stage: the test batch by batch
            (session 50, partial work; :mod:`~geomesh_p2p.trust.gain_batches`): ``GainStats.low`` is Welch's t of the
            lower ``gain_low_share`` (by mean gain, at least 2) of the drawn batches with at least ``gain_settle_steps``
            steps after them; on a contribution whose whole t passes it fails hard below ``gain_low_hard``, marks
            marginal below ``gain_low_min`` (with the power reference's ``low`` ``gain_t_gap`` above it); a staged
            screen's half passes alone only when each of its settled batches reaches a t of ``gain_low_stage``.
            Measured (tiny preset, rounds 2-11, H = 20/40, ``benchmarks/verify_gain.py``): honest ``low`` >= 1.64 at
            batch 8, >= 0.55 at batch 4; partial work (a quarter of its batches trained, all claimed) below 0 in
            72-79 % of draws.
    """

    share: float = 0.05
    duty: float = 0.15
    max_pending: int = 6
    k_fraction: float = 0.25
    k_min: int = 4
    k_max: int = 16
    controls: int = 4
    sample_elements: int = 1 << 18
    min_steps: int = 5
    max_full_steps: int = 64
    plain_hard: float = 0.52
    plain_min: float = 0.55
    trace_hard: float = 0.50
    trace_min: float = 0.515
    scale_factor: float = 1.5
    refute_margin: float = 0.03
    gain_assigned: int = 8
    gain_controls: int = 16
    gain_t_hard: float = 1.5
    gain_t_min: float = 1.75
    gain_refute_margin: float = 0.5
    gain_t_gap: float = 2.5
    gain_min_tokens: int = 1792
    gain_first_round: int = 2
    marginal_needed: int = 2
    marginal_window: int = 50
    keep_rounds: int = 3
    time_share: float = 0.25
    evidence_ttl_s: float = 900.0
    max_rechecks: int = 2
    recheck_rounds: int = 12
    screen_rounds: int = 3
    screeners: int = 4
    max_screens: int = 16
    burst_rounds: float = 8.0
    sample_share: float = 0.05
    sample_screeners: int = 2
    gain_staged: bool = True
    gain_stage_kappa: float = 1.71
    gain_settle_steps: int = 4
    gain_low_share: float = 0.5
    gain_low_hard: float = 0.0
    gain_low_min: float = 0.25
    gain_low_stage: float = 1.0

    def gain_refutes(self, gain) -> bool:
        """Whether a re-check's loss-gain test (a ``GainStats``, or None: not measured) passes a hard accusation by
        ``gain_refute_margin`` on both its statistics (the whole t, and ``low`` where measured), so that it may
        refute it."""
        if gain is None:
            return True
        m = self.gain_refute_margin
        return gain.t >= self.gain_t_min + m and (gain.low is None or gain.low >= self.gain_low_min + m)


#: Evidence lives at least this many times the rounds its participants keep it re-checkable (``keep_rounds``).
EVIDENCE_TTL_KEEP_MARGIN = 2.0


def evidence_lifetime_s(cfg: VerifyConfig, round_s: Optional[float]) -> float:
    """Seconds the evidence of a round that lasts ``round_s`` seconds (plan created to exchange deadline; None:
    unknown) stays in the DHT: ``cfg.evidence_ttl_s``, or longer when the rounds are long. The participants keep
    a round's weights for ``cfg.keep_rounds`` rounds, and the evidence must be there for every re-check they can
    make (issue 29 #2: a fixed 900 s is three 5-minute rounds, fewer than a re-check may need)."""
    rounds = EVIDENCE_TTL_KEEP_MARGIN * (max(cfg.keep_rounds, cfg.recheck_rounds) + 1) * max(0.0, float(round_s or 0.0))
    return max(cfg.evidence_ttl_s, rounds)


def selection_message(run_id: str, round: int, start_digest: Optional[str]) -> bytes:
    """What a verifier signs to draw its check of ``round`` (bound to the round's start weights)."""
    return _SELECT_DOMAIN + json.dumps([run_id, int(round), start_digest or ""]).encode()


def _u64(b: bytes) -> int:
    return int.from_bytes(b[:8], "little")


@dataclass(frozen=True)
class VerifyTask:
    """One check: whose contribution, which parts (``ranges``: their ``[start, end)``), steps and elements
    (a pure function of the plan, the contributions received and the verifier's selection signature;
    see :func:`derive_task`). ``kind``: :data:`CHECK`, or :data:`SCREEN` for a screening check (the loss-gain
    test alone, its batches drawn from the round's contributions, the same for every screener: :func:`derive_screen`;
    ``steps`` is then empty)."""

    round: int
    verifier: str
    accused: str
    parts: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    steps_done: int
    steps: tuple[int, ...]
    controls: int
    batch_size: int
    seq_len: int
    element_seed: int
    n_elements: int
    full_test: bool
    kind: str = CHECK

    def passes(self) -> int:
        """Forward/backward passes of ``batch_size`` rows the check costs (0 for a screening check: forward only)."""
        return 0 if self.kind == SCREEN else len(self.steps) + self.controls

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VerifyTask":
        """The task of :meth:`to_dict` (keys it does not know are ignored: a later version's additions).
        Raises KeyError / TypeError / ValueError when malformed."""
        d = {k: v for k, v in dict(d).items() if k in _TASK_FIELDS}
        d["parts"] = tuple(int(x) for x in d["parts"])
        d["ranges"] = tuple((int(a), int(b)) for a, b in d["ranges"])
        d["steps"] = tuple(int(x) for x in d["steps"])
        if str(d.get("kind", CHECK)) not in (CHECK, SCREEN):
            raise ValueError(f"unknown task kind {d['kind']!r}")
        return cls(**d)

    def to_dict(self) -> dict:
        """JSON-able; ``kind`` only when it is a screen (an ordinary check's dict is what earlier versions sign)."""
        d = asdict(self)
        d["parts"], d["ranges"], d["steps"] = list(self.parts), [list(r) for r in self.ranges], list(self.steps)
        if self.kind == CHECK:
            del d["kind"]
        return d


_TASK_FIELDS = frozenset(f.name for f in fields(VerifyTask))


def _k_of(cfg: VerifyConfig, steps: int) -> int:
    """Own batches a check of ``steps`` steps recomputes: a quarter of them, within [k_min, k_max]; only
    k_min beyond ``max_full_steps`` (where only the plain test applies, which needs no more)."""
    if steps > cfg.max_full_steps:
        return min(steps, cfg.k_min)
    return min(steps, max(cfg.k_min, min(cfg.k_max, math.ceil(cfg.k_fraction * steps))))


def derive_task(
    cfg: VerifyConfig,
    *,
    plan,
    verifier: str,
    selection: bytes,
    packets: Mapping[str, Mapping[int, Any]],
    part_ranges: Sequence[tuple[int, int]],
) -> Optional[VerifyTask]:
    """The check ``verifier`` must run this round, or None (not drawn, nobody checkable).

    ``plan``: the round's RoundPlan; ``selection``: the verifier's signature of
    :func:`selection_message`; ``packets``: sender -> part -> SignPacket received (relay);
    ``part_ranges``: ``[start, end)`` of every part. Every input is the same on every peer that took
    part in the round, so anyone can recompute (and so check) the task of any verifier.
    """
    try:
        mine = plan.assignment(verifier)
    except KeyError:
        return None
    seed = hashlib.sha256(b"task\x00" + selection).digest()
    L = int(plan.seq_len)
    eligible = [e for e in _eligible(cfg, plan, packets) if e[0].peer_id != verifier]
    if not eligible:
        return None
    a, steps, parts = eligible[_u64(seed[8:]) % len(eligible)]
    k = _k_of(cfg, steps)
    cost = (k + cfg.controls) * a.batch_size
    p = min(1.0, cfg.share * mine.inner_steps * mine.batch_size / cost)
    if _u64(seed) / 2.0**64 >= p:
        return None
    ranges = tuple((int(part_ranges[j][0]), int(part_ranges[j][1])) for j in parts)
    sub = hashlib.sha256(seed + a.peer_id.encode()).digest()
    chosen = sorted(sorted(range(steps), key=lambda j: hashlib.sha256(sub + struct.pack("<Q", j)).digest())[:k])
    return VerifyTask(
        round=int(plan.round),
        verifier=verifier,
        accused=a.peer_id,
        parts=parts,
        ranges=ranges,
        steps_done=int(steps),
        steps=tuple(chosen),
        controls=cfg.controls,
        batch_size=int(a.batch_size),
        seq_len=L,
        element_seed=_u64(sub[8:]) & ((1 << 63) - 1),
        n_elements=min(sum(e - s for s, e in ranges), cfg.sample_elements),
        full_test=steps <= cfg.max_full_steps,
    )


def _eligible(
    cfg: VerifyConfig, plan, packets: Mapping[str, Mapping[int, Any]], *, floor: bool = True
) -> list[tuple[Any, int, tuple[int, ...]]]:
    """``(assignment, steps it trained by its claim, the parts it sent as sign packets)`` of every contributor
    of ``plan`` a check may pick, in the plan's order: at least ``cfg.min_steps`` steps planned, and claimed at least
    its token floor's steps (:func:`claim_floor_steps`: the gain test's steps where the plan gives them, from
    ``gain_first_round`` on; a claim under it counts 0 tokens, so a check of it would decide nothing counted).
    ``floor`` False: ``cfg.min_steps`` claimed (a power reference, :func:`reference_task`: an honest checker's own
    contribution stopped under its floor still measures the round's power, as before session 46)."""
    L = int(plan.seq_len)
    out = []
    for a in plan.assignments:
        # a Committed stand-in (accountable mode: known by its result's commitment, verify_commit) draws alike
        got = {
            j: p
            for j, p in (packets.get(a.peer_id) or {}).items()
            if isinstance(p, (compression.SignPacket, Committed))
        }
        if not got or a.inner_steps < cfg.min_steps:
            continue
        tokens = min(max(p.tokens for p in got.values()), a.token_budget)
        steps = min(a.inner_steps, tokens // max(1, a.batch_size * L))
        least = (
            claim_floor_steps(
                cfg, round=int(plan.round), inner_steps=int(a.inner_steps), batch_size=int(a.batch_size), seq_len=L
            )
            if floor
            else cfg.min_steps
        )
        if steps >= least:  # under it the claim counts 0 tokens (round.rules.spec.screen_token_floor): nothing to check
            out.append((a, steps, tuple(sorted(got))))
    return out


def screen_candidates(cfg: VerifyConfig, plan, packets: Mapping[str, Mapping[int, Any]]) -> list[str]:
    """The contributors of ``plan`` screened this round, sorted: every checkable one (:func:`derive_task`'s
    eligibility) in the ``cfg.screen_rounds`` rounds from ``cfg.gain_first_round`` (none before), later those the
    plan marks as on probation (``PeerAssignment.probation``: identities that have not delivered
    ``PROBATION_ROUNDS`` rounds yet). Every
    participant computes the same list from the same plan and contributions. A contributor knows that its first
    rounds are screened, nothing more: which batches are replayed is drawn after the round (:func:`screen_seed`)."""
    r = int(plan.round)
    if r < cfg.gain_first_round:  # the loss-gain test has no power on a fresh model's first updates
        return []
    return sorted(
        a.peer_id
        for a, _, _ in _eligible(cfg, plan, packets)
        if screened_in_round(cfg, r, bool(getattr(a, "probation", False)))
    )


def screened_in_round(cfg: VerifyConfig, round: int, probation: bool) -> bool:
    """Whether a checkable contribution to round ``round`` of a contributor its plan marks ``probation`` is screened
    (:func:`screen_candidates`' rule before eligibility): from ``cfg.gain_first_round`` on, every contributor in the
    ``cfg.screen_rounds`` rounds from it, later those on probation. Known from the plan alone, so the leader can plan
    them the screen's steps (:func:`screen_steps`) and every participant gives them the same token floor."""
    r = int(round)
    return r >= cfg.gain_first_round and (r < cfg.gain_first_round + cfg.screen_rounds or bool(probation))


def screen_steps(cfg: VerifyConfig, *, round: int, probation: bool, batch_size: int, seq_len: int) -> int:
    """Fewest inner steps (at ``batch_size`` x ``seq_len`` tokens a step) that a contribution to ``round`` screened
    in it (:func:`screened_in_round`) must hold for its loss-gain test to decide: ``max(cfg.min_steps,
    ceil(cfg.gain_min_tokens / (batch_size x seq_len)))``; 0 for a contribution the round does not screen.

    Why (session 45): the gain test decides nothing under ``gain_min_tokens`` (1,792), the draws' eligibility starts
    at ``min_steps`` (5): a screened contributor planned 5-6 steps at batch 8 x 32 (1,280-1,536 tokens) weighed its
    whole claim in the aggregate and could never be decided (the backdoor poisoner never excluded in 3 of 8 runs of
    session 44). The leader plans screened contributors at least these steps (``plan.views.min_steps_of``) and their
    claims under them count 0 tokens (``round.rules.spec.screen_token_floor``)."""
    if not screened_in_round(cfg, round, probation):
        return 0
    return gain_floor_steps(cfg, batch_size=batch_size, seq_len=seq_len)


def gain_floor_steps(cfg: VerifyConfig, *, batch_size: int, seq_len: int) -> int:
    """``S``: the fewest inner steps at ``batch_size`` x ``seq_len`` tokens a step on which the loss-gain test decides,
    ``max(cfg.min_steps, ceil(cfg.gain_min_tokens / (batch_size x seq_len)))`` (7 at 8 x 32, 14 at 4 x 32, 5 from
    batch 12 x 32 up)."""
    per_step = max(1, int(batch_size) * int(seq_len))
    return max(int(cfg.min_steps), -(-int(cfg.gain_min_tokens) // per_step))


def claim_floor_steps(cfg: VerifyConfig, *, round: int, inner_steps: int, batch_size: int, seq_len: int) -> int:
    """Fewest steps (of ``batch_size`` x ``seq_len`` tokens) a claim of a contributor planned ``inner_steps`` in
    ``round`` must hold to count (``round.rules.spec.screen_token_floor``, relay and accountable rounds of a
    sign-compressed method) and to be drawn for a check or screen (:func:`_eligible`): 0 when planned under
    ``cfg.min_steps`` (never drawn; ``screen_token_cap`` bounds such a claim); from ``cfg.gain_first_round`` on, the
    gain test's ``S`` (:func:`gain_floor_steps`) when planned at least ``S``; else ``cfg.min_steps``. A function of
    the plan's assignment and the run alone: every participant computes the same floor.

    Why (session 46; session 45 did this for screened contributors only): any contribution of a round from
    ``gain_first_round`` on may be drawn for a sampled screen (the gain test alone) or a sampled full check (whose gain
    test is one of its statistics), and the gain test decides nothing under ``gain_min_tokens``: an established peer
    planned 7 or more steps at batch 8 x 32 could claim 5-6 steps' tokens (1,280-1,536) and count them, undecidable
    by any screen. Planned fewer than ``S`` (a short window, a run whose ``max_inner_steps`` or uniform ``H`` holds
    fewer), it keeps the ``min_steps`` floor: counting 0 there would drop every honest claim the window cannot
    raise to ``S`` (the reach test of ``plan.views.min_steps_of``, red team of session 45). An honest peer planned
    ``S`` or more fits them in the window at its planned step time and may run them past the train deadline within
    the floor's grace (``round.steps.floor_steps``)."""
    if int(inner_steps) < cfg.min_steps:
        return 0
    if int(round) >= cfg.gain_first_round:
        s = gain_floor_steps(cfg, batch_size=batch_size, seq_len=seq_len)
        if int(inner_steps) >= s:
            return s
    return int(cfg.min_steps)


#: Forward passes a training step costs (forward and backward: ~3 forwards' FLOPs), for the sampled screens' budget.
STEP_FORWARDS = 3


def sample_probability(cfg: VerifyConfig, plan, packets: Mapping[str, Mapping[int, Any]]) -> float:
    """The probability that an established contributor of ``plan``'s round is given a sampled screen: the
    ``cfg.sample_share`` of the participants' own compute (``STEP_FORWARDS x inner_steps x batch_size`` row-forwards
    each) over what screening every established checkable contributor by ``sample_screeners`` would cost
    (``2 x (min(gain_assigned, steps) + gain_controls) x batch_size`` row-forwards a screen: the first of a round,
    before its control losses are cached), those whose gain test decides (:func:`_sampled_pool`). In [0, 1]; 0
    before ``gain_first_round``, with ``sample_share`` 0 or nobody established. Pure: the same at every participant (the plan and the contributions received)."""
    if cfg.sample_share <= 0 or int(plan.round) < cfg.gain_first_round:
        return 0.0
    est = _sampled_pool(cfg, plan, packets)
    n = min(cfg.sample_screeners, len(plan.assignments) - 1)
    cost = sum(n * 2 * (min(cfg.gain_assigned, steps) + cfg.gain_controls) * a.batch_size for a, steps in est)
    if cost <= 0:
        return 0.0
    own = sum(STEP_FORWARDS * a.inner_steps * a.batch_size for a in plan.assignments)
    return min(1.0, cfg.sample_share * own / cost)


def sampled_candidates(cfg: VerifyConfig, plan, packets: Mapping[str, Mapping[int, Any]], seed: bytes) -> list[str]:
    """The established contributors given a sampled screen in ``plan``'s round, sorted: each of
    :func:`_sampled_pool` (checkable, not a newcomer, a claim the gain test decides) with probability
    :func:`sample_probability`, drawn by SHA-256
    of the round's screening ``seed`` (:func:`screen_seed`: fixed only once every contribution was signed) and its
    PeerID. The same list at every participant; a contributor cannot tell in advance whether it is drawn."""
    p = sample_probability(cfg, plan, packets)
    if p <= 0:
        return []
    return sorted(
        a.peer_id
        for a, _ in _sampled_pool(cfg, plan, packets)
        if _u64(hashlib.sha256(seed + b"sampled\x00" + a.peer_id.encode()).digest()) / 2.0**64 < p
    )


def _sampled_pool(cfg: VerifyConfig, plan, packets: Mapping[str, Mapping[int, Any]]) -> list[tuple[Any, int]]:
    """``(assignment, claimed steps)`` of the contributors a sampled screen may draw in ``plan``'s round: checkable
    (:func:`_eligible`), not a newcomer (:func:`screen_candidates`), and claiming at least ``cfg.gain_min_tokens``
    tokens, on which the screen's gain test decides (session 46: below it a screen passes whatever was sent, so the
    draw spent its compute on nothing; only a contributor planned under its gain floor's steps claims so few and
    counts, :func:`claim_floor_steps`)."""
    new = set(screen_candidates(cfg, plan, packets))
    L = int(plan.seq_len)
    return [
        (a, steps)
        for a, steps, _ in _eligible(cfg, plan, packets)
        if a.peer_id not in new and steps * int(a.batch_size) * L >= cfg.gain_min_tokens
    ]


def screen_seed(run_id: str, plan, packets: Mapping[str, Mapping[int, Any]]) -> bytes:
    """32 bytes every participant of ``plan``'s round derives alike and nobody knew while it trained: SHA-256 over
    the run, the round, its start digest and the SHA-256 of every contribution received (sender and part order).
    A contributor signs its own packets before it sees the others' (owners serve the relay results after their
    part closed), so it cannot grind its packet for a draw it likes. Hashes every packet: ``senders x P/8`` bytes
    (off the event loop)."""
    h = hashlib.sha256(_SCREEN_DOMAIN + json.dumps([run_id, int(plan.round), plan.start_digest or ""]).encode())
    for sender in sorted(packets):
        for j in sorted(packets[sender]):
            p = packets[sender][j]
            h.update(sender.encode() + b"\x00" + struct.pack("<Q", int(j)))
            h.update(hashlib.sha256(p.to_bytes()).digest() if hasattr(p, "to_bytes") else b"\x00" * 32)
    return h.digest()


def screeners_of(seed: bytes, accused: str, participants: Sequence[str], n: int) -> list[str]:
    """The ``n`` participants (``accused`` left out) that screen ``accused``: the first by SHA-256 of
    ``(seed, accused, participant)`` (a rendezvous draw after the round; everybody when fewer)."""
    rank = sorted(
        (hashlib.sha256(seed + accused.encode() + b"\x00" + p.encode()).digest(), p)
        for p in participants
        if p != accused
    )
    return [p for _, p in rank[: max(0, int(n))]]


def derive_screen(
    cfg: VerifyConfig,
    *,
    plan,
    verifier: str,
    accused: str,
    seed: bytes,
    packets: Mapping[str, Mapping[int, Any]],
    part_ranges: Sequence[tuple[int, int]],
) -> Optional[VerifyTask]:
    """The screening check of ``accused`` in ``plan``'s round as ``verifier`` runs it, or None (``accused`` is not
    screened this round, or ``verifier`` is not one of its screeners): a newcomer's (``cfg.screeners`` screeners) or
    an established contributor's sampled screen (:func:`sampled_candidates`, ``cfg.sample_screeners`` screeners),
    the same task either way. ``seed``: :func:`screen_seed` of the round.
    The batches (:func:`gain_steps` of the task's ``element_seed``) follow from ``seed`` and ``accused`` alone, so
    every screener replays the same batches and rows: one screener's measurement is its re-check of another's
    evidence. Pure: anyone holding the round's plan and contributions can recompute it."""
    if accused == verifier:
        return None
    if accused in screen_candidates(cfg, plan, packets):
        n = cfg.screeners
    elif accused in sampled_candidates(cfg, plan, packets, seed):
        n = cfg.sample_screeners  # an established contributor's sampled screen
    else:
        return None
    participants = [a.peer_id for a in plan.assignments]
    if verifier not in screeners_of(seed, accused, participants, n):
        return None
    a, steps, parts = next(e for e in _eligible(cfg, plan, packets) if e[0].peer_id == accused)
    ranges = tuple((int(part_ranges[j][0]), int(part_ranges[j][1])) for j in parts)
    sub = hashlib.sha256(seed + b"screen\x00" + accused.encode()).digest()
    return VerifyTask(
        round=int(plan.round),
        verifier=verifier,
        accused=accused,
        parts=parts,
        ranges=ranges,
        steps_done=int(steps),
        steps=(),
        controls=cfg.gain_controls,
        batch_size=int(a.batch_size),
        seq_len=int(plan.seq_len),
        element_seed=_u64(sub) & ((1 << 63) - 1),
        n_elements=0,
        full_test=False,
        kind=SCREEN,
    )


def reference_task(
    cfg: VerifyConfig, task: "VerifyTask", *, plan, packets: Mapping[str, Mapping[int, Any]], checker: str
) -> Optional["VerifyTask"]:
    """The loss-gain test of ``checker``'s own contribution that tells whether ``task``'s gain test has power in
    its round (``VerifyConfig.gain_t_gap``): ``task`` with the checker as the accused, its own steps and batch
    size (by :func:`_eligible`'s rule) and an element seed of its own (from the round, the checker and the parts).
    None when the checker is the accused, sent no checkable contribution in ``plan``'s round, or did not send
    every part of ``task`` (the reference must cover the same parameters). Pure."""
    if checker == task.accused:
        return None
    entry = next((e for e in _eligible(cfg, plan, packets, floor=False) if e[0].peer_id == checker), None)
    if entry is None:
        return None
    a, steps, parts = entry
    if not set(task.parts) <= set(parts):
        return None
    # its own batches, drawn from the round, the checker and the parts alone: the same reference for every accused
    # of the round over those parts (computed once: a cache key), and the checker is the one that trained on them
    sub = hashlib.sha256(
        b"reference\x00" + struct.pack("<Q", int(task.round)) + checker.encode() + repr(tuple(task.parts)).encode()
    ).digest()
    return dataclasses.replace(
        task,
        verifier=checker,
        accused=checker,
        steps_done=int(steps),
        steps=(),
        batch_size=int(a.batch_size),
        element_seed=_u64(sub) & ((1 << 63) - 1),
        full_test=False,
    )


#: Other contributions of its round a screener that sent none of its own measures as the power reference
#: (:func:`borrowed_references`); the test has power only where every one of them shows it (their lowest counts).
BORROWED_REFERENCES = 2


def borrowed_references(
    cfg: VerifyConfig,
    task: "VerifyTask",
    *,
    plan,
    packets: Mapping[str, Mapping[int, Any]],
    checker: str,
    n: int = BORROWED_REFERENCES,
) -> list["VerifyTask"]:
    """The power references of a ``checker`` with no contribution of its own in ``task``'s round (session 44): the
    :func:`reference_task` of ``n`` other contributors (neither the accused nor the checker) whose contributions it
    holds as sign packets in every part of ``task`` (accountable mode: fetched), drawn in an order from the task's
    element seed, their batches too (a screen's seed follows from the round's contributions: unknown while they
    trained, and the same at every screener of the accused). [] when fewer than ``n`` are held: then the test has
    no power here, as before. Why ``n`` >= 2 and every one must show power (``gain_stages.staged_gain``): the
    lowest of them is at most an honest contribution's t of the round unless all ``n`` are hostile, so a colluder
    cannot inflate the reference alone. Pure."""
    if n < 1:
        return []
    key = task.element_seed.to_bytes(8, "little") + b"borrowed\x00"
    out = []
    for peer in sorted(packets, key=lambda p: hashlib.sha256(key + p.encode()).digest()):
        held = packets.get(peer) or {}
        if peer in (checker, task.accused) or not all(
            isinstance(held.get(j), compression.SignPacket) for j in task.parts
        ):
            continue
        rt = reference_task(cfg, task, plan=plan, packets=packets, checker=peer)
        if rt is not None:
            sub = hashlib.sha256(key + peer.encode()).digest()
            out.append(dataclasses.replace(rt, verifier=checker, element_seed=_u64(sub) & ((1 << 63) - 1)))
        if len(out) == n:
            return out
    return []


def gain_order(task: "VerifyTask", n: int) -> tuple[int, ...]:
    """The contributor's steps the loss-gain test replays, in the order drawn: ``min(n, task.steps_done)`` of
    ``range(steps_done)`` from the task's element seed (which follows from the verifier's selection signature, made
    after the contribution was signed: the contributor cannot know them when it trains). Any prefix is a uniform
    draw too (a staged screen's first half: :mod:`~geomesh_p2p.trust.gain_stages`)."""
    key = task.element_seed.to_bytes(8, "little") + b"gain"
    order = sorted(range(task.steps_done), key=lambda j: hashlib.sha256(key + struct.pack("<Q", j)).digest())
    return tuple(order[: min(n, task.steps_done)])


def gain_steps(task: "VerifyTask", n: int) -> tuple[int, ...]:
    """:func:`gain_order`'s steps, sorted (the order the test's rows are taken in)."""
    return tuple(sorted(gain_order(task, n)))


def _randperm_prefix(total: int, n: int, seed: int) -> torch.Tensor:
    """``torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]`` (int64 ``[n]``), without the
    ``[total]`` permutation (issue 27, session 41: its int32 copy, 356 MB at 89M elements, was the rest of a check's peak).

    torch's CPU ``randperm`` is Fisher-Yates over the generator's raw 32-bit MT19937 draws: step ``i`` swaps
    positions ``i`` and ``i + draw_i % (total - i)``, and no later step touches position ``i``, so the first ``n``
    values need only the first ``n`` draws and the positions they moved (a dict). The draws are those of the same
    MT19937 seeded with the low 32 bits of ``seed``, as torch seeds it (numpy's legacy ``RandomState``).
    ``tests/unit/test_check_model.py`` compares it with ``torch.randperm``; ``n < total < 2**31``.

    No single call over all ``n`` values holds the GIL (session 47): this runs in ``geomesh-verify`` beside the event
    loop, and at ``n = 2**18`` ``sorted(list)`` and ``torch.tensor(list)`` each held it 70-210 ms (one C call: the
    interpreter's 5 ms switch interval does not apply), the loop's stalls. The draws go to Python ints in chunks of
    :data:`_DRAW_CHUNK`, the values into an ``array('q')`` one at a time, and the tensor is made from its buffer."""
    if n <= 0:
        return torch.empty(0, dtype=torch.int64)
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 2**32, size=n, dtype=np.uint64)
    moved: dict[int, int] = {}
    out = array("q")
    for c in range(0, n, _DRAW_CHUNK):
        for i, d in enumerate(draws[c : c + _DRAW_CHUNK].tolist(), c):
            j = i + d % (total - i)
            vi, vj = moved.get(i, i), moved.get(j, j)
            moved[j] = vi  # position i is final after this step: only j keeps a record
            out.append(vj)
    return torch.frombuffer(out, dtype=torch.int64).clone()  # clone: a tensor that owns its memory, not the array's


#: draws turned into Python ints per call in :func:`_randperm_prefix` (~0.5 ms of GIL each; 2**18 at once: ~16 ms)
_DRAW_CHUNK = 8192


def sample_elements(ranges: Sequence[tuple[int, int]], n: int, seed: int) -> torch.Tensor:
    """Sorted int64 element indices from the union of ``ranges`` (disjoint ``[start, end)``): all of
    them when they hold at most ``n``, else ``n`` distinct ones drawn with a CPU generator seeded with
    ``seed`` (the same on every machine). Sampling the whole model, not one part, is what was measured:
    one part can be all embedding rows of rare tokens, where every update follows weight decay."""
    ranges = sorted((int(s), int(e)) for s, e in ranges)
    sizes = torch.tensor([e - s for s, e in ranges], dtype=torch.int64)
    total = int(sizes.sum()) if len(ranges) else 0
    if total <= n:
        pos = torch.arange(total, dtype=torch.int64)
    elif total < 2**31 and 0 <= int(seed) < 2**64:
        pos = _randperm_prefix(total, n, int(seed)).sort().values  # a torch op: sorts without the GIL
    else:
        g = torch.Generator(device="cpu")
        g.manual_seed(int(seed))
        pos = torch.randperm(total, generator=g)[:n].sort().values
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes  # position of each range's first element in the union
    which = torch.searchsorted(offsets, pos, right=True) - 1
    return starts[which] + (pos - offsets[which])


def gather(packets: Mapping[int, Any], task: VerifyTask, index: torch.Tensor) -> torch.Tensor:
    """The decoded values of a sender's part packets at the global elements ``index`` (in the task's parts)."""
    out = torch.empty(index.numel(), dtype=torch.float32)
    for j, (s, e) in zip(task.parts, task.ranges):
        sel = (index >= s) & (index < e)
        if bool(sel.any()):
            out[sel] = compression.decode(packets[j])[index[sel] - s]
    return out
