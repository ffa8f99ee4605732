"""Peer announcements under <run>/peers: simultaneous joins form one swarm, the swarm outlives its
bootstrap, dead peers expire, incompatible peers are refused with what differs."""

from __future__ import annotations

import asyncio
import time

import pytest

from geomesh_p2p import __version__
from geomesh_p2p.telemetry import events
from geomesh_p2p.dht import (
    PeerAnnouncer,
    announce_loop,
    check_compatible,
    live_peers,
    peers_key,
)
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from tests.dht_helpers import RUN, start_node, start_swarm, stop_all, stop_node, wait_for

pytestmark = pytest.mark.timeout(60)

PERIOD = 0.4
CONFIG_HASH = "c0ffee" * 8


def node_record(node, **changes) -> PeerRecord:
    """``node``'s record (its PeerID and address, this version, :data:`CONFIG_HASH`), ``changes`` applied."""
    fields = dict(address=node.address, device="cpu: test", version=__version__, run_config_hash=CONFIG_HASH)
    return peer_record(node.peer_id.to_string(), **{**fields, **changes})


async def start_peer(bootstrap, **record_changes):
    node = await start_node(bootstrap, refresh_period_s=1.0, republish_period_s=2.0)
    announcer = PeerAnnouncer(node, lambda: node_record(node, **record_changes), period_s=PERIOD)
    announcer.start()
    return node, announcer


async def sees(node, peer_ids) -> bool:
    return {r.peer_id for r in await live_peers(node, RUN)} == {p.to_string() for p in peer_ids}


async def test_four_peers_joining_one_bootstrap_at_once_form_one_swarm_that_outlives_it():
    boot = await start_node(refresh_period_s=1.0)
    peers = []
    try:
        started = await asyncio.gather(*(start_peer([boot.address]) for _ in range(4)))
        peers = [n for n, _ in started]
        ids = [n.peer_id for n in peers]
        for n in peers + [boot]:  # a generous bound on a wait, not a speed goal (issue 15)
            await wait_for(
                lambda n=n: sees(n, ids),
                timeout=30 * PERIOD,
                interval=PERIOD / 4,
                what=f"{n.peer_id.short()} to see all four peers",
            )
        # the bootstrap dies: the peers still see each other (records keep being refreshed) ...
        await stop_node(boot)
        ttl = 3 * PERIOD
        await asyncio.sleep(ttl + PERIOD)
        for n in peers:
            assert await sees(n, ids)
        # ... and find new records and newcomers
        assert await peers[0].store(
            f"{RUN}/after-bootstrap", b"new", time.time() + 30, owner=peers[0].identity
        )  # values under the run's keys are signed
        for n in peers[1:]:
            assert (await n.get(f"{RUN}/after-bootstrap"))[None].value == b"new"
        late, late_announcer = await start_peer([peers[2].address])
        peers.append(late)
        for n in peers:
            await wait_for(
                lambda n=n: sees(n, ids + [late.peer_id]),
                timeout=8 * PERIOD,
                interval=PERIOD / 4,
                what="everyone to see the newcomer",
            )
        # a dead peer drops out within its record's lifetime
        await stop_node(peers[1])
        gone = peers.pop(1)
        survivors = [p.peer_id for p in peers]
        for n in peers:
            await wait_for(
                lambda n=n: sees(n, survivors),
                timeout=ttl + 4 * PERIOD,
                interval=PERIOD / 4,
                what=f"{gone.peer_id.short()} to expire",
            )
    finally:
        await stop_all(peers + [boot])


_MAJ, _MIN, _ = (int(x) for x in __version__.split("."))
SAME_SERIES, OTHER_MINOR = f"{_MAJ}.{_MIN}.7", f"{_MAJ}.{_MIN + 1}.0"  # relative to this version


async def test_incompatible_peer_is_refused_with_what_differs():
    boot = await start_node()
    nodes = []
    try:
        a, _ = await start_peer([boot.address])
        b, _ = await start_peer([boot.address], run_config_hash="deadbeef" * 8)
        c, _ = await start_peer([boot.address], version=OTHER_MINOR)
        nodes = [a, b, c]
        await wait_for(lambda: sees(boot, [a.peer_id, b.peer_id, c.peer_id]), timeout=10, what="all records")
        mine = node_record(a)
        with events.capture("peer_record_dropped") as dropped:
            compatible = await live_peers(a, RUN, mine=mine)
        assert [r.peer_id for r in compatible] == [a.peer_id.to_string()]
        assert sorted((e["subkey"], e["reason"], e["differs"]) for e in dropped) == sorted(
            [
                (b.peer_id.to_string(), "incompatible", ["run-config hash c0ffeec0ffee… vs deadbeefdead…"]),
                (c.peer_id.to_string(), "incompatible", [f"version {__version__} vs {OTHER_MINOR}"]),
            ]
        )
        filtered = await live_peers(a, RUN, expected_config_hash=CONFIG_HASH, expected_version=__version__)
        assert len(filtered) == 1
        assert len(await live_peers(a, RUN)) == 3
    finally:
        await stop_all(nodes + [boot])


async def test_peers_of_another_run_config_are_one_warning_line(caplog):
    """Fresh user 49: three live peers of another --model were three WARNING lines of hashes (one per record) before
    the one-line refusal; one line now names the records and the difference, each record's line at DEBUG."""
    import logging

    boot = await start_node()
    nodes = []
    try:
        a, _ = await start_peer([boot.address])
        others = [(await start_peer([boot.address], run_config_hash="deadbeef" * 8))[0] for _ in range(3)]
        nodes = [a, *others]
        await wait_for(lambda: sees(boot, [n.peer_id for n in nodes]), timeout=10, what="all records")
        with caplog.at_level(logging.DEBUG, logger="geomesh_p2p.dht.announce"):
            got = await live_peers(a, RUN, expected_config_hash=CONFIG_HASH)
        assert [r.peer_id for r in got] == [a.peer_id.to_string()]
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        names = ", ".join(sorted(f"{n.peer_id.to_string()[:10]}…" for n in others))
        assert warned == [
            f"3 peer record(s) incompatible, ignored ({names}): run-config hash c0ffeec0ffee… vs deadbeefdead… (other "
            "training flags or data; a joining peer's start-up names the fields that differ from the swarm's)"
        ]
        assert sum("incompatible, ignored: run-config hash" in r.getMessage() for r in caplog.records) == 3  # DEBUG
    finally:
        await stop_all(nodes + [boot])


def test_check_compatible_messages():
    ident = Identity.generate()

    class N:  # enough of a node for node_record
        peer_id = ident.peer_id
        address = "127.0.0.1:1"

    mine = node_record(N)
    assert check_compatible(mine, mine) is None
    assert check_compatible(mine, node_record(N, version=SAME_SERIES)) is None  # patch releases interoperate
    assert check_compatible(mine, node_record(N, version=OTHER_MINOR)) == f"version {__version__} vs {OTHER_MINOR}"
    msg = check_compatible(mine, node_record(N, run_config_hash="c0ffee" * 4 + "abcdef" * 4))
    assert (
        msg == "run-config hash c0ffeec0ffeec0ffeec0ffeec0ff… vs c0ffeec0ffeec0ffeec0ffeeabcd…"
    )  # long enough to differ
    two = check_compatible(mine, node_record(N, protocol_version=1, version="1.0.0"))
    assert two == f"version {__version__} vs 1.0.0; protocol version 2 vs 1"


async def test_malformed_or_misplaced_peer_records_are_dropped():
    node = await start_node()
    try:
        me = node.identity
        key = peers_key(RUN)
        assert await node.store(key, b"{not json", time.time() + 30, subkey=me.peer_id.to_string(), owner=me)
        other = Identity.generate()
        rec = node_record(node).model_copy(update={"peer_id": me.peer_id.to_string()})
        assert await node.store(key, rec.to_bytes(), time.time() + 30, subkey=other.peer_id.to_string(), owner=other)
        assert await node.store(key, b"{}", time.time() + 30, subkey="unowned", owner=other)
        with events.capture("peer_record_dropped") as dropped:
            assert await live_peers(node, RUN) == []
        assert sorted((e["subkey"], e["reason"]) for e in dropped) == sorted(
            [
                (me.peer_id.to_string(), "malformed"),
                (other.peer_id.to_string(), "names_another_peer"),
                ("unowned", "not_owner_subkey"),
            ]
        )
        # an announcer refuses a record of another peer
        with pytest.raises(ValueError, match="not this identity's PeerID"):
            await PeerAnnouncer(node, node_record(node, peer_id=other.peer_id.to_string())).announce_once()
    finally:
        await stop_all([node])


async def test_announce_loop_refreshes_and_update_announces_at_once():
    node = await start_node()
    try:
        task = asyncio.ensure_future(announce_loop(node, lambda: node_record(node, round=1), period_s=0.2))
        await wait_for(lambda: sees(node, [node.peer_id]), timeout=5, what="own record")
        first = (await live_peers(node))[0].timestamp
        await wait_for(lambda: _newer(node, first), timeout=5, what="a refreshed record")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        ann = PeerAnnouncer(node, node_record(node, round=2), period_s=30)
        ann.start()
        await wait_for(lambda: _round_is(node, 2), timeout=5, what="round 2")
        ann.update(node_record(node, round=3))
        await wait_for(lambda: _round_is(node, 3), timeout=5, what="round 3 announced at once")
        await ann.stop()
    finally:
        await stop_all([node])


async def _newer(node, t) -> bool:
    recs = await live_peers(node)
    return bool(recs) and recs[0].timestamp > t


async def _round_is(node, r) -> bool:
    recs = await live_peers(node)
    return bool(recs) and recs[0].round == r


async def test_a_restarted_peer_replaces_its_previous_processes_longer_lived_record():
    """Issue 25: a peer restarted with its key while the record of its previous process still lives (a lifetime
    that followed long rounds: 60 s here) announces a record that expires later than that one, so the DHT holds
    the new address at once (before, the shorter-lived new record was refused and others, the peer itself too,
    planned it at its old address). A lifetime shortened by follow_rounds never expires before the stored one."""
    boot = await start_node(refresh_period_s=1.0)
    identity = Identity.generate()
    old = await start_node([boot.address], identity=identity)
    new = None
    try:
        stale = PeerAnnouncer(old, lambda: node_record(old, round=7), period_s=30, ttl_s=60.0)
        assert await stale.announce_once()
        await stop_node(old)  # SIGKILL: no leaving record
        new = await start_node([boot.address], identity=identity)
        assert new.address != old.address
        fresh = PeerAnnouncer(new, lambda: node_record(new, round=0), period_s=30, ttl_s=6.0)
        assert await fresh.announce_once()
        assert fresh.expires_at == pytest.approx(stale.expires_at + 0.5)
        for reader in (boot, new):
            assert [(r.address, r.round) for r in await live_peers(reader, RUN)] == [(new.address, 0)]
        # a shorter lifetime after a longer one: the next record still expires after the stored one
        before = fresh.expires_at
        fresh.ttl_s = 3.0  # as follow_rounds sets it after a short round
        fresh.update(lambda: node_record(new, round=1))
        assert await fresh.announce_once()
        assert fresh.expires_at == pytest.approx(before + 0.5)
        assert [r.round for r in await live_peers(boot, RUN)] == [1]
    finally:
        await stop_all([n for n in (new, boot) if n is not None])


async def test_a_dht_node_keeps_how_long_its_last_stores_took():
    """The plan agreement's settle follows it (PlanStore.settle_s): 0.0 before any store, then the longest of the
    last 32, each a positive duration."""
    node = await start_node()
    try:
        assert node.recent_store_s() == 0.0
        for i in range(3):
            assert await node.store(f"{RUN}/x{i}", b"v", time.time() + 30, owner=node.identity)
        assert len(node.store_times) == 3 and all(t > 0 for t in node.store_times)
        assert node.recent_store_s() == max(node.store_times)
    finally:
        await stop_all([node])


# ---------------------------------------------------------------- session 16: fewer replicas, cached targets, 4 rounds
def _holders(nodes, key: str, subkey: str) -> list:
    """The nodes whose local store holds ``key``/``subkey``, and the expiration each holds."""
    from geomesh_p2p.dht.records import key_id_of

    out = []
    for n in nodes:
        for rec in n._local_records(key_id_of(key)):
            if rec.HasField("subkey") and rec.subkey == subkey:
                out.append((n, rec.expiration_time))
    return out


async def test_a_peer_record_is_stored_on_8_nodes_and_other_keys_on_k():
    """``PEER_RECORD_REPLICAS``: the run's peer records go to the key's 8 nearest nodes (the writer included when it
    is one of them), every other key to k (20: all 12 nodes here); a read still finds the record."""
    from geomesh_p2p.dht.state import PEER_RECORD_REPLICAS

    nodes = await start_swarm(12)
    try:
        writer, reader = nodes[3], nodes[7]
        mine = writer.peer_id.to_string()
        assert writer.replicas_for(peers_key(RUN)) == PEER_RECORD_REPLICAS == 8
        assert writer.replicas_for(f"{RUN}/plan/3") == writer.k == 20
        assert await PeerAnnouncer(writer, node_record(writer), period_s=30).announce_once()
        assert len(_holders(nodes, peers_key(RUN), mine)) == 8
        assert await writer.store(f"{RUN}/other", b"v", writer.now() + 30, subkey=mine, owner=writer.identity)
        assert len(_holders(nodes, f"{RUN}/other", mine)) == 12
        assert [r.peer_id for r in await live_peers(reader, RUN)] == [mine]
    finally:
        await stop_all(nodes)


async def test_store_targets_are_reused_and_a_failed_target_triggers_a_lookup():
    """``STORE_TARGET_REUSE`` (4): a peer record's store looks its key up, the next 3 stores go to the same 8 nodes
    without a lookup, the 5th looks up again. A cached target that does not answer (killed) drops the cache: that
    store looks the key up at once and still reaches 8 live nodes with the new record."""
    nodes = await start_swarm(12)
    try:
        writer = nodes[0]
        mine = writer.peer_id.to_string()
        ann = PeerAnnouncer(writer, lambda: node_record(writer), period_s=30, ttl_s=60.0)
        assert await ann.announce_once()  # a lookup, then the read of its stored expiration (not a store)
        assert (writer.store_lookups, writer.store_reuses) == (1, 0)
        for _ in range(3):
            assert await ann.announce_once()
        assert (writer.store_lookups, writer.store_reuses) == (1, 3)
        assert await ann.announce_once()  # the 5th: the targets were used 4 times
        assert (writer.store_lookups, writer.store_reuses) == (2, 3)
        held = _holders(nodes, peers_key(RUN), mine)
        assert len(held) == 8 and all(exp == ann.expires_at for _, exp in held)

        victim = next(n for n, _ in held if n is not writer)
        await stop_node(victim)
        live = [n for n in nodes if n is not victim]
        assert await ann.announce_once()  # a cached target is dead: look again, complete the replicas
        assert (writer.store_lookups, writer.store_reuses) == (3, 4)
        newest = [n for n, exp in _holders(live, peers_key(RUN), mine) if exp == ann.expires_at]
        assert len(newest) == 8
        assert await ann.announce_once()  # the new targets are cached: no lookup
        assert (writer.store_lookups, writer.store_reuses) == (3, 5)
    finally:
        await stop_all([n for n in nodes if n._alive])


async def test_a_record_outlives_a_round_three_times_the_last_and_expires_after_four():
    """Lifetime in rounds (session 16): after 8 s rounds a record lives 4 x 8 + 2 x 2 = 36 s of swarm time, so a
    reader still finds it after a round three times as long (24 s; the rule before, 2 rounds + 2 periods = 20 s,
    lost it) and no longer after 37 s. One swarm clock, moved by the test, for every node."""
    t = [time.time()]

    def clock() -> float:
        return t[0]

    boot = await start_node(clock=clock)
    writer = await start_node([boot.address], clock=clock)
    reader = await start_node([boot.address], clock=clock)
    try:
        ann = PeerAnnouncer(writer, node_record(writer), period_s=2.0)
        ann.follow_rounds(8.0, 6.0)
        assert ann.ttl_s == 36.0
        assert await ann.announce_once()
        assert await sees(reader, [writer.peer_id])
        t[0] += 3 * 8.0
        assert await sees(reader, [writer.peer_id])
        t[0] += 13.0
        assert await sees(reader, [])
    finally:
        await stop_all([reader, writer, boot])
