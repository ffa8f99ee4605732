"""Red team 51b of tie51 (``round/tie.py``, ``plan.agree.state_tie_winner``, ``StateSync.rejoin_state``'s same-round
break): a peer resumed with ``--min-peers`` 2 or more, held for the peers of its checkpoint, that sees peers live on
another state settles the tie by one rule; the loser re-syncs or ends (exit 3, ``tie_lost``) after 3 x
``--wait-peers-s``, the winner trains after ``--wait-peers-s``.

What holds: the same-round pull of a rogue with standing is no more than its later-round claim already gave (both
download the digest the vote backs, which the rogue computes over what it serves); a 2-2 tie moves exactly the side
with the smaller digest. Fixed here: an established peer that is NOT of the checkpoint (a rogue with standing, or a
stale honest one) on another state ended the hold -- on a larger digest it made the held peer end exit 3, on a
smaller digest or an earlier round it made it train alone after ``--wait-peers-s`` (before tie51 both waited for
the partners); a winner that left mid-wait and came back found the loser's wait already spent (it ended at once);
a partner flipping its digest every read was said in one INFO line per read.
A loser that re-synced to the winner was no longer held, and trained alone when the winner went (fixed:
``RoundDriver._rejoined_from_start``). Open here, fixed in session 52 (tests/unit/test_tie_kway.py): a 1-1-1 tie,
whose losers neither re-synced nor caught up; the re-sync of a tie lost downloaded what a fresh vote backed, not the
state the rule chose. Fakes of tests/unit/test_round_driver.py (virtual clock)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.unit.test_never_back import _node, _pid, _rec
from tests.unit.test_resumed_tie import TieBreaking, _held, _tied
from tests.unit.test_resumed_wait import _at
from tests.unit.test_round_driver import FakeClock, _peers

pytestmark = pytest.mark.timeout(60)


def _at_digest(peer, round: int, *, above: str | None = None, below: str | None = None) -> None:
    """``peer`` at ``round`` with a digest above ``above`` / below ``below`` (a rogue grinds its state the same way:
    half of all states do)."""
    for k in range(1, 200):
        _at(peer, round, k / 7.0)
        if (above is None or peer.digest > above) and (below is None or peer.digest < below):
            return
    raise AssertionError("no such digest")


async def _still_held(drv, budget_s: float = 2.0):
    """The gather's result, or "held" when it still waits after ``budget_s`` real seconds (the virtual clock runs
    hundreds of ``--wait-peers-s`` meanwhile)."""
    try:
        return await asyncio.wait_for(drv.gather(set(), first=True), budget_s)
    except asyncio.TimeoutError:
        return "held"


def _ledger(ids, rounds=46):
    ledger = Standing()
    for r in range(rounds):
        ledger.credit(r, list(ids))
    return ledger


async def test_a_rogues_same_round_pull_is_no_more_than_its_later_round_claim(monkeypatch):
    """One rogue with standing, the only other live peer of a resumed one: its made-up larger digest at the same
    round now moves the peer (before: 1-1 moved nobody); its later round moved it already (``behind``). Either way
    the download is checked against the digest the vote backs -- the rogue's, over whatever state it serves."""
    me, rogue = _pid(), _pid()
    ledger = _ledger((me, rogue))
    same = [_rec(rogue, round=46, digest="f" * 16, port=7001, attests={me: 32})]
    node, downloads = _node(me, ledger, same, monkeypatch, round=46, digest="a" * 16)
    assert node.rejoin_state(same) == (46, "f" * 16)
    await node.catch_up()
    assert downloads == [(46, "f" * 16)]  # expected_digest: what the vote backs, the rogue's own
    later = [_rec(rogue, round=47, digest="0" * 16, port=7001, attests={me: 32})]
    node2, _ = _node(me, ledger, later, monkeypatch, round=46, digest="a" * 16)
    assert node2.swarm_round(later) == 47


async def test_two_against_two_moves_exactly_the_side_with_the_smaller_digest(monkeypatch):
    a1, a2, b1, b2 = ids = [_pid() for _ in range(4)]
    ledger = {p: _ledger(ids) for p in ids}
    digest = {a1: "a" * 16, a2: "a" * 16, b1: "b" * 16, b2: "b" * 16}
    moves = {}
    for p in ids:
        view = [
            _rec(q, round=46, digest=digest[q], port=7000 + k, attests={p: 32}) for k, q in enumerate(ids) if q != p
        ]
        node, _ = _node(p, ledger[p], view, monkeypatch, round=46, digest=digest[p])
        moves[p] = node.rejoin_state(view)
    assert moves == {a1: (46, "b" * 16), a2: (46, "b" * 16), b1: None, b2: None}


async def test_an_established_rogue_on_a_larger_digest_does_not_end_a_peer_held_for_its_partner():
    """A rogue with standing here, not of the checkpoint, live at the held peer's round on a larger digest it never
    serves (the peer's re-sync to it fails: the fake's rule never moves it). Before the fix the peer lost the tie and
    ended exit 3 (``tie_lost``) after 3 x ``--wait-peers-s``, its partner about to come back; now it waits for the
    partner, as before tie51."""
    me, partner, rogue = _peers(3)
    _at(me, 86, 0.25)
    _at_digest(rogue, 86, above=me.digest)
    del me.swarm.records[partner.me]  # stopped: the user restarts it later
    drv = _held(me, rogue)
    drv._resumed_with = (partner.me,)
    assert await _still_held(drv) == "held" and drv.ended is None


async def test_an_established_peer_on_a_smaller_or_older_state_does_not_make_a_held_peer_train_alone():
    """The same rogue on a smaller digest (or a stale peer at an earlier round): before the fix the held peer "won"
    and trained alone after ``--wait-peers-s``, the fork the hold is for (fresh user 50); now it waits for its partner."""
    for round_, below in ((86, True), (85, False)):
        me, partner, other = _peers(3)
        _at(me, 86, 0.25)
        _at_digest(other, round_, below=me.digest if below else None)
        del me.swarm.records[partner.me]
        drv = _held(me, other)
        drv._resumed_with = (partner.me,)
        got = await _still_held(drv)
        assert got == "held", (round_, [m.peer_id[:8] for m in got or []])


async def test_a_winner_that_left_mid_wait_and_came_back_gives_the_loser_a_new_wait():
    """The loser saw the tie, then the winner's record went (it crashed, or restarted) for longer than 3 x
    ``--wait-peers-s``; the loser held for it meanwhile, as for any partner not running. Back, the winner waits
    ``--wait-peers-s`` and trains; before the fix the loser's bounded wait counted from the first sight and it ended
    exit 3 at the winner's return, before the catch-up it waits for."""
    winner, loser = _tied()
    drv = _held(loser, winner)
    saved = winner.record()

    def churn(t):
        dt = t - 1000.0
        if 5.0 <= dt < 20.0:  # seen at ~3 s (past the plain wait), gone from 5 s
            loser.swarm.records.pop(winner.me, None)
        elif dt >= 20.0 and winner.me not in loser.swarm.records:
            loser.swarm.records[winner.me] = saved  # back with --resume, the same state
        if dt >= 26.0 and winner.round == 86:  # it waited --wait-peers-s for the loser, then trained round 86
            winner.round = 87
            loser.swarm.records[winner.me] = winner.record()

    drv.clock = FakeClock(on_wait=churn)
    assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None  # the swarm is ahead: catch up
    assert drv.ended is None


async def test_a_three_way_tie_ends_on_one_lineage(monkeypatch):
    a, b, c = ids = [_pid() for _ in range(3)]
    digest = {a: "a" * 16, b: "b" * 16, c: "c" * 16}
    moves = {}
    for p in ids:
        view = [
            _rec(q, round=46, digest=digest[q], port=7000 + k, attests={p: 32}) for k, q in enumerate(ids) if q != p
        ]
        node, _ = _node(p, _ledger(ids), view, monkeypatch, round=46, digest=digest[p])
        moves[p] = node.rejoin_state(view)
    # the driver's side: the losers end the run (the fakes' swarm_round backs no round the others disagree on)
    x, y, z = _peers(3)
    for k, p in enumerate((x, y, z)):
        _at(p, 86, 0.25 + k)
        p.swarm.records[p.me] = p.record()
    top = max((x, y, z), key=lambda p: p.digest)
    losers = [p for p in (x, y, z) if p is not top]
    drv = losers[0].driver(min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    drv._start, drv._resumed_with = (86, losers[0].digest), tuple(p.me for p in (x, y, z) if p is not losers[0])
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drv.gather(set(), first=True), 2)
    assert moves == {a: (46, "c" * 16), b: (46, "c" * 16), c: None} and drv.ended is None


async def test_a_loser_re_synced_to_the_winner_still_waits_when_the_winner_goes():
    winner, loser = _tied(TieBreaking)
    drv = _held(loser, winner)
    assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None  # re-synced to the winner's state
    assert (loser.round, loser.digest) == (winner.round, winner.digest)
    del loser.swarm.records[winner.me]  # the winner crashed
    got = await _still_held(drv)
    assert got == "held", [m.peer_id[:8] for m in got or []]


async def test_a_partner_flipping_its_digest_is_said_a_bounded_number_of_times():
    """A partner of the checkpoint (a rogue among them) re-announcing the held peer's round with a larger, then a
    smaller digest, every read: the tie's winner flips with it; the held peer's log says each state of the tie once,
    not one line per read (and the run ends bounded, as the rule says: it trains or ends)."""
    me, rogue = _peers(2)
    _at(me, 86, 0.25)
    big, small = _peers(2)
    _at_digest(big, 86, above=me.digest)
    _at_digest(small, 86, below=me.digest)
    records = [
        big.record().model_copy(update={"peer_id": rogue.me}),
        small.record().model_copy(update={"peer_id": rogue.me}),
    ]
    flips = iter(range(10**6))

    def flip(t):
        me.swarm.records[rogue.me] = records[next(flips) % 2]

    drv = _held(me, rogue)
    drv.clock = FakeClock(on_wait=flip)
    with events.capture("resumed_tie") as said:
        got = await _still_held(drv)
    assert got != "held" and len(said) <= 2, (got, len(said))


async def test_the_re_sync_of_a_tie_lost_downloads_the_state_the_rule_chose(monkeypatch):
    me, rogue = _pid(), _pid()
    records = [_rec(rogue, round=46, digest="f" * 16, port=7001, attests={me: 32})]
    node, downloads = _node(me, _ledger((me, rogue)), records, monkeypatch, round=46, digest="a" * 16)
    target = node.rejoin_state(records)
    assert target == (46, "f" * 16)
    records[0] = _rec(rogue, round=46, digest="0" * 16, port=7001, attests={me: 32})  # swapped before the download
    await node.catch_up(target)  # the re-sync gather.rejoin makes (red team 52a: only with the target it chose)
    assert downloads == [target]
