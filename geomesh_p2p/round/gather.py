"""Phase GATHER: the peers in sync for the round (announced it with this peer's digest), and how long the
gather waits for the missing ones: last round's contributors still finishing it (until that round's exchange
deadline), syncing peers (by their announced download progress, issue 14 #3), ``min_peers``. Functions of
the :class:`~geomesh_p2p.round.driver.RoundDriver` (its ports: membership, policy, state, clock)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.probation import PROBATION_NOSHOW_PENALTY_ROUNDS, PROBATION_SYNC_WAIT_S
from geomesh_p2p.round.context import Phase
from geomesh_p2p.round.resync import end_run, leavers_of_round, left_alone, swarm_ended
from geomesh_p2p.round.tie import TIE_LOSER_WAITS, Tie, resumed_tie, tie_lost

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: A syncing peer's wait (issue 14 #3) is its announced remaining download time x ``SYNC_WAIT_SLACK`` plus
#: ``SYNC_WAIT_MARGIN_S``: its record is up to one announcement old, the rate varies, and after the last
#: byte it still checks the digest and loads the state.
SYNC_WAIT_SLACK = 1.25
SYNC_WAIT_MARGIN_S = 2.0
#: After its last byte a syncing peer applies what it fetched (an outer update: the outer step and the
#: commit's digest; a state: its digest) and copies it into its model: the margin above grows by this many
#: times the seconds this peer's own last outer step and commit took (``phase_s`` of its last row), the same
#: work on the same model. 2 s alone was short at real size (issue 29 #7: gpt2-124m, ~5 s per update).
SYNC_APPLY_FACTOR = 2.0
#: Start-up rejoins (:func:`rejoin`) a session tries: peers resumed at different rounds need one; a standing
#: majority announcing a new made-up digest every read kept a peer re-syncing from it, its --min-peers wait
#: restarted each time (red team 37b). Past it the gather waits as before 0.12.
MAX_REJOINS = 2
#: A planned-out peer waits for the next round until the plan's exchange deadline plus this (at least this).
#: The gather waits as long for a contributor of the last round still finishing it (its outer step, commit
#: and announcement come after its last pull, which ends by the exchange deadline at the latest).
ROUND_END_SLACK_S = 5.0
#: Gathers a peer on probation may hold past ``PROBATION_SYNC_WAIT_S`` by announcing a download and then
#: not arrive in sync: an identity announcing a slow download forever costs the swarm at most this many
#: capped waits (and each identity costs its proof of work).
PROBATION_SYNC_GRANTS = 2
#: ... per this many rounds: misses older than this are forgiven (issue 29 #7: an honest joiner whose two
#: waits fell short was capped at 1.5 s for good and never trained). A Sybil announcing slow downloads
#: forever thus costs the swarm at most ``PROBATION_SYNC_GRANTS`` capped waits per this many rounds.
PROBATION_SYNC_RETRY_ROUNDS = PROBATION_NOSHOW_PENALTY_ROUNDS


@dataclass
class SyncWaits:
    """One gather's bookkeeping of syncing peers (:func:`sync_deadline`); monotonic seconds."""

    t0: float
    until: dict[str, float] = field(default_factory=dict)  # peer -> end of its progress-derived wait
    seen: dict[str, int] = field(default_factory=dict)  # peer -> done_bytes that wait was derived from
    extended: set[str] = field(default_factory=set)  # peers waited for past the plain wait by their progress
    established: set[str] = field(default_factory=set)  # standing asked once per gather
    probation: set[str] = field(default_factory=set)
    logged: set[str] = field(default_factory=set)
    capped: set[str] = field(default_factory=set)  # on probation with no grant left (its line said once)


async def gather(drv: RoundDriver, expected: set[str], *, first: bool) -> Optional[list[PeerRecord]]:
    """Phase GATHER: the peers in sync for this round (announced it with this digest). Waits for
    ``expected`` (last round's contributors, less those leaving) up to ``gather_wait_s``
    (``wait_peers_s`` and ``min_peers`` before the first round); one of them whose record still shows
    the last round is finishing its exchange and is waited for until that round's exchange deadline plus
    ``ROUND_END_SLACK_S`` (:func:`finishing_waits`); and for each peer announced as
    syncing for this round as long as :func:`sync_deadline` says (its announced download progress,
    within ``sync_wait_cap_s``). None at once when the swarm holds a later round (leaving peers' records
    count: they show where the swarm is). Short of ``min_peers`` (after the first round ``min(min_peers,
    2)``: never alone): one INFO line "waiting for N peers, M live" (not one per read), a wait of up to
    ``wait_peers_s``; None with :attr:`ended` set
    (one WARNING) when every other peer's record says it left, on two reads in a row (a live peer's
    record may be a moment old) -- this peer never trains alone on a swarm that ended."""
    drv.phase = Phase.GATHER
    # After the first round only "not alone" holds: waiting for all N every round would stall a swarm
    # that lost one peer by wait_peers_s per round; the fork risk is a peer training by itself.
    min_peers = drv.cfg.min_peers if first else min(drv.cfg.min_peers, 2)
    t0 = drv.clock.monotonic()
    finish_end = finishing_end(drv, t0)
    finish_logged: set[str] = set()
    backoff = drv.backoff()
    last_ids: Optional[frozenset] = None
    waits = SyncWaits(t0)
    synced: list[PeerRecord] = []
    left_reads = 0  # consecutive reads on which every other peer's record says it left
    try:
        while True:
            everyone = await drv.membership.peers(include_leaving=True)
            now = drv.clock.monotonic()
            # A peer that said it is leaving is not waited for (it finished its last exchange).
            expected = expected - {r.peer_id for r in everyone if r.leaving}
            recs = [r for r in everyone if not r.leaving]
            drv._seen_live.update(r.peer_id for r in recs if r.peer_id != drv.me)  # resync.swarm_ended
            drv._gathered = {r.peer_id: r for r in recs}  # the live view PLAN starts from (no re-read)
            drv._gathered_leaving = {r.peer_id: r for r in everyone if r.leaving}
            drv.remember(everyone)
            # Leaving peers' records are evidence of the swarm's progress (their round and digest): a
            # stalled peer whose swarm finished while it was stopped must catch up, not train alone.
            sr = drv.policy.swarm_round(everyone)
            drv._swarm_seen = max(drv._swarm_seen, sr or 0)
            if sr is not None and sr > drv.state.round:
                return None
            synced = [r for r in recs if r.round == drv.state.round and r.weights_digest == drv.state.digest]
            ids = {r.peer_id for r in synced}
            if drv._in_step_seen[0] != (drv.state.round, drv.state.digest):
                drv._in_step_seen = ((drv.state.round, drv.state.digest), set())
            drv._in_step_seen[1].update(ids - {drv.me})  # seen live in step at this round (planned_with_leavers)
            short = len(ids) < min_peers
            if ids <= {drv.me}:
                # Nobody else in step: before this peer ends the run ("the swarm ended") or plans a round alone,
                # the others that announced leaving during this round may have been planned with it already.
                joined = await planned_with_leavers(drv, everyone)
                if joined:
                    return synced + joined
            ended = swarm_ended(drv, everyone) if short and not drv.stop.is_set() else None
            # A record of a peer still live may be a moment old (it re-announces at its loop top): the end
            # is confirmed by the next read, one backoff pause later. Not a longer wait: the leaving
            # records expire a few announce periods after their peers exit, and without them this peer
            # could only say it was left alone (not synced).
            left_reads = 0 if ended is None else left_reads + 1
            if ended is not None and left_reads >= 2:
                end_run(drv, ended)
                return None
            if first and short and not drv.stop.is_set() and await rejoin(drv, everyone):
                return None  # re-synced (or tried to): the next pass gathers at the state this peer holds now
            wait_s = drv.cfg.wait_peers_s if first or short else drv.cfg.gather_wait_s
            syncing = [
                r
                for r in recs
                if r.round == drv.state.round
                and r.weights_digest is None
                and r.peer_id not in ids
                and r.peer_id != drv.me
            ]
            note_standing(drv, syncing, recs, waits)
            ends = {r.peer_id: sync_deadline(drv, r, recs, waits, now, wait_s) for r in syncing}
            if not short:
                ends.update(finishing_waits(drv, expected - ids, recs, finish_end, now, finish_logged))
            waited = {p for p, end in ends.items() if end > now}
            if (expected | waited) <= ids and len(ids) >= min_peers:
                return synced
            alone = not first and not any(x.peer_id != drv.me for x in recs)
            fields: dict[str, Any] = dict(
                peer=drv.me, round=drv.state.round, min_peers=min_peers, in_step=len(ids), live=len(recs), wait_s=wait_s
            )
            if ended is not None:
                pass  # no wait line: the others' leaving records say the swarm ended, the next read confirms it (fresh
                # user 48 read "waiting up to 60 s" and "the swarm ended ... exit 0" in the same second)
            elif alone and drv._waiting_logged != (min_peers, len(recs), first):
                # After its first round nobody else is live: the wait is for ONE other peer, and the run ends after
                # it (a fresh user 47 saw 180 s of silence: the line of the first round's wait had been said).
                drv._waiting_logged = (min_peers, len(recs), first)
                events.emit(
                    log,
                    logging.INFO,
                    "waiting_for_peers",
                    "round %d: no other peer of the run is live; after its first round a peer trains only with "
                    "another (--min-peers %d; --min-peers 1 would train on alone): waiting up to %.0f s "
                    "(--wait-peers-s) for one, then this peer ends (docs/round.md, Never alone after the first round)",
                    drv.state.round,
                    drv.cfg.min_peers,
                    wait_s,
                    alone=True,
                    **fields,
                )
            elif len(ids) < min_peers and drv._waiting_logged != (min_peers, len(recs), first):
                drv._waiting_logged = (min_peers, len(recs), first)
                events.emit(
                    log,
                    logging.INFO,
                    "waiting_for_peers",
                    # "live" alone read as a contradiction ("waiting for 2 peers, 2 live": one of them was syncing or
                    # at another round; a fresh-user trial, session 34): say how many are in step; "in all (this one
                    # included)": "waiting for 2 peers" read as two others when only one other existed (session 42)
                    "round %d: waiting for %d peers in all (this one included); %d in step at this round, %d live (up to %.0f s)",
                    drv.state.round,
                    min_peers,
                    len(ids),
                    len(recs),
                    wait_s,
                    **fields,
                )
            until = max([t0 + wait_s] + [ends[p] for p in waited])
            held = now > until and held_for_swarm(drv, ids, first=first, short=short)
            tie = resumed_tie(drv, recs, now) if held else None
            if tie is not None and not tie.won and not drv.stop.is_set() and await rejoin(drv, everyone, tie):
                if drv.ended is not None or (drv.state.round, drv.state.digest) != tie.mine:
                    return None  # re-synced to the tie's winner: the next pass gathers at the state held now
                # the winner did not serve it (a failed download said why): the loser's bounded wait goes on
            if tie is not None and not tie.won and now - tie.since >= TIE_LOSER_WAITS * drv.cfg.wait_peers_s:
                tie_lost(drv, tie, now - tie.since)  # lost the tie, neither re-synced nor caught up: ends (exit 3)
                return None
            if tie is not None and tie.won:
                # peers it trained with are live on a losing state: they re-sync to this one, waited for a bounded
                # time (a re-sync announced with its progress is waited for by it, as any syncing peer's), then the
                # timer's fallback: it trains, and they catch up to its later state (round/tie.py)
                held = now - tie.since < drv.cfg.wait_peers_s
            elif held and tie is None:
                say_held(drv, recs, now - t0)
            if (short or held) and not drv.stop.is_set():
                drv.note_activity("waiting")  # for peers: --min-peers, or its checkpoint's (fresh user 52)
            if not held and (now > until or drv.stop.is_set()):
                if short and not first and not drv.stop.is_set() and not any(x.peer_id != drv.me for x in recs):
                    # After the first round nobody else is live at all: the swarm is gone (its records
                    # may have vanished with its peers). Training on alone would fork the run.
                    end_run(drv, left_alone(drv, everyone, now - t0), waited_s=now - t0, min_peers=min_peers)
                    return None
                if len(ids) < min_peers and not drv.stop.is_set():  # says so (issue 14 #10)
                    log.info(
                        "round %d: starting with %d of the %d peers wanted (--min-peers): waited %.0f s",
                        drv.state.round,
                        len(ids),
                        min_peers,
                        now - t0,
                    )
                return synced
            now_ids = frozenset(r.peer_id for r in recs)
            if now_ids != last_ids:
                last_ids = now_ids
                backoff.reset()
            pause = backoff.next() if held else min(backoff.next(), max(0.0, until - drv.clock.monotonic()) + 0.01)
            if await drv.pause(pause):
                return synced
    finally:
        note_sync_outcomes(drv, waits, {r.peer_id for r in synced})


def held_for_swarm(drv: RoundDriver, ids: set[str], *, first: bool, short: bool) -> bool:
    """True while a peer resumed from a checkpoint that others trained with it (``RoundDriver.run``'s ``resumed_with``) is
    still alone in step at that state, in its start-up gather short of ``--min-peers`` (2 or more): it goes on
    waiting for them past ``--wait-peers-s`` instead of training alone. Fresh user 50: p1 restarted first on a
    3-peer checkpoint trained round 86 alone after 60 s, a fork that ended exit 3 and made p2, restarted 2 min
    later, end at once ("the swarm ended", exit 3). A fresh swarm (round 0) and a checkpoint this peer trained
    alone keep the timer's fallback (docs/round.md); ``--min-peers 1`` trains on alone."""
    return (
        first
        and short
        and drv.cfg.min_peers >= 2
        and bool(drv._resumed_with)
        and (drv.state.round, drv.state.digest) in (drv._start, drv._rejoined_from_start)
        and ids <= {drv.me}
        and not drv.stop.is_set()
    )


#: seconds between the lines of a resumed peer waiting for the peers of its checkpoint (:func:`say_held`)
HELD_LOG_S = 30.0


def say_held(drv: RoundDriver, recs: list[PeerRecord], waited_s: float) -> None:
    """One INFO line every :data:`HELD_LOG_S` of the wait :func:`held_for_swarm` holds: which peers it waits for
    (the checkpoint's, short PeerIDs), which others are live, and how to go on."""
    now = drv.clock.monotonic()
    if drv._held_logged is not None and now - drv._held_logged < HELD_LOG_S:
        return
    drv._held_logged = now
    mine = list(drv._resumed_with)
    live = sorted(r.peer_id[:8] for r in recs if r.peer_id != drv.me)
    # only a peer that is not running is asked to be restarted (red team 50b: the line asked to restart a live peer);
    # a live one here is not in step yet (syncing past its wait: round/tie.py settles one live on another state)
    gone = [p[:8] for p in mine if p[:8] not in live]
    restart = (
        "Restart them with the same flags plus --resume"
        if len(gone) == len(mine)
        else f"Restart {', '.join(gone)} with the same flags plus --resume (the others are live, not in step yet)"
        if gone
        else "They are live, not in step yet: no restart needed"
    )
    events.emit(
        log,
        logging.INFO,
        "waiting_for_resumed",
        "round %d: resumed on a checkpoint trained with %d other peer(s) (%s); still waiting for them after %.0f s "
        "(--min-peers %d): a resumed peer does not train alone. Live now: %s. %s; to train on alone instead (a fork "
        "of the run), restart this peer with --min-peers 1",
        drv.state.round,
        len(mine),
        ", ".join(p[:8] for p in mine),
        waited_s,
        drv.cfg.min_peers,
        ", ".join(live) or "none",
        restart,
        peer=drv.me,
        round=drv.state.round,
        waiting_for=mine,
        live=len(recs),
        waited_s=waited_s,
    )


async def planned_with_leavers(drv: RoundDriver, everyone: list[PeerRecord]) -> list[PeerRecord]:
    """The leaving records (of ``everyone``, the gather's read) of peers that announced leaving *during* this peer's
    round -- at its round, with its digest, in this session -- when a signed plan of the round names this peer and
    one of them (``plans.names``: polled up to ``plan_timeout_s``, one read while this peer stops too); ``[]``
    otherwise, and after the first ask at a round and state (a gather's later reads do not ask again).

    Why (CI, session 38: ``test_stop_two_of_three``, ~1 in 8 at load): a leave announced at round r says "plan the
    rounds after r without me", not "round r is off". A leader that read this peer's record in sync planned round r
    with it; the others trained and stopped, announcing leaving at once (``RoundDriver._say_leaving_on_stop``). A
    peer still in the round's gather then saw every other peer leaving and ended the run ("the swarm ended"), or,
    alone in step with ``--min-peers 1``, planned the round by itself: the parts it owned in the others' plan went
    without an update and their round without its work. Returned as members, they send the round to the plan
    agreement, which reads the leavers' plans (``planning.known_view``) and follows the one naming this peer."""
    r, digest = drv.state.round, drv.state.digest
    # Only leavers this peer knows took part with it: in the last plan it applied or obtained (a catch-up by download
    # may stand between that round and this one) or read live in step at this round. Anyone can announce a leaving
    # record and sign a plan: a record re-announced each round made a lone peer wait a plan timeout every round, and
    # with a signed plan naming both, which the checks refuse, sit the round out to its end (red team 38, stop)
    known = {p for plan in (drv._last_plan, drv._plan_seen) if plan is not None for p in plan.participants()}
    if drv._in_step_seen[0] == (r, digest):
        known |= drv._in_step_seen[1]
    leavers = [x for x in leavers_of_round(drv, everyone) if x.peer_id in known]
    names = getattr(drv.plans, "names", None)
    if not leavers or names is None or drv._leavers_plan_read == (r, digest):
        return []
    drv._leavers_plan_read = (r, digest)
    # a stopping peer asks once (no wait on every Ctrl+C, as RoundDriver._planned_after_stop); otherwise a leader
    # stopped during its plan agreement may still publish the plan within a plan timeout
    wait_s = 0.0 if drv.stop.is_set() else drv.cfg.plan_timeout_s
    if not await names(r, drv.me, wait_s, among=[x.peer_id for x in leavers]):
        return []
    events.emit(
        log,
        logging.INFO,
        "planned_with_leavers",
        "round %d: %d peer(s) announced leaving during this round, but a plan of it names this peer: following it",
        r,
        len(leavers),
        peer=drv.me,
        round=r,
        leavers=sorted(x.peer_id for x in leavers),
    )
    return leavers


async def rejoin(drv: RoundDriver, everyone: list[PeerRecord], tie: Optional[Tie] = None) -> bool:
    """A start-up gather short of ``min_peers``: when the live others' vote backs a state at this peer's round or
    an earlier one that more of them hold than hold this peer's (``policy.rejoin_state``: the rule a healed
    partition follows, docs/round.md "Peers resumed at different rounds"), re-sync to it now (one INFO line, then
    the catch-up's own WARNING says what is discarded) instead of waiting the whole ``wait_peers_s`` and forking
    (a fresh-user trial, session 37: a whole swarm stopped at once resumed at rounds 46, 46 and 47; each side
    waited 60 s for the other). True when it re-synced or tried to; each state is tried once per session, and
    :data:`MAX_REJOINS` states at most. The download is of that state and no other (``RoundDriver.resync``'s
    target: a vote read again may back another, red team 51b).

    ``tie``: a :class:`~geomesh_p2p.round.tie.Tie` this peer lost: the state is its winner, which every peer of the
    tie computes alike, whatever the policy's vote backs (red team 51b: the losers of a 1-1-1 tie, whose vote
    backed no state, never re-synced and ended exit 3 while the winner trained on alone)."""
    # a resumed peer on its checkpoint's state: only the checkpoint's partners settle a vote with no majority, as they
    # alone settle the driver's tie (red team 52a: a rogue with standing not of the checkpoint, on a made-up later
    # round or larger digest, made two partners' 1-1 tie a 1-1-1 tie it won, before round/tie.py was asked)
    on_start = bool(drv._resumed_with) and (drv.state.round, drv.state.digest) in (drv._start, drv._rejoined_from_start)
    among = drv._resumed_with if on_start else None
    target = drv.policy.rejoin_state(everyone, among=among) if tie is None else tie.winner
    if target is None or target in drv._rejoin_tried or len(drv._rejoin_tried) >= MAX_REJOINS:
        return False
    drv._rejoin_tried.add(target)
    before, confirmed = (drv.state.round, drv.state.digest), drv._confirmed_round
    events.emit(
        log,
        logging.INFO,
        "rejoin_resync",
        "round %d: %s the state of round %d (digest %s)%s (digest %s): re-syncing to it now instead of waiting for "
        "--min-peers",
        drv.state.round,
        "the live peers' vote backs" if tie is None else "the tie with the peers it trained with goes to",
        target[0],
        target[1][:8],
        ", held by more of them than hold this peer's" if tie is None else ", not to this peer's",
        (drv.state.digest or "")[:8],
        peer=drv.me,
        round=target[0],
        digest=target[1],
        held_round=drv.state.round,
        held_digest=drv.state.digest,
    )
    # the rounds this peer held past that state were never confirmed by the live swarm: penalties and standing
    # credits noted in them go with them (resync.forget_blame)
    drv._confirmed_round = min(confirmed, target[0])
    await drv.resync(f"the live swarm holds the state of round {target[0]}", target)
    if (drv.state.round, drv.state.digest) == before:
        drv._confirmed_round = confirmed  # kept its state: nothing of it was discarded
    elif before == drv._start and drv._resumed_with:
        # resumed and held for its checkpoint's peers: re-synced to the state of those live (a tie lost: round/tie.py),
        # it still waits for them there; without this, the winner gone, it trained alone after --wait-peers-s (red team
        # 51b)
        drv._rejoined_from_start = (drv.state.round, drv.state.digest)
    return True


def finishing_end(drv: RoundDriver, t0: float) -> Optional[float]:
    """Until when (monotonic seconds) the gather that starts at ``t0`` waits for contributors of the last
    round still finishing it: that round's exchange deadline plus ``ROUND_END_SLACK_S`` (None when this
    peer did not apply the round before this one). A peer of a uniform-H method on a slow link finishes
    its pulls later than the others, up to the deadline; leaving it out made it download the state."""
    plan = drv._last_plan
    if plan is None or plan.round != drv.state.round - 1:
        return None
    return t0 + float(plan.exchange_deadline) - drv.clock.time() + ROUND_END_SLACK_S  # past: no wait


def finishing_waits(
    drv, missing: set[str], recs: list[PeerRecord], end: Optional[float], now: float, logged: set[str]
) -> dict[str, float]:
    """Peer -> until when (monotonic seconds) to wait for it, for each of ``missing`` (last round's
    contributors not yet in sync) whose live record still shows the last round at its start digest: it
    is finishing that round's exchange (or its outer step). ``end``: :func:`finishing_end`. A peer that
    died is not waited for past ``end``, and not at all once its record expired. One INFO line per peer
    (``waiting_for_late_peer``) when the wait goes past the plain gather wait."""
    plan = drv._last_plan
    if end is None or plan is None or not missing:
        return {}
    out = {
        r.peer_id: end
        for r in recs
        if r.peer_id in missing
        and r.round == plan.round
        and r.weights_digest is not None
        and r.weights_digest == (plan.start_digest or r.weights_digest)
    }
    for pid in sorted(set(out) - logged):
        if end > now:
            logged.add(pid)
            events.emit(
                log,
                logging.INFO,
                "waiting_for_late_peer",
                "round %d: waiting up to %.1f s more for %s, still finishing round %d (its exchange ends by "
                "the deadline)",
                drv.state.round,
                end - now,
                pid[:10],
                plan.round,
                peer=drv.me,
                round=drv.state.round,
                finishing_peer=pid,
                wait_s=end - now,
            )
    return out


def note_standing(drv: RoundDriver, syncing: list[PeerRecord], recs: list[PeerRecord], waits: SyncWaits) -> None:
    """Ask the standing of the ``syncing`` peers this gather has not asked about yet, from one view of ``recs``
    (:meth:`~geomesh_p2p.round.ports.RoundPolicy.standing_established_ids`): :func:`sync_deadline` asked once per
    peer, a view each, and a burst of identities announcing downloads cost O(N^2) on the event loop."""
    new = [r.peer_id for r in syncing if r.peer_id not in waits.established and r.peer_id not in waits.probation]
    if not new:
        return
    established = drv.policy.standing_established_ids(recs, new)
    for pid in new:
        (waits.established if pid in established else waits.probation).add(pid)


def sync_deadline(drv, rec: PeerRecord, recs: list[PeerRecord], waits: SyncWaits, now: float, wait_s: float) -> float:
    """Until when (monotonic seconds) this gather waits for syncing peer ``rec`` (issue 14 #3).

    Without a usable announced download progress: ``wait_s`` from the gather's start for an established
    peer, ``PROBATION_SYNC_WAIT_S`` for one on probation, as before. With one (a record with
    ``sync_progress``), ``wait_s`` at least (``PROBATION_SYNC_WAIT_S`` on probation), and each time its
    ``done_bytes`` moves (or is first seen: a peer that will fetch once the round ends announces 0 bytes
    and its rate), until now + its announced remaining time x ``SYNC_WAIT_SLACK`` + ``SYNC_WAIT_MARGIN_S``
    + :func:`apply_allowance_s`; never past ``sync_wait_cap_s`` from the gather's start. A download that
    stops moving is not waited for past the wait derived from its last progress. A peer on probation gets
    a progress-derived wait only while :func:`grants_left` (fewer than ``PROBATION_SYNC_GRANTS`` such waits
    it did not arrive from within ``PROBATION_SYNC_RETRY_ROUNDS`` rounds).

    Standing is asked at first sight, so the one INFO line (``waiting_for_syncing_peer``) states the wait
    really applied, probation cap included; a peer on probation with no grant left gets one INFO line
    (``sync_wait_capped``) saying it is not waited for past ``PROBATION_SYNC_WAIT_S``, and until when it
    is not (issue 29 #7: the line said "waiting up to 25 s" while the cap ended the gather at 1.5 s)."""
    pid, t0 = rec.peer_id, waits.t0
    if pid in waits.established:
        established = True
    elif pid in waits.probation:
        established = False
    else:  # a direct call: gather asked every syncing peer of its read at once (note_standing)
        established = bool(drv.policy.standing_established(recs, pid))
        (waits.established if established else waits.probation).add(pid)
    plain = t0 + (wait_s if established else PROBATION_SYNC_WAIT_S)
    sp = rec.sync_progress
    if sp is None:
        return plain
    if not established and not grants_left(drv, pid):
        if pid not in waits.capped:
            waits.capped.add(pid)
            misses, last = drv._sync_misses[pid]
            events.emit(
                log,
                logging.INFO,
                "sync_wait_capped",
                "round %d: not waiting for %s past %.1f s: syncing (%d of %d MiB at %.1f MiB/s), but on probation "
                "and it did not arrive after %d wait(s) by its progress (the last in round %d); waited for by its "
                "progress again from round %d",
                drv.state.round,
                pid[:10],
                PROBATION_SYNC_WAIT_S,
                sp.done_bytes >> 20,
                sp.total_bytes >> 20,
                sp.bytes_per_s / 2**20,
                misses,
                last,
                last + PROBATION_SYNC_RETRY_ROUNDS,
                peer=drv.me,
                round=drv.state.round,
                syncing_peer=pid,
                wait_s=PROBATION_SYNC_WAIT_S,
                misses=misses,
                retry_round=last + PROBATION_SYNC_RETRY_ROUNDS,
            )
        return plain
    if waits.seen.get(pid) != sp.done_bytes:  # it moved (or is new): derive its wait again
        waits.seen[pid] = sp.done_bytes
        remaining = sp.remaining_s()
        if remaining is not None:
            cap = t0 + max(wait_s, drv.cfg.sync_wait_cap_s)
            margin = SYNC_WAIT_MARGIN_S + apply_allowance_s(drv)
            waits.until[pid] = min(cap, now + remaining * SYNC_WAIT_SLACK + margin)
            if waits.until[pid] > plain and pid not in waits.logged:
                waits.logged.add(pid)
                events.emit(
                    log,
                    logging.INFO,
                    "waiting_for_syncing_peer",
                    "round %d: waiting up to %.1f s more for %s, syncing (%d of %d MiB at %.1f MiB/s)%s",
                    drv.state.round,
                    waits.until[pid] - now,
                    pid[:10],
                    sp.done_bytes >> 20,
                    sp.total_bytes >> 20,
                    sp.bytes_per_s / 2**20,
                    "" if established else " on probation",
                    peer=drv.me,
                    round=drv.state.round,
                    syncing_peer=pid,
                    wait_s=waits.until[pid] - now,
                    done_bytes=sp.done_bytes,
                    total_bytes=sp.total_bytes,
                    bytes_per_s=sp.bytes_per_s,
                    probation=not established,
                )
    end = max(plain, waits.until.get(pid, 0.0))
    if end > plain and end > now:
        waits.extended.add(pid)  # held past its plain wait by its progress: a miss if it does not arrive
    return end


def grants_left(drv: RoundDriver, pid: str) -> bool:
    """Whether peer ``pid`` (on probation) may still hold a gather by its announced progress: it did not
    arrive from ``PROBATION_SYNC_GRANTS`` such waits, or the last of them is ``PROBATION_SYNC_RETRY_ROUNDS``
    rounds old or more (misses are forgiven then: an honest joiner whose waits fell short is not left out
    for good)."""
    misses, last = drv._sync_misses.get(pid, (0, 0))
    return misses < PROBATION_SYNC_GRANTS or drv.state.round - last >= PROBATION_SYNC_RETRY_ROUNDS


def note_sync_outcomes(drv: RoundDriver, waits: SyncWaits, arrived: set[str]) -> None:
    """At a gather's end: a peer held past its plain wait by its progress (``waits.extended``) that did not
    arrive counts one miss at this round (misses older than ``PROBATION_SYNC_RETRY_ROUNDS`` start again from
    0); one that arrived has none."""
    r = drv.state.round
    for p in waits.extended - arrived:
        misses, last = drv._sync_misses.get(p, (0, r))
        drv._sync_misses[p] = (1 if r - last >= PROBATION_SYNC_RETRY_ROUNDS else misses + 1, r)
    for p in waits.extended & arrived:
        drv._sync_misses.pop(p, None)


def apply_allowance_s(drv: RoundDriver) -> float:
    """Seconds a syncing peer is given after its last byte to apply it, beyond ``SYNC_WAIT_MARGIN_S``:
    ``SYNC_APPLY_FACTOR`` x this peer's own outer step and commit (``phase_s`` ``outer_step`` + ``digest``)
    of its last row, the same work on the same model (0.0 before its first row)."""
    phases = getattr(drv.history[-1], "phase_s", None) if drv.history else None
    if not phases:
        return 0.0
    return SYNC_APPLY_FACTOR * max(0.0, float(phases.get("outer_step", 0.0)) + float(phases.get("digest", 0.0)))
