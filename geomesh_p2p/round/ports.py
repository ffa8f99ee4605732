"""The round driver's collaborators, as small structural interfaces (``typing.Protocol``).

:class:`~geomesh_p2p.round.driver.RoundDriver` touches the rest of the node only through these, so it
is unit-tested with in-memory fakes (tests/unit/test_round_driver.py). The node satisfies them with its
DHT records (:class:`Membership`), the signed plans in the DHT (:class:`PlanAgreement`), the inner
trainer (:class:`Trainer`), the collective (:class:`Collective`), its global state
(:class:`GlobalStatePort`) and its planning rules (:class:`RoundPolicy`).
"""

from __future__ import annotations

import asyncio
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    runtime_checkable,
)

import torch

from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan
from geomesh_p2p.schema.peer import PeerRecord

if TYPE_CHECKING:
    # the real types; training imports transformers, the exchange grpc: not loaded at run time here
    from geomesh_p2p.exchange.client import AllReduceResult
    from geomesh_p2p.exchange.partition import CollectiveSpec
    from geomesh_p2p.model.training import InnerResult, StepTarget
    from geomesh_p2p.model.turns import Turns
    from geomesh_p2p.telemetry.metrics import RoundRecord

__all__ = [
    "Clock",
    "SystemClock",
    "Membership",
    "PlanAgreement",
    "Trainer",
    "Collective",
    "GlobalStatePort",
    "EagerStatePort",
    "RoundPolicy",
]


class Clock(Protocol):
    """Time source of the driver (an injected fake makes timing tests instant)."""

    def time(self) -> float:
        """Swarm time, unix seconds (plans' deadlines are in it: :mod:`geomesh_p2p.net.swarm_time`)."""

    def monotonic(self) -> float:
        """Monotonic seconds (timeouts)."""

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``event``; True when it is set."""


class SystemClock:
    """:class:`Clock` over :mod:`time`: ``time`` is swarm time (:func:`geomesh_p2p.net.swarm_time.swarm_time`: this
    machine's clock plus the offset measured to the bootstraps), ``monotonic`` is local."""

    def time(self) -> float:
        return swarm_time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        return await wait_event(event, seconds)


class Membership(Protocol):
    """Live records of the run and this peer's own announcement."""

    me: str

    async def peers(self, include_leaving: bool = False) -> list[PeerRecord]:
        """Live, admitted records of this run, this peer's own (fresh) included; one DHT read."""

    async def records_of(self, peer_ids: Collection[str], *, sampled: bool = True) -> list[PeerRecord]:
        """Live, admitted records of ``peer_ids`` only (leaving ones included); one DHT read of those subkeys
        (a light follower's sample, issue 25), from a small quorum of holders unless ``sampled`` is False (a
        read whose missing record is acted on: the DHT's full read quorum)."""

    async def announce(self) -> None:
        """Store this peer's record now (round, digest, leaving); one DHT write. Never raises."""

    async def remeasure(self) -> None:
        """Measure this peer's link (a probe) and device (a timed step) afresh when a leader planned it out:
        its announced figures came from its last exchange and inner steps (or its start-up profile), and a
        peer left out of the round never measures again, so one pessimistic figure (a congested round, a
        profile taken on a loaded CPU) would keep it out for good."""
        ...


class PlanAgreement(Protocol):
    """Signed plans of a round (geomesh_p2p.plan.agree.obtain_plan over a PlanStore)."""

    async def agree(
        self,
        round: int,
        members: Sequence[PeerRecord],
        make_plan: Callable[[Sequence[PeerRecord], str], RoundPlan],
        *,
        accept: Callable[[RoundPlan], Optional[str]],
        candidates: Sequence[str],
        plan_timeout_s: float,
        provisional: Optional[Callable[[RoundPlan], None]] = None,
        last_resort: Sequence[str] = (),
        authorities: Sequence[str] = (),
        leaders: Optional[Callable[[], Collection[str]]] = None,
        gapped: Collection[str] = (),
        tiers: Optional[Mapping[str, int]] = None,
    ) -> Optional[RoundPlan]:
        """The plan every peer follows for ``round`` (publishing one when this peer's turn comes), or None.
        ``provisional(plan)``: called with the plan it will most likely return, before a settle wait
        (:func:`geomesh_p2p.plan.agree.obtain_plan`); the driver trains on it meanwhile. ``last_resort``:
        PeerIDs that publish only when no plan at all appeared after every candidate's turn (the driver
        passes it only when non-empty, so an agreement without the keyword still works). ``authorities``:
        established peers besides the candidates whose plans this peer must not bypass when it refuses them
        (passed only when non-empty). Raises :class:`~geomesh_p2p.plan.agree.PlanRefused` when this peer
        refuses a plan others may follow: the driver sits the round out (no fork, issue 25). ``leaders()``:
        the PeerIDs whose stored plans may be read at all (the others are left unread: any identity can store
        one, and a chunked one costs a lookup per chunk). ``gapped``: candidates whose records announce they lead
        nothing this round (``PeerRecord.lead_from``): the turns after theirs come sooner, nothing else changes
        (passed only when non-empty). ``tiers``: leader -> tier compared before the rank (round ``r - 1``'s plan's
        levels, ``round.planning.plan_tiers``; empty: the rank alone)."""

    def publish_background(self, plan: RoundPlan) -> None:
        """Store ``plan`` without waiting (a lone peer's own plan, for the status page); never raises."""

    async def plan_of(self, round: int, leader: str, sha256: str) -> tuple[Optional[RoundPlan], str]:
        """The plan of ``round`` stored by ``leader`` whose ``RoundPlan.to_bytes`` hashes (SHA-256 hex) to
        ``sha256``, even after its round ended, or (None, why); never raises (``round/last_plan.py``)."""


class Trainer(Protocol):
    """Inner training (geomesh_p2p.model.training.InnerTrainer); synchronous, the driver runs it in a thread."""

    def run(
        self,
        *,
        round: int,
        inner_steps: int,
        batch_size: int,
        micro_batch: Optional[int] = None,
        deadline: Optional[float] = None,
        progress=None,
        should_stop=None,
        target: Optional[StepTarget] = None,
        floor_steps: int = 0,
        floor_grace_s: float = 0.0,
    ) -> InnerResult:
        """Inner steps on the model; returns an InnerResult (steps_done, tokens, mean_loss, compute_s).
        ``floor_steps`` may run ``floor_grace_s`` past ``deadline`` (the token floor, InnerTrainer.run).
        ``target``: a :class:`~geomesh_p2p.model.training.StepTarget` read before every step instead of
        ``inner_steps`` / ``deadline`` (eager updates: only passed when ``DriverConfig.eager``)."""

    def gradient(
        self, *, round: int, batch_size: int, micro_batch: Optional[int] = None
    ) -> tuple[torch.Tensor, InnerResult]:
        """One batch's gradient [P] fp32 and its InnerResult (the ddp baseline)."""

    def evaluate(self, max_batches: int = 8) -> float:
        """Held-out perplexity of the model."""


@runtime_checkable
class SnapshotEvaluator(Protocol):
    """What a :class:`Trainer` may also offer (InnerTrainer does): evaluation of a snapshot of the global
    weights in a worker thread while the next round trains (issue 17). The driver checks for it first
    (``isinstance(trainer, SnapshotEvaluator)``)."""

    def snapshot_for_eval(self, weights: Optional[torch.Tensor] = None) -> None:
        """Copy the model's weights (or ``weights``, a flat [P] fp32 vector) into the model kept for evaluation."""

    def evaluate_snapshot(self, max_batches: int = 8) -> float:
        """Held-out perplexity of the last snapshot (raises RuntimeError before any)."""


@runtime_checkable
class CheckHolder(Protocol):
    """What a :class:`Trainer` may also offer (InnerTrainer does): its turns with verified work's check passes
    (:class:`~geomesh_p2p.model.turns.Turns`), whose :meth:`~geomesh_p2p.model.turns.Turns.hold` keeps new passes
    out while the round's outer step and commit run (issue 27, session 45). The driver checks for it first
    (``isinstance(trainer, CheckHolder)``)."""

    turns: Turns


class Collective(Protocol):
    """The exchange (geomesh_p2p.exchange.CollectiveService)."""

    async def all_reduce(
        self,
        spec: CollectiveSpec,
        delta: torch.Tensor,
        tokens: int,
        compute_end: Optional[float] = None,
        *,
        in_place: bool = False,
    ) -> AllReduceResult:
        """Aggregate ``delta`` [P] fp32 with the plan's participants; returns an AllReduceResult. ``in_place``:
        the aggregate may be written into ``delta``'s storage (the caller no longer reads it as its update)."""


class GlobalStatePort(Protocol):
    """The global weights and outer-optimizer state this peer holds. Synchronous methods touch the whole
    model: the driver calls them through ``asyncio.to_thread``."""

    round: int
    digest: Optional[str]
    #: True while this peer downloads the swarm's state (its record then carries no digest); the driver
    #: sets it when the plan leaves this peer out
    syncing: bool

    @property
    def state_lock(self) -> Any:
        """Optional: a re-entrant lock held while the state changes in place (the driver holds it around the
        outer step and its commit, so a reader never sees a stepped buffer under the old digest). Read-only
        here, so a node's property satisfies it as well as a plain attribute."""

    def pseudo_gradient(self) -> torch.Tensor:
        """Global weights minus the model's weights after the inner steps: [P] fp32."""

    def reset_model(self) -> None:
        """Load the global weights back into the model (this round's inner steps are void)."""

    def outer_step(self, r: int, plan: RoundPlan, aggregate: torch.Tensor, idle=()) -> None:
        """Apply round ``r``'s outer step per part (non-finite parts and ``idle`` ranges keep their values)."""

    def commit(self, round: int) -> str:
        """Load the new global weights into the model, recompute the digest, publish the snapshot; returns it."""

    async def catch_up(self, target: Optional[tuple[int, str]] = None) -> None:
        """Download the state the swarm backs, or the state (round, digest) ``target`` and no other (a re-sync to a
        state the rules chose: a tie lost); raises StateSyncError when no donor delivers it."""

    async def checkpoint_or_warn(self) -> Any:
        """Write a checkpoint off the loop; failures are one warning (returns None then)."""


class EagerStatePort(Protocol):
    """What a :class:`GlobalStatePort` also offers for eager updates (``DriverConfig.eager``, docs/eager.md).
    Synchronous, whole-model: the driver calls them through ``asyncio.to_thread``."""

    def eager_start(self, delta: torch.Tensor, weight: float) -> torch.Tensor:
        """This peer's next start weights ``O(θ, v; weight·delta)`` on copies of the global weights and outer
        state (:func:`geomesh_p2p.model.optim.eager_start`): a new [P] fp32 CPU tensor; the state is not changed."""

    def load_model(self, flat: torch.Tensor) -> None:
        """Load ``flat`` ([P] fp32) into the model (the inner optimizer's state is untouched)."""

    def pseudo_gradient_from(self, start: torch.Tensor) -> torch.Tensor:
        """``start`` ([P] fp32) minus the model's weights after the inner steps: [P] fp32."""

    def global_weights(self) -> torch.Tensor:
        """The global weights θ, [P] fp32 CPU (a view: read it, never change it)."""

    def commit(self, round: int, load_model: bool = True) -> str:
        """:meth:`GlobalStatePort.commit`; ``load_model=False`` leaves the model as it is (speculative inner
        steps are training on it)."""


class RoundPolicy(Protocol):
    """The node's rules for planning and for what a round's outcome means (penalties, standing, EMAs)."""

    def make_plan(self, members: Sequence[PeerRecord], leader: str) -> RoundPlan:
        """This peer's plan of the round when it leads (raises :class:`PlanDeferred` when none can be made yet)."""

    def plan_problem(self, plan: RoundPlan, live: dict) -> Optional[str]:
        """Why this peer refuses ``plan`` (None: it follows it)."""

    def sampled_plan_problem(self, plan: RoundPlan, sampled: dict, sample: Sequence[str]) -> Optional[str]:
        """A light follower's :meth:`plan_problem`: ``sampled`` holds the records it read of ``sample`` only."""

    def records_needed(self, plan: RoundPlan) -> list[str]:
        """Participants whose records a light follower must read (and not only sample) to check ``plan``."""

    def leader_candidates(self, members: Sequence[PeerRecord], live: dict) -> tuple[list[PeerRecord], list[str]]:
        """(the members to plan, the PeerIDs that may lead)."""

    def may_lead_ids(self, records: Sequence[PeerRecord], peer_ids: Iterable[str]) -> Optional[list[str]]:
        """The ids among ``peer_ids`` that :meth:`leader_candidates` lets lead in this peer's view of ``records``
        (``()``: its own ledger), bars included, without the rules about this peer itself (what a light follower
        ranks itself among); None when its own ledger is too short to tell (the peer then takes the full path)."""

    def collective_spec(self, plan: RoundPlan) -> CollectiveSpec:
        """The collective's spec of ``plan`` (raises ValueError when it cannot be executed)."""

    def swarm_round(self, records: Sequence[PeerRecord]) -> Optional[int]:
        """The round the swarm's vote backs, None when none is backed."""

    def rejoin_state(
        self, records: Sequence[PeerRecord], among: Optional[Collection[str]] = None
    ) -> Optional[tuple[int, str]]:
        """The (round, digest), at this peer's round or an earlier one, that the live others' vote backs and more
        of them hold than hold this peer's state, when re-syncing to it now is the only way to rejoin them; None
        when there is none (a start-up gather asks: peers resumed at different rounds). ``among``: the PeerIDs
        whose states alone settle a vote with no majority (a resumed peer's checkpoint partners)."""

    def digest_voters(self, records: Sequence[PeerRecord]) -> list[PeerRecord]:
        """``records`` without those of peers this peer excludes: their digests neither confirm nor outvote its own."""

    def standing_established(self, records: Sequence[PeerRecord], peer_id: str) -> bool:
        """Whether ``peer_id`` is established in this peer's view (syncing peers on probation are not waited for)."""

    def standing_established_ids(
        self, records: Sequence[PeerRecord], peer_ids: Optional[Iterable[str]] = None
    ) -> frozenset[str]:
        """The ids among ``peer_ids`` (default: the ``records``' peers) established in this peer's view of
        ``records``, from one view for all of them (ask this, not :meth:`standing_established` per record)."""

    def after_exchange(self, spec: CollectiveSpec, plan: RoundPlan, ar: AllReduceResult) -> None:
        """Penalties for failed owners and no-shows."""

    def note_own_failures(
        self, spec: CollectiveSpec, plan: RoundPlan, ar: AllReduceResult, *, stalled: bool = False
    ) -> None:
        """This peer's own failures of round ``plan.round`` only (its parts that failed, itself as a no-show),
        penalised as the others penalise it: ``stalled`` says this peer was not running through the
        exchange window, so the others' failures are not held against them."""

    def forget_marks_since(self, round: int) -> list[str]:
        """Drop the penalty marks this peer noted, and the standing credits it gave, in rounds ``round`` and later
        (a lineage the swarm did not confirm, abandoned by a re-sync); returns the PeerIDs whose marks were
        dropped."""

    async def before_outer_step(self, r: int, plan: RoundPlan, assignment: PeerAssignment, ar: AllReduceResult) -> None:
        """Verified work keeps round ``r``'s start weights (never raises)."""

    def after_outer_step(
        self, r: int, plan: RoundPlan, assignment: PeerAssignment, result: InnerResult, ar: AllReduceResult
    ) -> None:
        """Re-profiling (EMAs), delivered rates, standing credits."""

    def planned_out(self, r: int, plan: RoundPlan) -> None:
        """This peer sits round ``r`` out (planned out or refusing ``plan``): what must go on regardless (accountable
        mode's read of the proofs; never raises)."""

    def note_sat_out(self, plan: RoundPlan) -> None:
        """This peer sat out ``plan``, which names it, and the state it re-synced to differs from the plan's start
        (the round aggregated a token): the others marked it, and it takes on the same marks."""

    def publish_record(self, record: RoundRecord) -> None:
        """The round's row to the log, Prometheus and the status page."""
