"""Red team 2 (session 19): a peer started with another ``record_shards`` than its swarm."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.dht import PeerAnnouncer
from geomesh_p2p.dht.announce import IncompatibleSwarmError
from geomesh_p2p.node.joining import check_swarm
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.schema.shards import record_shard
from tests.dht_helpers import RUN, start_node, start_swarm, stop_all
from tests.integration.test_dht_announce import node_record

pytestmark = pytest.mark.timeout(60)


async def test_a_joiner_with_another_record_shards_is_refused_not_left_alone():
    """The swarm runs --record-shards 4; a joiner forgot the flag (S = 1, so another run-config hash). With one key
    such a joiner was refused at start (IncompatibleSwarmError naming the field); with the records under the S = 4
    keys it read ``<run>/peers``, found nobody, and started alone: a silent split of the run. Now the swarm's shard-0
    peers mirror their records under ``<run>/peers`` (``PeerAnnouncer.mirror_key``), so it finds them and is refused
    naming the field, with no bootstrap progress (as here) and at round 0 too."""
    nodes = await start_swarm(9)
    # one writer in shard 0: a sharded run's shard-0 peers mirror their records under <run>/peers
    ident = next(i for i in iter(Identity.generate, None) if record_shard(i.peer_id.to_string(), 4) == 0)
    nodes.insert(0, await start_node([nodes[0].address], identity=ident))
    try:
        swarm_cfg = RunConfig(run_id=RUN, record_shards=4)
        mine_cfg = RunConfig(run_id=RUN)
        writers, joiner = nodes[:5], nodes[9]
        announcers = [
            PeerAnnouncer(
                n,
                node_record(n, run_config_hash=swarm_cfg.config_hash(), run_config=swarm_cfg.model_dump()),
                period_s=30,
                shards=4,
            )
            for n in writers
        ]
        assert all(await asyncio.gather(*(a.announce_once() for a in announcers)))
        me = joiner.peer_id.to_string()
        fake = SimpleNamespace(
            dht=joiner,
            run_cfg=mine_cfg,
            me=me,
            config_hash=mine_cfg.config_hash(),
            my_record=lambda: node_record(joiner, run_config_hash=mine_cfg.config_hash()),
        )
        with pytest.raises(IncompatibleSwarmError, match="record_shards"):
            await check_swarm(fake)  # type: ignore[arg-type]
    finally:
        await stop_all(nodes)


async def test_the_dht_tool_lists_a_sharded_runs_peers(capsys):
    """``python -m geomesh_p2p.dht`` (the hand check of docs/dht.md) read ``<run>/peers`` only: at --record-shards 4
    it printed ``"peers": []`` for a live swarm. With ``--record-shards`` it reads the run's shard keys."""
    import json

    from geomesh_p2p.dht.__main__ import build_parser, run

    nodes = await start_swarm(8)
    try:
        writers = nodes[:4]
        announcers = [PeerAnnouncer(n, node_record(n), period_s=30, shards=4) for n in writers]
        assert all(await asyncio.gather(*(a.announce_once() for a in announcers)))
        ids = sorted(n.peer_id.to_string() for n in writers)
        ns = build_parser().parse_args(
            ["--bootstrap", nodes[5].address, "--run-id", RUN, "--client-only", "--record-shards", "4"]
        )
        capsys.readouterr()
        assert await run(ns) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert sorted(line["peers"]) == ids
    finally:
        await stop_all(nodes)
