"""Accountable mode against the session-15 red team (in-process gRPC on 127.0.0.1):

* a proof record its accuser signs itself naming part 99 (or a spec nested 200,000 deep) is refused with a
  reason; before, ``verify_proof`` raised IndexError / RecursionError, ``read_proofs`` let it escape, every
  honest peer's read of that slot failed, and a real forgery proof read in the same pass was marked seen and
  never applied: the proven forger stayed in;
* a hostile owner paging ``total = 2^32 - 1`` inputs of 64 MiB at a validator is refused after one page (the
  validator held 320 MiB in 5 s before).
"""

from __future__ import annotations

import asyncio
import json
import pytest

from geomesh_p2p.exchange import CollectiveService, accountable, messages
from geomesh_p2p.net.methods import COLLECTIVE_INPUTS
from geomesh_p2p.trust import fraud
from geomesh_p2p.wire import collective_pb2
from tests.collective_util import RUN
from tests.integration.test_collective_accountable import _accountability, _Forger, _round
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
