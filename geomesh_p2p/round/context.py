"""What the round driver's phases share: its configuration (:class:`DriverConfig`), where it is
(:class:`Phase`), what one round carries from phase to phase (:class:`RoundContext`), the rounds it applied
(:class:`LineageEntry`), the next round's speculative steps (:class:`Speculative`), why a run ended early
(:class:`SwarmEnded`) and the zero contribution of a round without usable work (:func:`no_work`)."""

from __future__ import annotations

import asyncio
import enum
import threading
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional

import torch

from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.model.training import InnerResult
from geomesh_p2p.plan.schema import PeerAssignment, RoundPlan
from geomesh_p2p.schema.peer import PeerRecord

if TYPE_CHECKING:  # the real types; the exchange loads grpc: not loaded at run time here
    from geomesh_p2p.exchange.client import AllReduceResult
    from geomesh_p2p.exchange.partition import CollectiveSpec
    from geomesh_p2p.model.training import StepTarget

__all__ = ["Phase", "SwarmEnded", "DriverConfig", "no_work", "RoundContext", "LineageEntry", "Speculative"]


class Phase(enum.Enum):
    """Where the driver is."""

    IDLE = "idle"
    GATHER = "gather"
    PLAN = "plan"
    TRAIN = "train"
    EXCHANGE = "exchange"
    FINISH = "finish"
    RESYNC = "resync"
    DONE = "done"


@dataclass(frozen=True)
class SwarmEnded:
    """Why :meth:`RoundDriver.run` ended before ``rounds`` / ``target_ppl`` (the node then does not log
    "done" as if healthy; docs/round.md, "A stalled peer and a swarm that ended").

    Attributes:
        round: the round of the state this peer holds at the end.
        swarm_round: the latest round the swarm's records (leaving peers included) show.
        synced: this peer's state is the swarm's last state (same round and digest as the swarm's vote or
            the majority of the records at that round); False: it holds a state the swarm never had or an
            older one it could not catch up from.
        why: one sentence for the log.
        cause: why, in one word (the ``swarm_ended`` event's ``cause``): ``"others_left"`` (every other
            peer announced leaving), ``"alone"`` (after its first round no other peer was live for
            ``wait_peers_s``), ``"digest_differs"`` (its last state is not the one the others hold),
            ``"finished_without"`` (a round it was planned out of ran, and its participants left before this peer
            got their state: ``resync.hold_finished_round``), ``"tie_lost"`` (resumed, it lost a tie with peers live on
            another state and did not re-sync to it: ``round.tie``).
    """

    round: int
    swarm_round: int
    synced: bool
    why: str
    cause: str = ""


def _node_default(name: str) -> Any:
    """NodeConfig's default of field ``name`` (KeyError when NodeConfig has no such field)."""
    return NodeConfig.model_fields[name].default


@dataclass
class DriverConfig:
    """The driver's knobs (seconds). ``min_peers`` peers are waited for before the first round; after it,
    ``min(min_peers, 2)``: a peer never trains alone when ``min_peers`` >= 2 (a swarm that lost one of its N
    peers goes on without stalling every round). Short of it a peer waits up to ``wait_peers_s`` (one INFO
    line "waiting for N peers, M live") and ends (:class:`SwarmEnded`) when every other peer left. Rounds
    with enough peers gather for ``gather_wait_s`` after the first."""

    # The node's knobs take their defaults from NodeConfig's fields (one definition each, issue 15);
    # :meth:`from_node` copies them from a node's config.
    min_peers: int = _node_default("min_peers")
    wait_peers_s: float = _node_default("wait_peers_s")
    gather_wait_s: float = _node_default("gather_wait_s")
    sync_wait_cap_s: float = _node_default("sync_wait_cap_s")  # longest gather wait for a syncing peer
    hold_leaving_s: float = _node_default("hold_leaving_s")  # resync.hold_finished_round, once all left
    plan_timeout_s: float = _node_default("plan_timeout_s")
    full_view_peers: int = _node_default("full_view_peers")  # light followers: docs/round.md "Light followers"
    light_sample: int = _node_default("light_sample")
    #: the run's ``record_shards`` (RunConfig): a light follower samples the participants of one shard at a time
    record_shards: int = 1
    digest_wait_s: float = 2.0
    rounds: Optional[int] = _node_default("rounds")
    target_ppl: Optional[float] = _node_default("target_ppl")
    eval_every: Optional[int] = _node_default("eval_every")  # None: auto (round/eval_schedule.py)
    eval_batches: int = _node_default("eval_batches")
    #: evaluate in a worker thread on a copy of the global weights while the next round trains (issue 17);
    #: the result goes into the next row (``eval_round`` says which round's weights it measured), the last
    #: round is evaluated at once. Needs a trainer with ``snapshot_for_eval`` / ``evaluate_snapshot``.
    eval_background: bool = _node_default("eval_background")
    checkpoint_every: int = _node_default("checkpoint_every")
    checkpointing: bool = False
    exchanges_gradient: bool = False  # ddp (MethodRule.exchanges_gradient): one batch's gradient, no pseudo-gradient
    #: MethodRule.push_encoding of the run ("sign" for the sign-compressed methods): whether a round has a token
    #: floor (round.rules.spec.screen_token_floor), whose steps may run past the train deadline (round.steps)
    push_encoding: str = ""
    #: eager updates (RunConfig.eager, docs/eager.md): a round's exchange runs in the background while the next
    #: round's inner steps run from this peer's own start ``O(θ, v; w Δ)``; needs an :class:`EagerStatePort`
    eager: bool = False
    backoff_first_s: float = 0.05
    backoff_cap_s: float = 1.0
    live_refresh_s: float = 1.0  # refresh of the live view while plans are read (backoff cap)

    @classmethod
    def from_node(cls, node_cfg: NodeConfig, **overrides: Any) -> "DriverConfig":
        """The driver's knobs of a node: every field that NodeConfig also has, copied from ``node_cfg``,
        then ``overrides`` (fields the node derives, e.g. ``checkpointing``)."""
        shared = {f.name: getattr(node_cfg, f.name) for f in fields(cls) if f.name in NodeConfig.model_fields}
        return cls(**{**shared, **overrides})


def no_work(compute_s: float) -> InnerResult:
    """The InnerResult of a round in which this peer trained nothing usable (0 tokens: the collective
    gives its contribution no weight)."""
    return InnerResult(
        steps_done=0,
        tokens=0,
        mean_loss=float("nan"),
        last_loss=float("nan"),
        compute_s=max(0.0, compute_s),
        stopped_early=True,
    )


@dataclass
class RoundContext:
    """What one round carries from phase to phase. Times are wall-clock seconds, bytes are totals."""

    round: int
    t_round: float
    members: list[PeerRecord] = field(default_factory=list)
    live: dict[str, PeerRecord] = field(default_factory=dict)
    plan: Optional[RoundPlan] = None
    assignment: Optional[PeerAssignment] = None
    result: Optional[InnerResult] = None
    delta: Optional[torch.Tensor] = None
    spec: Optional[CollectiveSpec] = None
    ar: Optional[AllReduceResult] = None
    t_compute_end: float = 0.0
    t_agg: float = 0.0
    sent0: int = 0
    recv0: int = 0
    #: inner steps started on the provisional plan during the plan's settle (issue 17), with that plan and
    #: the flag that stops them when the plan finally followed is another
    early: Optional[asyncio.Future] = None
    early_plan: Optional[RoundPlan] = None
    early_abort: Optional[threading.Event] = None
    #: monotonic start of the round (its wall start is ``t_round``): the wall-vs-monotonic gap over the
    #: round tells a host that slept; and the worst loop stall (seconds) taken when the exchange returned
    m_round: float = 0.0
    stall_s: Optional[float] = None
    #: a light follower's round (issue 25, :mod:`geomesh_p2p.round.light`): no gather, the plan and the digest
    #: checked against a sample of records
    light: bool = False
    #: eager updates: this round's own start weights ([P] fp32) when it is not the global weights, and how its
    #: inner steps began: "adopted" (the speculative steps, kept), "restarted" (from the own start, with the
    #: plan's assignment), "global" (from the global weights: no eager start, e.g. the first round). ``start``
    #: is released (None) once the round's update is computed from it.
    start: Optional[torch.Tensor] = None
    eager_steps: str = "global"

    def planned(self) -> RoundPlan:
        """The round's plan, set by the PLAN phase.

        Raises:
            RuntimeError: no plan yet (a later phase called before ``agree`` returned True: a driver bug).
        """
        if self.plan is None:
            raise RuntimeError(f"round {self.round}: no plan yet (a phase ran before the PLAN phase agreed one)")
        return self.plan

    def update(self) -> torch.Tensor:
        """This peer's update of the round ([P] fp32: pseudo-gradient, or the ddp baseline's gradient), set by
        the TRAIN phase.

        Raises:
            RuntimeError: no update yet (the EXCHANGE phase called before ``train`` returned True: a driver bug).
        """
        if self.delta is None:
            raise RuntimeError(f"round {self.round}: no update yet (the exchange ran before the TRAIN phase)")
        return self.delta

    def assigned(self) -> PeerAssignment:
        """This peer's assignment in the round's plan, set by the TRAIN phase.

        Raises:
            RuntimeError: no assignment yet (a phase after TRAIN called before it: a driver bug).
        """
        if self.assignment is None:
            raise RuntimeError(f"round {self.round}: no assignment yet (a phase ran before the TRAIN phase)")
        return self.assignment

    def trained(self) -> InnerResult:
        """The InnerResult of this peer's inner steps (steps_done, tokens, mean_loss, compute_s), set by the
        TRAIN phase.

        Raises:
            RuntimeError: no result yet (a phase after TRAIN called before it: a driver bug).
        """
        if self.result is None:
            raise RuntimeError(f"round {self.round}: no training result yet (a phase ran before the TRAIN phase)")
        return self.result

    def collective(self) -> CollectiveSpec:
        """The collective's spec of the round's plan, set by the TRAIN phase.

        Raises:
            RuntimeError: no spec yet (the EXCHANGE phase called before ``train`` returned True: a driver bug).
        """
        if self.spec is None:
            raise RuntimeError(f"round {self.round}: no collective spec yet (the exchange ran before the TRAIN phase)")
        return self.spec

    def exchanged(self) -> AllReduceResult:
        """The exchange's AllReduceResult (aggregate [P] fp32, contributors, missing parts), set by the
        EXCHANGE phase.

        Raises:
            RuntimeError: no result yet (the FINISH phase called before ``exchange`` returned True: a driver bug).
        """
        if self.ar is None:
            raise RuntimeError(f"round {self.round}: no exchange result yet (FINISH ran before the EXCHANGE phase)")
        return self.ar


@dataclass(frozen=True)
class LineageEntry:
    """One round this peer applied (issue 14 #11): the state it made and who made it.

    Attributes:
        round: the round ``r``.
        digest: digest of the state after it (round ``r + 1``'s start state).
        participants: PeerIDs of the round's plan.
        tokens: tokens aggregated in the round, all contributors together (each counted once: its
            largest claim over the parts).
        own_tokens: tokens this peer trained in it.
    """

    round: int
    digest: str
    participants: frozenset[str]
    tokens: int
    own_tokens: int


@dataclass
class Speculative:
    """Eager updates (docs/eager.md): round ``round``'s inner steps, started before its plan exists from this
    peer's own start ``start`` = ``O(θ^{r-1}, v^{r-1}; weight·Δ_m^{r-1})`` with the assignment of the round
    before; ``target`` (a :class:`~geomesh_p2p.model.training.StepTarget`) takes the plan's inner steps and train
    deadline once it is agreed. Times are swarm (wall) seconds."""

    round: int
    start: torch.Tensor
    batch_size: int
    micro_batch: Optional[int]
    target: StepTarget
    abort: threading.Event
    weight: float
    t_start: float
    task: Optional[asyncio.Future] = None
    t_end: Optional[float] = None  # when the steps ended (None: still running)
