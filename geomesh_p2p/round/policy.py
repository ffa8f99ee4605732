"""The node's round rules as one :class:`~geomesh_p2p.round.ports.RoundPolicy` (issue 13, issue 24):
:class:`NodeRoundPolicy` composes the rule objects of :mod:`geomesh_p2p.round.rules` (planning and plan
checks, penalties, re-profiling, verified work, the state vote) and is what the
:class:`~geomesh_p2p.round.driver.RoundDriver` calls. The node (:mod:`geomesh_p2p.node.peer`) builds them
over its state; tests build them directly with fakes (tests/rules_util.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Optional

from geomesh_p2p.round.rules.penalties import OWNER_PENALTY_ROUNDS, Penalties, conclusive
from geomesh_p2p.round.rules.planning import PlanRules, plan_horizon_s
from geomesh_p2p.round.rules.profiling import EXCHANGE_COST_STEP, Reprofiler
from geomesh_p2p.round.rules.state_sync import StateSync
from geomesh_p2p.round.rules.spec import collective_spec
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.round.rules.verified import VerifiedWork
from geomesh_p2p.round.rules.accountable import Accountability
from geomesh_p2p.config.method import MethodRule
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.trust import probation as pb
from geomesh_p2p.trust.standing import delivered

if TYPE_CHECKING:
    from geomesh_p2p.telemetry.metrics import RoundRecord

# Round log lines keep the node's logger name: operators' filters and the tests' caplog select on it.
log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = [
    "NodeRoundPolicy",
    "OWNER_PENALTY_ROUNDS",
    "EXCHANGE_COST_STEP",
    "plan_horizon_s",
]


def _no_publish(rec: RoundRecord) -> None:
    return None


def _gap_key(gap: str) -> str:
    """What names one gap of :meth:`Penalties.lead_gap` for its INFO line: which marks it lacks (its own, or the owner
    penalties). Its text names the round before too, so it changed every round (red team 50: the e2e killed-peer
    run's fresh peer said it 13 rounds in a row); the runs' starts move once the first round after a cut is applied.
    A gap said stays unsaid until it ends or turns into the other kind."""
    return "own" if gap.startswith("it knows") else "owner"


class NodeRoundPolicy:
    """The round rules the driver calls (:class:`~geomesh_p2p.round.ports.RoundPolicy`).

    Args:
        planning: planning and plan checks.
        penalties: the owner and no-show penalties (``planning.penalties`` when omitted).
        profile: re-profiling (``planning.profile`` when omitted).
        verified: verified work (off when omitted).
        sync: the state vote (``swarm_round``); None: no vote (``swarm_round`` is None).
        publish: the round's row to the log, Prometheus and the status page (raises RuntimeError after the
            node shut down); default: nowhere.
        max_message_bytes: the transport's largest gRPC message (the collective's spec cuts parts to it).
        accountable: accountable mode's validation, proofs and exclusions after each round (off when omitted).
    """

    def __init__(
        self,
        planning: PlanRules,
        *,
        penalties: Optional[Penalties] = None,
        profile: Optional[Reprofiler] = None,
        verified: Optional[VerifiedWork] = None,
        sync: Optional[StateSync] = None,
        publish: Callable[[RoundRecord], None] = _no_publish,
        max_message_bytes: Optional[Callable[[], int]] = None,
        accountable: Optional[Accountability] = None,
    ):
        self.planning = planning
        self.state: RoundState = planning.state
        self.penalties = penalties if penalties is not None else planning.penalties
        self.profile = profile if profile is not None else planning.profile
        self.verified = verified if verified is not None else VerifiedWork(self.state)
        self.sync = sync
        if sync is not None:  # the catch-up's state vote leaves out the votes the digest check leaves out
            sync.voters = self.digest_voters
        self._publish = publish
        self._max_message_bytes = max_message_bytes
        self.accountable = accountable
        self._lead_gap_said: Optional[str] = None  # the gap last said (one INFO line a gap: _gap_key)
        self._told_said: set[str] = set()  # the last marks taken from the peers' own records (one INFO line a set)
        #: the ``lead_from`` this peer's record last announced (``node.training.record_state``): kept to, see
        #: :meth:`leader_candidates`
        self.announced_lead_from: Optional[int] = None
        self.announced_round: Optional[int] = None  # the round of the record that announced it
        if accountable is not None:
            accountable.undo_on = self.undo_on

    def make_plan(self, members, leader):
        """This peer's plan when it leads (:meth:`PlanRules.make_plan`; raises PlanDeferred), naming the participants
        published evidence accuses that it has not settled yet (:meth:`VerifiedWork.accused`), listing the forged
        parts to undo (:meth:`Accountability.undo_list`) when the run undoes them (``undo_forged``)."""
        plan = self.planning.make_plan(members, leader)
        accused = self.verified.accused(plan)
        if accused:  # they lead nothing in the next round (round.planning.next_leaders; issue 28, session 47)
            plan = plan.model_copy(update={"accused": accused})
            log.info(
                "round %d: this plan names %s accused (published evidence not settled here yet): no leader of the "
                "next round",
                plan.round,
                ", ".join(p[:10] for p in accused),
            )
        if self.undo_on and getattr(plan, "mode", None) == "accountable" and self.accountable is not None:
            undo = self.accountable.undo_list(plan.round)
            if undo:
                plan = plan.model_copy(update={"undo": undo})
        return plan

    @property
    def undo_on(self) -> bool:
        """The run undoes proven forged parts exactly (RunConfig.undo_forged, docs/collective.md "State and repair")."""
        return bool(getattr(getattr(self.planning, "run_cfg", None), "undo_forged", False))

    def undo_problem(self, plan) -> Optional[str]:
        """Why this peer refuses ``plan``'s undo list (:meth:`Accountability.undo_problem`); a plan listing undos is
        refused by every follower (ContentRefusal) where no accountability runs."""
        if self.accountable is None:
            return (
                ContentRefusal("it lists undos, and this peer runs no accountable mode")
                if getattr(plan, "undo", None)
                else None
            )
        return self.accountable.undo_problem(plan, self.undo_on)

    def plan_problem(self, plan, live: dict) -> Optional[str]:
        """Why this peer refuses ``plan``: :meth:`PlanRules.plan_problem`, then verified work's objection, then its
        undo list's (:meth:`undo_problem`)."""
        return self.planning.plan_problem(plan, live) or self.verified.plan_problem(plan) or self.undo_problem(plan)

    def sampled_plan_problem(self, plan, sampled: dict, sample) -> Optional[str]:
        """A light follower's :meth:`plan_problem` (:meth:`PlanRules.sampled_plan_problem`: the records of a
        sample only), then verified work's objection."""
        return (
            self.planning.sampled_plan_problem(plan, sampled, sample)
            or self.verified.plan_problem(plan)
            or self.undo_problem(plan)
        )

    def records_needed(self, plan) -> list[str]:
        """Participants whose records a light follower must read to check ``plan`` (:meth:`PlanRules.records_needed`)."""
        return self.planning.records_needed(plan)

    def leader_candidates(self, members, live: dict):
        """(members without the peers verified work excluded, the established ones that may lead).

        This peer also leaves itself out, for a method of per-peer budgets, while it holds no delivered-work evidence
        of the last round (:meth:`PlanRules.delivered_evidence`: it did not apply round ``r - 1``: resumed, caught
        up, planned out) and another candidate remains: the followers that applied that round check budgets against
        what each participant delivered in it, and its plan, made from the records alone, broke that check (fresh-user
        trial, session 29: a peer resumed with ``--resume`` led at once, planned itself 79 steps, both others refused
        the plan and the round was lost for all three). Likewise while it does not hold the marks its plan must agree
        with (:meth:`Penalties.lead_gap`: joined, restarted without ``--resume``, re-synced or planned out within their
        span; session 50). If every member does so, the last resort publishes
        (:func:`geomesh_p2p.round.planning.last_resort`)."""
        members = self.verified.members(members)
        view = self.planning.standing_view(list(live.values()))
        # without the history, the peers' own word on their marks too (Penalties.announced_unled; session 50), where
        # a majority of every live peer that may lead backs it (backed_unled): the claimant's word alone moved this
        # peer's level off the holders' (red team 50b, session 52)
        backers = pb.leader_candidates(view, self.verified.member_ids(live), barred=self.penalties.unled())
        told = self.penalties.backed_unled(live.values(), backers) - self.penalties.unled()
        if told and told != self._told_said:  # one INFO line a set: the e2e log shows why the joiner's level moved
            log.info(
                "round %d: this peer lacks the marks of the last rounds; %s announce(s) a mark on itself: no leader "
                "candidate here either",
                self.state.round,
                ", ".join(sorted(p[:10] for p in told)),
            )
        self._told_said = told
        unled = self.penalties.unled() | told
        cands = pb.leader_candidates(
            view, [m.peer_id for m in members], barred=unled
        )  # the bars of may_lead_ids, and this peer's own-standing rule
        me, r = self.state.me, self.state.round
        # planned out of (or sat out) a round of the owner span: the owner penalties its voters hold (session 51).
        # The voters are every live peer that may lead, not the members in step only: the peers a rogue leader
        # planned out along with this one are still syncing at its gather, so among the members 2 rogues outvoted
        # 1 holder (red team 51a); those not at this round and state count against a map
        voters = pb.leader_candidates(view, self.verified.member_ids(live), barred=unled)
        took = self.penalties.take_owner_bars(live.values(), set(voters) | set(cands))
        if took is not None:
            log.info("round %d: this peer did not apply every round of the owner penalties in force; %s", r, took)
        if me not in cands or len(cands) < 2 or r <= 0:
            return members, cands
        gap = self.penalties.lead_gap(r)
        key = None if gap is None else _gap_key(gap)
        if key is not None and key != self._lead_gap_said:  # once a gap: its text grows every round (red team 50)
            log.info(
                "round %d: this peer is no leader candidate: %s (its plan could break a mark the others hold)", r, gap
            )
        self._lead_gap_said = key
        # A gap its record announced for this round is kept to, also when it closed since (the owner vote above): the
        # others took the next candidate's turn at once on the announcement, and a plan of this peer's published late
        # beside that one could be followed by some peers and not others (red team 51d's split, gap51)
        kept = self.announced_lead_from is not None and self.announced_lead_from > r
        if (
            gap is not None
            or kept
            or (MethodRule.from_run(self.planning.run_cfg).balanced and self.planning.delivered_evidence(r) is None)
        ):
            cands = [c for c in cands if c != me]
        return members, cands

    def lead_from(self, r: int) -> Optional[int]:
        """The first round from ``r`` on at which :meth:`leader_candidates` keeps this peer in by its own rules, if it
        applies each round from ``r`` on (None: none leaves it out at ``r``): :meth:`Penalties.lead_from`, and for a
        method of per-peer budgets ``r + 1`` while it holds no delivered-work evidence of round ``r - 1``. Its record
        announces it (``PeerRecord.lead_from``): the others take the next candidate's turn at once (fresh user 51)."""
        end = self.penalties.lead_from(r)
        if (
            r > 0
            and MethodRule.from_run(self.planning.run_cfg).balanced
            and self.planning.delivered_evidence(r) is None
        ):
            end = max(end or r, r + 1)
        return end

    def may_lead_ids(self, records, peer_ids: Iterable[str]) -> Optional[list[str]]:
        """The ids among ``peer_ids`` that :meth:`leader_candidates` lets lead in this peer's view of ``records``
        (``()``: its own ledger), without its own-standing and delivered-evidence rules about this peer itself:
        verified work's exclusions out (never this peer), the established ones, no-shows out
        (:func:`~geomesh_p2p.trust.probation.may_lead`). Sorted PeerIDs. A light follower ranks itself among
        these (:func:`geomesh_p2p.round.light.is_light`): ranked among every established participant, a
        crashed no-show ranked first held the only full-view slot of ``--full-view-peers 1`` while the full path
        let the next one lead, and that one ran light (issue 28, session 39).

        None when ``records`` is empty and the ledger alone cannot tell: it missed rounds of its window and credited
        fewer than the standing threshold (a peer restarted without its checkpoint, or resumed after a long gap). It
        then holds nobody established and :func:`~geomesh_p2p.trust.probation.split` takes every id for
        established, newcomers on probation included, where the full path reads the others' attestations (red team
        39: such a peer, the full path's first candidate everywhere, ranked a probation newcomer first, ran light,
        and every other participant ran light deferring to it: nobody published for a whole plan attempt)."""
        view = self.planning.standing_view(records)
        if not records and view.missed and view.credited < view.threshold:
            return None
        return pb.may_lead(view, self.verified.member_ids(peer_ids), barred=self.penalties.unled())

    def collective_spec(self, plan):
        """The collective's spec of ``plan`` (:func:`~geomesh_p2p.round.rules.spec.collective_spec`).

        Raises:
            ValueError: the plan cannot be executed.
            RuntimeError: built without the transport's message limit.
        """
        if self._max_message_bytes is None:
            raise RuntimeError("the round rules were built without the transport's message limit")
        return collective_spec(
            plan, self.planning.run_cfg, self.state.numel, self._max_message_bytes(), self.state.theta_maxabs
        )

    def swarm_round(self, records) -> Optional[int]:
        """The round the swarm's vote backs (:meth:`StateSync.swarm_round`), None when none is backed."""
        return self.sync.swarm_round(records) if self.sync is not None else None

    def rejoin_state(self, records, among: Optional[Collection[str]] = None) -> Optional[tuple[int, str]]:
        """The state to re-sync to before training though the swarm is at no later round
        (:meth:`StateSync.rejoin_state`; ``among``: the PeerIDs whose states settle a vote with no majority), None
        when none (or no state sync)."""
        return self.sync.rejoin_state(records, among) if self.sync is not None else None

    def digest_voters(self, records) -> list:
        """``records`` without those of the peers verified work or a proof excludes here (:meth:`VerifiedWork.members`):
        an excluded peer's digest neither confirms this peer's state nor outvotes it in the digest check.

        Why (session 28's backdoor pair b): the poisoner's vote made a 2-2 tie of a round in which two honest peers
        had advanced and a third had not; the tie kept the third on the poisoner's side. Leaving a vote out can
        only turn an excluded peer's tie into the honest side's majority, never make an honest peer's vote count
        less."""
        return self.verified.members(records)

    def standing_established(self, records, peer_id: str) -> bool:
        """Whether ``peer_id`` is established in this peer's view of ``records`` (:meth:`standing_established_ids`)."""
        return peer_id in self.standing_established_ids(records, (peer_id,))

    def standing_established_ids(self, records, peer_ids: Optional[Iterable[str]] = None) -> frozenset[str]:
        """The ids among ``peer_ids`` (default: the ``records``' peers) established in this peer's view of ``records``:
        one :meth:`PlanRules.standing_view` for all of them (callers that asked :meth:`standing_established` once per
        record built a view per record: O(N^2) on the event loop at hundreds of records)."""
        ids = [x.peer_id for x in records] if peer_ids is None else peer_ids
        return self.planning.standing_view(records).established_ids(ids)

    def after_exchange(self, spec, plan, ar) -> None:
        """Penalties for this peer's own failures, failed owners and no-shows (none from a round that
        aggregated no token: :func:`~geomesh_p2p.round.rules.penalties.conclusive`, one INFO line says so);
        the exchange's cost EMA."""
        if not conclusive(ar) and plan.participants() != [self.state.me]:
            # Two ways to aggregate nothing, named apart (session 35: "0 of 3 without a result" read as if
            # every part had succeeded): no result at all, or a result of 0 tokens (too few contributions
            # counted tokens for the quorum: a claim under its token floor counts 0).
            parts, missing = len(spec.owners), len(ar.missing_parts)
            log.info(
                "round %d: no part aggregated a token: %d of %d part(s) had a result of 0 tokens (fewer "
                "contributions counted tokens than the quorum of %d, or none did; work under a peer's token floor "
                "counts 0), %d had no result; nobody is marked a no-show or a failed owner for it",
                spec.round,
                parts - missing,
                parts,
                spec.quorum_count(),
                missing,
            )
        # who delivered in the round before (the graced no-shows' condition): every peer that applied it holds it
        before = self.planning.delivered_evidence(plan.round)
        self.penalties.note_applied(plan.round)  # the marks of this round are held here (session 50)
        self.penalties.note_own_failures(spec, plan, ar, delivered_before=before)
        self.penalties.note_failed_owners(spec, ar)
        self.penalties.note_no_shows(plan, ar, delivered_before=before)
        self.profile.update_exchange_cost(spec, ar)

    def note_own_failures(self, spec, plan, ar, *, stalled: bool = False) -> None:
        """:meth:`Penalties.note_own_failures` (the driver calls it alone for a round this peer stalled through)."""
        self.penalties.note_own_failures(
            spec, plan, ar, stalled=stalled, delivered_before=self.planning.delivered_evidence(plan.round)
        )
        if stalled:  # its own failures are known; the others' marks of that round are not (no part result read)
            self.penalties.note_own_known(plan.round)

    def forget_marks_since(self, round: int) -> list[str]:
        """:meth:`Penalties.forget_marks_since` and the standing credits of the same rounds
        (:meth:`~geomesh_p2p.trust.standing.Standing.forget_since`, one INFO line when any go); the driver calls
        it after a re-sync to a state this peer did not make. Returns the PeerIDs whose penalty marks went."""
        credits = self.state.standing.forget_since(round)
        if credits:
            log.info(
                "re-synced to the swarm's state: the standing credits of round(s) %s (a lineage the swarm did not "
                "confirm) dropped",
                ", ".join(str(r) for r in credits),
            )
        return self.penalties.forget_marks_since(round)

    async def before_outer_step(self, r, plan, assignment, ar) -> None:
        """Verified work keeps round ``r``'s start weights (:meth:`VerifiedWork.before_outer_step`)."""
        await self.verified.before_outer_step(r, plan, assignment, ar)

    def after_outer_step(self, r, plan, assignment, result, ar) -> None:
        """Re-profile before round r+1 is announced: its leader then plans with the figures every follower
        checks the plan against (planner.check_plan); delivered rates; standing credits (standing.py); accountable
        mode's validation of round ``r`` in the background (:meth:`Accountability.after_round`)."""
        self.profile.after_round(r, plan, assignment.micro_batch, result, ar)
        self.verified.after_commit(r + 1, plan)  # round r + 1's start weights written while it trains
        self.state.standing.credit(r, delivered(ar.contributors))
        if self.accountable is not None:
            self.accountable.after_round(r, plan, ar)

    def planned_out(self, r: int, plan) -> None:
        """This peer sits round ``r`` out (planned out, or refusing ``plan``): accountable mode reads the proofs in
        the DHT all the same (:meth:`Accountability.read_in_background`), and verified work applies its ended checks
        and reads the swarm's evidence (:meth:`VerifiedWork.planned_out`), so its verdicts follow the swarm's."""
        self.verified.planned_out(r)
        # it saw the plan: not named, nobody marks it; named, it takes the marks itself (note_sat_out)
        self.penalties.note_own_known(r)
        if self.accountable is not None:
            self.accountable.read_in_background(r, plan)

    def note_sat_out(self, plan) -> None:
        """:meth:`Penalties.note_sat_out`: this peer sat out ``plan``, which names it, and the swarm's state moved
        on through it (the driver calls it after the re-sync)."""
        self.penalties.note_sat_out(plan, delivered_before=self.planning.delivered_evidence(plan.round))

    def note_recovered_plan(self, plan) -> bool:
        """Round ``plan.round``'s plan, which this peer did not obtain and its voters' records name at its state
        (``round.planning.recover_last_plan``), names it: the others ran it without this peer and marked it as they
        mark a peer that sits a plan out (:meth:`note_sat_out`), unless this peer already knows its marks of that
        round (it saw the plan and sat it out: ``planned_out``). True when it took them.

        Why (fresh user 51): a follower ignored as absent a plan the others followed (its leader on probation in its
        view, plausible in a resumed peer's), caught up past it, and never took the owner bar and late mark the
        others gave it. Its check of the next leader's plan counted itself a possible owner (3 not 2), refused the
        honest plan as over the 2x bound, it sat that round out too, and led plans nobody followed."""
        me, r = self.state.me, plan.round
        if me is None or me not in plan.participants() or self.penalties.holds(r + 1, span=1, own=True):
            return False
        if r > 0 and not self.penalties.holds(r, span=1, own=True):
            # it was not with the swarm in round r - 1 either (resumed, joined, re-synced): its delivered evidence may
            # not be the others' (they grace a peer that delivered the round before), and a bench they do not hold
            # would make it refuse their plans naming it; it leads nothing meanwhile (Penalties.lead_gap)
            return False
        self.note_sat_out(plan)
        self.penalties.note_own_known(r)  # as planned_out: the marks the others took on it in round r are now known
        return True

    def publish_record(self, rec) -> None:
        """The round's row to the log, Prometheus and the status page. Raises RuntimeError after shutdown
        (the round log is closed). The row carries verified work's counts (``extra["verify"]``: checks drawn,
        done, late, dropped, waiting; issue 28) and accountable mode's validation (``extra["accountable"]``:
        :meth:`Accountability.counts`). The round's advisory agreement measurement runs from now on
        (:meth:`VerifiedWork.round_done`)."""
        self.verified.round_done(rec.round)
        counts = self.verified.counts()
        if counts is not None:
            rec.extra["verify"] = counts
        validated = None if self.accountable is None else self.accountable.counts()
        if validated is not None:
            rec.extra["accountable"] = validated
        self._publish(rec)
