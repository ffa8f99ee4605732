"""Collective (CSS): partition, spec, the aggregation rule, bitwise-identical results in both modes,
bytes on the wire, and the defences (each refused with its own status, named in the log)."""

from __future__ import annotations

import asyncio
import math
import struct
import time

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.telemetry import events
from geomesh_p2p.exchange import (
    CollectiveService,
    CollectiveSpec,
    PartOwner,
    make_partition,
    token_weighted_mean,
)
from geomesh_p2p.net.identity import EnvelopeError, Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import COLLECTIVE_PULL, COLLECTIVE_PUSH
from geomesh_p2p.wire import collective_pb2

from tests.collective_util import RUN, craft_contribution, deltas_for, pid_order, reference, reference_part
from tests.wait_util import until

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------------- partition


def test_make_partition_block_aligned_and_by_bandwidth():
    ids = [Identity.generate().peer_id for _ in range(4)]
    owners = [(ids[0], "a:1", 100.0), (ids[1], "b:1", 200.0), (ids[2], "c:1", None), (ids[3], "d:1", 100.0)]
    numel = 1_000_003
    parts = make_partition(numel, owners, block_size=2048)
    assert parts[0].start == 0 and parts[-1].end == numel
    for a, b in zip(parts, parts[1:]):
        assert a.end == b.start and a.end % 2048 == 0
    by_id = {p.peer_id: p.size for p in parts}
    assert by_id.get(str(ids[1]), 0) >= by_id.get(str(ids[0]), 0)  # more bandwidth, no smaller part
    # equal bandwidths -> equal parts (up to one block)
    eq = make_partition(numel, [(i, "x:1", 1.0) for i in ids], block_size=2048)
    assert len(eq) == 4 and max(p.size for p in eq) - min(p.size for p in eq) <= 2 * 2048
    one = make_partition(10, [(ids[0], "a:1", 5.0)], block_size=2048)
    assert one == [PartOwner(ids[0], "a:1", 0, 10)]
    with pytest.raises(ValueError):
        make_partition(100, [(ids[0], "a:1", 1.0), (ids[0], "b:1", 1.0)])
    with pytest.raises(ValueError):
        make_partition(0, [(ids[0], "a:1", 1.0)])


def test_spec_validation_and_round_trip():
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    owners = [PartOwner(a, "h:1", 0, 100), PartOwner(b, "h:2", 100, 250)]
    spec = CollectiveSpec(RUN, 3, {a: 10, str(b): 20}, owners, 250, 100.0, 101.0, mode="relay")
    assert set(spec.participants) == {str(a), str(b)}
    again = CollectiveSpec.from_dict(spec.to_dict())
    assert again == spec and again.spec_id == spec.spec_id and len(spec.spec_id) == 32
    other = CollectiveSpec(RUN, 3, {a: 10, str(b): 21}, owners, 250, 100.0, 101.0, mode="relay")
    assert other.spec_id != spec.spec_id
    with pytest.raises(ValueError, match="contiguous"):
        CollectiveSpec(RUN, 3, {a: 1}, [PartOwner(a, "h:1", 0, 100), PartOwner(b, "h:2", 101, 250)], 250, 1.0, 2.0)
    with pytest.raises(ValueError, match="cover"):
        CollectiveSpec(RUN, 3, {a: 1}, owners, 300, 1.0, 2.0)
    with pytest.raises(ValueError, match="mode"):
        CollectiveSpec(RUN, 3, {a: 1}, owners, 250, 1.0, 2.0, mode="gossip")
    with pytest.raises(ValueError):
        PartOwner(a, "", 0, 10)  # a client-only peer cannot own a part


# --------------------------------------------------------------------------- aggregation rule


def _packets(vectors, tokens, B=4):
    return [(n, compression.encode(v, B, n)) for v, n in zip(vectors, tokens)]


def test_token_weighted_mean_exact_rule_small():
    B = 4
    v1 = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, 0.5, -0.5, 0.5])  # scales 1.5, 0.5
    v2 = torch.tensor([-3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, -1.0])  # scales 3.0, 1.0
    v3 = torch.tensor([100.0, 100.0, -100.0, 100.0, 2.0, 2.0, 2.0, 2.0])  # scales 100, 2 (attacker)
    items = _packets([v1, v2, v3], [1, 1, 2], B)
    out = token_weighted_mean(items, 8, clip_k=2.0)
    # medians per block: 3.0 and 1.0 -> caps 6.0 and 2.0; weights 1/4, 1/4, 1/2
    exp = torch.tensor(
        [
            1.5 / 4 - 3.0 / 4 + 6.0 / 2,
            -1.5 / 4 + 3.0 / 4 + 6.0 / 2,
            1.5 / 4 + 3.0 / 4 - 6.0 / 2,
            -1.5 / 4 + 3.0 / 4 + 6.0 / 2,
            0.5 / 4 + 1.0 / 4 + 2.0 / 2,
            0.5 / 4 + 1.0 / 4 + 2.0 / 2,
            -0.5 / 4 + 1.0 / 4 + 2.0 / 2,
            0.5 / 4 - 1.0 / 4 + 2.0 / 2,
        ]
    )
    torch.testing.assert_close(out, exp, rtol=1e-6, atol=1e-6)
    # no clipping: the attacker's 100s pass
    assert float(token_weighted_mean(items, 8, clip_k=None)[0]) > 40
    # even count: median = mean of the two middle scales; tokens 0 -> left out entirely
    items4 = items + [(0, compression.encode(v3 * 1e6, B, 0))]
    assert torch.equal(token_weighted_mean(items4, 8, clip_k=2.0), out)
    even = token_weighted_mean(_packets([v1, v2], [1, 3], B), 8, clip_k=1.0)
    # block 0 median (1.5+3)/2 = 2.25 -> v2's 3.0 clipped to 2.25
    assert math.isclose(float(even[0]), 1.5 * 0.25 - 2.25 * 0.75, rel_tol=1e-6)
    assert torch.equal(token_weighted_mean([], 8, clip_k=4.0), torch.zeros(8))
    assert torch.equal(token_weighted_mean([(0, items[0][1])], 8, clip_k=4.0), torch.zeros(8))


def test_token_weighted_mean_matches_numpy_reference_bitwise():
    g = torch.Generator().manual_seed(3)
    P, B = 10_001, 256
    vs = [torch.randn(P, generator=g) * s for s in (1.0, 0.3, 7.0, 2.0, 0.01)]
    toks = [5, 17, 3, 0, 1000]
    items = [(n, compression.encode(v, B, n)) for v, n in zip(vs, toks)]
    ids = [Identity.generate().peer_id.to_string() for _ in vs]
    order = pid_order(ids)
    owners = [PartOwner(ids[0], "h:1", 0, P)]
    for k in (None, 1.5, 4.0):
        spec = CollectiveSpec(
            RUN, 0, {p: 10**9 for p in ids}, owners, P, 1.0, 2.0, mode="relay", block_size=B, clip_k=k
        )
        deltas = dict(zip(ids, vs))
        tokens = dict(zip(ids, toks))
        ref, used = reference_part(spec, 0, deltas, tokens, ids)
        got = token_weighted_mean([(tokens[p], items[ids.index(p)][1]) for p in order], P, clip_k=k)
        assert torch.equal(got, ref), k


_IDS = [Identity.generate().peer_id.to_string() for _ in range(6)]


@settings(max_examples=40, deadline=None)
@given(
    c=st.integers(1, 5),
    size=st.integers(1, 3000),
    block=st.sampled_from([1, 7, 64, 256]),
    clip=st.sampled_from([None, 0.5, 1.0, 4.0]),
    seed=st.integers(0, 2**31 - 1),
    toks=st.lists(st.integers(0, 10**7), min_size=5, max_size=5),
    caps=st.lists(st.integers(0, 10**7), min_size=5, max_size=5),
)
def test_token_weighted_mean_property_matches_reference(c, size, block, clip, seed, toks, caps):
    g = torch.Generator().manual_seed(seed)
    ids = _IDS[:c]
    deltas = {p: torch.randn(size, generator=g) * float(10 ** (k - 2)) for k, p in enumerate(ids)}
    spec = CollectiveSpec(
        RUN,
        0,
        dict(zip(ids, caps)),
        [PartOwner(_IDS[5], "h:1", 0, size)],
        size,
        1.0,
        2.0,
        mode="relay",
        block_size=block,
        clip_k=clip,
    )
    tokens = dict(zip(ids, toks))
    ref, used = reference_part(spec, 0, deltas, tokens, ids)
    items = [(n, compression.encode(deltas[p], block, tokens[p])) for p, n in used]
    got = token_weighted_mean(items, size, clip_k=clip)
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------------- all-reduce


@pytest.mark.parametrize(
    "mode, enc", [("relay", "sign"), ("reencode", "sign"), ("reencode", "int8"), ("reencode", "fp16")]
)
async def test_all_reduce_identical_everywhere_and_equal_to_reference(swarms, mode, enc):
    sw = await swarms(3, 1)  # 3 owners + 1 client-only peer
    numel = 50_000
    caps = {p: c for p, c in zip(sw.pids, (400, 1000, 50, 300))}
    spec = sw.spec(numel, mode=mode, aggregate_encoding=enc, caps=caps, block_size=1024)
    deltas = deltas_for(sw.pids, numel, seed=1)
    tokens = dict(zip(sw.pids, (100, 200, 300, 400)))  # 300 > cap 50: capped
    results = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens[p]) for s, p in zip(sw.services, sw.pids)])
    first = results[0]
    for r in results:
        assert torch.equal(r.aggregate, first.aggregate)
        assert r.missing_parts == [] and all(r.pushed.values())
        assert r.contributors == first.contributors
    expected_used = [(p, min(tokens[p], caps[p])) for p in pid_order(sw.pids)]
    for j in range(3):
        assert first.contributors[j] == expected_used
    ref = reference(spec, deltas, tokens, {j: sw.pids for j in range(3)})
    assert torch.equal(first.aggregate, ref)
    # the client-only peer served nothing and was never called
    client = sw.transports[3]
    assert client.address is None and client.stats.rejected == 0
    assert all(s.transport.stats.rejected == 0 for s in sw.services)


async def test_relay_and_reencode_fp32_agree_with_the_exact_mean(swarms):
    """fp32 push + fp32 aggregate is a plain butterfly all-reduce: the exact token-weighted mean."""
    sw = await swarms(2, 1)
    numel = 9_000
    spec = sw.spec(numel, mode="reencode", push_encoding="fp32", aggregate_encoding="fp32")
    deltas = deltas_for(sw.pids, numel, seed=2)
    tokens = dict(zip(sw.pids, (1, 2, 3)))
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens[p]) for s, p in zip(sw.services, sw.pids)])
    exact = sum(deltas[p] * tokens[p] for p in sw.pids) / 6
    for r in res:
        assert torch.equal(r.aggregate, res[0].aggregate)
        torch.testing.assert_close(r.aggregate, exact, rtol=1e-5, atol=1e-6)


async def test_bytes_reencode_sign_close_to_two_packets_per_peer(swarms):
    """Per peer, reencode/sign moves about 2 * (N-1)/N * P/8 bytes each way (plus scales and
    envelopes): pushes of N-1 parts out, N-1 pushes of its own part in, N-1 pulls served, N-1 pulled."""
    n = 4
    sw = await swarms(n)
    numel = 1 << 20
    B = 2048
    spec = sw.spec(numel, mode="reencode", aggregate_encoding="sign", block_size=B, deadline_s=5.0)
    deltas = deltas_for(sw.pids, numel, seed=4)
    before = [t.stats.snapshot() for t in sw.transports]
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 7) for s, p in zip(sw.services, sw.pids)])
    await asyncio.sleep(0)  # let the last replies be counted
    part = numel // n
    packet = 32 + part // 8 + 4 * (part // B)
    ideal = 2 * (n - 1) * packet  # bytes each way per peer (pushes out + pull replies served)
    for t, b in zip(sw.transports, before):
        sent = t.stats.bytes_sent - b[0]
        recv = t.stats.bytes_received - b[1]
        # overhead: 4 kinds of message x (n-1) each way (push, its reply, pull, its reply), each
        # with an outer envelope (~250 B); the packets also carry an inner signed envelope.
        assert ideal <= sent <= ideal + 4 * (n - 1) * 700, (sent, ideal)
        assert ideal <= recv <= ideal + 4 * (n - 1) * 700, (recv, ideal)
        assert 2 * (n - 1) * 4 * part / sent > 30  # vs. an fp32 butterfly (same pattern, 4 B/element)
    for r in res:
        assert r.bytes_sent > 0 and r.bytes_received > 0


async def test_push_before_the_owner_knows_the_round_is_held(swarms):
    """A push for a round the owner has not registered yet is held (then retried), not lost."""
    sw = await swarms(2)
    numel = 4096
    spec = sw.spec(numel, mode="relay", deadline_s=2.5)
    deltas = deltas_for(sw.pids, numel)
    early = asyncio.ensure_future(sw.services[0].all_reduce(spec, deltas[sw.pids[0]], 1))
    # peer 1 starts its round only once peer 0's push to it is waiting (no fixed sleep)
    await until(lambda: sw.services[1]._held > 0, 10, "peer 0's push held by peer 1")
    late = await sw.services[1].all_reduce(spec, deltas[sw.pids[1]], 1)
    r0 = await early
    assert torch.equal(r0.aggregate, late.aggregate) and late.missing_parts == []
    assert [p for p, _ in late.contributors[1]] == pid_order(sw.pids)


async def test_old_rounds_are_pruned_and_refused(swarms):
    sw = await swarms(2, max_rounds_kept=2)
    numel = 4096
    for r in (1, 2, 3):
        spec = sw.spec(numel, round=r, mode="reencode")
        res = await asyncio.gather(*[s.all_reduce(spec, torch.ones(numel) * r, 1) for s in sw.services])
        assert res[0].missing_parts == []
    assert sw.services[0].rounds_kept() == [2, 3]
    stale = sw.spec(numel, round=1)
    with pytest.raises(ValueError, match="older"):
        sw.services[0].register(stale)
    pkt = compression.encode(torch.ones(stale.owners[0].size), 2048, 1).to_bytes()
    payload = collective_pb2.PushPartRequest(
        contribution=craft_contribution(sw.ids[1], stale, 0, pkt)
    ).SerializeToString()
    with pytest.raises(RpcError) as ei:
        await sw.transports[1].call(sw.addresses[0], COLLECTIVE_PUSH, payload, round=1)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "round 1 is over" in ei.value.reason


async def test_same_round_twice_or_not_a_participant_is_an_error(swarms):
    sw = await swarms(2)
    spec = sw.spec(4096)
    outsider = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    svc = CollectiveService(outsider)
    try:
        with pytest.raises(ValueError, match="not a participant"):
            await svc.all_reduce(spec, torch.zeros(4096), 1)
    finally:
        await outsider.stop()
    with pytest.raises(ValueError, match="elements"):
        await sw.services[0].all_reduce(spec, torch.zeros(10), 1)
    with pytest.raises(compression.CodecError):
        await sw.services[0].all_reduce(spec, torch.full((4096,), float("nan")), 1)
    other = sw.spec(4096, clip_k=2.0)
    sw.services[0].register(spec)
    with pytest.raises(ValueError, match="different spec"):
        sw.services[0].register(other)


# ---------------------------------------------------------------------------------- defences


def _nan_scale(packet: bytes) -> bytes:
    b = bytearray(packet)
    b[32:36] = struct.pack("<f", float("nan"))  # first scale (scales follow the 32-byte header)
    return bytes(b)


def _forged(ident, spec, j, pkt):
    from geomesh_p2p.wire import envelope_pb2

    m = envelope_pb2.SignedMessage.FromString(craft_contribution(ident, spec, j, pkt))
    m.envelope.signature = bytes(64)
    return m.SerializeToString()


@pytest.mark.parametrize(
    "case, code, reason",
    [
        ("unknown_sender", grpc.StatusCode.PERMISSION_DENIED, "is not a participant"),
        ("other_round", grpc.StatusCode.INVALID_ARGUMENT, "round 9"),
        ("wrong_length", grpc.StatusCode.INVALID_ARGUMENT, "wrong length"),
        ("wrong_range", grpc.StatusCode.INVALID_ARGUMENT, "wrong range"),
        ("nan_scale", grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
        ("forged", grpc.StatusCode.UNAUTHENTICATED, "bad signature"),
        ("someone_elses", grpc.StatusCode.PERMISSION_DENIED, "but pushed by"),
        ("other_spec", grpc.StatusCode.FAILED_PRECONDITION, "another spec"),
        ("not_owner", grpc.StatusCode.NOT_FOUND, "does not own part"),
        ("wrong_encoding", grpc.StatusCode.INVALID_ARGUMENT, "encoding"),
        ("wrong_block_size", grpc.StatusCode.INVALID_ARGUMENT, "block size"),
        ("tampered", grpc.StatusCode.DATA_LOSS, "tampered"),
    ],
)
async def test_bad_pushes_refused_named_in_log_and_round_still_completes(swarms, case, code, reason):
    sw = await swarms(2, 1)
    numel = 8192
    spec = sw.spec(numel, mode="relay", deadline_s=2.0)
    for s in sw.services[:2]:
        s.register(spec)
    owner_ix, j = 0, 0
    size = spec.owners[j].size
    good = compression.encode(torch.randn(size), spec.block_size, 5).to_bytes()
    sender = sw.ids[2]  # the client-only participant
    caller = sw.transports[2]
    rogue = Identity.generate()
    if case == "unknown_sender":
        caller = Transport(rogue, RUN, TransportConfig(client_only=True))
        contribution = craft_contribution(rogue, spec, j, good)
    elif case == "other_round":
        contribution = craft_contribution(sender, spec, j, good, round=9)
    elif case == "wrong_length":
        contribution = craft_contribution(
            sender, spec, j, compression.encode(torch.randn(size - 8), spec.block_size, 5).to_bytes()
        )
    elif case == "wrong_range":
        contribution = craft_contribution(sender, spec, j, good, start=1, end=size + 1)
    elif case == "nan_scale":
        contribution = craft_contribution(sender, spec, j, _nan_scale(good))
    elif case == "forged":
        contribution = _forged(sender, spec, j, good)
    elif case == "someone_elses":
        contribution = craft_contribution(sw.ids[1], spec, j, good)
    elif case == "other_spec":
        contribution = craft_contribution(sender, spec, j, good, spec_id=bytes(32))
    elif case == "not_owner":
        owner_ix, j = 1, 0  # part 0 belongs to peer 0, pushed to peer 1
        contribution = craft_contribution(sender, spec, j, good)
    elif case == "wrong_encoding":
        contribution = craft_contribution(sender, spec, j, good, encoding="fp32")
    elif case == "wrong_block_size":
        contribution = craft_contribution(sender, spec, j, compression.encode(torch.randn(size), 512, 5).to_bytes())
    elif case == "tampered":
        from geomesh_p2p.wire import envelope_pb2

        m = envelope_pb2.SignedMessage.FromString(craft_contribution(sender, spec, j, good))
        m.payload = m.payload[:-1] + bytes([m.payload[-1] ^ 1])
        contribution = m.SerializeToString()
    payload = collective_pb2.PushPartRequest(contribution=contribution).SerializeToString()
    try:
        with pytest.raises(RpcError) as ei, events.capture("push_refused") as refused:
            await caller.call(sw.addresses[owner_ix], COLLECTIVE_PUSH, payload, round=spec.round)
    finally:
        if caller is not sw.transports[2]:
            await caller.stop()
    assert ei.value.code == code, ei.value
    assert reason in ei.value.reason
    culprit = str((rogue if case == "unknown_sender" else sw.ids[2]).peer_id)
    # the owner's WARNING names the sender and the status it answered
    assert [(e["peer"], e["round"], e["sender"], e["code"], e["level"]) for e in refused] == [
        (sw.pids[owner_ix], spec.round, culprit, code.name, "WARNING")
    ], refused
    assert refused[0]["reason"] == ei.value.reason
    # the server keeps serving: the honest round completes, with no trace of the bad push
    deltas = deltas_for(sw.pids, numel, seed=5)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 3) for s, p in zip(sw.services, sw.pids)])
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
    assert torch.equal(res[0].aggregate, reference(spec, deltas, dict.fromkeys(sw.pids, 3), {0: sw.pids, 1: sw.pids}))


async def test_attacker_scales_clipped_and_tokens_capped_in_both_modes(swarms):
    sw = await swarms(3)
    numel = 6144
    attacker = sw.pids[2]
    caps = {sw.pids[0]: 100, sw.pids[1]: 100, attacker: 100}
    deltas = deltas_for(sw.pids, numel, seed=6)
    deltas[attacker] = deltas[attacker] * 1e6
    tokens = {sw.pids[0]: 100, sw.pids[1]: 100, attacker: 10**12}
    out = {}
    for r, mode in enumerate(("relay", "reencode")):
        spec = sw.spec(numel, mode=mode, round=r + 1, caps=caps, clip_k=4.0, block_size=1024)
        res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens[p]) for s, p in zip(sw.services, sw.pids)])
        assert all(torch.equal(x.aggregate, res[0].aggregate) for x in res)
        assert dict(res[0].contributors[0])[attacker] == 100
        ref = reference(spec, deltas, tokens, {j: sw.pids for j in range(3)})
        assert torch.equal(res[0].aggregate, ref)
        out[mode] = res[0].aggregate
    honest_scale = max(float(deltas[p].abs().max()) for p in sw.pids[:2])
    assert float(out["relay"].abs().max()) < 4 * honest_scale  # bounded by k x median, not 1e6


async def test_relay_reader_drops_a_tampered_contribution_consistently(swarms):
    """An owner that relays a contribution with a broken signature: every reader refuses the whole part
    the same way (the owner verified what it took, so the signed result proves it altered it)."""
    sw = await swarms(2)
    numel = 4096
    spec = sw.spec(numel, mode="relay", deadline_s=2.0)
    svc = sw.services[0]
    svc.register(spec)
    j = 1
    size = spec.owners[j].size
    pk = [compression.encode(torch.randn(size), spec.block_size, 2).to_bytes() for _ in range(2)]
    good = craft_contribution(sw.ids[0], spec, j, pk[0], 2)
    bad = _forged(sw.ids[1], spec, j, pk[1])
    res = collective_pb2.PartResult(
        round=spec.round,
        part=j,
        start=spec.owners[j].start,
        end=spec.owners[j].end,
        spec_id=spec.spec_id,
        mode="relay",
        contributions=[collective_pb2.Contribution(signed_message=m) for m in (good, bad)],
    )
    signed = (
        sw.ids[1]
        .sign_message(
            run_id=RUN, round=spec.round, kind="geomesh.collective/PartResult", payload=res.SerializeToString()
        )
        .SerializeToString()
    )
    for reader in (svc, sw.services[1]):
        with pytest.raises(EnvelopeError, match="forged or tampered") as ei:
            reader._read_result(spec, j, signed)
        assert ei.value.code == grpc.StatusCode.DATA_LOSS


async def test_pull_from_non_participant_refused(swarms):
    sw = await swarms(1)
    spec = sw.spec(2048)
    sw.services[0].register(spec)
    rogue = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        req = collective_pb2.PullPartRequest(round=spec.round, part=0, wait_s=0.0, spec_id=spec.spec_id)
        with pytest.raises(RpcError) as ei:
            await rogue.call(sw.addresses[0], COLLECTIVE_PULL, req.SerializeToString(), round=spec.round)
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await rogue.stop()


async def test_last_compute_end_is_the_latest_contributors_stated_time(swarms):
    """Idle accounting: every peer learns when the last contributor finished computing."""
    sw = await swarms(3)
    spec = sw.spec(3 * 4096, mode="reencode")
    t = time.time()
    ends = [t - 3.0, t - 1.0, t - 2.0]
    results = await asyncio.gather(
        *[svc.all_reduce(spec, torch.randn(spec.numel), 10, compute_end=e) for svc, e in zip(sw.services, ends)]
    )
    assert [r.last_compute_end for r in results] == [t - 1.0] * 3


async def test_parts_too_big_for_one_message_are_split_and_still_exact():
    """fp32 parts larger than the gRPC message limit fail whole (the push is refused and the part is
    missing); cut with split_owners(max_part_elements(...)) the same vectors reduce exactly."""
    from geomesh_p2p.exchange import make_partition, max_part_elements, split_owners
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    limit = 256 << 10
    ids = [Identity.generate() for _ in range(3)]
    ts = [Transport(i, RUN, TransportConfig(port=0, max_message_bytes=limit, default_timeout_s=5.0)) for i in ids]
    svcs = [CollectiveService(t) for t in ts]
    try:
        addrs = [await t.start() for t in ts]
        pids = [str(i.peer_id) for i in ids]
        numel = 240_000  # fp32 parts of ~320 KB each, over the 256 KiB limit
        owners = make_partition(numel, [(p, a, 1.0) for p, a in zip(pids, addrs)], block_size=1024)
        deltas = deltas_for(pids, numel, seed=5)
        tokens = dict(zip(pids, (100, 200, 300)))

        def spec(round_, own):
            now = time.time()
            return CollectiveSpec(
                RUN,
                round_,
                {p: 10**9 for p in pids},
                own,
                numel,
                now + 1.5,
                now + 2.5,
                mode="reencode",
                aggregate_encoding="fp32",
                push_encoding="fp32",
                block_size=1024,
            )

        whole = spec(1, owners)
        res = await asyncio.gather(*[s.all_reduce(whole, deltas[p], tokens[p]) for s, p in zip(svcs, pids)])
        assert all(sorted(r.missing_parts) == [0, 1, 2] for r in res)  # every remote push was too big

        n = max_part_elements(
            push_encoding="fp32",
            mode="reencode",
            aggregate_encoding="fp32",
            n_participants=3,
            block_size=1024,
            max_message_bytes=limit,
        )
        assert n == int((0.9 * limit - (64 << 10)) // 4) // 1024 * 1024  # 41,984 elements
        split = split_owners(owners, n)
        assert len(split) == 6 and [o.peer_id for o in split] == [pids[0]] * 2 + [pids[1]] * 2 + [pids[2]] * 2
        assert all(o.end - o.start <= n for o in split) and split[-1].end == numel
        cut = spec(2, split)
        res = await asyncio.gather(*[s.all_reduce(cut, deltas[p], tokens[p]) for s, p in zip(svcs, pids)])
        ref = reference(cut, deltas, tokens, {j: pids for j in range(len(split))})
        for r in res:
            assert r.missing_parts == [] and torch.equal(r.aggregate, ref)
    finally:
        for s in svcs:
            await s.close()
        for t in ts:
            await t.stop(grace=0)
