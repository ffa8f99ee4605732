"""A run's records key takes only peer records with the run's proof of work (red team, session 28).

2,046 junk records, each signed by a throwaway key (no work) and stored for 24 h under ``<run>/peers``, filled the
key's 2,048 subkeys at every node: a newcomer's record was then refused ("key already holds 2048 subkeys") and it
never trained. A node now checks the content of a signed record offered under the records key (and its shard keys)
before it takes a slot: a PeerRecord, naming its signer, under its signer's subkey, with proof of work for the run's
bits (:func:`geomesh_p2p.trust.admission.run_record_store_check`). Since session 30 (0.10.0) every other key of the
run asks the same work, through the record's own ``pow_nonce``: junk under ``<run>/plan/<r>`` would otherwise keep
round r's leaders from storing their plans.
"""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from geomesh_p2p.dht import live_peers, peers_key
from geomesh_p2p.dht.records import key_id_of, make_record
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.schema.shards import records_key
from geomesh_p2p.trust.admission import peer_record_store_check, run_record_store_check, solve_pow
from tests.dht_helpers import RUN, start_node, start_swarm, stop_all
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(60)

BITS = 8


def _offer(node, key: str, value: bytes, owner: Identity, subkey: str | None = None):
    rec = make_record(key, value, time.time() + 3600, subkey=subkey or str(owner.peer_id), owner=owner, run_id=RUN)
    return node._store_local(rec, from_peer=None)


def _record(ident: Identity, *, work: bool = True, **fields) -> bytes:
    nonce = solve_pow(RUN, bytes(ident.peer_id), BITS) if work else None
    return peer_record(ident, pow_nonce=nonce, **fields).to_bytes()


async def test_junk_and_records_without_work_take_no_slot_under_the_records_key():
    (node,) = await start_swarm(1)
    try:
        node.store_check = peer_record_store_check(RUN, BITS)
        junk, lazy, honest, other = (Identity.generate() for _ in range(4))
        refused = {
            "junk": _offer(node, peers_key(RUN), b"x" * 3800, junk),
            "no work": _offer(node, peers_key(RUN), _record(lazy, work=False), lazy),
            "names another": _offer(node, peers_key(RUN), _record(honest), other),
            "junk in a shard key": _offer(node, records_key(RUN, 1, 4), b"{}", junk),
        }
        code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert {k: (o.stored, o.code) for k, o in refused.items()} == {k: (False, code) for k in refused}
        assert refused["junk"].reason.startswith("not a PeerRecord (")
        assert refused["no work"].reason == (
            f"no valid proof of work (this node asks {BITS} bits for a peer record of run {RUN!r})"
        )
        assert refused["names another"].reason == (
            f"the record names peer {str(honest.peer_id)[:10]}, its signer is {str(other.peer_id)[:10]}"
        )
        assert node.stats.records_refused == 4 and node._local_records(key_id_of(peers_key(RUN))) == []
        # the honest record is stored; under the run's other keys the work is the record's own nonce (below)
        assert _offer(node, peers_key(RUN), _record(honest), honest).stored
        assert not _offer(node, f"{RUN}/plan/0", b"not a peer record", junk, subkey=str(junk.peer_id)).stored
        assert _offer(node, "another-run/plan/0", b"outside this run", junk, subkey=str(junk.peer_id)).stored
        assert [r.subkey for r in node._local_records(key_id_of(peers_key(RUN)))] == [str(honest.peer_id)]
    finally:
        await stop_all([node])


async def test_without_a_check_the_node_stores_what_it_did_before():
    (node,) = await start_swarm(1)
    try:
        junk = Identity.generate()
        assert node.store_check is None and _offer(node, peers_key(RUN), b"x" * 100, junk).stored
    finally:
        await stop_all([node])


async def test_a_read_that_drops_many_records_says_so_in_one_line(caplog):
    """Junk a holder still serves (one that does not check, or checked less): the first 3 dropped records of a read
    have a line each, the rest one summary line, not one WARNING per record (the red team's 2,046 lines)."""
    (node,) = await start_swarm(1)
    try:
        for _ in range(10):
            assert _offer(node, peers_key(RUN), b"x" * 50, Identity.generate()).stored  # no store check here
        honest = Identity.generate()
        assert _offer(node, peers_key(RUN), _record(honest), honest).stored
        with caplog.at_level(logging.WARNING, logger="geomesh_p2p.dht.announce"):
            live = await live_peers(node)
        assert [r.peer_id for r in live] == [str(honest.peer_id)]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 4 and all("dropped: malformed PeerRecord" in x for x in lines[:3])
        assert lines[3] == (
            "a read of the peer records dropped 10 of 11 records (malformed 10); only the first 3 were logged one by one"
        )
    finally:
        await stop_all([node])


def _offer_with(node, key: str, owner: Identity, nonce):
    rec = make_record(
        key, b"a plan head", time.time() + 3600, subkey=str(owner.peer_id), owner=owner, run_id=RUN, pow_nonce=nonce
    )
    return node._store_local(rec, from_peer=None)


async def test_every_run_key_takes_a_signed_record_only_with_its_owners_proof_of_work():
    """Session 30 (the red team of session 28 left it open): 2,048 throwaway signers could pre-fill a future round's
    plan key, so that its leaders cannot store their plans. Plan heads and chunks, proofs and evidence now need the
    owner's proof of work too, carried in ``SignedRecord.pow_nonce``: missing, another identity's, or too few bits
    are refused with the reason and take no slot; the owner's own is stored."""
    (node,) = await start_swarm(1)
    try:
        node.store_check = run_record_store_check(RUN, BITS)
        leader, thief, lazy = (Identity.generate() for _ in range(3))
        good = solve_pow(RUN, bytes(leader.peer_id), BITS)
        weak = next(n for n in range(1 << 20) if not _works(lazy, n))  # a nonce without the bits
        plan = f"{RUN}/plan/7"
        refused = {
            "none": _offer_with(node, plan, lazy, None),
            "too few bits": _offer_with(node, plan, lazy, weak),
            "another identity's": _offer_with(node, plan, thief, good),
            "a proof key": _offer_with(node, f"{RUN}/proofs/3", lazy, None),
        }
        code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert {k: (o.stored, o.code) for k, o in refused.items()} == {k: (False, code) for k in refused}
        assert refused["none"].reason == (
            f"a record under run key {plan!r} carries no proof of work (this node asks {BITS} bits for run {RUN!r})"
        )
        assert "carries an invalid proof of work" in refused["too few bits"].reason
        assert "carries an invalid proof of work" in refused["another identity's"].reason
        assert node._local_records(key_id_of(plan)) == []
        assert _offer_with(node, plan, leader, good).stored
        assert [r.subkey for r in node._local_records(key_id_of(plan))] == [str(leader.peer_id)]
        # bits 0 ask nothing (a run without proof of work)
        node.store_check = run_record_store_check(RUN, 0)
        assert _offer_with(node, f"{RUN}/plan/8", lazy, None).stored
    finally:
        await stop_all([node])


def _works(ident: Identity, nonce: int) -> bool:
    from geomesh_p2p.trust.admission import check_pow

    return check_pow(RUN, bytes(ident.peer_id), nonce, BITS)


async def test_a_node_attaches_its_own_proof_of_work_to_what_it_signs_and_a_checking_node_stores_it():
    """End to end over gRPC: a node given its identity's nonce (``DHTNode(pow_nonce=...)``, as geomesh-peer does after
    the proof of work) stores a plan head at a node that checks the run's keys; one without the nonce is refused
    there, and a record it signs for another identity does not carry its nonce."""
    ident = Identity.generate()
    nonce = solve_pow(RUN, bytes(ident.peer_id), BITS)
    checker = await start_node(store_check=run_record_store_check(RUN, BITS))
    worker = await start_node([checker.address], identity=ident, pow_nonce=nonce, client_only=True)
    lazy = await start_node([checker.address], client_only=True)
    try:
        exp = time.time() + 600
        assert await worker.store(f"{RUN}/plan/2", b"head", exp, subkey=str(ident.peer_id), owner=ident)
        held = checker._local_records(key_id_of(f"{RUN}/plan/2"))
        assert [(r.subkey, r.pow_nonce) for r in held] == [(str(ident.peer_id), nonce)]
        who = lazy.identity
        assert not await lazy.store(f"{RUN}/plan/2", b"head", exp, subkey=str(who.peer_id), owner=who)
        assert len(checker._local_records(key_id_of(f"{RUN}/plan/2"))) == 1
        other = Identity.generate()  # signed here for another identity: the node's own nonce is not attached
        assert not await worker.store(f"{RUN}/plan/3", b"head", exp, subkey=str(other.peer_id), owner=other)
        sent = [r for r in worker._published.values() if r.key == f"{RUN}/plan/3"]
        assert len(sent) == 1 and not sent[0].HasField("pow_nonce")
    finally:
        await stop_all([lazy, worker, checker])
