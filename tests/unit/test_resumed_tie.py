"""Red team 50b's open case, fixed: two peers resumed from checkpoints of the same round with different digests (one
of them a fork), each held for the other (``gather.held_for_swarm``), waited for ever, each line asking to restart a
peer that was running. Now both settle the tie by one rule every peer computes alike (``plan.agree.state_tie_winner``:
the most holders, the later round, the larger digest): the loser re-syncs to the winner (``StateSync.rejoin_state``
breaks the same tie), the winner waits for it a bounded time, and neither line asks to restart a live peer
(round/tie.py). Fakes of tests/unit/test_round_driver.py (virtual clock, no timing)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

from geomesh_p2p.plan.agree import state_tie_winner
from geomesh_p2p.round.tie import TIE_LOSER_WAITS, resumed_tie
from geomesh_p2p.sync.download import StateSyncError
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.unit.test_never_back import _node, _pid, _rec
from tests.unit.test_resumed_wait import _at
from tests.unit.test_round_driver import FakeClock, FakePeer, _peers

pytestmark = pytest.mark.timeout(60)


class TieBreaking(FakePeer):
    """A fake whose start-up re-sync rule breaks a tie as ``StateSync.rejoin_state`` does (its own is None)."""

    def rejoin_state(self, records, among=None):
        others = [r for r in records if r.peer_id != self.me and not r.leaving and r.weights_digest]
        if len(others) != 1 or (others[0].round, others[0].weights_digest) == (self.round, self.digest):
            return None
        theirs = (others[0].round, others[0].weights_digest)
        return theirs if state_tie_winner({theirs: 1, (self.round, self.digest): 1}) == theirs else None


class Unserved(FakePeer):
    """A fake whose re-sync to a chosen state (``catch_up(target)``: a tie lost) finds nobody serving it."""

    async def catch_up(self, target=None):
        if target is None:
            return await super().catch_up()
        self.catch_ups += 1
        raise StateSyncError(f"no donor serves the state of round {target[0]}")


@contextlib.contextmanager
def _capture(*kinds: str):
    """The events of ``kinds`` emitted while the ``with`` lasts, in order."""
    with events.capture() as got:
        seen: list = []
        yield seen
    seen.extend(e for e in got if e["event"] in kinds)


def _held(me, other, *, wait_peers_s: float = 3.0):
    """``me``'s driver resumed on a checkpoint trained with ``other`` (each record announced as it is now)."""
    me.swarm.records[other.me] = other.record()
    drv = me.driver(min_peers=2, wait_peers_s=wait_peers_s, clock=FakeClock())
    drv._start, drv._resumed_with = (me.round, me.digest), (other.me,)
    return drv


def _tied(cls=FakePeer):
    """Two peers at round 86 on different digests: (winner, loser) by the rule."""
    a, b = _peers(2, cls=cls)
    _at(a, 86, 0.25)
    _at(b, 86, 0.5)
    return (a, b) if a.digest > b.digest else (b, a)


def test_the_rule_is_one_state_whatever_the_order_of_the_records():
    states = {(86, "aa"): 1, (86, "ff"): 1, (85, "zz"): 1}
    assert {state_tie_winner(dict(p)) for p in itertools.permutations(states.items())} == {(86, "ff")}
    assert state_tie_winner({(86, "ff"): 1, (86, "aa"): 2}) == (86, "aa")  # the most holders first
    assert state_tie_winner({(85, "zz"): 1, (86, "aa"): 1}) == (86, "aa")  # then the later round


async def test_both_sides_of_a_one_to_one_tie_compute_the_same_winner(monkeypatch):
    """The policy's rule (``StateSync.rejoin_state``) on each side of a 1-1 tie at round 46: exactly one side moves,
    to the other's state; the one with the larger digest stays. At an earlier round nobody moves, as before."""
    a, b = _pid(), _pid()
    ledger = {p: Standing() for p in (a, b)}
    for r in range(46):
        for p in (a, b):
            ledger[p].credit(r, [a, b])
    digests = {a: "d" + "1" * 15, b: "d" + "9" * 15}
    views = {p: [_rec(q, round=46, digest=digests[q], port=7000, attests={p: 32})] for p, q in ((a, b), (b, a))}
    moves = {}
    for p in (a, b):
        node, _ = _node(p, ledger[p], views[p], monkeypatch, round=46, digest=digests[p])
        moves[p] = node.rejoin_state(views[p])
    assert moves == {a: (46, digests[b]), b: None}
    # the driver's view of the same tie (round/tie.py) agrees on both sides
    winner, loser = _tied()
    ties = {
        p.me: resumed_tie(_held(p, q), list(p.swarm.records.values()), 0.0)
        for p, q in ((winner, loser), (loser, winner))
    }
    assert {t.winner for t in ties.values()} == {(86, winner.digest)}
    assert (ties[winner.me].won, ties[loser.me].won) == (True, False)


async def test_two_peers_resumed_on_a_tie_end_on_one_lineage_and_train_together():
    winner, loser = _tied(TieBreaking)
    d_win = winner.digest
    with _capture("rejoin_resync", "resumed_tie", "waiting_for_resumed") as seen:
        got = await asyncio.wait_for(
            asyncio.gather(
                _held(winner, loser).gather(set(), first=True), _held(loser, winner).gather(set(), first=True)
            ),
            10,
        )
    members = [sorted(m.peer_id for m in g) if g is not None else None for g in got]
    # the loser's first gather re-synced (None: it gathers again at the state it holds now); the winner's took both
    assert members[0] == sorted([winner.me, loser.me]) and members[1] is None
    assert (loser.round, loser.digest) == (winner.round, winner.digest) == (86, d_win)
    assert [(e["event"], e["peer"], e["digest"]) for e in seen] == [("rejoin_resync", loser.me, d_win)]
    assert winner.drv.ended is None and loser.drv.ended is None


async def test_the_winner_waits_a_bounded_time_for_a_loser_that_does_not_move_then_trains():
    winner, loser = _tied()  # the fake's rule never re-syncs the loser
    with _capture("resumed_tie", "waiting_for_resumed") as seen:
        members = await asyncio.wait_for(_held(winner, loser).gather(set(), first=True), 10)
    assert [m.peer_id for m in members] == [winner.me] and winner.drv.ended is None
    [tie] = seen  # one line, and no "restart them" line of a live peer
    assert (tie["event"], tie["won"], tie["others"], tie["winner_digest"]) == (
        "resumed_tie",
        True,
        [loser.me],
        winner.digest,
    )
    assert "this peer's state wins: waiting up to 3 s (--wait-peers-s)" in tie["message"]


async def test_the_loser_that_neither_re_syncs_nor_catches_up_ends_not_synced():
    """The loser's re-sync to the winner's state (tried once, at the first sight of the tie) fails: nobody serves
    it; the winner does not train on either. The loser ends exit 3 after its bounded wait."""
    winner, loser = _tied(Unserved)
    drv = _held(loser, winner)
    with _capture("resumed_tie", "waiting_for_resumed", "swarm_ended") as seen:
        assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None
    assert [e["event"] for e in seen] == ["resumed_tie", "swarm_ended"]
    assert seen[0]["won"] is False and f"the state of {winner.me[:8]} wins" in seen[0]["message"]
    assert (drv.ended.cause, drv.ended.synced, drv.ended.round) == ("tie_lost", False, 86)
    assert "restart it with --resume" in drv.ended.why and (loser.round, loser.digest) != (86, winner.digest)
    assert drv.clock.monotonic() - 1000.0 >= TIE_LOSER_WAITS * 3.0
    assert loser.catch_ups == 1  # the re-sync to the winner's state was tried, once


async def test_the_loser_catches_up_once_the_winner_trains_on():
    winner, loser = _tied(Unserved)  # its re-sync to the winner's round-86 state fails
    drv = _held(loser, winner)

    def trained_on(t):  # the winner trained round 86 after its bounded wait: its record shows round 87
        if t - 1000.0 >= 6.0 and winner.round == 86:
            winner.round = 87
            loser.swarm.records[winner.me] = winner.record()

    drv.clock = FakeClock(on_wait=trained_on)
    with _capture("resumed_tie", "swarm_ended") as seen:
        assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None  # the swarm is ahead: catch up
    assert [e["event"] for e in seen] == ["resumed_tie"] and drv.ended is None


async def test_a_live_partner_not_in_step_is_not_asked_to_be_restarted():
    me, q, gone = _peers(3)
    _at(me, 86, 0.25)
    q.round, q.syncing = 86, True  # live, syncing: not in step yet, no digest announced
    me.swarm.records[q.me] = q.record()
    del me.swarm.records[gone.me]
    drv = me.driver(min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    drv._start, drv._resumed_with = (86, me.digest), (q.me, gone.me)
    with events.capture("waiting_for_resumed") as held:
        try:
            await asyncio.wait_for(drv.gather(set(), first=True), 2)
        except asyncio.TimeoutError:
            pass
    assert held, "not held"
    said = held[0]["message"].split("Live now:")[1]
    assert f"Restart {gone.me[:8]} with the same flags plus --resume (the others are live, not in step yet)" in said
    assert q.me[:8] not in said.split("Restart")[1]
