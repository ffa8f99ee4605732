"""Evidence of a failed verified-work check (:mod:`geomesh_p2p.trust.verify`): the signed record a
verifier publishes in the DHT (:class:`Evidence`, its keys :func:`evidence_key` /
:func:`contributions_key`), with the accused's signed contributions so that any peer can re-check it
(:func:`fetch_contributions`). :meth:`Evidence.from_bytes` raises :class:`EvidenceError` on anything
malformed, forged or inconsistent.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Mapping, Optional

from geomesh_p2p.dht.records import owned_key
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID, Verifier, verify_signature
from geomesh_p2p.trust.verify_check import FAIL, MARGINAL, packet_digest
from geomesh_p2p.trust.verify_task import VerifyTask, selection_message
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = ["Evidence", "EvidenceError", "EVIDENCE_KIND", "evidence_key", "contributions_key", "fetch_contributions"]


#: Envelope kind of a signed evidence record.
EVIDENCE_KIND = "geomesh.verify/Evidence"


#: Envelope kind of a collective contribution (collective.CONTRIBUTION_KIND; repeated to avoid the import).
_CONTRIBUTION_KIND = "geomesh.collective/Contribution"


_EVIDENCE_MAGIC = b"GMEV"


#: Largest value stored in the DHT here (the DHT refuses values over 64 KiB): a signed contribution of
#: a part larger than this is not published with the evidence (the round's peers hold it anyway).
MAX_VALUE_BYTES = 60_000


class EvidenceError(ValueError):
    """An evidence record is malformed, forged, tampered with or inconsistent (one-line reason)."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


@dataclass
class Evidence:
    """A verifier's signed claim that ``accused``'s contribution to ``round`` failed its check.

    ``packets``: part -> SHA-256 of the accused's packet checked there; ``basis``: the verifier's own
    contribution it projected out (``[(peer, digest)]``). ``contributions``: part -> the accused's own
    signed PartContribution (SignedMessage bytes), not covered by the verifier's signature (the
    accused's signature and ``packets`` authenticate them); published beside the record, see
    :func:`contributions_key`. ``verifier_key`` is filled by :meth:`open`."""

    run_id: str
    round: int
    verifier: str
    accused: str
    start_digest: Optional[str]
    selection: bytes
    task: VerifyTask
    packets: dict[int, str]
    basis: list[tuple[str, str]]
    plain: float
    trace: float
    outcome: str
    reason: str
    contributions: dict[int, bytes] = field(default_factory=dict, compare=False)
    verifier_key: bytes = field(default=b"", compare=False)

    def header(self) -> dict:
        return {
            "v": 1,
            "run_id": self.run_id,
            "round": self.round,
            "verifier": self.verifier,
            "accused": self.accused,
            "start_digest": self.start_digest,
            "selection": _b64(self.selection),
            "task": self.task.to_dict(),
            "packets": {str(j): h for j, h in sorted(self.packets.items())},
            "basis": [list(o) for o in self.basis],
            "plain": self.plain,
            "trace": self.trace,
            "outcome": self.outcome,
            "reason": self.reason,
        }

    def to_signed(self, identity: Identity) -> bytes:
        """SignedMessage bytes (kind :data:`EVIDENCE_KIND`) of the header, signed by the verifier ``identity``."""
        if str(identity.peer_id) != self.verifier:
            raise ValueError("evidence must be signed by its verifier")
        head = json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode()
        return identity.sign_message(
            run_id=self.run_id, round=self.round, kind=EVIDENCE_KIND, payload=_EVIDENCE_MAGIC + head
        ).SerializeToString()

    @classmethod
    def open(cls, data: bytes, run_id: str, contributions: Optional[Mapping[int, bytes]] = None) -> "Evidence":
        """Parse and check signed evidence: the verifier's signature, the selection signature (by the same
        key over this round's start digest), the task's consistency, and each of ``contributions``
        (part -> the accused's signed bytes, e.g. from :func:`fetch_contributions`): signed by the
        accused for this round and part, and the packet the evidence names. Raises EvidenceError."""
        try:
            msg = envelope_pb2.SignedMessage.FromString(data)
        except Exception:
            raise EvidenceError("evidence is not a SignedMessage") from None
        try:
            v = Verifier(run_id, max_skew_s=float("inf")).verify(msg, kind=EVIDENCE_KIND, check_replay=False)
        except EnvelopeError as e:
            raise EvidenceError(f"evidence signature refused: {e.reason}") from None
        p = v.payload
        if p[:4] != _EVIDENCE_MAGIC:
            raise EvidenceError("evidence payload is malformed")
        try:
            h = json.loads(p[4:])
            task = VerifyTask.from_dict(h["task"])
            ev = cls(
                run_id=str(h["run_id"]),
                round=int(h["round"]),
                verifier=str(h["verifier"]),
                accused=str(h["accused"]),
                start_digest=h["start_digest"],
                selection=base64.b64decode(h["selection"], validate=True),
                task=task,
                packets={int(j): str(x) for j, x in h["packets"].items()},
                basis=[(str(a), str(b)) for a, b in h["basis"]],
                plain=float(h["plain"]),
                trace=float(h["trace"]),
                outcome=str(h["outcome"]),
                reason=str(h["reason"]),
                verifier_key=v.public_key,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EvidenceError(f"evidence header is malformed ({type(e).__name__})") from None
        if ev.verifier != v.sender.to_string() or ev.run_id != run_id or ev.round != v.round:
            raise EvidenceError("evidence names another verifier, run or round than its signature")
        if (
            (task.verifier, task.accused, task.round) != (ev.verifier, ev.accused, ev.round)
            or ev.accused == ev.verifier
            or set(ev.packets) != set(task.parts)
        ):
            raise EvidenceError("evidence task does not match its header")
        if ev.outcome not in (MARGINAL, FAIL):
            raise EvidenceError(f"evidence outcome {ev.outcome!r} accuses nobody")
        if not verify_signature(v.public_key, ev.selection, selection_message(run_id, ev.round, ev.start_digest)):
            raise EvidenceError("the selection signature is not the verifier's for this round")
        for j, signed in (contributions or {}).items():
            if j not in ev.packets:
                raise EvidenceError(f"a contribution to part {j}, which the evidence does not name")
            packet = _open_contribution(signed, run_id, ev.accused, ev.round, j, task)
            if packet_digest(packet) != ev.packets[j]:
                raise EvidenceError(f"the contribution to part {j} is not the packet the evidence names")
            ev.contributions[int(j)] = bytes(signed)
        return ev


def _open_contribution(signed: bytes, run_id: str, accused: str, round: int, part: int, task: VerifyTask):
    """The SignPacket of a sender-signed PartContribution, checked against the accused, round and part."""
    try:
        msg = envelope_pb2.SignedMessage.FromString(signed)
        v = Verifier(run_id, max_skew_s=float("inf")).verify(msg, kind=_CONTRIBUTION_KIND, check_replay=False)
        c = collective_pb2.PartContribution.FromString(v.payload)
    except EnvelopeError as e:
        raise EvidenceError(f"the contribution's signature is refused: {e.reason}") from None
    except Exception:
        raise EvidenceError("the contribution is malformed") from None
    if v.sender.to_string() != accused or c.round != round or v.round != round:
        raise EvidenceError("the contribution was not signed by the accused for this round")
    if (c.part, (c.start, c.end)) != (part, task.ranges[task.parts.index(part)]):
        raise EvidenceError(f"the contribution is not the accused's to part {part}")
    try:
        packet = compression.packet_from_bytes(c.packet)
    except compression.CodecError as e:
        raise EvidenceError(f"the contribution's packet is malformed: {e}") from None
    if not isinstance(packet, compression.SignPacket):
        raise EvidenceError("the contribution is not a sign packet")
    return packet


def evidence_key(run_id: str, round: int) -> str:
    """DHT key of the evidence about ``round`` (subkey = the verifier's PeerID: only it can write there)."""
    return f"{run_id}/evidence/{int(round)}"


def contributions_key(run_id: str, round: int, verifier: str) -> str:
    """DHT key of the accused's signed contributions a verifier's evidence of ``round`` names (subkey = the
    part index; owned by the verifier, see :func:`geomesh_p2p.dht.records.owned_key`)."""
    return owned_key(f"{run_id}/evidence/{int(round)}/contributions", PeerID.from_string(verifier))


async def fetch_contributions(dht, ev: Evidence) -> dict[int, bytes]:
    """The accused's signed contributions published with ``ev`` (part -> bytes; not yet checked: pass
    them to :meth:`Evidence.open`). For peers that were not in the round and hold no copy."""
    found = await dht.get(contributions_key(ev.run_id, ev.round, ev.verifier))
    out = {}
    for sub, entry in (found or {}).items():
        try:
            out[int(sub)] = entry[0]
        except (TypeError, ValueError):
            continue
    return out
