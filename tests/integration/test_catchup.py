"""Issue 14 #3: a download that crosses a round boundary finishes from the donor's kept copy of its round,
and a peer behind by a few rounds catches up by the donors' outer updates, bitwise (digest equal), refusing
a forged or tampered update with a reason. In-process: real transports on 127.0.0.1, no processes."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.model.optim import outer_step_per_part
from geomesh_p2p.model.state import GlobalState
from geomesh_p2p.sync.download import OuterUpdate, Snapshot, StateSyncError, catch_up_updates, download_state
from geomesh_p2p.sync.server import StateServer, UpdateLog
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.wire import state_pb2
from tests.state_util import StallingServer

RUN = "catchup-test"
CHUNK = 16 << 10
P = 1 << 15
BLOCK = 256
#: Seconds past this module's test timeouts (60 s): a stall limit or busy window this long is never waited out here
HANG_S = 300.0
#: Hang guard (seconds) of a download that must move on at the adaptive stall limit (STALL_FLOOR_S, 2 s): failing
#: it means the download waited for a stall timeout or busy window of HANG_S instead
GUARD_S = 40.0


def _state(round=5, seed=1, k=1, p=P) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    gs = GlobalState(p, k)
    gs.load(round, torch.randn(p, generator=g), torch.randn(k * p, generator=g) * 1e-2)
    return gs


def _sign_mean(seed: int, p: int = P, peers: int = 3) -> torch.Tensor:
    """A token-weighted mean of ``peers`` sign packets (1 bit + one fp32 scale per block): what a
    sign-compressed swarm aggregates, fp32 [p]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(p)
    for i in range(peers):
        scale = (torch.rand(p // BLOCK, generator=g) * 1e-3).repeat_interleave(BLOCK)
        out += torch.sign(torch.randn(p, generator=g)) * scale * (1000 + i)
    return out / (3000 + peers)


def _copy(gs: GlobalState) -> Snapshot:
    buf = gs.buffer.clone()
    return Snapshot(gs.round, buf[: gs.num_params], buf[gs.num_params :], gs.digest, buffer=buf)


def _advance(
    gs: GlobalState, srv: StateServer, outer: OuterNesterov, r: int, agg: torch.Tensor, ranges, idle=()
) -> None:
    """Round ``r``'s outer step as the node makes it (node.outer_step + commit): retain, record, step, seal."""
    with gs.lock:
        srv.retain()
        srv.updates.record(r, gs.digest, ranges, idle, agg)
        outer_step_per_part(outer, gs.theta, agg, ranges, r, idle)
        gs.commit(r + 1)
        srv.updates.seal(r + 1, gs.digest)


class TamperingServer(StateServer):
    """Serves outer updates changed by ``tamper(OuterUpdate) -> OuterUpdate`` (a forging donor)."""

    def __init__(self, transport, *, tamper, **kw):
        super().__init__(transport, **kw)
        self.tamper = tamper

    async def _handle_update(self, verified, context):
        req = state_pb2.StateRequest.FromString(verified.payload)
        data, _ = await self.updates.blob(req.round)
        bad = self.tamper(OuterUpdate.decode(data, P)).encode()
        h = hashlib.blake2b(bad).hexdigest()[:32]  # consistent with its bytes: only the digests betray it
        yield state_pb2.StateChunk(
            round=req.round, digest=h, total_bytes=len(bad), offset=0, data=bad
        ).SerializeToString()


async def _serve(gs: GlobalState, cls=StateServer, **kw):
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    srv = cls(t, chunk_bytes=CHUNK, state=gs, **kw)
    return t, srv, await t.start()


@pytest.mark.timeout(60)
async def test_a_download_crossing_a_round_boundary_finishes_from_the_same_rounds_snapshot():
    gs = _state()
    want = _copy(gs)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buf = gs.opt_state
    t, srv, addr = await _serve(gs, StallingServer, stall_after=2)
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        task = asyncio.ensure_future(
            download_state(client, [addr], round=5, numel=P, expected_digest=gs.digest, stall_timeout_s=600.0)
        )
        await asyncio.wait_for(srv.stalled.wait(), 10)
        # the donor's round ends mid-download: its outer step changes the served buffer in place
        await asyncio.to_thread(_advance, gs, srv, outer, 5, _sign_mean(1), [(0, P)])
        assert gs.round == 6 and srv.kept_rounds() == [5]
        srv.release.set()
        snap = await asyncio.wait_for(task, 30)
        assert snap.round == 5 and snap.digest == want.digest
        assert torch.equal(snap.buffer.view(torch.int32), want.buffer.view(torch.int32))
        # a new request for round 5 is still answered from the kept copy (a piece resuming here)
        again = await download_state(client, [addr], round=5, numel=P, expected_digest=want.digest)
        assert again.digest == want.digest
    finally:
        await client.stop()
        await t.stop(grace=0)


def test_a_round_nobody_downloads_is_not_copied():
    gs = _state()
    srv = StateServer(_FakeTransport(), state=gs)
    with gs.lock:
        assert srv.retain() is None
    assert srv.kept_rounds() == []


class _FakeTransport:
    """Registers handlers and nothing else (a StateServer built without a network)."""

    identity = Identity.generate()

    def add_stream(self, *a, **k):
        pass

    def add_unary(self, *a, **k):
        pass


@pytest.mark.timeout(60)
async def test_catch_up_from_r_to_r_plus_2_gives_the_exact_digest():
    donor_gs = _state()
    joiner = _copy(donor_gs)  # the joiner's download of round 5
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buf = donor_gs.opt_state
    t, srv, addr = await _serve(donor_gs)
    srv.updates.busy = lambda: True  # a joiner's download is in progress: older updates are kept (encoded)
    ranges = [(0, P // 4), (P // 4, P // 2), (P // 2, P)]
    _advance(donor_gs, srv, outer, 5, _sign_mean(1), ranges)
    _advance(donor_gs, srv, outer, 6, _sign_mean(2), ranges, idle=[(P // 4, P // 2)])  # a part nobody trained
    assert srv.updates.rounds() == [5, 6]
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        events, sized = [], []
        got = await catch_up_updates(
            client,
            [addr],
            joiner,
            target_round=7,
            target_digest=donor_gs.digest,
            outer=OuterNesterov(lr=0.7, momentum=0.9),
            on_event=lambda *e: events.append(e),
            on_size=lambda r, n: sized.append((r, n)),
        )
        assert got.round == 7 and got.digest == donor_gs.digest
        assert torch.equal(got.buffer.view(torch.int32), donor_gs.buffer.view(torch.int32))
        assert sorted(e[0] for e in events) == ["done", "done", "start", "start"]  # both fetched at once
        # what crossed the wire: each update's blob, far below the whole state (a mean of sign packets)
        sizes = [len((await srv.updates.blob(r))[0]) for r in (5, 6)]
        assert all(s < donor_gs.nbytes / 4 for s in sizes), (sizes, donor_gs.nbytes)
        # each blob's size as its first chunk states it, once (the joiner's announced progress counts it)
        assert sorted(sized) == [(5, sizes[0]), (6, sizes[1])]
        # once encoded, the raw [P] copy of the aggregate is dropped (memory: the blob only)
        assert srv.updates.get(5) is None and srv.updates.get(6) is None
        # a round not kept is refused with a reason, by every donor
        with pytest.raises(StateSyncError, match="no outer update of round 4 kept"):
            await catch_up_updates(
                client,
                [addr],
                _copy(_state(round=4)),
                target_round=7,
                target_digest=donor_gs.digest,
                outer=OuterNesterov(),
            )
    finally:
        await client.stop()
        await t.stop(grace=0)


def _flip_one(u: OuterUpdate) -> OuterUpdate:
    agg = u.aggregate.clone()
    agg[123] = -agg[123]
    return OuterUpdate(u.round, u.start_digest, u.end_digest, u.ranges, u.idle, agg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forge_digest", [False, True])
async def test_a_tampered_update_is_refused_and_an_honest_donor_is_not_needed_to_say_why(forge_digest):
    donor_gs = _state()
    joiner = _copy(donor_gs)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buf = donor_gs.opt_state
    t, srv, addr = await _serve(donor_gs, TamperingServer, tamper=lambda u: u)
    _advance(donor_gs, srv, outer, 5, _sign_mean(1), [(0, P)])

    def tamper(u):
        bad = _flip_one(u)
        if forge_digest:  # the forger states the digest its tampered update really gives
            trial = _copy(_state())
            o = OuterNesterov(lr=0.7, momentum=0.9)
            o.buf = trial.momentum
            outer_step_per_part(o, trial.theta, bad.aggregate, [(0, P)], 5, ())
            gs2 = GlobalState(P, 1, buffer=trial.buffer)
            bad = OuterUpdate(u.round, u.start_digest, gs2.compute_digest(), u.ranges, u.idle, bad.aggregate)
        return bad

    srv.tamper = tamper
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    try:
        why = "and the swarm" if forge_digest else "the update states"
        with pytest.raises(StateSyncError, match=f"outer update of round 5 is refused: .*{why}"):
            await catch_up_updates(
                client,
                [addr],
                joiner,
                target_round=6,
                target_digest=donor_gs.digest,
                outer=OuterNesterov(lr=0.7, momentum=0.9),
            )
    finally:
        await client.stop()
        await t.stop(grace=0)


def test_a_malformed_update_is_refused_with_a_reason():
    u = OuterUpdate(5, "a" * 32, "b" * 32, ((0, P),), (), _sign_mean(1))
    blob = u.encode()
    assert OuterUpdate.decode(blob, P).aggregate.view(torch.int32).equal(u.aggregate.view(torch.int32))
    with pytest.raises(StateSyncError, match="malformed outer update: update for P"):
        OuterUpdate.decode(blob, P + 1)
    with pytest.raises(StateSyncError, match="malformed outer update"):
        OuterUpdate.decode(blob[:-7], P)
    with pytest.raises(StateSyncError, match="not an outer update"):
        OuterUpdate.decode(b"XXXX" + blob[4:], P)
    bomb = OuterUpdate(5, "a" * 32, "b" * 32, ((0, 2 * P),), (), torch.zeros(2 * P)).encode()
    with pytest.raises(StateSyncError, match="malformed outer update"):
        OuterUpdate.decode(bomb, P)  # inflation is capped at 4 * P bytes


async def test_the_update_log_keeps_the_last_rounds_and_only_sealed_ones():
    log = UpdateLog(keep_rounds=2, spawn=asyncio.get_running_loop().create_task)
    for r in range(5):
        log.record(r, f"{r:032d}", [(0, 8)], (), torch.ones(8))
        log.seal(r + 1, f"{r + 1:032d}")
    # nobody syncing: only the newest round is kept (a raw [P] copy), for a peer planned out of it
    assert log.rounds() == [4]
    log.busy = lambda: True  # a download in progress: older rounds are encoded (blob only) and kept
    for r in range(5, 8):
        log.record(r, f"{r:032d}", [(0, 8)], (), torch.ones(8))
        log.seal(r + 1, f"{r + 1:032d}")
        await asyncio.sleep(0.05)
    assert log.rounds() == [6, 7]
    for _ in range(100):  # the encodings run in worker threads
        if log.get(6) is None:
            break
        await asyncio.sleep(0.05)
    assert log.get(6) is None and (await log.blob(6))[0].startswith(b"GMU1")
    log.record(8, "x" * 32, [(0, 8)], (), torch.ones(8))
    log.seal(10, "y" * 32)  # not the round recorded: dropped
    assert log.rounds() == [6, 7]


@pytest.mark.timeout(60)
async def test_a_donor_frozen_from_its_first_chunk_costs_the_floor_not_the_stall_timeout():
    """The piece of a donor that never sends a chunk moves once its sibling's rate shows the donor is late:
    STALL_FLOOR_S (2 s) here, not the stall timeout (issue 14 #3: a frozen donor costs <= 5 s). The stall timeout
    is past this test's time: a download that waited for it fails on the hang guard, not on a measured gap."""
    from geomesh_p2p.sync.download import STALL_FLOOR_S

    gs = _state(p=1 << 17)  # 1 MiB: 32 chunks per piece
    frozen_t, frozen, frozen_addr = await _serve(gs, StallingServer, stall_after=0)
    ok_t, _, ok_addr = await _serve(gs)
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    events = []
    try:
        snap = await asyncio.wait_for(
            download_state(
                client,
                [frozen_addr, ok_addr],
                round=5,
                numel=gs.num_params,
                expected_digest=gs.digest,
                stall_timeout_s=HANG_S,
                on_event=lambda *e: events.append(e),
            ),
            GUARD_S,
        )
        assert snap.digest == gs.digest
        moved = [e for e in events if e[0] == "moved"]
        assert [(e[1], e[2]) for e in moved] == [(0, ok_addr)]
        stalled = [(e[0], e[1], e[2]) for e in events if e[0] in ("stalled", "failed")]
        assert stalled == [("stalled", 0, frozen_addr)], events  # left once, on the stall limit
        assert STALL_FLOOR_S <= float(moved[0][3]), moved  # not before the floor (a lower bound holds under load)
    finally:
        frozen.release.set()
        await client.stop()
        await frozen_t.stop(grace=0)
        await ok_t.stop(grace=0)


# ------------------------------------------------ donors busy with their own exchange (rs7/rs8, DiLoCo)
@pytest.mark.timeout(60)
async def test_a_download_from_donors_busy_with_their_exchange_waits_for_them_instead_of_failing():
    """Both donors send one chunk, then nothing while their own exchange holds their uplink (longer than the
    stall limit), then the rest. Without ``busy_until`` every piece stalls on every donor (rs7: "sent nothing
    for 5.0 s", round after round); with the donors' exchange deadline known, each piece goes back to its
    donor after the first pass and waits for the end of the exchange: the download finishes."""
    from geomesh_p2p.net.swarm_time import swarm_time

    gs = _state(p=1 << 17)  # 1 MiB: 32 chunks per piece
    busy_s, stall_s = 4.0, 1.0
    donors = [await _serve(gs, StallingServer, stall_after=1) for _ in range(2)]
    addrs = [a for _, _, a in donors]
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    loop = asyncio.get_running_loop()
    try:
        # the donors' exchange ends busy_s from now: then they send again (the scenario's timing, not a wait)
        for _, srv, _ in donors:
            loop.call_later(busy_s, srv.release.set)
        with pytest.raises(StateSyncError, match="sent nothing"):
            await download_state(
                client, addrs, round=5, numel=gs.num_params, expected_digest=gs.digest, stall_timeout_s=stall_s
            )
        for _, srv, _ in donors:  # the next exchange: busy again for busy_s
            srv.release.clear()
            srv.stalled.clear()
            loop.call_later(busy_s, srv.release.set)
        end = swarm_time() + busy_s
        seen = []
        snap = await download_state(
            client,
            addrs,
            round=5,
            numel=gs.num_params,
            expected_digest=gs.digest,
            stall_timeout_s=stall_s,
            busy_until=lambda donor: end if donor in addrs else 0.0,
            on_event=lambda *e: seen.append(e),
        )
        assert snap.digest == gs.digest
        kinds = [e[0] for e in seen]
        assert "failed" not in kinds and "cancelled" not in kinds and kinds.count("done") == 2
        # the first pass left each donor on the plain limit; the retry of its own donor waited out the exchange
        held = sorted((e[1], e[2]) for e in seen if e[0] == "held")
        assert held == [(0, addrs[0]), (1, addrs[1])], seen
    finally:
        await client.stop()
        for t, srv, _ in donors:
            srv.release.set()
            await t.stop(grace=0)


@pytest.mark.timeout(60)
async def test_a_busy_donor_that_froze_still_costs_only_the_plain_limit_when_another_donor_serves():
    """busy_until does not make a frozen donor cheaper to keep: with a healthy donor at hand, the piece
    moves on the plain (adaptive) limit although the frozen one is said to be inside its exchange (for longer than
    this test's hang guard, and the stall timeout too: waiting for either fails the guard)."""
    from geomesh_p2p.net.swarm_time import swarm_time

    gs = _state(p=1 << 17)
    frozen_t, frozen, frozen_addr = await _serve(gs, StallingServer, stall_after=0)
    ok_t, _, ok_addr = await _serve(gs)
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    seen = []
    end = swarm_time() + HANG_S
    try:
        snap = await asyncio.wait_for(
            download_state(
                client,
                [frozen_addr, ok_addr],
                round=5,
                numel=gs.num_params,
                expected_digest=gs.digest,
                stall_timeout_s=HANG_S,
                busy_until=lambda donor: end,
                on_event=lambda *e: seen.append(e),
            ),
            GUARD_S,
        )
        assert snap.digest == gs.digest
        moved = [e for e in seen if e[0] == "moved"]
        assert [(e[1], e[2]) for e in moved] == [(0, ok_addr)], seen
        assert [(e[0], e[1], e[2]) for e in seen if e[0] in ("stalled", "failed")] == [("stalled", 0, frozen_addr)]
        assert not [e for e in seen if e[0] == "held"]
    finally:
        frozen.release.set()
        await client.stop()
        await frozen_t.stop(grace=0)
        await ok_t.stop(grace=0)


@pytest.mark.timeout(60)
async def test_a_donor_frozen_past_its_busy_window_is_left_after_the_window_plus_the_stall_limit():
    from geomesh_p2p.net.swarm_time import swarm_time

    gs = _state(p=1 << 17)
    t, srv, addr = await _serve(gs, StallingServer, stall_after=1)  # never released: gone quiet for good
    client = Transport(Identity.generate(), RUN, TransportConfig(client_only=True))
    # the first attempt's stall ends stall_s into the window of busy_s: the retry is held for the second left (a
    # margin for a loaded machine's late watchdog), then stalls on stall_s again
    busy_s, stall_s = 1.5, 0.5
    try:
        end = swarm_time() + busy_s
        seen: list = []
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(StateSyncError, match="sent nothing"):
            await download_state(
                client,
                [addr],
                round=5,
                numel=gs.num_params,
                expected_digest=gs.digest,
                stall_timeout_s=stall_s,
                busy_until=lambda donor: end,
                on_event=lambda *e: seen.append(e),
            )
        took = asyncio.get_running_loop().time() - t0
        # a first attempt on the plain limit, then the retry held by the window (once), then the limit again: left
        # for good (the test's timeout is the hang guard); not before the window plus the limit (a lower bound)
        kinds = [(e[0], e[1], e[2]) for e in seen if e[0] != "moved"]  # (the retry's one chunk moves the piece)
        assert kinds == [
            ("start", 0, addr),
            ("stalled", 0, addr),
            ("start", 0, addr),
            ("held", 0, addr),
            ("stalled", 0, addr),
        ], seen
        assert 0 < float(seen[3][3]) <= busy_s  # held for what was left of the window
        assert busy_s + stall_s - 0.1 <= took
    finally:
        srv.release.set()
        await client.stop()
        await t.stop(grace=0)
