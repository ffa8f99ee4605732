"""geomesh_p2p.telemetry.events: one call logs the human line and records a structured event (issue 15)."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from geomesh_p2p.telemetry import events

pytestmark = pytest.mark.timeout(30)

log = logging.getLogger("geomesh_p2p.test_events")


def test_emit_logs_the_line_as_before_and_hands_the_event_to_captures(caplog):
    with caplog.at_level(logging.WARNING, logger=log.name), events.capture() as got, events.capture("other") as others:
        ev = events.emit(
            log,
            logging.WARNING,
            "peer_refused",
            "refusing %s: %s",
            "p1",
            "wrong run",
            peer="p1",
            reason="wrong run",
            n=3,
            ratio=float("nan"),
        )
    assert [r.getMessage() for r in caplog.records] == ["refusing p1: wrong run"]
    assert caplog.records[0].funcName == "test_emit_logs_the_line_as_before_and_hands_the_event_to_captures"
    assert got == [ev] and others == []
    assert {k: v for k, v in ev.items() if k != "t"} == {
        "event": "peer_refused",
        "level": "WARNING",
        "message": "refusing p1: wrong run",
        "peer": "p1",
        "reason": "wrong run",
        "n": 3,
        "ratio": ev["ratio"],
    }
    assert isinstance(ev["t"], float)
    # after the with, nothing is captured; an event below the log level is still recorded
    events.emit(log, logging.WARNING, "peer_refused", "late")
    assert len(got) == 1
    with caplog.at_level(logging.WARNING, logger=log.name), events.capture() as got:
        caplog.clear()
        events.emit(log, logging.DEBUG, "quiet", "not printed")
    assert caplog.records == [] and [e["event"] for e in got] == ["quiet"]


def test_the_json_sink_writes_one_line_per_event_next_to_the_round_log(tmp_path):
    log_json = tmp_path / "run" / "peer0.jsonl"
    assert events.events_path(log_json) == tmp_path / "run" / "peer0.events.jsonl"
    assert events.events_path("x/log") == events.events_path("x/log").parent / "log.events"
    assert events.open_json_sink(None) is None
    sink = events.open_json_sink(log_json)
    try:
        threads = [
            threading.Thread(target=events.emit, args=(log, logging.INFO, "tick", "tick %d", i), kwargs={"i": i})
            for i in range(20)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events.emit(log, logging.INFO, "odd", "an object", what=object(), inf=float("inf"))
    finally:
        events.close_sink(sink)
    events.emit(log, logging.INFO, "after", "not written")  # the sink is unregistered and closed
    events.close_sink(sink)  # idempotent
    lines = events.events_path(log_json).read_text().splitlines()
    parsed = [json.loads(x) for x in lines]
    assert len(lines) == 21 and not log_json.exists()  # the round log is untouched
    assert sorted(e["i"] for e in parsed if e["event"] == "tick") == list(range(20))
    odd = events.read(events.events_path(log_json), "odd")
    assert len(odd) == 1 and odd[0]["inf"] is None and odd[0]["what"].startswith("<object object")
    assert events.read(tmp_path / "missing.jsonl") == []
    # a partly written last line is skipped
    p = tmp_path / "partial.jsonl"
    p.write_text('{"event": "a"}\n{"event": "b", "x"')
    assert events.read(p) == [{"event": "a"}]


def test_a_failing_sink_does_not_fail_the_caller():
    def broken(event):
        raise OSError("disk full")

    events.add_sink(broken)
    try:
        with events.capture() as got:
            events.emit(log, logging.INFO, "still", "still recorded")
    finally:
        events.remove_sink(broken)
    events.remove_sink(broken)  # no error when absent
    assert [e["event"] for e in got] == ["still"]
