"""geomesh_p2p.telemetry.logonce.LogOnce: once per key, bounded LRU, events passed through."""

import logging

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.telemetry.logonce import LogOnce, LogOnChange

log = logging.getLogger("test.logonce")


def _lines(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.logonce"]


def test_each_key_logs_once_at_its_level(caplog):
    once = LogOnce(log)
    with caplog.at_level(logging.DEBUG, logger="test.logonce"):
        assert once(("p1", "bad"), logging.WARNING, "refused %s: %s", "p1", "bad") is True
        assert once(("p1", "bad"), logging.WARNING, "refused %s: %s", "p1", "bad") is False
        assert once(("p2", "bad"), logging.INFO, "refused %s: %s", "p2", "bad") is True
    assert _lines(caplog) == [(logging.WARNING, "refused p1: bad"), (logging.INFO, "refused p2: bad")]
    assert len(once) == 2


def test_record_names_the_call_site(caplog):
    once = LogOnce(log)
    with caplog.at_level(logging.DEBUG, logger="test.logonce"):
        once("k", logging.WARNING, "x")
    assert [r.funcName for r in caplog.records] == ["test_record_names_the_call_site"]


def test_capacity_bounds_memory_least_recently_seen_forgotten(caplog):
    once = LogOnce(log, capacity=2)
    with caplog.at_level(logging.DEBUG, logger="test.logonce"):
        once("a", logging.INFO, "a")
        once("b", logging.INFO, "b")
        once("a", logging.INFO, "a")  # repeat: refreshes "a", so "b" is now the oldest
        once("c", logging.INFO, "c")  # evicts "b"
        assert len(once) == 2
        once("a", logging.INFO, "a")  # still remembered
        once("b", logging.INFO, "b")  # forgotten: logs again
    assert [m for _, m in _lines(caplog)] == ["a", "b", "c", "b"]


def test_event_passed_through_once():
    once = LogOnce(log)
    with events.capture() as got:
        for _ in range(2):  # the same key twice: one event
            once(
                ("p", "why"),
                logging.DEBUG,
                "ignoring %s: %s",
                "p",
                "why",
                event="record_not_admitted",
                peer="p",
                reason="why",
            )
    assert [(e["event"], e["level"], e["message"], e["peer"], e["reason"]) for e in got] == [
        ("record_not_admitted", "DEBUG", "ignoring p: why", "p", "why")
    ]


def test_fields_without_event_and_bad_capacity_are_refused():
    with pytest.raises(ValueError):
        LogOnce(log, capacity=0)
    with pytest.raises(TypeError):
        LogOnce(log)("k", logging.INFO, "m", peer="p")


def test_record_of_an_event_names_the_call_site_not_logonce(caplog):
    once = LogOnce(log)
    with caplog.at_level(logging.DEBUG, logger="test.logonce"), events.capture("record_not_admitted") as got:
        once("k", logging.WARNING, "refused %s", "p", event="record_not_admitted", peer="p")
    assert [(r.funcName, r.pathname) for r in caplog.records] == [
        ("test_record_of_an_event_names_the_call_site_not_logonce", __file__)
    ]
    assert [e["peer"] for e in got] == ["p"]


def test_log_on_change_warns_per_change_of_state_and_once_when_it_works_again(caplog):
    """Issue 29 #7: a resource failing the same way at every try is one WARNING, not one per try."""
    lc = LogOnChange(log)
    with caplog.at_level(logging.DEBUG, logger="test.logonce"), events.capture("disk") as got:
        assert lc.recovered("fine") is False  # it never failed: nothing to say
        for _ in range(3):
            lc.failed(("OSError", 28), "full %s", "/ckpt", event="disk")
        lc.failed(("OSError", 30), "read-only %s", "/ckpt", event="disk")  # another failure: a new WARNING
        failures = lc.failures
        assert lc.recovered("works again after %d", failures) is True
        assert lc.recovered("works again after %d", 0) is False  # said once
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "full /ckpt"),
        (logging.DEBUG, "full /ckpt"),
        (logging.DEBUG, "full /ckpt"),
        (logging.WARNING, "read-only /ckpt"),
        (logging.INFO, "works again after 4"),
    ]
    assert [e["repeat"] for e in got] == [0, 1, 2, 0]  # every failure is still an event
    assert lc.failing is None and lc.failures == 0
