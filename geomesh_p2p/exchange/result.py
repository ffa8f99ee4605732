"""What one peer got from one round's all-reduce: :class:`AllReduceResult` (the one-level exchange,
:mod:`.client`, and the grouped one, :mod:`.groups`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from geomesh_p2p.net.links import LinkSample

__all__ = ["AllReduceResult"]


@dataclass
class AllReduceResult:
    """What one peer got from one round's all-reduce.

    Attributes:
        aggregate: fp32 CPU tensor [numel], the token-weighted mean (zeros in missing parts).
        contributors: part index -> ``[(peer_id base58, tokens used)]`` in the fixed order
            (ascending raw PeerID), as the owner took them; absent for missing parts.
        missing_parts: indices of parts with no result signed by ``pull_deadline`` (owner gone, late or refused).
        pushed: part index -> True when the owner accepted this peer's contribution.
        bytes_sent / bytes_received: serialized SignedMessage bytes of this node's PushPart and
            PullPart traffic (client and server side) while the call ran.
        wall_s: seconds the call took.
        last_compute_end: unix seconds when the last contributor (of any part) finished its inner
            steps, as the senders stated it: the barrier for straggler-idle accounting (0 if unknown).
        contributions: relay mode: sender (base58 PeerID) -> part index -> its verified packet for that
            part (a :class:`compression.SignPacket`, or an fp32 tensor for fp32 pushes), as relayed by the
            owners; what verified work (:mod:`geomesh_p2p.trust.verify`) re-checks. Empty in reencode mode.
        part_ranges: ``[start, end)`` of every part, in part order (the spec's owners).
        upload / download: this node's pushes to other owners and its pulls of ready results as
            :class:`~geomesh_p2p.net.links.LinkSample` (payload bytes over the busy time of the link,
            the owners' stated hold taken out), or None when nothing crossed the network.
        result_hashes: accountable mode: part -> SHA-256 of the payload of the owner-signed result applied
            (the validators' seed, :func:`~geomesh_p2p.exchange.accountable.draw_validators`).
        proofs: accountable mode: drop proofs this node holds (AccountabilityProof bytes, each checked with
            :func:`~geomesh_p2p.exchange.accountable.verify_proof`): an owner omitted a receipted push.
        part_owners: base58 PeerID of each part's owner, in part order, when the parts are not the spec's
            (a grouped round: the cross level's leaders, :mod:`geomesh_p2p.exchange.groups`); empty otherwise.
    """

    aggregate: torch.Tensor
    contributors: dict[int, list[tuple[str, int]]]
    missing_parts: list[int]
    pushed: dict[int, bool]
    bytes_sent: int
    bytes_received: int
    wall_s: float
    last_compute_end: float = 0.0
    upload: Optional[LinkSample] = None
    download: Optional[LinkSample] = None
    contributions: dict[str, dict[int, Any]] = field(default_factory=dict)
    part_ranges: list[tuple[int, int]] = field(default_factory=list)
    result_hashes: dict[int, bytes] = field(default_factory=dict)
    proofs: list[bytes] = field(default_factory=list)
    part_owners: list[str] = field(default_factory=list)

    def owner_of(self, spec: Any, part: int) -> str:
        """The PeerID of the owner of ``part``: from :attr:`part_owners` when set, else from ``spec``'s owners."""
        return self.part_owners[part] if self.part_owners else spec.owners[part].peer_id

    @property
    def results_digest(self) -> str:
        """Hex SHA-256 over the applied results' hashes in part order (missing parts: 32 zero bytes): two
        peers that applied the same signed results hold the same value (accountable mode; "" otherwise)."""
        if not self.result_hashes:
            return ""
        h = hashlib.sha256()
        for j in range(len(self.part_ranges)):
            h.update(self.result_hashes.get(j, bytes(32)))
        return h.hexdigest()

    def idle_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` element ranges of the parts that aggregated no token this round (missing, or
        every contribution had 0 tokens): nobody trained there, so the outer step must not move them."""
        return [rg for j, rg in enumerate(self.part_ranges) if j in self.missing_parts or self.tokens(j) == 0]

    def tokens(self, part: int) -> int:
        """Total tokens aggregated in ``part`` (0 if missing)."""
        return sum(n for _, n in self.contributors.get(part, []))
