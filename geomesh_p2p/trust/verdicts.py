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
        #: excluded peers on a self-contained proof (:meth:`exclude_proven`): every reader of the proof holds the same
        #: verdict, so followers refuse plans naming them (the only verdicts that do, see :meth:`plan_problem`)
        self.proven: set[str] = set()
        #: peer id -> rounds of its marginal failures measured here (recent ones)
        self._marginal: dict[str, set[int]] = {}

    def to_meta(self) -> dict:
        """The verdicts as JSON-able data: ``{"excluded": {peer: why}, "excluded_round": {peer: round},
        "lone": [peers], "marginal": {peer: [rounds]}}``."""
        return {
            "excluded": dict(self.excluded),
            "excluded_round": dict(self.excluded_round),
            "lone": sorted(self.lone),
            "proven": sorted(self.proven),
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
        proven = meta.get("proven")
        if isinstance(proven, list):
            self.proven |= {p for p in proven[:MAX_RESTORED] if isinstance(p, str) and p in self.excluded}
        marginal = meta.get("marginal")
        if isinstance(marginal, dict):
            for p, rs in list(marginal.items())[:MAX_RESTORED]:
                if peer(p) and isinstance(rs, list):
                    self._marginal.setdefault(p, set()).update(r for r in rs[:64] if type(r) is int)

    def settled(self, accused: str) -> bool:
        """Whether ``accused`` is excluded here on more than this peer's own measurement (a proof, or another
        verifier's evidence that confirmed it: not :attr:`lone`), so another screen of it can change nothing here
        (its later screens are not fetched or run: session 30, the backdoor runs spent the budget re-screening an
        excluded poisoner's rounds 3-4 up to round 11)."""
        return accused in self.excluded and accused not in self.lone

    def filter(self, members: Iterable, keep: Optional[str] = None) -> list:
        """``members`` (PeerRecords or anything with ``peer_id``) without the excluded peers (never ``keep``)."""
        return [m for m in members if self.kept(m.peer_id, keep)]

    def kept(self, peer_id: str, keep: Optional[str] = None) -> bool:
        """Whether :meth:`filter` keeps ``peer_id``: not excluded here, or ``keep``."""
        return peer_id not in self.excluded or peer_id == keep

    def plan_problem(self, plan, me: Optional[str] = None, grace_rounds: int = 2) -> Optional[str]:
        """Why a follower refuses ``plan``: more than ``grace_rounds`` rounds after the exclusion (the proven
        round), it is led by or names a peer excluded here on a self-contained proof (:attr:`proven`: accountable
        mode's drop, forgery or equivocation proofs, which every reader of the proof verifies the same way). None
        otherwise.

        The grace holds for a plan the accused *leads* too (session 26): refused at once, the victim of a drop, which
        holds its proof a round before anyone else, refused the round-1 plan of the dropper that led it while the
        other honest peers followed it, and the round split (8 peers, 2 droppers). Within the grace the accused is in
        the plan for every follower or for none; honest leaders leave it out at once (:meth:`filter`).

        A verdict of verified work (a check, a screen, a re-check of another's evidence) never makes a follower
        refuse a plan (issue 28, "verdicts that cannot fork", session 19). Its statistic depends on the checker, and
        its re-checks land at different peers in different rounds (paced background work): a follower that
        refused the accused's plans while another honest peer had not re-checked yet split the swarm into two
        lineages (helper-cover's backdoor run, session 19; before it, a verdict held alone made its holder a swarm
        of one, session 15). So an exclusion takes effect through leaders: this node leaves the peer out of the
        plans it leads (:meth:`filter`), every follower follows them, and as the evidence is confirmed at the
        others their plans leave it out too. In any one round the accused is in the plan for everyone or for no
        one. What it costs: rounds led by a peer that has not confirmed yet (or by the accused, while it still
        ranks among the last round's established participants) include it."""
        bad = [
            p
            for p in plan.participants()
            if p in self.proven and p != me and plan.round > self.excluded_round.get(p, plan.round) + grace_rounds
        ]
        return f"it names {', '.join(p[:10] for p in bad)}, excluded by a proof" if bad else None

    def exclude_proven(self, peer: str, why: str, round: int) -> None:
        """Exclude ``peer`` on a self-contained proof this node re-checked (accountable mode's drop, forgery or
        equivocation proofs, :mod:`geomesh_p2p.trust.fraud`): never a verdict held alone, since every peer that
        reads the proof reaches the same one."""
        self._exclude(peer, why, round, lone=False)
        if peer != self.me:
            self.proven.add(peer)

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
