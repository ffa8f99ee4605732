"""Verified work in accountable mode (issues 26 and 28): checks, screens and re-checks of contributions that only
their part's owner received.

In relay mode every participant holds every signed contribution, so a check recomputes from what it holds
(:mod:`geomesh_p2p.trust.verify`). In accountable mode a participant holds its own contributions and, of every
other one, only what the part's owner-signed result commits to (:mod:`geomesh_p2p.exchange.commitment`: sender,
tokens used, SHA-256[:16] of the signed contribution). That is enough to run verified work unchanged:

* **The draw.** A :class:`Committed` stand-in per (sender, part) in the results takes the place of the packet in
  every pure draw (:func:`~geomesh_p2p.trust.verify_task.derive_task`, ``screen_candidates``, ``derive_screen``):
  they read only who sent which parts and the tokens, which the commitment holds (tokens used = the claim capped
  by the plan's budget, what the draw uses anyway). Every participant that applied the same results draws the
  same tasks.
* **The screen seed** (:func:`commitment_seed`): SHA-256 over the run, round, start digest and every committed
  input (sender, part, tokens, hash) of every part's result, in part and sender order. Every participant holds
  these results (it applied them), and each hash is of a contribution signed before its sender saw any other's.
  What it leaves: an owner chooses which late pushes its result takes, so it can vary the seed a little
  (as it can the validators' draw, docs/collective.md, "Validators").
* **A bounded fetch.** A sampled check covers at most :data:`CHECK_PARTS` of the accused's parts (:func:`narrow`:
  drawn from the task's own seed, the same at every peer), so it fetches at most that many signed contributions:
  about ``CHECK_PARTS x P / (8 N)`` bytes with N equal parts (sign packets), instead of ``P/8`` for the whole
  contribution; its loss-gain test then decides nothing (its sign statistics do). A screen (the loss-gain test alone)
  covers and fetches the whole contribution (session 31: the test's t is calibrated on the whole only). The
  contribution is fetched (by the round's side, :mod:`geomesh_p2p.round.rules.verified_accountable`) and accepted only when its SHA-256 matches the committed one and it is the accused's signed contribution to that
  part (:func:`verified_packet`); anything else is refused with the reason, never trusted.
* **Re-checks** of another verifier's evidence take the accused's contributions from the evidence itself (it
  carries them, signed), each checked against this participant's own commitment (:func:`materialize`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.net.identity import EnvelopeError, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

__all__ = [
    "CHECK_PARTS",
    "Committed",
    "ContributionRefused",
    "commitment_seed",
    "narrow",
    "overlay",
    "verified_packet",
    "materialize",
    "own_packet",
]

#: Parts of the accused's contribution one accountable-mode check covers (and fetches) at most. 2 of N equal
#: parts: ``2 P / (8 N)`` sign bytes per check (N = 4: a half of the contribution; N = 16: an eighth).
CHECK_PARTS = 2

_SEED_DOMAIN = b"geomesh-p2p/verify-screen-accountable/v1\x00"
_SCREEN = "screen"  # verify_task.SCREEN (verify_task imports this module)
_CONTRIBUTION_KIND = "geomesh.collective/Contribution"


@dataclass(frozen=True)
class Committed:
    """A contribution known by its commitment only (an entry of an owner-signed accountable part result).

    Attributes:
        tokens: tokens used (the sender's claim capped by the plan's token budget).
        digest: SHA-256 of the contribution's SignedMessage bytes, first 16 bytes.
        dropped: the owner's robust rule left it out of the aggregate (agreement filter).
    """

    tokens: int
    digest: bytes
    dropped: bool = False


class ContributionRefused(ValueError):
    """A fetched contribution is not the committed one, or not the accused's signed contribution (one-line
    reason)."""


def commitment_seed(run_id: str, plan, committed: Mapping[str, Mapping[int, Committed]]) -> bytes:
    """The screen seed of an accountable round (32 bytes; relay mode's is
    :func:`~geomesh_p2p.trust.verify_task.screen_seed`): SHA-256 over the run, the round, its start digest and every
    committed input (sender sorted, part sorted: sender, part, tokens, hash). ``committed``: sender -> part ->
    :class:`Committed`, from every part result this participant applied. Cheap (no packet is hashed)."""
    h = hashlib.sha256(_SEED_DOMAIN + json.dumps([run_id, int(plan.round), plan.start_digest or ""]).encode())
    for sender in sorted(committed):
        for j in sorted(committed[sender]):
            c = committed[sender][j]
            h.update(sender.encode() + b"\x00" + struct.pack("<QQ", int(j), int(c.tokens)) + bytes(c.digest))
    return h.digest()


def narrow(task, max_parts: int = CHECK_PARTS):
    """``task`` (a :class:`~geomesh_p2p.trust.verify_task.VerifyTask`) cut to at most ``max_parts`` of its parts,
    drawn by SHA-256 of its ``element_seed`` (which follows from the verifier's selection signature): a pure function
    of the task, so every peer cuts it alike. ``n_elements`` is capped by the parts kept. ``task`` itself when it has
    no more parts than that, and always for a screen (``kind`` ``"screen"``, the loss-gain test alone): its t is
    calibrated on the whole contribution only. Session 31 (``benchmarks/gain_parts.py``, tiny preset): honest t over
    parts (2, 3) of 4 (the embedding's tail and both blocks) -0.62 / 0.96 / 3.39 (min / median / max), the whole
    1.94 / 4.85 / 10.39, so a screen over such a pair failed honest work whenever the screener's own reference happened
    to reach t + gain_t_gap (docs/security.md, "Issue 28 (session 31): 100 honest rounds"). A screen fetches the
    accused's whole contribution (P/8 bytes)."""
    if task is None or task.kind == _SCREEN or len(task.parts) <= max_parts:
        return task
    key = int(task.element_seed).to_bytes(8, "little") + b"parts"
    pick = sorted(task.parts, key=lambda j: hashlib.sha256(key + struct.pack("<Q", int(j))).digest())[:max_parts]
    keep = [k for k, j in enumerate(task.parts) if j in set(pick)]
    ranges = tuple(task.ranges[k] for k in keep)
    return dataclasses.replace(
        task,
        parts=tuple(task.parts[k] for k in keep),
        ranges=ranges,
        n_elements=min(int(task.n_elements), sum(e - s for s, e in ranges)),
    )


def overlay(
    committed: Mapping[str, Mapping[int, Committed]], held: Optional[Mapping[str, Mapping[int, Any]]]
) -> dict[str, dict[int, Any]]:
    """sender -> part -> the packet held here (this peer's own, a fetched one) or else its :class:`Committed`
    stand-in: what the draws and checks of an accountable round read. Only committed (sender, part) pairs."""
    held = held or {}
    out: dict[str, dict[int, Any]] = {}
    for sender, parts in committed.items():
        mine = held.get(sender) or {}
        out[sender] = {j: mine.get(j, c) for j, c in parts.items()}
    return out


def verified_packet(
    signed: bytes,
    committed: Committed,
    *,
    run_id: str,
    accused: str,
    round: int,
    part: int,
    part_range: Sequence[int],
) -> Any:
    """The SignPacket of ``signed`` once it is proven to be the committed contribution: its SHA-256 matches the
    commitment, the accused signed it for ``run_id``, ``round`` and ``part`` over ``part_range`` (``[start, end)``),
    and its packet is a well-formed sign packet. Blocking (hashes and verifies a part: a worker thread).

    Raises:
        ContributionRefused: with the reason (the fetched bytes are not trusted: the check is not run on them).
    """
    if hashlib.sha256(signed).digest()[: len(committed.digest)] != committed.digest:
        raise ContributionRefused(
            f"the contribution of {accused[:10]} to part {part} does not match the hash its owner's result commits to"
        )
    try:
        msg = envelope_pb2.SignedMessage.FromString(signed)
        v = Verifier(run_id, max_skew_s=float("inf")).verify(msg, kind=_CONTRIBUTION_KIND, check_replay=False)
        c = collective_pb2.PartContribution.FromString(v.payload)
    except EnvelopeError as e:
        raise ContributionRefused(f"the contribution's signature is refused: {e.reason}") from None
    except Exception:  # noqa: BLE001  hostile bytes: any failure refuses them
        raise ContributionRefused("the contribution is malformed") from None
    if v.sender.to_string() != accused or c.round != round or v.round != round:
        raise ContributionRefused(f"the contribution is not signed by {accused[:10]} for round {round}")
    if (c.part, c.start, c.end) != (part, int(part_range[0]), int(part_range[1])):
        raise ContributionRefused(f"the contribution is not the accused's to part {part}")
    try:
        packet = compression.packet_from_bytes(c.packet)
    except compression.CodecError as e:
        raise ContributionRefused(f"the contribution's packet is malformed: {e}") from None
    if not isinstance(packet, compression.SignPacket):
        raise ContributionRefused("the contribution is not a sign packet (verified work checks sign contributions)")
    return packet


def materialize(kept, accused: str, contributions: Mapping[int, bytes], run_id: str, round: int) -> dict[int, str]:
    """Put the accused's signed ``contributions`` (part -> bytes, e.g. carried by evidence) into accountable round
    ``kept``'s held packets where each matches this peer's commitment (:func:`verified_packet`). Returns part ->
    why it was refused (empty: all taken). Nothing to do for a relay round or a part already held. Blocking."""
    committed = getattr(kept, "committed", None)
    if committed is None or kept.packets is None:
        return {}
    mine = committed.get(accused) or {}
    held = kept.packets.setdefault(accused, {})
    refused: dict[int, str] = {}
    for j, signed in contributions.items():
        if j in held:
            continue
        c = mine.get(int(j))
        if c is None:
            refused[int(j)] = f"no committed contribution of {accused[:10]} to part {j} here"
            continue
        try:
            held[int(j)] = verified_packet(
                bytes(signed),
                c,
                run_id=run_id,
                accused=accused,
                round=round,
                part=int(j),
                part_range=kept.part_ranges[j],
            )
        except ContributionRefused as e:
            refused[int(j)] = str(e)
    return refused


def own_packet(signed: bytes) -> Any:
    """The packet of this peer's own signed contribution (SignedMessage bytes it made: not verified again), or
    None when it is not a sign packet (fp32 pushes: verified work checks sign contributions only).

    Raises:
        ContributionRefused: the bytes do not parse.
    """
    try:
        c = collective_pb2.PartContribution.FromString(envelope_pb2.SignedMessage.FromString(signed).payload)
        packet = compression.packet_from_bytes(c.packet)
    except Exception:  # noqa: BLE001
        raise ContributionRefused("this peer's own contribution does not parse") from None
    return packet if isinstance(packet, compression.SignPacket) else None
