"""Fixtures shared by the integration tests of the all-reduce groups (test_collective_groups*.py,
test_groups_redteam.py)."""

import pytest

from geomesh_p2p.exchange.groups import GroupedCollective
from tests.collective_util import Swarm


@pytest.fixture
async def grouped_swarm():
    """``await grouped_swarm(n, **kw)`` -> (a started :class:`Swarm` of ``n`` in-process peers, a
    :class:`GroupedCollective` per peer: long polls of 2 s, late pulls of 1 s, then ``kw``); all stopped after, also
    when the test fails."""
    made = []

    async def make(n: int, **kw):
        sw = Swarm(n)
        grouped = [GroupedCollective(s, **{"long_poll_s": 2.0, "late_pull_s": 1.0, **kw}) for s in sw.services]
        made.append((sw, grouped))
        await sw.start()
        return sw, grouped

    try:
        yield make
    finally:
        for sw, grouped in made:
            for k, gc in enumerate(grouped):
                if k not in sw._stopped:
                    await gc.close()
            await sw.stop()
