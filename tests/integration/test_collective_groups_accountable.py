"""Accountable mode in grouped (two-level) rounds (issue 26): 9 in-process peers in groups of 3 on 127.0.0.1.

Checked: every peer applies the same bits, the two-level rule computed apart; honest rounds yield no finding at either
level; a leader that forges its cross result (level 2) and a slice owner that forges its group aggregate (level 1,
the signed cross contribution it hands on) are each caught by a drawn validator, a slice owner that drops a
receipted group push from its level-1 commitment is caught by the dropped member (a handoff-drop proof), the proof verifies at a third peer
from its bytes alone, a tampered proof is refused, and once the proof is in the DHT every honest peer excludes the
forger and only it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.exchange import accountable
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.groups import group_layout, level_specs
from geomesh_p2p.net.identity import EnvelopeError
from grpc import StatusCode as Code
from geomesh_p2p.round.rules.accountable import Accountability
from geomesh_p2p.trust import fraud
from geomesh_p2p.trust.verify import Verdicts
from geomesh_p2p.wire import collective_pb2
from tests.collective_util import RUN, deltas_for
from tests.integration.test_collective_groups import G, _reference, _run, _spec
from tests.unit.test_evidence_chunks import LimitedDHT


def _doctor_first_other(service):
    """Make ``service``'s owner side aggregate a doctored copy (signs of the first block flipped) of the first other
    sender's packet while its result still commits to the real signed contribution."""
    real = service._build_result

    def forged(self, spec, part, contributions):
        first = next((c for c in contributions if c.sender != self.peer_id), None)

        def doctor(c):
            if c is not first:
                return c
            dec = compression.decode(c.packet)
            dec[: spec.block_size] = -dec[: spec.block_size]
            return dataclasses.replace(c, packet=compression.encode(dec, spec.block_size, c.tokens))

        return real(spec, part, [doctor(c) for c in contributions])

    service._build_result = types.MethodType(forged, service)


async def _round(make, seed, forge=None):
    sw, grouped = await make(9)
    spec = _spec(sw, mode="accountable", validators_per_part=2)
    layout = group_layout(spec, G)
    assert layout is not None and len(layout.groups) == 3
    evil = None
    if forge == "leader":
        evil = layout.leaders[0][0]
        _doctor_first_other(grouped[sw.pids.index(evil)].cross)
    elif forge == "slice_owner":  # a slice owner that leads nothing: its forgery is at level 1 only
        evil = next(p for os in layout.slice_owners for p in os if all(p not in ls for ls in layout.leaders))
        _doctor_first_other(grouped[sw.pids.index(evil)].group)
    deltas = deltas_for(sw.pids, 3 * 4 * 2048, seed=seed)
    tokens = {p: 100 for p in sw.pids}
    out = await _run(grouped, spec, deltas, tokens)
    return sw, grouped, spec, layout, deltas, tokens, out, evil


async def _validate(grouped, spec):
    found = await asyncio.gather(*(gc.validate_round(spec.round, timeout_s=5.0) for gc in grouped))
    return [f for fs in found for f in fs]


@pytest.mark.timeout(120)
async def test_an_accountable_grouped_round_applies_the_same_bits_and_honest_owners_yield_no_finding(grouped_swarm):
    sw, grouped, spec, layout, deltas, tokens, out, _ = await _round(grouped_swarm, seed=21)
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])
    assert torch.equal(aggs[0], _reference(spec, layout, deltas, tokens, set(sw.pids)))
    assert all(r.missing_parts == [] for r in out.values())
    # the leaders' accountable results list the group members: every peer counted, none a no-show
    from geomesh_p2p.trust.probation import absent_participants

    assert all(absent_participants(spec.participants, r.contributors) == [] for r in out.values())
    # each slice owner's cross contribution carries its level-1 commitment (one input list of its 3 members)
    for gc in grouped:
        if layout.slice_of(gc.peer_id) is not None:
            gid, lists = gc.cross.handoff[spec.round]
            assert len(gid) == 32 and all(len(ls) == 1 and len(ls[0]) == 3 * 29 for ls in lists.values())
    findings = await _validate(grouped, spec)
    assert findings == []
    # every member checked its receipted pushes in its slice owners' signed level-1 commitments (no packet fetched):
    # each of the 9 holds receipts of its 2 mates' slices; the bytes received are a few hundred per commitment
    checks = [gc.drop_checks.get(spec.round, (0, 0)) for gc in grouped]
    assert all(n >= 2 for n, _ in checks), checks
    assert all(b <= n * 600 for n, b in checks), checks
    # validation ran at both levels: cross parts and hand-offs were fetched
    assert sum(gc.cross.validation_stats.get(spec.round, SimpleNamespace(parts=0)).parts for gc in grouped) > 0
    inputs = [
        gc.group.transport.stats.by_method.get("/geomesh.wire.CollectiveGroup/PullInputs", (0, 0)) for gc in grouped
    ]
    assert sum(b for _, b in inputs) > 0


@pytest.mark.timeout(120)
async def test_a_forging_leader_is_proven_and_excluded_by_every_honest_peer(grouped_swarm):
    sw, grouped, spec, layout, _, _, out, evil = await _round(grouped_swarm, seed=22, forge="leader")
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])  # forged, but the same bits everywhere
    findings = await _validate(grouped, spec)
    forged = [f for f in findings if f.kind == "forgery"]
    assert forged and all(f.owner == evil for f in forged)
    assert [f for f in findings if f.kind != "forgery"] == []
    v = accountable.verify_proof(RUN, forged[0].proof)
    assert (v.kind, v.accused) == ("forgery", evil) and "aggregate differs" in v.reason
    # in the DHT: every honest peer excludes the leader, and only it
    excluded = await _excluded_everywhere(sw, grouped, forged[0].proof, spec.round)
    for pid, out_of in excluded.items():
        if pid == evil:
            assert out_of == {}
        else:
            assert set(out_of) == {evil} and "forgery proven" in out_of[evil]


@pytest.mark.timeout(120)
async def test_a_slice_owner_forging_its_group_aggregate_is_proven_by_its_handoff(grouped_swarm):
    sw, grouped, spec, layout, _, _, out, evil = await _round(grouped_swarm, seed=23, forge="slice_owner")
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])
    findings = await _validate(grouped, spec)
    forged = [f for f in findings if f.kind == "forgery"]
    # the drawn members of its group (validators_per_part = 2 of its 2 mates) each prove it; nobody else is accused
    assert len(forged) == 2 and all(f.owner == evil for f in forged), findings
    assert [f for f in findings if f.kind != "forgery"] == []
    v = accountable.verify_proof(RUN, forged[0].proof)
    assert (v.kind, v.accused, v.round) == ("handoff", evil, spec.round)
    assert "packet differs from the group rule" in v.reason
    # tampering: inputs swapped (not what the owner committed to) or another group spec: refused, nobody accused
    p = collective_pb2.AccountabilityProof.FromString(forged[0].proof)
    p.contributions[0], p.contributions[1] = p.contributions[1], p.contributions[0]
    with pytest.raises(accountable.ProofError, match="not the contribution committed to"):
        accountable.verify_proof(RUN, p.SerializeToString())
    p = collective_pb2.AccountabilityProof.FromString(forged[0].proof)
    other_g = next(g for g in range(len(layout.groups)) if evil not in layout.groups[g])
    from geomesh_p2p.exchange.groups import level_specs

    gspecs, _ = level_specs(spec, layout, spec.pull_deadline - 6.0, 128 << 20)
    import json

    p.spec_json = json.dumps(gspecs[other_g].to_dict(), sort_keys=True)
    with pytest.raises(accountable.ProofError, match="another group spec"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # an honest slice owner's hand-off proves nothing
    honest = next(p for os in layout.slice_owners for p in os if p != evil)
    assert all(f.owner != honest for f in findings)
    # the proof excludes the forger through the DHT
    dht = LimitedDHT()
    assert await fraud.publish_proof(dht, forged[0].proof, sw.ids[0], run_id=RUN, slot=spec.round, expiration_time=1e12)
    valid, refused = await fraud.read_proofs(dht, fraud.ProofReader(dht), RUN, [spec.round])
    assert refused == [] and [x.verdict.accused for x in valid] == [evil]


@pytest.mark.timeout(120)
async def test_a_slice_owner_whose_group_part_missed_the_quorum_is_not_proven_to_forge(grouped_swarm):
    """Red team, session 26 (16 peer processes on 2 cores, tests/e2e/test_accountable_groups_procs.py): an honest
    slice owner's group part closed short of the quorum (pushes past its deadline under load). Its own read refuses
    that result, so it hands on zeros for the part's range and counts no member, while its commitment lists the
    inputs it had. The drawn mates recomputed the group rule over those inputs, "proved" a forgery, and every peer
    excluded the honest owner. Here: quorum 1.0 (every member in every part) and one mate's contribution left out
    of the owner's part (as a push that came after the part closed): no finding against it."""
    sw, grouped = await grouped_swarm(9)
    spec = _spec(sw, mode="accountable", validators_per_part=2, quorum=1.0)
    layout = group_layout(spec, G)
    assert layout is not None and len(layout.groups) == 3
    short = next(p for os in layout.slice_owners for p in os if all(p not in ls for ls in layout.leaders))
    mate = next(p for p in layout.groups[layout.group_of(short)] if p != short)
    service = grouped[sw.pids.index(short)].group
    real = service._accept

    def closed_before_the_mate(self, state, part, c):
        if c.sender == mate:
            raise EnvelopeError(
                Code.FAILED_PRECONDITION, f"part {part.index} closed (deadline) before this push arrived"
            )
        return real(state, part, c)

    service._accept = types.MethodType(closed_before_the_mate, service)
    deltas = deltas_for(sw.pids, 3 * 4 * 2048, seed=24)
    out = await _run(grouped, spec, deltas, {p: 100 for p in sw.pids})
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])
    # the owner's hand-off commits to the 2 inputs it had, and hands on zeros with no member for that range
    _, lists = grouped[sw.pids.index(short)].cross.handoff[spec.round]
    assert [len(x) for ls in lists.values() for x in ls] == [2 * 29] * sum(len(ls) for ls in lists.values())
    findings = await _validate(grouped, spec)
    assert [f for f in findings if f.owner == short] == [], [(f.kind, f.owner[:10], f.reason) for f in findings]
    # the hand-off was validated (its mates fetched the group inputs), and found exactly what the owner handed on
    stats = [
        gc.group.transport.stats.by_method.get("/geomesh.wire.CollectiveGroup/PullInputs", (0, 0)) for gc in grouped
    ]
    assert sum(b for _, b in stats) > 0


def _drop_from_commitment(service, mate):
    """Make ``service``'s owner side receipt ``mate``'s push as usual, then leave it out of its signed result (its
    input list and its aggregate): a slice owner's level-1 drop, which no recomputation catches."""
    real = service._build_result

    def dropping(self, spec, part, contributions):
        kept = [c for c in contributions if c.sender != mate]
        part.inputs, part.input_senders = [c.signed for c in kept], [c.sender for c in kept]  # served consistently
        return real(spec, part, kept)

    service._build_result = types.MethodType(dropping, service)


async def _excluded_everywhere(sw, grouped, proof, round):
    """The peers that exclude someone once ``proof`` is in the DHT, each with who it excludes and why."""
    dht = LimitedDHT()
    accs = []
    for k, gc in enumerate(grouped):
        verdicts = Verdicts(sw.pids[k])
        acc = Accountability(
            lambda v=verdicts: v,
            collective=lambda gc=gc: gc,
            dht=lambda: dht,
            identity=sw.ids[k],
            run_id=RUN,
            validate_timeout_s=2.0,
        )
        accs.append((acc, verdicts))
    assert await fraud.publish_proof(dht, proof, sw.ids[0], run_id=RUN, slot=round, expiration_time=1e12)
    for acc, _ in accs:
        await acc.read(round)
    return {sw.pids[k]: dict(v.excluded) for k, (_, v) in enumerate(accs)}


@pytest.mark.timeout(120)
async def test_a_slice_owner_that_drops_a_receipted_mate_is_proven_by_that_mate_and_excluded(grouped_swarm):
    """A slice owner receipts a group mate's push, then leaves it out of its group result, so of the level-1
    commitment its cross contribution carries, and of the aggregate it hands on. Before session 27 nobody proved it
    (the recomputation over the committed inputs matches). Now the mate checks the owner's signed commitment
    (fetched alone from the leader that counted it) against its receipt: a handoff-drop proof, which excludes the
    owner at every honest peer; tampered copies are refused with a reason."""
    sw, grouped = await grouped_swarm(9)
    spec = _spec(sw, mode="accountable", validators_per_part=2)
    layout = group_layout(spec, G)
    assert layout is not None and len(layout.groups) == 3
    evil = next(p for os in layout.slice_owners for p in os if all(p not in ls for ls in layout.leaders))
    g = layout.group_of(evil)
    mate, other = [p for p in layout.groups[g] if p != evil]
    _drop_from_commitment(grouped[sw.pids.index(evil)].group, mate)
    deltas = deltas_for(sw.pids, 3 * 4 * 2048, seed=25)
    out = await _run(grouped, spec, deltas, {p: 100 for p in sw.pids})
    aggs = [r.aggregate for r in out.values()]
    assert all(torch.equal(aggs[0], a) for a in aggs[1:])
    findings = await _validate(grouped, spec)
    # the dropped mate, and only it, proves the drop (once per group part of the owner it pushed to); the
    # hand-off recomputation finds nothing (list and aggregate agree), nobody else is accused
    assert findings and all((f.kind, f.owner) == ("drop", evil) for f in findings), [
        (f.kind, f.owner[:10], f.reason) for f in findings
    ]
    gspec = grouped[sw.pids.index(mate)].levels[spec.round][2][g]
    owned = [j for j, o in enumerate(gspec.owners) if o.peer_id == evil]
    assert sorted(f.part for f in findings) == owned
    v = accountable.verify_proof(RUN, findings[0].proof)
    assert (v.kind, v.accused, v.round) == ("handoff-drop", evil, spec.round)
    assert "not in the result's inputs" in v.reason
    assert fraud.accused_of(findings[0].proof) == evil
    excluded = await _excluded_everywhere(sw, grouped, findings[0].proof, spec.round)
    for p, ex in excluded.items():
        if p == evil:
            assert ex == {}
        else:
            assert set(ex) == {evil} and "handoff-drop proven" in ex[evil], (p[:10], ex)
    # tampering: each refused with its reason
    good = collective_pb2.AccountabilityProof.FromString(findings[0].proof)
    j = good_part = findings[0].part
    listed = grouped[sw.pids.index(other)].group._rounds[spec.round].receipts[good_part]
    p = collective_pb2.AccountabilityProof.FromString(findings[0].proof)
    p.receipt = listed.signed  # another mate's receipt: its push is in the commitment
    with pytest.raises(accountable.ProofError, match="in the commitment as receipted: no drop"):
        accountable.verify_proof(RUN, p.SerializeToString())
    p = collective_pb2.AccountabilityProof.FromString(findings[0].proof)
    env = __import__("geomesh_p2p.wire.envelope_pb2", fromlist=["x"]).SignedMessage.FromString(p.commitment)
    env.payload = env.payload[:-1] + bytes([env.payload[-1] ^ 1])  # a forged commitment: not what was signed
    p.commitment = env.SerializeToString()
    with pytest.raises(accountable.ProofError, match="the commitment does not open"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # a receipt the owner signed for another round's spec (same part, same push hash)
    rc = accountable.open_receipt(accountable.Verifier(RUN, max_skew_s=float("inf")), good.receipt)
    body = collective_pb2.Receipt(
        round=spec.round + 1, part=j, spec_id=bytes(32), sender=bytes(32), tokens=rc.tokens,
        contribution_sha256=rc.sha256,
    ).SerializeToString()  # fmt: skip
    evil_id = sw.ids[sw.pids.index(evil)]
    p = collective_pb2.AccountabilityProof.FromString(findings[0].proof)
    p.receipt = evil_id.sign_message(
        run_id=RUN, round=spec.round + 1, kind=accountable.RECEIPT_KIND, payload=body
    ).SerializeToString()
    with pytest.raises(accountable.ProofError, match="not for the proof's group spec"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # the receipt of a part of another owner (not the commitment's signer)
    p = collective_pb2.AccountabilityProof.FromString(findings[0].proof)
    p.receipt = next(
        rc.signed for rc in grouped[sw.pids.index(mate)].group._rounds[spec.round].receipts.values() if rc.owner != evil
    )
    with pytest.raises(accountable.ProofError, match="signed by different peers"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # the leader refuses an X whose level-1 commitment is missing or not its sender's (else an owner could hand on a
    # contribution whose lists no member can check without the packet)
    from geomesh_p2p.exchange import group_commitment, messages

    c = layout.slice_of(evil)
    xs = grouped[0].levels[spec.round][3][c]
    leader = grouped[sw.pids.index(xs.owners[0].peer_id)]
    signed_x = next(
        bytes(x)
        for x, who in zip(
            leader.cross._rounds[spec.round].parts[0].inputs, leader.cross._rounds[spec.round].parts[0].input_senders
        )
        if who == evil
    )
    env_pb2 = __import__("geomesh_p2p.wire.envelope_pb2", fromlist=["x"])
    head = collective_pb2.PartContribution.FromString(env_pb2.SignedMessage.FromString(signed_x).payload)
    verifier = accountable.Verifier(RUN, max_skew_s=float("inf"))
    assert messages.check_contribution(verifier, xs, None, signed_x, evil)[1].group_inputs == tuple(head.group_inputs)
    mate_id = sw.ids[sw.pids.index(mate)]
    for commitment, why in [
        (b"", "not its own: message has no envelope"),
        (
            group_commitment.sign_commitment(
                mate_id, RUN, spec.round, xs.spec_id, 0, head.group_spec_id, list(head.group_inputs)
            ),
            "signed by another peer",
        ),
    ]:
        head.group_commitment = commitment
        resigned = evil_id.sign_message(
            run_id=RUN, round=spec.round, kind=messages.CONTRIBUTION_KIND, payload=head.SerializeToString()
        ).SerializeToString()
        with pytest.raises(EnvelopeError, match=why):
            messages.check_contribution(verifier, xs, None, resigned, evil)


def _inflate(service):
    """Make ``service``'s owner side aggregate every contribution multiplied by -20 (tests.adversary's
    ``forge-aggregate``) while its result still commits to the real signed contributions."""
    real = service._build_result

    def forged(self, spec, part, contributions):
        def doctor(c):
            dec = compression.decode(c.packet) * -20.0
            return dataclasses.replace(c, packet=compression.encode(dec, spec.block_size, c.tokens))

        return real(spec, part, [doctor(c) for c in contributions])

    service._build_result = types.MethodType(forged, service)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["reencode", "accountable"])
async def test_a_slice_owner_leading_a_cross_part_that_serves_a_minus_20x_aggregate_is_refused_by_every_reader(
    grouped_swarm, mode
):
    """Issue 26, session 30: the round's scale bound on grouped levels. A slice owner that leads a cross part serves
    -20x the true level-2 aggregate; every reader (its cross set, which reads the leader, and the group members,
    which gather the part from their slice owner) refuses it before decoding: the part is a zero update everywhere,
    every other part is the two-level rule's exact value, and in accountable mode the forger is still proven."""
    sw, grouped = await grouped_swarm(9)
    bound = 10.0
    spec = _spec(sw, mode=mode, validators_per_part=2, max_scale=bound)
    layout = group_layout(spec, G)
    assert layout is not None and len(layout.groups) == 3
    evil = layout.leaders[0][0]
    assert layout.slice_of(evil) is not None  # a slice owner that also leads a part of a cross level
    _inflate(grouped[sw.pids.index(evil)].cross)
    deltas = deltas_for(sw.pids, 3 * 4 * 2048, seed=24)
    tokens = {p: 100 for p in sw.pids}
    out = await _run(grouped, spec, deltas, tokens)
    ref = _reference(spec, layout, deltas, tokens, set(sw.pids))
    assert 0 < float(ref.abs().max()) < bound < 20 * float(ref.abs().max())  # honest within, the forgery above
    _, xspecs = level_specs(spec, layout, spec.pull_deadline - 6.0, 128 << 20)
    ranges = [(a + o.start, a + o.end, o.peer_id) for (a, _), xs in zip(layout.slices, xspecs) for o in xs.owners]
    bad = [k for k, (_, _, p) in enumerate(ranges) if p == evil]
    assert bad
    expected = ref.clone()
    for k in bad:
        expected[ranges[k][0] : ranges[k][1]] = 0.0
    for k, r in out.items():
        assert r.missing_parts == bad, (k, r.missing_parts)
        assert torch.equal(r.aggregate, expected), k  # bitwise the same everywhere, the forgery applied nowhere
    if mode != "accountable":
        return
    # every peer keeps the refused results as the leader signed them, as it keeps applied ones: the level-1
    # validator draw (a seed over every cross result's hash) is the same everywhere
    from geomesh_p2p.exchange.group_audit import _cross_results

    held = [_cross_results(gc, gc.levels[spec.round][3], spec.round) for gc in grouped]
    assert all(h == held[0] for h in held) and len(held[0]) == len(ranges)
    findings = await _validate(grouped, spec)
    forged = [f for f in findings if f.kind == "forgery"]
    assert forged and all(f.owner == evil for f in forged), findings
    assert [f for f in findings if f.kind != "forgery"] == []
    v = accountable.verify_proof(RUN, forged[0].proof)
    assert (v.kind, v.accused) == ("forgery", evil)
