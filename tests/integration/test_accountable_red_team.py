"""Accountable mode against the session-15 red team (in-process gRPC on 127.0.0.1):

* a proof record its accuser signs itself naming part 99 (or a spec nested 200,000 deep) is refused with a
  reason; before, ``verify_proof`` raised IndexError / RecursionError, ``read_proofs`` let it escape, every
  honest peer's read of that slot failed, and a real forgery proof read in the same pass was marked seen and
  never applied: the proven forger stayed in;
* a hostile owner paging ``total = 2^32 - 1`` inputs of 64 MiB at a validator is refused after one page (the
  validator held 320 MiB in 5 s before);
* a forger that answers every PullInputs with NOT_FOUND was excluded by nobody (caught with probability 0):
  now its validator fetches the inputs from their senders (the owner's own from the part's witness) and the
  proof is the same, so it is excluded by every honest peer; bytes a sender serves that are not the committed
  ones are refused (the part is then "unvalidatable": a suspicion, no proof); outsiders get nothing; a result
  listing the owner's own contribution without its witness's receipt is refused by every reader.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest

from geomesh_p2p.exchange import CollectiveService, accountable, audit, messages
from geomesh_p2p.exchange import owner as owner_mod
from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.net.methods import COLLECTIVE_INPUTS
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.trust import fraud
from geomesh_p2p.wire import collective_pb2
from tests.collective_util import RUN, Swarm
from tests.integration.test_collective_accountable import _accountability, _Forger, _round, _settle
from tests.unit.test_evidence_chunks import LimitedDHT

pytestmark = pytest.mark.timeout(120)


def _bad_proof(ident, spec, *, part: int = 99, spec_json=None) -> bytes:
    """A 'drop proof' whose result its accuser signs itself, naming ``part`` (beyond the spec's owners)."""
    res = collective_pb2.PartResult(round=spec.round, part=part, spec_id=spec.spec_id, mode="accountable")
    signed = ident.sign_message(
        run_id=RUN, round=spec.round, kind=messages.RESULT_KIND, payload=res.SerializeToString()
    )
    return collective_pb2.AccountabilityProof(
        kind="drop",
        result=signed.SerializeToString(),
        receipt=b"",
        spec_json=json.dumps(spec.to_dict(), sort_keys=True) if spec_json is None else spec_json,
    ).SerializeToString()


async def test_a_proof_naming_a_part_beyond_the_spec_or_nested_too_deep_is_refused_with_a_reason(swarms):
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 4, seed=1)
    with pytest.raises(accountable.ProofError, match="names part 99, the spec has 4"):
        accountable.verify_proof(RUN, _bad_proof(sw.ids[2], spec))
    with pytest.raises(accountable.ProofError, match="nested too deep"):
        accountable.verify_proof(RUN, _bad_proof(sw.ids[2], spec, spec_json="[" * 200_000 + "]" * 200_000))


async def _validator_proof(sw, spec):
    for k, s in enumerate(sw.services):
        for f in await s.validate_round(spec.round, timeout_s=5.0):
            if f.proof is not None:
                return k, f.proof
    raise AssertionError("no validator drew the forged part with this seed")


@pytest.mark.parametrize("where", ["same-slot", "every-slot"])
async def test_a_bad_record_next_to_a_real_proof_does_not_keep_the_forger_in(swarms, where):
    _Forger.how = "flip"
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3 + [_Forger], validators=1, seed=6)
    dht = LimitedDHT()
    accs = [_accountability(sw, k, dht) for k in range(4)]
    validator, proof = await _validator_proof(sw, spec)
    slot = spec.round + 1
    bad = _bad_proof(sw.ids[3], spec)  # published by the forger itself, under its own subkey
    for r in range(spec.round, spec.round + 4) if where == "every-slot" else [slot]:
        assert await fraud.publish_proof(dht, bad, sw.ids[3], run_id=RUN, slot=r, expiration_time=1e12)
    assert await fraud.publish_proof(dht, proof, sw.ids[validator], run_id=RUN, slot=slot, expiration_time=1e12)
    for r in range(spec.round, spec.round + 4):
        for acc, _ in accs[:3]:
            await acc.read(r)  # no exception escapes
    assert all(sw.pids[3] in accs[k][1].excluded for k in range(3)), "the proven forger is still in"


async def test_a_validator_refuses_an_owner_that_pages_more_inputs_than_participants(swarms):
    class _Flooder(CollectiveService):
        async def _handle_inputs(self, verified, context):
            req = collective_pb2.PullInputsRequest.FromString(verified.payload)
            return collective_pb2.PullInputsResponse(
                round=req.round, part=req.part, contributions=[b"\0" * (1 << 20)] * 4, total=(1 << 32) - 1
            ).SerializeToString()

    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3 + [_Flooder], validators=3, seed=2)
    v = sw.services[0]
    flooder = spec.owners[spec.part_index_of(sw.pids[3])[0]].address
    calls = []
    orig = v.transport.call

    async def counting(addr, method, payload, **kw):
        if method == COLLECTIVE_INPUTS and addr == flooder:
            calls.append(method)
        return await orig(addr, method, payload, **kw)

    v.transport.call = counting
    findings = await asyncio.wait_for(v.validate_round(spec.round, timeout_s=10.0), 60)
    flooded = [f for f in findings if f.owner == sw.pids[3]]
    assert flooded and all(f.proof is None for f in flooded)
    assert any("claims 4294967295 inputs for 4 participants" in f.reason for f in flooded), flooded
    assert len(calls) == 1  # refused at its first page: no paging on to the deadline


class _WithholdingForger(_Forger):
    """The session-15 red team's forger: doctors an input (as :class:`_Forger`) and answers every PullInputs
    (its own pushes' too) with NOT_FOUND."""

    async def _handle_inputs(self, verified, context):
        raise EnvelopeError(grpc.StatusCode.NOT_FOUND, "no such inputs")


async def test_a_forger_that_withholds_every_input_is_excluded_by_every_honest_peer(swarms):
    _Forger.how = "flip"
    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_WithholdingForger], validators=1, seed=6)
    evil = spec.part_index_of(sw.pids[3])[0]
    accs = await _settle(sw, spec, res, LimitedDHT())
    for k in range(3):
        assert set(accs[k][1].excluded) == {sw.pids[3]}, k
        assert "forgery proven" in accs[k][1].excluded[sw.pids[3]]
    # caught by exactly the validator drawn for the part, as a forger that serves its inputs is: the detection
    # probability is the draw's again, 1 - C(aM, V) / C(M, V)
    hashes = [res[0].result_hashes[j] for j in range(len(spec.owners))]
    (drawn,) = accountable.draw_validators(spec, hashes, evil, 1)
    v = sw.pids.index(drawn)
    # the validator's figures (the round row's extra["accountable"]): every input of the forged part came from its
    # sender (the forger's own from the witness; this validator's own from itself), the honest parts' from owners
    mine = [j for j in range(4) if j != v and sw.pids[v] in accountable.draw_validators(spec, hashes, j, 1)]
    witness = accountable.witness_of(spec, evil).peer_id
    row = accs[v][0].counts()
    assert row == {
        "published": 1,
        "excluded": 1,
        "validated_round": spec.round,
        "parts": len(mine),
        "from_owner": 4 * (len(mine) - 1),
        "from_senders": 3 - (witness == drawn),
        "proofs": 1,
        "suspicions": 1,
        "unvalidatable": 0,
        "bytes": row["bytes"],
    }, row
    held = [sw.services[sw.pids.index(spec.owners[j].peer_id)] for j in mine]  # the owners: the true inputs
    assert row["bytes"] == sum(len(c) for s_, j in zip(held, mine) for c in s_._rounds[spec.round].parts[j].inputs)
    assert accs[3][1].excluded == {}


async def test_bytes_a_sender_serves_other_than_the_committed_ones_are_refused(swarms):
    class _LyingSender(CollectiveService):
        async def _handle_inputs(self, verified, context):
            req = collective_pb2.PullInputsRequest.FromString(verified.payload)
            if not req.from_sender:
                return await super()._handle_inputs(verified, context)
            fake = bytearray(self._own_inputs(self._rounds[req.round], req.part)[0])
            fake[-1] ^= 1
            return collective_pb2.PullInputsResponse(
                round=req.round, part=req.part, contributions=[bytes(fake)], total=1
            ).SerializeToString()

    _Forger.how = "flip"
    classes = [CollectiveService, CollectiveService, _LyingSender, _WithholdingForger]
    sw, spec, _, _ = await _round(swarms, classes, validators=3, seed=11)
    evil = spec.part_index_of(sw.pids[3])
    findings = await asyncio.gather(
        *[sw.services[k].validate_round(spec.round, timeout_s=5.0, parts=evil) for k in (0, 1)]
    )
    for fs in findings:  # the honest validators: the liar's bytes are not the committed ones, nothing proven
        assert [f.kind for f in fs] == ["unvalidatable"] and fs[0].proof is None, fs
        assert "served other bytes than input" in fs[0].reason and "no such inputs" in fs[0].reason
    assert all(sw.services[k].validation_stats[spec.round].unvalidatable == 1 for k in (0, 1))
    # the liar itself validates from its own (true) copy: the forgery is proven all the same
    liar = await sw.services[2].validate_round(spec.round, timeout_s=5.0, parts=evil)
    assert [f.kind for f in liar if f.proof is not None] == ["forgery"]


async def test_sender_copies_are_served_to_participants_only_and_once_the_part_is_out(swarms, monkeypatch):
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3, seed=9)
    j = spec.part_index_of(sw.pids[1])[0]
    outsider = Swarm(1)
    await outsider.start()

    def req(part, **kw):
        return collective_pb2.PullInputsRequest(
            round=spec.round, part=part, spec_id=spec.spec_id, from_sender=True, **kw
        ).SerializeToString()

    try:
        with pytest.raises(RpcError, match="not in round"):
            await outsider.transports[0].call(sw.addresses[0], COLLECTIVE_INPUTS, req(j), round=spec.round, timeout=5.0)
        with pytest.raises(RpcError, match="holds no contribution to part"):  # the owner pushes nothing to its part
            await sw.transports[0].call(sw.addresses[1], COLLECTIVE_INPUTS, req(j), round=spec.round, timeout=5.0)
        ok = await sw.transports[0].call(sw.addresses[2], COLLECTIVE_INPUTS, req(j), round=spec.round, timeout=5.0)
        resp = collective_pb2.PullInputsResponse.FromString(ok.payload)
        pushed = sw.services[2]._rounds[spec.round].pushed[j]
        assert resp.total == len(resp.contributions) >= 1 and resp.contributions[0] in pushed
        # before the part's result is out (not applied, before the deadline), a contribution is not shown
        state = sw.services[2]._rounds[spec.round]
        state.result_hashes.pop(j)
        monkeypatch.setattr(owner_mod, "swarm_time", lambda: spec.deadline - 1.0)
        with pytest.raises(RpcError, match="has no result here yet"):
            await sw.transports[0].call(sw.addresses[2], COLLECTIVE_INPUTS, req(j), round=spec.round, timeout=5.0)
    finally:
        await outsider.stop()


async def test_a_result_listing_the_owners_contribution_without_its_witness_receipt_is_refused(swarms):
    class _NoWitness(CollectiveService):
        def _build_result(self, spec, part, contributions):
            part.witness_receipt = b""
            return super()._build_result(spec, part, contributions)

    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_NoWitness], seed=12)
    evil = spec.part_index_of(sw.pids[3])
    assert all(r.missing_parts == evil for r in res), [r.missing_parts for r in res]
    # the honest owners' results carry their witness's receipt, which opens and names their own contribution
    j = spec.part_index_of(sw.pids[0])[0]
    signed = sw.services[1]._rounds[spec.round].cache[j]
    opened = accountable.open_result(sw.services[1]._inner, signed, 4)
    rc = accountable.open_receipt(sw.services[1]._inner, opened.fields.witness_receipt)
    assert (rc.owner, rc.sender, rc.part) == (accountable.witness_of(spec, j).peer_id, sw.pids[0], j)


async def test_an_owner_whose_witness_refuses_leaves_its_own_contribution_out_and_its_part_is_applied(swarms):
    class _NoWitnessing(CollectiveService):
        def _witness(self, state, j, c):
            raise EnvelopeError(grpc.StatusCode.PERMISSION_DENIED, "not witnessing")

    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_NoWitnessing], seed=13)
    (j,) = [j for j in range(4) if accountable.witness_of(spec, j).peer_id == sw.pids[3]]
    owner = spec.owners[j].peer_id
    assert all(r.missing_parts == [] for r in res)  # every part applied, on every reader
    assert sorted(p for p, _ in res[0].contributors[j]) == sorted(p for p in sw.pids if p != owner)
    assert all(sorted(p for p, _ in res[0].contributors[k]) == sorted(sw.pids) for k in range(4) if k != j)


@pytest.mark.parametrize("other", ["round", "spec"])
async def test_a_witness_receipting_another_round_or_spec_does_not_cost_the_owner_its_part(swarms, other):
    """Red team, session 16: a hostile witness that signs its receipt for another round (or spec), with the right
    part, sender and hash. The owner checked only the signer, part, sender and hash, listed its own contribution
    with that receipt, and every reader then refused the honest owner's result (witness_problem checks round and
    spec): the part was lost on every peer. The owner must check the receipt as its readers do, and leave its own
    contribution out."""

    class _OtherReceipt(CollectiveService):
        def _witness(self, state, j, c):
            spec = state.spec
            fake = SimpleNamespace(
                run_id=spec.run_id,
                round=spec.round + (1 if other == "round" else 0),
                spec_id=b"\x07" * 32 if other == "spec" else spec.spec_id,
            )
            state.witnessed.setdefault(j, c)
            rc = accountable.build_receipt(self.transport.identity, fake, j, c)
            return collective_pb2.PushPartResponse(accepted=True, receipt=rc)

    sw, spec, _, res = await _round(swarms, [CollectiveService] * 3 + [_OtherReceipt], seed=14)
    (j,) = [j for j in range(4) if accountable.witness_of(spec, j).peer_id == sw.pids[3]]
    owner = spec.owners[j].peer_id
    assert all(r.missing_parts == [] for r in res), [r.missing_parts for r in res]
    assert sorted(p for p, _ in res[0].contributors[j]) == sorted(p for p in sw.pids if p != owner)


class _Emptier(_Forger):
    """Red team (session 18, omit_caller): as an owner, answers a validator's ``PullInputs(omit_caller)`` with
    ``mode``: ``"swap"``: the caller's own input sent in full and another sender's entry emptied in its place;
    ``"two"``: the caller's entry and another one emptied; ``"unasked"``: the caller's entry emptied though it did
    not ask. ``forge``: its result also doctors an input (as :class:`_Forger`)."""

    mode = "swap"
    forge = False

    def _build_result(self, spec, part, contributions):
        if type(self).forge:
            return super()._build_result(spec, part, contributions)
        return CollectiveService._build_result(self, spec, part, contributions)

    async def _handle_inputs(self, verified, context):
        req = collective_pb2.PullInputsRequest.FromString(verified.payload)
        if req.from_sender:
            return await super()._handle_inputs(verified, context)
        caller = verified.sender.to_string()
        part = self._rounds[req.round].parts[req.part]
        mine = [k for k, s in enumerate(part.input_senders) if s == caller]
        other = next(k for k, s in enumerate(part.input_senders) if s not in (caller, self.peer_id))
        page = [bytes(c) for c in part.inputs]
        how = type(self).mode
        if how == "swap" and req.omit_caller:
            page[other] = b""
        elif how == "two" and req.omit_caller:
            page[other] = b""
            for k in mine:
                page[k] = b""
        elif how == "unasked" and not req.omit_caller:
            page[other] = b""
        return collective_pb2.PullInputsResponse(
            round=req.round, part=req.part, contributions=page[int(req.first) :], total=len(page)
        ).SerializeToString()


@pytest.mark.parametrize("how", ["swap", "two"])
@pytest.mark.parametrize("forge", [False, True])
async def test_an_owner_emptying_other_inputs_than_the_callers_proves_nothing_false_and_escapes_no_proof(
    swarms, how, forge
):
    """omit_caller (session 18): an owner that empties another sender's input (the validator then puts its own
    push in that slot) or more than one entry gets no forgery proof when honest (the slot does not match the
    commitment: the senders are asked, a ``withheld`` suspicion), and a forger does not escape its proof."""
    _Emptier.mode, _Emptier.forge, _Forger.how = how, forge, "flip"
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3 + [_Emptier], validators=3, seed=12)
    evil = spec.part_index_of(sw.pids[3])
    findings = await asyncio.wait_for(
        asyncio.gather(*[sw.services[k].validate_round(spec.round, timeout_s=5.0, parts=evil) for k in range(3)]), 60
    )
    for k, fs in enumerate(findings):
        kinds = sorted(f.kind for f in fs)
        assert kinds == (["forgery", "withheld"] if forge else ["withheld"]), (k, fs)
        withheld = next(f for f in fs if f.kind == "withheld")
        why = "served 2 empty input(s)" if how == "two" else "is not the contribution the result commits to"
        assert why in withheld.reason and withheld.proof is None, withheld
        for f in fs:
            if f.proof is not None:  # the forger's proof, from the senders' copies: it checks at a third peer
                v = accountable.verify_proof(RUN, f.proof)
                assert (v.kind, v.accused, v.part) == ("forgery", sw.pids[3], evil[0])
        assert sw.services[k].validation_stats[spec.round].from_senders >= 2


async def test_a_validator_that_did_not_ask_to_omit_refuses_an_empty_input(swarms):
    _Emptier.mode, _Emptier.forge = "unasked", False
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 3 + [_Emptier], validators=3, seed=13)
    j = spec.part_index_of(sw.pids[3])[0]
    inputs, why = await audit._pull_inputs(sw.services[0], spec, j, swarm_time() + 5.0)
    assert inputs is None and why == "the owner served 1 empty input(s)"


async def test_omitted_inputs_page_at_one_input_a_page(swarms, monkeypatch):
    """Paging with omit_caller: pages of one input (the empty entry rides along without counting) give the same
    inputs as one page, and an honest round validates with no finding."""
    # this test pulls one part's inputs three times (whole, paged, the validation): over the per-caller budget of
    # two (test_a_caller_is_served_a_parts_inputs_twice_a_round_not_in_a_loop), which is not what it is about
    monkeypatch.setattr(owner_mod, "INPUT_SERVES_PER_CALLER", 4)
    sw, spec, _, _ = await _round(swarms, [CollectiveService] * 4, validators=3, seed=14)
    v = sw.services[0]
    state = v._rounds[spec.round]
    j = next(j for j, o in enumerate(spec.owners) if o.peer_id != sw.pids[0])
    own = bytes(messages.push_request_contribution(state.pushed[j]))
    whole, why = await audit._pull_inputs(v, spec, j, swarm_time() + 5.0, own)
    assert why == "" and len(whole) == 4 and own in whole
    calls = []
    orig = v.transport.call

    async def counting(addr, method, payload, **kw):
        if method == COLLECTIVE_INPUTS:
            calls.append(collective_pb2.PullInputsRequest.FromString(payload).first)
        return await orig(addr, method, payload, **kw)

    v.transport.call = counting
    monkeypatch.setattr(owner_mod, "_INPUTS_PAGE_BYTES", 1)
    paged, why = await audit._pull_inputs(v, spec, j, swarm_time() + 5.0, own)
    assert why == "" and paged == whole
    # one input a page; the caller's empty entry is sent with the page before it (or alone when it is first)
    assert 3 <= len(calls) <= 4 and calls == sorted(set(calls)), calls
    calls.clear()
    findings = await asyncio.wait_for(v.validate_round(spec.round, timeout_s=5.0), 60)
    assert findings == [] and v.validation_stats[spec.round].from_owner == 4 * v.validation_stats[spec.round].parts
