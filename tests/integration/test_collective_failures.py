"""Failures during one all-reduce (DESIGN.md, Round r step 6): a peer fails before sending, half way
through sending, is slow past the deadline, an owner fails while reducing, an owner is slow, a peer
cancels; plus a real multi-process round where one peer is SIGKILLed mid-round.

In every case the survivors finish within the push deadline + 2 s, hold bitwise-identical
aggregates, agree on who contributed to what, and the aggregate equals the reference computed from
those contributor lists (a part whose owner is gone is zero for everyone).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange import CollectiveService
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.net.methods import COLLECTIVE_PUSH
from geomesh_p2p.wire import collective_pb2
from tests.jsonl_util import JsonLineProc, kill_workers
from tests.collective_util import RUN, Swarm, craft_contribution, deltas_for, pid_order, reference
from tests.wait_util import until

pytestmark = pytest.mark.timeout(60)

SLACK_S = 2.0  # survivors finish by deadline + this


class Faulty(CollectiveService):
    """A CollectiveService with injectable faults (async callables, or None for normal behaviour)."""

    def __init__(self, transport, **kw):
        super().__init__(transport, **kw)
        self.push_fault = None  # async (spec, part) -> None, before delivering a part
        self.reduce_fault = None  # async (spec, part) -> None, before an owned part is reduced
        self.pull_fault = None  # async (spec, part) -> None, before pulling a part's result
        self.delivered: dict[int, asyncio.Event] = {}
        self.reached = asyncio.Event()  # set by faults that mark "the failure point is reached"

    def _ev(self, j: int) -> asyncio.Event:
        return self.delivered.setdefault(j, asyncio.Event())

    async def _before_push(self, spec, part):
        if self.push_fault is not None:
            await self.push_fault(spec, part)

    async def _before_reduce(self, spec, part):
        if self.reduce_fault is not None:
            await self.reduce_fault(spec, part)

    async def _before_pull(self, spec, part):
        if self.pull_fault is not None:
            await self.pull_fault(spec, part)

    async def _deliver(self, state, j, delta, tokens, uploads=None):
        ok = await super()._deliver(state, j, delta, tokens, uploads)
        self._ev(j).set()
        return ok


async def hang_forever():
    await asyncio.Event().wait()


@pytest.fixture
def swarm(swarms):
    """``await swarm(n_servers=3, n_clients=1, **kw)`` -> a started :class:`Swarm` of :class:`Faulty`
    services; conftest's ``swarms`` stops every one in teardown."""

    def make(n_servers=3, n_clients=1, **kw):
        return swarms(n_servers, n_clients, service_cls=Faulty, **kw)

    return make


def hang_after_part_0(svc):
    """A ``push_fault`` for ``svc``: it delivers part 0, then (once part 0 is delivered) sets ``svc.reached``
    and hangs before every other part, as a peer that dies or cancels half-way through sending."""

    async def fault(spec_, part):
        if part != 0:
            await svc._ev(0).wait()
            svc.reached.set()
            await hang_forever()

    return fault


async def timed(coro):
    res = await coro
    return res, time.time()


def start_round(sw: Swarm, spec, deltas, tokens, who):
    return {
        k: asyncio.ensure_future(timed(sw.services[k].all_reduce(spec, deltas[sw.pids[k]], tokens[sw.pids[k]])))
        for k in who
    }


def check_survivors(sw: Swarm, spec, deltas, tokens, outs: dict, *, missing=(), absent_from=None):
    """Identical aggregates / contributor lists, on time, equal to the reference; returns one result."""
    results = [r for r, _ in outs.values()]
    first = results[0]
    for r, finished in outs.values():
        assert finished <= spec.deadline + SLACK_S, finished - spec.deadline
        assert torch.equal(r.aggregate, first.aggregate)
        assert r.contributors == first.contributors
        assert r.missing_parts == sorted(missing)
    for j in missing:
        o = spec.owners[j]
        assert torch.count_nonzero(first.aggregate[o.start : o.end]) == 0
    for j, who in (absent_from or {}).items():
        assert all(p not in who for p, _ in first.contributors[j]), (j, who)
    contributors = {j: [p for p, _ in c] for j, c in first.contributors.items()}
    for j, c in contributors.items():
        assert c == pid_order(c)
    assert torch.equal(first.aggregate, reference(spec, deltas, tokens, contributors))
    return first


def setup_round(sw: Swarm, numel=30_000, **kw):
    spec = sw.spec(numel, block_size=1024, **kw)
    deltas = deltas_for(sw.pids, numel, seed=11)
    tokens = {p: 10 * (k + 1) for k, p in enumerate(sw.pids)}
    return spec, deltas, tokens


# ------------------------------------------------------------------------------------ senders


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_client_peer_fails_before_sending(swarm, mode):
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    await sw.stop_one(3)  # the client-only peer is gone before the round
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2]).items()}
    first = check_survivors(sw, spec, deltas, tokens, outs, absent_from={j: [sw.pids[3]] for j in range(3)})
    assert all(len(first.contributors[j]) == 3 for j in range(3))


async def test_owner_fails_before_sending(swarm):
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="reencode")
    await sw.stop_one(2)  # owner of part 2 is gone: its part is skipped by all, it is absent from the rest
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 3]).items()}
    check_survivors(sw, spec, deltas, tokens, outs, missing=[2], absent_from={0: [sw.pids[2]], 1: [sw.pids[2]]})


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_peer_fails_half_way_through_sending(swarm, mode):
    """Owner 2 delivers part 0, then dies (transport stopped, task gone) before parts 1 and 2."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    victim = sw.services[2]

    victim.push_fault = hang_after_part_0(victim)
    tasks = start_round(sw, spec, deltas, tokens, [0, 1, 2, 3])
    await victim.reached.wait()
    tasks.pop(2).cancel()
    await sw.stop_one(2)
    outs = {k: await t for k, t in tasks.items()}
    first = check_survivors(sw, spec, deltas, tokens, outs, missing=[2], absent_from={1: [sw.pids[2]]})
    assert sw.pids[2] in [p for p, _ in first.contributors[0]]


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_sender_slow_past_the_deadline_is_left_out_and_still_gets_the_result(swarm, mode):
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    slow = sw.services[3]

    async def fault(spec_, part):
        await asyncio.sleep(spec_.deadline - time.time() + 0.2)  # the fault itself: too slow

    slow.push_fault = fault
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2, 3]).items()}
    check_survivors(sw, spec, deltas, tokens, outs, absent_from={j: [sw.pids[3]] for j in range(3)})
    assert not any(outs[3][0].pushed.values())
    assert all(all(outs[k][0].pushed.values()) for k in (0, 1, 2))
    # a push arriving after the part closed is refused, with the reason
    pkt = compression.encode(torch.randn(spec.owners[0].size), spec.block_size, 1).to_bytes()
    payload = collective_pb2.PushPartRequest(
        contribution=craft_contribution(sw.ids[3], spec, 0, pkt)
    ).SerializeToString()
    with pytest.raises(RpcError) as ei:
        await sw.transports[3].call(sw.addresses[0], COLLECTIVE_PUSH, payload, round=spec.round)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "closed (deadline)" in ei.value.reason


# ------------------------------------------------------------------------------------- owners


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_owner_fails_while_reducing(swarm, mode):
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    victim = sw.services[1]

    def landed(j: int) -> bool:
        state = sw.services[j]._rounds.get(spec.round)
        return state is not None and j in state.parts and sw.pids[1] in state.parts[j].contributions

    async def fault(spec_, part):
        # Its own pushes to parts 0 and 2 must have landed before it dies (what the last assertion is
        # about): they race with the pushes to its part, which started this reduction.
        await until(lambda: landed(0) and landed(2), what="the victim's pushes to parts 0 and 2")
        victim.reached.set()
        await hang_forever()

    victim.reduce_fault = fault
    tasks = start_round(sw, spec, deltas, tokens, [0, 1, 2, 3])
    await victim.reached.wait()  # every push to part 1 arrived; the owner now dies
    tasks.pop(1).cancel()
    await sw.stop_one(1)
    outs = {k: await t for k, t in tasks.items()}
    first = check_survivors(sw, spec, deltas, tokens, outs, missing=[1])
    # its own pushes to parts 0 and 2 had landed before it died: still counted
    assert all(sw.pids[1] in [p for p, _ in first.contributors[j]] for j in (0, 2))


@pytest.mark.parametrize("delay, missing", [(0.5, []), (None, [1])])
async def test_owner_slow(swarm, delay, missing):
    """Slow but before the pull deadline: everyone waits for it. Slower than the pull deadline:
    every peer, the owner included, skips that part."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="reencode")
    owner = sw.services[1]

    async def fault(spec_, part):
        await asyncio.sleep(delay if delay is not None else spec_.pull_deadline - time.time() + 1.0)

    owner.reduce_fault = fault
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2, 3]).items()}
    check_survivors(sw, spec, deltas, tokens, outs, missing=missing)


@pytest.mark.parametrize("who", [3, 0])
async def test_peer_cancels(swarm, who):
    """A peer cancels its all-reduce after delivering part 0. A cancelled owner keeps serving its
    part (the service, not the call, holds it), so nobody loses that range."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="relay")
    quitter = sw.services[who]

    quitter.push_fault = hang_after_part_0(quitter)
    tasks = start_round(sw, spec, deltas, tokens, [0, 1, 2, 3])
    await quitter.reached.wait()
    t = tasks.pop(who)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    outs = {k: await t for k, t in tasks.items()}
    first = check_survivors(sw, spec, deltas, tokens, outs, absent_from={j: [sw.pids[who]] for j in range(1, 3)})
    assert sw.pids[who] in [p for p, _ in first.contributors[0]]


# ------------------------------------------------------------------------------ real processes

WORKER = Path(__file__).resolve().parents[1] / "collective_worker.py"


@pytest.fixture
async def workers(tmp_path):
    """``await workers(n)`` -> ``n`` started tests/collective_worker.py processes (JSON lines; stderr in
    ``tmp_path/worker<k>.err``); all are SIGKILLed by PID and reaped in teardown."""
    procs: list[JsonLineProc] = []

    async def spawn(n: int) -> list[JsonLineProc]:
        env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent))
        for k in range(n):
            with open(tmp_path / f"worker{k}.err", "wb") as err:  # the child keeps its own copy of the fd
                procs.append(await JsonLineProc.start(str(WORKER), "--run", RUN, env=env, stderr=err))
        return procs

    try:
        yield spawn
    finally:
        await kill_workers(procs)


async def test_owner_gone_after_serving_some_peers_the_rest_get_its_signed_result_from_them(swarm):
    """Owner 1 serves parts to peers 0 and 2, then dies before the client-only peer 3 pulls: peer 3
    gets the owner-signed result from a peer that cached it, so nobody diverges."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="reencode")
    late = sw.services[3]
    got: dict[int, asyncio.Event] = {k: asyncio.Event() for k in (0, 2)}
    owner_gone = asyncio.Event()

    class Tracking:
        def __init__(self, svc, k):
            orig = svc._obtain

            async def obtain(state, j):
                out = await orig(state, j)
                if j == 1:
                    got[k].set()
                return out

            svc._obtain = obtain

    for k in (0, 2):
        Tracking(sw.services[k], k)
    orig_pull = late._pull

    async def slow_pull(spec_, j):
        if j == 1:
            await owner_gone.wait()
        return await orig_pull(spec_, j)

    late._pull = slow_pull
    tasks = start_round(sw, spec, deltas, tokens, [0, 1, 2, 3])
    await got[0].wait()
    await got[2].wait()
    tasks.pop(1).cancel()
    await sw.stop_one(1)
    owner_gone.set()
    outs = {k: await t for k, t in tasks.items()}
    check_survivors(sw, spec, deltas, tokens, outs, missing=[])


async def test_owner_killed_while_its_only_reader_decodes_its_result(swarm):
    """Owner 1 answers reader 0, then dies while reader 0 still decodes the result (the read slot, a loaded
    CPU). Readers 2 and 3 find the owner gone: before the fix no helper had a copy yet (it was cached only once
    decoded), they gave up at once and the round ended on two aggregates (missing [1] for them, [] for 0)."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="reencode")
    r0 = sw.services[0]
    owner_gone = asyncio.Event()
    pulled = asyncio.Event()
    orig_pull0, orig_read0 = r0._pull, r0._read_result

    async def pull0(spec_, j):
        out = await orig_pull0(spec_, j)
        if j == 1:
            pulled.set()
        return out

    def read0(spec_, j, signed, out=None):  # a worker thread: decoding under load
        if j == 1:
            t_end = time.monotonic() + 10  # bounded: a failing test must not leave this thread spinning
            while not owner_gone.is_set() and time.monotonic() < t_end:
                time.sleep(0.01)
            time.sleep(0.5)  # the others ask the helpers meanwhile
        return orig_read0(spec_, j, signed, out)

    r0._pull, r0._read_result = pull0, read0

    async def wait_owner(spec_, part):
        if part == 1:
            await owner_gone.wait()

    for k in (2, 3):
        sw.services[k].pull_fault = wait_owner
    tasks = start_round(sw, spec, deltas, tokens, [0, 1, 2, 3])
    await pulled.wait()
    tasks.pop(1).cancel()
    await sw.stop_one(1)
    owner_gone.set()
    outs = {k: (await t)[0] for k, t in tasks.items()}
    assert {k: r.missing_parts for k, r in outs.items()} == {0: [], 2: [], 3: []}
    assert all(torch.equal(r.aggregate, outs[0].aggregate) for r in outs.values())
    assert all(r.contributors == outs[0].contributors for r in outs.values())


async def test_a_leaving_owner_serves_its_parts_until_a_slow_reader_pulled_them(swarm):
    """rs9: the last round's owner exited as soon as its own exchange ended, while a peer on a slow link was
    still pulling its part; that peer ended the run on another digest. ``linger`` (what a leaving node runs
    before its server stops) waits for every other participant's pull, or for its bound."""
    sw = await swarm(n_servers=2, n_clients=0)
    spec, deltas, tokens = setup_round(sw)
    owner, reader = sw.services
    gate = asyncio.Event()

    async def slow_link(spec_, part):  # the reader's pulls of the owner's parts wait for the gate
        if spec_.owners[part].peer_id == sw.pids[0]:
            await gate.wait()

    reader.pull_fault = slow_link
    outs = start_round(sw, spec, deltas, tokens, [0, 1])
    await outs[0]  # the owner's own exchange is over
    mine = [j for j, o in enumerate(spec.owners) if o.peer_id == sw.pids[0]]
    assert mine and owner.unserved() == {j: [sw.pids[1]] for j in mine}
    lingering = asyncio.ensure_future(owner.linger(spec.deadline + 30))
    await asyncio.sleep(0.2)
    assert not lingering.done()  # the reader has not pulled yet
    gate.set()
    await outs[1]
    assert await asyncio.wait_for(lingering, 10) == {}
    assert owner.unserved() == {}


async def test_linger_stops_at_its_bound_when_a_reader_never_pulls(swarm):
    sw = await swarm(n_servers=2, n_clients=0)
    spec, deltas, tokens = setup_round(sw)
    owner, reader = sw.services
    reader.pull_fault = lambda spec_, part: hang_forever()
    outs = start_round(sw, spec, deltas, tokens, [0, 1])
    await outs[0]
    t0 = time.monotonic()
    left = await asyncio.wait_for(owner.linger(time.time() + 0.5), 20)  # a hang guard: linger past its bound
    assert 0.4 <= time.monotonic() - t0  # not before its bound (a lower bound holds under load)
    # it stopped with the reader's pulls still unserved: every part of the owner's, the reader's name on each
    assert left and all(v == [sw.pids[1]] for v in left.values())
    assert sorted(left) == [j for j, o in enumerate(spec.owners) if o.peer_id == sw.pids[0]]
    outs[1].cancel()
    await asyncio.gather(outs[1], return_exceptions=True)


# ------------------------------------------------------------------------------ one lineage under overload


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_a_reader_that_reaches_the_owner_only_after_the_pull_deadline_applies_what_the_others_applied(
    swarm, mode
):
    """Issue 25 (run 8 of docs/scale.md): under overload some readers got a part's result by the pull deadline
    and others did not, and the round ended on two states. A result signed by the pull deadline is applied by
    every reader: one whose pulls start only after the deadline still asks (quick asks, late_pull_s more) and
    gets the same aggregate, bit for bit."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    late = sw.services[3]

    async def overloaded(spec_, part):  # this reader's pulls start 0.3 s after the pull deadline
        await asyncio.sleep(max(0.0, spec_.pull_deadline - time.time() + 0.3))

    late.pull_fault = overloaded
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2, 3]).items()}
    results = [r for r, _ in outs.values()]
    assert all(r.missing_parts == [] for r in results)
    assert all(torch.equal(r.aggregate, results[0].aggregate) for r in results)
    assert all(r.contributors == results[0].contributors for r in results)
    assert outs[3][1] > spec.pull_deadline  # it did read after the deadline


async def test_a_result_signed_after_the_pull_deadline_is_left_out_by_every_reader_and_its_owner(swarm):
    """An owner that builds its result after the pull deadline (starved): a reader asking after the deadline is
    told "not ready" and stops at once; one that gets the late result anyway (a helper's copy, a reply in
    flight) leaves it out by its signed timestamp. Every peer, the owner included, skips the part."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode="reencode")
    owner = sw.services[1]

    built: list[bytes] = []

    def late_build(spec_, part, contributions, _orig=owner._build_result):
        time.sleep(max(0.0, spec_.pull_deadline - time.time() + 0.2))  # a worker thread: the owner is starved
        built.append(_orig(spec_, part, contributions))
        return built[-1]

    owner._build_result = late_build
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2, 3]).items()}
    check_survivors(sw, spec, deltas, tokens, outs, missing=[1])
    # and the timestamp rule alone: the owner's late result (never served: it landed after the deadline), handed
    # to a reader, is refused
    await until(lambda: built, 10)
    signed = built[0]
    reader = sw.services[0]
    rstate = reader._rounds[spec.round]

    async def handed(spec_, j):
        return signed

    reader._pull = handed
    assert await reader._obtain(rstate, 1) is None


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_a_result_signed_by_the_deadline_that_lands_after_it_is_left_out_by_its_owner_and_every_reader(
    swarm, mode
):
    """The stalled-peer fork (docs/round.md): on a loaded host an owner's result was signed (worker thread) before
    the pull deadline and reached its event loop after it. The owner's own wait ended at the deadline (part left
    out), a reader asking at once was told "not ready" (left out), a reader asking later got it, signed in time, and
    applied it: one round, two states. Now a result that lands on the owner's loop after the deadline is served to
    nobody: all four leave the part out, bit for bit the same aggregate."""
    sw = await swarm()
    spec, deltas, tokens = setup_round(sw, mode=mode)
    owner, late = sw.services[1], sw.services[3]

    def lands_late(spec_, part, contributions, _orig=owner._build_result):
        signed = _orig(spec_, part, contributions)  # signed now, before the pull deadline
        time.sleep(max(0.0, spec_.pull_deadline - time.time() + 0.3))  # ... and on the owner's loop after it
        return signed

    async def overloaded(spec_, part):  # this reader's pulls start after the result landed
        await asyncio.sleep(max(0.0, spec_.pull_deadline - time.time() + 0.6))

    owner._build_result = lands_late
    late.pull_fault = overloaded
    outs = {k: await t for k, t in start_round(sw, spec, deltas, tokens, [0, 1, 2, 3]).items()}
    # before the fix: {0: [1], 1: [1], 2: [1], 3: []}
    assert {k: r.missing_parts for k, (r, _) in outs.items()} == {k: [1] for k in outs}
    check_survivors(sw, spec, deltas, tokens, outs, missing=[1])
    assert owner._rounds[spec.round].parts[1].signed_result is None  # nor served to a validator
