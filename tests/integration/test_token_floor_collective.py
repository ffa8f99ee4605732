"""The token floor in the collective (issue 28, the ``min_steps`` dodge; in-process gRPC swarms on 127.0.0.1).

A contributor planned 20 steps that claims fewer tokens than ``min_steps`` steps' worth is never drawn for a check
or a screen (``verify_task._eligible``). With the spec's ``token_floor`` its claim counts 0 tokens at every owner,
reader and validator alike: it is in no part's aggregate (bitwise the aggregate of the same round with that peer
claiming 0 tokens), every peer holds the same bits, and in accountable mode the validators find nothing against the
honest owners (their results list it with 0 tokens, as recomputed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from geomesh_p2p.exchange import CollectiveService

from tests.integration.test_collective_robust import ROBUST, _honest_deltas

pytestmark = pytest.mark.timeout(120)

NUMEL = 4 * 2048 * 2
FLOOR = 500  # the tokens of min_steps steps at the peer's planned batch (round.rules.spec.screen_token_floor)


async def _run(sw, mode: str, round: int, dodger_tokens: int, floor: bool):
    deltas = _honest_deltas(sw.pids, NUMEL, seed=5)
    # the dodger sends a pseudo-gradient that agrees with the others (the filters keep it) at a claim below its floor
    tokens = {p: 1000 for p in sw.pids} | {sw.pids[3]: dodger_tokens}
    spec = sw.spec(
        NUMEL,
        mode=mode,
        round=round,
        deadline_s=3.0,
        token_floor={p: FLOOR for p in sw.pids} if floor else {},
        **ROBUST,
    )
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens[p]) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == [] for r in res)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # bitwise, on every reader
    return spec, res


@pytest.mark.parametrize("mode", ["relay", "reencode", "accountable"])
async def test_a_claim_below_the_floor_counts_nothing_at_every_peer(swarms, mode):
    sw = await swarms(4, service_cls=[CollectiveService] * 4)
    dodger = sw.pids[3]
    # without a floor, a claim of 400 tokens (4 steps' worth) is in every part: the dodge the floor closes
    _, res = await _run(sw, mode, 1, 400, floor=False)
    assert all(dict(who).get(dodger) == 400 for who in res[0].contributors.values())
    # with the floor: in no part, and the aggregate is bitwise the one of a round the dodger claimed 0 tokens in
    spec, res = await _run(sw, mode, 2, 400, floor=True)
    # listed with 0 tokens, as a 0-token claim is: no weight, and no delivered work for the planner's evidence
    assert all(dict(who).get(dodger, 0) == 0 for who in res[0].contributors.values())
    _, zero = await _run(sw, mode, 3, 0, floor=False)
    assert torch.equal(res[0].aggregate, zero[0].aggregate)
    # a claim at the floor counts as before
    _, at = await _run(sw, mode, 4, FLOOR, floor=True)
    assert all(dict(who).get(dodger) == FLOOR for who in at[0].contributors.values())
    if mode == "accountable":  # every validator recomputes the owners' results with the floor: no proof
        assert all(r.proofs == [] for r in res)
        found = await asyncio.gather(*[s.validate_round(spec.round, timeout_s=5.0) for s in sw.services])
        assert [f for fs in found for f in fs] == []
