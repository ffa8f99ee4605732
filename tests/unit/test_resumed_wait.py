"""Fresh user 50: a swarm of three stopped (every peer Ctrl+C); p1 restarted alone with ``--resume --min-peers 3``
waited 60 s, trained round 86 ALONE ("starting with 1 of the 3 peers wanted"), ended exit 3, and p2, restarted 2 min
later on the 3-peer state, ended at once ("the swarm ended", exit 3). A peer resumed on a checkpoint others trained
with it now waits for them past ``--wait-peers-s``, saying every 30 s whom it waits for and how to go on
(``gather.held_for_swarm``); a fresh swarm and a checkpoint trained alone keep the timer's fallback."""

from __future__ import annotations

import asyncio

import torch

from geomesh_p2p.round import resync
from geomesh_p2p.telemetry import events
from tests.unit.test_round_driver import FakeClock, _digest, _peers


def _at(peer, round: int, seed: float) -> None:
    peer.theta = torch.full_like(peer.theta, seed)
    peer.round, peer.digest, peer.model = round, _digest(peer.theta), peer.theta.clone()


async def test_a_peer_resumed_on_a_swarms_checkpoint_waits_for_its_peers_instead_of_training_alone():
    me, q = _peers(2)
    _at(me, 86, 0.25)
    _at(q, 86, 0.25)
    del me.swarm.records[q.me]  # q is stopped; it comes back after 70 virtual s

    def q_comes_back(t):
        if t - 1000.0 >= 70.0 and q.me not in me.swarm.records:
            me.swarm.records[q.me] = q.record()

    clock = FakeClock(on_wait=q_comes_back)
    drv = me.driver(min_peers=3, wait_peers_s=3.0, clock=clock)
    drv._start, drv._resumed_with = (86, me.digest), (q.me,)
    with events.capture("waiting_for_resumed") as held:
        members = await asyncio.wait_for(drv.gather(set(), first=True), 10)
    # not alone: it went on once q was back (2 of the 3 wanted, after the wait: the fallback of a swarm, not alone)
    assert sorted(m.peer_id for m in members) == sorted([me.me, q.me]) and drv.ended is None
    assert [round(e["waited_s"]) // 30 for e in held] == [0, 1, 2]  # one line at ~3 s, ~33 s, ~63 s
    assert [(e["round"], e["waiting_for"], e["live"]) for e in held] == [(86, [q.me], 1)] * 3
    assert held[0]["message"] == (
        f"round 86: resumed on a checkpoint trained with 1 other peer(s) ({q.me[:8]}); still waiting for them after "
        "3 s (--min-peers 3): a resumed peer does not train alone. Live now: none. Restart them with the same flags "
        "plus --resume; to train on alone instead (a fork of the run), restart this peer with --min-peers 1"
    )


async def test_a_fresh_swarm_or_a_checkpoint_trained_alone_keeps_the_timers_fallback():
    # (start round, the checkpoint's other peers, --min-peers): a checkpoint trained alone, a fresh swarm at round 0,
    # and --min-peers 1 (asks to train on alone) start alone once --wait-peers-s ran out, as before
    for start, resumed_with, min_peers in ((86, (), 3), (0, (), 3), (86, ("other",), 1)):
        (me,) = _peers(1)
        if start:
            _at(me, start, 0.25)
        drv = me.driver(min_peers=min_peers, wait_peers_s=3.0, clock=FakeClock())
        drv._start, drv._resumed_with = (me.round, me.digest), resumed_with
        with events.capture("waiting_for_resumed") as held:
            members = await asyncio.wait_for(drv.gather(set(), first=True), 10)
        assert [m.peer_id for m in members] == [me.me] and held == [], start


def test_the_checkpoints_peers_are_the_ledgers_entry_of_the_round_that_made_it():
    from geomesh_p2p.trust.standing import Standing

    s = Standing.from_meta({"rounds": [[84, ["a", "b", "me"]], [85, ["b", "me", "a"]], [86, ["me"]]]})
    assert s.trained_with(86, "me") == ("a", "b")  # round 85 made the state of round 86
    assert s.trained_with(87, "me") == ()  # round 86 trained alone
    assert s.trained_with(90, "me") == ()  # not in the ledger


async def test_a_previous_sessions_leaving_record_at_or_behind_this_peers_round_does_not_end_the_swarm():
    me, old, new = _peers(3)
    for p in (me, old, new):
        _at(p, 86, 0.25)
    old.round, old.leaving = 85, True
    rec = old.record()
    me.swarm.records[old.me] = rec.model_copy(update={"timestamp": rec.timestamp - 600})  # last run's stop
    drv = me.driver(min_peers=3)
    del me.swarm.records[new.me]
    assert resync.swarm_ended(drv, list(me.swarm.records.values())) is None
    # a leaving record of this session still ends it, counted alone (the old one is no peer of now)
    new.leaving = True
    me.swarm.records[new.me] = new.record()
    ended = resync.swarm_ended(drv, list(me.swarm.records.values()))
    assert ended is not None and (ended.synced, ended.swarm_round) == (True, 86)
    assert ended.why.startswith("the swarm ended: every other peer (1) announced leaving, the latest at round 86")


async def test_a_resumed_peer_does_not_end_on_the_leaving_record_its_partner_left_just_before_this_start():
    """The e2e's case (restart seconds after the stop, within ``PREVIOUS_SESSION_MARGIN_S``): the partner's leaving
    record at this peer's round and digest is the stop of the run it resumes, not an end of this session's swarm;
    the peer waits on. Once that partner was read live in this session, its leaving does end the run, as before."""
    me, q = _peers(2)
    _at(me, 2, 0.25)
    _at(q, 2, 0.25)
    q.leaving = True
    me.swarm.records[q.me] = q.record()  # fresh: announced a moment ago
    drv = me.driver(min_peers=2)
    drv._start, drv._resumed_with = (2, me.digest), (q.me,)
    assert resync.swarm_ended(drv, list(me.swarm.records.values())) is None
    drv._seen_live.add(q.me)  # it came back in this session, then left
    ended = resync.swarm_ended(drv, list(me.swarm.records.values()))
    assert ended is not None and (ended.synced, ended.round, ended.swarm_round) == (True, 2, 2)
    drv2 = me.driver(min_peers=2)  # not resumed on a swarm's checkpoint: ends as before
    drv2._start = (2, me.digest)
    assert resync.swarm_ended(drv2, list(me.swarm.records.values())) is not None
