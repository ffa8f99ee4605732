"""A diagnostic run's stall threshold (issue 27, session 46): ``GEOMESH_LOOPLAG_TRACE_MS`` lowers the length from which
the node's loop monitor locates a stall (250 ms by default) and logs every located stall at INFO, the host-busy ones
(idle in the selector, DEBUG otherwise) too; a malformed value keeps the default with a WARNING."""

from __future__ import annotations

import logging
import threading

import pytest

from geomesh_p2p.telemetry import looplag
from geomesh_p2p.telemetry.looplag import TRACE_ENV, monitor_from_env

pytestmark = pytest.mark.timeout(30)


def test_the_threshold_comes_from_the_environment(monkeypatch, caplog):
    caplog.set_level("WARNING", logger="geomesh_p2p.telemetry.looplag")
    monkeypatch.delenv(TRACE_ENV, raising=False)
    m = monitor_from_env()
    assert (m.trace_after_s, m.all_at_info) == (0.25, False)
    monkeypatch.setenv(TRACE_ENV, "40")
    m = monitor_from_env()
    assert (m.trace_after_s, m.all_at_info) == (0.04, True)
    for bad in ("0", "-5", "nan", "inf", "fast"):
        monkeypatch.setenv(TRACE_ENV, bad)
        caplog.clear()
        m = monitor_from_env()
        assert (m.trace_after_s, m.all_at_info) == (0.25, False), bad
        assert any(TRACE_ENV in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), bad


def test_a_diagnostic_run_logs_a_host_busy_stall_at_info(monkeypatch, caplog):
    monkeypatch.setenv(TRACE_ENV, "40")
    m = monitor_from_env()
    caplog.set_level("DEBUG", logger="geomesh_p2p.telemetry.looplag")
    m._loop_thread = threading.get_ident()
    stall = looplag._Stall(0.0, 0.0, {})
    stall.blocked, stall.cpu, stall.start_cpu = 0.08, 0.0, 0.0
    stall.samples[("python3.11/selectors.py:468 select", False)] = 3
    m._report(stall, {})
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "blocked" in r.getMessage()]
    assert len(lines) == 1 and lines[0][0] == logging.INFO and "80 ms" in lines[0][1]
