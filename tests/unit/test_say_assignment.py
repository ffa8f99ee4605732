"""The "this peer trains H inner steps" line (round/steps.say_assignment): said at the first round, then only when
the plan's window moves by more than a quarter."""

import logging
from types import SimpleNamespace

import pytest

from geomesh_p2p.round.steps import say_assignment

pytestmark = pytest.mark.timeout(30)


def test_said_at_the_first_round_then_only_when_the_window_moves_by_a_quarter(caplog):
    drv = SimpleNamespace(said_window=None)
    caplog.set_level(logging.INFO, logger="geomesh_p2p.node.peer.round")
    for rnd, window in enumerate([324.0, 330.0, 250.0, 240.0, 120.0, 150.0, 151.0]):
        say_assignment(drv, SimpleNamespace(round=rnd, window_s=window, leader="LeaderPeerId123"), 28, 8)
    lines = [r.getMessage() for r in caplog.records if "inner step(s)" in r.getMessage()]
    # against the last window said: 330 and 250 are within a quarter of 324 (81 s), 240 is not; 120 is not within
    # 60 s of 240; 150 is exactly a quarter above 120 (kept quiet), 151 is past it
    assert lines == [
        "round 0: this peer trains 28 inner step(s) of batch 8 in the plan's 324.0 s window (leader LeaderPeer)",
        "round 3: this peer trains 28 inner step(s) of batch 8 in the plan's 240.0 s window (leader LeaderPeer)",
        "round 4: this peer trains 28 inner step(s) of batch 8 in the plan's 120.0 s window (leader LeaderPeer)",
        "round 6: this peer trains 28 inner step(s) of batch 8 in the plan's 151.0 s window (leader LeaderPeer)",
    ]
    assert drv.said_window == 151.0
