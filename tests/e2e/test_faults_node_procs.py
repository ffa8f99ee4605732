"""The process-level tests of ``tests/unit/test_faults_node.py`` (they start OS processes)."""

from __future__ import annotations

import os
import re
import pytest
from tests.unit.test_faults_node import FAKETIME_LIB, _digests, _start_entry  # noqa: F401


@pytest.mark.timeout(420)
def test_peer_advertising_an_unreachable_host_trains_client_only_without_a_fork(swarm):
    """--advertise-host 127.0.0.9 (nothing listens there): the peer warns once, owns no part (its record
    names no address), both peers train the same rounds with equal digests (no fork into 1-peer runs)."""
    names = ["p0", "bad"]
    entry = _start_entry(swarm, "p0", "--rounds", "3", "--min-peers", "2")
    swarm.peer("bad", "--rounds", "3", "--min-peers", "2", "--advertise-host", "127.0.0.9", bootstrap=entry)
    assert swarm.wait_exit(names, 360) == {"p0": 0, "bad": 0}
    text = swarm.text("bad")
    assert text.count("nobody can dial this node at 127.0.0.9:") == 1, text[-3000:]
    assert "continuing as a client-only node that owns no part" in text
    # no fork: both in every round's plan, or one planned out of a round by the no-part penalty of a push the load
    # made late (it re-syncs); a 1-peer run of its own has a row of peers 1 beside the other's row, and fails here
    assert swarm.plan_problems(names, range(3)) == [], {n: swarm.rows(n) for n in names}
    assert any(x["peers"] == 2 for x in swarm.rows("bad")), swarm.rows("bad")  # it trained with p0
    for r in range(3):
        d = {n: x["digest"] for n in names for x in swarm.rows(n) if x["round"] == r}
        assert len(set(d.values())) == 1, f"round {r}: {d}"


@pytest.mark.timeout(420)
def test_newcomer_of_a_run_whose_peers_left_waits_or_resumes(swarm, tmp_path):
    """The bootstrap saw the run at round N > 0, its only peer left: a newcomer says so and waits (Ctrl+C
    ends it cleanly, no checkpoint of the seed is written), or resumes from a checkpoint when told to."""
    swarm.bootstrap("boot", "--status-interval", "0.5", "--state-file", "")
    entry = swarm.address("boot")
    ck = tmp_path / "ck"
    swarm.peer("first", "--rounds", "2", "--checkpoint-dir", str(ck), bootstrap=entry)
    assert swarm.wait_exit(["first"], 300) == {"first": 0}
    assert [x["round"] for x in swarm.rows("first")] == [0, 1]

    def empty_swarm(name: str) -> list[tuple]:
        return [(e["run_id"], e["round"] >= 1, e["peers"], e["action"]) for e in swarm.events(name, "empty_swarm")]

    swarm.peer("waiter", "--checkpoint-dir", str(tmp_path / "ck_waiter"), bootstrap=entry)
    swarm.wait_for(lambda: swarm.events("waiter", "empty_swarm_waiting"), 180, "the waiting line")
    swarm.interrupt("waiter")
    assert swarm.wait_exit(["waiter"], 60) == {"waiter": 0}
    text = swarm.text("waiter")
    assert empty_swarm("waiter") == [("test-swarm", True, 1, "wait")], text[-3000:]
    assert len(swarm.events("waiter", "empty_swarm_waiting")) == 1  # one line for the whole wait
    assert "Traceback" not in text and not list((tmp_path / "ck_waiter").glob("ckpt-*"))
    assert swarm.rows("waiter") == []

    swarm.peer("resumer", "--rounds", "3", "--on-empty-swarm", "resume", "--checkpoint-dir", str(ck), bootstrap=entry)
    assert swarm.wait_exit(["resumer"], 300) == {"resumer": 0}
    text = swarm.text("resumer")
    assert empty_swarm("resumer") == [("test-swarm", True, 1, "resume")], text[-3000:]
    assert [e["round"] for e in swarm.events("resumer", "resumed_from_checkpoint")] == [2], text[-3000:]
    assert [x["round"] for x in swarm.rows("resumer")] == [2]


@pytest.mark.timeout(480)
def test_peer_with_a_clock_30s_ahead_trains_with_the_swarm(swarm, monkeypatch):
    """FAKETIME=+30s moves the whole process's wall clock: plans' deadlines, expiries and contribution
    times are all in swarm time, so the skewed peer trains (> 0 inner steps) and its digests equal the others'."""
    if not os.path.exists(FAKETIME_LIB):
        pytest.skip(f"libfaketime is not installed ({FAKETIME_LIB}; apt-get install libfaketime)")
    names = ["p0", "p1", "skewed"]
    args = ("--rounds", "3", "--min-peers", "3")
    entry = _start_entry(swarm, "p0", *args)
    swarm.peer("p1", *args, bootstrap=entry)
    monkeypatch.setenv("LD_PRELOAD", FAKETIME_LIB)
    monkeypatch.setenv("FAKETIME", "+30s")
    monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    monkeypatch.setenv("FAKETIME_NO_CACHE", "1")
    # full speed: the speed factor's time.sleep fails under libfaketime with the monotonic clock left alone
    # (Python's sleep is a clock_nanosleep on CLOCK_MONOTONIC, which libfaketime then refuses: EINVAL)
    swarm.peer("skewed", *args, "--speed-factor", "1", bootstrap=entry)
    monkeypatch.delenv("LD_PRELOAD")
    codes = swarm.wait_exit(names, 420)
    assert codes["skewed"] == 0, swarm.text("skewed")[-3000:]
    for n in ("p0", "p1"):
        # Under load (a CI host at load ~10) the exclusion rule may plan a slow unskewed peer out of the last
        # rounds; once the others have exited at --rounds it cannot download their last state and says so with
        # exit 3 (EXIT_NOT_SYNCED). Not the fault this test is about; any other exit is.
        late = codes[n] == 3 and "not in the plan of leader" in swarm.text(n)
        assert codes[n] == 0 or late, (n, codes[n], swarm.text(n)[-3000:])
    assert re.search(r"clock offset to the bootstrap\(s\): -(29|30)\.\d s", swarm.text("skewed")), swarm.text("skewed")
    # Round 0 waits for all three (--min-peers 3): the skewed peer is in it, trains and agrees.
    d = _digests(swarm, names, 0)
    assert None not in d.values() and len(set(d.values())) == 1, f"round 0: {d}"
    rows = swarm.rows("skewed")
    assert rows[0]["peers"] == 3 and rows[0]["inner_steps_done"] > 0, rows[0]
    # Never a run of its own (the fault: peers=1, its own digest); later rounds may plan a peer out
    # under load, so each of its rows is checked against the rows the others wrote for that round.
    assert [x["round"] for x in rows] == [0, 1, 2] and all(x["peers"] >= 2 for x in rows), rows
    for x in rows[:-1]:  # not the last: a peer late for it (load) can miss parts the leaving others never serve again
        others = {v for v in _digests(swarm, ["p0", "p1"], x["round"]).values() if v}
        assert others == {x["digest"]}, (x["round"], others, x["digest"])
