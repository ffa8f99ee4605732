"""Planning rules (:class:`PlanRules`): admission of the members to plan (no-shows left out, a bounded number
on probation, owners under a penalty client-only), this peer's plan when it leads (with the window's
exclusions and the evidence of delivered rates), and the checks a follower makes on a leader's plan.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Collection, Optional, Sequence

from geomesh_p2p.config.method import MethodRule, round_mode
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan import planner
from geomesh_p2p.plan.bounds import follower_owner_count
from geomesh_p2p.plan.cost import ranks_of
from geomesh_p2p.plan.agree import PlanDeferred
from geomesh_p2p.plan.planner import PlanConfig
from geomesh_p2p.plan.schema import ContentRefusal
from geomesh_p2p.round.rules.penalties import Penalties
from geomesh_p2p.round.rules.profiling import Reprofiler
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.trust import probation as pb

if TYPE_CHECKING:
    from geomesh_p2p.config.models import NodeConfig, RunConfig

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["PlanRules", "NoOwner", "plan_horizon_s"]

#: Followers refuse a plan whose deadlines lie further ahead than PLAN_HORIZON_WINDOWS x window +
#: PLAN_HORIZON_SLACK_S (window_s None: PLAN_HORIZON_DEFAULT_WINDOW_S): a rogue leader cannot park the swarm.
PLAN_HORIZON_WINDOWS = 4
PLAN_HORIZON_SLACK_S = 120.0
PLAN_HORIZON_DEFAULT_WINDOW_S = 60.0
#: A leader's own exchange timeout stays under this share of that horizon, so its followers accept the plan.
EXCHANGE_HORIZON_SHARE = 0.9
#: The exchange timeout is at least max(EXCHANGE_FLOOR_S, EXCHANGE_FLOOR_PLAN_TIMEOUTS x --plan-timeout-s).
EXCHANGE_FLOOR_S = 5.0
EXCHANGE_FLOOR_PLAN_TIMEOUTS = 3
#: Plans :meth:`PlanRules.build_plan` makes at most to fill a probation slot whose newcomer is over the bound.
PROBATION_TRIES = 4


def plan_horizon_s(window_s: Optional[float]) -> float:
    """Seconds ahead of now that a plan's deadlines may lie (followers refuse farther ones)."""
    return PLAN_HORIZON_WINDOWS * (window_s or PLAN_HORIZON_DEFAULT_WINDOW_S) + PLAN_HORIZON_SLACK_S


class NoOwner(Exception):
    """:meth:`PlanRules.build_plan`: no member to plan has an address (nobody can own a part)."""


class PlanRules:
    """This peer's planning and plan checks.

    Args:
        run_cfg: the run config (shapes of the plan, window, method).
        cfg: the node config (``plan_timeout_s``: the floor of this peer's exchange window).
        state: this peer's :class:`RoundState` (``me``, ``round``, ``digest``, ``numel``, ``standing``).
        penalties: the owner and no-show penalties this peer holds.
        profile: this peer's re-profiled figures (link EMAs and exchange cost: its exchange window; the
            delivered rates of the last round: the evidence its plans are bounded by). Default: none
            measured (the floor window, no evidence).
    """

    def __init__(
        self,
        run_cfg: RunConfig,
        cfg: NodeConfig,
        state: RoundState,
        penalties: Penalties,
        profile: Optional[Reprofiler] = None,
    ):
        self.run_cfg = run_cfg
        self.cfg = cfg
        self.state = state
        self.penalties = penalties
        self.profile = profile if profile is not None else Reprofiler(cfg, state)
        self._no_owner = False  # the last plan attempt found no member that can own a part
        self._lone_bars_said: Optional[tuple] = None  # the plan whose lone owner bars were last logged as followed

    @property
    def method_rule(self) -> MethodRule:
        """What the run's method means for a round (encodings, balanced or uniform, part alignment)."""
        return MethodRule.from_run(self.run_cfg)

    def standing_view(self, records):
        """This node's :class:`~geomesh_p2p.trust.probation.StandingView` of ``records`` for the current round."""
        s = self.state
        return pb.StandingView(s.standing, records, round=s.round, me=s.me)

    def make_plan(self, members, leader):
        """This peer's plan when it leads (:meth:`build_plan`).

        Raises :class:`~geomesh_p2p.plan.agree.PlanDeferred` when no member to plan can own a part
        (every one client-only, e.g. a lone peer nobody can dial, or on probation): it says so in one
        WARNING when that starts and one INFO when it ends, not at every retry (issue 14 #10)."""
        try:
            plan = self.build_plan(members, leader)
        except NoOwner as e:
            if self._no_owner is False:
                log.warning("round %d: no reachable peer can own a part (%s): waiting for one", self.state.round, e)
            self._no_owner = True
            raise PlanDeferred(str(e)) from None
        if self._no_owner:
            log.info("round %d: a peer can own a part again: planning", self.state.round)
        self._no_owner = False
        return plan

    def plan_config(self, n_peers: int) -> PlanConfig:
        """The planner's settings for a round of ``n_peers`` (this peer's exchange window included)."""
        r, rule = self.run_cfg, self.method_rule
        payload = rule.payload_bytes(self.state.numel, n_peers)
        return PlanConfig(
            seq_len=r.seq_len,
            target_batch=r.target_batch,
            window_s=r.window_s,
            # --window-s auto: each round's window from the records' step times (plan.awb.auto_window)
            target_inner_steps=r.target_inner_steps if r.window_s is None else None,
            # what every follower accepts (plan_problem's horizon), with the exchange's 10% to spare
            max_window_s=EXCHANGE_HORIZON_SHARE * plan_horizon_s(r.window_s),
            part_align=rule.part_align,
            comm_share=r.comm_share,
            payload_bytes=payload,
            mode=r.mode,
            method=r.method,
            uniform_inner_steps=r.uniform_inner_steps,
            max_inner_steps=r.max_inner_steps,
            exchange_timeout_s=self.exchange_window(n_peers, payload),
        )

    def exchange_window(self, n_peers: int, payload_bytes: int) -> float:
        """Seconds from a plan's train deadline to its exchange deadline (this peer's plans; followers check
        only that it is not unreasonably far): :func:`planner.exchange_timeout` of this peer's predicted
        exchange, network (its link EMAs) plus CPU (:func:`planner.exchange_cpu_s` at its measured cost per
        element pass, :meth:`Reprofiler.update_exchange_cost`), at least ``max(5, 3 x --plan-timeout-s)`` and
        at most 90% of the horizon followers accept (``4 x window + 120 s``). The CPU part grows with the model
        (encoding, signing, verifying and aggregating every element)."""
        floor = max(EXCHANGE_FLOOR_S, EXCHANGE_FLOOR_PLAN_TIMEOUTS * self.cfg.plan_timeout_s)
        cost = self.profile.codec_s_per_element
        numel = self.state.numel
        if not cost or not numel:
            return floor
        ema = self.profile.ema
        up = (getattr(ema, "upload_bps", None) or 0) or 1e8
        down = (getattr(ema, "download_bps", None) or 0) or 1e8
        comm = payload_bytes / up + payload_bytes / down
        n = max(1, n_peers)
        cpu = planner.exchange_cpu_s(numel, n, round_mode(self.run_cfg.mode, n, self.run_cfg.method), cost)
        # Never past what followers accept (plan_problem: "deadlines unreasonably far"), with 10% to spare.
        horizon = EXCHANGE_HORIZON_SHARE * plan_horizon_s(self.run_cfg.window_s)
        return max(floor, min(planner.exchange_timeout(comm, cpu, floor), horizon))

    def admit(self, members, skip: Collection[str] = ()):
        """(members to plan, those of them on probation): no-shows left out; of the peers on probation
        (standing below ``probation.threshold``) but ``skip`` (left out: newcomers :meth:`build_plan` found over
        the probation bound), at most ``probation_slots(established)``, highest standing first, then by a
        per-round rendezvous hash (probation.py)."""
        pen = self.penalties.noshows()
        me, rnd = self.state.me, self.state.round
        kept = [m for m in members if (m.peer_id not in pen or m.peer_id == me) and m.peer_id not in skip]
        view = self.standing_view(members)
        est, waiting = pb.split(view, [m.peer_id for m in kept])
        chosen = pb.select_probation(self.run_cfg.run_id, rnd, view, waiting, pb.probation_slots(len(est)))
        left = len(waiting) - len(chosen)
        if left or len(kept) < len(members):
            out = [m.peer_id[:10] for m in members if m.peer_id in pen and m.peer_id != me]
            log.info(
                "round %d: planning %d established peer(s) and %d of %d on probation; %d no-show(s) left out%s",
                rnd,
                len(est),
                len(chosen),
                len(waiting),
                len(out),
                f" ({', '.join(out)})" if out else "",
            )
        keep = set(est) | set(chosen)
        return [m for m in kept if m.peer_id in keep], tuple(chosen)

    def build_plan(self, members, leader):
        """This peer's plan of the round over ``members`` with ``leader`` (raises :class:`NoOwner` when no
        member to plan has an address). A newcomer on probation whose budget every follower's check would refuse
        is left out, and the next in line takes its slot (up to ``PROBATION_TRIES`` plans, then the slot stays
        empty): red team 53b, a newcomer claiming 64 ranks held the only slot in the rounds its rendezvous hash
        won, and the honest newcomer after it was not tried."""
        skip: set[str] = set()
        for tries in range(1, PROBATION_TRIES + 1):
            plan, over = self._build_plan(members, leader, skip, last=tries == PROBATION_TRIES)
            if not over:
                return plan
            skip |= set(over)
        raise AssertionError("the last try leaves every newcomer over the bound out")  # pragma: no cover

    def _build_plan(self, members, leader, skip: set[str], last: bool):
        """(:meth:`build_plan`'s plan with the newcomers of ``skip`` left out, the newcomers it holds over the
        probation bound: peer id -> why). ``last``: those are left out of the plan returned (no next try)."""
        rnd = self.state.round
        members, chosen = self.admit(members, skip)
        probation = chosen
        placed = {m.peer_id for m in members if m.address}  # the addresses the records announce
        members = self.penalties.without_parts(members, probation)
        cfg = self.plan_config(len(members))
        supported = self.delivered_evidence(rnd)
        if self.run_cfg.window_s or cfg.target_inner_steps is not None:
            # A peer whose exchange plus minimum compute would stretch the round well past what it takes
            # without it is planned out this round (planner.window_exclusions; docs/round.md, "Exclusion
            # rule"). One that fits the window costs nothing: AWB gives it fewer steps. A peer that delivered
            # last round stays unless it would double the round: a noisy link figure must not flap it.
            ex = planner.window_exclusions(members, cfg, kept=supported or ())
            if ex.excluded:
                slow = set(ex.excluded)
                log.warning(
                    "round %d: planning without %s: the round needs %s s with it (exchange %s s), %.1f s "
                    "without (window %.1f s)",
                    rnd,
                    ", ".join(p[:10] for p in ex.excluded),
                    ", ".join(f"{ex.need_s[p]:.1f}" for p in ex.excluded),
                    ", ".join(f"{ex.comm_s[p]:.1f}" for p in ex.excluded),
                    max([ex.window_s] + [v for p, v in ex.need_s.items() if p not in slow]),
                    ex.window_s,
                )
                members = [m for m in members if m.peer_id not in slow]
                # Still at most probation_slots(established) on probation (those first in line stay).
                ids = {m.peer_id for m in members}
                n_est = sum(1 for p in ids if p not in probation)
                probation = tuple(p for p in chosen if p in ids)[: pb.probation_slots(n_est)]
                members = [m for m in members if m.peer_id not in chosen or m.peer_id in probation]
                cfg = self.plan_config(len(members))
        # geomesh/awb: AWB plan; diloco/css: uniform; ddp: uniform with one step per round. Claims are
        # bounded by the planner (planner.bound_records) and, for the peers of the last round, by what
        # their delivered contributions support (Reprofiler.delivered_rates).
        if not any(m.address for m in members):
            raise NoOwner(f"{len(members)} peer(s) to plan, all client-only or on probation")
        plan = self._plan(members, placed, probation, cfg, leader, supported)
        over = planner.over_probation(plan, cfg, {m.peer_id: ranks_of(m) for m in members})
        if over and not last:
            log.info(
                "round %d: planning without %s on probation, the next in line tried",
                rnd,
                ", ".join(p[:10] for p in over),
            )
            return plan, over
        if over:
            # A newcomer whose budget every follower's probation check refuses (a uniform method plans a K-rank peer
            # K devices' rows, and a record may claim more ranks than the bound counts): left out of the round, it
            # waits to be established; planned, no plan of the round was followed, nor published (red team 53a).
            log.info(
                "round %d: planning without %s on probation: %s",
                rnd,
                ", ".join(p[:10] for p in over),
                next(iter(over.values())),
            )
            members = [m for m in members if m.peer_id not in over]
            probation = tuple(p for p in probation if p not in over)
            plan = self._plan(members, placed, probation, self.plan_config(len(members)), leader, supported)
        return plan, {}

    def _plan(self, members, placed: set, probation: tuple, cfg: PlanConfig, leader: str, supported):
        """:func:`planner.make_plan` of :meth:`build_plan` (``placed``: the members whose records announce an
        address, before the owner penalties)."""
        # Parts are capped at the ownership bound of a follower that holds none of this peer's owner bars (it
        # counts every participant its records place as a possible owner): views of the bars differ after a
        # resume, and such a follower refused the plan (session 52, fresh user 52b: 847360 of 937472 elements,
        # over the 626688 bound among 3).
        possible = {m.peer_id for m in members if m.peer_id in placed} - set(probation)
        owners = {m.peer_id for m in members if m.address} - set(probation)
        share_among = follower_owner_count(len(possible), len(possible - owners))
        return planner.make_plan(
            members,
            cfg,
            run_id=self.run_cfg.run_id,
            round=self.state.round,
            leader=leader,
            numel=self.state.numel,
            start_time=swarm_time() + 0.5,
            start_digest=self.state.digest,
            supported_tokens_per_s=supported,
            probation=probation,
            # late peers (no part of a recent round took their work) get less of it (probation.py, "A late peer")
            late_tokens_per_s=self.penalties.late_ceilings(),
            share_among=share_among,
        )

    def plan_problem(self, plan, live: dict) -> Optional[str]:
        """Why this peer must not follow ``plan`` (None: it may). Guards against a rogue or broken
        leader: wrong model size or settings, unknown leader or participants, owners at addresses
        their records do not announce, deadlines far in the future (a stall); then
        :func:`geomesh_p2p.plan.planner.check_plan`: batches, steps, window, token budgets and ownership
        within what the participants' records and the run config support."""
        reason = self._settings_problem(plan)
        if reason is not None:
            return reason
        if plan.leader not in live:
            return "its leader is not a live peer of this run"
        unknown = [p[:10] for p in plan.participants() if p not in live]
        if unknown:
            return f"it names peers that are not live: {unknown}"
        reason = _address_problem(plan, live) or self._steps_problem(plan)
        if reason is not None:
            return reason
        # Probation (issue 12): the leader is not a new identity, and those it plans as established are
        # established in this peer's view too (lenient by the rounds this peer did not see).
        reason = pb.marking_problem(plan, self.standing_view(list(live.values())), live.keys())
        if reason is not None:
            return reason
        # Batches, steps, window, budgets and ownership, recomputed from the records (issue 11).
        reason = self._penalty_problem(plan, live)
        if reason is not None:
            return reason
        barred = self.penalties.barred()
        return planner.check_plan(
            plan,
            live,
            self.plan_config(len(plan.assignments)),
            now=swarm_time(),
            barred=barred,
            supported=self.delivered_evidence(plan.round),
            unseen=self.unseen_evidence(plan.round),
            late=self.penalties.follower_late(plan.round, plan.participants(), self.delivered_evidence(plan.round)),
        )

    def sampled_plan_problem(self, plan, sampled: dict, sample: Sequence[str]) -> Optional[str]:
        """A light follower's :meth:`plan_problem` (issue 25, docs/round.md "Light followers"): it read the
        records of ``sample`` only (the plan's leader and a few participants drawn at random), ``sampled`` maps
        those it found to their records. Every check that needs the plan and the run config alone applies to
        the whole plan (settings, steps, deadlines, this peer's penalties, and
        :func:`geomesh_p2p.plan.planner.check_plan_sampled`'s budgets, shares and ownership); those that need
        a participant's record apply to the sampled ones, against their announced figures. A participant of
        the sample with no live record is refused as in :meth:`plan_problem`. Probation marks are not
        checked here (they need every record's standing): the full-view peers check them."""
        reason = self._settings_problem(plan)
        if reason is not None:
            return reason
        unchecked = [p[:10] for p in self.records_needed(plan) if sample and p not in sample]
        if unchecked:
            return f"it needs the records of {unchecked} to be checked, and they were not read"
        unknown = [p[:10] for p in sample if p not in sampled]
        if unknown:
            return f"it names peers that are not live: {unknown}"
        reason = _address_problem(plan, sampled) or self._steps_problem(plan) or self._penalty_problem(plan, sampled)
        if reason is not None:
            return reason
        return planner.check_plan_sampled(
            plan,
            sampled,
            self.plan_config(len(plan.assignments)),
            now=swarm_time(),
            barred=self.penalties.barred(),
            supported=self.delivered_evidence(plan.round),
            unseen=self.unseen_evidence(plan.round),
            late=self.penalties.follower_late(plan.round, plan.participants(), self.delivered_evidence(plan.round)),
        )

    def delivered_evidence(self, round: int) -> Optional[dict]:
        """peer id -> tokens/s its delivered contribution to round ``round - 1`` supports
        (:meth:`Reprofiler.delivered_rates`, computed by every peer that applied that round's aggregate), or
        None when this peer did not apply round ``round - 1``. The leader plans round ``round`` within it and
        followers check the plan against it (issue 28: claims planned by delivered work,
        :func:`geomesh_p2p.plan.bounds.evidence_ceilings`); a follower without it checks against the records
        alone."""
        evidence = self.profile.supported_tps
        return evidence[1] if evidence is not None and evidence[0] == round - 1 else None

    def unseen_evidence(self, round: int) -> Optional[dict]:
        """peer id -> the tokens/s round ``round - 1``'s plan gave it, for its participants whose delivery this peer
        did not see (it missed a part: :meth:`Reprofiler.unseen_rates`); None as :meth:`delivered_evidence`."""
        unseen = self.profile.unseen_tps
        return unseen[1] if unseen is not None and unseen[0] == round - 1 else None

    def records_needed(self, plan) -> list[str]:
        """Participants a light follower must sample to check ``plan`` (:func:`planner.records_needed`)."""
        return planner.records_needed(plan, self.plan_config(len(plan.assignments)))

    def _settings_problem(self, plan) -> Optional[str]:
        """Reasons of the plan and the run config alone: every honest follower gives them (ContentRefusal)."""
        rc, numel = self.run_cfg, self.state.numel
        if plan.numel != numel:
            return ContentRefusal(f"it is for {plan.numel} parameters, the model has {numel}")
        mode = round_mode(rc.mode, len(plan.assignments), rc.method)
        if plan.seq_len != rc.seq_len or plan.method != rc.method or plan.mode != mode:
            return ContentRefusal("its seq_len / method / mode differ from the run config")
        return None

    def _steps_problem(self, plan) -> Optional[str]:
        """Inner steps over the run's maximum, deadlines far in the future (a stall)."""
        rc = self.run_cfg
        for a in plan.assignments:
            if a.inner_steps > rc.max_inner_steps:
                return ContentRefusal(
                    f"{a.inner_steps} inner steps for {a.peer_id[:10]} exceed the run's {rc.max_inner_steps}"
                )
        horizon = plan_horizon_s(rc.window_s)
        if plan.train_deadline - swarm_time() > horizon or plan.exchange_deadline - plan.train_deadline > horizon:
            return "its deadlines are unreasonably far in the future"
        return None

    def _penalty_problem(self, plan, live: Optional[dict] = None) -> Optional[str]:
        """Penalties hold whoever leads (an adversarial review found a no-show leading and giving itself 64%
        of the model again): a leader this peer saw deliver nothing, or a part given to an owner whose part
        had no valid result, is refused; the next leader takes over. An owner bar refuses only where the swarm
        shares it (:meth:`Penalties.shared_bars` over ``live``, peer id -> PeerRecord: the leader's record or a
        majority of the voters' name it); one held here alone is followed past, with one INFO line (session 52).
        ``live`` None (no records read): every bar held here refuses."""
        me, barred, noshows = self.state.me, self.penalties.barred(), self.penalties.noshows()
        if plan.leader in noshows and plan.leader != me:
            return f"its leader {plan.leader[:10]} contributed to no part recently (not planned until round {noshows[plan.leader]})"
        # A late-marked leader is not refused (session 50, red team 50): a follower that joined or re-synced since the
        # mark holds none and would follow its plan while the holders followed the next candidate's (two plans in one
        # round). Honest late peers hold their own mark (note_own_failures, note_sat_out) or, without the history, do
        # not lead (Penalties.lead_gap); a rogue one escapes its late ceiling, no further than an unmarked peer's budget.
        owning = [pid for pid, _, _ in plan.owners() if pid in barred and pid != me]
        if not owning or live is None:
            return (
                f"it gives a part to {owning[0][:10]}, whose part had no valid result in a recent round"
                if owning
                else None
            )
        # a bar held here alone is followed past (session 52, Penalties.shared_bars): refused, this peer sat out every
        # plan the others followed while it lasted (fresh user 52: rounds 29-32); its own plans still leave the peer out
        recs = list(live.values())
        voters = pb.leader_candidates(self.standing_view(recs), list(live), barred=self.penalties.unled())
        shared, tally = self.penalties.shared_bars(owning, recs, voters, plan.leader)
        if shared:
            return (
                f"it gives a part to {shared[0][:10]}, whose part had no valid result in a recent round "
                f"({tally[shared[0]]} hold that bar)"
            )
        key = (plan.round, plan.leader, tuple(owning))
        if key != self._lone_bars_said:  # one line a plan: plan_problem runs at every attempt that reads it
            log.info(
                "round %d: following the plan of leader %s although it gives a part to %s, whose part had no valid "
                "result in this peer's view only (%s hold that bar; the leader's record names none): a bar held alone "
                "bars them from this peer's own plans only",
                plan.round,
                plan.leader[:10],
                ", ".join(p[:10] for p in owning),
                "; ".join(f"{p[:10]}: {tally[p]}" for p in owning),
            )
        self._lone_bars_said = key
        return None


def _address_problem(plan, records: dict) -> Optional[str]:
    """An owner placed at an address its record (when in ``records``) does not announce."""
    for a in plan.assignments:
        rec = records.get(a.peer_id)
        if rec is not None and a.part_end > a.part_start and a.address != rec.address:
            return f"owner {a.peer_id[:10]} is placed at {a.address}, its record says {rec.address}"
    return None
