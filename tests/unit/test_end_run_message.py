"""The line a peer logs when the swarm ended before its goal names the goal it had (fresh-user trial, session 28:
a peer started with neither --rounds nor --target-ppl said "ending without reaching the target")."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from geomesh_p2p.round.context import SwarmEnded
from geomesh_p2p.round.resync import end_run

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "rounds, target, tail",
    [
        (None, None, "ending (no --rounds or --target-ppl was set)"),
        (20, None, "ending without reaching --rounds 20"),
        (None, 150.0, "ending without reaching --target-ppl 150"),
        (20, 150.0, "ending without reaching --rounds 20 or --target-ppl 150"),
    ],
)
def test_the_swarm_ended_line_names_the_goal_this_peer_had(caplog, rounds, target, tail):
    drv = SimpleNamespace(cfg=SimpleNamespace(rounds=rounds, target_ppl=target), me="peer", ended=None)
    ended = SwarmEnded(round=7, swarm_round=7, synced=True, why="the swarm ended", cause="alone")
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        end_run(drv, ended)
    assert drv.ended is ended
    assert [r.getMessage() for r in caplog.records] == [f"round 7: the swarm ended; {tail}"]
    # it holds the swarm's last state: a normal end, INFO; a peer that does not hold it is warned
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        end_run(drv, SwarmEnded(round=7, swarm_round=9, synced=False, why="NOT the swarm's", cause="alone"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
