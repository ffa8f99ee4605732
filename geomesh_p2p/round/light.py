"""Light followers (issue 25, docs/round.md "Light followers"): a follower whose DHT traffic per round does
not grow with the swarm.

Every read of ``<run>/peers`` returns all N records (~1 KB each, from a quorum of replicas), and a full-view
peer reads them several times a round (the gather, the plan check, the digest check). A peer of the last
round's plan ranked after the first ``full_view_peers`` (default 8) to lead the next round
(:func:`geomesh_p2p.plan.agree.leader_order` over that plan's participants: the order every full-view peer's
leader election starts from) is a **light follower** instead:

* no gather and no "behind" read: it completed the last round with the swarm and announced its new record;
* the plan: it reads the round's signed plans (all of them, whoever published) and follows the best-ranked
  one that passes every check the plan and the run config allow
  (:meth:`~geomesh_p2p.round.rules.planning.PlanRules.sampled_plan_problem` with no records), then reads the
  records of a sample (the plan's leader and ``light_sample - 1`` participants drawn at random, a subkey
  read) and checks the plan's figures for them;
* the digest: it compares its own with the majority of a random sample of the round's contributors
  (:func:`digest_sample`; the verdict is the full check's, ``finish.judge_digest``).

It never publishes a plan. Whatever it cannot decide from the plan and the sample sends it back to the full
path for the same round (gather, full agreement): no plan in time, a plan led by a peer outside the last
plan's established participants, a plan its checks refuse, a stall. A refused plan of a participant the full path
may let lead (its ledger's bars: the last round's leader and accused included, whom the full path lets lead once no
other of them is live, which only its records read tells) hands the round over as soon as that plan's settle ends,
not after the whole agreement (session 49). So a light follower either follows the
plan the full path would pick, or takes the full path. What it gives up is a lie about an unsampled
participant's figures, which each light follower sees with probability (sample size / participants) and the
full-view peers see in full (they then sit the round out rather than fork, :class:`PlanRefused`).

Per round a light follower makes O(1) DHT reads whose size does not depend on N besides the plan itself: its
announcements (node lookups), the plan reads, one subkey read of ``light_sample`` records for the plan and
one or a few for the digest.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import TYPE_CHECKING, Optional, Sequence

from geomesh_p2p.plan.agree import PlanRefused, PlanStalled, leader_order, leader_rank
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.round.context import Phase, RoundContext
from geomesh_p2p.round.eager import drop_speculative
from geomesh_p2p.round.last_plan import remember
from geomesh_p2p.round.levels import next_leaders
from geomesh_p2p.round.planning import discard_early, may_start_early, wait_out
from geomesh_p2p.round.steps import inner_steps
from geomesh_p2p.schema.shards import record_shard
from geomesh_p2p.telemetry import events

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

log = logging.getLogger("geomesh_p2p.node.peer.round")

#: Draws of the samples: from the OS's entropy, so a leader cannot tell which participants a follower checks.
_draw = random.SystemRandom()


def is_light(drv: RoundDriver) -> bool:
    """Whether this peer runs round ``drv.state.round`` as a light follower: it followed, applied and confirmed
    the previous round's plan, is in it, is ranked ``full_view_peers`` or later among its participants (its leader
    left out) that the full path lets lead this round (:func:`lead_order`: established in its own ledger, no
    no-show, none that verified work excludes), and nothing sent it back to the full path for this round. Never
    with eager updates (their speculative steps span the plan agreement) or while stopping or leaving."""
    cfg, plan, r = drv.cfg, drv._last_plan, drv.state.round
    if cfg.full_view_peers <= 0 or cfg.eager or plan is None or plan.round != r - 1:
        return False
    if drv._light_ok_round != r or drv._light_fallback_round == r:
        return False
    if drv.stop.is_set() or drv.leaving or drv.state.syncing:
        return False
    if drv.me not in _may_take_over(plan):
        return False
    order = lead_order(drv, plan, r)
    return order is not None and drv.me not in order[: cfg.full_view_peers]


def _may_take_over(plan: RoundPlan, among: Optional[Sequence[str]] = None) -> list[str]:
    """The participants of ``plan`` that may lead the next round (planning.next_leaders: not its leader nor those
    it names accused, else not its leader, else any; the first level with one of ``among``, by default with any),
    so that full_view_peers candidates stay full-view peers and every light follower's candidate can lead. PeerIDs,
    sorted."""
    pool = plan.participants() if among is None else list(among)
    for took in next_leaders(plan):
        if any(p in took for p in pool):
            return [p for p in plan.participants() if p in took]
    return plan.participants()


def lead_order(drv: RoundDriver, plan: RoundPlan, r: int) -> Optional[list[str]]:
    """The participants of ``plan`` (round ``r - 1``) that the full path lets lead round ``r``, in the order of
    its leader election (:func:`leader_order`): the first ``full_view_peers`` are the full-view peers, the turns
    that pace a light follower's plan reads. PeerIDs; None when this peer's ledger is too short to rank them
    (``RoundPolicy.may_lead_ids``: it takes the full path)."""
    # ranked among those the full path lets lead (RoundPolicy.may_lead_ids: the bars of its leader_candidates). A
    # peer that applied the last round missed none, so its own ledger decides, no record read. Ranked among every
    # participant instead, the only established peer of a loaded e2e run (the others' underfilled round 0 earned no
    # standing) ran light and waited a whole plan attempt for plans from peers that deferred to it (session 38);
    # ranked among every established one, a crashed no-show ranked first held the only full-view slot (session 39)
    ids: Optional[list[str]] = []
    for took in next_leaders(plan):  # the first level that holds one it lets lead, as the full path's candidates
        ids = drv.policy.may_lead_ids((), sorted(took))
        if ids is None:
            return None
        if ids:
            break
    return leader_order(plan.run_id, r, ids or [])


#: Most records one sampled read asks for (the DHT's subkeys per find, RecordLimits.max_keys_per_find).
MAX_SAMPLE = 64


def draw_in_shards(peers: Sequence[str], k: int, shards: int) -> list[str]:
    """``k`` of ``peers`` (all when fewer) drawn at random. With ``shards`` > 1 (the run's ``record_shards``) they are
    drawn a shard at a time: a peer drawn at random picks the shard, then others of that shard, and only when it
    holds fewer than ``k`` another shard: a sampled read then asks one or two shard keys, not up to ``k`` of them
    (each a lookup). Every peer is equally likely to be drawn first, but the others come from its shard: a liar
    whose lies fill one shard is seen ~1/S of the time (red team, session 19), so only the digest check draws
    this way (its sample is a vote, and filling a shard with identities costs S x their proof of work); the plan
    check draws uniformly (:func:`plan_sample`)."""
    if shards <= 1:
        return _draw.sample(list(peers), min(len(peers), k))
    left, out = list(peers), list[str]()
    while left and len(out) < k:
        shard = record_shard(_draw.choice(left), shards)
        same = [p for p in left if record_shard(p, shards) == shard]
        out += _draw.sample(same, min(len(same), k - len(out)))
        left = [p for p in left if record_shard(p, shards) != shard]
    return out


def plan_sample(plan: RoundPlan, me: str, k: int, needed: Sequence[str] = ()) -> list[str]:
    """The participants whose records a light follower reads to check ``plan``: its leader, every one of
    ``needed`` (whose assignment the plan alone cannot check, :func:`geomesh_p2p.plan.planner.records_needed`),
    and others drawn uniformly at random up to ``k`` in all, whatever the run's ``record_shards`` (the read then asks
    the keys of the shards drawn, ~S(1 - (1 - 1/S)^k) of them: a leader cannot hide its lies in one shard). This
    peer is in it only when needed (its own record is its current one, not read: the plan's lie may be about this
    peer)."""
    first = list(dict.fromkeys([*([plan.leader] if plan.leader != me else []), *needed]))
    others = [p for p in plan.participants() if p != me and p not in first]
    return first + _draw.sample(others, min(len(others), max(0, k - len(first))))


async def agree(drv: RoundDriver, ctx: RoundContext) -> Optional[bool]:
    """Phase PLAN of a light follower (see the module). True: follow ``ctx.plan``; False: no round for this
    peer (planned out or other weights: it waited for the round's end and re-synced); None: take the full
    path for this round (the driver gathers and agrees again; this round is no longer light)."""
    drv.phase = Phase.PLAN
    r, prev = ctx.round, drv._last_plan
    assert prev is not None  # is_light checked it
    established = [a.peer_id for a in prev.assignments if not a.probation]
    # no self-succession, and none of the accused of round r - 1's plan while another can (planning.next_leaders)
    took = set(_may_take_over(prev, established))
    barred = {p for p in established if p not in took}
    established = [p for p in established if p in took] or established
    # The candidates whose turns pace the plan reads (obtain_plan wakes at each take-over instant): the full-view
    # peers (is_light's order, so a barred no-show neither paces the reads nor blocks as a refused candidate); every
    # stored plan is read whoever leads it.
    candidates = [p for p in (lead_order(drv, prev, r) or [])[: drv.cfg.full_view_peers] if p != drv.me]
    # The participants the full path may let lead under some liveness (its ledger's bars, none of the levels):
    # others may follow their plans, so one refused here is handed to the full path once its settle ends
    # (obtain_plan's authorities: PlanRefused), not waited out as absent. Session 49 (CI, test_ctrl_c...): c2 left
    # after round 0, c0 (its leader) led round 1 as the full path's last level, and this newcomer, barring c0 while
    # c2 was established in round 0's plan, waited the whole agreement for c2's plan, then came too late for c0's.
    authorities = [p for p in (drv.policy.may_lead_ids((), prev.participants()) or []) if p != drv.me]

    def on_provisional(p: RoundPlan) -> None:
        # as the full path (planning.agree): train on the plan most likely followed while the settle runs
        if ctx.early is None and drv._spec is None and may_start_early(drv, p):
            ctx.early_plan, ctx.early_abort = p, threading.Event()
            ctx.early = asyncio.ensure_future(inner_steps(drv, ctx, p, ctx.early_abort))

    def never(*_args) -> RoundPlan:  # a light follower is no candidate: obtain_plan never asks it to lead
        raise RuntimeError("a light follower does not lead")

    outsiders: set[str] = set()  # leaders of plans read that were no established participant of the last round

    def accept(p: RoundPlan) -> Optional[str]:
        if p.leader not in established:
            # Not followed from here (its leader may be a Sybil: it would send every light follower to the full
            # path each round, or the last round's leader, which the full path refuses as content); whether the
            # full-view peers may follow it is asked once the choice is made.
            outsiders.add(p.leader)
            if p.leader in barred:  # the full path lets it lead where no other of them is live: records say
                return (
                    f"its leader {p.leader[:10]} led round {prev.round} or was named accused in it, and leads only "
                    "where no other established participant of it is live"
                )
            return f"its leader {p.leader[:10]} was no established participant of round {prev.round}"
        return drv.policy.sampled_plan_problem(p, {}, ())

    why: Optional[str] = None
    plan: Optional[RoundPlan] = None
    try:
        plan = await drv.plans.agree(
            r,
            [],
            never,
            accept=accept,
            candidates=candidates,
            plan_timeout_s=drv.cfg.plan_timeout_s,
            provisional=on_provisional,
            authorities=authorities,
        )
    except PlanRefused as e:
        why = f"it refuses the best-ranked plan ({e.reason})"
    except PlanStalled as e:
        why = f"this peer was not running for {e.stalled_s:.1f} s"
    if plan is None and why is None:
        why = "no plan appeared"
    if plan is not None and why is None:
        why = await outsider_problem(drv, plan, outsiders)
    if plan is not None and why is None:
        why = await check_sample(drv, plan)
    if why is not None:
        return await fall_back(drv, ctx, why)
    assert plan is not None
    if ctx.early is not None and (ctx.early_plan is None or plan.to_bytes() != ctx.early_plan.to_bytes()):
        await discard_early(drv, ctx, plan)
    ctx.plan = plan
    remember(drv, plan)  # the next round's leaders (planning.last_round_leaders), this peer's record's reference
    if drv.me not in plan.participants() or plan.start_digest != drv.state.digest:
        await drop_speculative(drv, "not in the plan" if drv.me not in plan.participants() else "weights differ")
        await wait_out(drv, ctx)
        return False
    return True


async def outsider_problem(drv: RoundDriver, plan: RoundPlan, outsiders: set[str]) -> Optional[str]:
    """The reason to leave the light path when a plan of the round ranks before ``plan`` and its leader, no
    established participant of the last round, has a live admitted record (an established peer that re-synced
    may lead a plan the full-view peers follow); None when there is none, or none of them announces (a Sybil
    without a record, or one whose record the admission rules drop: one subkey read)."""
    rank = leader_rank(plan.run_id, plan.round, plan.leader)
    before = sorted(p for p in outsiders if leader_rank(plan.run_id, plan.round, p) < rank)
    if not before:
        return None
    try:
        # not a sampled read: a record missing here keeps this peer light, so it is read from the full quorum
        live = [x.peer_id for x in await drv.membership.records_of(before[:MAX_SAMPLE], sampled=False) if not x.leaving]
    except Exception as e:  # a failed read: the full path decides
        return f"reading the records of {len(before)} better-ranked leader(s) failed ({type(e).__name__}: {e})"
    if live or len(before) > MAX_SAMPLE:
        who = ", ".join(p[:10] for p in (live or before)[:3])
        return f"a better-ranked plan's leader ({who}) was no established participant of round {plan.round - 1}"
    return None


async def check_sample(drv: RoundDriver, plan: RoundPlan) -> Optional[str]:
    """Read the records of :func:`plan_sample` (one subkey read) and check ``plan`` against them; the reason
    to leave the light path, or None."""
    needed = drv.policy.records_needed(plan)
    if len(needed) >= MAX_SAMPLE:
        return f"{len(needed)} participants' assignments need their records checked: more than one read holds"
    sample = plan_sample(plan, drv.me, drv.cfg.light_sample, needed)
    try:
        recs = await drv.membership.records_of(sample)
    except Exception as e:  # a failed read: the full path decides
        return f"reading the sample's records failed ({type(e).__name__}: {e})"
    sampled = {x.peer_id: x for x in recs if not x.leaving}
    reason = drv.policy.sampled_plan_problem(plan, sampled, sample)
    return None if reason is None else f"the plan fails its check against {len(sample)} sampled records: {reason}"


async def fall_back(drv: RoundDriver, ctx: RoundContext, why: str) -> Optional[bool]:
    """Leave the light path for this round (one INFO line): discard steps started on a provisional plan, and
    mark the round so that :func:`is_light` says no. Returns None (the caller's "take the full path")."""
    if ctx.early is not None:
        await discard_early(drv, ctx, None)
    drv._light_fallback_round = ctx.round
    events.emit(
        log,
        logging.INFO,
        "light_fallback",
        "round %d: light follower takes the full path this round: %s",
        ctx.round,
        why,
        peer=drv.me,
        round=ctx.round,
        reason=why,
    )
    return None


async def digest_sample(drv: RoundDriver, r: int, participants: Sequence[str]) -> list:
    """A light follower's votes on the digest of round ``r``: this peer's own and those of up to ``light_sample``
    of ``participants`` drawn at random that announced round ``r`` with a digest (one subkey read, polled with
    backoff until all did or ``digest_wait_s``). Only ``round`` and ``weights_digest`` of each vote are read
    (:func:`~geomesh_p2p.plan.agree.digest_majority`)."""
    others = [p for p in participants if p != drv.me]
    sample = draw_in_shards(others, drv.cfg.light_sample, drv.cfg.record_shards)
    deadline = drv.clock.monotonic() + drv.cfg.digest_wait_s
    backoff = drv.backoff()
    recs: list = []
    while sample:
        try:
            recs = [x for x in await drv.membership.records_of(sample) if x.round == r and x.weights_digest]
        except Exception as e:  # a failed read: try again until the deadline
            log.debug("round %d: reading the digest sample failed: %r", r, e)
        if len(recs) >= len(sample) or drv.clock.monotonic() > deadline:
            break
        if await drv.pause(min(backoff.next(), max(0.0, deadline - drv.clock.monotonic()) + 0.01)):
            break
    return recs + [_Vote(r, drv.state.digest, drv.me)]


class _Vote:
    """This peer's own vote in :func:`digest_majority` (its round, digest and PeerID; nothing else is read)."""

    def __init__(self, round: int, digest: Optional[str], peer_id: str):
        self.round, self.weights_digest, self.peer_id = round, digest, peer_id
