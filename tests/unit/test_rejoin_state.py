"""Peers resumed at different rounds (docs/round.md, "Peers resumed at different rounds"): the state a start-up
gather re-syncs to at once (``StateSync.rejoin_state``): the live others' standing vote backs a state at this
peer's round or an earlier one, more of them hold it than hold this peer's, and going back is the only way to
rejoin them. A fresh-user trial, session 37: a swarm stopped at once resumed at rounds 46, 46 and 47 (a round
the third peer trained alone); each side waited the whole --min-peers wait for the other, then they forked."""

from __future__ import annotations

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from tests.unit.test_never_back import _node, _pid, _rec

pytestmark = pytest.mark.timeout(30)


def _ledger(me: str, peers: list[str], rounds: int) -> Standing:
    """A ledger that saw ``peers`` and ``me`` deliver rounds ``0 .. rounds - 1`` together."""
    ledger = Standing()
    for r in range(rounds):
        ledger.credit(r, [*peers, me])
    return ledger


async def test_the_peer_ahead_alone_rejoins_the_two_behind_and_says_what_it_discards(monkeypatch):
    a, b, me = _pid(), _pid(), _pid()
    everyone = (a, b, me)
    # the two behind attest each other and this peer alike: neither would adopt this peer's state
    behind = [
        _rec(p, round=46, digest="r46", port=7000 + k, attests={q: 32 for q in everyone if q != p})
        for k, p in enumerate((a, b))
    ]
    node, downloads = _node(me, _ledger(me, [a, b], 46), behind, monkeypatch, round=47, digest="r47")
    assert node.rejoin_state(behind) == (46, "r46")
    with events.capture("older_state_adopted") as adopted:
        await node.catch_up()
    assert downloads == [(46, "r46")] and (node.state.round, node.state.digest) == (46, "r46")
    [e] = adopted
    assert (e["level"], e["held_round"], e["round"], e["discarded_rounds"]) == ("WARNING", 47, 46, [46])
    assert "discarded: this peer's 1 round(s) since that state (round 46)" in e["message"]


async def test_one_peer_behind_moves_nobody_and_one_peer_ahead_moves_nobody(monkeypatch):
    """1 against 1 is no majority: the peer ahead waits for more peers (as before); and the two in step never
    move to the one peer ahead, whatever it claims (an open swarm: one record pushes no state on the others)."""
    a, b, me = _pid(), _pid(), _pid()
    one = [_rec(a, round=46, digest="r46", port=7000, attests={me: 32})]
    node, _ = _node(me, _ledger(me, [a, b], 46), one, monkeypatch, round=47, digest="r47")
    assert node.rejoin_state(one) is None
    # the majority side: this peer and b at round 46, a alone at round 47 (its own lineage)
    view = [
        _rec(a, round=47, digest="r47", port=7000, attests={b: 32, me: 32}),
        _rec(b, round=46, digest="r46", port=7001, attests={a: 32, me: 32}),
    ]
    node, _ = _node(me, _ledger(me, [a, b], 46), view, monkeypatch, round=46, digest="r46")
    assert node.rejoin_state(view) is None
    assert node.swarm_round(view) is None  # and no later round is backed either: behind() stays False


async def test_leaving_records_and_a_backer_that_would_follow_this_peer_keep_its_state(monkeypatch):
    a, b, c, me = _pid(), _pid(), _pid(), _pid()
    left = [
        _rec(p, round=46, digest="r46", port=7000 + k, attests={me: 32}, leaving=True) for k, p in enumerate((a, b))
    ]
    node, _ = _node(me, _ledger(me, [a, b], 46), left, monkeypatch, round=47, digest="r47")
    assert node.rejoin_state(left) is None  # a previous session's records: nobody to rejoin
    # both backers weigh this peer above each other: each would adopt its state (the peers behind come up)
    follow = [
        _rec(p, round=46, digest="r46", port=7000 + k, attests={me: 32, c: 1, **{q: 1 for q in (a, b) if q != p}})
        for k, p in enumerate((a, b))
    ]
    node, _ = _node(me, _ledger(me, [a, b], 46), follow, monkeypatch, round=47, digest="r47")
    assert node.rejoin_state(follow) is None
    # a live peer at this peer's round (another digest) or later: newer donors, no going back
    newer = follow[:1] + [_rec(b, round=46, digest="r46", port=7001)] + [_rec(c, round=47, digest="x", port=7002)]
    node, _ = _node(me, _ledger(me, [a, b, c], 46), newer, monkeypatch, round=47, digest="r47")
    assert node.rejoin_state(newer) is None


async def test_at_the_same_round_the_minority_digest_rejoins_the_majority(monkeypatch):
    a, b, me = _pid(), _pid(), _pid()
    view = [_rec(p, round=46, digest="r46", port=7000 + k, attests={me: 32}) for k, p in enumerate((a, b))]
    node, _ = _node(me, _ledger(me, [a, b], 46), view, monkeypatch, round=46, digest="fork")
    assert node.rejoin_state(view) == (46, "r46")
    node.syncing = True  # a catch-up under way: nothing to decide
    assert node.rejoin_state(view) is None
    # a ledger that knows none of them (a vote of addresses): fresh identities pull nobody off its state
    node, _ = _node(me, Standing(), view, monkeypatch, round=46, digest="fork")
    assert node.state_vote(view).choice.mode == "fresh" and node.rejoin_state(view) is None
