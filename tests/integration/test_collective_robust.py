"""The collective with a robust rule, relay mode and a quorum: in-process gRPC swarms on 127.0.0.1.

What is checked: a sign-flipping contributor with 1000x scales and a 10**12-token claim has no say in any
part (every peer's aggregate equals, bitwise, the rule over the honest contributions alone); an owner that
relays only its own contribution cannot impose it (every reader refuses the part the same way).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.robust import aggregate_part
from geomesh_p2p.exchange import CollectiveService

from tests.collective_util import Swarm, pid_order

pytestmark = pytest.mark.timeout(120)

ROBUST = dict(rule="meanmed", weight_cap=1.0, min_agreement=0.5, quorum=0.5)


def _honest_deltas(pids, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    return {p: base + 0.7 * torch.randn(numel, generator=g) for p in pids}


def _expected(spec, deltas, tokens, who):
    out = torch.zeros(spec.numel)
    for o in spec.owners:
        items = [
            (
                min(tokens[p], spec.participants[p]),
                compression.encode(deltas[p][o.start : o.end].contiguous(), spec.block_size, tokens[p]),
            )
            for p in pid_order(who)
        ]
        out[o.start : o.end] = aggregate_part(
            items,
            o.size,
            rule=spec.rule,
            weight_cap=spec.weight_cap,
            min_agreement=spec.min_agreement,
            min_support=spec.min_support,
            clip_k=spec.clip_k,
        )
    return out


class _FlipMax(CollectiveService):
    """Pushes -1000 x its delta and claims 10**12 tokens (its plan's cap still applies)."""

    async def all_reduce(self, spec, delta, tokens, compute_end=None, *, in_place=False):
        return await super().all_reduce(spec, -1000.0 * delta, 10**12, compute_end, in_place=in_place)


async def test_a_flipping_contributor_has_no_say_in_relay_mode(swarms):
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [_FlipMax])
    numel = 4 * 2048 * 3
    honest = sw.pids[:3]
    deltas = _honest_deltas(sw.pids, numel)
    tokens = {p: 1000 + 100 * k for k, p in enumerate(sw.pids)}
    caps = {p: 10**9 for p in sw.pids}  # a plan that trusted the attacker's record
    spec = sw.spec(numel, mode="relay", caps=caps, deadline_s=3.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens[p]) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == [] for r in res)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # bitwise, attacker included
    assert torch.equal(res[0].aggregate, _expected(spec, deltas, tokens, honest))
    # Dropped by the filter in every part: listed as contributor nowhere (a no-show for the planner).
    assert all(sw.pids[3] not in dict(who) and len(who) == 3 for who in res[0].contributors.values())
    # The relayed packets are exposed for verified work: every sender, every part.
    assert set(res[0].contributions) == set(sw.pids)
    assert all(set(v) == {0, 1, 2, 3} for v in res[0].contributions.values())


class _StealthFlip(CollectiveService):
    """Pushes its delta with the 45% largest-magnitude coordinates flipped (the issue-28 red team's stealthy flip)."""

    async def all_reduce(self, spec, delta, tokens, compute_end=None, *, in_place=False):
        from tests.adversary import stealth_flip

        return await super().all_reduce(spec, stealth_flip(delta), tokens, compute_end, in_place=in_place)


@pytest.mark.parametrize("mode", ["relay", "reencode"])
async def test_the_support_filter_drops_a_stealthy_flip_at_every_peer(swarms, mode):
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [_StealthFlip])
    numel = 4 * 2048 * 3
    g = torch.Generator().manual_seed(3)
    true = torch.exp(torch.randn(numel, generator=g)) * torch.sign(torch.randn(numel, generator=g))
    deltas = {p: true + lvl * torch.randn(numel, generator=g) for p, lvl in zip(sw.pids, (0.8, 3.0, 1.5, 0.8))}
    spec = sw.spec(numel, mode=mode, deadline_s=10.0, min_support=0.5, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 1000) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == [] for r in res)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
    # every part: the three honest contributors only (so the flip is a no-show for the planner)
    assert all(sorted(dict(who)) == sorted(sw.pids[:3]) for who in res[0].contributors.values())
    if mode == "relay":  # no say in any sign: those of the rule over the honest contributions alone (the
        # magnitude is min(median scale of all, of the kept), so it is not the honest-only one bit for bit)
        honest = {p: deltas[p] for p in sw.pids[:3]}
        alone = _expected(spec, honest, {p: 1000 for p in honest}, sw.pids[:3])
        assert torch.equal(torch.sign(res[0].aggregate), torch.sign(alone))
    # without the support filter the fixed 0.5 agreement filter lets it in (what the red team found)
    spec = sw.spec(numel, mode=mode, round=2, deadline_s=10.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 1000) for s, p in zip(sw.services, sw.pids)])
    assert all(sw.pids[3] in dict(who) for who in res[0].contributors.values())


async def _round_with_evil_owner(swarms, evil_cls, *, seed: int):
    """One robust relay round of 4 peers (8192 fp32 elements, 100 tokens each), peer 3 an owner of class
    ``evil_cls``: asserts every reader refuses peer 3's part (missing, all zeros) and all aggregates are
    bitwise equal. Returns (peer 0's CollectiveResult, the evil PartOwner)."""
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [evil_cls])
    numel = 4 * 2048
    deltas = _honest_deltas(sw.pids, numel, seed=seed)
    spec = sw.spec(numel, mode="relay", deadline_s=3.0, **ROBUST)
    evil_part = spec.part_index_of(sw.pids[3])
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == evil_part for r in res)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
    o = spec.owners[evil_part[0]]
    assert not res[0].aggregate[o.start : o.end].any()
    return res[0], o


class _SelfishOwner(CollectiveService):
    """As an owner, relays only its own contribution (drops everybody else's)."""

    def _build_result(self, spec, part, contributions):
        return super()._build_result(spec, part, [c for c in contributions if c.sender == self.peer_id])


async def test_an_owner_that_drops_the_others_loses_its_part_everywhere(swarms):
    res, o = await _round_with_evil_owner(swarms, _SelfishOwner, seed=1)  # below the quorum of 2: refused
    assert res.aggregate[: o.start].count_nonzero() > 0.5 * o.start  # 2-2 ties of the sign mean are 0


def test_quorum_count():
    sw = Swarm(4)
    sw.addresses = ["127.0.0.1:1"] * 4
    assert sw.spec(8192, quorum=0.5).quorum_count() == 2
    assert sw.spec(8192, quorum=0.51).quorum_count() == 3
    assert sw.spec(8192, quorum=0.0).quorum_count() == 0
    with pytest.raises(ValueError, match="quorum"):
        sw.spec(8192, quorum=1.5)
    with pytest.raises(ValueError, match="rule"):
        sw.spec(8192, rule="median")


class _TamperingOwner(CollectiveService):
    """As an owner, flips one byte near the end of one other sender's signed contribution it relays (the
    rest stay valid: enough for the quorum, so only the tampering rule refuses the part)."""

    def _build_result(self, spec, part, contributions):
        victim = next(c.sender for c in contributions if c.sender != self.peer_id)

        def spoil(c):
            if c.sender != victim:
                return c
            b = bytearray(c.signed)
            b[-5] ^= 0x01
            return dataclasses.replace(c, signed=bytes(b))

        return super()._build_result(spec, part, [spoil(c) for c in contributions])


async def test_an_owner_that_relays_a_tampered_contribution_forfeits_its_part(swarms):
    """A relayed contribution that fails a byte-only check (forged, tampered, malformed) proves the owner
    altered it (it verified what it took): every reader refuses the part, whatever the quorum says."""
    await _round_with_evil_owner(swarms, _TamperingOwner, seed=2)


class _KeepsAbstainers(CollectiveService):
    """As an owner, relays its own contribution and the 0-token ones only (drops every voting honest one)."""

    def _build_result(self, spec, part, contributions):
        return super()._build_result(
            spec, part, [c for c in contributions if c.sender == self.peer_id or c.tokens == 0]
        )


async def test_abstaining_contributions_do_not_make_a_quorum(swarms):
    """An adversarial review: a flipping owner of three relayed its own contribution and the 0-token one
    of a peer that trained nothing; that met the quorum of 2 and its flipped update moved the model alone
    every round. Only voting contributions count: the part aggregates to zero and is idle."""
    sw = await swarms(3, service_cls=[CollectiveService] * 2 + [_KeepsAbstainers])
    numel = 3 * 2048
    deltas = _honest_deltas(sw.pids, numel, seed=3)
    deltas[sw.pids[0]] = torch.zeros(numel)  # a peer that trained 0 steps this round
    tokens = {sw.pids[0]: 0, sw.pids[1]: 100, sw.pids[2]: 100}
    spec = sw.spec(numel, mode="relay", deadline_s=3.0, **ROBUST)
    evil_part = spec.part_index_of(sw.pids[2])[0]
    res = await asyncio.gather(
        *[
            s.all_reduce(spec, -deltas[p] if p == sw.pids[2] else deltas[p], tokens[p])
            for s, p in zip(sw.services, sw.pids)
        ]
    )
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
    o = spec.owners[evil_part]
    assert not res[0].aggregate[o.start : o.end].any()
    assert all((o.start, o.end) in r.idle_ranges() for r in res)
    assert sorted(res[0].contributors[evil_part]) == sorted([(sw.pids[0], 0), (sw.pids[2], 0)])


async def test_relay_readers_are_not_sent_their_own_contributions_and_apply_the_same_bits(swarms):
    """Issue 26: in relay mode an owner serves each reader the part's result without the reader's own signed
    contribution (``PullPartRequest.omit_caller``), which the reader puts back before the owner's signature is
    checked. Every reader then holds the owner's signed bytes exactly, the aggregate is bitwise the one of whole
    results, and each reader receives about the bytes it pushed less."""
    from geomesh_p2p.net.methods import COLLECTIVE_PULL, COLLECTIVE_PUSH

    numel = 2048 * 256
    runs = {}
    for omit in (False, True):
        sw = await swarms(4)
        for s in sw.services:
            s.omit_own = omit
        deltas = _honest_deltas(sw.pids, numel, seed=5)
        spec = sw.spec(numel, mode="relay", deadline_s=3.0, **ROBUST)
        res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
        assert all(r.missing_parts == [] for r in res)
        assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
        for j, o in enumerate(spec.owners):  # each reader holds the owner's signed bytes, its own entry put back
            owner = sw.services[sw.pids.index(o.peer_id)]
            signed = owner._rounds[spec.round].parts[j].result()
            readers = [s for s, p in zip(sw.services, sw.pids) if p != o.peer_id]
            assert all(bytes(s._rounds[spec.round].cache[j]) == signed for s in readers)
        pulled = [s.transport.stats.by_method.get(COLLECTIVE_PULL, (0, 0))[1] for s in sw.services]
        pushed = [s.transport.stats.by_method.get(COLLECTIVE_PUSH, (0, 0))[0] for s in sw.services]
        runs[omit] = (res[0].aggregate.clone(), pulled, pushed)
    (whole, pulled_whole, _), (omitted, pulled_omitted, pushed) = runs[False], runs[True]
    assert torch.equal(whole, omitted)  # the same update, bit for bit
    for i in range(4):
        # each reader pushed its contributions to 3 other owners and is sent their 3 results without them
        saved = pulled_whole[i] - pulled_omitted[i]
        assert 0.9 * pushed[i] <= saved <= pushed[i], (i, saved, pushed[i])  # pushes carry their envelopes too
