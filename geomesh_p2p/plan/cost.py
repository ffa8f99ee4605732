"""The planner's per-peer time model: throughput at a batch size, the micro-batch, the step and
communication times of a peer (:class:`PeerModel`) and its inner steps in a window (units: sequences,
tokens, seconds, bytes, bytes/s). The formulas are in :mod:`geomesh_p2p.plan.awb`'s docstring.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from geomesh_p2p.plan.schema import PlanConfig
from geomesh_p2p.schema.peer import PeerRecord

_STEP_EPS = 1e-9  # relative slack so that T = c + k*s computed in floats still yields k steps


def interpolate_tokens_per_s(tokens_per_s: Mapping[int, float], batch: int) -> float:
    """Training throughput (tokens/s) at ``batch`` sequences from measured ``{batch: tokens/s}``.

    The step time per batch is modelled as affine in the batch size (a fixed cost plus a cost per
    sequence), so it is interpolated linearly between the nearest measured batch sizes. Below the
    smallest measured batch the step time is taken as that batch's (pessimistic: throughput scales
    down with the batch); above the largest, throughput is taken as saturated (step time grows in
    proportion). Raises ValueError when nothing is measured or ``batch < 1``.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    if not tokens_per_s:
        raise ValueError("tokens_per_s is empty: no measured throughput")
    if batch in tokens_per_s:
        return float(tokens_per_s[batch])
    sizes = sorted(tokens_per_s)
    # u(b) = seconds per step per token of sequence length = b / tps(b)
    if batch < sizes[0]:
        return float(tokens_per_s[sizes[0]]) * batch / sizes[0]
    if batch > sizes[-1]:
        return float(tokens_per_s[sizes[-1]])
    hi = next(b for b in sizes if b > batch)
    lo = max(b for b in sizes if b < batch)
    u_lo, u_hi = lo / tokens_per_s[lo], hi / tokens_per_s[hi]
    u = u_lo + (u_hi - u_lo) * (batch - lo) / (hi - lo)
    return batch / u


def best_micro_batch(record: PeerRecord) -> int:
    """The measured batch size with the highest tokens/s that fits ``max_batch`` (ties: larger).

    With no measured batch that fits, ``max_batch`` itself (its throughput is interpolated).
    """
    fits = {b: v for b, v in record.tokens_per_s.items() if b <= record.max_batch}
    if not fits:
        return record.max_batch
    return max(fits, key=lambda b: (fits[b], b))


def ranks_of(record: PeerRecord) -> int:
    """The local devices a peer trains on as one (``record.ranks``, issue 30; 1 for older records)."""
    return max(1, int(getattr(record, "ranks", 1) or 1))


def rank_micro(micro: int, record: PeerRecord) -> int:
    """``micro`` fitted to a multi-rank peer (``record.ranks`` K > 1, issue 30): rounded down to a multiple of
    K, at least K, so the peer's batch splits evenly over its ranks; unchanged for K = 1, or when K rows do
    not fit the record's ``max_batch`` (then the ranks split it unevenly: geomesh_p2p.model.ranks.split_rows)."""
    k = ranks_of(record)
    if k <= 1 or micro % k == 0:
        return micro
    fitted = max(k, micro - micro % k)
    return fitted if fitted <= record.max_batch else micro


def uniform_micro(records: Sequence[PeerRecord], cfg: PlanConfig) -> int:
    """The micro-batch per device of a uniform plan: ``min(target_batch, min_i max_batch_i // ranks_i)`` (what
    fits every device), at least 1."""
    return max(1, min(cfg.target_batch, min(r.max_batch // ranks_of(r) for r in records)))


def peer_uniform_micro(micro: int, record: PeerRecord) -> int:
    """A peer's micro-batch in a uniform plan whose per-device micro-batch is ``micro``: ``micro`` on each of its
    ranks (a K-rank peer trains K devices' batches, as K DiLoCo workers would), within its ``max_batch``."""
    return min(micro * ranks_of(record), max(micro, record.max_batch))


def comm_time(record: PeerRecord, cfg: PlanConfig) -> float:
    """Predicted seconds of this peer's collective: ``2*latency + payload/up + payload/down``."""
    return 2 * cfg.latency_s + cfg.payload_bytes / record.upload_bps + cfg.payload_bytes / record.download_bps


def accum_steps_for(micro_batch: int, target_batch: int) -> int:
    """Gradient-accumulation steps of a micro-batch: ``max(1, ceil(target_batch / micro_batch))``."""
    return max(1, -(-target_batch // micro_batch))


class PeerModel:
    __slots__ = ("peer_id", "address", "micro", "accum", "batch", "step_s", "comm_s")

    def __init__(self, record: PeerRecord, cfg: PlanConfig, micro: int):
        self.peer_id = record.peer_id
        self.address = record.address
        micro = rank_micro(micro, record)  # a multi-rank peer's batch is a multiple of its ranks
        self.micro = micro
        # target_batch is a floor per device: a K-rank peer's step holds at least K x target_batch sequences
        self.accum = accum_steps_for(micro, cfg.target_batch * ranks_of(record))
        self.batch = micro * self.accum
        self.step_s = self.batch * cfg.seq_len / interpolate_tokens_per_s(record.tokens_per_s, micro)
        self.comm_s = comm_time(record, cfg)

    def with_step_s(self, step_s: float) -> "PeerModel":
        """A copy planned at another step time (seconds)."""
        m = object.__new__(PeerModel)
        for k in self.__slots__:
            setattr(m, k, getattr(self, k))
        m.step_s = step_s
        return m


def inner_steps(T: np.ndarray, s: np.ndarray, c: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """H = clip(floor((T - c) / s), min, max), broadcasting T against the peers."""
    raw = np.floor((T - c) / s + _STEP_EPS)
    return np.clip(raw, cfg.min_inner_steps, cfg.max_inner_steps).astype(np.int64)


def step_and_comm(models: Sequence[PeerModel]) -> tuple[np.ndarray, np.ndarray]:
    """(step seconds, comm seconds) of the peers as float64 arrays."""
    return (
        np.array([m.step_s for m in models], dtype=np.float64),
        np.array([m.comm_s for m in models], dtype=np.float64),
    )
