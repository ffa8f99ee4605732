"""The in-place all-reduce (issue 27): the round's aggregate written into the update's own storage, part by part
once this node's push of that part is encoded. Same bits as a separate buffer on every peer, no second [numel]
(the result's aggregate is the update's storage), missing parts zeroed, and a push encoded late (after its
part's result arrived) never sees the aggregate in its slice."""

from __future__ import annotations

import asyncio
import time

import pytest

from geomesh_p2p.exchange import CollectiveService
from tests.collective_util import deltas_for, reference

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "mode, push, agg",
    [("relay", "sign", "sign"), ("reencode", "sign", "sign"), ("reencode", "fp32", "fp32"), ("relay", "fp32", "fp32")],
)
async def test_in_place_gives_the_same_bits_in_the_updates_own_storage(swarms, mode, push, agg):
    sw = await swarms(3, 1)  # 3 owners + 1 client-only peer
    numel = 40_000
    deltas = deltas_for(sw.pids, numel, seed=5)
    tokens = dict(zip(sw.pids, (100, 200, 300, 400)))
    kw = dict(mode=mode, push_encoding=push, aggregate_encoding=agg, block_size=1024)
    spec1 = sw.spec(numel, round=1, deadline_s=10.0, **kw)
    apart = await asyncio.gather(
        *[s.all_reduce(spec1, deltas[p].clone(), tokens[p]) for s, p in zip(sw.services, sw.pids)]
    )
    mine = {p: deltas[p].clone() for p in sw.pids}
    ptrs = {p: mine[p].data_ptr() for p in sw.pids}
    spec2 = sw.spec(numel, round=2, deadline_s=10.0, **kw)
    inplace = await asyncio.gather(
        *[s.all_reduce(spec2, mine[p], tokens[p], in_place=True) for s, p in zip(sw.services, sw.pids)]
    )
    for p, a, b in zip(sw.pids, apart, inplace):
        assert b.missing_parts == [] and all(b.pushed.values())
        assert b.contributors == a.contributors
        assert b.aggregate.data_ptr() == ptrs[p]  # the update's storage: no second [numel]
        assert b.aggregate.view(-1).equal(a.aggregate)  # bitwise, on every peer
        assert b.aggregate.equal(inplace[0].aggregate)
    if push == "sign":
        assert inplace[0].aggregate.equal(reference(spec2, deltas, tokens, {j: sw.pids for j in range(3)}))


async def test_in_place_zeroes_the_part_of_a_gone_owner(swarms):
    sw = await swarms(3, 1)
    numel = 30_000
    spec = sw.spec(numel, block_size=1024, mode="relay", deadline_s=1.5, pull_s=3.0)
    deltas = deltas_for(sw.pids, numel, seed=11)
    tokens = {p: 10 * (k + 1) for k, p in enumerate(sw.pids)}
    await sw.stop_one(2)  # the owner of part 2 is gone
    mine = {sw.pids[k]: deltas[sw.pids[k]].clone() for k in (0, 1, 3)}
    outs = await asyncio.gather(
        *(sw.services[k].all_reduce(spec, mine[sw.pids[k]], tokens[sw.pids[k]], in_place=True) for k in (0, 1, 3))
    )
    o = spec.owners[2]
    for res in outs:
        assert res.missing_parts == [2]
        assert int((res.aggregate[o.start : o.end] != 0).sum()) == 0  # not this peer's update any more
        assert res.aggregate.equal(outs[0].aggregate)
    assert int((outs[0].aggregate[: o.start] != 0).sum()) > 0


class _LatePusher(CollectiveService):
    """Starts encoding its pushes only after the push deadline: every part's result (closed without it) is
    ready before its push is encoded."""

    async def _before_push(self, spec, part):
        await asyncio.sleep(max(0.0, spec.deadline - time.time()) + 0.3)


async def test_a_result_waits_for_the_push_of_its_part_to_be_encoded(swarms):
    """In place, a part's result must not overwrite the update's slice before this node's push of that part
    has read it: the late pusher applies the same aggregate as the others (its pushes refused, nothing of its
    update left in the aggregate)."""
    sw = await swarms(4, 0, service_cls=[None, None, None, _LatePusher])
    pids, numel = sw.pids, 30_000
    owners = sw.owners(numel, block_size=1024, which=[0, 1, 2])  # the late peer owns no part
    spec = sw.spec(numel, block_size=1024, mode="relay", deadline_s=1.5, pull_s=5.0, owners=owners)
    deltas = deltas_for(pids, numel, seed=3)
    tokens = {p: 10 * (k + 1) for k, p in enumerate(pids)}
    mine = {p: deltas[p].clone() for p in pids}
    outs = await asyncio.gather(
        *(s.all_reduce(spec, mine[p], tokens[p], in_place=True) for s, p in zip(sw.services, pids))
    )
    assert not any(outs[-1].pushed.values())  # every push of the late peer came after its part closed
    for res in outs:
        assert res.missing_parts == []
        assert res.aggregate.equal(outs[0].aggregate)
    assert outs[-1].aggregate.equal(reference(spec, deltas, tokens, {j: pids[:3] for j in range(3)}))


async def test_in_place_in_accountable_mode_gives_the_same_bits(swarms):
    """Accountable re-encoding (issue 26) in place (issue 27; the session-16 red team found no test of the two
    together): the owners' robust aggregate, re-encoded, witnessed and receipted, lands in every reader's own update
    storage with the same bits as in a separate buffer, on every peer."""
    from tests.integration.test_collective_robust import ROBUST, _honest_deltas

    sw = await swarms(4)
    numel = 4 * 2048 * 2
    deltas = _honest_deltas(sw.pids, numel, seed=3)
    kw = dict(mode="accountable", deadline_s=5.0, **ROBUST)
    spec1 = sw.spec(numel, round=1, **kw)
    apart = await asyncio.gather(*[s.all_reduce(spec1, deltas[p].clone(), 100) for s, p in zip(sw.services, sw.pids)])
    mine = {p: deltas[p].clone() for p in sw.pids}
    ptrs = {p: mine[p].data_ptr() for p in sw.pids}
    spec2 = sw.spec(numel, round=2, **kw)
    inplace = await asyncio.gather(
        *[s.all_reduce(spec2, mine[p], 100, in_place=True) for s, p in zip(sw.services, sw.pids)]
    )
    for p, a, b in zip(sw.pids, apart, inplace):
        assert a.missing_parts == [] and b.missing_parts == []
        assert b.contributors == a.contributors and len(b.contributors) == 4
        assert b.aggregate.data_ptr() == ptrs[p]  # the update's storage: no second [numel]
        assert b.aggregate.view(-1).equal(a.aggregate)  # bitwise, on every peer
        assert b.aggregate.equal(inplace[0].aggregate)
    assert bool(inplace[0].aggregate.abs().sum() > 0)  # a real aggregate, not zeros
