"""A peer that was stalled (SIGSTOP, swap, a host that slept) while the swarm went on (adversarial review
H1, H2): it must catch up to the swarm -- leaving peers' records included -- or end saying it is not
synced, never train alone on a stale state and say "done"; and what it saw while it was not running must
not be held against the owners it could not reach.

In-process tests use the round driver's fakes (tests/unit/test_round_driver.py); the last test runs OS
processes (a bootstrap and three peers, SIGSTOP / SIGCONT by PID) and is marked e2e."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.node import report
from geomesh_p2p.telemetry import events
from geomesh_p2p.round import resync
from geomesh_p2p.round.driver import STALL_VOID_SHARE
from geomesh_p2p.trust.probation import noshow_penalty_rounds
from geomesh_p2p.round.rules import OWNER_PENALTY_ROUNDS, Penalties, RoundState
from tests.rules_util import make_rules
from geomesh_p2p.sync.download import StateSyncError
from tests.unit.test_round_driver import FakeClock, _digest, _peers, _run_all

pytestmark = pytest.mark.timeout(60)


def _finished(peer, round: int, seed: float) -> None:
    """``peer`` as the swarm leaves it after its last round: at ``round`` with weights of its own
    (``seed``), announced as leaving."""
    peer.theta = torch.full_like(peer.theta, seed)
    peer.model, peer.round, peer.digest, peer.leaving = peer.theta.clone(), round, _digest(peer.theta), True
    peer.swarm.records[peer.me] = peer.record()


async def test_a_stalled_peer_catches_up_to_a_swarm_whose_peers_all_left_and_does_not_train_alone():
    stale, a, b = _peers(3)
    for p in (a, b):
        _finished(p, 5, 0.25)  # the swarm finished round 4 and announced leaving at round 5
    stale.round = 3
    drv = stale.driver(rounds=7, min_peers=2, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(), 30)
    # before the fix: behind() and gather() left the leaving peers out, so it trained rounds 3-6 alone
    assert drv.history == []
    assert stale.catch_ups == 1 and (stale.round, stale.digest) == (5, a.digest)
    assert torch.equal(stale.theta, a.theta)
    assert drv.ended is not None and drv.ended.synced is True
    assert (drv.ended.round, drv.ended.swarm_round) == (5, 5)
    assert [(e["peer"], e["cause"], e["round"], e["swarm_round"], e["synced"]) for e in ended] == [
        (stale.me, "others_left", 5, 5, True)
    ]


async def test_a_resumed_peer_behind_the_swarm_keeps_what_it_noted_before_this_session_on_catching_up():
    """Fresh-user trial, session 31: a peer resumed at round 3 while the swarm was at round 5 caught up (a state not
    of its lineage) and dropped its standing credits and penalty marks of rounds 0-2 as an unconfirmed lineage's,
    though each of those rounds was digest-checked before it stopped. The session's starting state counts as
    confirmed: only what is noted from round 3 on may go."""
    stale, a, b = _peers(3)
    for p in (a, b):
        _finished(p, 5, 0.25)
    stale.round = 3  # restored from its checkpoint
    forgot: list = []
    stale.forget_marks_since = lambda r: forgot.append(r) or []
    drv = stale.driver(rounds=7, min_peers=2, clock=FakeClock())
    await asyncio.wait_for(drv.run(), 30)
    assert stale.catch_ups == 1 and (stale.round, stale.digest) == (5, a.digest)
    assert forgot == [3]  # before: [0], every restored credit and mark


async def test_a_peer_that_cannot_catch_up_from_a_swarm_that_left_ends_not_synced():
    stale, a, b = _peers(3)
    for p in (a, b):
        _finished(p, 5, 0.25)
    stale.round = 3

    async def donors_gone():
        stale.catch_ups += 1
        raise StateSyncError("every donor refused the connection")

    stale.catch_up = donors_gone
    drv = stale.driver(rounds=7, min_peers=2, clock=FakeClock())
    await asyncio.wait_for(drv.run(), 30)
    assert drv.history == [] and stale.catch_ups == 1
    assert drv.ended is not None and drv.ended.synced is False
    assert (drv.ended.round, drv.ended.swarm_round) == (3, 5)
    assert "NOT the swarm's" in drv.ended.why


async def test_short_of_min_peers_at_a_later_round_the_peer_waits_for_the_plain_wait():
    """--min-peers holds at every round, not only the first: a live peer that has not announced the round
    yet is waited for up to wait_peers_s with one line, and the round starts when it arrives."""
    clock = FakeClock()
    p, q = _peers(2)
    p.round = q.round = 4
    q.digest = p.digest
    q.swarm.records[q.me] = q.record().model_copy(update={"round": 3})  # one round behind (still finishing)

    def arrive(t):
        if t - 1000.0 > 2.0:  # after more than the later rounds' 1 s gather wait
            q.swarm.records[q.me] = q.record()

    clock.on_wait = arrive
    drv = p.driver(min_peers=2, wait_peers_s=30.0, clock=clock)
    with events.capture("waiting_for_peers") as waiting:
        members = await asyncio.wait_for(drv.gather(set(), first=False), 10)
    assert sorted(m.peer_id for m in members) == sorted([p.me, q.me])
    assert [(e["round"], e["min_peers"], e["wait_s"]) for e in waiting] == [(4, 2, 30.0)]  # the plain wait, once


async def test_after_the_first_round_a_swarm_short_of_min_peers_but_not_alone_goes_on_without_the_long_wait():
    clock = FakeClock()
    p, q, gone = _peers(3)
    del p.swarm.records[gone.me]  # one of the three left for good
    for x in (p, q):
        x.round = 2
        x.swarm.records[x.me] = x.record()
    drv = p.driver(min_peers=3, wait_peers_s=30.0, clock=clock)
    members = await asyncio.wait_for(drv.gather({p.me, q.me}, first=False), 10)
    assert sorted(m.peer_id for m in members) == sorted([p.me, q.me])
    assert clock.t - 1000.0 < 1.0 and drv.ended is None  # no --wait-peers-s wait for the third


@pytest.mark.parametrize(
    "confirmed, seen, said",
    [
        (4, 0, "the swarm confirmed it, and where the swarm ended is unknown"),
        (3, 0, "the swarm never confirmed it"),
        (4, 5, "NOT the swarm's: the swarm was last seen at round 5"),
    ],
)
async def test_after_the_first_round_a_peer_left_with_no_live_peer_ends_instead_of_training_alone(
    confirmed, seen, said
):
    """The others' records vanished with them (seen in the H1 process run): after its first round a peer short
    of --min-peers that sees nobody else live for wait_peers_s ends, never as synced (nothing shows where the
    swarm ended); the line says whether the swarm confirmed its state."""
    (p,) = _peers(1)
    p.round = 4
    drv = p.driver(min_peers=2, wait_peers_s=30.0, clock=FakeClock())
    drv._confirmed_round, drv._swarm_seen = confirmed, seen  # seen: a catch-up to it failed, then records vanished
    with events.capture("swarm_ended") as ended:
        assert await asyncio.wait_for(drv.gather(set(), first=False), 10) is None
    assert drv.ended is not None and drv.ended.synced is False and drv.ended.round == 4
    assert [(e["peer"], e["cause"], e["round"], e["synced"], e["min_peers"]) for e in ended] == [
        (p.me, "alone", 4, False, 2)
    ]
    assert 30.0 <= ended[0]["waited_s"] < 32.0  # virtual seconds: the whole --wait-peers-s
    assert said in drv.ended.why
    # before its first round a lone peer still starts after the wait (issue 14 #10)
    drv2 = p.driver(min_peers=2, wait_peers_s=30.0, clock=FakeClock())
    assert [m.peer_id for m in await asyncio.wait_for(drv2.gather(set(), first=True), 10)] == [p.me]
    assert drv2.ended is None


async def test_a_sole_peer_that_was_the_whole_swarm_ends_holding_the_runs_state():
    """Fresh user 46: the first and only peer of a run (--min-peers 3) trained round 0 alone after the wait, then at
    round 1 ended "NOT the swarm's: the swarm never confirmed it", exit 3, though its own rounds were the run's
    whole lineage. It still does not train on alone after the first round, but ends synced and says why; a peer
    that saw another record at any read (or resumed past round 0) ends as before."""
    (p,) = _peers(1)
    drv = p.driver(min_peers=3, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(), 30)
    assert [r.round for r in drv.history] == [0]
    assert drv.ended is not None and (drv.ended.round, drv.ended.swarm_round, drv.ended.synced) == (1, 1, True)
    assert [(e["cause"], e["synced"]) for e in ended] == [("alone", True)]
    assert "this peer was the whole swarm" in drv.ended.why and "--min-peers is 1 (it is 3)" in drv.ended.why
    # another peer's record read once (it left before round 0 ended, its record gone): the old end, not synced
    q, gone = _peers(2)
    del q.swarm.records[gone.me]
    drv2 = q.driver(min_peers=3, wait_peers_s=3.0, clock=FakeClock())
    drv2.remember([gone.record()])
    await asyncio.wait_for(drv2.run(), 30)
    assert drv2.ended is not None and drv2.ended.synced is False and "NOT the swarm's" in drv2.ended.why


async def test_a_sole_peer_resumed_at_round_0_of_a_run_known_further_along_is_not_the_whole_swarm():
    """Red team 46: a peer stopped while it waited at round 0 (its final checkpoint: round 0) resumed after the run
    had reached round 15 and its peers had left (their records expired, a bootstrap remembering round 15: the join's
    "resumed behind ... a fork of the run" WARNING). Alone, it trained round 0 and ended "this peer was the whole
    swarm, so its state (round 1) is the run's", synced, exit 0: the run it forked from was 14 rounds further on.
    A round the join knew the run at (``known_round``) past this peer's keeps it from being the whole swarm."""
    (p,) = _peers(1)
    drv = p.driver(min_peers=3, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(known_round=15), 30)
    assert [r.round for r in drv.history] == [0]
    assert drv.ended is not None and (drv.ended.round, drv.ended.swarm_round, drv.ended.synced) == (1, 15, False)
    assert [(e["cause"], e["synced"]) for e in ended] == [("alone", False)]
    assert (
        "whole swarm" not in drv.ended.why and "NOT the swarm's: the swarm was last seen at round 15" in drv.ended.why
    )


async def test_a_peer_whose_last_round_is_not_the_swarms_state_does_not_end_synced():
    me, a, b = _peers(3)
    for p in (a, b):
        _finished(p, 7, 0.25)
    me.round, me.theta = 7, torch.full_like(me.theta, 0.5)
    me.digest = _digest(me.theta)
    drv = me.driver(rounds=7)
    await drv._check_end()
    assert drv.ended is not None and drv.ended.synced is False
    assert f"2 of 2 other peer(s) hold digest {a.digest[:8]}" in drv.ended.why
    _finished(me, 7, 0.25)  # the same state as the swarm's: healthy
    drv2 = me.driver(rounds=7)
    await drv2._check_end()
    assert drv2.ended is None


async def test_identities_outside_the_plan_that_made_the_state_do_not_vote_on_it_at_the_end():
    """The kind (session 30's red team, by reading): the end-of-run checks counted every record of the run, where the
    round's digest check counts the plan's participants only. Three signed identities that took no part in round 6
    announce another state at round 7: the peer still ends synced (before: "NOT the swarm's", 3 of 5 against it)."""
    me, a, b, s1, s2, s3 = _peers(6)
    for p in (me, a, b):
        _finished(p, 7, 0.25)
    for p in (s1, s2, s3):
        _finished(p, 7, 0.75)  # a state nobody of the plan holds
    plan = SimpleNamespace(
        round=6, participants=lambda: [me.me, a.me, b.me], exchange_deadline=time.time(), start_digest=None
    )
    me.standing_established = lambda records, peer_id: peer_id in (a.me, b.me)  # the Sybils never delivered here
    drv = me.driver(rounds=7)
    drv._last_plan = plan
    await drv._check_end()
    assert drv.ended is None
    # the round's own check already counted only the participants (kept so)
    assert await asyncio.wait_for(drv.check_digest(7, [me.me, a.me, b.me]), 10) is True
    # every other peer left: the swarm ended on this peer's state
    ended = resync.swarm_ended(drv, list(me.swarm.records.values()))
    assert ended is not None and (ended.synced, ended.round, ended.swarm_round) == (True, 7, 7)
    # without a plan of round 6 (nothing says who made the state) every record counts, as before
    drv2 = me.driver(rounds=7)
    await drv2._check_end()
    assert drv2.ended is not None and drv2.ended.synced is False
    assert f"3 of 5 other peer(s) hold digest {s1.digest[:8]}" in drv2.ended.why


async def test_a_fork_whose_last_plan_names_only_its_own_side_is_still_reported_at_the_end():
    """Red team (session 31) of the check above: the end-of-run checks count only the participants of this peer's
    last plan, and a lineage that forked off follows plans naming its own side only, so they agree with it by
    construction. Here this peer and ``a`` followed a round-6 plan of the two of them while ``b``, ``c`` and ``d``,
    established peers this peer trained with, went on with another state: the run must not end as if healthy
    (before the check above: "3 of 4 hold digest ..."). A peer alone in its last plan was never checked at all.
    Sybil identities (no standing here) still do not vote."""
    me, a, b, c, d, s1 = _peers(6)
    for p in (me, a):
        _finished(p, 7, 0.25)
    for p in (b, c, d):
        _finished(p, 7, 0.75)  # the swarm's state: the other side of the fork
    _finished(s1, 7, 0.5)
    established = {a.me, b.me, c.me, d.me}  # s1: an identity that never delivered here
    me.standing_established = lambda records, peer_id: peer_id in established
    for members in ([me.me, a.me], [me.me]):
        plan = SimpleNamespace(
            round=6, participants=lambda m=members: m, exchange_deadline=time.time(), start_digest=None
        )
        drv = me.driver(rounds=7)
        drv._last_plan = plan
        await drv._check_end()
        assert drv.ended is not None and drv.ended.synced is False, members
        assert f"3 of 4 other peer(s) hold digest {b.digest[:8]}" in drv.ended.why
        ended = resync.swarm_ended(drv, list(me.swarm.records.values()))
        assert ended is not None and ended.synced is False


class _FailedRound:
    """An all-reduce result in which every part had no valid result (what a peer sees after a stall)."""

    @staticmethod
    def make(delta):
        return SimpleNamespace(
            aggregate=torch.zeros_like(delta),
            contributors={},
            missing_parts=[0],
            last_compute_end=None,
            idle_ranges=lambda: [],
        )


@pytest.mark.parametrize("stall_share, blamed", [(2.0, False), (0.1, True)])
async def test_a_round_this_peer_was_stalled_through_blames_no_owner(stall_share, blamed):
    (lone,) = _peers(1)
    noted, own = [], []
    lone.after_exchange = lambda spec, plan, ar: noted.append(spec.round)
    lone.note_own_failures = lambda spec, plan, ar, stalled: own.append((spec.round, stalled))

    async def all_reduce(spec, delta, tokens, compute_end=None, *, in_place=False):
        return _FailedRound.make(delta)

    lone.all_reduce = all_reduce
    drv = lone.driver(rounds=1)
    window = {}

    def stall():
        plan = lone.last_plan
        return stall_share * (plan.exchange_deadline - plan.train_deadline)

    real_make = lone.make_plan

    def make_plan(members, leader):
        lone.last_plan = real_make(members, leader)
        window["s"] = lone.last_plan.exchange_deadline - lone.last_plan.train_deadline
        return lone.last_plan

    lone.make_plan = make_plan
    drv.loop_stall = stall
    with events.capture("stalled_round_not_blamed") as unblamed:
        await asyncio.wait_for(drv.run(), 30)
    assert window["s"] > 0 and (stall_share >= STALL_VOID_SHARE) is (not blamed)
    assert noted == ([0] if blamed else [])
    assert own == ([] if blamed else [(0, True)])  # stalled: only its own failed parts are noted (the others bar it)
    want = [] if blamed else [(lone.me, 0, pytest.approx(stall_share * window["s"]), pytest.approx(window["s"]))]
    assert [(e["peer"], e["round"], e["stalled_s"], e["window_s"]) for e in unblamed] == want
    assert drv.history[0].loop_stall_ms == pytest.approx(stall_share * window["s"] * 1e3)


async def test_penalties_of_a_lineage_abandoned_on_resync_are_dropped():
    peers = _peers(3)
    odd = peers[2]
    forgot: dict = {}
    for p in peers:
        forgot[p.me] = []
        p.forget_marks_since = (lambda who: lambda r: forgot[who].append(r) or ["x" * 10])(p.me)

    def corrupt_round_1():
        odd.corrupt_outer_step = odd.round == 1

    odd.hooks["exchange"] = corrupt_round_1
    await _run_all(peers, rounds=2)
    assert [row.digest_agree for row in odd.drv.history] == [True, False]
    assert odd.digest == peers[0].digest
    # round 0 was confirmed (round 1's start); what it noted in round 1 on its own state goes
    assert forgot == {peers[0].me: [], peers[1].me: [], odd.me: [1]}


def _Policy(me: str, round: int) -> Penalties:
    """The node's owner / no-show penalty rules of peer ``me`` at ``round``."""
    return Penalties(RoundState(me=me, round=round))


def test_a_peer_stalled_through_a_round_takes_on_the_penalties_the_others_give_it():
    """Seen in the H2 reproducer: the stalled peer, unaware the others marked it a no-show and barred its
    part, led round 5 with a plan they refused (and refused theirs: 'owns ... over the bound among 3 owners')."""
    pol = _Policy("me", 3)
    owners = [SimpleNamespace(peer_id=p) for p in ("a", "me", "b")]
    plan = SimpleNamespace(round=3, participants=lambda: ["a", "me", "b"], probation=lambda: ())
    nothing = SimpleNamespace(missing_parts=[0, 1, 2], contributors={})
    pol.note_own_failures(SimpleNamespace(round=3, owners=owners), plan, nothing, stalled=True)
    assert pol.owner == {"me": 3 + OWNER_PENALTY_ROUNDS}
    assert pol.noshow == {"me": 3 + noshow_penalty_rounds(False)}
    # not stalled and the round aggregated no token: the others conclude nothing from it, nor does it
    pol2 = _Policy("me", 3)
    pol2.note_own_failures(SimpleNamespace(round=3, owners=owners), plan, nothing)
    assert pol2.noshow == {} and pol2.owner == {}
    # not stalled, its own part 1 missing while part 0 aggregated tokens: it bars itself like the others do
    pol2b = _Policy("me", 3)
    pol2b.note_own_failures(
        SimpleNamespace(round=3, owners=owners),
        plan,
        SimpleNamespace(missing_parts=[1], contributors={0: [("a", 5), ("me", 5)], 2: [("a", 5), ("me", 5)]}),
    )
    assert pol2b.noshow == {} and pol2b.owner == {"me": 3 + OWNER_PENALTY_ROUNDS}
    # not stalled, and the others' parts show it contributed nowhere: it marks itself like they do
    pol3 = _Policy("me", 3)
    pol3.note_own_failures(
        SimpleNamespace(round=3, owners=owners),
        plan,
        SimpleNamespace(missing_parts=[], contributors={0: [("a", 5), ("b", 5)]}),
    )
    assert pol3.noshow == {"me": 3 + noshow_penalty_rounds(False)} and pol3.owner == {}


def test_forget_marks_since_drops_penalties_noted_from_that_round_on_and_keeps_older_ones():
    rules = make_rules(me="me", round=2)  # no exchange cost measured: after_exchange notes penalties only
    pol = rules.penalties
    owners = [SimpleNamespace(peer_id=p) for p in ("old-owner", "new-owner", "me")]
    pol.note_failed_owners(
        SimpleNamespace(round=2, owners=owners), SimpleNamespace(missing_parts=[0], contributors={1: [("me", 3)]})
    )
    pol.state.round = 3
    plan = SimpleNamespace(round=3, participants=lambda: ["me", "new-owner", "noshow"], probation=lambda: ())
    ar = SimpleNamespace(missing_parts=[1, 2], contributors={0: [("me", 10), ("new-owner", 10)]})
    rules.after_exchange(SimpleNamespace(round=3, owners=owners), plan, ar)
    # its own part 2 failed too: the others bar it, so it bars itself (its plans and checks agree with theirs)
    assert pol.owner == {
        "old-owner": 2 + OWNER_PENALTY_ROUNDS,
        "new-owner": 3 + OWNER_PENALTY_ROUNDS,
        "me": 3 + OWNER_PENALTY_ROUNDS,
    }
    assert set(pol.noshow) == {"noshow"}
    assert pol.forget_marks_since(3) == ["new-owner", "noshow"]
    # the bar on itself is the others' view, kept
    assert pol.owner == {"old-owner": 2 + OWNER_PENALTY_ROUNDS, "me": 3 + OWNER_PENALTY_ROUNDS}
    assert pol.noshow == {}
    assert pol.forget_marks_since(3) == []


def test_a_round_that_aggregated_no_token_marks_nobody(caplog):
    """Issue 25, 32 processes on 2 cores: round 0's parts closed below their quorum or with 0-token
    contributions; each peer marked the no-shows and failed owners its own pulls showed, the marks differed,
    and two lineages followed. A round that changed nothing concludes nothing, for anyone. Its one line names
    the parts without a result apart from those whose result aggregated 0 tokens (session 35: "0 of 3 without
    a result" read as if every part had succeeded)."""
    owners = [SimpleNamespace(peer_id=p) for p in ("a", "me", "b")]
    plan = SimpleNamespace(round=3, participants=lambda: ["a", "me", "b", "c"], probation=lambda: ())
    spec = SimpleNamespace(round=3, owners=owners, quorum_count=lambda: 2)
    zero = SimpleNamespace(missing_parts=[0, 2], contributors={1: [("a", 0), ("me", 0)]})
    rules = make_rules(me="me", round=3)
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        rules.after_exchange(spec, plan, zero)
    said = [x.getMessage() for x in caplog.records if "no part aggregated a token" in x.getMessage()]
    assert said == [
        "round 3: no part aggregated a token: 1 of 3 part(s) had a result of 0 tokens (fewer contributions counted "
        "tokens than the quorum of 2, or none did; work under a peer's token floor counts 0), 2 had no result; "
        "nobody is marked a no-show or a failed owner for it"
    ]
    assert rules.penalties.owner == {} and rules.penalties.noshows() == {} and rules.penalties.noted == {}
    # the same round with one token applied in part 1: the failed owners and the no-shows are marked
    one = SimpleNamespace(missing_parts=[0, 2], contributors={1: [("a", 1), ("me", 0)]})
    rules.after_exchange(spec, plan, one)
    assert rules.penalties.owner == {"a": 3 + OWNER_PENALTY_ROUNDS, "b": 3 + OWNER_PENALTY_ROUNDS}
    assert set(rules.penalties.noshows()) == {"b", "c"}


async def test_leaving_records_of_a_previous_session_do_not_end_a_restarted_run():
    """Fresh-user trial (session 13): every peer of a run stopped, then two were restarted with --resume; the
    first saw the other's leaving record of the previous session before its new live one, concluded "the swarm
    ended" and exited at once (and said its state was NOT the swarm's). Leaving records older than this
    process are no such sign: it waits out --wait-peers-s for the others, trains its first round as a lone
    first peer does, and then ends as a peer left alone (never "the swarm ended" from the old record)."""
    me, a = _peers(2)
    _finished(a, 5, 0.25)
    old = a.swarm.records[a.me]
    a.swarm.records[a.me] = old.model_copy(update={"timestamp": old.timestamp - 120})  # before this process
    me.theta, me.round, me.digest = a.theta.clone(), 5, a.digest  # the same state, resumed from its checkpoint
    me.model = a.theta.clone()
    drv = me.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(), 30)
    assert [e["cause"] for e in ended] == ["alone"]  # not "others_left" from the old record, at once
    assert [r.round for r in drv.history] == [5]
    # the same record announced during this session does end it, as before
    me2, b = _peers(2)
    _finished(b, 5, 0.25)
    me2.theta, me2.round, me2.digest, me2.model = b.theta.clone(), 5, b.digest, b.theta.clone()
    drv2 = me2.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended2:
        await asyncio.wait_for(drv2.run(), 30)
    assert [(e["cause"], e["synced"]) for e in ended2] == [("others_left", True)]


@pytest.mark.parametrize(
    "known, digest_of_a, synced",
    [(5, "same", True), (3, "same", True), (5, "other", False), (0, "same", False), (7, "same", False)],
)
async def test_a_peer_restarted_on_the_state_the_others_left_the_run_at_ends_holding_the_runs_state(
    known, digest_of_a, synced
):
    """Fresh user 47: a 2-peer swarm, both left at round 5 (here) on one state; one restarted alone on its own
    checkpoint of that round (the join knew the run there: ``known_round`` 5). After --wait-peers-s it trained round 5
    alone, as --min-peers says, then said nothing for another --wait-peers-s and ended "NOT the swarm's", exit 3,
    though it had taken the run up where it was and was its only lineage since. It now says what it waits for once
    and ends synced (also when the bootstrap last saw an earlier round: 3). Not when the leaving record backs another
    digest, when nothing placed the run anywhere (known 0), or when the run was known further along (7: a fork)."""
    me, a = _peers(2)
    _finished(a, 5, 0.25)
    old = a.swarm.records[a.me]
    a.swarm.records[a.me] = old.model_copy(update={"timestamp": old.timestamp - 120})  # a previous session's
    seed = 0.25 if digest_of_a == "same" else 0.5
    me.theta = torch.full_like(a.theta, seed)
    me.round, me.digest, me.model = 5, _digest(me.theta), me.theta.clone()
    drv = me.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended, events.capture("waiting_for_peers") as waiting:
        await asyncio.wait_for(drv.run(known_round=known), 30)
    assert [r.round for r in drv.history] == [5]  # the first round after the wait, alone, as before
    assert drv.ended is not None and (drv.ended.round, drv.ended.synced) == (6, synced)
    assert [(e["cause"], e["synced"]) for e in ended] == [("alone", synced)]
    if synced:
        assert drv.ended.swarm_round == 6
        assert "continued it from round 5" in drv.ended.why and "is the run's" in drv.ended.why
    else:
        assert "NOT" in drv.ended.why and "whole swarm" not in drv.ended.why
    # one line per wait: the first round's (for --min-peers), then round 6's, for one other peer, then the end
    assert [(e["round"], e.get("alone", False)) for e in waiting] == [(5, False), (6, True)]
    assert "waiting up to 3 s (--wait-peers-s) for one, then this peer ends" in waiting[1]["message"]


@pytest.mark.parametrize("i_win_the_tie", [True, False])
async def test_the_digest_check_waits_for_a_voter_still_finishing_the_round(i_win_the_tie):
    """The stalled-peer fork (docs/round.md, session 27): p1 stopped, p0 and p2 split a round and p2 announced
    its digest 3 s after p0 (a loaded host). p0's check ended after ``digest_wait_s`` (2 s) with its own vote
    alone (None: no re-sync) while p2's saw both and kept its digest on the tie's break: the fork went on, each
    trained the next round alone. Now a voter whose record still shows the round being finished is waited for
    (until the exchange deadline + ROUND_END_SLACK_S), so both judge the same two votes: exactly one re-syncs."""
    me, b = _peers(2)
    digests = [_digest(torch.full_like(me.theta, s)) for s in (0.25, 0.5)]
    mine, theirs = sorted(digests, reverse=i_win_the_tie)  # the tie breaks on the larger digest
    me.round, me.digest = 5, mine
    b.round = 4  # still finishing round 4: its record shows the round's start
    b.swarm.records[b.me] = b.record()
    clock = FakeClock()
    t0 = clock.t

    def b_announces(t):  # 3 s after this peer's check began, b commits round 4 and announces round 5
        if t - t0 >= 3.0 and b.round == 4:
            b.round, b.digest = 5, theirs
            b.swarm.records[b.me] = b.record()

    clock.on_wait = b_announces
    drv = me.driver(rounds=9, min_peers=2, clock=clock)
    drv._last_plan = SimpleNamespace(
        round=4, exchange_deadline=time.time(), start_digest=None
    )  # its exchange just ended
    verdict = await asyncio.wait_for(drv.check_digest(5, [me.me, b.me]), 10)
    assert verdict is i_win_the_tie  # before: None (b's vote came after digest_wait_s)
    # a voter that never finishes (died mid-round) is waited for only until that bound: None, as before
    me2, dead = _peers(2)
    me2.round, dead.round = 5, 4
    dead.swarm.records[dead.me] = dead.record()
    clock2 = FakeClock()
    wall0 = time.time()
    clock2.time = lambda: wall0 + (clock2.t - 1000.0)  # type: ignore[method-assign]  # virtual: exact waits
    drv2 = me2.driver(rounds=9, min_peers=2, clock=clock2)
    drv2._last_plan = SimpleNamespace(round=4, exchange_deadline=wall0, start_digest=None)
    assert await asyncio.wait_for(drv2.check_digest(5, [me2.me, dead.me]), 10) is None
    assert 5.0 <= clock2.t - 1000.0 <= 7.0  # ROUND_END_SLACK_S past the deadline (virtual seconds)


def _tie(start_loses: bool):
    """Session 28's backdoor pair b at its round-10 digest check, seen by h1: h1 and the poisoner a0 hold the start
    state S of round 9 (h1 followed a0's plan, which lost the agreement: it applied nothing), h0 and h2 advanced to
    X. Returns (h1's driver, S, X); the string order of S and X is chosen so the old tie break kept S."""
    h1, a0, h0, h2 = _peers(4)
    s, x = sorted((_digest(torch.full_like(h1.theta, v)) for v in (0.25, 0.5)), reverse=True)  # S wins on the string
    for p, d in ((h1, s), (a0, s), (h0, x), (h2, x)):
        p.round, p.digest = 10, d
        p.swarm.records[p.me] = p.record()
    drv = h1.driver(rounds=12, min_peers=2, clock=FakeClock())
    drv._last_plan = SimpleNamespace(round=9, exchange_deadline=time.time(), start_digest=s if start_loses else None)
    return h1, a0, drv, [p.me for p in (h1, a0, h0, h2)], s, x


async def test_a_peer_that_applied_nothing_loses_a_digest_tie_to_the_peers_that_advanced():
    """The kind: a tie between the round's start state (peers that applied nothing) and an advanced state kept the
    behind side on its own line when the digest string favoured it; the behind side now re-syncs (one lineage)."""
    h1, _a0, drv, voters, s, x = _tie(start_loses=True)
    with events.capture("digest_mismatch") as seen:
        verdict = await asyncio.wait_for(drv.check_digest(10, voters), 10)
    assert verdict is False  # before the fix: True (S won the 2-2 tie on the string), and h1 trained on with a0
    assert [(e["digest"], e["majority_digest"], e["agree"], e["total"], e["behind"]) for e in seen] == [
        (s, x, 2, 4, True)
    ]
    # without a plan of round 9 (nothing says which side stood still) the string decides, as before
    _h1, _a0, drv2, voters2, _s, _x = _tie(start_loses=False)
    assert await asyncio.wait_for(drv2.check_digest(10, voters2), 10) is True


async def test_an_excluded_peers_digest_vote_is_left_out_of_the_check():
    """The other half of the kind: the vote of a peer this peer excludes (verified work, a proof) made the tie. Left
    out, the tally is 1 against 2 and this peer re-syncs, whatever the tie break."""
    h1, a0, drv, voters, s, x = _tie(start_loses=False)
    h1.excluded = {a0.me}
    with events.capture("digest_mismatch") as seen:
        verdict = await asyncio.wait_for(drv.check_digest(10, voters), 10)
    assert verdict is False
    assert [(e["majority_digest"], e["agree"], e["total"]) for e in seen] == [(x, 2, 3)]


@pytest.mark.parametrize("seed_of_me", [0.25, 0.5])
async def test_a_checkpoint_past_the_state_the_others_left_is_not_claimed_the_runs(seed_of_me):
    """Red team 47b: the others left at round 4 (a previous session's record, the join knew the run there); this
    peer restarts on a checkpoint of round 5 of any lineage (a fork it trained alone before, exit 3 then: nothing
    ties its round 5 to the state of round 4 they left). ``left_before`` takes every leaving record at an earlier
    round, whatever its digest, so it claimed the whole swarm and ended synced, exit 0. Only a leaving record of its
    own round and digest (the state the others left, continued) backs that claim now."""
    me, a = _peers(2)
    _finished(a, 4, 0.25)
    old = a.swarm.records[a.me]
    a.swarm.records[a.me] = old.model_copy(update={"timestamp": old.timestamp - 120})  # a previous session's
    me.theta = torch.full_like(a.theta, seed_of_me)
    me.round, me.digest, me.model = 5, _digest(me.theta), me.theta.clone()
    drv = me.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(known_round=4), 30)
    assert drv.ended is not None and (drv.ended.round, drv.ended.synced) == (6, False)
    assert [(e["cause"], e["synced"]) for e in ended] == [("alone", False)]
    assert "NOT" in drv.ended.why


@pytest.mark.parametrize("digest_of_a", ["same", "other"])
async def test_a_restarted_peer_keeps_the_leaving_records_it_read_at_start_after_they_expire(digest_of_a):
    """Fresh user 48: both peers left at round 4; one restarted 4 s later on its checkpoint of that round, waited
    --wait-peers-s, trained round 4 alone, waited again and ended "NOT the swarm's", exit 3: the leaving records that
    back its start live ~30-40 s and had expired by the end, where they were read. What the records said as this
    session began is kept: the claim still needs one of its round and digest (not when it backs another digest)."""
    me, a = _peers(2)
    _finished(a, 4, 0.25)
    old = a.swarm.records[a.me]
    a.swarm.records[a.me] = old.model_copy(update={"timestamp": old.timestamp - 20})  # a previous session's
    me.theta = torch.full_like(a.theta, 0.25 if digest_of_a == "same" else 0.5)
    me.round, me.digest, me.model = 4, _digest(me.theta), me.theta.clone()
    read = me.peers

    async def expiring(include_leaving=False):
        if me.round > 4:  # the lone round is trained: the leaving record has expired
            me.swarm.records.pop(a.me, None)
        return await read(include_leaving)

    me.peers = expiring
    drv = me.driver(rounds=9, min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended:
        await asyncio.wait_for(drv.run(known_round=4), 30)
    assert a.me not in me.swarm.records  # the end read no leaving record
    assert [r.round for r in drv.history] == [4]
    synced = digest_of_a == "same"
    assert drv.ended is not None and (drv.ended.round, drv.ended.synced) == (5, synced)
    assert [(e["cause"], e["synced"]) for e in ended] == [("alone", synced)]
    assert ("continued it from round 4" in drv.ended.why) is synced
    # not synced, its records carry no digest from now on: a bootstrap does not keep its round 5 as the run's
    assert report.disowned(SimpleNamespace(_round_driver=drv)) is not synced


async def test_a_swarm_that_ended_is_said_without_a_wait_line_before_it():
    """Fresh user 48: after the first round, the other peers announced leaving (Ctrl+C); the last one logged "no other
    peer of the run is live ... (--min-peers 3; 1 trains on alone): waiting up to 60 s" and, in the same second, "the
    swarm ended ... exit 0": no wait came. The wait line is not said while the leaving records say the swarm ended;
    when it is said, its parenthesis reads "--min-peers 1 would train on alone"."""
    me, b = _peers(2)
    _finished(b, 5, 0.25)  # announced leaving in this session, at this peer's round and state
    me.theta, me.round, me.digest, me.model = b.theta.clone(), 5, b.digest, b.theta.clone()
    drv = me.driver(min_peers=3, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("swarm_ended") as ended, events.capture("waiting_for_peers") as waiting:
        assert await asyncio.wait_for(drv.gather(set(), first=False), 10) is None
    assert [(e["cause"], e["synced"]) for e in ended] == [("others_left", True)]
    assert waiting == []
    # left alone with no leaving record (the other vanished): the wait line, worded plainly
    (q,) = _peers(1)
    q.round = 5
    drv2 = q.driver(min_peers=3, wait_peers_s=3.0, clock=FakeClock())
    with events.capture("waiting_for_peers") as waiting2:
        assert await asyncio.wait_for(drv2.gather(set(), first=False), 10) is None
    assert [e.get("alone") for e in waiting2] == [True]
    assert "(--min-peers 3; --min-peers 1 would train on alone): waiting up to 3 s" in waiting2[0]["message"]


@pytest.mark.parametrize("n", [2, 3])
async def test_a_peer_planned_out_of_the_last_round_ends_holding_the_state_the_others_made(n):
    """The case (session 48): a peer run with ``--rounds 3`` that the leader plans out of round 2, the run's last
    (the no-part penalty a loaded machine gives an honest peer whose push came after its part closed). It must end
    as the trainers do: holding the state of round 3 (their digest), the run not ended without it (exit 0, not 3)."""
    from tests.unit.test_round_driver import PEERS, RUN
    from geomesh_p2p.round import leader_order

    peers = _peers(n)
    ids = [p.me for p in peers]
    # round 1's leader: round 2's is another (a round is never led by the last round's leader, session 30)
    out = PEERS[leader_order(RUN, 1, ids)[0]]
    trainers = [p for p in peers if p is not out]

    def plan_out_of_round_2(p):
        p.plan_only = {q.me for q in trainers} if p.round == 2 else None

    for p in peers:
        p.hooks["agree"] = lambda p=p: plan_out_of_round_2(p)
    with events.capture("planned_out") as planned_out, events.capture("swarm_ended") as ended:
        await asyncio.wait_for(asyncio.gather(*[p.driver(rounds=3, min_peers=n).run() for p in peers]), 45)
    assert [(e["peer"], e["round"], e["reason"]) for e in planned_out] == [(out.me, 2, "not_in_plan")]
    assert [row.round for row in out.drv.history] == [0, 1]
    assert all([row.round for row in p.drv.history] == [0, 1, 2] for p in trainers)
    leader = trainers[0]
    assert {p.digest for p in trainers} == {leader.digest} and {p.round for p in trainers} == {3}
    assert (out.round, out.digest) == (3, leader.digest) and torch.equal(out.theta, leader.theta)
    assert out.drv.ended is None and ended == []  # "done", exit 0 (node.report.log_swarm_ended never called)


async def test_a_peer_planned_out_of_a_last_round_that_ends_late_still_gets_its_state(monkeypatch):
    """The case as processes under load show it (session 48, "usually exits 3"): the planned-out peer's wait for the
    last round's end (the plan's exchange deadline + slack) passes while the trainers still finish it (a loaded
    machine, what planned the peer out). Its catch-up finds the state it holds backed and it announces that state
    (round 2, a digest) until its next read; a trainer whose run ended and read the records then saw nobody
    catching up to round 3 (``node.report.serve_final_state``, before: syncing records only) and exited, and the
    peer found no donor: it ended "NOT the swarm's", exit 3. Now the trainers serve it: it ends on round 3's state."""
    from geomesh_p2p.node import report
    from geomesh_p2p.round import leader_order, planning
    from tests.unit.test_round_driver import PEERS, RUN

    wait_for_round = planning.wait_for_round
    monkeypatch.setattr(planning, "wait_for_round", lambda drv, r, timeout_s: wait_for_round(drv, r, 0.2))
    peers = _peers(3)
    ids = [p.me for p in peers]
    out = PEERS[leader_order(RUN, 1, ids)[0]]
    trainers = [p for p in peers if p is not out]
    gone: set[str] = set()
    window, read = asyncio.Event(), asyncio.Event()  # out announces round 2 with a digest; a trainer read it then

    for p in peers:
        p.hooks["agree"] = lambda p=p: setattr(p, "plan_only", {q.me for q in trainers} if p.round == 2 else None)

    async def before_outer_step(r, plan, assignment, ar):
        if r == 2:  # the round ends after the planned-out peer stopped waiting for it
            await asyncio.wait_for(window.wait(), 20)

    async def catch_up(orig=out.catch_up):
        if {p.me for p in trainers} <= gone:
            out.catch_ups += 1
            raise StateSyncError("every donor refused the connection (they exited)")
        await orig()
        if out.round == 2 and not window.is_set():  # nothing adopted: its record says round 2 with a digest
            window.set()
            await asyncio.wait_for(read.wait(), 20)

    async def run_and_exit(p):
        await p.drv.run()
        if p is out:
            return
        # node.report.serve_final_state: serve the peers catching up to this round, then exit
        start, participants = report.final_plan_start(SimpleNamespace(round=p.round, _round_driver=p.drv))
        for _ in range(40):
            waiting = report.catching_up(list(p.swarm.records.values()), p.me, p.round, start, participants)
            read.set()
            if not waiting:
                break
            await asyncio.sleep(0.1)
        gone.add(p.me)

    for p in trainers:
        p.before_outer_step = before_outer_step
    out.catch_up = catch_up
    for p in peers:
        p.driver(rounds=3, min_peers=3)
        p.drv.cfg.hold_leaving_s = 1.0
    with events.capture("planned_out") as planned_out:
        await asyncio.wait_for(asyncio.gather(*[run_and_exit(p) for p in peers]), 40)
    assert window.is_set() and read.is_set()
    assert {(e["peer"], e["round"], e["reason"]) for e in planned_out} == {(out.me, 2, "not_in_plan")}
    leader = trainers[0]
    assert {p.digest for p in trainers} == {leader.digest} and {p.round for p in trainers} == {3}
    assert out.drv.ended is None, out.drv.ended.why  # before: "NOT the swarm's", exit 3
    assert (out.round, out.digest) == (3, leader.digest) and torch.equal(out.theta, leader.theta)
