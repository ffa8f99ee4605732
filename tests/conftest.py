"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.collective_util import Swarm
from tests.proc_util import Server
from tests.swarm_util import ProcSwarm


@pytest.fixture
async def swarms():
    """``await swarms(n_servers, n_clients=0, **kw)`` -> a started in-process collective :class:`Swarm`;
    every swarm made is stopped in teardown (also when the test fails)."""
    made: list[Swarm] = []

    async def make(n_servers, n_clients=0, **kw) -> Swarm:
        s = Swarm(n_servers, n_clients, **kw)
        made.append(s)
        return await s.start()

    try:
        yield make
    finally:
        for s in made:
            await s.stop()


@pytest.fixture
def swarm(tmp_path):
    """A :class:`ProcSwarm` of peer processes in ``tmp_path``; every process it started is stopped in
    teardown (SIGINT, then SIGKILL), also when the test fails. Modules with their own ``swarm`` override it."""
    s = ProcSwarm(tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture
def servers():
    """``servers(argv)`` -> a started :class:`~tests.proc_util.Server` (``python argv...``, address from
    its 'serving on' line); every server started is stopped by PID in teardown, also when the test fails."""
    started: list[Server] = []

    def spawn(argv):
        s = Server(argv)
        started.append(s)
        return s

    try:
        yield spawn
    finally:
        for s in started:
            s.stop()


# ------------------------------------------------------------------------------ tiers
# `make test-quick` runs `pytest -m "not e2e"`: everything but the tests that start OS processes (peer,
# bootstrap and worker processes, console scripts, the browser). Until the suite is split into
# tests/unit, tests/integration and tests/e2e (issue 15), the e2e tier is named here: whole modules by
# file name (so it survives a move into a sub-folder), single tests by "module::test", and any test that
# uses a process-spawning fixture.
E2E_MODULES = frozenset({
    "test_attacks.py", "test_bootstrap.py", "test_join_errors.py", "test_status_page.py", "test_swarm.py",
    "test_sybil.py", "test_young_swarm.py", "test_slow_link.py", "test_startup_stop.py",
})
E2E_TESTS = frozenset({
    "test_cli.py::test_console_scripts_help",
    "test_log_hygiene.py::test_a_healthy_three_peer_swarm_logs_no_error_traceback_or_pending_task",
    "test_log_hygiene.py::test_a_bootstrap_stopped_while_joining_stops_at_once_and_cleanly",
})
E2E_FIXTURES = frozenset({
    "workers",  # test_collective_failures: real collective_worker.py processes
    "servers",  # test_limits: a bootstrap or peer process whose memory is measured
})


def pytest_collection_modifyitems(config, items):
    """Mark the tests that start processes ``e2e`` (see ``E2E_MODULES``); pytest's own hook, no return."""
    for item in items:
        name = item.path.name
        if (name in E2E_MODULES or f"{name}::{item.originalname}" in E2E_TESTS
                or E2E_FIXTURES.intersection(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.e2e)
