"""geomesh_p2p.dht.progress: a bootstrap's last known round of its run, and its saved state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import pytest

from bootstrap import cli as boot_cli
from geomesh_p2p.dht import BootstrapState, SwarmProgress, peers_key, publish_progress, swarm_progress
from geomesh_p2p.net.identity import Identity
from tests.dht_helpers import RUN, start_node, stop_all, stop_node, wait_for
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(60)


async def test_only_a_bootstraps_own_entry_counts():
    boot = await start_node()
    liar = await start_node([boot.address])
    newcomer = await start_node([boot.address])
    try:
        assert set(newcomer.bootstrap_peers) == {boot.peer_id}
        assert await swarm_progress(newcomer) is None
        # any peer can write its own subkey: a fake round from a non-bootstrap is ignored
        assert await publish_progress(liar, SwarmProgress(10**9, 1.0, 1))
        assert await swarm_progress(newcomer) is None
        assert await publish_progress(boot, SwarmProgress(31, 1234.5, 3))
        assert await swarm_progress(newcomer) == SwarmProgress(31, 1234.5, 3, boot.peer_id.to_string())
        assert await swarm_progress(boot) is None  # it joined through nobody
    finally:
        await stop_all([newcomer, liar, boot])


async def test_state_saves_and_loads_for_its_run_only(tmp_path):
    boot = await start_node()
    peer = await start_node([boot.address])
    try:
        path = tmp_path / "sub" / "boot.state.json"
        BootstrapState.capture(boot, SwarmProgress(12, 99.0, 2)).save(str(path))
        data = json.loads(path.read_text())
        assert data["run_id"] == RUN and data["contacts"] == [[peer.peer_id.to_string(), peer.address]]
        assert data["progress"] == {"round": 12, "seen_at": 99.0, "peers": 2}
        state = BootstrapState.load(str(path), RUN)
        assert [(c.peer_id, c.address) for c in state.contact_list()] == [(peer.peer_id, peer.address)]
        assert state.swarm_progress(by="b") == SwarmProgress(12, 99.0, 2, "b")
        assert BootstrapState.load(str(path), "another-run") is None
        assert BootstrapState.load(str(tmp_path / "absent.json"), RUN) is None
        path.write_text("{not json")
        assert BootstrapState.load(str(path), RUN) is None
        assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left behind
    finally:
        await stop_all([peer, boot])


async def test_a_restarted_node_rejoins_saved_contacts():
    boot = await start_node()
    peers = [await start_node([boot.address]) for _ in range(2)]
    fresh = await start_node()
    try:
        assert await fresh.rejoin([c for c in boot.contacts()]) == 3  # the two, and the bootstrap they know
        assert {c.peer_id for c in fresh.contacts()} == {p.peer_id for p in peers} | {boot.peer_id}
    finally:
        await stop_all(peers + [boot, fresh])


async def test_peers_ping_their_bootstrap_while_others_are_known():
    boot = await start_node()
    peer = await start_node([boot.address])
    other = await start_node([boot.address])
    try:

        async def knows_other():
            return other.peer_id in {c.peer_id for c in peer.contacts()}

        await wait_for(knows_other, 10, what="the peer to know the other peer")
        peer._forget(boot.node_id)  # as after the bootstrap's outage: the others still fill the table
        assert peer.contacts() and boot.peer_id not in {c.peer_id for c in peer.contacts()}
        assert await peer.ping_bootstraps() == 1
        assert boot.peer_id in {c.peer_id for c in peer.contacts()}
    finally:
        await stop_all([peer, other, boot])


async def test_a_stopping_bootstrap_saves_the_swarms_latest_round(tmp_path, capsys):
    """The state file holds the round the swarm is at when the bootstrap stops, not the one of its last
    periodic read (--status-interval apart; here 1 h, so only the final read can see round 7)."""
    saved = await _saved_progress(tmp_path, capsys, [dict(round=7, leaving=True)])  # finished round 6, left
    assert (saved["round"], saved["config_hash"]) == (7, "h")  # "h": the record's run-config hash


async def test_a_record_of_another_config_is_not_remembered_as_the_runs(tmp_path, capsys):
    """Review: the newest record alone named the config. One identity announcing round 10^9 with another
    run-config hash made the state file remember that hash, and every peer of the run's own config then
    failed at once when it found the swarm empty (PeerNode._on_empty_swarm: "another run config")."""
    recs = [dict(round=7), dict(round=7, leaving=True), dict(round=10**9, run_config_hash="other")]
    saved = await _saved_progress(tmp_path, capsys, recs)
    assert (saved["round"], saved["config_hash"], saved["peers"]) == (7, "h", 2)


async def _saved_progress(tmp_path, capsys, records: list[dict], pow_bits: str = "0") -> dict:
    """Run the bootstrap's _serve, store ``records`` (peer_record fields, one identity each) under the
    run's key, stop it, and return the progress its state file saved."""
    state = tmp_path / "boot.state.json"
    argv = ["--identity", str(tmp_path / "b.key"), "--state-file", str(state), "--status-interval", "3600"]
    # the records below carry no proof of work
    async with _bootstrap(capsys, argv + ["--pow-bits", pow_bits]) as (node, stop, served):
        for fields in records:
            ident = Identity.generate()
            rec = peer_record(ident, **{"weights_digest": "ab" * 32, **fields})  # holds a state
            assert await node.store(peers_key(RUN), rec.to_bytes(), time.time() + 600, subkey=rec.peer_id, owner=ident)
        stop.set()
        assert await asyncio.wait_for(served, 30) == 0
        return json.loads(state.read_text())["progress"]


async def _put(node, ident, expires_s: float, **fields) -> None:
    """Store ``ident``'s record (peer_record ``fields``) under the run's key for ``expires_s`` seconds."""
    rec = peer_record(ident, **fields)
    assert await node.store(peers_key(RUN), rec.to_bytes(), time.time() + expires_s, subkey=rec.peer_id, owner=ident)


async def _remembered(node, round: int) -> bool:
    """Whether the run's published progress says ``round``."""
    p = await swarm_progress(node, RUN)
    return p is not None and p.round == round


@contextlib.asynccontextmanager
async def _bootstrap(capsys, argv: list[str]):
    """A bootstrap (``bootstrap.cli._serve`` of run RUN on 127.0.0.1, port 0, ``argv`` added) and a DHT node joined
    to it: yields (node, stop event, the serve task); both are stopped on exit, also when the test fails."""
    ns = boot_cli.parse(["--host", "127.0.0.1", "--port", "0", "--run-id", RUN] + argv)
    stop = asyncio.Event()
    served = asyncio.ensure_future(boot_cli._serve(ns, Identity.load_or_create(ns.identity), None, None, stop))
    node = None
    try:
        address = None
        while address is None:  # printed once the transport listens
            assert not served.done(), capsys.readouterr()
            m = re.search(r"serving on (\S+)", capsys.readouterr().out)
            address = m.group(1) if m else None
            if address is None:
                await asyncio.sleep(0.05)
        node = await start_node([address])
        yield node, stop, served
    finally:
        stop.set()
        if not served.done():
            served.cancel()
        await asyncio.gather(served, return_exceptions=True)
        if node is not None:
            await stop_node(node)


async def test_records_below_the_bootstraps_pow_floor_are_not_counted_and_it_says_so(tmp_path, capsys, caplog):
    """Red team (session 13): a bootstrap whose --pow-bits is above the run's counted nothing and logged only
    "live peers: 0". Records without the work are not counted, with one WARNING naming the flag."""
    import logging

    with caplog.at_level(logging.WARNING, logger="geomesh.bootstrap"):
        saved = await _saved_progress(tmp_path, capsys, [dict(round=7), dict(round=7)], pow_bits="8")
    assert saved is None  # nothing counted, nothing remembered
    lines = [r.getMessage() for r in caplog.records if "carry less proof of work" in r.getMessage()]
    assert len(lines) == 1 and "2 peer record(s)" in lines[0] and "--pow-bits 8" in lines[0], lines
    # since session 28 the bootstrap also refuses to store them (each slot of the records key costs the work it
    # counts), and says so once per storer
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused record from")]
    assert refused and all("no valid proof of work (this node asks 8 bits for a peer record" in x for x in refused)


async def test_a_fresh_peer_of_another_config_than_the_remembered_run_is_refused_before_its_profile(tmp_path):
    """Fresh user 46: a peer of another --model than the run its bootstrap remembers (no peer of it live) was refused
    by PeerNode._on_empty_swarm only after the data, the model and the profile (33 s for gpt2-124m on a CPU). It is
    now refused right after the DHT join, with the live peers' check, before any of them."""
    from geomesh_p2p.config.models import NodeConfig, RunConfig
    from geomesh_p2p.dht import IncompatibleSwarmError
    from geomesh_p2p.node.peer import PeerNode

    boot = await start_node()
    node = None
    try:
        theirs = RunConfig(run_id=RUN, model="tiny", pow_bits=0)
        mine = RunConfig(run_id=RUN, model="gpt2-124m", pow_bits=0)
        entry = SwarmProgress(7, time.time(), 2, config_hash=theirs.config_hash(), config=theirs.model_dump())
        assert await publish_progress(boot, entry)
        cfg = NodeConfig(bootstrap=[boot.address], identity=str(tmp_path / "p.key"), threads=1, probe_bytes=1 << 16)
        node = PeerNode(mine, cfg, identity=Identity.generate())
        built: list[bool] = []
        node._build_training = lambda: built.append(True)  # type: ignore[method-assign]
        with pytest.raises(
            IncompatibleSwarmError, match="was at round 7 with another run config.*model: 'gpt2-124m' here"
        ):
            await asyncio.wait_for(node.start(), 30)
        assert built == []  # before: refused after the profile, by initial_state's empty-swarm check
    finally:
        if node is not None:
            await node.shutdown()
        await stop_node(boot)


async def test_a_round_a_lone_peer_disowned_is_given_back(tmp_path, capsys):
    """Fresh user 48: the others had left at round 4; a peer restarted alone trained round 4 alone (its live record
    of round 5 raised the bootstrap's round) and ended "NOT the swarm's", exit 3: the bootstrap kept round 5 as the
    run's, and the peers restarted later adopted that state. Its leaving record holds no digest now
    (node.report.disowned): the bootstrap gives the round back (4); a leaving record holding a state keeps 5."""
    for digest, kept in ((None, 4), ("cd" * 32, 5)):
        state = tmp_path / f"boot-{kept}.state.json"
        argv = ["--identity", str(tmp_path / f"b{kept}.key"), "--state-file", str(state), "--status-interval", "0.2"]
        async with _bootstrap(capsys, argv + ["--pow-bits", "0"]) as (node, stop, served):
            lone, other = Identity.generate(), Identity.generate()

            def put(ident, expires_s, **fields):
                return _put(node, ident, expires_s, **fields)

            def remembered(round):
                return _remembered(node, round)

            await put(other, 600, round=4, leaving=True, weights_digest="ab" * 32)  # left at round 4
            await wait_for(lambda: remembered(4), 20, what="round 4 remembered")
            await put(lone, 600, round=5, weights_digest="cd" * 32)  # the lone peer, live after its lone round
            await wait_for(lambda: remembered(5), 20, what="round 5 remembered")
            await put(lone, 700, round=5, leaving=True, weights_digest=digest)  # it ends
            stop.set()
            assert await asyncio.wait_for(served, 30) == 0
            assert json.loads(state.read_text())["progress"]["round"] == kept
