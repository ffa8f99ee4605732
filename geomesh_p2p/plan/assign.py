"""From per-peer steps to a :class:`~geomesh_p2p.plan.schema.RoundPlan`: the partition of the flat
vector among the peers that accept connections (:func:`partition`, sized by
:func:`geomesh_p2p.schema.partition.part_sizes`; probation peers own nothing) and the assignments
(:func:`build_plan`), shared by the AWB and the uniform planner.
"""

from __future__ import annotations

import math
from typing import Collection, NamedTuple, Optional, Sequence, cast

import numpy as np

from geomesh_p2p.config import method as _method
from geomesh_p2p.plan.cost import PeerModel
from geomesh_p2p.plan.schema import Mode, PeerAssignment, PlanConfig, RoundPlan
from geomesh_p2p.schema.partition import part_sizes
from geomesh_p2p.schema.peer import PeerRecord


def partition(
    numel: int,
    owners: Sequence[PeerRecord],
    *,
    align: int = 1,
    min_size: int = 0,
    equal: bool = False,
    share_among: Optional[int] = None,
) -> list[tuple[str, int, int]]:
    """Split ``[0, numel)`` into contiguous parts, one per peer, in peer_id order, by :func:`part_sizes`.

    Peers that accept connections get parts sized by their bandwidth (``min(upload_bps,
    download_bps)``, bytes/s); client-only peers (``address is None``) get an empty part.
    ``equal=True`` splits equally among the owners instead (the uniform baseline). Returns
    ``[(peer_id, start, end)]`` for every peer given, sorted by peer_id; the non-empty parts tile
    ``[0, numel)`` exactly. ``share_among``: as :func:`part_sizes` (no part over a fair share among that many).

    Raises ValueError for ``numel < 0``, no peers, duplicate peer ids, a non-positive bandwidth, or
    no peer that accepts connections (someone must own the parts).
    """
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    if not owners:
        raise ValueError("no peers to partition among")
    recs = sorted(owners, key=lambda r: r.peer_id)
    ids = [r.peer_id for r in recs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate peer_id in partition input")
    for r in recs:
        for field in ("upload_bps", "download_bps"):
            v = getattr(r, field)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"peer {r.peer_id}: {field}={v} must be a positive finite bandwidth (bytes/s)")
    bw = [0.0 if r.client_only else float(min(r.upload_bps, r.download_bps)) for r in recs]
    sizes = part_sizes(numel, bw, align=align, min_size=min_size, equal=equal, share_among=share_among)
    out, pos = [], 0
    for r, size in zip(recs, sizes):
        out.append((r.peer_id, pos, pos + size))
        pos += size
    assert pos == numel
    return out


class PlanMeta(NamedTuple):
    """What a plan states besides its assignments: the arguments of :func:`plan_round` (same names)."""

    run_id: str
    round: int
    leader: str
    numel: int
    start_time: float
    start_digest: Optional[str]
    created_at: Optional[float]
    share_among: Optional[int] = None


def build_plan(
    recs: list[PeerRecord],
    models: list[PeerModel],
    H: np.ndarray,
    T: float,
    cfg: PlanConfig,
    meta: PlanMeta,
    probation: Collection[str],
    *,
    equal: bool,
) -> RoundPlan:
    """The RoundPlan of peers ``recs`` (their ``models`` and inner steps ``H``, window ``T`` seconds):
    ``[0, numel)`` partitioned among the established peers that accept connections (``equal``: in
    equal parts, else by bandwidth; none over a fair share among ``meta.share_among``: :func:`partition`), the
    probation peers made client-only (:func:`owners_only`)."""
    parts = partition(
        meta.numel, owners_only(recs, probation), align=cfg.part_align, equal=equal, share_among=meta.share_among
    )
    assignments = []
    for m, h, (pid, start, end) in zip(models, H.tolist(), parts):
        assert pid == m.peer_id
        compute = h * m.step_s
        assignments.append(
            PeerAssignment(
                peer_id=pid,
                address=m.address,
                batch_size=m.batch,
                micro_batch=m.micro,
                accum_steps=m.accum,
                inner_steps=int(h),
                token_budget=int(h) * m.batch * cfg.seq_len,
                part_start=start,
                part_end=end,
                predicted_compute_s=compute,
                predicted_comm_s=m.comm_s,
                predicted_idle_s=max(0.0, T - compute - m.comm_s),
                probation=pid in probation,
            )
        )
    train_deadline = meta.start_time + T
    return RoundPlan(
        run_id=meta.run_id,
        round=meta.round,
        leader=meta.leader,
        method=cfg.method,
        mode=cast(Mode, _method.round_mode(cfg.mode, len(assignments), cfg.method)),
        numel=meta.numel,
        seq_len=cfg.seq_len,
        window_s=T,
        train_deadline=train_deadline,
        exchange_deadline=train_deadline + cfg.exchange_timeout_s,
        start_digest=meta.start_digest,
        created_at=meta.start_time if meta.created_at is None else meta.created_at,
        assignments=assignments,
    )


def probation_ids(recs: Sequence[PeerRecord], probation: Collection[str]) -> frozenset:
    """The probation peers among ``recs``; empty when that would leave no established peer (then the
    marking means nothing: geomesh_p2p.trust.probation, 'nobody established')."""
    ids = frozenset(r.peer_id for r in recs if r.peer_id in set(probation))
    return ids if len(ids) < len(recs) else frozenset()


def owners_only(recs: Sequence[PeerRecord], probation: Collection[str]) -> list[PeerRecord]:
    """``recs`` with the probation peers made client-only: they own no part (:func:`partition` raises
    ValueError when no established peer accepts connections)."""
    return [r.model_copy(update={"address": None}) if r.peer_id in probation else r for r in recs]
