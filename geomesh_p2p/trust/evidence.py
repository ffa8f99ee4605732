"""Evidence of a failed verified-work check (:mod:`geomesh_p2p.trust.verify`): the signed record a
verifier publishes in the DHT (:class:`Evidence`, its keys :func:`evidence_key` /
:func:`contributions_key`), with the accused's signed contributions so that any peer can re-check it
(:func:`fetch_contributions`). :meth:`Evidence.open` raises :class:`EvidenceError` on anything
malformed, forged or inconsistent.

Wire form in the DHT (``EVIDENCE_WIRE_VERSION`` 2, issue 25). The verifier signs the header (one
SignedMessage, :meth:`Evidence.to_signed`), which lists every part it checked (about 92-98 B per part:
the part, its range, the SHA-256 of the accused's packet): 94 KB at 1,024 parts, over the DHT's 64 KiB
value limit, so version 1 (those bytes as one value) published nothing above ~600 parts. Version 2
stores zlib of the same signed bytes (:func:`encode_value`, about half the size) framed by
:mod:`geomesh_p2p.dht.chunked` (magic ``gmev/2``): inline in the value under :func:`evidence_key`
(subkey = the verifier) when it fits, else a head listing the chunks by hash, each chunk under its own
key, all owner-signed by the verifier. Who signs what is unchanged: the verifier signs the header, the
accused its contributions; the framing only carries the signed bytes (the reader checks each chunk's
owner and hash, the whole against the head's hash, and caps the decompression at
``MAX_EVIDENCE_BYTES``; :class:`EvidenceReader`). The accused's contributions, one value per part,
are spread over keys of ``CONTRIBUTIONS_PER_KEY`` parts each (a DHT key holds at most 2,048 subkeys)
and stored with bounded concurrency, each store with its deadline, at most ``MAX_CONTRIBUTION_RECORDS``
of them (a DHT node's quota per signer; :func:`publish_evidence`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Optional

from geomesh_p2p.dht import chunked
from geomesh_p2p.dht.chunked import ChunkedValue, ChunkFormat
from geomesh_p2p.dht.records import owned_key
from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.net.identity import EnvelopeError, Identity, PeerID, Verifier, verify_signature
from geomesh_p2p.trust.verify_check import FAIL, MARGINAL, packet_digest
from geomesh_p2p.trust.verify_task import SCREEN, VerifyTask, selection_message
from geomesh_p2p.wire import collective_pb2, envelope_pb2
from geomesh_p2p.util.untrusted import json_loads

log = logging.getLogger("geomesh_p2p.trust.verify")

__all__ = [
    "Evidence",
    "EvidenceError",
    "EvidenceReader",
    "EVIDENCE_KIND",
    "EVIDENCE_WIRE_VERSION",
    "contributions_key",
    "decode_value",
    "encode_value",
    "evidence_key",
    "evidence_slot",
    "screen_evidence_key",
    "fetch_contributions",
    "publish_evidence",
    "signed_contribution",
]


#: Envelope kind of a signed evidence record.
EVIDENCE_KIND = "geomesh.verify/Evidence"


#: Envelope kind of a collective contribution (collective.CONTRIBUTION_KIND; repeated to avoid the import).
_CONTRIBUTION_KIND = "geomesh.collective/Contribution"


_EVIDENCE_MAGIC = b"GMEV"


#: Largest value stored in the DHT here (the DHT refuses values over 64 KiB): a signed contribution of
#: a part larger than this is not published with the evidence (the round's peers hold it anyway).
MAX_VALUE_BYTES = chunked.VALUE_BYTES

#: Version of the evidence's wire form in the DHT. 1: the signed evidence as one value (nothing
#: published above ~600 parts); 2: zlib of the same signed bytes, inline or head + chunks (module doc).
#: The signed header itself is unchanged (its ``"v"`` stays 1).
EVIDENCE_WIRE_VERSION = 2
_WIRE_MAGIC = b"gmev/2"
#: Signed evidence inflating to more is refused (a zlib bomb from a verifier). Bytes: ~90,000 parts.
MAX_EVIDENCE_BYTES = 8 << 20
#: A head listing more chunks is refused: 64 x 60,000 B of compressed evidence (~70,000 parts).
MAX_EVIDENCE_CHUNKS = 64
#: Parts whose contributions share one DHT key (a key holds at most 2,048 subkeys, 8 MiB per node).
CONTRIBUTIONS_PER_KEY = 256
#: At most this many of the accused's contributions, of at most ``MAX_CONTRIBUTION_BYTES`` together, are
#: published with one evidence (parts in order; the rest are left out, logged). A DHT node holds at most
#: 512 records / 2 MiB per signer (``dht.quota.StorageQuota``): measured on 4 nodes, publishing all 1,024
#: contributions stored 511 and then refused the verifier's next evidence and would refuse its peer
#: record. Re-checks use the round's own copies; these are an audit trail for peers outside the round.
MAX_CONTRIBUTION_RECORDS = 128
MAX_CONTRIBUTION_BYTES = 512 << 10
#: Deadline of each store and get of :func:`publish_evidence` / :func:`fetch_contributions`, seconds.
STORE_TIMEOUT_S = 10.0
#: Stores of one evidence in flight at once.
STORE_CONCURRENCY = 16


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
            h = json_loads(p[4:], "evidence header")
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


def screen_evidence_key(run_id: str, round: int, accused: str) -> str:
    """DHT key of the screening evidence about ``accused`` in ``round`` (subkey = the verifier's PeerID). One key
    per accused: a screener may fail several newcomers of one round, and :func:`evidence_key` holds one record per
    verifier (its sampled check's)."""
    return f"{run_id}/evidence/{int(round)}/screen/{accused}"


def evidence_slot(ev: "Evidence") -> str:
    """The DHT key ``ev`` is published under: :func:`screen_evidence_key` for a screening check, else
    :func:`evidence_key`."""
    if ev.task.kind == SCREEN:
        return screen_evidence_key(ev.run_id, ev.round, ev.accused)
    return evidence_key(ev.run_id, ev.round)


def contributions_key(run_id: str, round: int, verifier: str, shard: int = 0, screen_of: Optional[str] = None) -> str:
    """DHT key of shard ``shard`` of the accused's signed contributions a verifier's evidence of ``round``
    names: parts ``[shard * CONTRIBUTIONS_PER_KEY, (shard + 1) * CONTRIBUTIONS_PER_KEY)``, subkey = the
    part index; owned by the verifier (:func:`geomesh_p2p.dht.records.owned_key`). ``screen_of``: the accused of a
    screening evidence (its contributions under a key of their own)."""
    screen = f"/screen/{screen_of}" if screen_of else ""
    return owned_key(f"{run_id}/evidence/{int(round)}{screen}/contributions/{int(shard)}", PeerID.from_string(verifier))


def evidence_format() -> ChunkFormat:
    """The evidence's framing in the DHT (:mod:`geomesh_p2p.dht.chunked`, magic ``gmev/2``)."""
    return ChunkFormat(
        magic=_WIRE_MAGIC,
        what="evidence",
        owner_role="verifier",
        version=EVIDENCE_WIRE_VERSION,
        max_chunks=MAX_EVIDENCE_CHUNKS,
    )


def encode_value(signed: bytes) -> ChunkedValue:
    """Frame signed evidence (:meth:`Evidence.to_signed` bytes) for the DHT: zlib level 6, then inline or
    head + chunks. Raises ValueError over ``MAX_EVIDENCE_CHUNKS`` chunks. CPU: ~15 ms per 100 KB."""
    return chunked.split(zlib.compress(signed, 6), evidence_format())


def decode_value(body: bytes) -> bytes:
    """The signed evidence of an assembled body (not yet checked: pass it to :meth:`Evidence.open`).
    Raises ValueError: not zlib, over ``MAX_EVIDENCE_BYTES`` once inflated, truncated."""
    return chunked.decompress_capped(body, MAX_EVIDENCE_BYTES, "evidence")


class EvidenceReader(chunked.ChunkedReader[bytes]):
    """Assembles the signed evidence of heads read under :func:`evidence_key`:
    ``await load(evidence_key, verifier, head) -> bytes`` (see :meth:`ChunkedReader.load`: raises
    :class:`~geomesh_p2p.dht.chunked.ChunksPending` while a chunk is missing, late, not the verifier's or
    not matching; ValueError when malformed). The result is not checked yet: :meth:`Evidence.open`."""

    def __init__(self, dht, chunk_timeout_s: float = 5.0, cache_size: int = 8):
        super().__init__(dht, evidence_format(), decode_value, chunk_timeout_s=chunk_timeout_s, cache_size=cache_size)


@dataclass(frozen=True)
class Published:
    """What :func:`publish_evidence` stored: ``evidence`` (its head, after every chunk; ``chunks`` of
    them), ``contributions`` of ``contributions_total`` tried stored somewhere, ``contributions_left_out``
    not tried (over ``MAX_CONTRIBUTION_RECORDS`` / ``MAX_CONTRIBUTION_BYTES``)."""

    evidence: bool
    chunks: int
    contributions: int
    contributions_total: int
    contributions_left_out: int = 0


async def publish_evidence(
    dht,
    ev: Evidence,
    identity: Identity,
    *,
    expiration_time: float,
    timeout_s: float = STORE_TIMEOUT_S,
    concurrency: int = STORE_CONCURRENCY,
) -> Published:
    """Store ``ev`` signed by its verifier ``identity`` (:func:`encode_value`, in a worker thread: tens of
    ms at thousands of parts), its chunks then its head under :func:`evidence_slot`, then the accused's
    signed contributions it carries under :func:`contributions_key` (not needed by the round's peers,
    who hold them: after the evidence; the first ``MAX_CONTRIBUTION_RECORDS`` parts within
    ``MAX_CONTRIBUTION_BYTES``), at most ``concurrency`` stores at once, each within ``timeout_s``. Raises ValueError when ``identity`` is not the verifier or the evidence needs more
    than ``MAX_EVIDENCE_CHUNKS`` chunks; a store that fails or times out is counted, not raised."""
    value = await asyncio.to_thread(lambda: encode_value(ev.to_signed(identity)))
    out = await chunked.store_chunked(
        dht,
        evidence_slot(ev),
        value,
        subkey=ev.verifier,
        owner=identity,
        expiration_time=expiration_time,
        timeout_s=timeout_s,
        concurrency=concurrency,
    )
    items: list[tuple[str, Optional[str], bytes]] = []
    total = 0
    for j, b in sorted(ev.contributions.items()):
        if len(items) == MAX_CONTRIBUTION_RECORDS or total + len(b) > MAX_CONTRIBUTION_BYTES:
            break
        total += len(b)
        shard = j // CONTRIBUTIONS_PER_KEY
        items.append((contributions_key(ev.run_id, ev.round, ev.verifier, shard, _screen_of(ev)), str(j), b))
    stored = await chunked.store_many(
        dht, items, owner=identity, expiration_time=expiration_time, timeout_s=timeout_s, concurrency=concurrency
    )
    return Published(out.ok, len(value.chunks), sum(stored), len(items), len(ev.contributions) - len(items))


async def fetch_contributions(dht, ev: Evidence, timeout_s: float = STORE_TIMEOUT_S) -> dict[int, bytes]:
    """The accused's signed contributions published with ``ev`` (part -> bytes, parts ``ev`` names only;
    not yet checked: pass them to :meth:`Evidence.open`). For peers that were not in the round and hold
    no copy. Reads the shards in parallel, each get within ``timeout_s``; a shard not read is left out."""
    shards = sorted({j // CONTRIBUTIONS_PER_KEY for j in ev.packets})

    async def one(shard: int) -> dict:
        try:
            key = contributions_key(ev.run_id, ev.round, ev.verifier, shard, _screen_of(ev))
            return dict(await asyncio.wait_for(dht.get(key), timeout_s) or {})
        except asyncio.TimeoutError:
            return {}

    out = {}
    for shard, found in zip(shards, await asyncio.gather(*(one(s) for s in shards))):
        for sub, entry in found.items():
            try:
                j = int(sub)
            except (TypeError, ValueError):
                continue
            if j in ev.packets and j // CONTRIBUTIONS_PER_KEY == shard:
                out[j] = entry[0]
    return out


def _screen_of(ev: Evidence) -> Optional[str]:
    return ev.accused if ev.task.kind == SCREEN else None


def signed_contribution(collective, round: int, part: int, sender: str) -> Optional[bytes]:
    """The sender-signed contribution bytes of ``sender`` to ``part`` of ``round`` held by a
    :class:`~geomesh_p2p.exchange.CollectiveService` (accepted as the part's owner, or relayed in an
    owner's result it pulled), or None. Reads the service's per-round state (kept for its
    ``max_rounds_kept`` newest rounds); returns None if that state is gone or shaped differently."""
    try:
        state = collective._rounds.get(round)
        if state is None:
            return None
        owned = state.parts.get(part)
        if owned is not None and sender in owned.contributions:
            return owned.contributions[sender].signed
        result = state.cache.get(part) or (owned.signed_result if owned is not None else None)
        if not result:
            return None
        res = collective_pb2.PartResult.FromString(envelope_pb2.SignedMessage.FromString(result).payload)
        want = bytes(PeerID.from_string(sender))
        for item in res.contributions:
            env = envelope_pb2.SignedMessage.FromString(item.signed_message).envelope
            if env.sender == want:
                return item.signed_message
    except Exception as e:  # never let evidence gathering break a round
        log.debug("signed contribution of %s, round %d part %d not found: %s", sender[:10], round, part, e)
    return None
