"""Accountable re-encoding: receipts, results committed to their inputs, validators drawn after the round,
and self-contained proofs against a part's owner. Pure and synchronous (no I/O): the service runs these in
worker threads (the recomputation touches a whole part).

Design after BTARD ("Secure Distributed Training at Scale", Gorbunov et al., ICML 2022, section 3: butterfly
all-reduce with a robust rule per partition, validators chosen at random after the fact, ACCUSE and ban),
on this exchange (docs/collective.md, "Accountable mode"):

1. **Receipts.** The owner answers every accepted push with a :data:`RECEIPT_KIND` message it signs
   (run, round, part, spec, sender, tokens claimed, SHA-256 of the contribution's signed bytes); the
   sender keeps it for the kept rounds (:func:`build_receipt`, :func:`open_receipt`).
2. **A result committed to its inputs.** The owner's PartResult carries the re-encoded aggregate (the run's
   robust rule, as reencode) and the compact input list of :mod:`.commitment` (every accepted contribution
   in the aggregate's order, 29 bytes each).
3. **Drops are provable.** A contributor whose receipted contribution is not in the signed result (or with
   other tokens than its cap allows) holds a *drop proof*: the receipt and the result, two owner signatures
   that contradict (:func:`inclusion_problem`, :func:`drop_proof`); any peer checks it in O(list).
4. **Forgeries are found after the fact.** Validators of each part are drawn after the results are known
   (:func:`draw_validators`, a seed over the *other* parts' result hashes), pull the signed inputs from the
   owner and recompute the rule and the encoding bit for bit (:func:`recheck_part`); a mismatch is a
   *forgery proof* (signed result + signed inputs + the spec, whose SHA-256 the result signed) that any
   peer re-checks in O(part).
5. **Hand-offs** (a grouped round's level 1): a slice owner's signed cross contribution that is not the group
   rule over the group inputs it commits to is a *handoff proof* (:mod:`.handoff`); a receipted group push its
   signed level-1 commitment omits is a *handoff-drop proof* (:mod:`.handoff_drop`); two signed level-1
   commitments with different input lists for one group part are a *handoff-equivocation proof*
   (:mod:`.handoff_equivocation`).
6. **Equivocation.** Two results an owner signed for one (round, part) with different payloads are an
   *equivocation proof* (:func:`equivocation_proof`).

Every proof is checked by :func:`verify_proof` from its bytes alone; it raises :class:`ProofError` with a
reason when the bytes are malformed, forged, or prove nothing (e.g. a "forgery" whose recomputation matches).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import grpc
from google.protobuf.message import DecodeError

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange import handoff, handoff_drop, handoff_equivocation, messages
from geomesh_p2p.exchange.aggregate import aggregate_buffer
from geomesh_p2p.exchange.commitment import (
    DIGEST_BYTES,
    InputEntry,
    InputsError,
    contribution_digest,
    decode_inputs,
    participant_order,
    rank_by_seed,
)
from geomesh_p2p.exchange.messages import RESULT_KIND, Contribution
from geomesh_p2p.exchange.partition import CollectiveSpec, _pid_bytes
from geomesh_p2p.exchange.witness import RECEIPT_KIND, Receipt, _verify, open_receipt, witness_of, witness_problem
from geomesh_p2p.net.identity import EnvelopeError, Identity, Verifier
from geomesh_p2p.wire import collective_pb2

__all__ = [
    "RECEIPT_KIND",
    "PROOF_KINDS",
    "ProofError",
    "ProofVerdict",
    "Receipt",
    "OpenedResult",
    "build_receipt",
    "open_receipt",
    "open_result",
    "inclusion_problem",
    "drop_proof",
    "recheck_part",
    "forgery_proof",
    "equivocation_proof",
    "verify_proof",
    "forged_range",
    "draw_validators",
    "validator_seed",
    "witness_of",
    "witness_problem",
]

PROOF_KINDS = (
    "drop",
    "forgery",
    "equivocation",
    "handoff",
    handoff_drop.HANDOFF_DROP,
    handoff_equivocation.HANDOFF_EQUIVOCATION,
)
#: A proof larger than this is refused unread (a forgery proof holds one part's inputs: N x part bytes).
MAX_PROOF_BYTES = 256 << 20

Code = grpc.StatusCode


class ProofError(ValueError):
    """A proof is malformed, forged, or proves nothing (one-line reason)."""


@dataclass(frozen=True)
class OpenedResult:
    """An owner-signed accountable PartResult, signature checked (no spec needed).

    Attributes:
        owner: base58 PeerID of the signer.
        payload_sha256: SHA-256 of the signed payload (the envelope's, covered by the signature): the part's
            *result hash* (validator seed, equivocation).
        fields: the PartResult's small fields (protobuf, ``aggregate`` and relayed contributions left out).
        aggregate: the encoded aggregate (a view of the signed bytes).
        entries: the decoded input list.
    """

    owner: str
    round: int
    payload_sha256: bytes
    fields: Any
    aggregate: memoryview
    entries: list[InputEntry]


def build_receipt(identity: Identity, spec: CollectiveSpec, part: int, c: Contribution) -> bytes:
    """The owner's signed receipt (SignedMessage bytes, kind :data:`RECEIPT_KIND`) of contribution ``c``
    to ``part`` (``c.digest`` set: accountable mode's :func:`~.messages.check_contribution`)."""
    body = collective_pb2.Receipt(
        round=spec.round,
        part=part,
        spec_id=spec.spec_id,
        sender=_pid_bytes(c.sender),
        tokens=int(c.tokens),
        contribution_sha256=c.digest or contribution_digest(c.signed),
    ).SerializeToString()
    return identity.sign_message(
        run_id=spec.run_id, round=spec.round, kind=RECEIPT_KIND, payload=body
    ).SerializeToString()


def open_result(verifier: Verifier, signed: wire.Buffer, n_participants: int) -> OpenedResult:
    """Verify an owner-signed accountable PartResult (signature, mode, input list) without a spec; the
    aggregate is not decoded. Raises EnvelopeError when it is malformed, forged or not accountable."""
    v = _verify(verifier, signed, RESULT_KIND, "part result")
    env = wire.SignedView(signed).envelope
    try:
        res, aggregate, relayed = messages._result_fields(v.payload)
    except (DecodeError, wire.WireError):
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result payload is malformed") from None
    if res.mode != "accountable" or relayed or res.contributors or res.tokens:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result is not an accountable result")
    if res.round != v.round:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"part result is for round {res.round} (envelope {v.round})")
    try:
        entries = decode_inputs(res.inputs, n_participants)
    except InputsError as e:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"part result's input list is malformed: {e}") from None
    return OpenedResult(v.sender.to_string(), int(res.round), bytes(env.payload_sha256), res, aggregate, entries)


def inclusion_problem(spec: CollectiveSpec, result: OpenedResult, receipt: Receipt) -> Optional[str]:
    """Why ``result`` contradicts ``receipt`` (the same owner's: the contribution it receipted is missing,
    or listed with other tokens than ``min(claimed, cap)``), or None when it is in as receipted."""
    return handoff_drop.entries_problem(spec, result.entries, receipt)  # one rule at both levels


def drop_proof(receipt: bytes, result: wire.Buffer, spec: Optional[CollectiveSpec] = None) -> bytes:
    """A drop proof's bytes (AccountabilityProof): the owner's receipt and its result that omits it (with
    ``spec`` when the contradiction is in the tokens, which need the plan's cap)."""
    return collective_pb2.AccountabilityProof(
        kind="drop",
        receipt=bytes(receipt),
        result=bytes(result),
        spec_json="" if spec is None else json.dumps(spec.to_dict(), sort_keys=True),
    ).SerializeToString()


def forgery_proof(spec: CollectiveSpec, result: wire.Buffer, contributions: Sequence[wire.Buffer]) -> bytes:
    """A forgery proof's bytes: the owner-signed result, the signed inputs in its order and the spec."""
    return collective_pb2.AccountabilityProof(
        kind="forgery",
        result=bytes(result),
        contributions=[bytes(c) for c in contributions],
        spec_json=json.dumps(spec.to_dict(), sort_keys=True),
    ).SerializeToString()


def equivocation_proof(a: wire.Buffer, b: wire.Buffer) -> bytes:
    """An equivocation proof's bytes: two results one owner signed for one (round, part)."""
    return collective_pb2.AccountabilityProof(
        kind="equivocation", result=bytes(a), other_result=bytes(b)
    ).SerializeToString()


def recheck_part(
    verifier: Verifier, spec: CollectiveSpec, part: int, result: wire.Buffer, contributions: Sequence[wire.Buffer]
) -> Optional[str]:
    """A validator's check of ``part``'s owner-signed accountable ``result`` against the signed
    ``contributions`` the owner served (in the result's order). Returns the reason the owner is proven to
    have forged (an input it committed to that fails verification or names another sender, tokens not the
    plan's cap, a filter decision or aggregate bytes other than the rule's over its inputs, member lists -- a grouped
    round's cross level -- other than the inputs'), or None when
    the result is exactly the rule over its inputs.

    Raises ProofError when nothing can be concluded against the owner: the result is not the part's owner's
    or not this spec's, or the served contributions are not the ones it committed to (the owner served
    other bytes: a withholding, not a forgery proof). Worker thread: it verifies and aggregates a part."""
    o = spec.owners[part]
    try:
        opened = open_result(verifier, result, len(spec.participants))
    except EnvelopeError as e:
        raise ProofError(f"the part result does not open: {e.reason}") from None
    f = opened.fields
    if opened.owner != o.peer_id:
        raise ProofError("the part result is not signed by the part's owner")
    if (f.round, f.part, f.start, f.end, bytes(f.spec_id)) != (spec.round, part, o.start, o.end, spec.spec_id):
        raise ProofError("the part result does not match the round's spec")
    if len(contributions) != len(opened.entries):
        raise ProofError(f"{len(contributions)} inputs served, the result commits to {len(opened.entries)}")
    order = participant_order(spec.participants)
    checked: list[Contribution] = []
    for k, (entry, signed) in enumerate(zip(opened.entries, contributions)):
        if contribution_digest(signed)[:DIGEST_BYTES] != entry.digest:
            raise ProofError(f"served input {k} is not the contribution the result commits to")
        try:
            _, c = messages.check_contribution(verifier, spec, part, signed, None)
        except EnvelopeError as err:
            return f"input {k} the owner committed to fails verification: {err.reason}"
        if c.sender != order[entry.index]:
            return f"input {k} is signed by {c.sender[:10]}, the result names participant {entry.index}"
        used = spec.counted_tokens(c.sender, c.tokens)
        if entry.tokens != used:
            return f"input {k} lists {entry.tokens} tokens, the claim capped by the plan is {used}"
        checked.append(c)
    used_all = [spec.counted_tokens(c.sender, c.tokens) for c in checked]
    dropped: list[int] = []
    mean = spec.aggregate([(n, c.packet) for n, c in zip(used_all, checked)], o.size, dropped)
    flags = [e.dropped for e in opened.entries]
    if flags != [k in set(dropped) for k in range(len(checked))]:
        return "the agreement filter's drops differ from the result's flags"
    if spec.readers:  # a grouped round's cross level: the member lists readers count are the inputs' own
        kept = [c for k, c in enumerate(checked) if k not in set(dropped)]
        listed = (list(f.member_counts), [bytes(m) for m in f.members], list(f.member_tokens))
        want_members = (
            [len(c.members) for c in kept],
            [_pid_bytes(p) for c in kept for p, _ in c.members],
            [n for c in kept for _, n in c.members],
        )
        if listed != want_members:
            return "the result's group member lists differ from those of the committed inputs"
    want = aggregate_buffer(spec.aggregate_encoding, mean, spec.block_size, sum(used_all))
    if bytes(want) != bytes(opened.aggregate):
        return "the aggregate differs from the rule recomputed over the committed inputs"
    return None


@dataclass(frozen=True)
class ProofVerdict:
    """What a verified proof establishes: ``accused`` (base58 PeerID) misbehaved as ``kind`` as the owner
    of ``part`` in ``round``; ``reason`` says how."""

    kind: str
    accused: str
    round: int
    part: int
    reason: str


def verify_proof(run_id: str, data: bytes, max_bytes: int = MAX_PROOF_BYTES) -> ProofVerdict:
    """Check a proof from its bytes alone (no trust in whoever sent it). O(result inputs) for a drop or an
    equivocation, O(part) for a forgery (it re-runs the rule: a worker thread).

    Raises ProofError with the reason when it is too large, malformed, forged, or proves nothing."""
    if len(data) > max_bytes:
        raise ProofError(f"proof of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        p = collective_pb2.AccountabilityProof.FromString(data)
    except DecodeError:
        raise ProofError("proof is malformed") from None
    if p.kind not in PROOF_KINDS:
        raise ProofError(f"unknown proof kind {p.kind!r}")
    verifier = Verifier(run_id, max_skew_s=float("inf"), max_payload_bytes=max_bytes)
    if p.kind == "handoff":  # an accountable grouped round's level 1 (:mod:`.handoff`)
        if not p.spec_json or not p.cross_spec_json:
            raise ProofError("a handoff proof needs the group and cross specs")
        gspec, xspec = _spec_of(p.spec_json), _spec_of(p.cross_spec_json)
        try:
            k, x = handoff.open_handoff(verifier, xspec, p.contribution)
            why_h = handoff.recheck_handoff(verifier, gspec, xspec, p.contribution, handoff.split_inputs(p))
        except handoff.HandoffError as e:
            raise ProofError(str(e)) from None
        if why_h is None:
            raise ProofError("the cross contribution is exactly the group rule over its inputs: no forgery")
        return ProofVerdict("handoff", x.sender, xspec.round, k, why_h)
    if p.kind == handoff_drop.HANDOFF_DROP:  # a grouped round's level 1: a receipted push its owner's commitment omits
        if not p.spec_json or not p.cross_spec_json:
            raise ProofError("a handoff-drop proof needs the group and cross specs")
        gspec, xspec = _spec_of(p.spec_json), _spec_of(p.cross_spec_json)
        try:
            accused, j, why_d = handoff_drop.verify_handoff_drop(verifier, gspec, xspec, p.receipt, p.commitment)
        except handoff.HandoffError as e:
            raise ProofError(str(e)) from None
        return ProofVerdict(handoff_drop.HANDOFF_DROP, accused, gspec.round, j, why_d)
    if p.kind == handoff_equivocation.HANDOFF_EQUIVOCATION:  # level 1: two lists of one group part
        if not p.spec_json or not p.cross_spec_json:
            raise ProofError("a handoff-equivocation proof needs the group and cross specs")
        gspec, xspec = _spec_of(p.spec_json), _spec_of(p.cross_spec_json)
        try:
            accused, j, why_e = handoff_equivocation.verify_handoff_equivocation(
                verifier, gspec, xspec, p.commitment, p.other_commitment
            )
        except handoff.HandoffError as e:
            raise ProofError(str(e)) from None
        return ProofVerdict(handoff_equivocation.HANDOFF_EQUIVOCATION, accused, gspec.round, j, why_e)
    spec = _spec_of(p.spec_json) if p.spec_json else None
    n = len(spec.participants) if spec is not None else 1 << 20
    try:
        res = open_result(verifier, p.result, n)
    except EnvelopeError as e:
        raise ProofError(f"the part result does not open: {e.reason}") from None
    f = res.fields
    if spec is not None and not 0 <= int(f.part) < len(spec.owners):  # red team: part=99 raised IndexError
        raise ProofError(f"the result names part {f.part}, the spec has {len(spec.owners)}")
    if spec is not None and (bytes(f.spec_id) != spec.spec_id or spec.owners[f.part].peer_id != res.owner):
        raise ProofError("the spec is not the one the result was signed for, or the signer owns no such part")
    if p.kind == "equivocation":
        try:
            other = open_result(verifier, p.other_result, n)
        except EnvelopeError as e:
            raise ProofError(f"the second part result does not open: {e.reason}") from None
        g = other.fields
        if (other.owner, other.round, g.part, bytes(g.spec_id)) != (res.owner, res.round, f.part, bytes(f.spec_id)):
            raise ProofError("the two results are not one owner's for one part of one round and spec")
        if other.payload_sha256 == res.payload_sha256:
            raise ProofError("the two results are the same result: no equivocation")
        return ProofVerdict("equivocation", res.owner, res.round, int(f.part), "two different signed results")
    if p.kind == "drop":
        try:
            rc = open_receipt(verifier, p.receipt)
        except EnvelopeError as e:
            raise ProofError(f"the receipt does not open: {e.reason}") from None
        if (rc.owner, rc.round, rc.part, rc.spec_id) != (res.owner, res.round, int(f.part), bytes(f.spec_id)):
            raise ProofError("the receipt and the result are not one owner's for one part of one round and spec")
        if spec is None:
            if any(e.digest == rc.sha256[:DIGEST_BYTES] for e in res.entries):
                raise ProofError("the receipted contribution is in the result: no drop")
            why = "the receipted contribution is not in the result's inputs"
        else:
            problem = inclusion_problem(spec, res, rc)
            if problem is None:
                raise ProofError("the receipted contribution is in the result as receipted: no drop")
            why = problem
        return ProofVerdict("drop", res.owner, res.round, int(f.part), why)
    if spec is None:
        raise ProofError("a forgery proof needs the round's spec")
    why_forged = recheck_part(verifier, spec, int(f.part), p.result, list(p.contributions))
    if why_forged is None:
        raise ProofError("the result is exactly the rule over its inputs: no forgery")
    return ProofVerdict("forgery", res.owner, res.round, int(f.part), why_forged)


def forged_range(data: bytes) -> Optional[tuple[int, int]]:
    """``[start, end)`` (elements of ``[P]``) of the part a forgery proof is about: its spec's owner of the result's
    part. Read *without* checking the proof (call :func:`verify_proof` first); None when ``data`` is no forgery
    proof or does not parse."""
    try:
        p = collective_pb2.AccountabilityProof.FromString(data)
        if p.kind != "forgery" or not p.spec_json:
            return None
        spec = _spec_of(p.spec_json)
        res, _, _ = messages._result_fields(wire.SignedView(p.result).payload)
        o = spec.owners[int(res.part)]
        return int(o.start), int(o.end)
    except Exception:  # noqa: BLE001  (malformed bytes: no range)
        return None


def _spec_of(spec_json: str) -> CollectiveSpec:
    try:
        spec = CollectiveSpec.from_dict(json.loads(spec_json))
    except RecursionError:  # red team: a spec nested 200,000 deep
        raise ProofError("the proof's spec is malformed: nested too deep") from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ProofError(f"the proof's spec is malformed: {e}") from None
    if spec.mode != "accountable":
        raise ProofError("the proof's spec is not an accountable round's")
    return spec


def validator_seed(spec: CollectiveSpec, result_hashes: Sequence[Optional[bytes]], part: int) -> bytes:
    """The seed of ``part``'s validator draw: SHA-256 over the run, round, part and the result hashes
    (:attr:`OpenedResult.payload_sha256`; 32 zero bytes for a missing part) of every *other* part, in part
    order. The owner cannot move its own part's draw by choosing its result's bytes; each other owner moves
    it only by changing its own result (see docs/collective.md, "Accountable mode", for what that leaves)."""
    h = hashlib.sha256(b"geomesh.accountable/validators\0" + spec.run_id.encode() + b"\0")
    h.update(spec.round.to_bytes(8, "little") + part.to_bytes(4, "little"))
    for k, rh in enumerate(result_hashes):
        if k != part:
            h.update(rh if rh is not None and len(rh) == 32 else bytes(32))
    return h.digest()


def draw_validators(spec: CollectiveSpec, result_hashes: Sequence[Optional[bytes]], part: int, k: int) -> list[str]:
    """The ``k`` validators of ``part``: the participants other than its owner ranked by
    SHA-256(seed || raw PeerID), lowest first (:func:`validator_seed`). Every peer with the same result
    hashes draws the same ones; ``k`` above the candidates gives them all."""
    owner = spec.owners[part].peer_id
    return rank_by_seed(validator_seed(spec, result_hashes, part), (p for p in spec.participants if p != owner), k)
