"""Probation: what a new identity may do before it has delivered work (issue 12, "Admission").

Identities cost a proof of work, nothing more, so one process can announce thirty of them as fast GPUs
that never take part. Left alone they are planned in (33 participants for 3 honest peers), own most
parts (zero updates for their ranges), make every part wait for pushes that never come and stretch the
leader take-over by one timeout each. This module holds the rules that stop a burst of identities from
dominating a round; :class:`~geomesh_p2p.node.peer.PeerNode` applies them (its round rules,
:class:`~geomesh_p2p.round.policy.NodeRoundPolicy`) when it plans (``PlanRules.build_plan``), checks a plan
(``PlanRules.plan_problem``) and picks leader candidates (``leader_candidates``, asked by
:meth:`RoundDriver.agree <geomesh_p2p.round.driver.RoundDriver.agree>`); the round driver waits for
peers on probation as they sync (:meth:`RoundDriver.gather <geomesh_p2p.round.driver.RoundDriver.gather>`).

Who is established
------------------
A peer is **established**, in one node's view, when its *standing* (rounds among the last 32 this node
applied in which it contributed: :mod:`geomesh_p2p.trust.standing`) is at least
``threshold(r) = min(K, ceil(r / 2))`` with ``K = PROBATION_ROUNDS``; every other peer is on **probation**.
``min(K, ceil(r / 2))`` is the bootstrap: in round 0 of a fresh swarm everybody is established, in rounds 1-2
those who delivered once, and so on (half the rounds so far: an honest peer whose work one round counted 0
tokens keeps its standing), so a brand-new 3-peer swarm plans exactly as before. When nobody among the peers being planned is
established (every old peer left), all of them are (:func:`split`).

A node's ledger may miss rounds (it joined late, re-synced, or restarted): ``missed`` = rounds of the
window ``[max(0, r - 32), r)`` it did not credit. For *other* peers it then also reads what records
attest (``PeerRecord.standing``, as a fresh joiner's vote does), from attestors that delivered in its own
credited rounds (with an empty ledger, from anyone: a fresh joiner trusts what it reads; see
docs/admission.md), never more than it missed; for *itself* only once it credited a round (then only
peers it saw deliver vouch for it), so records of identities it never saw deliver cannot make a node
believe it may lead. A follower is lenient by what it missed
(:meth:`StandingView.plausible`): it refuses a leader's claim that a peer is established only when that
peer could not have delivered ``threshold`` rounds even in the rounds the follower did not see.

What probation means
--------------------
* **Bounded count**: at most ``probation_slots(n_established) = max(1, n_established // PROBATION_SHARE)``
  probation peers join a round. They are chosen by standing first (a newcomer that delivered once is
  kept until it is established), then by a per-round rendezvous hash (:func:`probation_rank`), so a
  Sybil cannot pick its slot and thirty of them get one slot, not thirty.
* **No part**: a probation peer is planned as client-only (it owns no part); followers refuse a plan in
  which one owns a part.
* **Bounded weight**: its token budget is at most ``PROBATION_BUDGET_FACTOR`` x the lower-median budget
  of the established participants (the aggregation then caps its weight at the median as for anyone).
* **Not in the quorum**: the plan marks it (``PeerAssignment.probation``); a part result needs
  ``quorum x`` the *established* participants' contributions (``CollectiveSpec.probation``), and an
  owner closes a part a short grace after every established participant pushed it
  (:func:`early_close_grace_s`), so a no-show on probation costs the round that grace, not the deadline.
* **Never leads** (unless nobody is established): leader candidates are the established members
  (:func:`leader_candidates`); a follower refuses a plan whose leader is not plausibly established. A
  node never names itself while it is not established in its own view and another member remains (a
  newcomer follows the peers whose state it downloaded; docs/admission.md, "A young swarm").

No-shows
--------
A peer planned in round ``r`` that is in no aggregate this node applied (it pushed nothing that any
owner took) is not planned again for ``NOSHOW_PENALTY_ROUNDS`` rounds (``PROBATION_NOSHOW_PENALTY_ROUNDS``
when it was on probation) and is no leader candidate meanwhile. Every honest peer applied the same
aggregates, so honest leaders agree.

A late peer (session 49): an honest but slow peer whose pushes reach their owners after the parts closed is, for every
other peer, a no-show like any other (the owners refuse the pushes; no result lists it). Benched, it came back with the
same budget and was late again (in, out, in: 4,3,3,2,3,2 rows a round in a 4-peer run). So every no-show is also
*marked late* for ``LATE_MARK_ROUNDS`` rounds: it is planned at no more than ``plan.bounds.LATE_RATE_SHARE`` of the rate
its plan of that round gave it (:func:`~geomesh_p2p.plan.bounds.late_ceiling`; followers accept a budget that low) and
is no leader candidate. A peer that delivered in the round before and holds no late mark is *not* benched for that
miss: it stays planned, with the smaller budget. Since session 50 a newcomer on probation too (both newcomers of the e2e
young swarm, each late once after a delivered round, were benched 10 rounds and never trained with the bootstrap peer
in the same round): the round before is proven work, and it stays within its probation slot, owns no part, has its
budget capped and counts in no quorum. A miss while marked and a miss after a round without delivered work (an identity
that never delivers, a free rider, a crashed peer) bench it as before (``PROBATION_NOSHOW_PENALTY_ROUNDS`` on
probation), and the mark then outlasts the bench. Every input is the plans and the part results every honest peer
applied.
"""

from __future__ import annotations

from collections import Counter

import hashlib
from typing import Collection, Iterable, Mapping, Optional, Sequence

from geomesh_p2p.trust.standing import DEFAULT_WINDOW, Standing, attest_key

#: Trusted attestors that must vouch for a standing before a node that missed rounds counts it
#: (:meth:`StandingView.attested`; fewer when fewer are trusted): with one, a single established attacker's record
#: attested 16 identities that never delivered into a late joiner's established set, leader candidates all
#: (red team, session 34). Honest peers attest each other (and themselves), so each has every honest attestor.
ATTESTORS = 2
#: Rounds a new identity must have delivered (in a node's ledger) before it is established: K.
PROBATION_ROUNDS = 3
#: At most ``max(1, n_established // PROBATION_SHARE)`` probation peers join a round (3 established: 1;
#: 8: 2), so probation peers are at most ~1/5 of a round's participants.
PROBATION_SHARE = 4
#: A probation peer's token budget is at most this many times the lower-median budget of the
#: established participants (followers allow plan.bounds.PLAN_CHECK_TOLERANCE on top).
PROBATION_BUDGET_FACTOR = 1.0
#: Rounds an established peer that was planned and delivered nothing is left out of plans (and of the
#: leader candidates). Short: an honest peer can miss one round (a crash and restart, a stall), and
#: must not wait long to be planned again; long enough that a peer gone silent costs one round's wait.
NOSHOW_PENALTY_ROUNDS = 3
#: The same for a peer that was on probation when it did not show up: longer, so identities that never
#: deliver are each tried rarely; an honest newcomer that missed once waits as long.
PROBATION_NOSHOW_PENALTY_ROUNDS = 10
#: Rounds a no-show stays marked late (after its bench, if benched): planned at no more than ``LATE_RATE_SHARE`` of its
#: planned rate, no leader candidate, and benched at its next miss. A peer that only misses while its budget regrows
#: misses at most one round in ``LATE_MARK_ROUNDS + 1`` without being benched, and delivers the others.
LATE_MARK_ROUNDS = 8
#: An owner closes a part this long (at least) after every established participant pushed it, without
#: the probation peers that have not: ``max(EARLY_CLOSE_MIN_S, EARLY_CLOSE_WINDOW_SHARE x window)``.
EARLY_CLOSE_MIN_S = 0.5
EARLY_CLOSE_WINDOW_SHARE = 0.1
#: Longest a peer waits, while gathering members, for a probation peer that announces it is syncing
#: (an established one is waited for up to the full gather wait, as before).
PROBATION_SYNC_WAIT_S = 1.5


def threshold(round: int, k: int = PROBATION_ROUNDS) -> int:
    """Standing an identity needs to be established in round ``round``: ``min(k, ceil(round / 2))`` (0 in round 0):
    at least half of the rounds so far, at most ``k``.

    Why half, not every round (``min(k, round)`` before session 34): in a young swarm that bootstrap demanded a
    delivery in *every* round before ``k``, and one round an honest peer's work counted 0 tokens (the deadline
    stopped it under its token floor, on a busy machine) put it on probation for the rest of the young swarm:
    with 30 Sybils around, 2 of 3 honest peers ended on probation or planned out, their parts closed without them,
    and 4 rounds aggregated nothing (tests/e2e/test_sybil.py, three copies at once on 2 cores). A Sybil that never
    delivers stays at 0 under either rule."""
    return max(0, min(int(k), (int(round) + 1) // 2))


def probation_slots(n_established: int) -> int:
    """Most probation peers one round may hold: ``max(1, n_established // PROBATION_SHARE)``."""
    return max(1, int(n_established) // PROBATION_SHARE)


def probation_rank(run_id: str, round: int, peer_id: str) -> bytes:
    """Per-round rendezvous hash ordering the probation peers (lower first); another domain than the
    leader rank, so the round's leader order says nothing about who gets the probation slots."""
    return hashlib.sha256(f"{run_id}/probation/{round}/{peer_id}".encode()).digest()


def early_close_grace_s(window_s: float) -> float:
    """Seconds an owner waits for probation peers after every established participant pushed a part."""
    return max(EARLY_CLOSE_MIN_S, EARLY_CLOSE_WINDOW_SHARE * float(window_s))


def noshow_penalty_rounds(on_probation: bool) -> int:
    return PROBATION_NOSHOW_PENALTY_ROUNDS if on_probation else NOSHOW_PENALTY_ROUNDS


class StandingView:
    """One node's view of who is established in round ``round`` (see the module doc).

    ``standing``: the node's ledger (None: empty); ``records``: the records in view (their attestations
    are read only for rounds this node missed); ``me``: this node's PeerID (attestations count for its
    own standing only once it credited a round: see :meth:`score`).
    """

    def __init__(
        self,
        standing: Optional[Standing],
        records: Iterable = (),
        *,
        round: int,
        me: Optional[str] = None,
        window: int = DEFAULT_WINDOW,
        k: int = PROBATION_ROUNDS,
    ):
        self.round = int(round)
        self.me = me
        self.threshold = threshold(self.round, k)
        self._standing = standing
        span = range(max(0, self.round - window), self.round)
        credited = {r for r in (standing.credited_rounds() if standing is not None else []) if r in span}
        self.credited = len(credited)
        # what the ledger saw within the window only: a ledger restored after a gap (a --resume at a later
        # round) holds credits of rounds before it, and counted them, this peer led while the others saw it
        # on probation and refused its plans (fresh-user trial, session 13)
        self._weights = standing.weights_in(span) if standing is not None else Counter()
        self.missed = len(span) - self.credited
        self._records = list(records)
        self._hist: dict[str, int] = {}
        self._attestors: Optional[list] = None
        self._k: Optional[int] = None  # _vouchers(), computed once

    def own(self, peer_id: str) -> int:
        """Rounds of the window this node itself saw ``peer_id`` deliver (its ledger)."""
        return self._weights.get(peer_id, 0)

    def _trusted(self) -> list:
        """Records whose attestations count: of peers that delivered in ``min(threshold, credited)`` of
        this node's credited rounds (all records while this node credited none: a fresh joiner)."""
        if self._attestors is None:
            need = min(self.threshold, self.credited)
            self._attestors = [r for r in self._records if self.own(r.peer_id) >= need]
        return self._attestors

    def attested(self, peer_id: str) -> int:
        """The standing at least ``min(ATTESTORS, trusted records)`` trusted records attest for ``peer_id`` (the
        k-th highest of their attestations, bounded by the window: one attestor alone cannot make an identity
        established once two are trusted; an attestor's omission can lower an honest peer's score only where this
        node's own ledger does not already hold it). A
        record's entry for its own peer counts too (:meth:`Standing.attestations` with ``own``): a peer
        that trained alone has nobody else to vouch for it, and a newcomer must see it established as it
        sees itself (docs/admission.md, "A young swarm"); trusted attestors are the peers this node saw
        deliver (anyone's only while it credited nothing, when identities vouching for each other do the
        same), and the score stays bounded by the rounds this node missed."""
        if peer_id not in self._hist:
            self._attest_all([peer_id])
        return self._hist[peer_id]

    def _vouchers(self) -> int:
        """How many trusted attestors must vouch for a standing before it counts: ``min(ATTESTORS, n)``, ``n`` the
        trusted records that attest anything (a newcomer's own record, empty, vouches for nobody: with it counted,
        the peer whose state it downloaded, alone in the run, would never be established in its view)."""
        if self._k is None:  # once per view: attested() asks per peer id, over the same trusted records
            n = sum(1 for r in self._trusted() if getattr(r, "standing", None) and r.peer_id != self.me)
            self._k = max(1, min(ATTESTORS, n))
        return self._k

    def score(self, peer_id: str) -> int:
        """Standing of ``peer_id`` as this node counts it: its ledger, filled in from attestations for at
        most the rounds it missed (for itself only once it credited a round: then the attestors are peers
        it saw deliver, never identities it has only read about)."""
        own = self.own(peer_id)
        if self.missed == 0 or (peer_id == self.me and self.credited == 0):
            return own
        return max(own, min(self.attested(peer_id), own + self.missed))

    def established(self, peer_id: str) -> bool:
        return self.score(peer_id) >= self.threshold

    def established_ids(self, peer_ids: Iterable[str]) -> frozenset[str]:
        """The ids among ``peer_ids`` that are :meth:`established` in this view.

        For many ids the attestations are read in one pass over the trusted records (each vouches for at most
        ``MAX_ATTESTED`` peers), not one pass per id: the end-of-run voters and a gather's syncing peers ask
        for every record of the run, hundreds of them."""
        ids = frozenset(peer_ids)
        pending = ids - self._hist.keys()
        if self.missed and len(pending) > 1:
            self._attest_all(pending)
        return frozenset(p for p in ids if self.established(p))

    def _attest_all(self, peer_ids: Collection[str]) -> None:
        """:meth:`attested` of each of ``peer_ids`` (into its cache), from one pass over the trusted records."""
        keys = {attest_key(p) for p in peer_ids}
        said: dict = {key: [] for key in keys}
        for r in self._trusted():
            for key, n in (getattr(r, "standing", None) or {}).items():
                if key in keys:
                    said[key].append(min(int(n), DEFAULT_WINDOW))
        k = self._vouchers()
        for p in peer_ids:
            got = sorted(said[attest_key(p)], reverse=True)
            # the k-th highest: what at least k trusted attestors vouch for (one alone cannot make identities)
            self._hist[p] = got[k - 1] if len(got) >= k else 0

    def plausible(self, peer_id: str) -> bool:
        """Could ``peer_id`` be established in a view that saw the rounds this node missed? A follower
        accepts a leader's claim that it is when this holds."""
        return self.own(peer_id) + self.missed >= self.threshold or self.established(peer_id)


def split(view: StandingView, peer_ids: Iterable[str]) -> tuple[list[str], list[str]]:
    """(established, probation) among ``peer_ids`` (sorted). Nobody established -> all are (bootstrap)."""
    ids = sorted(set(peer_ids))
    known = view.established_ids(ids)  # one pass over the attestations for all of them
    est = [p for p in ids if p in known]
    if not est:
        return ids, []
    return est, [p for p in ids if p not in known]


def select_probation(run_id: str, round: int, view: StandingView, candidates: Iterable[str], slots: int) -> list[str]:
    """The ``slots`` probation peers that join ``round``: highest standing first (a newcomer that
    delivered is kept until established), then the per-round rendezvous hash. Deterministic."""
    order = sorted(set(candidates), key=lambda p: (-view.score(p), probation_rank(run_id, round, p)))
    return order[: max(0, int(slots))]


def may_lead(view: StandingView, member_ids: Iterable[str], barred: Collection[str] = ()) -> list[str]:
    """Members that may lead, as every view that holds the same standing and bars sees them: the established ones
    not ``barred`` (no-shows). When none is, the established ones; when nobody is established, every member (a
    fresh swarm). Sorted PeerIDs. :func:`leader_candidates` adds this node's own-standing rule; a light follower
    ranks itself among these (:func:`geomesh_p2p.round.light.is_light`), so that the peers the full path lets
    lead are the full-view ones."""
    est, _ = split(view, member_ids)
    return [p for p in est if p not in barred] or est


def leader_candidates(view: StandingView, member_ids: Iterable[str], barred: Collection[str] = ()) -> list[str]:
    """Members that may lead (:func:`may_lead`): the established ones not ``barred`` (no-shows). When none is, the
    established ones; when nobody is established, every member (a fresh swarm).

    This node itself (``view.me``) is left out while it is not established in its own view and another
    member remains (a newcomer that downloaded the state follows until it has delivered): with the
    bootstrap rule above, a newcomer that sees nobody established would otherwise rank itself among
    the candidates, publish a plan the peers that made the state refuse (it is on probation in their
    view) and follow it, forking off a lineage of its own (docs/admission.md, "A young swarm").

    Views differ, so every member may leave itself out and name another that does the same (rs7: two
    peers, one not established in its own view, the other ``barred`` by its own no-show mark): the
    round driver then makes such a member the last resort after an attempt without any plan
    (:meth:`RoundDriver._last_resort <geomesh_p2p.round.driver.RoundDriver._last_resort>`; docs/round.md,
    "Leader election when nobody leads")."""
    ok = may_lead(view, member_ids, barred)
    me = view.me
    if me in ok and len(ok) > 1 and not view.established(me):
        ok = [p for p in ok if p != me]
    return ok


def marking_problem(plan, view: StandingView, live_ids: Collection[str]) -> Optional[str]:
    """Why a follower with ``view`` must refuse ``plan``'s probation marking (None: it may follow).

    * the leader must be plausibly established when any live peer is established in this view
      (probation peers never lead, unless nobody is established);
    * every participant the plan treats as established must be plausibly established, unless no
      participant is established in this view (the leader used the bootstrap rule).
    The count bound, part ownership and budgets of probation peers are checked by
    :func:`geomesh_p2p.plan.planner.check_plan` (they do not depend on the view).
    """
    if view.established_ids(live_ids) and not view.plausible(plan.leader):
        return (
            f"its leader {plan.leader[:10]} is on probation here (standing {view.score(plan.leader)} of the "
            f"{view.threshold} rounds needed to lead)"
        )
    participants = plan.participants()
    if not view.established_ids(participants):
        return None
    wrong = [
        a.peer_id for a in plan.assignments if not getattr(a, "probation", False) and not view.plausible(a.peer_id)
    ]
    if wrong:
        return (
            f"it plans {len(wrong)} peer(s) on probation here as established ({', '.join(p[:10] for p in wrong[:5])}; "
            f"standing below {view.threshold} rounds)"
        )
    return None


def absent_participants(
    participants: Iterable[str], contributors: Mapping[int, Sequence[tuple[str, int]]]
) -> list[str]:
    """Participants that are in no part's contributors (no-shows), or [] when no part has a result
    (nothing can be told then)."""
    seen = {pid for part in contributors.values() for pid, _ in part}
    if not seen:
        return []
    return sorted(p for p in participants if p not in seen)
