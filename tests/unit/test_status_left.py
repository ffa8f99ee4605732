"""The status view (page and ``geomesh-peer status``) shows a leaving record whose peer has gone as ``left``, not as
``leaving`` until the record expires (fresh-user report: peers that had exited were listed as leaving for minutes)."""

from __future__ import annotations

import pytest

from geomesh_p2p.status.swarm import (
    LEFT_AFTER_ROUNDS,
    LEFT_SLACK_S,
    MIN_ROUND_S,
    RoundSummary,
    SwarmWatcher,
    _state,
)
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0


def _rec(name: str, *, round: int, age_s: float, leaving: bool = False):
    return peer_record(
        name, address="127.0.0.1:1", round=round, weights_digest="d0", leaving=leaving, timestamp=NOW - age_s
    )


def _summary(round: int, round_s: float) -> RoundSummary:
    return RoundSummary(
        round=round,
        time=NOW,
        peers=2,
        leader="a",
        batch=8,
        steps=4,
        steps_planned=4,
        tokens=1000,
        compute_s=round_s / 2,
        round_s=round_s,
        straggler_s=0.0,
        network_s=0.0,
        sent=1,
        recv=1,
    )


def test_a_leaving_record_turns_left_once_not_stored_for_two_rounds():
    # no round length known: rounds count as MIN_ROUND_S (6 s): left after 2 x 6 + 10 = 22 s without a store
    limit = LEFT_AFTER_ROUNDS * MIN_ROUND_S + LEFT_SLACK_S
    assert limit == 22.0
    assert _state(_rec("p", round=5, age_s=limit - 1, leaving=True), None, 5, NOW, 0.0) == "leaving"
    assert _state(_rec("p", round=5, age_s=limit + 1, leaving=True), None, 5, NOW, 0.0) == "left"
    # 20 s rounds: 2 x 20 + 10 = 50 s
    assert _state(_rec("p", round=5, age_s=49.0, leaving=True), None, 5, NOW, 20.0) == "leaving"
    assert _state(_rec("p", round=5, age_s=51.0, leaving=True), None, 5, NOW, 20.0) == "left"
    # the swarm two rounds past the round the record names: gone, however fresh the record
    assert _state(_rec("p", round=5, age_s=0.0, leaving=True), None, 6, NOW, 20.0) == "leaving"
    assert _state(_rec("p", round=5, age_s=0.0, leaving=True), None, 7, NOW, 20.0) == "left"
    # a peer that is not leaving is never "left", however old its record (it expires on its own): "silent" past the
    # same 22 s without a store (fresh user 52)
    assert _state(_rec("p", round=5, age_s=limit - 1), None, 5, NOW, 0.0) == "training"
    assert _state(_rec("p", round=5, age_s=500.0), None, 5, NOW, 0.0) == "silent"


def test_the_view_uses_the_rounds_it_read_for_the_round_length():
    w = SwarmWatcher(object(), "run")
    peers = [
        _rec("a-live", round=9, age_s=1.0),
        _rec("b-just-left", round=9, age_s=30.0, leaving=True),
        _rec("c-gone", round=9, age_s=60.0, leaving=True),
        _rec("d-old-round", round=7, age_s=1.0, leaving=True),
    ]
    # without summaries (6 s rounds): 30 s and 60 s old leaving records are both gone
    view = w._build(NOW, peers, 0, 9, None, None)
    states = {p["peer_id"]: p["state"] for p in view["peers"]}
    assert states == {"a-live": "training", "b-just-left": "left", "c-gone": "left", "d-old-round": "left"}
    # the last rounds took 15 s (median of the reporters, the longest of the last 3 rounds): left after 40 s
    for r, secs in ((5, 90.0), (6, 15.0), (7, 12.0), (8, 15.0)):
        w._history[r] = {"a": _summary(r, secs), "b": _summary(r, secs)}
    assert w._round_s(None) == 15.0  # round 5's 90 s is older than the last 3 rounds
    view = w._build(NOW, peers, 0, 9, None, None)
    states = {p["peer_id"]: p["state"] for p in view["peers"]}
    assert states == {"a-live": "training", "b-just-left": "leaving", "c-gone": "left", "d-old-round": "left"}
    # live peers first, then the leaving and left ones, each by PeerID
    assert [p["peer_id"] for p in view["peers"]] == ["a-live", "b-just-left", "c-gone", "d-old-round"]


def test_a_peer_that_ran_another_plan_and_a_split_round_are_shown():
    """Fresh user 51: a peer refused the others' plans and trained alone for 10 rounds while the table listed all
    three as ``training`` with equal digests; now its row and the round's row say so."""
    from io import StringIO

    from rich.console import Console

    from peer.tools_cli import render_status

    w = SwarmWatcher(object(), "run")
    peers = [_rec(n, round=23, age_s=1.0) for n in ("a", "b", "c")]
    peers[2] = peers[2].model_copy(update={"unled_until": 30})
    for r, leaders in ((21, "aaa"), (22, "aac")):  # round 22: c ran its own plan, a and b a's
        w._history[r] = {n: _summary(r, 10.0).model_copy(update={"leader": ld}) for n, ld in zip("abc", leaders)}
    view = w._build(NOW, peers, 0, 23, None, None)
    got = {p["peer_id"]: (p["last_round"], p["last_leader"], p["other_plan"], p["marked_until"]) for p in view["peers"]}
    assert got == {"a": (22, "a", False, None), "b": (22, "a", False, None), "c": (22, "c", True, 30)}
    rounds = w._rounds_view()["rounds"]
    assert [(x["round"], x["leader"], x["leaders"]) for x in rounds] == [(21, "a", 1), (22, "a", 2)]
    # a mark that ended before the current round is not shown
    assert w._build(NOW, peers, 0, 31, None, None)["peers"][2]["marked_until"] is None
    buf = StringIO()
    render_status(view, {"rounds": rounds}, Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    assert "training, other plan r22, no lead to r30" in text
    assert [ln.split()[:3] for ln in text.splitlines() if ln.strip().startswith("22 ")] == [["22", "2", "2"]]
    assert "2 SPLIT" in text
