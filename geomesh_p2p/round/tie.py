"""A resumed peer held for the peers of its checkpoint (:func:`~geomesh_p2p.round.gather.held_for_swarm`) that
finds one of them LIVE on another state: the hold is for peers to come back, and this one is back, on a state of its
own. Red team 50b: two peers resumed from checkpoints of the same round with different digests (one of them a fork)
each waited for the other for ever (the policy's re-sync rule broke no 1-1 tie), each line asking the user to
restart a peer that was running.

Now both sides settle the tie by the rule every peer computes alike from the records
(:func:`~geomesh_p2p.plan.agree.state_tie_winner`: the state most of them hold, then the later round, then the larger
digest), one INFO line each (``resumed_tie``), and both waits are bounded:

* the side whose state wins waits up to ``--wait-peers-s`` from the moment it saw the tie for the others to come in
  step (a re-sync announced with its progress is waited for by that progress, as any syncing peer), then trains as
  the timer's fallback says (with those in step): the others then see a later state and catch up to it;
* the side whose state loses trains nothing of its own: its start-up gather re-syncs to the winner when the policy's
  vote backs it (``StateSync.rejoin_state`` breaks the same tie alike), else at its first sight of the tie to the
  winner itself (``gather.rejoin(drv, everyone, tie)``: a k-way tie, whose vote backs no state, too), downloading
  that state and no other; or it catches up once the winner trains on; when neither happened within :data:`TIE_LOSER_WAITS` x ``--wait-peers-s`` it ends the run (cause ``"tie_lost"``,
  exit 3) saying whose state won and how to go on. Functions of the :class:`~geomesh_p2p.round.driver.RoundDriver`."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from geomesh_p2p.plan.agree import state_tie_winner
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.telemetry import events
from geomesh_p2p.round.context import SwarmEnded
from geomesh_p2p.round.resync import end_run

if TYPE_CHECKING:
    from geomesh_p2p.round.driver import RoundDriver

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

#: The side that lost a tie waits this many ``--wait-peers-s`` (from the moment it saw the tie) for a re-sync to the
#: winning state or for the winner to train on (it waits ``--wait-peers-s`` for the loser, then trains: a catch-up
#: follows), then ends (exit 3): one wait for the winner's, one for its round, one for the catch-up to start.
TIE_LOSER_WAITS = 3.0
#: A tie whose winner changed (a record flipping between digests) is said again at most once per this many seconds.
TIE_LOG_S = 30.0


@dataclass(frozen=True)
class Tie:
    """A resumed peer's tie with live peers on other states (:func:`resumed_tie`).

    Attributes:
        mine: (round, digest) this peer holds.
        winner: (round, digest) the tie goes to (:func:`~geomesh_p2p.plan.agree.state_tie_winner`).
        others: the live records on other states that took part (PeerRecords, their order as read).
        since: monotonic seconds when this session first saw a tie at ``mine``.
    """

    mine: tuple[int, str]
    winner: tuple[int, str]
    others: tuple[PeerRecord, ...]
    since: float

    @property
    def won(self) -> bool:
        return self.winner == self.mine

    def holders(self) -> list[str]:
        """The PeerIDs (short) of the others that hold the winning state."""
        return [r.peer_id[:8] for r in self.others if (r.round, r.weights_digest) == self.winner]


def live_elsewhere(drv: RoundDriver, recs: list[PeerRecord]) -> list[PeerRecord]:
    """The live records (not leaving; announcing a digest, i.e. not syncing) of the peers of this resumed peer's
    checkpoint (``_resumed_with``) that hold another state than this peer's (round, digest).

    Only those: the hold is for them (red team 51b: a peer established here but not of the checkpoint -- a rogue
    with standing, or a stale honest peer -- on a larger digest made the held peer end exit 3, ``tie_lost``, on a
    smaller one or an earlier round made it train alone after ``--wait-peers-s``; before tie51 both waited for the
    partners). Such a peer held for its own partners settles its side of the tie alone (it re-syncs by the policy's
    vote, or trains and is caught up to)."""
    mine = (drv.state.round, drv.state.digest)
    partners = set(drv._resumed_with)
    return [
        r
        for r in recs
        if r.peer_id in partners
        and r.peer_id != drv.me
        and not r.leaving
        and r.weights_digest
        and (r.round, r.weights_digest) != mine
    ]


def resumed_tie(drv: RoundDriver, recs: list[PeerRecord], now: float) -> Optional[Tie]:
    """The :class:`Tie` of a peer :func:`~geomesh_p2p.round.gather.held_for_swarm` holds (alone in step at the state
    it resumed), when peers it would wait for are live on other states (:func:`live_elsewhere`); None otherwise. The
    first sight at a state starts its bounded wait and says so (one INFO line, ``resumed_tie``)."""
    others = live_elsewhere(drv, recs)
    if not others or drv.state.digest is None:
        # no tie in view (the others went, or came in step): a tie seen again starts its bounded wait again (red
        # team 51b: a winner that left mid-wait and came back found the loser's wait spent, and it ended at once)
        drv._tie_seen = None
        return None
    mine = (drv.state.round, drv.state.digest)
    holders: Counter[tuple[int, str]] = Counter((r.round, str(r.weights_digest)) for r in others)
    holders[mine] += 1  # nobody else holds it: held_for_swarm holds only a peer alone in step
    winner = state_tie_winner(holders)
    if drv._tie_seen is None or drv._tie_seen[0] != mine:
        drv._tie_seen = (mine, now)
    tie = Tie(mine=mine, winner=winner, others=tuple(others), since=drv._tie_seen[1])
    # said at first sight, and again when the winner changed, at most once per TIE_LOG_S (red team 51b: a partner
    # re-announcing a larger, then a smaller digest flipped the winner every read: one line per read)
    said = drv._tie_logged
    if said is None or said[0] != mine or (said[1] != winner and now - drv._tie_said_at >= TIE_LOG_S):
        drv._tie_logged, drv._tie_said_at = (mine, winner), now
        say_tie(drv, tie)
    return tie


def say_tie(drv: RoundDriver, tie: Tie) -> None:
    """The one INFO line (``resumed_tie``) of a tie first seen: who is live on which state, the rule, which state
    wins and what this peer does now."""
    wait_s = drv.cfg.wait_peers_s
    r, d = tie.mine
    others = ", ".join(f"{x.peer_id[:8]} (round {x.round}, digest {str(x.weights_digest)[:8]})" for x in tie.others)
    what = (
        f"this peer's state wins: waiting up to {wait_s:.0f} s (--wait-peers-s) for them to re-sync to it, then "
        "training on it"
        if tie.won
        else f"the state of {', '.join(tie.holders())} wins: this peer trains nothing of its own and re-syncs to it "
        f"(or catches up once they train on); if it has not within {TIE_LOSER_WAITS * wait_s:.0f} s, it ends (exit 3)"
    )
    events.emit(
        log,
        logging.INFO,
        "resumed_tie",
        "round %d: resumed on a checkpoint trained with others, and peers it trained with are live on another "
        "state: %s, this peer's digest %s (a fork of the run, or a state behind). Peers on different states settle on the "
        "one most of them hold, then the later round, then the larger digest, as every peer computes it: %s",
        r,
        others,
        d[:8],
        what,
        peer=drv.me,
        round=r,
        digest=d,
        others=[x.peer_id for x in tie.others],
        winner_round=tie.winner[0],
        winner_digest=tie.winner[1],
        won=tie.won,
    )


def tie_lost(drv: RoundDriver, tie: Tie, waited_s: float) -> None:
    """End the run of a peer that lost a :class:`Tie` and neither re-synced to the winning state nor caught up to the
    winner within :data:`TIE_LOSER_WAITS` x ``--wait-peers-s`` (``end_run``, cause ``"tie_lost"``: exit 3)."""
    (r, d), (wr, wd) = tie.mine, tie.winner
    why = (
        f"peer(s) {', '.join(tie.holders())} live at round {wr} hold digest {wd[:8]}, which wins the tie with this "
        f"peer's state (round {r}, digest {d[:8]}: the state most peers hold, then the later round, then the larger "
        f"digest), and this peer did not re-sync or catch up to it within {waited_s:.0f} s; this peer's state is NOT "
        "the swarm's: restart it with --resume to re-sync to theirs (it trained nothing of its own)"
    )
    end_run(
        drv,
        SwarmEnded(round=r, swarm_round=max(r, wr), synced=False, why=why, cause="tie_lost"),
        winner_round=wr,
        winner_digest=wd,
        others=[x.peer_id for x in tie.others],
    )
