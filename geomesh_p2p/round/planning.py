"""Phase PLAN: the plan this peer follows for the round (:func:`agree`: the policy's leader candidates,
the plan agreement port, the live view kept fresh meanwhile, inner steps started on the provisional plan
during its settle), a last resort when no candidate publishes (:func:`last_resort`), and a planned-out
peer's wait for the round's end before it re-syncs (:func:`wait_out`). Functions of the
:class:`~geomesh_p2p.round.driver.RoundDriver` (its ports: plans, membership, policy, state)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Optional, Sequence

from geomesh_p2p.plan.agree import PlanDeferred, PlanRefused, PlanStalled
from geomesh_p2p.plan.schema import RoundPlan
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.round import resync as resync_rules
from geomesh_p2p.round.context import Phase, RoundContext
from geomesh_p2p.round.eager import drop_speculative
from geomesh_p2p.round.gather import ROUND_END_SLACK_S
from geomesh_p2p.round.last_plan import Recovered, named_refs, plan_ref, recover, remember
from geomesh_p2p.round.levels import LEADER_RESORT_MISSES as LEADER_RESORT_MISSES
from geomesh_p2p.round.levels import announced_gaps as announced_gaps
from geomesh_p2p.round.levels import last_round_leaders as last_round_leaders
from geomesh_p2p.round.levels import lead_problem as lead_problem
from geomesh_p2p.round.levels import next_leaders as next_leaders
from geomesh_p2p.round.levels import plan_tiers as plan_tiers
from geomesh_p2p.round.levels import ungapped_leaders as ungapped_leaders
from geomesh_p2p.round.steps import inner_steps

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")


async def refresh_live(drv: RoundDriver, live: dict, done: asyncio.Event, leaving: Optional[dict] = None) -> None:
    """Add newly seen live peers to ``live`` (and, when given, the records that announce leaving to
    ``leaving``) until ``done``: backoff, restarting when a peer appears. Stopped by the event, not
    cancelled, so that a lookup in flight finishes and its result is kept (a cancelled lookup is safe too:
    its tasks are owned by an :class:`~geomesh_p2p.util.aio.TaskScope`)."""
    backoff = Backoff(drv.cfg.backoff_first_s * 4, max(drv.cfg.backoff_first_s * 4, drv.cfg.live_refresh_s))
    while not await wait_event(done, backoff.next()):
        try:
            read = await drv.membership.peers(include_leaving=leaving is not None)
        except Exception as e:  # a failed DHT read: keep the last view
            log.debug("refreshing live peers failed: %s", e)
            continue
        fresh = {x.peer_id: x for x in read if not x.leaving}
        if leaving is not None:
            leaving.update({x.peer_id: x for x in read if x.leaving})
        if set(fresh) - set(live):
            backoff.reset()
        live.update(fresh)


def known_view(live: dict, leaving: dict, recent: Optional[dict] = None) -> dict:
    """The records a follower checks a plan against: the live ones, those that announced leaving, and
    (``recent``) those its gathers read within ``RECENT_RECORD_S`` whose records have expired since. A
    leader whose read came before a peer's leaving record planned it (under load the announcement is
    seconds late), or read a record that expired before this peer's read: following that plan costs that
    peer's parts at most, refusing it makes this peer sit the round out (issue 25; before, it led a plan of
    its own and the survivors of test_ctrl_c_peer_leaves_cleanly... forked). Newest first: live, leaving,
    recent."""
    return {**(recent or {}), **leaving, **live}


def doubt_problem(plan: RoundPlan, doubt: Optional[Recovered], r: int, candidates: Sequence[str]) -> Optional[str]:
    """Why a peer in doubt of round ``r - 1``'s plan (:func:`~geomesh_p2p.round.last_plan.recover`) does not follow
    ``plan``: a plan it names and could read would not let ``plan``'s leader lead (:func:`lead_problem` over this
    peer's ``candidates``), or it could read none. A plain reason, no :class:`ContentRefusal`: the peers holding
    that plan may follow ``plan``, so this peer sits the round out where ``plan`` ranks first rather than follow
    another (``PlanRefused``). None: no doubt, or every plan named lets that leader lead."""
    if doubt is None:
        return None
    if not doubt.doubt:
        return f"this peer does not hold round {r - 1}'s plan and cannot tell which it was ({doubt.why})"
    for q in doubt.doubt:
        if lead_problem(plan, last_round_leaders(q, r, candidates)) is not None:
            return (
                f"its leader {plan.leader[:10]} may not lead under the plan of round {r - 1} from {q.leader[:10]}, "
                f"one of those this peer's voters name ({doubt.why})"
            )
    return None


async def recover_last_plan(drv: RoundDriver, r: int, live: dict, candidates: Sequence[str]) -> Optional[Recovered]:
    """Round ``r - 1``'s plan for this peer when it did not obtain it (:func:`~geomesh_p2p.round.last_plan.recover`
    over its ``live`` records, its leader ``candidates`` but itself voting): taken (``drv._plan_seen``, one INFO
    line) and None returned, or the :class:`Recovered` in doubt (one WARNING line a round), or None (this peer holds
    that plan or kept it from an earlier attempt, round 0, no voter names one, or a plan agreement without
    ``plan_of``)."""
    seen, read = drv._plan_seen, getattr(drv.plans, "plan_of", None)
    if r < 1 or (seen is not None and seen.round == r - 1):
        return None
    mine = (getattr(drv, "_plans_by_round", None) or {}).get(r - 1)
    if mine is not None:
        # It obtained round r - 1's plan, then one of round r in an attempt that left its state at round r: the rule
        # is still round r - 1's plan's (before, no rule applied in such a retry, while it did at a peer whose
        # earlier attempt found no plan)
        drv._plan_seen = mine
        return None
    if read is None:
        return None
    voters = [c for c in candidates if c != drv.me]
    held = await recover(read, list(live.values()), r, drv.state.digest, voters)
    if held is None:
        return None
    if held.plan is not None:
        remember(drv, held.plan)
        events.emit(
            log,
            logging.INFO,
            "last_plan_recovered",
            "round %d: this peer did not obtain round %d's plan; took the one its records name: %s",
            r,
            r - 1,
            held.why,
            peer=drv.me,
            round=r,
            leader=held.plan.leader,
        )
        note = getattr(getattr(drv, "policy", None), "note_recovered_plan", None)
        if (
            note is not None
            and drv.state.digest != held.plan.start_digest
            and vouched(list(live.values()), r, drv.state.digest, voters, held.plan)
            and note(held.plan)
        ):
            # the plan made this state (its voters hold it) and named this peer, which ran none of it: the marks the
            # others took on it there (fresh user 51)
            log.info(
                "round %d: round %d's plan named this peer, which ran none of it: it takes the marks the others "
                "took on it then",
                r,
                r - 1,
            )
            drv._sat_out_taken = r
        return None
    if getattr(drv, "_doubt_said", None) != r:
        drv._doubt_said = r
        events.emit(
            log,
            logging.WARNING,
            "last_plan_in_doubt",
            "round %d: this peer does not hold round %d's plan and cannot take one (%s): it follows only a plan "
            "whose leader every plan named may let lead, leads nothing, and sits the round out otherwise",
            r,
            r - 1,
            held.why,
            peer=drv.me,
            round=r,
        )
    return held


def vouched(records: list, r: int, digest: Optional[str], voters: Sequence[str], plan: RoundPlan) -> bool:
    """Whether more than half of ``voters``' ``records`` at round ``r`` and ``digest`` name ``plan`` (round ``r - 1``'s),
    not only more than half of the references named: a recovered plan's marks (``note_recovered_plan``) are taken on
    their word alone. Red team 51c: where the honest voters name none (a joint restart, red team 48), one rogue's
    reference to a plan it forged naming this peer was taken, and this peer benched itself and barred itself from
    owning parts for marks no honest peer held (it would refuse their plans naming it an owner)."""
    who = set(voters)
    n = len({x.peer_id for x in records if x.peer_id in who and x.round == r and digest and x.weights_digest == digest})
    return named_refs(records, r, digest, voters)[plan_ref(plan)] * 2 > n


async def agree(drv: RoundDriver, ctx: RoundContext) -> bool:
    """Phase PLAN: the plan this peer follows (it publishes one when its turn as leader comes). A peer
    alone in the run plans its own round at once (no DHT round trips eat its window). False: no
    round for this peer (no plan, or not in it: it waited for the round's end and re-synced)."""
    drv.phase = Phase.PLAN
    r = ctx.round
    live = ctx.live
    # The gather's last read is a moment old: reuse it (one DHT get less between the gather and the
    # plan, issue 17); the refresher below keeps the view fresh while the plan is agreed.
    gathered, drv._gathered = drv._gathered, None
    leaving: dict = dict(drv._gathered_leaving) if gathered is not None else {}
    recent = drv.recent()
    drv._gathered_leaving = {}
    live.update(gathered if gathered is not None else {x.peer_id: x for x in await drv.membership.peers()})
    members, candidates = drv.policy.leader_candidates(ctx.members, live)
    # Without round r - 1's plan no rule of who may lead would apply here while it applies at the others: take the
    # plan their records name, or doubt (red team 47b, round/last_plan.py)
    doubt = await recover_last_plan(drv, r, live, candidates)
    if getattr(drv, "_sat_out_taken", None) == r:  # its own marks of round r - 1 taken just now: who may lead moved
        drv._sat_out_taken = None
        members, candidates = drv.policy.leader_candidates(ctx.members, live)
    judged = list(candidates)  # in doubt, each plan named is judged over these, as took would be over it
    # who may lead is tested over the candidates that lead at all: a gapped one counts nowhere (fresh user 52)
    gaps = gaps_of(drv, live, candidates, r)
    took = ungapped_leaders(drv._plan_seen, r, candidates, gaps)
    # After an attempt at this round and state with no plan at all, the accused may lead (a silent candidate held
    # the first level, red team 47): as last resorts only (the candidates, whose turns come first, are kept), so
    # a plan of the first level, where one appears, is the one every peer follows.
    missed = drv._plan_misses[2] if drv._plan_misses[:2] == (r, drv.state.digest) else 0
    # (round r - 1's leader from LEADER_RESORT_MISSES on, ranked after the established last resorts: session 52)
    may_lead = ungapped_leaders(drv._plan_seen, r, candidates, gaps, missed=missed) if missed else took
    if took is not None:
        candidates = [c for c in candidates if c in took]
    if doubt is not None:  # a plan of this peer's could be one the others refuse as content: it leads nothing
        candidates = [c for c in candidates if c != drv.me]
    refused_before = drv._refused_leaders[2] if drv._refused_leaders[:2] == (r, drv.state.digest) else frozenset()
    if refused_before:
        # An earlier attempt at this round and state sat out a plan this peer refuses: its leader is no
        # candidate now (its plan stays refused; else a leader all refuse would stall the round forever).
        candidates = [c for c in candidates if c not in refused_before]
    # Established live peers outside this peer's members (in sync at another state, or not gathered): others
    # may follow their plans, so one this peer refuses is not bypassed either (obtain_plan's authorities).
    # Records a gather read within RECENT_RECORD_S count (a read under load misses records).
    seen = {**{p: x for p, x in recent.items() if not x.leaving}, **live}
    authorities = [
        p
        for p in drv.policy.leader_candidates(list(seen.values()), seen)[1]
        if p not in candidates and p not in refused_before and p != drv.me and (took is None or p in took)
    ]
    plan: Optional[RoundPlan]
    refused_plan: Optional[RoundPlan] = None  # a plan others may follow that this peer refuses: it sits out
    stalled = False  # this process was not running through the agreement (PlanStalled): the round starts over
    # A peer read by a gather within RECENT_RECORD_S and not leaving may still be there: its record expired
    # or was missed by this read (under load). Planning alone without reading the plans would fork off a
    # lineage of one (issue 25: a peer whose reads lost every other record trained rounds by itself).
    others_recent = any(p != drv.me and not x.leaving for p, x in recent.items())
    if [m.peer_id for m in members] == [drv.me] and set(live) == {drv.me} and not others_recent:
        # Lone peer: nobody else can lead, follow or read a plan; plan with a fresh start time so
        # the whole window trains (the DHT, maybe unreachable, is not asked).
        try:
            plan = drv.policy.make_plan(members, drv.me)
        except PlanDeferred:  # the policy said why, once: wait without an ERROR every pause
            await drv.pause(drv.cfg.plan_timeout_s)
            return False
        except Exception as e:
            log.error("round %d: planning failed (%s: %s)", r, type(e).__name__, e)
            await drv.pause(drv.cfg.plan_timeout_s)
            return False
        drv.plans.publish_background(plan)  # for the status page; nobody waits for it
    else:
        # Not cancelled by a stop request (bounded by the plan timeouts): once the others follow a plan
        # naming this peer, it must serve its part and contribute (only the floor's steps if stopping). The live view
        # stays fresh meanwhile: a peer that (re)joined just now may lead a better-ranked plan.
        done = asyncio.Event()
        refresher = asyncio.ensure_future(refresh_live(drv, live, done, leaving))

        def make_plan(ms: Sequence[PeerRecord], leader: str) -> RoundPlan:
            # A member that announced leaving since the gather is not planned (its parts would go missing).
            return drv.policy.make_plan([m for m in ms if m.peer_id not in leaving or m.peer_id == drv.me], leader)

        def on_provisional(p: RoundPlan) -> None:
            # The settle (plans.obtain_plan) waits for a better-ranked plan that almost never comes:
            # train on the plan it will most likely return meanwhile; discarded below if another wins.
            if ctx.early is None and drv._spec is None and may_start_early(drv, p):
                ctx.early_plan, ctx.early_abort = p, threading.Event()
                ctx.early = asyncio.ensure_future(inner_steps(drv, ctx, p, ctx.early_abort))

        resort = [] if doubt is not None else last_resort(drv, r, members, candidates, may_lead)
        # a plan of an earlier level of round r - 1's plan wins in every view that accepts it (red team 52b)
        tiers = plan_tiers(drv._plan_seen, r)
        gapped = announced_gaps(live, candidates, r, drv.me)
        try:
            plan = await drv.plans.agree(
                r,
                members,
                make_plan,
                accept=lambda p: (
                    lead_problem(p, may_lead)
                    or doubt_problem(p, doubt, r, judged)
                    or drv.policy.plan_problem(p, known_view(live, leaving, recent))
                ),
                # the plans accept could take (their leader must be in this view): the others stay unread
                leaders=lambda: known_view(live, leaving, recent),
                candidates=candidates,
                plan_timeout_s=drv.cfg.plan_timeout_s,
                provisional=on_provisional,
                **({"last_resort": resort} if resort else {}),
                **({"authorities": authorities} if authorities else {}),
                **({"gapped": gapped} if gapped else {}),
                tiers=tiers,
            )
        except PlanRefused as e:
            # Others may follow a plan this peer refuses: following another one would fork the lineage. Sit
            # the round out (wait for its end, re-sync to what the swarm made); the round gets longer for this
            # peer, the swarm keeps one lineage (issue 25, docs/round.md "No fork under overload").
            refused = drv._refused_leaders[2] if drv._refused_leaders[:2] == (r, drv.state.digest) else frozenset()
            drv._refused_leaders = (r, drv.state.digest, refused | {e.plan.leader})
            refused_plan = e.plan
            plan = None
        except PlanStalled as e:
            # This process was not running through the agreement: its view is stale, so its turn as leader is
            # not taken (a plan from it could name peers that left, or train alone). The round starts over
            # from a fresh gather; no plan miss is counted (the others may well have agreed meanwhile).
            events.emit(
                log,
                logging.WARNING,
                "plan_stalled",
                "round %d: this peer was not running for %.1f s while the plan was agreed; reading the swarm "
                "again instead of taking over as leader from a view that old",
                r,
                e.stalled_s,
                peer=drv.me,
                round=r,
                stalled_s=e.stalled_s,
            )
            plan, stalled = None, True
        finally:
            done.set()  # the lookup under way finishes (bounded by the DHT's RPC timeouts)
            await asyncio.gather(refresher, return_exceptions=True)
    alone = plan is not None and left_alone_in_plan(drv, ctx, plan, leaving)
    if ctx.early is not None and (
        plan is None or alone or ctx.early_plan is None or plan.to_bytes() != ctx.early_plan.to_bytes()
    ):
        await discard_early(drv, ctx, None if alone else plan)
    if alone and plan is not None:
        await drop_speculative(drv, "every other member left")
        events.emit(
            log,
            logging.INFO,
            "round_alone_skipped",
            "round %d: the plan names only this peer and every other peer gathered for the round (%d) announced "
            "leaving since: not training it alone (a lineage of one that the others would refuse on their return)",
            r,
            len(ctx.members) - 1,
            peer=drv.me,
            round=r,
            leader=plan.leader,
            left=sorted(m.peer_id for m in ctx.members if m.peer_id != drv.me),
        )
        return False
    if stalled:
        await drop_speculative(drv, "stalled during the plan agreement")
        return False
    if refused_plan is not None:
        await drop_speculative(drv, "sitting out a refused plan")
        ctx.plan = refused_plan
        await wait_out(drv, ctx, refused=True)
        return False
    key = (r, drv.state.digest)
    misses = drv._plan_misses[2] if drv._plan_misses[:2] == key else 0
    drv._plan_misses = (r, drv.state.digest, misses + 1 if plan is None else 0)
    if plan is None:
        await drop_speculative(drv, "no plan appeared")
        drv.note_activity("no plan")
        if not drv.stop.is_set():
            log.warning("round %d: no plan appeared; retrying", r)
        return False
    ctx.plan = plan
    remember(drv, plan)
    if drv.stop.is_set() and drv.me not in plan.participants():
        await drop_speculative(drv, "stopping, not in the plan")
        return False
    if drv.me not in plan.participants() or plan.start_digest != drv.state.digest:
        await drop_speculative(drv, "not in the plan" if drv.me not in plan.participants() else "weights differ")
        await wait_out(drv, ctx)
        return False
    return True


def gaps_of(drv: RoundDriver, live: dict, candidates: Sequence[str], r: int) -> set[str]:
    """The ``candidates`` that lead nothing in round ``r`` by a gap announced in their records (:func:`announced_gaps`),
    and this peer when its own record announced one (``policy.announced_lead_from``, kept to:
    ``NodeRoundPolicy.leader_candidates``). PeerIDs."""
    own = getattr(getattr(drv, "policy", None), "announced_lead_from", None)
    mine = {drv.me} if type(own) is int and own > r else set()
    return set(announced_gaps(live, candidates, r, drv.me)) | mine


def left_alone_in_plan(drv: RoundDriver, ctx: RoundContext, plan: RoundPlan, leaving: dict) -> bool:
    """Whether ``plan`` names this peer alone while the round was gathered with others, every one of whom
    announced leaving since (``leaving``: their records; a fresh-user trial, session 37: all three peers were
    stopped at once, one had gathered the others just before their announcement, took over as leader, trained
    the round by itself and resumed on a state of its own lineage). Only with ``--min-peers`` 2 or more, or
    while this peer stops too: ``--min-peers 1`` asks to train on alone."""
    others = {m.peer_id for m in ctx.members} - {drv.me}
    gathered = {m.peer_id: float(m.timestamp) for m in ctx.members}
    # a leaving record older than the live one gathered is a previous session's, served by a stale or hostile
    # holder (red team 37b): that member did not leave
    left = {p for p, x in leaving.items() if float(getattr(x, "timestamp", 0.0)) >= gathered.get(p, 0.0)}
    return (
        plan.participants() == [drv.me]
        and bool(others)
        and others <= left
        and (drv.cfg.min_peers >= 2 or drv.stop.is_set())
    )


def last_resort(
    drv: RoundDriver,
    r: int,
    members: Sequence[PeerRecord],
    candidates: Sequence[str],
    may_lead: Optional[frozenset] = None,
) -> list[str]:
    """The members that are no leader candidates (this peer among them) when this peer must publish a plan
    itself if no candidate does (``last_resort`` of
    :func:`~geomesh_p2p.plan.agree.obtain_plan`), else ``[]``.

    The leader candidates are computed by each member from its own view (standing, no-show marks), and
    a member leaves itself out where it expects the others to refuse its plan: while it is not
    established in its own view (a newcomer follows the peers whose state it downloaded), or while it
    marked itself a no-show. Views differ, so every member can defer to another that defers in turn
    (rs7: two peers, each the other's only candidate, "no plan appeared; retrying" for 6 minutes). So
    once an attempt at this round and state ended with no plan at all, a member in sync that is no
    candidate becomes the last resort: it publishes after every candidate's turn has passed with no
    plan read, refused ones included (docs/round.md, "Leader election when nobody leads"). A healthy
    established leader publishes within its turn of the first attempt, so a newcomer following it never
    gets there (the young-swarm rule holds); one WARNING per round.

    ``may_lead``: who may lead this round (:func:`last_round_leaders`, None: anyone). A member outside it is no last
    resort: every peer refuses its plan as content (red team 47: round r - 1's leader, a last resort too, ranked
    before the accused, and its refused plan would only have delayed the accused's). So round r - 1's leader is one
    only from ``LEADER_RESORT_MISSES`` attempts with no plan (where the others' level holds a candidate): after the
    candidates' whole attempt and the established last resorts' (the accused's) whole attempt, and before any
    newcomer's (:func:`newcomer_resort_misses`; issue 28, session 52)."""
    member_ids = {m.peer_id for m in members}
    if drv.me in candidates or drv.me not in member_ids or (may_lead is not None and drv.me not in may_lead):
        return []
    if drv._plan_misses[:2] != (r, drv.state.digest) or drv._plan_misses[2] < 1:
        return []
    resorts = sorted(p for p in member_ids - set(candidates) if may_lead is None or p in may_lead)
    est = established_resorts(drv, members, candidates, resorts)
    wait = newcomer_resort_misses(drv, r, members, candidates)
    if drv.me not in est and drv._plan_misses[2] < wait:
        if drv._plan_misses[2] == 1:
            log.info(
                "round %d: no plan appeared in a whole attempt; this peer is on probation in its own view while "
                "established peers may lead (%s): it publishes no plan as a last resort (the peers holding the "
                "standing would refuse it)",
                r,
                ", ".join(p[:10] for p in sorted(set(candidates) | set(est))) or "none",
            )
        return []
    late = drv.me not in est
    if late:  # the established ones published nothing in a whole escalated attempt either (red team 51c)
        est = resorts
    # its first attempt as a last resort: once (round r - 1's leader is one from LEADER_RESORT_MISSES where the
    # others' level held a candidate: last_round_leaders)
    first = wait if late else LEADER_RESORT_MISSES if drv.me in barred_last_leader(drv, r, candidates) else 1
    if drv._plan_misses[2] == first:
        events.emit(
            log,
            logging.WARNING,
            "plan_last_resort",
            "round %d: no plan appeared in a whole attempt; this peer is no leader candidate in its own view "
            "and the %d it defers to (%s) published none: it publishes a plan itself if none appears "
            "after their turns",
            r,
            len(candidates),
            ", ".join(c[:10] for c in candidates) or "none",
            peer=drv.me,
            round=r,
            candidates=list(candidates),
            attempts=drv._plan_misses[2],
        )
    # Every member that is no candidate, not only this peer: obtain_plan ranks them among themselves, so
    # two last resorts publish a stagger apart and the second follows the first's plan (review: with
    # ``[me]`` alone both sat at the same instant and, refusing each other's plans, split the round). A peer on
    # probation is none while an established peer may lead (established_resorts, fresh user 51).
    return est


#: Attempts at a round and state that ended with no plan at all before a peer on probation in its own view is a last
#: resort beside an established one (:func:`established_resorts`), one more where round r - 1's leader is an
#: established member that is a last resort only from ``LEADER_RESORT_MISSES`` (:func:`newcomer_resort_misses`).
#: Red team 51c: with 1 (never), one established peer that stays live and publishes nothing, not even as a last
#: resort (a rogue, or one whose own view leaves it out), held every newcomer of a young swarm out of leading while its
#: record lived: no plan at all, for ever. The established last resorts publish in the second attempt; a newcomer
#: reaches the third only if none did.
NEWCOMER_RESORT_MISSES = 2


def established_resorts(
    drv: RoundDriver, members: Sequence[PeerRecord], candidates: Sequence[str], resorts: list[str]
) -> list[str]:
    """The last resorts ``resorts`` that publish: the established ones in this peer's view
    (:meth:`~geomesh_p2p.round.ports.RoundPolicy.standing_established_ids`) when any of ``candidates`` or ``resorts``
    is established, else all of them (nobody established: a young swarm). Sorted PeerIDs.

    Why (fresh user 51, round 20): the established peers deferred to each other (the resumed one left itself out for
    the marks it could not know, the other was round 19's leader), so the newcomer, on probation everywhere, published
    as a last resort: the resumed peer followed its plan (plausible there: it missed rounds of the standing window),
    the peer holding the whole window refused it as led by a peer on probation, sat the round out and was marked by
    the other two (late 8 rounds, owner bar 5), which cost rounds 20-29. A plan led by a peer on probation is refused
    by every peer holding the standing while an established peer is live; an established last resort's is not."""
    ids = getattr(getattr(drv, "policy", None), "standing_established_ids", None)
    if ids is None:
        return resorts
    est = ids(list(members), sorted(set(candidates) | set(resorts)))
    return [p for p in resorts if p in est] if est else resorts


def barred_last_leader(drv: RoundDriver, r: int, candidates: Sequence[str]) -> frozenset:
    """Round ``r - 1``'s leader (as a set of one PeerID, else empty) where round ``r - 1``'s plan this peer obtained
    (``drv._plan_seen``) lets it lead round ``r`` only from ``LEADER_RESORT_MISSES`` attempts with no plan: another
    participant is one of ``candidates`` (:func:`last_round_leaders` after one miss leaves it out)."""
    seen = getattr(drv, "_plan_seen", None)
    if seen is None or seen.round != r - 1:
        return frozenset()
    took = last_round_leaders(seen, r, candidates, missed=1)
    return frozenset() if took is None or seen.leader in took else frozenset({seen.leader})


def newcomer_resort_misses(drv: RoundDriver, r: int, members: Sequence[PeerRecord], candidates: Sequence[str]) -> int:
    """Attempts at round ``r`` and this state with no plan at all before this peer, on probation in its own view, is
    a last resort beside established peers: ``NEWCOMER_RESORT_MISSES``, or ``LEADER_RESORT_MISSES + 1`` while round
    ``r - 1``'s leader is a member, established in this peer's view of ``members``, and a last resort only from
    ``LEADER_RESORT_MISSES`` (:func:`barred_last_leader` over ``candidates``).

    Why (issue 28, session 52, the e2e stalled-peer run): the newcomer p2 published at its third attempt while round
    2's leader p0 could not lead (its only candidate p1 stopped, its record live); p0 refused p2's plan (its leader on
    probation) and led round 3 once p1's record lapsed: p0 and p2 applied two states. An established peer refuses a
    newcomer's plan while one is live, so each established last resort gets a whole attempt first. The inputs are
    round ``r - 1``'s plan and the standing, the same ones that make that leader a last resort at its peer."""
    lead = barred_last_leader(drv, r, candidates)
    ids = getattr(getattr(drv, "policy", None), "standing_established_ids", None)
    if not lead or drv.me in lead or ids is None or not lead <= {m.peer_id for m in members}:
        return NEWCOMER_RESORT_MISSES
    if not lead <= ids(list(members), sorted(lead)):
        return NEWCOMER_RESORT_MISSES
    return max(NEWCOMER_RESORT_MISSES, LEADER_RESORT_MISSES + 1)


#: A state adopted by a sync this long before a plan's creation (seconds) may not have been announced by then: the
#: leader reads the records, then plans (used only to word the planned-out line, never by a rule)
IN_STEP_SLACK_S = 2.0


def left_out_why(drv: RoundDriver, r: int, plan) -> str:
    """Why round ``r``'s leader left this peer out of ``plan``, as far as this peer can tell: one that reached round
    ``r``'s state by a sync (download or catch-up) about when the plan was made, or had trained no round yet, was not
    in step for it, whatever its speed (fresh user 49 read "too slow" on a resumed peer catching up round by round);
    only one in step may have been too slow. Text only: the leader's rules decide."""
    synced = getattr(drv, "_synced_to", None)
    if synced is not None and synced[0] == r and synced[1] >= plan.created_at - IN_STEP_SLACK_S:
        return (
            f"it was still catching up when the plan was made: it reached round {r}'s state by a sync "
            f"{abs(synced[1] - plan.created_at):.1f} s {'after' if synced[1] >= plan.created_at else 'before'} it; "
            "it is planned once it announces a round in step"
        )
    if not (getattr(drv, "history", None) or []):
        return (
            "it had trained no round here yet (it joined or resumed just now): a leader plans a peer once it has "
            "announced itself in step before the plan"
        )
    return (
        "the leader left it out: it missed an earlier round's exchange, or its link or device is too slow for the "
        f"{plan.window_s:.1f} s window; see the leader's log"
    )


async def wait_out(drv: RoundDriver, ctx: RoundContext, refused: bool = False) -> None:
    """A planned-out peer (joined late, too slow for the window, or other weights), or one that refuses the
    plan others may follow (``refused``): announce as syncing for the next round (its leader then waits for
    it), wait for the others to announce it, re-sync."""
    plan, r = ctx.planned(), ctx.round
    planned_in = drv.me in plan.participants() and not refused
    why = (
        f"refusing the plan of leader {plan.leader[:10]} that other peers may follow (following another would "
        "split the round; see the plan_refused line)"
        if refused
        else f"not in the plan of leader {plan.leader[:10]} ({left_out_why(drv, r, plan)})"
        if not planned_in
        else "weights differ from the plan's"
    )
    events.emit(
        log,
        logging.INFO,
        "planned_out",
        "round %d: %s; waiting for the round to end, then syncing",
        r,
        why,
        peer=drv.me,
        round=r,
        leader=plan.leader,
        reason="refused" if refused else "not_in_plan" if not planned_in else "weights_differ",
    )
    drv.state.syncing, drv.state.round = True, r + 1
    drv.activity = "refusing plans" if refused else "sitting out"  # announced just below
    drv.policy.planned_out(r, plan)  # e.g. proofs still read: a peer out for rounds must not follow an excluded leader
    await drv.membership.announce()
    # Left out by the leader: re-measure link and device while the round ends (bounded, see the port), and
    # announce the fresh figure as soon as it is known, before the next round is planned.
    reprobe = None if planned_in or refused else asyncio.ensure_future(reprobe_and_announce(drv))
    try:
        await wait_for_round(
            drv, r + 1, timeout_s=max(ROUND_END_SLACK_S, plan.exchange_deadline - drv.clock.time() + ROUND_END_SLACK_S)
        )
        if reprobe is not None and not drv.stop.is_set():
            await reprobe
    finally:
        if reprobe is not None and not reprobe.done():
            reprobe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reprobe
    await drv.resync("planned out")
    if drv.state.round <= r and drv.ended is None and not drv.stop.is_set():
        # no state to adopt: never run round r again while its plan's participants are past it (a fork)
        await resync_rules.hold_finished_round(drv, r, plan.participants())
    if drv.me in plan.participants() and drv.state.round > r and drv.state.digest != plan.start_digest:
        # The others ran a plan naming this peer without it, and the state moved (their round aggregated a token:
        # they marked it); one that applied nothing leaves the start digest and concludes nothing, for anyone.
        # After the hold too (red team 50): a state adopted on a retry of the catch-up came through round r all
        # the same, and round r counts as one whose marks on this peer it knows (planned_out)
        drv.policy.note_sat_out(plan)


async def reprobe_and_announce(drv: RoundDriver) -> None:
    """A planned-out peer's link and device re-measurement (:meth:`Membership.remeasure`), then its
    announcement. A failure is logged once at DEBUG: the peer keeps the figures it had."""
    try:
        await drv.membership.remeasure()
        await drv.membership.announce()
    except Exception as e:  # never fail the wait for the round's end over a probe
        log.debug("link or device re-measurement failed: %r", e)


async def wait_for_round(drv: RoundDriver, r: int, timeout_s: float = 30.0) -> bool:
    """Wait until another peer announces round ``r`` with a digest (backoff); True when one did."""
    deadline = drv.clock.monotonic() + timeout_s
    backoff = drv.backoff()
    while drv.clock.monotonic() < deadline and not drv.stop.is_set():
        # leaving peers count: their last record says they finished round r - 1
        recs = [x for x in await drv.membership.peers(include_leaving=True) if x.peer_id != drv.me]
        if any(x.round >= r and x.weights_digest for x in recs):
            return True
        if await drv.pause(min(backoff.next(), max(0.0, deadline - drv.clock.monotonic()) + 0.01)):
            break
    return False


def may_start_early(drv: RoundDriver, plan: RoundPlan) -> bool:
    """Whether this peer may start its inner steps on ``plan`` before the settle confirms it: it is in
    the plan, holds the plan's start weights, is not stopping, and trains inner steps (ddp's one-batch
    gradient gains nothing from it)."""
    return (
        not drv.cfg.exchanges_gradient
        and not drv.stop.is_set()
        and drv.me in plan.participants()
        and plan.start_digest == drv.state.digest
    )


async def discard_early(drv: RoundDriver, ctx: RoundContext, plan: Optional[RoundPlan]) -> None:
    """The plan followed is not the one the inner steps started on during the settle (a better-ranked
    leader's plan appeared, or none is followed): stop those steps and load the global weights back."""
    early, early_plan, abort = ctx.early, ctx.early_plan, ctx.early_abort
    if early is None or early_plan is None or abort is None:  # set together by agree's on_provisional
        raise RuntimeError(f"round {ctx.round}: no inner steps were started during the settle")
    abort.set()
    await asyncio.gather(early, return_exceptions=True)
    ctx.early = None
    await asyncio.to_thread(drv.state.reset_model)
    events.emit(
        log,
        logging.INFO,
        "early_steps_discarded",
        "round %d: the plan of leader %s started on during the settle is not the one followed (%s); "
        "its inner steps are discarded",
        ctx.round,
        early_plan.leader[:10],
        f"leader {plan.leader[:10]}'s is" if plan is not None else "none is",
        peer=drv.me,
        round=ctx.round,
        started_leader=early_plan.leader,
        followed_leader=plan.leader if plan is not None else None,
    )
