"""Accountable re-encoding (issue 26): in-process gRPC swarms on 127.0.0.1.

What is checked: every reader applies the same bytes (bitwise-equal aggregates, equal to the robust rule over
the inputs); an owner that drops a receipted contribution is proven (the proof checks at a third peer, a forged
or empty one is refused); an owner that forges its aggregate (flipped signs, an inflated scale) is caught by a
validator and the fraud proof verifies at a third peer, while honest owners never yield a proof; an owner
that signs two results for one part is caught; malformed receipts and proofs are refused with a reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc

import pytest
import torch

from geomesh_p2p.exchange import CollectiveService, decode_aggregate, encode_aggregate
from geomesh_p2p.exchange import accountable, audit, messages
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.exchange.commitment import RECORD_BYTES, InputsError, decode_inputs
from geomesh_p2p.net.identity import EnvelopeError, Identity, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

from geomesh_p2p.round.rules.accountable import Accountability
from geomesh_p2p.trust import fraud
from geomesh_p2p.trust.verify import Verdicts

from geomesh_p2p.net.methods import COLLECTIVE_INPUTS, COLLECTIVE_PULL
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.net.transport import RpcError

from tests.collective_util import RUN, Swarm
from tests.unit.test_evidence_chunks import LimitedDHT
from tests.integration.test_collective_robust import ROBUST, _expected, _honest_deltas

pytestmark = pytest.mark.timeout(120)

NUMEL = 4 * 2048 * 2


async def _round(swarms, classes, *, validators=1, seed=0, tokens=100):
    sw = await swarms(len(classes), service_cls=classes)
    deltas = _honest_deltas(sw.pids, NUMEL, seed=seed)
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=3.0, validators_per_part=validators, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], tokens) for s, p in zip(sw.services, sw.pids)])
    return sw, spec, deltas, res


async def _validate_all(sw, spec, parts=None):
    out = await asyncio.gather(*[s.validate_round(spec.round, timeout_s=5.0, parts=parts) for s in sw.services])
    return [f for fs in out for f in fs]


async def test_accountable_readers_apply_the_same_bits_and_honest_owners_yield_no_proof(swarms):
    sw, spec, deltas, res = await _round(swarms, [CollectiveService] * 4, validators=3)
    assert all(r.missing_parts == [] for r in res)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # bitwise, on every reader
    mean = _expected(spec, deltas, {p: 100 for p in sw.pids}, sw.pids)  # the rule over every input ...
    for o in spec.owners:  # ... re-encoded by its owner as the round's aggregate encoding (sign)
        enc = encode_aggregate(spec.aggregate_encoding, mean[o.start : o.end].contiguous(), spec.block_size, 400)
        mean[o.start : o.end] = decode_aggregate(spec.aggregate_encoding, enc, o.size)
    assert torch.equal(res[0].aggregate, mean)
    assert all(r.contributors == res[0].contributors for r in res)
    assert all(sorted(p for p, _ in who) == sorted(sw.pids) for who in res[0].contributors.values())
    # every peer holds a receipt for each part it pushed to another owner, and one result hash per part
    for s, p, r in zip(sw.services, sw.pids, res):
        state = s._rounds[spec.round]
        assert set(state.receipts) == {j for j, o in enumerate(spec.owners) if o.peer_id != p}
        assert all(rc.sender == p and rc.tokens == 100 for rc in state.receipts.values())
        assert set(r.result_hashes) == set(range(len(spec.owners))) and r.proofs == []
    assert len({r.results_digest for r in res}) == 1 and len(res[0].results_digest) == 64
    # every other peer validates every part (validators_per_part = 3 of 3 candidates): nothing found
    sent_before = [s.transport.stats.by_method.get("/geomesh.wire.Collective/PullInputs", (0, 0)) for s in sw.services]
    assert await _validate_all(sw, spec) == []
    pulled = [s.transport.stats.by_method.get("/geomesh.wire.Collective/PullInputs", (0, 0)) for s in sw.services]
    assert all(b[1] > a[1] for a, b in zip(sent_before, pulled))  # the inputs were really fetched


class _Dropper(CollectiveService):
    """As an owner, receipts every push but leaves the first other sender out of its result."""

    victim: str = ""

    def _build_result(self, spec, part, contributions):
        kept = [c for c in contributions if c.sender != type(self).victim]
        return super()._build_result(spec, part, kept)


async def test_an_owner_that_drops_a_receipted_contribution_is_proven(swarms):
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [_Dropper])
    _Dropper.victim = sw.pids[0]
    deltas = _honest_deltas(sw.pids, NUMEL, seed=2)
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=3.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    evil = spec.part_index_of(sw.pids[3])
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # the same (lossy) bytes everywhere
    assert len(res[0].proofs) == len(evil) and all(r.proofs == [] for r in res[1:])
    proof = res[0].proofs[0]
    # a third peer checks it from the bytes alone
    v = accountable.verify_proof(RUN, proof)
    assert (v.kind, v.accused, v.round, v.part) == ("drop", sw.pids[3], spec.round, evil[0])
    assert "not in the result" in v.reason
    # a forged proof: the receipt re-signed by someone else than the owner is refused
    p = collective_pb2.AccountabilityProof.FromString(proof)
    rc = collective_pb2.Receipt.FromString(envelope_pb2.SignedMessage.FromString(p.receipt).payload)
    other = Identity.generate()
    fake = other.sign_message(
        run_id=RUN, round=spec.round, kind=accountable.RECEIPT_KIND, payload=rc.SerializeToString()
    )
    p.receipt = fake.SerializeToString()
    with pytest.raises(accountable.ProofError, match="not one owner's"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # a receipt with a flipped payload byte is refused as tampered
    p = collective_pb2.AccountabilityProof.FromString(proof)
    b = bytearray(p.receipt)
    b[-3] ^= 1
    p.receipt = bytes(b)
    with pytest.raises(accountable.ProofError, match="tampered|malformed"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # a "drop proof" against an honest owner (its result holds the receipted push) proves nothing
    honest_j = spec.part_index_of(sw.pids[1])[0]
    rc_ok = sw.services[0]._rounds[spec.round].receipts[honest_j]
    honest_result = sw.services[0]._rounds[spec.round].cache[honest_j]
    with pytest.raises(accountable.ProofError, match="no drop"):
        accountable.verify_proof(RUN, accountable.drop_proof(rc_ok.signed, honest_result))


class _Forger(CollectiveService):
    """As an owner, aggregates a doctored copy of the first other sender's packet (signs flipped, or a scale
    x1000) while its result still commits to the sender's real signed contribution."""

    how = "flip"

    def _build_result(self, spec, part, contributions):
        def doctor(c):
            if c.sender == self.peer_id or c is not next(x for x in contributions if x.sender != self.peer_id):
                return c
            dec = compression.decode(c.packet)
            if type(self).how == "flip":
                dec[: spec.block_size] = -dec[: spec.block_size]
            else:
                dec[: spec.block_size] *= 1000.0
            return dataclasses.replace(c, packet=compression.encode(dec, spec.block_size, c.tokens))

        return super()._build_result(spec, part, [doctor(c) for c in contributions])


@pytest.mark.parametrize("how", ["flip", "scale"])
async def test_a_forging_owner_is_caught_by_a_validator_and_the_proof_checks_elsewhere(swarms, how):
    _Forger.how = how
    sw, spec, deltas, res = await _round(swarms, [CollectiveService] * 3 + [_Forger], validators=1, seed=3)
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)  # forged, but the same bits everywhere
    evil = spec.part_index_of(sw.pids[3])
    findings = await _validate_all(sw, spec)
    forged = [f for f in findings if f.kind == "forgery"]
    assert [f.part for f in forged] == evil and all(f.owner == sw.pids[3] for f in forged)
    assert [f for f in findings if f.kind != "forgery"] == []  # the honest owners' parts: no proof
    # exactly the drawn validator found it
    hashes = [res[0].result_hashes[j] for j in range(len(spec.owners))]
    drawn = accountable.draw_validators(spec, hashes, evil[0], 1)
    assert len(drawn) == 1 and drawn[0] != sw.pids[3]
    # a third peer re-checks the proof from its bytes
    v = accountable.verify_proof(RUN, forged[0].proof)
    assert (v.kind, v.accused, v.part) == ("forgery", sw.pids[3], evil[0]) and "aggregate differs" in v.reason
    # tampering with the proof: an input swapped for another sender's is refused (not what was committed)
    p = collective_pb2.AccountabilityProof.FromString(forged[0].proof)
    p.contributions[0], p.contributions[1] = p.contributions[1], p.contributions[0]
    with pytest.raises(accountable.ProofError, match="not the contribution the result commits to"):
        accountable.verify_proof(RUN, p.SerializeToString())
    # the same proof bytes with an honest owner's result and inputs prove nothing
    hj = spec.part_index_of(sw.pids[1])[0]
    inputs = [bytes(c) for c in sw.services[1]._rounds[spec.round].parts[hj].inputs]
    honest = accountable.forgery_proof(spec, sw.services[0]._rounds[spec.round].cache[hj], inputs)
    with pytest.raises(accountable.ProofError, match="no forgery"):
        accountable.verify_proof(RUN, honest)


class _Equivocator(CollectiveService):
    """As an owner, serves a second signed result (another ``closed_by``) to the peers in ``victims``."""

    victims: set = set()

    def _build_result(self, spec, part, contributions):
        self.alt = getattr(self, "alt", {})
        self.alt[part.index] = messages.build_result(
            self.transport.identity, spec, part.index, part.owner, "equivocated", contributions, part.witness_receipt
        )
        return super()._build_result(spec, part, contributions)

    async def _handle_pull(self, verified, context):
        req = collective_pb2.PullPartRequest.FromString(verified.payload)
        state = self._rounds.get(req.round)
        if verified.sender.to_string() in type(self).victims and state is not None and req.part in state.parts:
            part = state.parts[req.part]
            await asyncio.wait_for(part.ready.wait(), 10.0)
            return collective_pb2.PullPartResponse(
                round=req.round, part=req.part, ready=True, signed_result=self.alt[req.part]
            ).SerializeToString()
        return await super()._handle_pull(verified, context)


async def test_an_equivocating_owner_is_detected(swarms):
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [_Equivocator])
    _Equivocator.victims = {sw.pids[0], sw.pids[1]}
    deltas = _honest_deltas(sw.pids, NUMEL, seed=4)
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=3.0, validators_per_part=3, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    evil = spec.part_index_of(sw.pids[3])[0]
    # the aggregates agree (same aggregate bytes), the results do not: the results digest tells
    assert res[0].results_digest == res[1].results_digest != res[2].results_digest
    findings = await _validate_all(sw, spec, parts=[evil])
    eq = [f for f in findings if f.kind == "equivocation"]
    assert eq and all(f.owner == sw.pids[3] and f.part == evil for f in eq)
    v = accountable.verify_proof(RUN, eq[0].proof)
    assert (v.kind, v.accused) == ("equivocation", sw.pids[3])
    p = collective_pb2.AccountabilityProof.FromString(eq[0].proof)
    p.other_result = p.result  # the same result twice is no equivocation
    with pytest.raises(accountable.ProofError, match="same result"):
        accountable.verify_proof(RUN, p.SerializeToString())


def test_malformed_receipts_proofs_and_input_lists_are_refused_with_a_reason():
    verifier = Verifier(RUN, max_skew_s=float("inf"))
    with pytest.raises(accountable.ProofError, match="malformed"):
        accountable.verify_proof(RUN, b"\xff\xff\xff")
    with pytest.raises(accountable.ProofError, match="unknown proof kind"):
        accountable.verify_proof(RUN, collective_pb2.AccountabilityProof(kind="gossip").SerializeToString())
    with pytest.raises(accountable.ProofError, match="over the limit"):
        accountable.verify_proof(RUN, b"x" * 100, max_bytes=10)
    with pytest.raises(accountable.ProofError, match="does not open"):
        accountable.verify_proof(
            RUN, collective_pb2.AccountabilityProof(kind="drop", result=b"junk").SerializeToString()
        )
    with pytest.raises(EnvelopeError, match="not a SignedMessage"):
        accountable.open_receipt(verifier, b"\x0a\xff")
    ident = Identity.generate()
    wrong_kind = ident.sign_message(run_id=RUN, round=1, kind="geomesh.collective/PartResult", payload=b"")
    with pytest.raises(EnvelopeError, match="kind"):
        accountable.open_receipt(verifier, wrong_kind.SerializeToString())
    short = ident.sign_message(
        run_id=RUN, round=1, kind=accountable.RECEIPT_KIND,
        payload=collective_pb2.Receipt(round=1, sender=bytes(ident.peer_id), contribution_sha256=b"x").SerializeToString(),
    )  # fmt: skip
    with pytest.raises(EnvelopeError, match="wrong length"):
        accountable.open_receipt(verifier, short.SerializeToString())
    with pytest.raises(InputsError, match="whole number"):
        decode_inputs(b"x" * (RECORD_BYTES + 1), 4)
    rec = (5).to_bytes(4, "little") + bytes(8) + b"\0" + bytes(16)
    with pytest.raises(InputsError, match="beyond"):
        decode_inputs(rec, 4)
    rec1 = (1).to_bytes(4, "little") + bytes(8) + b"\0" + bytes(16)
    with pytest.raises(InputsError, match="order"):
        decode_inputs(rec1 + rec1, 4)
    with pytest.raises(InputsError, match="flags"):
        decode_inputs((1).to_bytes(4, "little") + bytes(8) + b"\x04" + bytes(16), 4)


async def test_a_validator_reports_inputs_the_owner_will_not_serve(swarms):
    class _Withholder(CollectiveService):
        async def _handle_inputs(self, verified, context):
            raise EnvelopeError(grpc.StatusCode.PERMISSION_DENIED, "not telling")

    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_Withholder], validators=3, seed=5)
    evil = spec.part_index_of(sw.pids[3])
    findings = await _validate_all(sw, spec, parts=evil)
    assert len(findings) == 3 and all(f.kind == "withheld" and f.proof is None for f in findings)
    assert all("not telling" in f.reason for f in findings)
    assert isinstance(findings[0], audit.Finding)


# ------------------------------------------------------------------------- proofs in the DHT, exclusion


def _accountability(sw, k, dht):
    verdicts = Verdicts(sw.pids[k])
    acc = Accountability(
        lambda: verdicts,
        collective=lambda: sw.services[k],
        dht=lambda: dht,
        identity=sw.ids[k],
        run_id=RUN,
        validate_timeout_s=2.0,
    )
    return acc, verdicts


async def _settle(sw, spec, res, dht, *, read=True):
    """Every peer's :class:`Accountability` after the round ``res`` came from: validation and publication in the
    background (``after_round``), awaited; then (``read``) each reads the proofs again, as its next round does (a
    peer that read before a proof was stored). Returns ``[(accountability, verdicts)]`` in peer order."""
    accs = [_accountability(sw, k, dht) for k in range(len(res))]
    plan = SimpleNamespace(mode="accountable")
    for (acc, _), r in zip(accs, res):
        acc.after_round(spec.round, plan, r)
    await asyncio.gather(*[acc.task for acc, _ in accs])
    if read:
        for acc, _ in accs:
            await acc.read(spec.round)
    return accs


async def test_a_forger_is_excluded_by_every_peer_once_its_proof_is_in_the_dht(swarms):
    _Forger.how = "flip"
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_Forger], validators=1, seed=6)
    dht = LimitedDHT()
    # validation, publication and the read run in the background after the round (after_round)
    accs = await _settle(sw, spec, res, dht, read=False)
    assert list(dht.data) == [fraud.proofs_key(RUN, spec.round)]  # the validator's one proof
    # the peers that read before the proof was stored read again next round: all honest peers now exclude it
    for acc, _ in accs:
        await acc.read(spec.round)
    for k in range(3):
        verdicts = accs[k][1]
        assert set(verdicts.excluded) == {sw.pids[3]} and sw.pids[3] not in verdicts.lone
        assert "forgery proven" in verdicts.excluded[sw.pids[3]]
        assert verdicts.plan_problem(
            SimpleNamespace(participants=lambda: sw.pids, leader=sw.pids[3], round=spec.round + 3)
        )
    assert accs[3][1].excluded == {}  # the accused's own verdicts: not itself


async def test_honest_rounds_and_suspicions_exclude_nobody(swarms):
    class _Withholder(CollectiveService):
        async def _handle_inputs(self, verified, context):
            raise EnvelopeError(grpc.StatusCode.UNAVAILABLE, "busy")

    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_Withholder], validators=3, seed=7)
    dht = LimitedDHT()
    accs = [_accountability(sw, k, dht) for k in range(4)]
    for (acc, _), r in zip(accs, res):
        await acc.run(spec.round)
    assert dht.data == {} and all(v.excluded == {} for _, v in accs)  # withheld inputs: logged, no verdict


class _TokenCutter(CollectiveService):
    """As an owner, lists the first other sender with 1 token instead of its capped claim (same contribution)."""

    def _build_result(self, spec, part, contributions):
        first = next(c for c in contributions if c.sender != self.peer_id)
        cut = [dataclasses.replace(c, tokens=1) if c is first else c for c in contributions]
        return super()._build_result(spec, part, cut)


async def test_an_owner_that_cuts_a_receipted_token_count_is_proven_with_the_spec(swarms):
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_TokenCutter], seed=8)
    evil = spec.part_index_of(sw.pids[3])[0]
    holders = [r for r in res if r.proofs]
    assert len(holders) == 1  # the first other sender in raw-PeerID order: its receipt says 100 tokens
    v = accountable.verify_proof(RUN, holders[0].proofs[0])
    assert (v.kind, v.accused, v.part) == ("drop", sw.pids[3], evil)
    assert "lists 1 tokens" in v.reason and "capped by the plan is 100" in v.reason


async def test_pull_inputs_is_refused_with_a_reason(swarms):
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3, seed=9)
    j = spec.part_index_of(sw.pids[1])[0]
    outsider = Swarm(1)
    await outsider.start()
    try:
        cases = [
            (
                outsider.transports[0],
                collective_pb2.PullInputsRequest(round=1, part=j, spec_id=spec.spec_id),
                "not in round",
            ),
            (sw.transports[0], collective_pb2.PullInputsRequest(round=1, part=j, spec_id=b"x" * 32), "another spec"),
            (
                sw.transports[0],
                collective_pb2.PullInputsRequest(round=1, part=(j + 1) % 3, spec_id=spec.spec_id),
                "does not own",
            ),
            (
                sw.transports[0],
                collective_pb2.PullInputsRequest(round=7, part=j, spec_id=spec.spec_id),
                "too far ahead|not held",
            ),
        ]
        for t, req, reason in cases:
            with pytest.raises(RpcError, match=reason):
                await t.call(sw.addresses[1], COLLECTIVE_INPUTS, req.SerializeToString(), round=req.round, timeout=5.0)
        ok = await sw.transports[0].call(
            sw.addresses[1],
            COLLECTIVE_INPUTS,
            collective_pb2.PullInputsRequest(round=1, part=j, spec_id=spec.spec_id, first=1).SerializeToString(),
            round=1,
            timeout=5.0,
        )
        resp = collective_pb2.PullInputsResponse.FromString(ok.payload)
        assert resp.total == 3 and len(resp.contributions) == 2  # paged from input 1
    finally:
        await outsider.stop()


async def test_a_false_proof_in_the_dht_excludes_nobody(swarms):
    """An accuser publishes a "forgery proof" against an honest owner (its real result and inputs) and garbage:
    every peer re-checks and refuses both; nobody is excluded."""
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 4, seed=10)
    dht = LimitedDHT()
    j = spec.part_index_of(sw.pids[1])[0]
    inputs = [bytes(c) for c in sw.services[1]._rounds[spec.round].parts[j].inputs]
    false = accountable.forgery_proof(spec, sw.services[0]._rounds[spec.round].cache[j], inputs)
    exp = 1e12
    assert await fraud.publish_proof(dht, false, sw.ids[0], run_id=RUN, slot=spec.round, expiration_time=exp)
    assert await fraud.publish_proof(dht, b"\x00garbage", sw.ids[2], run_id=RUN, slot=spec.round, expiration_time=exp)
    accs = [_accountability(sw, k, dht) for k in range(4)]
    valid, refused = await fraud.read_proofs(dht, fraud.ProofReader(dht), RUN, [spec.round])
    assert valid == [] and len(refused) == 2
    assert any("no forgery" in r for r in refused) and any("malformed" in r for r in refused)
    for acc, _ in accs:
        await acc.read(spec.round)
    assert all(v.excluded == {} for _, v in accs)


async def test_a_validator_is_not_sent_its_own_contribution_back(swarms, monkeypatch):
    """``PullInputs(omit_caller)``: the owner sends an empty entry in place of the validator's own signed push
    and the validator puts its copy back; the inputs are the same bytes as a full pull, and the reply is smaller
    by at least that contribution (1/N of the part's inputs). A copy put back that is not the one the result
    commits to is refused by the recheck (the senders are asked then), never taken for a forgery."""
    from geomesh_p2p.exchange import owner as owner_mod

    # three pulls of one part here (full, lean, a wrong copy put back): over the per-caller budget of two, not the point
    monkeypatch.setattr(owner_mod, "INPUT_SERVES_PER_CALLER", 4)
    sw, spec, deltas, res = await _round(swarms, [CollectiveService] * 4)
    v = sw.services[0]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id != sw.pids[0])
    state = v._rounds[spec.round]
    own = bytes(messages.push_request_contribution(state.pushed[j]))

    def received() -> int:
        return v.transport.stats.by_method.get(COLLECTIVE_INPUTS, (0, 0))[1]

    deadline = swarm_time() + 10.0
    r0 = received()
    full, why = await audit._pull_inputs(v, spec, j, deadline)
    r1 = received()
    lean, why_lean = await audit._pull_inputs(v, spec, j, deadline, own)
    r2 = received()
    assert why == why_lean == "" and len(full) == 4 and lean == full and own in full
    assert (r1 - r0) - (r2 - r1) >= len(own) > 0
    assert accountable.recheck_part(v._inner, spec, j, state.cache[j], lean) is None  # the rule over its inputs
    # another copy put back (here: a byte changed) does not match the commitment: a withholding, not a forgery
    other = own[:-1] + bytes([own[-1] ^ 1])
    wrong, _ = await audit._pull_inputs(v, spec, j, deadline, other)
    assert wrong is not None and other in wrong
    with pytest.raises(accountable.ProofError, match="is not the contribution the result commits to"):
        accountable.recheck_part(v._inner, spec, j, state.cache[j], wrong)
    # the equivocation check of a copy that is the one applied here: answered by its hash, not the part's bytes
    hashes = [state.result_hashes.get(k) for k in range(len(spec.owners))]
    pulls = v.transport.stats.by_method.get(COLLECTIVE_PULL, (0, 0))[1]
    assert await audit._cached_copy(v, spec, j, hashes, swarm_time() + 10.0) is None
    answered = v.transport.stats.by_method.get(COLLECTIVE_PULL, (0, 0))[1] - pulls
    assert 0 < answered < 512 < len(state.cache[j])  # a "same" reply in its envelope, not the signed result


async def test_a_caller_is_served_a_parts_inputs_twice_a_round_not_in_a_loop(swarms):
    """PullInputs serves one caller a part's inputs at most INPUT_SERVES_PER_CALLER (2) times over a round (the
    validation and one retry), from the owner and from a sender alike; a third pull is refused with the reason
    (PERMISSION_DENIED, which an honest validator does not retry), so no peer turns another's upload into a loop."""
    from geomesh_p2p.exchange.owner import INPUT_SERVES_PER_CALLER

    sw, spec, deltas, res = await _round(swarms, [CollectiveService] * 4)
    v = sw.services[0]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id != sw.pids[0])
    state = v._rounds[spec.round]
    deadline = swarm_time() + 10.0
    assert INPUT_SERVES_PER_CALLER == 2
    for _ in range(2):
        got, why = await audit._pull_inputs(v, spec, j, deadline)
        assert why == "" and len(got) == 4
    got, why = await audit._pull_inputs(v, spec, j, deadline)
    assert got is None and "PERMISSION_DENIED" in why and "served to this caller 2 times already" in why
    # the same from a sender that holds its own push to part j
    holder = next(p for p in sw.pids[1:] if p != spec.owners[j].peer_id)
    address = next(o.address for o in spec.owners if o.peer_id == holder)
    for _ in range(2):
        held, why = await audit._fetch_held(v, state, j, holder, address, deadline)
        assert why == "" and held and len(held) >= 1
    held, why = await audit._fetch_held(v, state, j, holder, address, deadline)
    assert held is None and "PERMISSION_DENIED" in why
    # another caller's budget is its own
    other = sw.services[2] if sw.pids[2] != spec.owners[j].peer_id else sw.services[3]
    got, why = await audit._pull_inputs(other, spec, j, deadline)
    assert why == "" and len(got) == 4


@pytest.mark.parametrize("mode", ["relay", "accountable"])
async def test_a_caller_is_served_a_parts_result_three_times_a_round_not_in_a_loop(swarms, mode):
    """PullPart serves one caller a part's whole result at most RESULT_SERVES_PER_CALLER (3) times a round: the
    round's own pull and two retries. A relay result carries every contribution of the part (~P/8 bytes at N
    peers), so a loop of pulls made the owner's upload an amplifier; the fourth is refused with the reason
    (PERMISSION_DENIED, not retried by the puller), and another caller's budget is its own."""
    from geomesh_p2p.exchange.owner import RESULT_SERVES_PER_CALLER

    sw = await swarms(4)
    deltas = _honest_deltas(sw.pids, NUMEL, seed=3)
    spec = sw.spec(NUMEL, mode=mode, deadline_s=3.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    assert all(r.missing_parts == [] for r in res)
    v = sw.services[0]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id != sw.pids[0])
    owner = spec.owners[j]
    req = collective_pb2.PullPartRequest(round=spec.round, part=j, wait_s=0.0, spec_id=spec.spec_id)

    async def pull(service) -> collective_pb2.PullPartResponse:
        reply = await service.transport.call(owner.address, COLLECTIVE_PULL, req.SerializeToString(), round=spec.round)
        return collective_pb2.PullPartResponse.FromString(reply.payload)

    assert RESULT_SERVES_PER_CALLER == 3
    retries = [await pull(v) for _ in range(2)]  # the round's own pull was the first
    assert all(r.ready for r in retries) and retries[0].signed_result == retries[1].signed_result != b""
    with pytest.raises(RpcError) as ei:
        await pull(v)
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"the result of part {j} of round {spec.round} was served to this caller 3 times already" in ei.value.reason
    other = next(s for s, p in zip(sw.services[1:], sw.pids[1:]) if p != owner.peer_id)
    assert (await pull(other)).ready


class _Inflater(CollectiveService):
    """As an owner, aggregates every contribution multiplied by -20 (tests.adversary's ``forge-aggregate``) while
    its result still commits to the real signed contributions."""

    def _build_result(self, spec, part, contributions):
        def doctor(c):
            dec = compression.decode(c.packet) * -20.0
            return dataclasses.replace(c, packet=compression.encode(dec, spec.block_size, c.tokens))

        return super()._build_result(spec, part, [doctor(c) for c in contributions])


async def test_an_aggregate_above_the_rounds_scale_bound_is_refused_everywhere_and_its_owner_still_proven(swarms):
    """Issue 26: a forged -20x aggregate stayed applied until its owner's proof (4 forgers of 16: 1.11x the honest
    perplexity). With the round's scale bound in the spec (``max_scale``: the plan's steps x lr, from the start
    state, the same at every reader) every reader refuses it before decoding: the part is a zero update at every
    peer, the honest parts are applied, and the refused result is still validated, so its owner is proven."""
    sw = await swarms(4, service_cls=[CollectiveService] * 3 + [_Inflater])
    deltas = _honest_deltas(sw.pids, NUMEL, seed=5)  # |x| ~ 1: honest block scales ~ 1
    spec = sw.spec(NUMEL, mode="accountable", deadline_s=5.0, validators_per_part=1, max_scale=3.0, **ROBUST)
    res = await asyncio.gather(*[s.all_reduce(spec, deltas[p], 100) for s, p in zip(sw.services, sw.pids)])
    evil = spec.part_index_of(sw.pids[3])
    assert evil and all(r.missing_parts == evil for r in res)  # refused by every reader, the owner too
    assert all(torch.equal(r.aggregate, res[0].aggregate) for r in res)
    for j, o in enumerate(spec.owners):
        part = res[0].aggregate[o.start : o.end]
        assert bool((part == 0).all()) is (j in evil)  # the forged part a zero update, the honest ones applied
    findings = await _validate_all(sw, spec)
    forged = [f for f in findings if f.kind == "forgery"]
    assert [f.part for f in forged] == evil and all(f.owner == sw.pids[3] for f in forged)
    v = accountable.verify_proof(RUN, forged[0].proof)
    assert (v.kind, v.accused) == ("forgery", sw.pids[3])
    # without the bound the same forger's aggregate is applied everywhere (the behaviour before 0.9.0)
    sw2 = await swarms(4, service_cls=[CollectiveService] * 3 + [_Inflater])
    spec2 = sw2.spec(NUMEL, mode="accountable", deadline_s=5.0, validators_per_part=1, **ROBUST)
    deltas2 = _honest_deltas(sw2.pids, NUMEL, seed=5)
    res2 = await asyncio.gather(*[s.all_reduce(spec2, deltas2[p], 100) for s, p in zip(sw2.services, sw2.pids)])
    assert all(r.missing_parts == [] for r in res2)
