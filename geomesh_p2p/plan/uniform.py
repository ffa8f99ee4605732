"""The uniform plan, the DiLoCo baseline: :func:`plan_uniform`.

The uniform plan gives every peer the same micro-batch
``min(target_batch, min_i max_batch_i)``, the same batch and the same ``H = uniform_inner_steps``;
``T`` is set by the slowest peer, so faster peers idle for the difference. Its partition is equal
parts among the peers that accept connections.
"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

import numpy as np

from geomesh_p2p.plan.assign import PlanMeta, build_plan, probation_ids
from geomesh_p2p.plan.bounds import bound_records, check_records
from geomesh_p2p.plan.cost import PeerModel, peer_uniform_micro, uniform_micro
from geomesh_p2p.plan.schema import PlanConfig, RoundPlan
from geomesh_p2p.schema.peer import PeerRecord


def plan_uniform(
    records: Sequence[PeerRecord],
    cfg: PlanConfig,
    *,
    run_id: str,
    round: int,
    leader: str,
    numel: int,
    start_time: float,
    start_digest: Optional[str] = None,
    created_at: Optional[float] = None,
    inner_steps: Optional[int] = None,
    probation: Collection[str] = (),
    share_among: Optional[int] = None,
) -> RoundPlan:
    """Plan a round the DiLoCo way: the same batch and inner steps for every peer.

    Micro-batch ``m = min(target_batch, min_i max_batch_i // ranks_i)`` per device (fits everyone; a
    K-rank peer trains ``K m`` rows per pass, its ranks' sum), batch
    ``m * ceil(target_batch / m)``, ``H = inner_steps`` (default ``cfg.uniform_inner_steps``) for
    all; the window is set by the slowest peer, ``T = max_i (H s_i + c_i)``, so faster peers idle
    ``T - H s_i - c_i``. Parts are equal among the peers that accept connections. Claims are
    bounded as in :func:`plan_round` (:func:`bound_records`). Same arguments, determinism and
    errors as :func:`plan_round`.
    """
    recs = bound_records(check_records(records))
    H_all = cfg.uniform_inner_steps if inner_steps is None else int(inner_steps)
    if H_all < 1:
        raise ValueError(f"inner_steps={H_all} must be >= 1")
    micro = uniform_micro(recs, cfg)
    models = [PeerModel(r, cfg, peer_uniform_micro(micro, r)) for r in recs]
    H = np.full(len(models), H_all, dtype=np.int64)
    T = max(H_all * m.step_s + m.comm_s for m in models)
    probation = probation_ids(recs, probation)
    meta = PlanMeta(run_id, round, leader, numel, start_time, start_digest, created_at, share_among)
    return build_plan(recs, models, H, T, cfg, meta, probation, equal=True)
