"""The state vote and the re-sync of the round rules (:class:`StateSync`): which state the swarm backs
(weighted by standing, :func:`~geomesh_p2p.trust.standing.choose_state`), whether this peer is behind, and
the catch-up to that state (outer updates from the donors, else a full download), never back to an older
state unless that is the only way to rejoin the live swarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, Optional

import torch

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.agree import choose_plan, state_tie_winner
from geomesh_p2p.round.rules.planning import plan_horizon_s
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.sync import download as state_sync
from geomesh_p2p.schema.peer import MAX_LINK_BPS, SyncProgress
from geomesh_p2p.sync.progress import SyncMeter
from geomesh_p2p.telemetry import events
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.trust.dialback import DialBack, no_connection
from geomesh_p2p.trust.standing import OnceLog, StateChoice, choose_state, would_adopt

if TYPE_CHECKING:
    from geomesh_p2p.config.models import RunConfig
    from geomesh_p2p.model.state import GlobalState
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.plan.agree import PlanStore
    from geomesh_p2p.schema.peer import PeerRecord

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["StateSync", "NO_MAJORITY_RETRIES", "STATE_SYNC_ATTEMPTS", "BUSY_REFRESH_S", "sync_call_timeout_s"]

#: Reads of the swarm's records a catch-up makes, 0.5 s apart, while no state has a majority (mid-round).
NO_MAJORITY_RETRIES = 8
#: Full state downloads tried before a joiner gives up: donors may leave or lag mid-download for minutes.
STATE_SYNC_ATTEMPTS = 30
#: Full state downloads in a row whose every donor was unreachable (connection refused) after which a sync gives
#: up: leaving peers serve their last state until they exit and their records outlive them by a TTL, so a peer
#: resumed after the run's peers had all left asked the gone ones 44 times in 25 s (87 WARNING lines; a fresh-user
#: trial, session 34).
UNREACHABLE_ATTEMPTS = 3
#: Seconds between reads of the swarm's plans while a sync runs: the donors' busy windows (their exchange
#: deadlines) that the download's stall clock waits for (state_sync.BusyFn).
BUSY_REFRESH_S = 1.0
#: The shortest deadline of one state or outer-update call of a sync, seconds (:func:`sync_call_timeout_s`).
SYNC_CALL_TIMEOUT_S = 120.0


def sync_call_timeout_s(window_s: Optional[float]) -> float:
    """The deadline (seconds) of each state or outer-update call of a sync in a run whose window is ``window_s``:
    ``SYNC_CALL_TIMEOUT_S``, or the plan horizon followers accept (``4 x window + 120 s``) when longer. A donor
    busy with its own round sends late, not never: its stall clock is held until its plan's exchange deadline,
    which lies at most that horizon ahead, so a fixed 120 s cut such calls mid-round once rounds last minutes
    (issue 29 #2); a donor that went quiet is still left after the stall timeout."""
    return max(SYNC_CALL_TIMEOUT_S, plan_horizon_s(window_s))


def _none() -> None:
    return None


async def _nothing() -> None:
    return None


class StateSync:
    """This peer's state vote and re-sync.

    Args:
        run_cfg: the run config (``run_id``, ``window_s``).
        state: this peer's :class:`RoundState` (``me``, ``round``, ``digest``, ``numel``, ``state_numel``,
            ``standing``, ``history``; ``round`` is moved here as the catch-up goes).
        stop: set when the node stops (a catch-up then returns).
        peers: the live records of the run (``include_leaving``), this peer's own included.
        announce: stores this peer's record now (never raises).
        record_changed: called when the sync's progress moved (the record is refreshed).
        set_state: ``(round, theta [P], optimizer state [k * P])`` becomes the global state (worker thread).
        transport: the node's transport (downloads), None before it started.
        plans: the run's signed plans (the donors' busy windows), None: not watched.
        gstate: the global state buffer, None before the node built it (tests of the vote).
        outer: the outer optimizer (outer updates are applied with it).
        address: the address this peer's record names (may raise before the transport exists).

    Attributes:
        syncing: True while a catch-up runs (this peer's record then carries no digest).
        meter: the progress of the download under way, announced in the record.
        stats: full downloads, outer updates applied and incremental catch-ups refused.
    """

    def __init__(
        self,
        run_cfg: RunConfig,
        state: RoundState,
        stop: asyncio.Event,
        *,
        peers: Callable[..., Awaitable[list[PeerRecord]]],
        announce: Callable[[], Awaitable[None]] = _nothing,
        record_changed: Callable[[], None] = _none,
        set_state: Optional[Callable[[int, torch.Tensor, Optional[torch.Tensor]], None]] = None,
        transport: Callable[[], Optional[Transport]] = _none,
        plans: Callable[[], Optional[PlanStore]] = _none,
        gstate: Callable[[], Optional[GlobalState]] = _none,
        outer: Callable[[], Any] = _none,
        address: Callable[[], Optional[str]] = _none,
    ):
        self.run_cfg = run_cfg
        self.state = state
        self._stop = stop
        self._peers = peers
        self._announce = announce
        self._record_changed = record_changed
        self._set_state_fn = set_state
        self._transport = transport
        self._plans = plans
        self._gstate = gstate
        self._outer = outer
        self._address = address
        self.syncing = False
        self.meter: Optional[SyncMeter] = None
        self.stats = {"downloads": 0, "updates": 0, "refused": 0}
        #: the last outer update's size (bytes, its blob's first chunk says) and this peer's mean rate over
        #: its last transfer (bytes/s): what it announces before its next transfer's first byte
        self.update_bytes: Optional[int] = None
        self.rate_bps = 0.0
        self._back_once = LogOnce(log)
        self._vote_log = OnceLog()
        self._dialback: Optional[DialBack] = None  # built on the first vote of addresses
        #: the records whose votes count in the catch-up's state vote (the policy's ``digest_voters``: without the
        #: peers this peer excludes); all of them when unset
        self.voters: Callable[[list[PeerRecord]], list[PeerRecord]] = list
        #: peer -> the timestamp of its leaving record whose address refused the connection: that peer exited (a
        #: leaving peer serves its state only until it does), so that record neither votes nor donates
        #: (:meth:`state_vote`); a new record of it (restarted) counts again
        self._gone: dict[str, float] = {}
        #: the round announced by the peers the last :meth:`catch_up` could take the state from when it ended
        #: adopting nothing because none of them answered (no connection: they exited, their records outliving
        #: them); None otherwise, e.g. when one answered with another state (node/joining.py: a fresh peer may then
        #: continue from its own checkpoint of that round)
        self.unanswered: Optional[int] = None
        self._silent: Optional[int] = None  # the last vote's: its holders' newest round when none answered a dial
        #: (the state held, (round, digest), the choice) of the last :meth:`rejoin_state` that chose one (:meth:`_pin`)
        self._chosen: Optional[tuple[tuple[int, str], tuple[int, str], StateChoice]] = None

    def progress(self) -> Optional[SyncProgress]:
        """The ``sync_progress`` of this peer's record: the meter's progress while it syncs, else None.

        While it syncs before a transfer started (planned out, waiting for the round to end; reading the
        vote), what it is about to fetch (:meth:`expected`), so that the leader's gather, which starts
        as the round ends, waits for it by that from its first read (issue 29 #7: a joiner on probation
        showed no progress in the first 1.5 s of the gather and was planned out every round)."""
        if not self.syncing:
            return None
        meter = self.meter
        if meter is None:
            return self.expected()
        got = meter.progress()
        if got.bytes_per_s <= 0 and self.rate_bps > 0:  # no byte of this transfer yet: the last one's rate
            got = got.model_copy(update={"bytes_per_s": min(MAX_LINK_BPS, self.rate_bps)})
        return got

    def expected(self) -> Optional[SyncProgress]:
        """0 bytes of what this peer will fetch to reach the round it announces, at its last transfer's mean
        rate: the outer updates from the state it holds (``update_bytes`` each) when it holds one of the
        last ``DEFAULT_KEEP_UPDATES`` rounds, else the whole state. None before any transfer (no rate)."""
        if self.rate_bps <= 0:
            return None
        gs = self._gstate()
        held = gs.round if gs is not None and gs.digest is not None else None
        n = self.state.round - held if held is not None else 0
        if 0 < n <= state_sync.DEFAULT_KEEP_UPDATES and self.update_bytes:
            total = n * self.update_bytes
        else:
            total = (self.state.numel + self.state.state_numel) * 4
        return SyncProgress(done_bytes=0, total_bytes=max(1, total), bytes_per_s=min(MAX_LINK_BPS, self.rate_bps))

    async def _dialled(self, recs: list) -> list:
        """``recs`` without the records whose addresses do not answer as their identities with their states
        (:class:`~geomesh_p2p.trust.dialback.DialBack`); each dropped record is said once (INFO). Unchanged
        without a transport (tests of the vote)."""
        transport = self._transport()
        if transport is None:
            return recs
        if self._dialback is None or self._dialback.transport is not transport:
            self._dialback = DialBack(transport)
        kept, dropped = await self._dialback.verified(recs)
        held = [r for r in recs if r.weights_digest and r.round > 0]
        if held and all(no_connection(dropped.get(r.peer_id, "")) for r in held):
            self._silent = max(r.round for r in held)
        for peer, why in dropped.items():
            self._vote_log(
                ("dialback", peer, why),
                logging.INFO,
                "state vote: the record of %s does not vote: %s",
                peer[:10],
                why,
                event="record_not_dialled",
                peer=self.state.me,
                subject=peer,
                reason=why,
            )
        return kept

    def _note_rate(self) -> None:
        """Keep the mean rate of the transfer just done (a meter that counted bytes) for :meth:`expected`."""
        rate = self.meter.mean_bytes_per_s() if self.meter is not None else 0.0
        if rate > 0:
            self.rate_bps = rate

    def _set_state(self, round: int, theta: torch.Tensor, momentum: Optional[torch.Tensor]) -> None:
        if self._set_state_fn is None:
            raise RuntimeError("this peer cannot adopt a state (built without its global state)")
        self._set_state_fn(round, theta, momentum)

    async def catch_up(self, target: Optional[tuple[int, str]] = None) -> None:
        """Bring this peer to the state the swarm's vote backs (late join, planned out, digest mismatch):
        weighted by standing once this peer knows who delivered, else by distinct addresses with history
        (standing.py). ``target`` (round, digest): that state and no other, unless the vote backs a later round
        (:meth:`_pinned`; with the donors the last :meth:`rejoin_state` chose it from).

        Incremental (issue 14 #3): a state of an earlier round -- this peer's own when it is of the swarm's
        lineage (planned out), or one it downloaded while the swarm moved on -- is brought forward by the
        donors' outer updates (:func:`state_sync.catch_up_updates`, each checked against the digests, the
        last against the digest the vote backs); the whole state is downloaded only when no such base
        exists or the updates are refused (one INFO line with the reason). A download crossing a round
        boundary finishes from the donors' kept copy of its round. ``stats`` counts full downloads
        and updates applied."""
        stats = self.stats
        self.syncing = True
        busy: dict[str, float] = {}  # donor address -> swarm seconds it is busy with its own round until
        watcher = asyncio.ensure_future(self._watch_busy_donors(busy)) if self._plans() is not None else None
        start_round = self.state.round
        gs = self._gstate()  # None: a node built without a model (tests of the vote)
        held_round, held_digest = (gs.round, gs.digest) if gs is not None else (self.state.round, None)
        base: Optional[state_sync.Snapshot] = None
        own_tried = False
        downloaded: Optional[state_sync.Snapshot] = None  # the last full download, kept whole
        caught_from: Optional[int] = None  # the round the incremental catch-up started from
        unreachable = 0  # downloads in a row whose donors were all unreachable
        self.unanswered = None
        pin = self._pin(target)
        try:
            for attempt in range(STATE_SYNC_ATTEMPTS):
                if self._stop.is_set():
                    return
                # leaving peers vote and donate too: they serve their last state until they exit, and a peer
                # stalled while the swarm finished must catch up to it rather than train alone (docs/round.md)
                recs = [r for r in await self._peers(include_leaving=True) if r.peer_id != self.state.me]
                recs = self.voters(recs)  # an excluded peer's state is neither voted for nor downloaded
                self._silent = None
                vote = self.state_vote(recs)
                if vote.choice is None or vote.choice.mode != "standing":
                    # a vote of addresses (this peer knows nobody): only those that answer as their records'
                    # identities, holding the states they announce, count (trust/dialback.py)
                    recs = await self._dialled(recs)
                    vote = self.state_vote(recs)
                choice = vote.choice
                if pin is not None:
                    pin, choice = self._pinned(pin, recs, choice)
                    if choice is None:
                        break  # the state chosen is served by nobody now: refused (no other state instead)
                if choice is None:
                    # No state has a majority: mostly a moment mid-round, when the others announce round r+1 one
                    # by one. Read again a few times; returning at once left a planned-out peer announcing a
                    # round whose state it does not hold, and it forked by leading that round alone.
                    if attempt < NO_MAJORITY_RETRIES:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), 0.5)
                        continue
                    if base is not None and (base is downloaded or caught_from is not None):
                        await self._adopt(
                            base,
                            "downloaded"
                            if caught_from is None
                            # nobody backs a state
                            else f"caught up from round {caught_from} by {base.round - caught_from} outer update(s)",
                        )  # now: keep what was verified against the swarm
                        return
                    self.state.round = held_round if held_digest else start_round  # the round of the state it holds
                    self.unanswered = self._silent
                    return
                if held_digest and choice.round < held_round:
                    # The vote backs an OLDER state than the one this peer holds (rs7: the round-10 donors
                    # left, a live peer at round 5 remained): never back, unless it is the only way to rejoin.
                    why = self._why_not_back(choice, recs, held_round, held_digest)
                    if why is not None:
                        if (
                            base is not None
                            and base.round > held_round
                            and (base is downloaded or caught_from is not None)
                        ):
                            await self._adopt(base, "downloaded" if caught_from is None else "caught up")
                            return  # verified against the vote that brought it here: newer than the state held
                        self._back_log()(
                            ("not_back", held_round, held_digest, choice.round, choice.digest),
                            logging.INFO,
                            "keeping the state of round %d (digest %s): the swarm's vote backs the state of "
                            "round %d (digest %s), an OLDER one, and %s",
                            held_round,
                            held_digest[:8],
                            choice.round,
                            choice.digest[:8],
                            why,
                            event="older_state_declined",
                            peer=self.state.me,
                            round=choice.round,
                            digest=choice.digest,
                            held_round=held_round,
                            held_digest=held_digest,
                            reason=why,
                        )
                        self.state.round = held_round
                        return
                    if choice.digest != held_digest:
                        self._note_going_back(choice, recs, held_round, held_digest)
                if choice.digest == self.state.digest and base is None:
                    # This peer holds the backed state already (its digest check was outvoted by identities
                    # without standing, or the others have not moved on yet).
                    self.state.round = choice.round
                    return
                top, donors = choice.round, choice.donors
                self.state.round = top
                # (a fresh peer's round-0 state, or one older than the donors keep updates for, is not tried)
                if (
                    base is None
                    and not own_tried
                    and held_digest
                    and 0 < held_round < top
                    and top - held_round <= state_sync.DEFAULT_KEEP_UPDATES
                ):
                    own_tried = True  # this peer's own state may be of the swarm's lineage: try the updates
                    base = await asyncio.to_thread(self._state_copy)
                if base is not None and base.round == top and base.digest == choice.digest:
                    await self._adopt(
                        base,
                        "downloaded"
                        if caught_from is None
                        else f"caught up from round {caught_from} by {top - caught_from} outer update(s)",
                    )
                    return
                if base is not None and base.round < top:
                    from_round = base.round
                    # progress announced as for a download (the leader's wait follows it); each update's size is
                    # estimated as the last one's (at first P bytes: a sign-compressed swarm's zlib blob is ~0.25 x
                    # 4P) until its first chunk states it (an fp32 update is ~4P: issue 29 #7)
                    self._note_rate()
                    meter = self.meter = SyncMeter(
                        max(1, (top - from_round) * (self.update_bytes or self.state.numel)),
                        on_progress=self._record_changed,
                    )
                    sizes: dict[int, int] = {}

                    def on_size(rnd: int, nbytes: int, n: int = top - from_round, meter=meter, sizes=sizes) -> None:
                        sizes[rnd] = self.update_bytes = nbytes
                        meter.set_total(sum(sizes.values()) + (n - len(sizes)) * nbytes)
                        self._record_changed()

                    await self._announce()
                    log.info(
                        "catching up from round %d to %d by %d outer update(s) from %d donor(s)",
                        from_round,
                        top,
                        top - from_round,
                        len(donors),
                    )
                    work = await asyncio.to_thread(self._snapshot_copy, base)  # kept whole if an update is refused
                    try:
                        snap = await state_sync.catch_up_updates(
                            self.meter.wrap(self._transport()),
                            donors,
                            work,
                            target_round=top,
                            target_digest=choice.digest,
                            outer=self._outer(),
                            timeout_s=sync_call_timeout_s(self.run_cfg.window_s),
                            busy_until=lambda d: busy.get(d, 0.0),
                            on_size=on_size,
                        )
                    except state_sync.StateSyncError as e:
                        stats["refused"] += 1
                        # every donor was tried (fetch_update): the updates are gone or refused, or this
                        # peer's own state is not of the swarm's lineage: the whole state it is
                        log.info(
                            "incremental catch-up from round %d to %d refused (%s); downloading the state",
                            from_round,
                            top,
                            e,
                        )
                        base, caught_from = None, None
                        continue
                    stats["updates"] += top - from_round
                    caught_from = from_round if caught_from is None else caught_from
                    # not adopted yet: the swarm may have sealed another round meanwhile; the next pass adopts
                    # this state or brings it further (no copy into the model, no evaluation in between)
                    base = snap
                    continue
                # the record announces the download's progress: the leader's wait for it follows (issue 14 #3)
                self._note_rate()
                self.meter = SyncMeter(
                    (self.state.numel + self.state.state_numel) * 4, on_progress=self._record_changed
                )
                await self._announce()  # tell the leader we are syncing for this round
                log.info(
                    "downloading the state of round %d (%d bytes) from %d donor(s)",
                    top,
                    (self.state.numel + self.state.state_numel) * 4,
                    len(donors),
                )
                try:
                    snap = await state_sync.download_state(
                        self.meter.wrap(self._transport()),
                        donors,
                        round=top,
                        numel=self.state.numel,
                        expected_digest=choice.digest,
                        state_numel=self.state.state_numel,
                        timeout_s=sync_call_timeout_s(self.run_cfg.window_s),
                        busy_until=lambda d: busy.get(d, 0.0),
                        last_attempt=attempt == STATE_SYNC_ATTEMPTS - 1,
                    )
                except state_sync.StateSyncError as e:
                    if pin is not None:  # its donors then: only those that announce it now (a swap refused)
                        pin = replace(pin, donors=[])
                    held = held_round if held_digest else start_round
                    silent = isinstance(e, state_sync.DonorsUnreachable) and self._only_donors(recs, donors)
                    if isinstance(e, state_sync.DonorsUnreachable) and self._left_for_good(recs, donors, top, held):
                        self.state.round, self.unanswered = held, top if silent else None
                        return  # no live donor: this peer goes on from the state it holds (said in one line)
                    # all donors gone (no connection) several times in a row: they have left; anything else resets it
                    unreachable = unreachable + 1 if isinstance(e, state_sync.DonorsUnreachable) else 0
                    if unreachable >= UNREACHABLE_ATTEMPTS:
                        self.unanswered = top if silent else None
                        log.warning(
                            "state download for round %d: its %d donor(s) did not answer %d times in a row (%s): "
                            "they have left; giving up the download",
                            top,
                            len(donors),
                            unreachable,
                            e,
                        )
                        break
                    log.info("state download for round %d failed (%s); retrying", top, e)
                    await asyncio.sleep(0.5)
                    continue
                stats["downloads"] += 1
                events.emit(
                    log,
                    logging.INFO,
                    "state_downloaded",
                    "downloaded state of round %d from %d donor(s), digest %s; %s",
                    top,
                    len(donors),
                    snap.digest[:8],
                    choice.describe(),
                    peer=self.state.me,
                    round=top,
                    donors=list(donors),
                    digest=snap.digest,
                    vote=choice.mode,
                )
                base = downloaded = snap  # the next pass adopts it, or brings it to the round the swarm moved on to
            self.state.round = held_round if held_digest else start_round  # nothing adopted: it holds its own state
            raise state_sync.StateSyncError(
                f"could not download the swarm's state after {attempt + 1} attempt(s); see the log for why"
            )
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            self._note_rate()
            self.syncing, self.meter = False, None
            await self._announce()

    def _pin(self, target: Optional[tuple[int, str]]) -> Optional[StateChoice]:
        """The state a catch-up downloads whatever the vote: ``target`` (with :attr:`_chosen`'s donors when it chose
        it at the state held now), None: the vote's. Red team 52a: a choice no re-sync followed pinned the next
        catch-up of a peer behind to a rogue's state over the majority's at its round."""
        chosen, self._chosen = self._chosen, None
        if target is None:
            return None
        if chosen is not None and chosen[:2] == ((self.state.round, self.state.digest), target):
            return chosen[2]
        return StateChoice(target[0], target[1], [], 0, 0, "tie")

    def _pinned(self, pin: StateChoice, recs: list, choice: Optional[StateChoice]):
        """(pin, choice) of a pass of a pinned catch-up: no pin and the vote's ``choice`` when it backs a later round
        (the swarm moved on); else ``pin`` with the donors announcing it in ``recs`` too, None when none (refused)."""
        if choice is not None and choice.round > pin.round:
            return None, choice
        now = [r.address for r in recs if (r.round, r.weights_digest) == (pin.round, pin.digest) and r.address]
        donors = list(dict.fromkeys(pin.donors + now))
        if not donors:
            log.info(
                "the state chosen to re-sync to (round %d, digest %s) is served by nobody", pin.round, pin.digest[:8]
            )
        return pin, replace(pin, donors=donors) if donors else None

    @staticmethod
    def _only_donors(recs: list, donors) -> bool:
        """Every record in ``recs`` holding a state past round 0 is one of ``donors`` (addresses): no other peer
        holds a state this one could take instead."""
        return all(r.address in donors for r in recs if r.weights_digest and r.round > 0)

    def _left_for_good(self, recs: list, donors, top: int, held: int) -> bool:
        """After a download whose ``donors`` (addresses) all refused the connection: those whose records in ``recs``
        announced leaving exited, and are no donors (nor voters) from now on (:attr:`_gone`). True when every
        donor did so: then one line says that no live peer holds the state of round ``top`` and what this peer
        does instead, from its state of round ``held`` (fresh user 46: a peer resumed after the others finished asked the two gone ones 104 times
        in 45 s, a line per piece, then trained alone untold)."""
        by_address = {r.address: r for r in recs if r.address}
        left = [by_address[d] for d in donors if d in by_address and by_address[d].leaving]
        for r in left:
            self._gone[r.peer_id] = float(r.timestamp)
        if not left or len(left) < len(donors):
            return False
        events.emit(
            log,
            logging.WARNING,
            "no_live_donor",
            "no live peer holds the swarm's state of round %d: its %d donor(s) (%s) announced leaving and refuse "
            "connections (they exited), so they are not asked again; this peer keeps the state it holds, round %d, "
            "not the swarm's (training on from it is a new lineage; a peer of the run that comes back may hand it "
            "a newer state)",
            top,
            len(left),
            ", ".join(f"{r.peer_id[:10]} at {r.address}" for r in left),
            held,
            peer=self.state.me,
            round=top,
            donors=[r.peer_id for r in left],
        )
        return True

    def _why_not_back(self, choice, recs, held_round: int, held_digest: str) -> Optional[str]:
        """Why this peer must not adopt ``choice`` (a state of a round below ``held_round``, the round of the
        state it holds), or None when going back is the only way to rejoin the live swarm.

        It waits (keeps its state, announced with its digest, so peers behind can download it) when:

        * a live peer (not leaving) announces round ``held_round`` or later, with a digest or syncing: newer
          donors are there or may come back (a failed download, a donor restarting);
        * a live peer backing ``choice`` would adopt this peer's state by its own vote
          (:func:`~geomesh_p2p.trust.standing.would_adopt`, read from its record's attestations): the swarm behind
          can come up to this peer (rs7: the peer at round 5 had seen this one deliver).

        ``recs``: the other peers' records, leaving ones included. A state whose digest is the one held
        (rounds that moved nothing) is never adopted at a lower round either."""
        if choice.digest == held_digest:
            return "it is this peer's own state (rounds that changed nothing)"
        newer = sorted(r.peer_id for r in recs if not r.leaving and r.round >= held_round)
        if newer:
            return (
                f"{len(newer)} live peer(s) announce round {held_round} or later ({', '.join(p[:10] for p in newer[:5])}): "
                "waiting for the newer state"
            )
        try:
            address = self._address()
        except Exception:  # no transport yet (a node built without one): only the vote's address key differs
            address = None
        mine = SimpleNamespace(
            peer_id=self.state.me,
            address=address or "this-peer",
            round=held_round,
            weights_digest=held_digest,
            standing={},
            leaving=False,
        )
        backers = [r for r in recs if not r.leaving and (r.round, r.weights_digest) == (choice.round, choice.digest)]
        coming = sorted(
            b.peer_id
            for b in backers
            if would_adopt(b, [x for x in recs if x.peer_id != b.peer_id] + [mine], held_round, held_digest)
        )
        if coming:
            return (
                f"{len(coming)} live peer(s) at round {choice.round} ({', '.join(p[:10] for p in coming[:5])}) would "
                f"adopt this peer's state by their own vote: waiting for them to catch up to round {held_round}"
            )
        return None

    def _back_log(self) -> LogOnce:
        """Logs each decision about an older state once (a catch-up retried every few seconds repeats it)."""
        return self._back_once

    def _note_going_back(self, choice, recs, held_round: int, held_digest: str) -> None:
        """The one WARNING (``older_state_adopted``, once per pair of states) of a peer that adopts an older
        state: the only way to rejoin the live swarm (:meth:`_why_not_back` found no reason to wait)."""
        live = sorted({r.peer_id for r in recs if not r.leaving and r.weights_digest})
        self._back_log()(
            ("back", held_round, held_digest, choice.round, choice.digest),
            logging.WARNING,
            "going back from the state of round %d (digest %s) to the OLDER state of round %d (digest %s): no "
            "live peer is at round %d or later, and none of the %d live peer(s) at round %d would adopt this "
            "peer's state; the only way to rejoin the live swarm (%s); discarded: this peer's %d round(s) since "
            "that state (%s), a lineage the live swarm does not hold",
            held_round,
            held_digest[:8],
            choice.round,
            choice.digest[:8],
            held_round,
            len(live),
            choice.round,
            choice.describe(),
            held_round - choice.round,
            f"round {choice.round}" if held_round - choice.round == 1 else f"rounds {choice.round}-{held_round - 1}",
            event="older_state_adopted",
            peer=self.state.me,
            round=choice.round,
            digest=choice.digest,
            held_round=held_round,
            held_digest=held_digest,
            live=live,
            discarded_rounds=list(range(choice.round, held_round)),
        )

    async def _watch_busy_donors(self, busy: dict[str, float]) -> None:
        """While a sync runs: every ``BUSY_REFRESH_S``, the plans of the round being synced to and the next
        one (the donors' rounds) set ``busy[address]`` to that plan's exchange deadline for each participant
        (addresses from the live records, else the plan's), capped at the plan horizon followers accept. A plan
        whose deadlines followers refuse (farther than that horizon) is ignored: the cap alone is re-read from
        "now" every refresh, so such a rogue plan held its donors busy for as long as it stayed in the DHT.
        A failed read keeps the figures it had."""
        store = self._plans()
        if store is None:  # no plan store: nothing to watch
            return
        while True:
            try:
                addr = {r.peer_id: r.address for r in await self._peers(include_leaving=True) if r.address}
                now = swarm_time()
                horizon = plan_horizon_s(self.run_cfg.window_s)
                for rnd in (self.state.round, self.state.round + 1):
                    # Deadlines farther than the horizon: refused by every follower (PlanRules.plan_problem), so no
                    # evidence of a busy donor (and not allowed to hide the round's real plan either).
                    sane = [
                        p
                        for p in await store.read(rnd, leaders=addr)  # plans of unknown peers: left unread
                        if float(p.train_deadline) - now <= horizon
                        and float(p.exchange_deadline) - float(p.train_deadline) <= horizon
                    ]
                    plan = choose_plan(self.run_cfg.run_id, rnd, sane)
                    if plan is None:
                        continue
                    end = min(float(plan.exchange_deadline), now + horizon)
                    for a in plan.assignments:
                        where = addr.get(a.peer_id) or a.address
                        if where:
                            busy[where] = max(busy.get(where, 0.0), end)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a DHT hiccup: the download keeps the plain stall limits meanwhile
                log.debug("reading the donors' plans failed: %r", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), BUSY_REFRESH_S)
            if self._stop.is_set():
                return

    def _state_copy(self) -> "state_sync.Snapshot":
        """This peer's global state as a Snapshot owning a copy of the buffer (worker thread).

        Raises:
            RuntimeError: the state has no digest yet (it was never committed: nothing of the swarm's lineage).
        """
        gs = self._gstate()
        if gs is None:
            raise RuntimeError("this peer holds no global state yet: it cannot be a base to catch up from")
        with gs.lock:
            if gs.digest is None:  # catch_up asks only for a committed state
                raise RuntimeError("this peer's global state has no digest yet: it cannot be a base to catch up from")
            return self._snapshot_copy(
                state_sync.Snapshot(gs.round, gs.theta, gs.opt_state, gs.digest, buffer=gs.buffer)
            )

    @staticmethod
    def _snapshot_copy(snap: "state_sync.Snapshot") -> "state_sync.Snapshot":
        """``snap`` with a buffer of its own ((1 + k) * P * 4 bytes; worker thread).

        Raises:
            ValueError: ``snap`` has no ``buffer`` (a snapshot not backed by one contiguous state buffer).
        """
        if snap.buffer is None:
            raise ValueError(f"the snapshot of round {snap.round} has no contiguous buffer to copy")
        buf = snap.buffer.clone()
        P = snap.theta.numel()
        return state_sync.Snapshot(snap.round, buf[:P], buf[P:], snap.digest, buffer=buf)

    async def _adopt(self, snap: "state_sync.Snapshot", how: str) -> None:
        """Make ``snap`` this peer's state (worker thread for the copy); one INFO line."""
        await asyncio.to_thread(self._set_state, snap.round, snap.theta, snap.momentum)
        log.info("state of round %d adopted (%s), digest %s", snap.round, how, (self.state.digest or "")[:8])

    async def behind(self) -> bool:
        """True when the swarm already holds the state of a later round (this peer must catch up)."""
        sr = self.swarm_round(await self._peers(include_leaving=True))  # leaving peers show the swarm's round
        return sr is not None and sr > self.state.round

    def swarm_round(self, recs) -> Optional[int]:
        """The round the other peers are at: the round of the state their vote backs (standing.choose_state),
        None when no state is backed by more than half of the vote. Votes count work, not identities: a
        peer that trained weighs each record by the rounds it saw that peer deliver (30 fresh identities
        announcing round+1 weigh nothing); a fresh peer counts distinct addresses, preferring peers others
        vouch for. One record alone cannot drag a peer to a round nobody else is at."""
        vote = self.state_vote(recs)
        return vote.choice.round if vote.choice is not None else None

    def rejoin_state(self, recs, among: Optional[Collection[str]] = None) -> Optional[tuple[int, str]]:
        """The (round, digest) this peer should re-sync to now, before training a round, though the swarm is at
        no later round: None when there is none (docs/round.md, "Peers resumed at different rounds"). A re-sync to
        it (:meth:`catch_up` with it as target) downloads exactly this state (:meth:`_pinned`).

        ``recs``: the run's records (this peer's own and leaving ones are skipped: the question is which state
        the live swarm trains on). The state is :meth:`state_vote`'s choice over the live others' records
        (standing-weighted, as a healed partition's, ``standing.choose_state``) when all of these hold:

        * the vote is by standing (its backers delivered in rounds this peer applied): a vote of addresses (a
          ledger that knows none of them) would let fresh identities pull a peer off its state;
        * it is at this peer's round or an earlier one, with another digest (a later one: :meth:`behind`);
        * more live peers with standing here announce it than announce this peer's state, this peer counted:
          the minority side moves, never the majority (one peer claiming a state of its own, with fresh
          identities beside it, moves nobody); as many at this peer's round: the side whose digest loses the
          tie (:func:`~geomesh_p2p.plan.agree.state_tie_winner`, the larger digest wins) moves;
        * for an earlier round, :meth:`_why_not_back` finds no reason to wait (no live peer at this peer's
          round or later, none of its backers would adopt this peer's state by its own vote).

        No majority (a k-way tie: red team 51b's 1-1-1, whose losers ended exit 3): ``plan.agree.state_tie_winner``
        over the live peers with standing here (``among``, a resumed peer's checkpoint partners: theirs only; red
        team 52a), this peer counted, when not its own state (a later round too; an earlier one: as above).

        Why: a whole swarm stopped at once resumed from checkpoints of different rounds (the peer that did not
        see the others leave trained one more round alone); each side waited the whole ``--min-peers`` wait
        for the other, then they forked (a fresh-user trial, session 37)."""
        held_round, held_digest = self.state.round, self.state.digest
        self._chosen = None
        if not held_digest or self.syncing:
            return None
        live = self.voters([r for r in recs if not r.leaving and r.peer_id != self.state.me and r.weights_digest])
        vote = self.state_vote(live)
        choice, mine = vote.choice, (held_round, held_digest)
        # identities with standing here only: one standing attacker and a fresh identity of its own announcing
        # the same state outnumbered this peer and moved it to a state only the attacker serves (red team 37b)
        voting = [r for r in live if vote.weights.get(r.peer_id, 0) > 0]
        holders: Counter[tuple[int, str]] = Counter((r.round, str(r.weights_digest)) for r in voting)
        holders[mine] += 1
        if choice is not None:
            if choice.mode != "standing" or choice.round > held_round or choice.digest == held_digest:
                return None
            # as many on each side: at the same round the tie goes to the larger digest, the break every peer
            # computes alike (plan.agree.state_tie_winner), so exactly one side moves (red team 50b: two peers
            # resumed on a 1-1 tie each waited for the other for ever); at an earlier round this peer's state wins
            target = (choice.round, choice.digest)
            ours = {target: holders[target], mine: holders[mine]}
            if ours[target] < ours[mine] or state_tie_winner(ours) != target:
                return None
        elif vote.standing:
            tied = Counter((r.round, str(r.weights_digest)) for r in voting if among is None or r.peer_id in among)
            tied[mine] += 1
            target = state_tie_winner(tied)  # no majority: the rule every peer with these records computes alike
            if target == mine:
                return None
            choice = StateChoice(*target, [], tied[target], sum(tied.values()), "tie")
        else:
            return None
        if target[0] < held_round and self._why_not_back(choice, live, held_round, held_digest) is not None:
            return None
        donors = [r.address for r in voting if (r.round, r.weights_digest) == target and r.address]
        self._chosen = (mine, target, replace(choice, donors=donors))
        return target

    def state_vote(self, recs):
        """:func:`~geomesh_p2p.trust.standing.choose_state` for this peer; logs once a state that most identities
        announce but the standing this peer sees does not back, when it would have moved this peer."""
        recs = [r for r in recs if not (r.leaving and self._gone.get(r.peer_id) == float(r.timestamp))]
        vote = choose_state(recs, me=self.state.me, standing=self.state.standing, trained=bool(self.state.history))
        ref = vote.refusal
        if ref is not None:
            mine = (self.state.round, self.state.digest)
            if ref.round > mine[0] or (ref.round == mine[0] and ref.digest != mine[1]):
                self._vote_log(
                    ("refused", ref.round, ref.digest),
                    logging.WARNING,
                    "%s",
                    ref.message(),
                    event="state_refused",
                    peer=self.state.me,
                    round=ref.round,
                    digest=ref.digest,
                    identities=ref.identities,
                    backing=ref.backing,
                    total=ref.total,
                )
        return vote
