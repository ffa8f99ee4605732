"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.collective_util import Swarm


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
