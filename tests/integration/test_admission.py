"""Admission (issue 12): proof of work per identity in open runs, --allow-peers in private runs."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.admission import (
    Admission,
    check_pow,
    leading_zero_bits,
    load_or_solve_pow,
    pow_cache_path,
    pow_digest,
    read_allow_file,
    solve_pow,
)
from geomesh_p2p.dht import PeerAnnouncer, live_peers
from geomesh_p2p.net.identity import Identity, allow_list
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import STATE_STATUS
from tests.dht_helpers import RUN, start_node, stop_all

pytestmark = pytest.mark.timeout(60)

BITS = 8  # tests: 256 hashes on average


def _rec(ident: Identity, *, nonce=None, round=3, digest="d", address="127.0.0.1:9", config_hash="h") -> PeerRecord:
    from geomesh_p2p import __version__

    return peer_record(
        ident,
        address=address,
        version=__version__,
        run_config_hash=config_hash,
        round=round,
        weights_digest=digest,
        pow_nonce=nonce,
    )


def _solved(ident: Identity, run_id: str = RUN, bits: int = BITS) -> int:
    return solve_pow(run_id, bytes(ident.peer_id), bits)


# ------------------------------------------------------------------------------------------ proof of work
def test_pow_is_bound_to_identity_run_and_difficulty():
    a, b = Identity.generate(), Identity.generate()
    n = _solved(a)
    assert leading_zero_bits(pow_digest(RUN, bytes(a.peer_id), n)) >= BITS
    assert check_pow(RUN, bytes(a.peer_id), n, BITS)
    assert check_pow(RUN, bytes(a.peer_id), None, 0)  # difficulty 0: off
    assert not check_pow(RUN, bytes(a.peer_id), None, BITS)
    # another identity or another run cannot reuse it (2**-8 chance each of passing by luck: pick a failing one)
    assert not all(check_pow(RUN, bytes(Identity.generate().peer_id), n, BITS) for _ in range(4))
    assert not all(check_pow(f"other-{i}", bytes(a.peer_id), n, BITS) for i in range(4))
    assert not check_pow(RUN, bytes(a.peer_id), n, 64)  # far more work than was done
    assert not check_pow(RUN, bytes(b.peer_id), -1, BITS) and not check_pow(RUN, bytes(b.peer_id), 1 << 64, BITS)


def test_pow_is_computed_once_and_cached_next_to_the_key(tmp_path):
    key = tmp_path / "node.key"
    ident = Identity.load_or_create(key)
    cache = pow_cache_path(key)
    assert cache == tmp_path / "node.key.pow"
    n1, _, cached1 = load_or_solve_pow(ident, RUN, BITS, cache)
    n2, t2, cached2 = load_or_solve_pow(ident, RUN, BITS, cache)
    assert (cached1, cached2) == (False, True) and n1 == n2 and t2 == 0.0
    assert json.loads(cache.read_text()) == {"peer_id": str(ident.peer_id), "runs": {RUN: n1}}
    # A cache of another key (the key file was replaced) is not trusted: recomputed for the new key.
    other = Identity.generate()
    n3, _, cached3 = load_or_solve_pow(other, RUN, BITS, cache)
    assert not cached3 and check_pow(RUN, bytes(other.peer_id), n3, BITS)
    # A stop request ends the search.
    assert load_or_solve_pow(Identity.generate(), RUN, 40, None, lambda: True)[0] is None


def test_a_record_without_valid_pow_is_ignored():
    good, lazy = Identity.generate(), Identity.generate()
    n = _solved(good)
    forged = Identity.generate()
    while check_pow(RUN, bytes(forged.peer_id), n, BITS):  # 2**-8: a borrowed nonce that fits by luck
        forged = Identity.generate()
    recs = [_rec(good, nonce=n), _rec(lazy), _rec(forged, nonce=n)]
    adm = Admission(RUN, BITS)
    with events.capture("record_not_admitted") as refused:
        kept = adm.filter(recs)
        adm.filter(recs)  # logged once per peer and reason
    assert [r.peer_id for r in kept] == [str(good.peer_id)]
    assert "no proof of work" in adm.problem(recs[1])
    assert "invalid proof of work" in adm.problem(recs[2])
    assert sorted((e["peer"], e["reason"]) for e in refused) == sorted(
        [(str(lazy.peer_id), adm.problem(recs[1])), (str(forged.peer_id), adm.problem(recs[2]))]
    )  # once each
    assert Admission(RUN, 0).filter(recs) == recs  # pow_bits 0: open run without proof of work


async def test_peer_node_ignores_dht_records_without_pow(monkeypatch):
    """End to end through the DHT: two identities announce; the node's peer list keeps only the one
    whose record carries a valid proof of work (its own record is always there)."""
    from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig

    nodes = []
    try:
        boot = await start_node()
        nodes.append(boot)
        node = PeerNode(
            RunConfig(run_id=RUN, pow_bits=BITS), NodeConfig(identity="/nonexistent/key"), identity=Identity.generate()
        )
        good, lazy = Identity.generate(), Identity.generate()
        for ident, nonce in ((good, _solved(good)), (lazy, None)):
            n = await start_node([boot.address], identity=ident)
            nodes.append(n)
            await PeerAnnouncer(n, _rec(ident, nonce=nonce, config_hash=node.config_hash)).announce_once()
        node.dht = boot
        monkeypatch.setattr(node, "my_record", lambda: _rec(node.identity, nonce=0, config_hash=node.config_hash))
        seen = await live_peers(boot, RUN)
        assert {r.peer_id for r in seen} == {str(good.peer_id), str(lazy.peer_id)}
        got = {r.peer_id for r in await node.peers()}
        assert got == {str(good.peer_id), node.me}
    finally:
        await stop_all(nodes)


def test_run_config_carries_pow_bits_and_cli_defaults_match():
    from geomesh_p2p.trust import admission
    from geomesh_p2p.node.peer import RunConfig
    from peer import node_cli

    assert RunConfig().pow_bits == admission.DEFAULT_POW_BITS == node_cli.DEFAULT_POW_BITS
    assert node_cli.MAX_POW_BITS == admission.MAX_POW_BITS
    assert RunConfig(pow_bits=8).config_hash() != RunConfig().config_hash()  # a mismatch is refused
    from peer.cli import build_parser

    ns = build_parser().parse_args(["join", "--pow-bits", "12"])
    assert node_cli.run_config_from(ns).pow_bits == 12


# ------------------------------------------------------------------------------------------ allow-lists
def test_allow_file_accepts_peer_ids_and_public_keys(tmp_path):
    import base58

    a, b = Identity.generate(), Identity.generate()
    f = tmp_path / "allow.txt"
    f.write_text(
        f"# the run's peers\n{a.peer_id}\n\nPeerID: {base58.b58encode(b.public_key_bytes).decode()}  # b's key\n"
    )
    entries = read_allow_file(f)
    allowed = allow_list(entries)
    assert allowed(a.peer_id) and allowed(b.peer_id) and not allowed(Identity.generate().peer_id)
    me = Identity.generate()
    assert allow_list(entries, also=[me.peer_id])(me.peer_id)
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{a.peer_id}\nnot-a-key\n")
    with pytest.raises(ValueError, match="line 2"):
        read_allow_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody\n")
    with pytest.raises(ValueError, match="names no peer"):
        read_allow_file(empty)
    with pytest.raises(ValueError, match="cannot read"):
        read_allow_file(tmp_path / "missing.txt")


async def test_allow_listed_run_refuses_an_outsiders_record_and_rpc():
    """A private run: the insiders' DHT and state server refuse an outsider's store and state RPC with
    PERMISSION_DENIED and a reason; an outsider's record that reaches a peer anyway is ignored."""
    from geomesh_p2p.sync.server import StateServer
    from geomesh_p2p.wire import state_pb2

    inside = [Identity.generate() for _ in range(2)]
    outsider = Identity.generate()
    allow = allow_list([str(i.peer_id) for i in inside])
    nodes = []
    try:
        # insider 0: a DHT node and a state server behind one allow-listed transport
        from geomesh_p2p.dht import DHTNode

        t = Transport(inside[0], RUN, TransportConfig(port=0), allow=allow)
        dht0 = DHTNode(t, rpc_timeout_s=2.0)
        StateServer(t)
        await t.start()
        await dht0.join([])
        nodes.append(dht0)
        dht1 = await start_node([dht0.address], identity=inside[1])
        nodes.append(dht1)
        # the insider's record is stored; the outsider's store and state request are refused
        assert await PeerAnnouncer(dht1, _rec(inside[1])).announce_once()
        out_t = Transport(outsider, RUN, TransportConfig(client_only=True))
        try:
            from geomesh_p2p.net.methods import DHT_STORE
            from geomesh_p2p.dht.records import make_record
            from geomesh_p2p.wire import dht_pb2

            rec = make_record(
                f"{RUN}/peers",
                _rec(outsider).to_bytes(),
                time.time() + 30,
                subkey=str(outsider.peer_id),
                owner=outsider,
                run_id=RUN,
            )
            req = dht_pb2.StoreRequest(records=[rec])
            for method, payload in (
                (DHT_STORE, req.SerializeToString()),
                (STATE_STATUS, state_pb2.StateRequest().SerializeToString()),
            ):
                with pytest.raises(RpcError) as ei:
                    await out_t.call(dht0.address, method, payload)
                assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert outsider.peer_id.short() in ei.value.reason and "allow-list" in ei.value.reason
        finally:
            await out_t.stop()
        recs = await live_peers(dht0, RUN)
        assert {r.peer_id for r in recs} == {str(inside[1].peer_id)}
        # a record signed by the outsider that reaches a peer by another path counts for nothing
        adm = Admission(RUN, 0, allow)
        theirs, ours = _rec(outsider), _rec(inside[1])
        assert adm.filter([theirs, ours]) == [ours]
        assert "allow-list" in adm.problem(theirs)
    finally:
        await stop_all(nodes)


def test_join_and_bootstrap_take_allow_peers(tmp_path, capsys):
    from bootstrap.cli import main as boot_main
    from bootstrap.cli import parse as boot_parse
    from peer import node_cli
    from peer.cli import build_parser

    ident = Identity.generate()
    f = tmp_path / "allow.txt"
    f.write_text(f"{ident.peer_id}\n")
    ns = build_parser().parse_args(["join", "--allow-peers", str(f)])
    assert node_cli.node_config_from(ns).allow_peers == [str(ident.peer_id)]
    assert node_cli.node_config_from(build_parser().parse_args(["join"])).allow_peers is None
    assert boot_parse(["--allow-peers", str(f)]).allow_peers == str(f)
    bad = tmp_path / "bad.txt"
    bad.write_text("xyz\n")
    assert boot_main(["--allow-peers", str(bad), "--identity", str(tmp_path / "b.key"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-peers" in err and "line 1" in err


async def test_free_identities_do_not_outvote_the_run_at_a_bootstrap(tmp_path):
    """Issue 28 (trust gaps): a bootstrap counted records without checking their proof of work, so identities
    made for free, announcing a config whose pow_bits is 0 and round 10^6, were the majority of its status page
    and of the progress it tells newcomers. With the bootstrap's --pow-bits floor they are not counted."""
    from bootstrap.cli import parse, pow_floor
    from geomesh_p2p.config.models import DEFAULT_POW_BITS
    from geomesh_p2p.dht import make_record, peers_key
    from geomesh_p2p.dht.progress import progress_of
    from geomesh_p2p.status.swarm import SwarmWatcher

    node = await start_node(run_id=RUN)
    try:
        now = time.time()
        honest, free = [Identity.generate() for _ in range(3)], [Identity.generate() for _ in range(12)]
        for ident in honest + free:
            if ident in honest:
                rec = _rec(ident, nonce=_solved(ident), round=40, config_hash="a" * 16)
                rec = rec.model_copy(update={"run_config": {"pow_bits": BITS, "run_id": RUN}})
            else:
                rec = _rec(ident, round=10**6, config_hash="b" * 16)
                rec = rec.model_copy(update={"run_config": {"pow_bits": 0, "run_id": RUN}})
            pid = str(ident.peer_id)
            item = make_record(peers_key(RUN), rec.to_bytes(), now + 600, subkey=pid, owner=ident, run_id=RUN)
            assert await node.store_record(item)
        recs = await live_peers(node, RUN, include_leaving=True)
        assert len(recs) == 15
        # without a floor the free identities decide (the gap): their config, their round
        unchecked = progress_of(recs, "boot", now)
        assert unchecked is not None and (unchecked.round, unchecked.config_hash) == (10**6, "b" * 16)
        assert (await SwarmWatcher(node, RUN).refresh())["round"] == 10**6
        # with the floor: the run's three peers alone
        counted = progress_of(Admission(RUN, BITS).filter(recs), "boot", now)
        assert counted is not None and (counted.round, counted.config_hash, counted.peers) == (40, "a" * 16, 3)
        view = await SwarmWatcher(node, RUN, pow_floor=BITS).refresh()
        assert view["round"] == 40 and len(view["peers"]) == 3 and view["ignored"] == 12
    finally:
        await stop_all([node])
    # the floor's default: the peers' default in an open run, 0 with --allow-peers; a bad value fails at start
    allow = tmp_path / "allow.txt"
    allow.write_text(str(Identity.generate().peer_id) + "\n")
    assert pow_floor(parse([])) == DEFAULT_POW_BITS
    assert pow_floor(parse(["--allow-peers", str(allow)])) == 0
    assert pow_floor(parse(["--pow-bits", "8"])) == 8
    with pytest.raises(SystemExit):
        parse(["--pow-bits", "99"])
