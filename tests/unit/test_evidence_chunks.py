"""Verified-work evidence of any size in the DHT (issue 25, evidence wire version 2): evidence of 1,024 and
4,096 parts, whose signed header (~92 B per part) is over the 64 KiB DHT value limit, is published and
read back exactly (zlib of the verifier's signed bytes, inline or head + chunks via dht/chunked.py); a
forged, corrupted or missing chunk is refused with a reason and the evidence is picked up once it is
right; the accused's contributions (the first 128: a DHT node's quota per signer) are stored at most 16
at once, each store with its deadline, under keys of 256 parts. The DHT is an in-memory stand-in applying the real DHT's owner rule, value size and
subkey limits (tests/integration/test_plan_chunks.py runs the same framing over real DHT nodes)."""

from __future__ import annotations

import asyncio
import logging
import zlib

import pytest
import torch

from geomesh_p2p.dht.chunked import ChunksPending, chunk_key, parse_head
from geomesh_p2p.dht.records import DEFAULT_LIMITS, required_owner
from geomesh_p2p.dht.state import DHTValue
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.trust import evidence as EV
from geomesh_p2p.trust.verify import WorkVerifier
from geomesh_p2p.trust.verify_task import VerifyConfig
from tests.evidence_util import big_evidence

pytestmark = pytest.mark.timeout(120)
RUN = "evidence-chunks"
ROUND = 4


class LimitedDHT:
    """key -> subkey -> (value, expiration, owner PeerID), with the real DHT's owner rule, 64 KiB per
    value and 2,048 subkeys per key; counts stores, the most in flight at once, and never answers the
    stores of the slots in ``hang``."""

    def __init__(self, hang: frozenset = frozenset()):
        self.data: dict = {}
        self.hang = hang
        self.stores = self.in_flight = self.max_in_flight = 0

    async def store(self, key, value, expiration_time, subkey=None, owner=None):
        self.stores += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if (key, subkey) in self.hang:
                await asyncio.Event().wait()  # a node that never answers: only the deadline ends it
            await asyncio.sleep(0)  # an RPC yields: the next stores start while this one is "in flight"
            assert owner is not None and required_owner(key, subkey) == owner.peer_id, "owner rule"
            assert len(value) <= DEFAULT_LIMITS.max_value_bytes, f"value of {len(value)} bytes"
            slots = self.data.setdefault(key, {})
            slots[subkey] = (value, expiration_time, owner.peer_id)
            assert len(slots) <= DEFAULT_LIMITS.max_subkeys_per_key, "subkeys per key"
            return True
        finally:
            self.in_flight -= 1

    async def get(self, key, latest=True, subkeys=None, quorum=None):
        return {sk: DHTValue(*v) for sk, v in self.data.get(key, {}).items()}  # as DHTNode.get


def _key() -> str:
    return EV.evidence_key(RUN, ROUND)


@pytest.fixture(scope="module")
def ev4096():
    v, a = Identity.generate(), Identity.generate()
    return v, big_evidence(4096, run_id=RUN, round=ROUND, verifier=v, accused=a)


async def _published(v, ev) -> LimitedDHT:
    dht = LimitedDHT()
    assert (await EV.publish_evidence(dht, ev, v, expiration_time=swarm_time() + 60)).evidence
    return dht


@pytest.mark.parametrize("n, chunks, cap", [(1024, 0, None), (4096, 4, 4096)])
async def test_evidence_of_n_parts_is_published_and_read_back_exactly(n, chunks, cap, ev4096, monkeypatch):
    if cap is not None:  # all 4,096 contributions (no DHT quota here): 16 keys of 256 parts
        monkeypatch.setattr(EV, "MAX_CONTRIBUTION_RECORDS", cap)
        monkeypatch.setattr(EV, "MAX_CONTRIBUTION_BYTES", 1 << 30)
    published = min(n, EV.MAX_CONTRIBUTION_RECORDS)  # the default: the first 128 parts (a node's quota)
    if n == 4096:
        v, ev = ev4096
    else:
        v = Identity.generate()
        ev = big_evidence(n, run_id=RUN, round=ROUND, verifier=v)
    signed = ev.to_signed(v)
    assert len(signed) > DEFAULT_LIMITS.max_value_bytes  # version 1 (these bytes as one value) stored nothing
    dht = LimitedDHT()
    out = await EV.publish_evidence(dht, ev, v, expiration_time=swarm_time() + 60)
    assert out == EV.Published(True, chunks, published, published, n - published)
    assert dht.stores == 1 + chunks + published and dht.max_in_flight == EV.STORE_CONCURRENCY
    me = str(v.peer_id)
    head = dht.data[_key()][me][0]
    parsed = parse_head(head, EV.evidence_format())
    assert (parsed.body is None) == (chunks > 0) and len(parsed.chunks) == chunks and len(head) < 60_000
    # the contributions under ceil(published / 256) keys, each part once
    shards = [EV.contributions_key(RUN, ROUND, me, s) for s in range(-(-published // EV.CONTRIBUTIONS_PER_KEY))]
    assert sum(len(dht.data[k]) for k in shards) == published and all(len(dht.data[k]) <= 256 for k in shards)

    reader = EV.EvidenceReader(dht)
    data = await reader.load(_key(), me, head)
    stored = [dht.data[chunk_key(_key(), parsed.sha256, i)][me][0] for i in range(chunks)]
    body = parsed.body if parsed.body is not None else b"".join(stored)
    assert zlib.decompress(body) == data and all(len(c) <= 60_000 for c in stored)
    got = await EV.fetch_contributions(dht, ev)
    assert got == {j: ev.contributions[j] for j in range(published)}  # exact bytes, every part published
    opened = EV.Evidence.open(data, RUN, got)  # the verifier's signature and every accused signature checked
    assert opened == ev and opened.header() == ev.header() and opened.contributions == got
    assert opened.verifier_key == v.public_key_bytes and len(opened.packets) == n
    gets = 0

    async def counted(key, latest=True):
        nonlocal gets
        gets += 1
        return await LimitedDHT.get(dht, key)

    dht.get = counted
    assert await reader.load(_key(), me, head) == data and gets == 0  # the next poll: remembered


async def test_a_forged_corrupted_or_missing_chunk_is_refused_with_a_reason(ev4096, caplog):
    v, ev = ev4096
    dht = await _published(v, ev)
    me = str(v.peer_id)
    head = dht.data[_key()][me][0]
    k1 = chunk_key(_key(), parse_head(head, EV.evidence_format()).sha256, 1)
    value, exp, _owner = dht.data[k1][me]
    forger = Identity.generate()
    for bad, reason in [
        ((value, exp, forger.peer_id), "chunk 2/4 is not signed by the verifier"),  # right bytes, other signer
        ((value[:-1] + bytes([value[-1] ^ 1]), exp, v.peer_id), "chunk 2/4 does not match the head's hash"),
        (None, "chunk 2/4 not found"),
    ]:
        if bad is None:
            del dht.data[k1]
        else:
            dht.data[k1] = {me: bad}
        with pytest.raises(ChunksPending, match=reason):
            await EV.EvidenceReader(dht).load(_key(), me, head)

    # a node's verifier: not queued (logged once, with the reason) until the right chunk is back
    wv = WorkVerifier(
        VerifyConfig(), identity=Identity.generate(), run_id=RUN, model=None, dataset=None, seed=0, lr=1e-3,
        weight_decay=0.1, dht=dht,
    )  # fmt: skip
    wv.keep_round(ROUND, theta=torch.zeros(1), plan=None, part_ranges=[], packets={})  # fetch reads kept rounds
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.trust.verify"):
        assert await wv.fetch() == 0
        assert await wv.fetch() == 0
    lines = [r.getMessage() for r in caplog.records if "not usable yet" in r.getMessage()]
    assert len(lines) == 1 and "chunk 2/4 not found" in lines[0]
    dht.data[k1] = {me: (value, exp, v.peer_id)}
    assert await wv.fetch() == 1 and await wv.fetch() == 0  # queued once
    (data,) = wv._pending.values()
    assert EV.Evidence.open(data, RUN) == ev


async def test_a_version_1_value_and_a_zlib_bomb_are_refused(ev4096, caplog):
    v, ev = ev4096
    with pytest.raises(ValueError, match="not an evidence of wire version 2"):
        parse_head(ev.to_signed(v), EV.evidence_format())
    with pytest.raises(ValueError, match="decompresses to more than"):
        EV.decode_value(zlib.compress(b" " * (EV.MAX_EVIDENCE_BYTES + 10)))  # 8 KB -> 8 MiB
    dht = LimitedDHT()
    me = str(v.peer_id)
    dht.data[_key()] = {me: (b"gmev/2I" + zlib.compress(b" " * (EV.MAX_EVIDENCE_BYTES + 10)), 0.0, v.peer_id)}
    wv = WorkVerifier(
        VerifyConfig(), identity=Identity.generate(), run_id=RUN, model=None, dataset=None, seed=0, lr=1e-3,
        weight_decay=0.1, dht=dht,
    )  # fmt: skip
    wv.keep_round(ROUND, theta=torch.zeros(1), plan=None, part_ranges=[], packets={})
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.trust.verify"):
        assert await wv.fetch() == 0 and await wv.fetch() == 0
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "decompresses to more than" in lines[0] and not wv._pending


async def test_contributions_are_stored_16_at_once_each_within_its_deadline():
    v = Identity.generate()
    ev = big_evidence(300, run_id=RUN, round=ROUND, verifier=v)
    me = str(v.peer_id)
    stuck = (EV.contributions_key(RUN, ROUND, me, 0), "57")  # one node never answers this store
    dht = LimitedDHT(hang=frozenset({stuck}))
    out = await EV.publish_evidence(dht, ev, v, expiration_time=swarm_time() + 60, timeout_s=0.5)
    assert out == EV.Published(True, 0, 127, 128, 300 - 128)  # the first 128 parts tried, one timed out
    assert dht.max_in_flight == 16 and dht.in_flight == 0  # bounded, and the stuck store was cancelled
    got = await EV.fetch_contributions(dht, ev)
    assert set(got) == set(range(128)) - {57} and all(got[j] == ev.contributions[j] for j in got)
    # a head that cannot be stored in time: the evidence is reported as not stored (no exception)
    dht2 = LimitedDHT(hang=frozenset({(_key(), me)}))
    out2 = await EV.publish_evidence(dht2, ev, v, expiration_time=swarm_time() + 60, timeout_s=0.2)
    assert not out2.evidence and out2.contributions == 128
