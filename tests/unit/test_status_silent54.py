"""A peer that died (or hangs, or sleeps) stays on the status view as ``silent`` (fresh user 54: a SIGKILLed peer read
``training``, then ``behind``, then vanished from the page and from ``geomesh-peer status`` ~30 s after the kill, when
its record expired; a peer frozen 46 s left no trace at all)."""

from __future__ import annotations

import asyncio

import pytest

import geomesh_p2p.status.swarm as swarm
from geomesh_p2p.status.swarm import SILENT_KEEP_S, RoundSummary, SwarmWatcher, _state
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0


def _rec(name: str, *, round: int = 9, age_s: float = 1.0, leaving: bool = False, digest: str = "d0"):
    return peer_record(
        name, address="127.0.0.1:1", round=round, weights_digest=digest, leaving=leaving, timestamp=NOW - age_s
    )


def _summary(round: int, round_s: float) -> RoundSummary:
    return RoundSummary(
        round=round, time=NOW, peers=3, leader="a", batch=8, steps=4, steps_planned=4, tokens=1000,
        compute_s=round_s / 2, round_s=round_s, straggler_s=0.0, network_s=0.0, sent=1, recv=1,
    )  # fmt: skip


def _refresh(w: SwarmWatcher, monkeypatch, recs, now: float) -> dict:
    """One :meth:`SwarmWatcher.refresh` at swarm time ``now`` reading ``recs`` (no plans, no summaries)."""

    async def live(node, run_id, **kw):
        return list(recs)

    async def nothing(key):
        return {}

    monkeypatch.setattr(swarm, "live_peers", live)
    monkeypatch.setattr(swarm, "swarm_time", lambda: now)
    monkeypatch.setattr(w, "_get", nothing)
    monkeypatch.setattr(w, "_admitted", lambda rs: (list(rs), 0))  # admission has tests of its own
    return asyncio.run(w.refresh())


def _states(view) -> dict:
    return {p["peer_id"]: (p["state"], p["last_seen_s"]) for p in view["peers"]}


def test_a_peer_whose_record_expired_without_leaving_stays_listed_as_silent(monkeypatch):
    w = SwarmWatcher(object(), "run")
    a, b, c = _rec("a"), _rec("b", digest="d1"), _rec("c", leaving=True)
    view = _refresh(w, monkeypatch, [a, b, c], NOW)
    assert {k: s for k, (s, _) in _states(view).items()} == {"a": "training", "b": "training", "c": "leaving"}
    assert view["digests"]["total"] == 3
    # b's and c's records expired (b was killed, c left): b is silent, with its last store's age; c is gone
    a = _rec("a", age_s=-39.0)  # a stores its record again: 1 s old
    view = _refresh(w, monkeypatch, [a], NOW + 40.0)
    assert _states(view) == {"a": ("training", 1.0), "b": ("silent", 41.0)}
    assert [p["peer_id"] for p in view["peers"]] == ["a", "b"]  # live first
    # counted in nothing else: the round and the digests are the live peers'
    assert view["round"] == 9 and view["digests"]["total"] == 1 and view["digests"]["equal"] is True
    # kept until SILENT_KEEP_S after its last store, then dropped
    assert _states(_refresh(w, monkeypatch, [a], NOW + SILENT_KEEP_S - 1.0))["b"] == ("silent", SILENT_KEEP_S)
    assert "b" not in _states(_refresh(w, monkeypatch, [a], NOW + SILENT_KEEP_S + 2.0))


def test_a_silent_peer_that_comes_back_reads_its_new_record(monkeypatch):
    w = SwarmWatcher(object(), "run")
    a, b = _rec("a"), _rec("b")
    _refresh(w, monkeypatch, [a, b], NOW)
    assert _states(_refresh(w, monkeypatch, [a], NOW + 60.0))["b"][0] == "silent"
    back = _rec("b", round=12, age_s=-60.0)  # stored at NOW + 60 (resumed, downloaded the swarm's state)
    a2 = _rec("a", round=12, age_s=-60.0)
    assert _states(_refresh(w, monkeypatch, [a2, back], NOW + 61.0)) == {"a": ("training", 1.0), "b": ("training", 1.0)}
    # and it leaves cleanly: not kept once its leaving record expired
    _refresh(w, monkeypatch, [a2, back.model_copy(update={"leaving": True})], NOW + 62.0)
    assert set(_states(_refresh(w, monkeypatch, [a2], NOW + 120.0))) == {"a"}


def test_the_watcher_keeps_a_bounded_number_of_silent_peers(monkeypatch):
    monkeypatch.setattr(swarm, "MAX_SILENT_KEPT", 3)
    w = SwarmWatcher(object(), "run")
    many = [_rec(f"p{i:02d}", age_s=1.0 - i) for i in range(6)]  # p05 stored last
    _refresh(w, monkeypatch, many, NOW + 6.0)
    view = _refresh(w, monkeypatch, [many[0]], NOW + 30.0)
    assert [p["peer_id"] for p in view["peers"]] == ["p00", "p03", "p04", "p05"]
    assert len(w._seen) == 4


def test_one_long_round_does_not_put_silent_past_the_records_lifetime():
    # rounds of 6.5 s, one of 24 s (the round after the death waited for the dead owner's part): the view's round
    # length is the median, 6.5 s, so silent from 2 x 6.5 + 10 = 23 s, inside the record's ~4 rounds (30 s); with
    # the longest round (24 s) it read "training" / "behind" until 58 s, and the record was gone at ~30 s
    w = SwarmWatcher(object(), "run")
    for r, secs in ((6, 6.5), (7, 24.0), (8, 6.5)):
        w._history[r] = {"a": _summary(r, secs), "b": _summary(r, secs)}
    assert w._round_s(None) == 6.5
    assert _state(_rec("p", round=8, age_s=22.0), None, 9, NOW, w._round_s(None)) == "training"
    assert _state(_rec("p", round=8, age_s=24.0), None, 9, NOW, w._round_s(None)) == "silent"


def test_the_swarms_round_is_not_a_dead_peers(monkeypatch):
    """Fresh user 54b: after the last live peer announced leaving (round 5), the table's round went back to 4 and named
    the peer killed 2 minutes earlier (its record, alive until it expired) as the leader."""
    w = SwarmWatcher(object(), "run")
    dead = _rec("dead", round=4, age_s=140.0)  # not stored for 140 s: silent (2 x 6 s + 10 s)
    survivor = _rec("live", round=5, age_s=1.0, leaving=True)
    view = _refresh(w, monkeypatch, [dead, survivor], NOW)
    assert view["round"] == 5 and _states(view)["dead"][0] == "silent"
    # while nobody else is left: the dead peer's round is all there is
    assert _refresh(SwarmWatcher(object(), "run"), monkeypatch, [dead], NOW)["round"] == 4
