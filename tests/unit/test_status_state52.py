"""Fresh user 52: the status views must say what each peer announces it does. A peer waiting for ``--min-peers``, one
catching up and one refusing every plan were all listed ``training``; a SIGKILLed peer read ``training`` for ~40 s,
then ``behind``; and the header read ``peers 4`` after all four had left."""

from __future__ import annotations

from io import StringIO

import pytest
from rich.console import Console

from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.status.swarm import SwarmWatcher, _state
from peer.tools_cli import _peer_count, render_status
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0


def _rec(name: str, *, round: int = 9, age_s: float = 1.0, **fields) -> PeerRecord:
    fields.setdefault("weights_digest", "d0")
    return peer_record(name, address="127.0.0.1:1", round=round, timestamp=NOW - age_s, **fields)


@pytest.mark.parametrize(
    "fields, want",
    [
        ({"activity": "waiting"}, "waiting"),  # p1c: "waiting for 3 peers", no plan of this round
        ({"activity": "syncing"}, "syncing"),  # p3: catching up by outer updates (its digest announced)
        ({"activity": "no plan"}, "no plan"),  # p1b: no plan it accepts appeared
        # refusing or planned out: no digest while it waits for the round's end, yet not downloading
        ({"activity": "refusing plans", "weights_digest": None}, "refusing plans"),
        ({"activity": "sitting out", "weights_digest": None}, "sitting out"),
        ({"activity": "training"}, "training"),
        ({"activity": "training", "weights_digest": None}, "syncing"),  # no digest: downloading, whatever it said
        ({"activity": "waiting", "round": 6}, "behind"),  # three rounds behind the swarm's round 9
        ({"activity": "some newer word"}, "some newer word"),  # a newer release's word, as announced
        ({"activity": "\x1b[31mred"}, "\ufffd[31mred"),  # cleaned like every record string
        ({}, "training"),  # an older release's record: as before
    ],
)
def test_the_state_is_what_the_record_announces(fields, want):
    assert _state(_rec("p", **fields), None, 9, NOW, 10.0) == want


def test_a_record_without_activity_keeps_the_plan_rule():
    assert _state(_rec("p"), {"q"}, 9, NOW, 10.0) == "waiting"
    assert _state(_rec("p"), {"p"}, 9, NOW, 10.0) == "training"
    # a record that says what it does is not overruled by the plan
    assert _state(_rec("p", activity="training"), {"q"}, 9, NOW, 10.0) == "training"


def test_a_record_not_stored_for_two_rounds_and_10_s_is_silent():
    # 12 s rounds: 2 x 12 + 10 = 34 s (the SIGKILLed p4 read "training" at 39.8 s, then "behind" at 52-84 s)
    assert _state(_rec("p", age_s=33.0), None, 9, NOW, 12.0) == "training"
    assert _state(_rec("p", age_s=35.0), None, 9, NOW, 12.0) == "silent"
    assert _state(_rec("p", round=7, age_s=52.0), None, 9, NOW, 12.0) == "silent"  # not "behind"
    assert _state(_rec("p", age_s=35.0, activity="waiting"), None, 9, NOW, 12.0) == "silent"
    # a leaving record that old is "left", as before
    assert _state(_rec("p", age_s=35.0, leaving=True), None, 9, NOW, 12.0) == "left"


def test_peer_count_says_the_states_unless_all_train():
    assert _peer_count([]) == "0"
    assert _peer_count([{"state": "training"}] * 3) == "3"
    assert _peer_count([{"state": "left"}] * 4) == "4 (4 left)"
    assert _peer_count([{"state": "waiting"}]) == "1 (1 waiting)"
    assert _peer_count([{"state": "training"}] * 3 + [{"state": "silent"}]) == "4 (3 training, 1 silent)"


def test_the_table_shows_each_announced_state():
    w = SwarmWatcher(object(), "R")
    peers = [
        _rec("a-train", activity="training"),
        _rec("b-wait", activity="waiting"),
        _rec("c-refuse", activity="refusing plans", weights_digest=None, unled_until=40),
        _rec("d-killed", age_s=60.0, activity="training"),
    ]
    view = w._build(NOW, peers, 0, 9, None, None)
    assert [(p["peer_id"], p["state"]) for p in view["peers"]] == [
        ("a-train", "training"),
        ("b-wait", "waiting"),
        ("c-refuse", "refusing plans"),
        ("d-killed", "silent"),  # listed after the live ones
    ]
    buf = StringIO()
    render_status(view, {"rounds": []}, Console(file=buf, width=160, color_system=None))
    lines = buf.getvalue().splitlines()
    assert lines[0] == (
        "run R  round 9  leader b-wait  peers 4 (1 training, 1 waiting, 1 refusing plans, 1 silent)  digests equal (3/3)"
    )
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert "  refusing plans, no lead to r40  " in rows["c-refuse"]
    assert rows["d-killed"].rstrip() == (
        "d-killed  cpu        1.00     1,000       80.0         80.0      9  silent                                -       60 s"
    )
    assert "  waiting  " in rows["b-wait"] and "  training  " in rows["a-train"]


def test_the_header_counts_the_left_ones_when_all_left():
    w = SwarmWatcher(object(), "R")
    peers = [_rec(n, age_s=50.0, leaving=True) for n in ("a", "b", "c", "d")]
    view = w._build(NOW, peers, 0, 9, None, None)
    buf = StringIO()
    render_status(view, {"rounds": []}, Console(file=buf, width=160, color_system=None))
    assert buf.getvalue().splitlines()[0].startswith("run R  round 9  leader -  peers 4 (4 left)  digests ")
