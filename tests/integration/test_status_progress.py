"""``geomesh-peer status`` with no live peer: the round its bootstrap saved (fresh user 39)."""

from __future__ import annotations

import argparse
import time
from io import StringIO

import pytest
from rich.console import Console

from geomesh_p2p.dht import SwarmProgress, publish_progress
from peer.tools_cli import _read_swarm, render_status
from tests.dht_helpers import RUN, start_node, stop_all

pytestmark = pytest.mark.timeout(60)


def _ns(boot) -> argparse.Namespace:
    return argparse.Namespace(identity=None, run_id=RUN, bootstrap=[boot.address], timeout=5.0, record_shards=1)


async def test_no_live_peer_says_the_round_its_bootstrap_saved_and_how_to_go_on():
    boot = await start_node()
    try:
        view, rounds = await _read_swarm(_ns(boot))
        assert view["peers"] == [] and "progress" not in view  # nothing saved yet: nothing said
        seen = time.time() - 600.0  # "10 min" for the next 30 s
        assert await publish_progress(boot, SwarmProgress(49, seen, 3))
        view, rounds = await _read_swarm(_ns(boot))
        assert view["progress"] == {"round": 49, "seen_at": seen, "peers": 3}
        buf = StringIO()
        render_status(view, rounds, Console(file=buf, width=200, color_system=None))
        lines = buf.getvalue().splitlines()
        assert lines[-2] == f"no live peer in run {RUN} (or none has announced itself yet)"
        assert lines[-1] == (
            "its bootstrap last saw 3 peer(s) at round 49, 10 min ago: restart them with the same flags plus "
            "--resume to go on from their checkpoints"
        )
    finally:
        await stop_all([boot])
