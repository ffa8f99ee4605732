"""A run's records key takes only peer records with the run's proof of work (red team, session 28).

2,046 junk records, each signed by a throwaway key (no work) and stored for 24 h under ``<run>/peers``, filled the
key's 2,048 subkeys at every node: a newcomer's record was then refused ("key already holds 2048 subkeys") and it
never trained. A node now checks the content of a signed record offered under the records key (and its shard keys)
before it takes a slot: a PeerRecord, naming its signer, under its signer's subkey, with proof of work for the run's
bits (:func:`geomesh_p2p.trust.admission.peer_record_store_check`). Other keys are as before.
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
from geomesh_p2p.trust.admission import peer_record_store_check, solve_pow
from tests.dht_helpers import RUN, start_swarm, stop_all
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
        # the honest record is stored, and so is anything under another key (plans, proofs: their own checks)
        assert _offer(node, peers_key(RUN), _record(honest), honest).stored
        assert _offer(node, f"{RUN}/plan/0", b"not a peer record", junk, subkey=str(junk.peer_id)).stored
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
