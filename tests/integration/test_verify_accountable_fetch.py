"""Verified work in accountable mode, the fetch (geomesh_p2p/exchange/fetch_input.py): after an accountable round
on in-process gRPC peers, a checker fetches the accused's signed contribution to one part -- from the part's owner
(``PullInputs(first, count=1)``: one input, not a page), else from the accused (``PullInputs(from_sender)``) --
and takes it only when its SHA-256 is the one the owner's result commits to; a holder serving other bytes or
refusing is a reason, never trusted.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from geomesh_p2p.exchange import CollectiveService, messages
from geomesh_p2p.exchange.commitment import DIGEST_BYTES
from geomesh_p2p.exchange.fetch_input import committed_round, fetch_input
from geomesh_p2p.net.methods import COLLECTIVE_INPUTS
from geomesh_p2p.trust.verify_commit import Committed, ContributionRefused, verified_packet
from geomesh_p2p.wire import collective_pb2

from tests.integration.test_collective_robust import ROBUST, _honest_deltas

pytestmark = pytest.mark.timeout(120)

NUMEL = 4 * 2048 * 2


async def _round(swarms, n=4, seed=0):
    sw = await swarms(n, service_cls=[CollectiveService] * n)
    deltas = _honest_deltas(sw.pids, NUMEL, seed=seed)
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=3.0, validators_per_part=1, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == [] for r in res)
    return sw, spec


def _received(service) -> int:
    return service.transport.stats.by_method.get(COLLECTIVE_INPUTS, (0, 0))[1]


async def test_a_checker_fetches_the_committed_contribution_from_the_accused_and_checks_it(swarms):
    sw, spec = await _round(swarms)
    checker, accused = sw.services[0], sw.pids[1]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id not in (sw.pids[0], accused))
    held = await asyncio.to_thread(committed_round, checker, spec.round)
    assert held is not None and set(held.inputs) == set(sw.pids)  # every sender's commitment of every part
    assert all(set(parts) == set(range(len(spec.owners))) for parts in held.inputs.values())
    assert set(held.own) == set(range(len(spec.owners)))  # its own contributions: pushes and its own part's
    tokens, dropped, digest = held.inputs[accused][j]
    theirs = await asyncio.to_thread(committed_round, sw.services[1], spec.round)
    want = theirs.own[j]  # what the accused pushed
    assert hashlib.sha256(want).digest()[:DIGEST_BYTES] == digest and tokens == 100 and not dropped
    r0 = _received(checker)
    got, why, n = await fetch_input(checker, spec.round, j, accused, digest, timeout_s=5.0)
    assert got == want and why == [] and n == len(want)
    # on the wire (from the owner, count = 1): that one contribution in a reply's envelope, not a page of four
    assert len(want) < _received(checker) - r0 < len(want) + 1024
    packet = verified_packet(
        got, Committed(tokens, digest), run_id=spec.run_id, accused=accused, round=spec.round, part=j,
        part_range=(spec.owners[j].start, spec.owners[j].end),
    )  # fmt: skip
    c = messages.check_contribution(checker._inner, spec, j, want, None)[1]
    assert packet.to_bytes() == c.packet.to_bytes()


async def test_an_owner_that_serves_other_bytes_is_refused_and_the_accused_serves_its_own(swarms):
    sw, spec = await _round(swarms, seed=3)
    checker, accused = sw.services[0], sw.pids[1]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id not in (sw.pids[0], accused))
    owner = sw.services[sw.pids.index(spec.owners[j].peer_id)]
    held = await asyncio.to_thread(committed_round, checker, spec.round)
    digest = held.inputs[accused][j][2]
    want = bytes(messages.push_request_contribution(sw.services[1]._rounds[spec.round].pushed[j]))
    part = owner._rounds[spec.round].parts[j]
    k = part.input_senders.index(accused)
    other = next(c for c in part.inputs if bytes(c) != want)
    part.inputs[k] = other  # the owner serves another (validly signed) input in the accused's place
    got, why, n = await fetch_input(checker, spec.round, j, accused, digest, timeout_s=5.0)
    assert got == want  # from the accused: the committed bytes
    assert len(why) == 1 and "the owner" in why[0] and "served other bytes than the committed contribution" in why[0]
    assert n >= len(other) + len(want)
    # the owner's bytes, offered under the commitment, are refused with the reason
    with pytest.raises(ContributionRefused, match="does not match the hash its owner's result commits to"):
        verified_packet(
            bytes(other), Committed(100, digest), run_id=spec.run_id, accused=accused, round=spec.round, part=j,
            part_range=(spec.owners[j].start, spec.owners[j].end),
        )  # fmt: skip


async def test_when_nobody_serves_the_committed_contribution_there_is_nothing_to_check_and_why(swarms):
    sw, spec = await _round(swarms, seed=5)
    checker, accused = sw.services[0], sw.pids[1]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id not in (sw.pids[0], accused))
    owner = sw.services[sw.pids.index(spec.owners[j].peer_id)]
    digest = (await asyncio.to_thread(committed_round, checker, spec.round)).inputs[accused][j][2]
    del sw.services[1]._rounds[spec.round].pushed[j]  # the accused holds nothing (NOT_FOUND)
    part = owner._rounds[spec.round].parts[j]
    part.inputs = [b"\x00" * 64 for _ in part.inputs]  # the owner serves other bytes
    got, why, n = await fetch_input(checker, spec.round, j, accused, digest, timeout_s=5.0)
    assert got is None and len(why) == 2
    assert "the owner" in why[0] and "other bytes" in why[0] and "the sender" in why[1] and "NOT_FOUND" in why[1]


async def test_pull_inputs_count_serves_at_most_that_many_inputs(swarms):
    sw, spec = await _round(swarms, seed=7)
    j = spec.part_index_of(sw.pids[1])[0]
    for count, want in ((1, 1), (2, 2), (0, 3)):  # 0: a page (every input from ``first`` on)
        req = collective_pb2.PullInputsRequest(round=spec.round, part=j, spec_id=spec.spec_id, first=1, count=count)
        reply = await sw.transports[0].call(
            sw.addresses[1], COLLECTIVE_INPUTS, req.SerializeToString(), round=spec.round, timeout=5.0
        )
        resp = collective_pb2.PullInputsResponse.FromString(reply.payload)
        assert resp.total == 4 and len(resp.contributions) == want


async def _kept_round(swarms, r: int, cfg, *, B: int = 1, H: int = 6, claim: int = 100):
    """A real accountable round ``r`` of 4 in-process peers kept by peer 0's verified work (rules/verified_accountable.py)
    under ``cfg``, its ``queue_screens`` recorded (no model runs): (sw, plan, res, wv, vw, calls); ``calls["screens"]``
    maps (accused, part) -> the signed bytes each queued screen got. Every peer is planned ``H`` steps of ``B`` x 16
    tokens and claims ``claim`` tokens. The caller closes ``wv``."""
    import torch

    from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan
    from geomesh_p2p.round.rules import verified_accountable
    from geomesh_p2p.round.rules.state import RoundState
    from geomesh_p2p.round.rules.verified import VerifiedWork
    from geomesh_p2p.trust.verify import WorkVerifier
    from tests.collective_util import RUN

    n, L = 4, 16
    sw = await swarms(n, service_cls=[CollectiveService] * n)
    budget = B * L * H
    deltas = _honest_deltas(sw.pids, NUMEL, seed=11)
    spec = sw.spec(NUMEL, mode="accountable", round=r, deadline_s=3.0, caps={p: budget for p in sw.pids}, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], claim) for s, p in zip(sw.services, sw.pids)])
    owned = {o.peer_id: (o.start, o.end) for o in spec.owners}
    plan = RoundPlan(
        run_id=RUN, round=r, leader=min(sw.pids), method="geomesh", mode="accountable", numel=NUMEL, seq_len=L,
        window_s=6.0, train_deadline=1e9 + 6, exchange_deadline=1e9 + 12, start_digest="d2", created_at=1e9,
        assignments=[
            PeerAssignment(
                peer_id=p, address="x:1", batch_size=B, micro_batch=B, accum_steps=1, inner_steps=H,
                token_budget=budget, part_start=owned[p][0], part_end=owned[p][1], predicted_compute_s=1.0,
                predicted_comm_s=0.1, predicted_idle_s=0.0,
            )
            for p in sorted(sw.pids)
        ],
    )  # fmt: skip
    me, service = sw.pids[0], sw.services[0]
    wv = WorkVerifier(cfg, identity=sw.ids[0], run_id=RUN, model=None, dataset=None, seed=0, lr=1e-3, weight_decay=0.1)
    calls: dict = {}

    def queue_screens(rr, *, due=None, signed_of=None):
        wanted = calls["wanted"]
        calls["screens"] = {(a, j): signed_of(j, a) for a, parts in wanted.items() for j in parts}

    wv.queue_screens = queue_screens  # type: ignore[method-assign]
    vw = VerifiedWork(RoundState(me=me), verifier=wv, theta=lambda: torch.zeros(NUMEL), collective=lambda: service)
    vw.verify_round = lambda *a, **k: None  # type: ignore[method-assign]  (no evidence to read here)
    assert await verified_accountable.keep(vw, r, plan, res[0])
    return sw, plan, res, wv, vw, calls


async def test_the_round_side_keeps_the_commitments_fetches_what_its_screens_need_and_queues_them(swarms):
    """rules/verified_accountable.py over a real accountable round (round 2: every contributor is screened): the
    round is kept with every part result's commitments and this peer's own packets, the contributions its screens
    want (every part of each newcomer it screens: a screen covers the whole contribution, session 31) are fetched, each matches its commitment, and the screens are
    queued with exactly those signed bytes; the sampled check draws nothing (share 0). No model runs here (the
    queue calls are recorded): the screens themselves are tests/unit/test_verify_accountable.py's."""
    from geomesh_p2p.round.rules import verified_accountable
    from geomesh_p2p.trust.verify_task import VerifyConfig

    sw, plan, res, wv, vw, calls = await _kept_round(swarms, 2, VerifyConfig(share=0.0))
    me = sw.pids[0]
    try:
        kept = wv._kept[2]
        assert kept.committed is not None and set(kept.committed) == set(sw.pids)
        assert set(kept.packets) == {me} and len(kept.packets[me]) == len(plan.assignments)  # its own, every part
        assert kept.screened == sorted(sw.pids)  # round 2: everybody is new
        wanted = calls["wanted"] = wv.accountable_wants(2)
        assert set(wanted) == set(sw.pids) - {me}  # 4 screeners per newcomer: all 3 others screen each one
        n_parts = len(plan.assignments)  # one part per peer
        assert all(len(parts) == n_parts for parts in wanted.values())
        figures = await verified_accountable.fetch_and_queue(vw, 2, plan, plan.assignments[0], res[0], timeout_s=5.0)
        assert figures["wanted"] == figures["fetched"] == 3 * n_parts and figures["refused"] == 0
        assert vw.fetch_counts == figures and vw.counts()["fetch"] == figures
        for (a, j), signed in calls["screens"].items():  # each screen gets the committed bytes of its parts
            assert signed is not None and hashlib.sha256(signed).digest()[:DIGEST_BYTES] == kept.committed[a][j].digest
        held = wv._packets(2, kept)
        assert all(not isinstance(held[a][j], Committed) for a, parts in wanted.items() for j in parts)
        assert wv.accountable_wants(2) == {}  # nothing left to fetch
    finally:
        wv.close()


async def test_an_established_contributors_sampled_screen_gets_its_contribution_fetched_too(swarms):
    """The kind (session 31, the backdoor benchmark's logs: "screening of ... not run: its contribution is not held
    here" for every sampled screen): accountable mode fetched what its screens need before it queued them, and drew
    the sampled screens of established contributors (the patient poisoner's defence) only when queueing, so none of
    them ever had its contribution. Round 7 has no newcomer; every established contributor is drawn here (a sampled
    share that makes the probability 1, 3 screeners each): all three are fetched (before: nothing) and screened. Each
    claims 1,792 tokens (7 steps of 16 x 16): a sampled screen draws only claims its gain test decides (session 46)."""
    from geomesh_p2p.round.rules import verified_accountable
    from geomesh_p2p.trust.verify_task import VerifyConfig

    cfg = VerifyConfig(share=0.0, sample_share=100.0, sample_screeners=3)
    sw, plan, res, wv, vw, calls = await _kept_round(swarms, 7, cfg, B=16, H=7, claim=7 * 16 * 16)
    me = sw.pids[0]
    try:
        kept = wv._kept[7]
        assert kept.screened == []  # no newcomer in round 7
        wanted = calls["wanted"] = wv.accountable_wants(7)
        assert set(wanted) == set(sw.pids) - {me}
        n_parts = len(plan.assignments)
        assert all(len(parts) == n_parts for parts in wanted.values())  # a screen covers the whole contribution
        assert kept.screened == sorted(sw.pids)  # the drawn ones (this peer too: others screen it)
        figures = await verified_accountable.fetch_and_queue(vw, 7, plan, plan.assignments[0], res[0], timeout_s=5.0)
        assert figures["wanted"] == figures["fetched"] == 3 * n_parts and figures["refused"] == 0
        for (a, j), signed in calls["screens"].items():
            assert signed is not None and hashlib.sha256(signed).digest()[:DIGEST_BYTES] == kept.committed[a][j].digest
        assert wv.accountable_wants(7) == {}
    finally:
        wv.close()
