"""The node's mutable round state that the round rules read and write (:class:`RoundState`).

One instance is shared by :class:`~geomesh_p2p.node.peer.PeerNode` (its ``round``, ``digest``, ``numel``,
``state_numel``, ``standing`` and ``history`` are this object's fields) and the rule objects of
:mod:`geomesh_p2p.round.rules`, so a rule never needs the node itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from geomesh_p2p.trust.standing import Standing

__all__ = ["RoundState"]


@dataclass
class RoundState:
    """What the round rules know of this peer (shared with the node; the driver moves ``round`` / ``digest``).

    Attributes:
        me: this peer's PeerID (None: rules built for a test without an identity).
        round: the round this peer is at (the driver's counter; runs ahead of the state held while syncing).
        digest: the digest of the global state held (None before it took one).
        numel: P, the model's parameters (0 until the node built its model).
        state_numel: elements of the outer optimizer's state (k x P).
        standing: the standing ledger (rounds seen delivered; replaced on ``--resume``).
        history: the rows of the rounds this peer trained (a vote counts standing once it trained).
        theta_maxabs: max |theta| of the global state held (set with its commit; None before one): the
            round's aggregate scale bound (:func:`~geomesh_p2p.round.rules.spec.aggregate_scale_bound`).
        known_round: the newest round the join knew the run at (a bootstrap's remembered progress, the vote of the
            leaving peers' records: node/joining.py; 0 when none, or ``--on-empty-swarm seed``): a session that
            starts at round 0 behind it is not the whole swarm (``RoundDriver.run``).
        written_by: the PeerID (base58) that wrote the checkpoint this peer resumed from, when another identity than
            this peer's (None otherwise, and once a catch-up replaced that state): its leaving record is that
            checkpoint's own word, no other peer's evidence of it (``RoundDriver.run``; red team 48b).
        resumed_with: the other PeerIDs the resumed checkpoint's standing ledger names at its last round (the peers
            this one trained it with; empty for a checkpoint trained alone, or once a catch-up replaced that state):
            such a peer waits for them rather than train alone after ``--wait-peers-s`` (``gather.held_for_swarm``).
    """

    me: Optional[str] = None
    round: int = 0
    digest: Optional[str] = None
    numel: int = 0
    state_numel: int = 0
    standing: Standing = field(default_factory=Standing)
    history: list[Any] = field(default_factory=list)
    theta_maxabs: Optional[float] = None
    known_round: int = 0
    written_by: Optional[str] = None
    resumed_with: tuple[str, ...] = ()
