"""A vote with no majority at start-up (tie52, red team 51b's open cases): ``StateSync.rejoin_state`` settles a
k-way tie by ``plan.agree.state_tie_winner`` over the live peers with standing here (this peer counted), the same
state on every peer; the next ``catch_up`` downloads exactly the state chosen (or a target the driver's tie gave),
from the donors it was chosen from, and no other: refused when nobody serves it, dropped only when the vote backs a
later round. The driver's lost tie (``round/tie.py``) re-syncs to the tie's winner itself (``gather.rejoin(tie)``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from geomesh_p2p.sync import download as dl
from geomesh_p2p.trust.standing import Standing
from tests.unit.test_never_back import _node, _pid, _rec
from tests.unit.test_resumed_tie import _capture
from tests.unit.test_resumed_wait import _at
from tests.unit.test_round_driver import FakeClock, _peers

pytestmark = pytest.mark.timeout(60)


def _ledger(ids, rounds=46):
    ledger = Standing()
    for r in range(rounds):
        ledger.credit(r, list(ids))
    return ledger


def _moves(states: dict, monkeypatch, ledger=None) -> dict:
    """peer -> ``rejoin_state`` of each peer holding ``states[peer]`` ((round, digest)), every other one live."""
    ids = list(states)
    out = {}
    for p in ids:
        view = [
            _rec(q, round=states[q][0], digest=states[q][1], port=7000 + k, attests={p: 32})
            for k, q in enumerate(ids)
            if q != p
        ]
        node, _ = _node(p, ledger or _ledger(ids), view, monkeypatch, round=states[p][0], digest=states[p][1])
        out[p] = node.rejoin_state(view)
    return out


async def test_a_two_two_one_split_with_no_majority_moves_everyone_to_the_larger_digest_of_the_two_pairs(
    monkeypatch,
):
    """Five peers at round 46: two on b, two on c, one on a. Nobody's standing vote has a majority (2 of 4 at
    most); each computes holders a 1, b 2, c 2 (itself counted): c, the larger digest of the two pairs."""
    a, b1, b2, c1, c2 = _pid(), _pid(), _pid(), _pid(), _pid()
    states = {a: (46, "a" * 16), b1: (46, "b" * 16), b2: (46, "b" * 16), c1: (46, "c" * 16), c2: (46, "c" * 16)}
    assert _moves(states, monkeypatch) == {
        a: (46, "c" * 16),
        b1: (46, "c" * 16),
        b2: (46, "c" * 16),
        c1: None,
        c2: None,
    }


async def test_with_no_majority_the_later_round_wins_and_the_peers_behind_move_up_to_it(monkeypatch):
    """1-1-1 across rounds (the tie's winner trained round 46 while the two losers had not re-synced): the swarm
    backs no round (no majority, ``behind`` is False), so before the fix nobody caught up; now both move to 47."""
    a, b, w = _pid(), _pid(), _pid()
    states = {a: (46, "a" * 16), b: (46, "b" * 16), w: (47, "0" * 16)}
    assert _moves(states, monkeypatch) == {a: (47, "0" * 16), b: (47, "0" * 16), w: None}


async def test_a_vote_with_no_majority_of_peers_without_standing_moves_nobody(monkeypatch):
    """The tie rule counts peers with standing here only: a ledger that knows none of them (a fresh vote) moves
    nobody, however the digests fall (fresh identities must not pull a peer off its state)."""
    a, b, c = _pid(), _pid(), _pid()
    states = {a: (46, "a" * 16), b: (46, "b" * 16), c: (46, "c" * 16)}
    ledger = Standing()
    ledger.credit(0, [_pid(), _pid()])  # knows two others, none of these
    assert _moves(states, monkeypatch, ledger=ledger) == {a: None, b: None, c: None}


async def test_the_catch_up_after_a_k_way_tie_downloads_the_winner_from_its_holder(monkeypatch):
    me, b, c = _pid(), _pid(), _pid()
    recs = [
        _rec(b, round=46, digest="b" * 16, port=7001, attests={me: 32}),
        _rec(c, round=46, digest="c" * 16, port=7002, attests={me: 32}),
    ]
    node, downloads = _node(me, _ledger((me, b, c)), recs, monkeypatch, round=46, digest="a" * 16)
    donors = []

    async def download(transport, donors_, *, round, numel, expected_digest, state_numel=None, **kw):
        downloads.append((round, expected_digest))
        donors.append(list(donors_))
        return dl.Snapshot(round, torch.zeros(2), torch.zeros(2), expected_digest)

    monkeypatch.setattr(dl, "download_state", download)
    assert node.rejoin_state(recs) == (46, "c" * 16)
    # the re-sync gather.rejoin makes (its target); without one the vote alone backs no state: it reads 8 times and
    # returns, adopting nothing (red team 52a: a choice no re-sync followed no longer pins a plain catch-up)
    await node.catch_up((46, "c" * 16))
    assert downloads == [(46, "c" * 16)] and donors == [["127.0.0.1:7002"]] and node.state.round == 46


async def test_a_chosen_state_nobody_serves_any_more_is_refused_not_replaced(monkeypatch):
    """The rogue that won the tie swaps its record and serves another state: the download of the chosen digest
    fails (the digest check), and with nobody announcing the chosen state the catch-up is refused (StateSyncError),
    the peer's own state kept; before, it downloaded what the fresh vote backed (the rogue's new state)."""
    me, rogue = _pid(), _pid()
    records = [_rec(rogue, round=46, digest="f" * 16, port=7001, attests={me: 32})]
    node, downloads = _node(me, _ledger((me, rogue)), records, monkeypatch, round=46, digest="a" * 16)

    async def mismatch(transport, donors, *, round, numel, expected_digest, state_numel=None, **kw):
        downloads.append((round, expected_digest))
        raise dl.StateSyncError("digest mismatch: the donor serves 00000000")

    monkeypatch.setattr(dl, "download_state", mismatch)
    assert node.rejoin_state(records) == (46, "f" * 16)
    records[0] = _rec(rogue, round=46, digest="0" * 16, port=7001, attests={me: 32})
    with pytest.raises(dl.StateSyncError):
        await node.catch_up((46, "f" * 16))  # the re-sync gather.rejoin makes to the state chosen
    assert downloads == [(46, "f" * 16)]
    assert (node.state.round, node.state.digest, node.syncing) == (46, "a" * 16, False)
    assert node._chosen is None  # taken


async def test_an_explicit_target_nobody_announces_is_refused_and_a_stale_choice_is_not_used(monkeypatch):
    me, other = _pid(), _pid()
    records = [_rec(other, round=46, digest="f" * 16, port=7001, attests={me: 32})]
    node, downloads = _node(me, _ledger((me, other)), records, monkeypatch, round=46, digest="a" * 16)
    with pytest.raises(dl.StateSyncError):
        await node.catch_up((46, "e" * 16))  # the driver's tie said e: nobody serves it, and f is not taken instead
    assert downloads == []
    assert node.rejoin_state(records) == (46, "f" * 16)
    node.state.digest = "d" * 16  # the state held changed since the choice: its donors are not the pin's
    records[0] = _rec(other, round=46, digest="9" * 16, port=7001, attests={me: 32})
    await node.catch_up()  # no target: what the vote backs now
    assert downloads == [(46, "9" * 16)]


async def test_a_loser_of_a_tie_re_syncs_to_the_tie_rules_state_not_the_largest():
    """The driver's side, with fakes whose start-up rule never re-syncs and whose catch-up without a target takes
    the largest state: the loser's held gather sees its partners on S (two of them) and T (one, a larger digest),
    re-syncs to S (the most holders: the tie's rule), once, and the next gather finds it in step with them."""
    probe = _peers(3)
    for k, p in enumerate(probe):
        _at(p, 86, 0.25 * (k + 1))
    small, mid, large = (0.25 * (probe.index(p) + 1) for p in sorted(probe, key=lambda p: p.digest))
    loser, s1, s2, t = _peers(4)
    for p, v in ((loser, mid), (s1, small), (s2, small), (t, large)):
        _at(p, 86, v)
        p.swarm.records[p.me] = p.record()
    assert s1.digest == s2.digest < loser.digest < t.digest
    drv = loser.driver(min_peers=2, wait_peers_s=3.0, clock=FakeClock())
    drv._start, drv._resumed_with = (86, loser.digest), (s1.me, s2.me, t.me)
    held = loser.digest
    with _capture("rejoin_resync") as seen:
        assert await asyncio.wait_for(drv.gather(set(), first=True), 10) is None
    assert (loser.round, loser.digest) == (86, s1.digest) and loser.catch_ups == 1 and drv.ended is None
    [e] = seen
    assert (e["round"], e["digest"], e["held_digest"]) == (86, s1.digest, held)
    assert "the tie with the peers it trained with goes to" in e["message"]
    members = await asyncio.wait_for(drv.gather(set(), first=True), 10)
    assert sorted(m.peer_id for m in members) == sorted([loser.me, s1.me, s2.me])
