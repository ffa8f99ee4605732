"""Where this peer stands against the swarm: behind it (:func:`behind`), re-synced to its state
(:func:`resync`, :func:`catch_up`: what a re-sync to another side of a partition discards, blame noted on an
abandoned lineage), or left by it (:func:`swarm_ended`, :func:`left_alone`, :func:`check_end`,
:func:`end_run`: the run ends without its goal). Functions of the
:class:`~geomesh_p2p.round.driver.RoundDriver` (its ports: membership, state, policy)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from geomesh_p2p.plan.agree import digest_majority
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.sync.download import StateSyncError
from geomesh_p2p.telemetry import events
from geomesh_p2p.round.context import LineageEntry, Phase, SwarmEnded
from geomesh_p2p.round.eager import drop_speculative
from geomesh_p2p.round.exchange import drop_feedback
from geomesh_p2p.round.last_plan import forget_since

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: Pause after a failed catch-up before the next: long enough for a donor to come back, short for a joiner.
RESYNC_RETRY_PAUSE_S = 3.0

#: Which side of a healed partition survives (docs/round.md, "Partitions"); said in the dropped side's line.
SURVIVOR_RULE = (
    "a peer adopts the state more than half of the vote backs (standing.choose_state: each other peer "
    "weighs the rounds this peer saw it deliver among the last 32) once it is at a later round than its "
    "own, or when a plan of the other side's leader plans it out; after a partition of under 16 rounds "
    "the side at the later round survives (docs/round.md, Partitions)"
)


async def behind(drv: RoundDriver) -> bool:
    """True when the swarm's vote backs a later round than this peer's. Peers that announced leaving
    count: their last record says which round and state the swarm reached (a swarm whose peers all
    finished their last round is ahead of a peer that was stalled, not gone)."""
    everyone = await drv.membership.peers(include_leaving=True)
    drv.saw_others(everyone)
    sr = drv.policy.swarm_round(everyone)
    drv._swarm_seen = max(drv._swarm_seen, sr or 0)
    return sr is not None and sr > drv.state.round


def plan_voters(drv: RoundDriver, records: Sequence[PeerRecord], r: int) -> list[PeerRecord]:
    """``records`` of the participants of the plan of round ``r - 1`` this peer followed (the plan that made the
    state of round ``r``) and of the peers established in this peer's view (``policy.standing_established``), all of
    them when this peer followed no plan of that round.

    Why (session 30's red team, by reading): the end-of-run checks counted the digest of every record of the run,
    while the round's own check (:func:`~geomesh_p2p.round.finish.check_digest`) counts only the plan's
    participants. A few signed identities that took no part in the round (each costs one proof of work) could then
    back another digest at this peer's round and make an honest peer end "NOT synced" (a failed exit). Only the
    peers that made the state vote on it, and the peers established here (a fork's other side); peers of a later
    round are counted as before, by their round."""
    plan = drv._last_plan
    if plan is None or plan.round != r - 1:
        return list(records)
    members = set(plan.participants())
    # and the peers established in this peer's view (they delivered in the rounds it applied: no fresh identity):
    # a lineage that forked off follows plans of its own side only, which agree with it by construction, so
    # counting the plan alone hid every fork whose side was this peer's, the end-of-run check's whole point
    # (red team, session 31: test_a_fork_whose_last_plan_names_only_its_own_side_is_still_reported_at_the_end)
    # (one standing view for all of them: one per record cost O(N^2) on the event loop at hundreds of records)
    established = drv.policy.standing_established_ids(records, [x.peer_id for x in records if x.peer_id not in members])
    return [x for x in records if x.peer_id in members or x.peer_id in established]


#: Seconds of clock difference between peers tolerated when a leaving record's time is compared with this
#: process's start (swarm time is agreed within about this)
PREVIOUS_SESSION_MARGIN_S = 5.0


def leavers_of_round(drv: RoundDriver, everyone: Sequence[PeerRecord]) -> list[PeerRecord]:
    """The records of ``everyone`` of other peers that announced leaving at this peer's round with its digest, in
    this session (not before :attr:`RoundDriver.started_at`, less :data:`PREVIOUS_SESSION_MARGIN_S`): peers that
    left during this round or right before it, whom a leader may have planned into it with this peer (a leave
    announced at round r takes the peer out of the rounds after r, not out of a plan of r made before it)."""
    r, digest = drv.state.round, drv.state.digest
    since = getattr(drv, "started_at", None)
    return [
        x
        for x in everyone
        if x.leaving
        and x.peer_id != drv.me
        and x.round == r
        and digest is not None
        and x.weights_digest == digest
        and (since is None or float(x.timestamp) >= since - PREVIOUS_SESSION_MARGIN_S)
    ]


def swarm_ended(drv: RoundDriver, everyone: Sequence[PeerRecord]) -> Optional[SwarmEnded]:
    """A :class:`SwarmEnded` when ``everyone`` (the run's records, leaving peers included) holds at least
    one other peer and every other peer announced leaving; None while another peer is live.

    ``synced``: the majority digest of the others' records at this peer's round is this peer's digest
    (the swarm ended on the state this peer holds); ``swarm_round``: the latest round they announced.

    Leaving records announced before this process began (:attr:`RoundDriver.started_at`, less
    :data:`PREVIOUS_SESSION_MARGIN_S`) are a previous session's: a run restarted with ``--resume`` saw the
    others' old leaving records before their new live ones and ended at once (fresh-user trial, session 13).
    They are no sign that the swarm ended now; the wait for ``--min-peers`` goes on."""
    others = [x for x in everyone if x.peer_id != drv.me]
    if not others or any(not x.leaving for x in others):
        return None
    since = getattr(drv, "started_at", None)
    if since is not None:
        # a previous session's leaving record at or behind this peer's round says nothing of now (fresh user 50: a
        # peer resumed at the newest state counted the stop of the run before): only newer ones, or ones ahead, count
        others = [
            x for x in others if float(x.timestamp) >= since - PREVIOUS_SESSION_MARGIN_S or x.round > drv.state.round
        ]
        if not others:
            return None
    r = drv.state.round
    if getattr(drv, "_resumed_with", ()) and (r, drv.state.digest) == getattr(drv, "_start", None):
        # resumed on a checkpoint trained with others and still at it: a leaving record at or behind it of a peer this
        # session never read live is that swarm's stop, however recent (fresh user 50's restart one peer at a time:
        # the peer ended "the swarm ended" on the record its partner left seconds before this start)
        others = [x for x in others if x.round > r or x.peer_id in drv._seen_live]
        if not others:
            return None
    # an excluded peer's state never counts, nor one of an identity outside the plan that made it
    voters = plan_voters(drv, others, r) or others
    majority, _, _ = digest_majority(drv.policy.digest_voters(voters), r)
    swarm_round = max(x.round for x in voters)
    synced = majority is not None and majority == drv.state.digest and swarm_round <= r
    state = (
        f"the swarm's last state (round {r}, digest {(drv.state.digest or '')[:8]})"
        if synced
        else f"NOT the swarm's: this peer holds round {r}, digest {(drv.state.digest or '')[:8]}, the swarm "
        f"ended at round {swarm_round}" + (f" with digest {majority[:8]}" if majority else "")
    )
    why = (
        f"the swarm ended: every other peer ({len(others)}) announced leaving, the latest at round "
        f"{swarm_round}; this peer's state is {state}"
    )
    return SwarmEnded(round=r, swarm_round=swarm_round, synced=synced, why=why, cause="others_left")


def left_alone(drv: RoundDriver, everyone: Sequence[PeerRecord], waited_s: float) -> SwarmEnded:
    """The :class:`SwarmEnded` of a peer that, after its first round, found no other live peer for a
    whole ``wait_peers_s`` short of ``min_peers``. ``synced`` only when it was the whole swarm (``_whole_swarm``): no
    other peer's record was ever read since it started from the seed, or from the round the run was known at with
    only a previous session's leaving records at or behind that state (``RoundDriver.left_before``: the peers that
    left it there), one of them at that state (its round and digest: a checkpoint past every leaving record is no
    continuation of theirs that anything shows). Else never: with the others' records gone nothing
    shows where the swarm ended (it may have gone on after the last state it confirmed to this peer), so
    the run is not claimed healthy; the line says whether the swarm confirmed this peer's state (a digest
    check that agreed, or a catch-up adopted it)."""
    r = drv.state.round
    others = [x for x in everyone if x.peer_id != drv.me]
    r0, d0 = drv._start
    # Past round 0 a leaving record of the state this session started from must back the claim (red team 47b: records
    # at earlier rounds, any digest, are left_before too, and nothing ties a checkpoint of a later round to the state
    # they left: a fork trained alone before, restarted, ended synced, exit 0).
    # Read as this session began (``_start_backed``): the records expire within about 30-40 s of the others leaving,
    # before this end (after --wait-peers-s, the lone round and --wait-peers-s again) reads them (fresh user 48).
    backed = (
        r0 <= 0
        or drv._start_backed
        or any(
            drv.left_before(x) and (x.round, x.weights_digest) == (r0, d0) and x.peer_id != drv._written_by
            for x in others
        )
    )
    if drv._whole_swarm and backed and all(drv.left_before(x) for x in others):
        # No other peer ever: nobody else's digest can confirm the state, yet this peer's own rounds made the run's
        # only lineage, so "NOT the swarm's" (exit 3) was wrong (fresh user 46: a sole first peer with --min-peers
        # 3 trained round 0 after the wait, then ended so at round 1). It stops as the swarm it was, synced. So does
        # a peer that took the run up at the round it was known at, after its other peers had left (fresh user 47).
        came = (
            "no other peer of the run ever appeared"
            if r0 <= 0
            else f"no other peer of the run came back since this peer continued it from round {r0}, the round the "
            "run was at when its other peers left"
        )
        why = (
            f"{came} (waited {waited_s:.0f} s at round {r}); this peer was the whole "
            f"swarm, so its state (round {r}, digest {(drv.state.digest or '')[:8]}) is the run's; after its first "
            f"round a peer does not train on alone unless --min-peers is 1 (it is {drv.cfg.min_peers}): start it "
            "again with --resume once other peers join"
        )
        return SwarmEnded(round=r, swarm_round=r, synced=True, why=why, cause="alone")
    seen = max([drv._swarm_seen] + [x.round for x in others])
    state = (
        f"NOT the swarm's: the swarm was last seen at round {seen}"
        if seen > r
        else "NOT known to be the swarm's last: the swarm confirmed it, and where the swarm ended is unknown"
        if drv._confirmed_round >= r
        else "NOT the swarm's: the swarm never confirmed it (its last round had no agreeing digest check)"
    )
    why = (
        f"no other peer of the run is live (waited {waited_s:.0f} s for one to train with); "
        f"this peer's state (round {r}, digest {(drv.state.digest or '')[:8]}) is {state}"
    )
    return SwarmEnded(round=r, swarm_round=max(r, seen), synced=False, why=why, cause="alone")


def end_run(drv: RoundDriver, ended: SwarmEnded, **facts: Any) -> None:
    """Record that the run ends without reaching its goal because the swarm ended (one line, the ``swarm_ended``
    event; ``facts``: more event fields of the call site): INFO when this peer holds the swarm's last state (the
    others finished or left: a normal end, which a fresh user read as a fault at WARNING, session 35), WARNING
    when it does not."""
    drv.ended = ended
    target = drv.cfg.target_ppl
    goal = [f"--rounds {drv.cfg.rounds}"] if drv.cfg.rounds is not None else []
    goal += [f"--target-ppl {target:g}"] if target is not None else []
    events.emit(
        log,
        logging.INFO if ended.synced else logging.WARNING,
        "swarm_ended",
        "round %d: %s; %s",
        ended.round,
        ended.why,
        f"ending without reaching {' or '.join(goal)}" if goal else "ending (no --rounds or --target-ppl was set)",
        peer=drv.me,
        round=ended.round,
        swarm_round=ended.swarm_round,
        synced=ended.synced,
        cause=ended.cause,
        **facts,
    )


async def check_end(drv: RoundDriver) -> None:
    """After the last round: when the other peers' records at this peer's round back another digest
    (this peer trained its last rounds on a state the swarm never had), the run did not end healthy:
    :attr:`ended` says so (synced False) and one WARNING line. Others at a later round are no failure
    (peers with a larger ``--rounds`` go on). One DHT read."""
    everyone = await drv.membership.peers(include_leaving=True)
    others = [x for x in everyone if x.peer_id != drv.me]
    r = drv.state.round
    majority, agree, total = digest_majority(drv.policy.digest_voters(plan_voters(drv, others, r)), r)
    if majority is not None and majority != drv.state.digest:
        later = max((x.round for x in others), default=r)
        end_run(
            drv,
            SwarmEnded(
                round=r,
                swarm_round=max(later, r),
                synced=False,
                why=(
                    f"this peer's last state (round {r}, digest {(drv.state.digest or '')[:8]}) is NOT the swarm's: "
                    f"{agree} of {total} other peer(s) hold digest {majority[:8]}"
                ),
                cause="digest_differs",
            ),
            others=total,
            majority_digest=majority,
        )


#: How long a peer holding a round that ran without it retries its catch-up once every participant seen past that
#: round announced leaving (they serve their last state while they linger: ``node.report.FINAL_STATE_LINGER_S``):
#: ``--hold-leaving-s`` (the driver's ``cfg.hold_leaving_s``), this by default
HOLD_LEAVING_S = 40.0


async def hold_finished_round(drv: RoundDriver, r: int, participants: Sequence[str]) -> None:
    """Round ``r`` ran on a plan of ``participants`` without this peer (planned out, or refusing it), and the
    catch-up after it found no state to adopt, so this peer is back at round ``r``. Running round ``r`` again
    with the peers left would fork the run: session 27, 9 peers with ``--rounds 3``, the three planned out of round 2
    found no donor after the six others finished it and left together, ran a round 2 of their own and ended "done"
    on another digest. So once a participant of that plan announced a later round (its signed record, leaving
    ones included), round ``r`` is taken: this peer announces that it syncs to round ``r + 1`` (finished peers wait
    for it: ``node.report.serve_final_state``) and retries the catch-up :data:`RESYNC_RETRY_PAUSE_S` apart until it
    adopts a later state. While a participant past ``r`` is live it retries as long as it takes; once all of them
    announced leaving, for ``cfg.hold_leaving_s`` more (:data:`HOLD_LEAVING_S` by default), then it ends the run not synced (:func:`end_run`, cause
    ``"finished_without"``: exit 3, never "done"). When no participant is past round ``r`` (the round failed and is
    planned again) it returns at once: the round is open."""
    members = set(participants) - {drv.me}
    past_seen: dict[str, int] = {}  # participant -> the later round it announced (kept after its record expires)
    all_leaving_since: Optional[float] = None
    while not drv.stop.is_set() and drv.ended is None and drv.state.round <= r:
        recs = await drv.membership.peers(include_leaving=True)
        past = [x for x in recs if x.peer_id in members and x.round > r and x.weights_digest]
        past_seen.update((x.peer_id, x.round) for x in past)
        if not past_seen:
            return
        now = drv.clock.monotonic()
        if any(not x.leaving for x in past):
            all_leaving_since = None
        elif all_leaving_since is None:
            all_leaving_since = now
        elif now - all_leaving_since >= drv.cfg.hold_leaving_s:
            swarm_round = max(past_seen.values())
            why = (
                f"the plan of round {r} ran without this peer; its {len(past_seen)} participant(s) seen past it "
                f"(to round {swarm_round}) all left or are gone, and no donor gave this peer their state: it holds "
                f"round {r}, digest {(drv.state.digest or '')[:8]}, NOT the swarm's (running round {r} again with "
                "the peers left would fork the run)"
            )
            end_run(drv, SwarmEnded(r, swarm_round, False, why, "finished_without"), participants=len(members))
            return
        # announced as syncing to round r + 1 (the catch-up's failure announced round r with its digest): a peer
        # that finished round r serves it its state before it exits
        drv.state.syncing, drv.state.round = True, r + 1
        try:
            await drv.membership.announce()
            stopped = await drv.pause(RESYNC_RETRY_PAUSE_S)
        finally:
            drv.state.syncing, drv.state.round = False, r
        if stopped:
            return
        await drv.resync(f"round {r} ran without this peer")


async def resync(drv: RoundDriver, why: str, target: Optional[tuple[int, str]] = None) -> None:
    """Download the swarm's state (``target``: that (round, digest) and no other, :func:`catch_up`); a failure is
    one warning and a pause (the donors may come back), or, when every other peer announced leaving, the end of the
    run (:attr:`ended`, one WARNING)."""
    drv.phase = Phase.RESYNC
    await drop_speculative(drv, "re-sync")  # no eager start after a re-sync: the peer starts from θ
    try:
        await drv._catch_up(target)
    except StateSyncError as e:
        # Every donor gone for good (all of them announced leaving): retrying would never end.
        ended = swarm_ended(drv, await drv.membership.peers(include_leaving=True))
        if ended is not None:
            end_run(drv, ended)
            return
        log.warning("catching up failed (%s; %s); retrying in a few seconds", e, why)
        await drv.pause(RESYNC_RETRY_PAUSE_S)


async def catch_up(drv: RoundDriver, target: Optional[tuple[int, str]] = None) -> None:
    """``state.catch_up()`` (``state.catch_up(target)``: the state of that (round, digest) only, a re-sync to a
    state the rules chose); when the state adopted is not of this peer's lineage (its side of a partition lost the
    vote), one WARNING line says what is discarded (:func:`log_dropped`). Raises what ``catch_up`` raises
    (StateSyncError)."""
    before = (drv.state.round, drv.state.digest)
    # The sides as announced before the download (a peer that trained with this one: its lineage);
    # read only when there is a lineage to lose (a joiner's catch-up costs no extra DHT read).
    recs = await drv.membership.peers(include_leaving=True) if drv.lineage else []
    kept = len(drv.lineage)
    mine = {e.digest for e in drv.lineage}
    await (drv.state.catch_up() if target is None else drv.state.catch_up(target))
    if drv.lineage and drv.state.digest != before[1]:
        drv._log_dropped(before, recs)
    if len(drv.lineage) < kept:  # rounds of this peer's lineage were discarded
        await drop_feedback(drv)
    if drv.state.digest != before[1] and drv.state.digest not in mine:
        forget_blame(drv)
    if drv.state.digest != before[1] and not drv.state.syncing:
        drv._confirmed_round = drv.state.round  # adopted the swarm's state: its start is confirmed
        # when it came (swarm time), for the planned-out line's reason only (planning.left_out_why); a driver double
        # without a clock words no reason from it
        clock = getattr(drv, "clock", None)
        drv._synced_to = (drv.state.round, clock.time()) if clock is not None else None
        forget_since(drv, drv.state.round)  # the plans it obtained may not have made that state


def forget_blame(drv: RoundDriver) -> None:
    """After a re-sync to a state this peer did not make: penalties it noted in rounds the swarm never
    confirmed to it (from :attr:`_confirmed_round` on) came from the lineage it abandoned (e.g. every part
    failed while it was stalled) and are dropped (``policy.forget_marks_since``; one INFO line)."""
    dropped = drv.policy.forget_marks_since(drv._confirmed_round)
    if dropped:
        log.info(
            "re-synced to the swarm's state: %d penalty mark(s) this peer noted since round %d (a lineage "
            "the swarm did not confirm) dropped: %s",
            len(dropped),
            drv._confirmed_round,
            ", ".join(p[:10] for p in dropped),
        )


def log_dropped(drv: RoundDriver, before: tuple, recs: Sequence[PeerRecord]) -> None:
    """After a re-sync from ``before`` (round, digest) to the state now held: when that state is not of
    this peer's lineage, log one WARNING with the rounds trained since the fork, the peers of this
    side, the tokens discarded and :data:`SURVIVOR_RULE`, and forget those rounds.

    The fork is found from the records read before the download: peers announcing a digest that is
    not in this peer's lineage are the other side; the rounds discarded are the newest rounds of the
    lineage that none of them took part in (a round with a peer of the other side was before the
    split)."""
    mine = {e.digest for e in drv.lineage} | {before[1]}
    if drv.state.digest in mine:
        return  # a state this peer made itself: nothing of its lineage is lost
    others = {r.peer_id for r in recs if r.peer_id != drv.me and r.weights_digest and r.weights_digest not in mine}
    dropped: list[LineageEntry] = []
    for e in reversed(drv.lineage):
        if e.participants & others:
            break
        dropped.append(e)
    if not others or not dropped:
        return  # no round of this peer's is known to be discarded (nobody of another side in view)
    dropped.reverse()
    side = sorted(set().union(*(e.participants for e in dropped)))
    tokens, own = sum(e.tokens for e in dropped), sum(e.own_tokens for e in dropped)
    span = f"round {dropped[0].round}" if len(dropped) == 1 else f"rounds {dropped[0].round}-{dropped[-1].round}"
    events.emit(
        log,
        logging.WARNING,
        "partition_lost",
        "re-synced to the state of round %d (digest %s), not of this peer's lineage: its side of a "
        "partition lost; discarded %d round(s) trained since the fork (%s) by %d peer(s) of this side "
        "(%s), %d tokens (%d of them this peer's). Rule: %s",
        drv.state.round,
        (drv.state.digest or "")[:8],
        len(dropped),
        span,
        len(side),
        ", ".join(p[:10] for p in side),
        tokens,
        own,
        SURVIVOR_RULE,
        peer=drv.me,
        round=drv.state.round,
        digest=drv.state.digest,
        discarded_rounds=[e.round for e in dropped],
        side=side,
        tokens=tokens,
        own_tokens=own,
    )
    for _ in dropped:
        drv.lineage.pop()
