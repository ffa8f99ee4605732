"""Red team 54b: the status view's ``silent`` rows (commit 3214312d).

A watcher now remembers every admitted record it read and lists a peer whose record is missing from a later read as
``silent`` (``SwarmWatcher._silent``, now ``_unread``), whatever the age of the record it last read; and the view's round length is the
median of the last 3 rounds' (``_round_s``), which lags a swarm that slows down. Both list live, on-schedule peers as
``silent`` -- the state README.md defines as "a peer that did not leave and whose record was not stored again for two
rounds plus 10 s (killed, hung, asleep or cut off)". Fixed: a remembered peer a read did not return shows its last
record's state (``silent`` by the same rule as any record), and the round length is at least the last round's.
"""

from __future__ import annotations

import pytest

from geomesh_p2p.status.swarm import SILENT_KEEP_S, SwarmWatcher, _state
from tests.unit.test_status_silent54 import NOW, _rec, _refresh, _states, _summary

pytestmark = pytest.mark.timeout(30)


def test_a_peer_one_read_misses_is_not_silent_while_its_record_is_fresh(monkeypatch):
    w = SwarmWatcher(object(), "run")
    a, b = _rec("a"), _rec("b")
    _refresh(w, monkeypatch, [a, b], NOW)
    # 2 s later the read returns a's record only (b's record lives on: it was stored 1 s before the last read)
    view = _refresh(w, monkeypatch, [_rec("a", age_s=-1.0)], NOW + 2.0)
    assert _states(view)["b"] == ("training", 3.0)  # its last record's state (the page showed "silent" before the fix)


def test_an_empty_read_does_not_turn_the_whole_swarm_silent(monkeypatch):
    w = SwarmWatcher(object(), "run")
    recs = [_rec(n) for n in ("a", "b", "c")]
    _refresh(w, monkeypatch, recs, NOW)
    view = _refresh(w, monkeypatch, [], NOW + 2.0)
    states = {k: s for k, (s, _) in _states(view).items()}
    assert states == {"a": "training", "b": "training", "c": "training"}  # was all "silent" before the fix


def test_a_swarm_that_slows_down_does_not_read_silent_in_its_second_slow_round():
    w = SwarmWatcher(object(), "run")
    for r, secs in ((8, 6.5), (9, 6.5), (10, 40.0)):  # load arrived in round 10; round 11 (40 s too) is under way
        w._history[r] = {"a": _summary(r, secs), "b": _summary(r, secs)}
    assert w._round_s(None) == 40.0  # the last round's (the median of the 3 alone was 6.5)
    rec = _rec("p", round=10, age_s=25.0)  # stored at round 10's end, 25 s into round 11
    assert _state(rec, None, 11, NOW, w._round_s(None)) != "silent"


def test_a_peer_restarted_with_a_new_key_leaves_one_silent_row_per_restart(monkeypatch):
    """Evidence (passes): a peer that crashes (OOM, kill -9) and is restarted with a fresh identity (no --identity
    file, or a wiped one) every 30 s leaves one ``silent`` row per crash for 15 minutes: 30 rows after 15 min, all
    counted in the page's "peers" card (status.js counts ``peers.length``). Bounded (``MAX_SILENT_KEPT``, 1024; each
    identity pays its proof of work), but the header reads "31 peers" for a swarm of 1 live one and the restarted one."""
    w = SwarmWatcher(object(), "run")
    a = _rec("a")
    t = NOW
    for i in range(30):
        t = NOW + 30.0 * i
        _refresh(w, monkeypatch, [a.model_copy(update={"timestamp": t - 1}), _rec(f"r{i:02d}", age_s=-30.0 * i + 1)], t)
    view = _refresh(w, monkeypatch, [a.model_copy(update={"timestamp": t + 1})], t + 2.0)  # 14.5 min in
    states = [s for s, _ in _states(view).values()]
    # the newest restart (r29) stored 3 s ago: its last record's state; the 29 before it are silent
    assert len(view["peers"]) == 31 and states.count("silent") == 29 and _states(view)["r29"] == ("training", 3.0)
    assert SILENT_KEEP_S == 900.0
