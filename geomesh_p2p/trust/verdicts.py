"""The verdicts of verified work one node holds on the others (:class:`Verdicts`): whom it excludes from its
plans, which of those verdicts it holds alone, the rounds of marginal failures; saved with the checkpoint.
:class:`~geomesh_p2p.trust.verify.WorkVerifier` is one (it measures them); the rules are in
:mod:`geomesh_p2p.trust.verify`'s docstring ("Evidence and exclusion").
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

log = logging.getLogger("geomesh_p2p.trust.verify")

__all__ = ["Verdicts", "MAX_RESTORED"]


#: Verdicts restored from a checkpoint: at most this many entries of each kind (an edited file of 200k
#: exclusions stalled the loop 2 s and grew the checkpoint to 88 MB: red team, session 13)
MAX_RESTORED = 4096


class Verdicts:
    """The verdicts of verified work one node holds on the others, and what they mean for plans: the excluded
    peers (left out of the plans it makes, :meth:`filter`; plans naming them refused, :meth:`plan_problem`),
    which of those it holds alone (:attr:`lone`), and the rounds of marginal failures. Small and JSON-able
    (:meth:`to_meta`): saved with the checkpoint, so a restarted peer does not forget them (issue 28).
    :class:`WorkVerifier` is one; a node that has not built its verifier yet holds one alone.

    ``me``: this node's base58 PeerID (never excluded)."""

    def __init__(self, me: str):
        self.me = me
        #: peer id -> why it is excluded from this node's plans
        self.excluded: dict[str, str] = {}
        #: peer id -> the round whose check excluded it
        self.excluded_round: dict[str, int] = {}
        #: excluded peers whose failures this node measured only in its own checks (no other verifier's
        #: evidence re-checked here fails them too): a verdict held alone, see :meth:`plan_problem`
        self.lone: set[str] = set()
        #: peer id -> rounds of its marginal failures measured here (recent ones)
        self._marginal: dict[str, set[int]] = {}

    def to_meta(self) -> dict:
        """The verdicts as JSON-able data: ``{"excluded": {peer: why}, "excluded_round": {peer: round},
        "lone": [peers], "marginal": {peer: [rounds]}}``."""
        return {
            "excluded": dict(self.excluded),
            "excluded_round": dict(self.excluded_round),
            "lone": sorted(self.lone),
            "marginal": {p: sorted(r) for p, r in self._marginal.items()},
        }

    def restore(self, meta) -> None:
        """Take the verdicts of :meth:`to_meta` (``--resume``), merged into those held; malformed entries are
        dropped (an edited checkpoint must not end the node)."""
        if not isinstance(meta, dict):
            return

        def peer(p) -> bool:  # a plausible other peer's id (never this node: an edited file must not bar it)
            return isinstance(p, str) and 0 < len(p) <= 64 and p != self.me

        excluded, rounds = meta.get("excluded"), meta.get("excluded_round")
        if isinstance(excluded, dict):
            for p, why in list(excluded.items())[:MAX_RESTORED]:
                if peer(p) and p not in self.excluded:
                    self.excluded[p] = str(why)[:500]
                    r = rounds.get(p) if isinstance(rounds, dict) else None
                    self.excluded_round[p] = r if type(r) is int else 0
        lone = meta.get("lone")
        if isinstance(lone, list):
            self.lone |= {p for p in lone[:MAX_RESTORED] if isinstance(p, str) and p in self.excluded}
        marginal = meta.get("marginal")
        if isinstance(marginal, dict):
            for p, rs in list(marginal.items())[:MAX_RESTORED]:
                if peer(p) and isinstance(rs, list):
                    self._marginal.setdefault(p, set()).update(r for r in rs[:64] if type(r) is int)

    def filter(self, members: Iterable, keep: Optional[str] = None) -> list:
        """``members`` (PeerRecords or anything with ``peer_id``) without the excluded peers (never ``keep``)."""
        return [m for m in members if m.peer_id not in self.excluded or m.peer_id == keep]

    def plan_problem(self, plan, me: Optional[str] = None, grace_rounds: int = 2) -> Optional[str]:
        """Why a follower refuses ``plan``: its leader is excluded here (it would plan itself back in), or
        it names a peer excluded here more than ``grace_rounds`` rounds before the plan's round (honest
        leaders re-check the same evidence within a round or two; before that, their plans still count).

        A verdict this node holds alone (:attr:`lone`: only its own checks failed the peer) never makes it
        refuse a plan (issue 28, "verdicts that cannot fork"): the checks' statistic depends on the checker
        (its own contribution is the basis), so the others' re-checks may all pass the same contribution,
        and a peer refusing every plan they follow sat out every round (before: formed a swarm of one). It
        keeps following the swarm's plans, leaves the peer out of the plans it leads (:meth:`filter`: the
        others follow those), and its evidence stays published for the others to re-check."""
        bad = [
            p
            for p in plan.participants()
            if p in self.excluded
            and p not in self.lone
            and p != me
            and (p == plan.leader or plan.round > self.excluded_round.get(p, plan.round) + grace_rounds)
        ]
        return f"it names {', '.join(p[:10] for p in bad)}, excluded by verified work" if bad else None

    def exclude_proven(self, peer: str, why: str, round: int) -> None:
        """Exclude ``peer`` on a self-contained proof this node re-checked (accountable mode's drop, forgery or
        equivocation proofs, :mod:`geomesh_p2p.trust.fraud`): never a verdict held alone, since every peer that
        reads the proof reaches the same one."""
        self._exclude(peer, why, round, lone=False)

    def _exclude(self, peer: str, why: str, round: int, lone: bool = False) -> None:
        """Exclude ``peer`` (``lone``: on this node's own checks alone); a peer excluded alone before whose
        failure another verifier's evidence now confirms here is no longer lone."""
        if peer == self.me:
            return
        if peer in self.excluded:
            if not lone and peer in self.lone:
                self.lone.discard(peer)
                self.excluded_round[peer] = int(round)  # the plan grace runs from the confirmation
                log.info("verified work: the exclusion of %s is confirmed by another verifier's evidence", peer[:10])
            return
        self.excluded[peer] = why
        self.excluded_round[peer] = int(round)
        if lone:
            self.lone.add(peer)
        log.warning(
            "verified work: %s is excluded from the plans this peer makes: %s%s",
            peer[:10],
            why,
            " (a verdict of this peer alone until another verifier's evidence confirms it: it still follows "
            "plans that name it)"
            if lone
            else "",
        )
