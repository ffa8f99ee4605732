"""Level-1 equivocation proofs (issue 26): two signed GroupCommitments of one slice owner whose input lists differ for
a group part both cover (:mod:`geomesh_p2p.exchange.handoff_equivocation`, through ``accountable.verify_proof``).

12 peers in groups of 3 are 4 groups: ``ceil(4 / 3) = 2`` leaders per slice, so each slice owner's one group part is
covered by two cross parts (two leaders), each of which receives its own commitment.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from geomesh_p2p.exchange import accountable
from geomesh_p2p.exchange.commitment import InputEntry, encode_inputs, participant_order
from geomesh_p2p.exchange.group_commitment import commitment_payload, sign_commitment
from geomesh_p2p.exchange.groups import group_layout, level_specs
from geomesh_p2p.exchange.handoff import overlapping_parts
from geomesh_p2p.exchange.handoff_equivocation import HANDOFF_EQUIVOCATION, handoff_equivocation_proof
from geomesh_p2p.exchange.partition import CollectiveSpec, PartOwner
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.trust import fraud
from geomesh_p2p.wire import collective_pb2, envelope_pb2

RUN = "equiv-run"
B = 2048
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def world():
    ids = [Identity.generate() for _ in range(12)]
    pids = [i.peer_id.to_string() for i in ids]
    numel = 3 * 4 * B
    owners = [PartOwner(p, f"127.0.0.1:{9000 + k}", k * B, (k + 1) * B) for k, p in enumerate(pids[:12])]
    spec = CollectiveSpec(
        RUN, 3, {p: 100 for p in pids}, owners, numel, time.time() + 5, time.time() + 8,
        mode="accountable", block_size=B, validators_per_part=2,
    )  # fmt: skip
    layout = group_layout(spec, 3)
    assert layout is not None and len(layout.groups) == 4 and all(len(ls) == 2 for ls in layout.leaders)
    gspecs, xspecs = level_specs(spec, layout, time.time(), 128 << 20)
    owner = layout.slice_owners[0][0]
    gspec, xs = gspecs[0], xspecs[0]
    # the premise: both cross parts of the slice (two leaders) overlap the owner's one group part
    parts = [overlapping_parts(gspec, owner, xs, k) for k in range(len(xs.owners))]
    assert len(xs.owners) == 2 and xs.owners[0].peer_id != xs.owners[1].peer_id
    assert parts[0] == parts[1] and len(parts[0]) == 1
    order = participant_order(gspec.participants)
    entries = [InputEntry(order.index(p), 100, False, hashlib.sha256(p.encode()).digest()[:16]) for p in sorted(order)]
    entries.sort(key=lambda e: e.index)
    idx = {i.peer_id.to_string(): i for i in ids}
    return dict(ids=idx, gspec=gspec, gspecs=gspecs, xs=xs, owner=owner, j=parts[0][0], entries=entries)


def _sign(w, lists, k, signer=None, group_spec_id=None):
    gid = w["gspec"].spec_id if group_spec_id is None else group_spec_id
    env = sign_commitment(w["ids"][signer or w["owner"]], RUN, w["gspec"].round, w["xs"].spec_id, k, gid, lists)
    payload = commitment_payload(w["gspec"].round, w["xs"].spec_id, k, gid, lists)
    return envelope_pb2.SignedMessage(
        envelope=envelope_pb2.Envelope.FromString(env), payload=payload
    ).SerializeToString()


def _proof(w, a, b, gspec=None):
    return handoff_equivocation_proof(gspec or w["gspec"], w["xs"], a, b)


def test_two_commitments_with_different_lists_for_one_group_part_prove_an_equivocation(world):
    w = world
    full, short = encode_inputs(w["entries"]), encode_inputs(w["entries"][1:])  # a member listed to one leader only
    proof = _proof(w, _sign(w, [full], 0), _sign(w, [short], 1))
    v = accountable.verify_proof(RUN, proof)
    assert (v.kind, v.accused, v.round, v.part) == (HANDOFF_EQUIVOCATION, w["owner"], w["gspec"].round, w["j"])
    assert "different inputs for group part" in v.reason and "3 and 2 entries, 1 and 0" in v.reason
    assert fraud.accused_of(proof) == w["owner"]
    # other tokens for the same contribution are an equivocation too; so is an empty list (no result) against one
    other = encode_inputs([InputEntry(e.index, 50 if n == 0 else e.tokens, e.dropped, e.digest) for n, e in
                           enumerate(w["entries"])])  # fmt: skip
    assert accountable.verify_proof(RUN, _proof(w, _sign(w, [full], 0), _sign(w, [other], 1))).part == w["j"]
    assert accountable.verify_proof(RUN, _proof(w, _sign(w, [b""], 0), _sign(w, [full], 1))).accused == w["owner"]


def test_a_tampered_or_empty_handoff_equivocation_proof_is_refused_with_its_reason(world):
    w = world
    full, short = encode_inputs(w["entries"]), encode_inputs(w["entries"][1:])
    a, b = _sign(w, [full], 0), _sign(w, [short], 1)
    mate = next(p for p in w["gspec"].participants if p != w["owner"])

    def refused(proof, why):
        with pytest.raises(accountable.ProofError, match=why):
            accountable.verify_proof(RUN, proof)

    # a flipped byte of the second commitment's payload: not what the owner signed
    msg = envelope_pb2.SignedMessage.FromString(b)
    msg.payload = msg.payload[:-1] + bytes([msg.payload[-1] ^ 1])
    refused(_proof(w, a, msg.SerializeToString()), "the second commitment does not open")
    # the same lists to both leaders (the honest owner), and one commitment twice
    refused(_proof(w, a, _sign(w, [full], 1)), "same inputs for every group part they share: no equivocation")
    refused(_proof(w, a, a), "no equivocation")
    # another group spec: in the proof (the commitments name theirs), or signed into one commitment
    refused(_proof(w, a, b, gspec=w["gspecs"][1]), "not for the proof's cross and group specs")
    refused(_proof(w, a, _sign(w, [short], 1, group_spec_id=w["gspecs"][1].spec_id)), "not for the proof's")
    # the second commitment signed by another peer (a mate cannot frame the owner)
    refused(_proof(w, a, _sign(w, [short], 1, signer=mate)), "signed by different peers")
    # a commitment carrying another number of lists than its cross part's group parts
    refused(_proof(w, a, _sign(w, [short, short], 1)), "carries 2 list")
    # no specs, an unknown field set
    p = collective_pb2.AccountabilityProof.FromString(_proof(w, a, b))
    p.cross_spec_json = ""
    refused(p.SerializeToString(), "needs the group and cross specs")
    p = collective_pb2.AccountabilityProof.FromString(_proof(w, a, b))
    p.spec_json = json.dumps({**json.loads(p.spec_json), "mode": "reencode"})
    refused(p.SerializeToString(), "not an accountable round's|malformed")
