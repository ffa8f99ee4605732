"""Red team 54c: the status view's swarm round is taken from the "fresh" records only (commit 186f6e82,
``SwarmWatcher.refresh``), judged with ``_round_s(None)``: the plan's window left out, and 0 (so ``MIN_ROUND_S``,
6 s: a 22 s bound) while the watcher has read no round summaries yet. In a swarm of long rounds (README: a 120 s
window at gpt2-124m), whose peers store their records once a round, the one peer that stored last decides the round.

Style of tests/unit/test_status_silent54.py (no DHT, no sockets)."""

from __future__ import annotations

import pytest

from geomesh_p2p.status.swarm import SwarmWatcher
from tests.unit.test_status_silent54 import NOW, _rec, _refresh

pytestmark = pytest.mark.timeout(30)


def test_a_resumed_peer_does_not_name_the_round_of_a_swarm_of_long_rounds(monkeypatch):
    w = SwarmWatcher(object(), "run")
    # five peers at round 50 that stored their records at their last round's end, 60 s ago (120 s rounds)
    peers = [_rec(f"p{i}", round=50, age_s=60.0) for i in range(5)]
    # a peer resumed from an old checkpoint: it announced at once (no digest yet: downloading the swarm's state)
    resumed = _rec("r", round=3, age_s=1.0, digest=None)
    view = _refresh(w, monkeypatch, [*peers, resumed], NOW)
    assert view["round"] == 50, f"the view names round {view['round']} for a swarm at round 50"


def test_control_before_the_resumed_peer_the_round_is_the_swarms(monkeypatch):
    w = SwarmWatcher(object(), "run")
    peers = [_rec(f"p{i}", round=50, age_s=60.0) for i in range(5)]
    assert _refresh(w, monkeypatch, peers, NOW)["round"] == 50
