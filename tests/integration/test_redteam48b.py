"""Red team 48b (gRPC): the bootstrap's give-back of a disowned rise (``dht.progress.disowned_rise``,
``bootstrap/cli.py``'s ``rose_from``) against a swarm that trained together, then crashed."""

from __future__ import annotations

import asyncio
import json

import pytest

from geomesh_p2p.dht import live_peers
from geomesh_p2p.net.identity import Identity
from tests.dht_helpers import RUN, wait_for
from tests.integration.test_dht_progress import _bootstrap, _put, _remembered

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("who", ["rogue", "survivor"])
async def test_a_digest_less_leaving_record_does_not_undo_rounds_several_peers_trained(tmp_path, capsys, who):
    """Red team 48b: ``rose_from`` was the progress before the *first* live rise the bootstrap saw (round 0 of a run
    it watched from the start), kept while the swarm trained for 100 rounds. When no peer was live any more (the
    whole swarm crashed: a power cut, SIGKILL; or its last survivor ended "NOT known to be the swarm's last", which
    ``report.disowned`` also marks) one leaving record without a digest past round 0 -- a rogue identity's, any
    proof of work -- was every record past it: the bootstrap went back to round 0, forgot the run, and a peer that
    then found the swarm empty started from the seed silently (``on_empty_swarm``: no run known past round 0).
    ``who``: a rogue's leaving record at round 101, or an honest survivor's at round 100 (it trained with the two,
    waited alone and ended not synced: "the swarm confirmed it, and where the swarm ended is unknown").
    Rounds that two or more live peers reached are no lone peer's fork: they stand (fixed: such a round clears
    ``rose_from``)."""
    state = tmp_path / "boot.state.json"
    argv = ["--identity", str(tmp_path / "b.key"), "--state-file", str(state), "--status-interval", "0.2"]
    async with _bootstrap(capsys, argv + ["--pow-bits", "0"]) as (node, stop, served):
        a, b, c = Identity.generate(), Identity.generate(), Identity.generate()

        def put(ident, expires_s, **fields):
            return _put(node, ident, expires_s, **fields)

        def remembered(round):
            return _remembered(node, round)

        async def crashed():
            ids = {r.peer_id for r in await live_peers(node, RUN, include_leaving=True)}
            return not ids & {str(a.peer_id), str(b.peer_id)}

        await put(a, 2, round=0, weights_digest="00" * 32)  # the run starts: the bootstrap sees round 0
        await wait_for(lambda: remembered(0), 20, what="round 0 remembered")
        for ident in (a, b):  # both train on to round 100, then crash (their records expire, no leaving one)
            await put(ident, 5, round=100, weights_digest="ab" * 32)
        if who == "survivor":
            await put(c, 600, round=100, weights_digest="ab" * 32)
        await wait_for(lambda: remembered(100), 20, what="round 100 remembered")
        if who == "rogue":
            await put(c, 600, round=101, leaving=True, weights_digest=None)  # "disowned", digest-less
        await wait_for(crashed, 30, what="the crashed peers' records to expire")
        if who == "survivor":  # alone, it ends "NOT known to be the swarm's last": report.disowned, no digest
            await put(c, 700, round=100, leaving=True, weights_digest=None)
        stop.set()
        assert await asyncio.wait_for(served, 30) == 0
    assert json.loads(state.read_text())["progress"]["round"] == 100
