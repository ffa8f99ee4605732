"""Link bandwidth measured from real transfers (geomesh_p2p.net.links, the collective's timing, the node's EMA)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from geomesh_p2p.model.capability import MAX_TPS_DROP_PER_UPDATE, ThroughputEMA
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.links import MAX_PROBE_BYTES, LinkProbeService, LinkSample, busy_seconds, link_sample, probe_link
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import LINK_PROBE
from geomesh_p2p.wire import collective_pb2, link_pb2

pytestmark = pytest.mark.timeout(60)


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert busy_seconds([(5, 6), (0, 2), (1, 3)]) == 4.0  # order does not matter
    assert busy_seconds([(0, 10), (2, 3), (4, 5)]) == 10.0  # nested
    assert busy_seconds([(0, 1), (1, 2)]) == 2.0  # touching
    assert busy_seconds([(3, 1), (0, 0.5)]) == 0.5  # an inverted interval counts 0


def test_link_sample_bytes_over_busy_time():
    s = link_sample([(1000, 0.0, 1.0), (3000, 0.5, 2.0)])
    assert s == LinkSample(4000, 2.0, 2)
    assert s.bytes_per_s == 2000.0
    assert link_sample([]) is None
    assert link_sample([(10, 0.0, 1.0)], min_bytes=11) is None
    assert link_sample([(10, 1.0, 1.0)]) is None  # no busy time: nothing to learn
    with pytest.raises(ValueError):
        link_sample([(-1, 0.0, 1.0)])
    with pytest.raises(ValueError):
        link_sample([(1, 0.0, math.inf)])


async def _started(service=LinkProbeService, **client_only) -> tuple[Transport, str | None]:
    """A started transport on 127.0.0.1 (port 0: the OS picks) serving ``service`` (1 MiB probes), or a
    client-only one when ``client_only`` gives its TransportConfig fields; returns it and its address."""
    if client_only:
        t = Transport(Identity.generate(), "links-test", TransportConfig(client_only=True, **client_only))
    else:
        t = Transport(Identity.generate(), "links-test", TransportConfig(port=0))
        service(t, max_bytes=1 << 20)
    return t, await t.start()


@pytest.fixture
async def probe_server():
    t, address = await _started()
    c, _ = await _started(added_latency_s=0.02)
    try:
        yield t, c, address
    finally:
        await c.stop(grace=0)
        await t.stop(grace=0)


async def test_probe_measures_real_transfers(probe_server):
    server, client, address = probe_server
    sent0 = client.stats.snapshot()[0]
    res = await probe_link(client, address, nbytes=256 << 10, repeats=2)
    # 3 empty probes + 3 uploads of 256 KiB (sizing + 2 repeats) + 3 downloads went over the wire.
    sent, received = (a - b for a, b in zip(client.stats.snapshot(), (sent0, 0)))
    assert 3 * (256 << 10) <= sent < 3 * (256 << 10) + 9 * 1024
    assert received >= 3 * (256 << 10)
    # The 20 ms added before every call is in the RTT, and taken out of the bandwidth.
    assert res.rtt_s >= 0.02
    assert res.upload_bps > 0 and res.download_bps > 0 and res.nbytes == 256 << 10
    assert res.address == address


async def test_probe_over_the_cap_is_refused_and_the_server_keeps_serving(probe_server):
    server, client, address = probe_server
    req = link_pb2.LinkProbeRequest(reply_bytes=(1 << 20) + 1).SerializeToString()
    with pytest.raises(RpcError) as e:
        await client.call(address, LINK_PROBE, req, timeout=5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the most is 1048576" in e.value.reason
    with pytest.raises(RpcError) as e:
        await client.call(address, LINK_PROBE, b"\xff\xff\xff", timeout=5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    res = await probe_link(client, address, nbytes=1024, repeats=1)
    assert res.nbytes == 1024
    with pytest.raises(ValueError):
        await probe_link(client, address, nbytes=MAX_PROBE_BYTES + 1)


async def test_collective_reports_upload_and_download_samples():
    """Three peers all-reduce over loopback: each one's upload sample is exactly the bytes of the
    PushPart payloads it sent to the two other owners, its download sample the two results pulled."""
    from geomesh_p2p.exchange import CollectiveService, CollectiveSpec, make_partition

    ids = [Identity.generate() for _ in range(3)]
    ts = [Transport(i, "links-test", TransportConfig(port=0)) for i in ids]
    services = [CollectiveService(t) for t in ts]
    try:
        addrs = [await t.start() for t in ts]
        pids = [str(i.peer_id) for i in ids]
        numel = 3 * 4096
        owners = make_partition(numel, [(p, a, 1.0) for p, a in zip(pids, addrs)])
        spec = CollectiveSpec(
            run_id="links-test",
            round=0,
            participants={p: 100 for p in pids},
            owners=owners,
            numel=numel,
            mode="reencode",
            aggregate_encoding="sign",
            push_encoding="sign",
            block_size=2048,
            deadline=time.time() + 20,
            pull_deadline=time.time() + 25,
        )
        deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        results = await asyncio.gather(*(s.all_reduce(spec, d, tokens=100) for s, d in zip(services, deltas)))
        for k, r in enumerate(results):
            assert r.upload is not None and r.download is not None
            assert r.upload.transfers == 2 and r.download.transfers == 2
            # exact payload bytes: two PushPart requests (a signed contribution of 1 part each)
            pushed = sum(
                len(
                    collective_pb2.PushPartRequest(
                        contribution=services[k]._contribution_bytes(
                            spec, j, deltas[k], 100, services[k]._rounds[0].compute_end
                        )
                    ).SerializeToString()
                )
                for j in range(3)
                if owners[j].peer_id != pids[k]
            )
            assert r.upload.nbytes == pushed
            assert 0 < r.upload.seconds <= r.wall_s and 0 < r.download.seconds <= r.wall_s
    finally:
        for s in services:
            await s.close()
        for t in ts:
            await t.stop(grace=0)


def _node_with(upload_bps=None, download_bps=None):
    """The node's re-profiling rules (:class:`Reprofiler`) past its first round, with these stated links."""
    from geomesh_p2p.node.peer import NodeConfig
    from geomesh_p2p.round.rules import Reprofiler, RoundState

    node = Reprofiler(
        NodeConfig(upload_bps=upload_bps, download_bps=download_bps, min_link_sample_bytes=1000),
        RoundState(round=1),
        ema=ThroughputEMA(
            alpha=0.5, tokens_per_s={8: 100.0}, upload_bps=upload_bps or 1000.0, download_bps=download_bps or 1000.0
        ),
    )
    node.measured = {"up", "down", "tps"}  # past the first round: plain EMA
    return node


def test_node_folds_measured_links_into_its_ema():
    node = _node_with()
    ar = SimpleNamespace(upload=LinkSample(3000, 1.5, 2), download=LinkSample(500, 0.1, 1))
    node.update_links(ar)
    # up: 3000 bytes in 1.5 s busy = 2000 B/s (the bootstrap's RTT is not taken out); EMA 0.5 * 2000 + 0.5 * 1000
    assert node.ema.upload_bps == 1500.0
    # down: 500 bytes is under min_link_sample_bytes: unchanged
    assert node.ema.download_bps == 1000.0


def test_one_sample_moves_the_figure_at_most_link_step_ratio():
    """An owner that lies about its hold time skews one sample; the record moves by at most 4x."""
    node = _node_with()
    node.update_links(SimpleNamespace(upload=LinkSample(1_000_000, 0.001, 1), download=LinkSample(4000, 400.0, 1)))
    assert node.ema.upload_bps == 0.5 * 4000.0 + 0.5 * 1000.0  # 1e9 B/s claimed, 4x the figure taken
    assert node.ema.download_bps == 0.5 * 250.0 + 0.5 * 1000.0  # 10 B/s claimed, 1/4 of the figure taken


def test_stated_bandwidth_is_not_overwritten():
    node = _node_with(upload_bps=5e6)
    node.update_links(SimpleNamespace(upload=LinkSample(10_000, 1.0, 1), download=LinkSample(3_000, 1.0, 1)))
    assert node.ema.upload_bps == 5e6
    assert node.ema.download_bps == 0.5 * 3_000 + 0.5 * 1000.0


def test_first_measurement_replaces_the_start_up_figure():
    """The probe's (or start-up profile's) figure is a prior: the first round's sample replaces it,
    later samples are averaged in."""
    node = _node_with()
    node.measured = set()
    node.update_links(SimpleNamespace(upload=LinkSample(6000, 2.0, 1), download=None))
    assert node.ema.upload_bps == 3000.0 and node.measured == {"up"}
    node.update_links(SimpleNamespace(upload=LinkSample(1000, 1.0, 1), download=None))
    assert node.ema.upload_bps == 0.5 * 1000.0 + 0.5 * 3000.0
    node.update_throughput(8, SimpleNamespace(tokens=512, compute_s=4.0))
    assert node.ema.tokens_per_s == {8: 128.0}
    node.update_throughput(8, SimpleNamespace(tokens=512, compute_s=2.0))
    assert node.ema.tokens_per_s == {8: 0.5 * 256.0 + 0.5 * 128.0}


def test_announced_throughput_grows_at_most_2x_per_round():
    """A self-measured compute time is not evidence: a free rider reporting 1 ms for its planned work
    moves its announced tokens/s by at most MAX_TPS_GROWTH_PER_UPDATE (2x) per round, the first
    measurement included; slowing down moves it by at most MAX_TPS_DROP_PER_UPDATE (1.4x) per round (session 27: a
    plan made from the record one update older must still pass the followers' check)."""
    node = _node_with()
    node.measured = set()
    for expected in (200.0, 400.0, 800.0):
        node.update_throughput(8, SimpleNamespace(tokens=204_800, compute_s=1e-3))
        assert node.ema.tokens_per_s == {8: expected}
    node.update_throughput(8, SimpleNamespace(tokens=80, compute_s=1.0))  # EMA 440: under 800 / 1.4
    assert node.ema.tokens_per_s == {8: 800.0 / MAX_TPS_DROP_PER_UPDATE}
    node.update_throughput(8, SimpleNamespace(tokens=480, compute_s=1.0))  # EMA 525.7: within the bound, as measured
    assert node.ema.tokens_per_s == {8: pytest.approx(0.5 * 480.0 + 0.5 * 800.0 / MAX_TPS_DROP_PER_UPDATE)}


async def test_probe_flood_is_refused_per_caller_and_by_reply_budget():
    t = Transport(Identity.generate(), "links-test", TransportConfig(port=0))
    LinkProbeService(t, max_bytes=1 << 20, max_per_minute=5, max_reply_bytes_per_10s=3 << 20)
    address = await t.start()
    a = Transport(Identity.generate(), "links-test", TransportConfig(client_only=True))
    b = Transport(Identity.generate(), "links-test", TransportConfig(client_only=True))
    await a.start()
    await b.start()
    try:
        big = link_pb2.LinkProbeRequest(reply_bytes=1 << 20).SerializeToString()
        for _ in range(3):  # 3 MiB of replies: the whole 10 s budget
            await a.call(address, LINK_PROBE, big, timeout=5)
        with pytest.raises(RpcError) as e:
            await b.call(address, LINK_PROBE, big, timeout=5)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget" in e.value.reason
        empty = link_pb2.LinkProbeRequest().SerializeToString()
        await a.call(address, LINK_PROBE, empty, timeout=5)  # empty probes cost no budget
        await a.call(address, LINK_PROBE, empty, timeout=5)  # the 5th call of this minute
        with pytest.raises(RpcError) as e:
            await a.call(address, LINK_PROBE, empty, timeout=5)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in a minute" in e.value.reason
        await b.call(address, LINK_PROBE, empty, timeout=5)  # another caller is still served
    finally:
        await a.stop(grace=0)
        await b.stop(grace=0)
        await t.stop(grace=0)


class _LyingProbe(LinkProbeService):
    """Claims it held every probe for a day (so the transfer would seem to take no time)."""

    async def _handle(self, verified, context):
        resp = link_pb2.LinkProbeResponse.FromString(await super()._handle(verified, context))
        resp.held_s = 86400.0
        return resp.SerializeToString()


async def test_a_lying_probe_server_inflates_the_figure_at_most_twofold():
    t, honest = await _started()
    liar_t, liar = await _started(_LyingProbe)
    c, _ = await _started(added_latency_s=0.05)
    try:
        res = await probe_link(c, liar, nbytes=64 << 10, repeats=1)
        # every transfer counts at least half its call time: <= 2 * bytes / call time, and a call
        # takes at least the 50 ms added latency
        assert res.upload_bps <= 2 * (64 << 10) / 0.05 and res.download_bps <= 2 * (64 << 10) / 0.05
        assert math.isfinite(res.upload_bps) and res.upload_bps > 0
        ref = await probe_link(c, honest, nbytes=64 << 10, repeats=1)
        assert ref.upload_bps > 0
    finally:
        await c.stop(grace=0)
        await liar_t.stop(grace=0)
        await t.stop(grace=0)
