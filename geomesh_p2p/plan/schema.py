"""The round plan's schema: :class:`PlanConfig` (what the leader plans with besides the records),
:class:`RoundPlan` and its :class:`PeerAssignment` s (the signed plan stored under ``<run>/plan/<r>``,
JSON on the wire), and :func:`format_plan_table` to print one. Pydantic, versioned
(``PLAN_SCHEMA_VERSION``).
"""

from __future__ import annotations

from typing import Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from geomesh_p2p.schema.compat import WIRE_MODEL

PLAN_SCHEMA_VERSION = 1


def max_accused(n_participants: int) -> int:
    """The most peers a plan of ``n_participants`` may name in :attr:`RoundPlan.accused`: one (red team 47: round r's
    leader order is public before round r - 1 is planned, so a rogue leader names exactly the honest peers ranked
    before its best colluder; with k names a colluder among the first k + 1 of round r's order leads it, so k is kept
    at 1: the colluder's rate at most doubles, docs/security.md "Red team 47"). The leader names the participant with
    the most distinct accusers (ties by PeerID). A plan of one participant names none (only its leader takes part).
    ``n_participants`` is kept for the callers and the wire rule's shape (a bound per plan size)."""
    del n_participants
    return 1


Method = Literal["geomesh", "awb", "diloco", "css", "ddp"]


Mode = Literal["relay", "reencode", "accountable"]  # a round's (the plan's)
RunMode = Literal["relay", "reencode", "accountable", "auto"]  # a run's (config.method.MODES)


class ContentRefusal(str):
    """A reason to refuse a plan that follows from the plan and the run config alone (its model size, settings,
    accumulation steps, inner-step range), not from the follower's view of the swarm: every honest follower
    gives it, so none follows that plan and bypassing it (following the next leader's) cannot split the round.
    :func:`geomesh_p2p.plan.agree.obtain_plan` treats such a plan as absent; a refusal that depends on the view
    (records, standing, penalties) blocks instead (issue 25, "No fork under overload")."""


class PlanConfig(BaseModel):
    """What the leader needs besides the peers' records to plan a round (shared by the run).

    Units: sequences for batches, tokens, seconds, bytes. Raises ``pydantic.ValidationError`` (a
    ``ValueError``) on out-of-range values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: int = Field(ge=1, description="tokens per sequence")
    target_batch: int = Field(
        ge=1, description="desired sequences per inner step (a floor; micro-batched when it does not fit)"
    )
    target_tokens_per_round: Optional[int] = Field(
        default=None, ge=1, description="tokens the whole group should train per round; None: derive from the window"
    )
    window_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="sync window T, seconds; None: from target_inner_steps when set (geomesh_p2p.plan.awb."
        "auto_window), else T such that comm is comm_share of it",
    )
    target_inner_steps: Optional[int] = Field(
        default=None,
        ge=1,
        description="with window_s None: the inner steps the median peer's window holds (RunConfig's "
        "--window-s auto); None: the comm_share window",
    )
    comm_share: float = Field(default=0.1, gt=0, le=1, description="target fraction of the window spent communicating")
    min_inner_steps: int = Field(default=1, ge=1)
    max_inner_steps: int = Field(default=500, ge=1)
    payload_bytes: int = Field(
        ge=0, description="bytes one peer sends and (again) receives per round in the collective"
    )
    latency_s: float = Field(default=0.05, ge=0, description="one request's latency, seconds (paid once per phase)")
    exchange_timeout_s: float = Field(
        default=30.0, gt=0, description="seconds after the training deadline by which the collective must finish"
    )
    mode: RunMode = Field(
        default="reencode",
        description="the run's exchange mode; auto: each plan's mode from its participant count "
        "(geomesh_p2p.config.method.round_mode)",
    )
    method: Method = "geomesh"
    uniform_inner_steps: int = Field(default=20, ge=1, description="H for the uniform (DiLoCo) plan")
    max_window_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="longest window T, seconds (followers refuse deadlines past their horizon); None: no cap",
    )
    window_slack: float = Field(
        default=0.05, ge=0, le=0.5, description="relative room the AWB planner has to move T to cut straggler idle"
    )
    part_align: int = Field(default=1, ge=1, description="partition parts are multiples of this many elements")

    @model_validator(mode="after")
    def _steps_range(self) -> "PlanConfig":
        if self.max_inner_steps < self.min_inner_steps:
            raise ValueError(f"max_inner_steps={self.max_inner_steps} is below min_inner_steps={self.min_inner_steps}")
        return self


class PeerAssignment(BaseModel):
    """One peer's share of a round. Units: sequences, tokens, elements, seconds.

    ``batch_size`` sequences per inner (optimizer) step, run as ``accum_steps`` forward/backward
    passes of ``micro_batch`` sequences; ``token_budget = batch_size * seq_len * inner_steps``.
    ``[part_start, part_end)`` is the slice of the flat parameter vector this peer owns in the
    collective (empty for client-only peers). ``predicted_*`` are the planner's expectations.
    """

    model_config = WIRE_MODEL  # a column of a newer patch is ignored, not refused (docs/compat.md)

    peer_id: str = Field(min_length=1)
    address: Optional[str] = Field(default=None, description="host:port as the leader saw it; None = client-only")
    batch_size: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    accum_steps: int = Field(ge=1)
    inner_steps: int = Field(ge=0)
    token_budget: int = Field(ge=0)
    part_start: int = Field(ge=0)
    part_end: int = Field(ge=0)
    predicted_compute_s: float = Field(ge=0)
    predicted_comm_s: float = Field(ge=0)
    predicted_idle_s: float = Field(ge=0)
    probation: bool = Field(
        default=False,
        description="a new identity (geomesh_p2p.trust.probation): owns no part, bounded budget, "
        "not counted in the part quorum",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "PeerAssignment":
        if self.micro_batch * self.accum_steps != self.batch_size:
            raise ValueError(
                f"peer {self.peer_id}: batch_size={self.batch_size} != micro_batch={self.micro_batch}"
                f" * accum_steps={self.accum_steps}"
            )
        if self.part_end < self.part_start:
            raise ValueError(f"peer {self.peer_id}: part_end={self.part_end} < part_start={self.part_start}")
        if self.probation and self.part_end > self.part_start:
            raise ValueError(f"peer {self.peer_id} is on probation and owns a part")
        return self

    @property
    def owns_part(self) -> bool:
        return self.part_end > self.part_start


class RoundPlan(BaseModel):
    """The leader's plan for one round, stored (signed) under ``<run>/plan/<r>``. JSON on the wire.

    Times are unix seconds (``train_deadline``: hard stop for inner steps, ``= start + window_s``;
    each peer is planned to stop ``predicted_comm_s`` earlier; ``exchange_deadline``: the collective
    must be over). ``numel``: elements of the flat parameter vector; the owners' parts tile
    ``[0, numel)``. ``from_bytes`` raises ``pydantic.ValidationError`` on malformed or inconsistent
    input (unsorted or duplicate peers, budgets that do not match, parts that overlap or leave gaps).
    """

    # A field of a newer patch release is ignored, not refused (docs/compat.md): the plan is signed over the
    # bytes as stored (its head, and its chunks by SHA-256), never over a re-serialization of the parsed fields.
    model_config = WIRE_MODEL

    schema_version: int = PLAN_SCHEMA_VERSION
    run_id: str
    round: int = Field(ge=0)
    leader: str
    method: Method
    mode: Mode
    numel: int = Field(ge=0)
    seq_len: int = Field(ge=1)
    window_s: float = Field(gt=0)
    train_deadline: float
    exchange_deadline: float
    start_digest: Optional[str] = None
    created_at: float
    assignments: list[PeerAssignment] = Field(min_length=1)
    # Exact undo (issue 26, RunConfig.undo_forged, docs/collective.md "State and repair"): (round, part) of
    # forged parts proven in the DHT that this round's outer step takes out of the state. Left out of the JSON
    # while empty (peers of the releases before the compatibility policy refuse unknown fields); a run that
    # uses it has ``undo_forged`` set, a patch field, so older peers refuse its config hash (docs/compat.md).
    undo: list[tuple[int, int]] = Field(default_factory=list, max_length=16)
    # Participants against which the leader held published verified-work evidence it had not settled yet when it
    # planned (issue 28, session 47): they lead nothing in the next round (round.planning.next_leaders), a function
    # of this plan alone, the same at every peer that obtained it. Sorted, no duplicates, never the leader, at most
    # max_accused (one); left out of the JSON while empty (0.15.0, docs/compat.md).
    accused: list[str] = Field(default_factory=list)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {v} is not the supported {PLAN_SCHEMA_VERSION}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RoundPlan":
        ids = [a.peer_id for a in self.assignments]
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError("assignments must be sorted by peer_id without duplicates")
        if self.exchange_deadline < self.train_deadline:
            raise ValueError(
                f"exchange_deadline={self.exchange_deadline} is before train_deadline={self.train_deadline}"
            )
        for a in self.assignments:
            if a.token_budget != a.batch_size * self.seq_len * a.inner_steps:
                raise ValueError(
                    f"peer {a.peer_id}: token_budget={a.token_budget} != batch_size*seq_len*inner_steps"
                    f" = {a.batch_size * self.seq_len * a.inner_steps}"
                )
            if a.part_end > self.numel:
                raise ValueError(f"peer {a.peer_id}: part_end={a.part_end} beyond numel={self.numel}")
        pos = 0
        for pid, start, end in sorted(self.owners(), key=lambda o: o[1]):
            if start != pos:
                raise ValueError(f"peer {pid}: part starts at {start}, expected {pos} (gap or overlap)")
            pos = end
        if pos != self.numel:
            raise ValueError(f"parts cover [0, {pos}) but numel={self.numel}")
        if self.accused:
            if any(a >= b for a, b in zip(self.accused, self.accused[1:])):
                raise ValueError("accused must be sorted without duplicates")
            if self.leader in self.accused or not set(self.accused) <= set(ids):
                raise ValueError("accused must be participants other than the leader")
            if len(self.accused) > max_accused(len(ids)):
                raise ValueError(f"{len(self.accused)} accused, over {max_accused(len(ids))} for {len(ids)} peers")
        return self

    # helpers -------------------------------------------------------------------------------
    def participants(self) -> list[str]:
        """PeerIDs in the round, sorted."""
        return [a.peer_id for a in self.assignments]

    def assignment(self, peer_id: str) -> PeerAssignment:
        """This peer's assignment; raises KeyError when it is not in the plan."""
        for a in self.assignments:
            if a.peer_id == peer_id:
                return a
        raise KeyError(f"peer {peer_id} is not in the plan for round {self.round}")

    def owners(self) -> list[tuple[str, int, int]]:
        """(peer_id, start, end) of every peer owning a non-empty part, in peer_id (= start) order."""
        return [(a.peer_id, a.part_start, a.part_end) for a in self.assignments if a.owns_part]

    def probation(self) -> list[str]:
        """PeerIDs the plan marks as on probation (geomesh_p2p.trust.probation), sorted."""
        return [a.peer_id for a in self.assignments if a.probation]

    def established(self) -> list[str]:
        """PeerIDs the plan counts as established (the part quorum's basis), sorted."""
        return [a.peer_id for a in self.assignments if not a.probation]

    def predicted_straggler_idle(self) -> dict[str, float]:
        """peer_id -> predicted idle time at the barrier as a fraction of the window (0..1)."""
        return {a.peer_id: a.predicted_idle_s / self.window_s for a in self.assignments}

    def total_token_budget(self) -> int:
        """Tokens the whole group is planned to train this round."""
        return sum(a.token_budget for a in self.assignments)

    def to_bytes(self) -> bytes:
        """JSON bytes (deterministic for equal plans)."""
        empty = {k for k in ("undo", "accused") if not getattr(self, k)}  # absent while empty: the bytes as before
        return self.model_dump_json(exclude=empty or None).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RoundPlan":
        """Parse JSON bytes; raises pydantic.ValidationError on anything malformed."""
        return cls.model_validate_json(data)


def format_plan_table(plan: RoundPlan, names: Optional[Mapping[str, str]] = None) -> str:
    """A plain-text table of a plan (one row per peer) for logs, the CLI and ``pytest -s``.

    ``names`` optionally maps peer_id to a label (e.g. the GPU name) shown instead of the id.
    """
    names = names or {}
    head = (
        f"round {plan.round} method={plan.method} mode={plan.mode} window={plan.window_s:.3f}s"
        f" tokens={plan.total_token_budget()}"
    )
    cols = ["peer", "batch", "micro", "accum", "H", "tokens", "compute_s", "comm_s", "idle_s", "idle%", "part"]
    rows = []
    idle = plan.predicted_straggler_idle()
    for a in plan.assignments:
        rows.append(
            [
                names.get(a.peer_id, a.peer_id[:12]),
                str(a.batch_size),
                str(a.micro_batch),
                str(a.accum_steps),
                str(a.inner_steps),
                str(a.token_budget),
                f"{a.predicted_compute_s:.3f}",
                f"{a.predicted_comm_s:.3f}",
                f"{a.predicted_idle_s:.3f}",
                f"{100 * idle[a.peer_id]:.2f}",
                f"[{a.part_start},{a.part_end})" if a.owns_part else "-",
            ]
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    lines = [head, fmt.format(*cols)] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)
