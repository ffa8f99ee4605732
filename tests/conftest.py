"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.collective_util import Swarm
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
