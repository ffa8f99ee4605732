"""A peer's capability figures, re-profiled every round (DESIGN.md, "Round r" step 7).

A peer announces its tokens/s per micro-batch and its link speeds in its
:class:`~geomesh_p2p.schema.peer.PeerRecord` (first from the start-up profile,
:mod:`geomesh_p2p.model.profile`); during the run :class:`ThroughputEMA` folds each round's
observed step times and transfer times into that record, so the next plan fits reality (GeoMesh
profiles once; we re-profile every round). Units: tokens/s, bytes/s, seconds.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from geomesh_p2p.schema.peer import PeerRecord

#: the most a peer's announced tokens/s may grow in one re-profiling update (x): its self-measured
#: compute time is not evidence (a free rider can report ~0 s), so a figure can only be inflated
#: slowly; a real speed-up (a profile taken under load) is reached in a few rounds (2x per round).
MAX_TPS_GROWTH_PER_UPDATE = 2.0

#: the most a peer's announced tokens/s may fall in one re-profiling update (x). Below the followers' plan check
#: tolerance (``plan.bounds.PLAN_CHECK_TOLERANCE``, 1.5), so that a plan made from a record one update older still
#: passes the check of a follower that read the newer one: in session 26's 16-peer run a first in-swarm measurement
#: far below a start-up profile taken alone made a follower refuse its leader's plan ("token budget 384 ... exceeds
#: the 331 its bounded throughput supports") and sit the round out. A device that really got k x slower is
#: announced so after log(k) / log(1.4) rounds; meanwhile its budgets are too large and it trains what it can by the
#: plan's deadline, as any straggler.
MAX_TPS_DROP_PER_UPDATE = 1.4


class ThroughputEMA:
    """Exponential moving averages of a peer's throughput and link speeds, updated every round.

    ``alpha`` is the weight of a new observation: ``v <- alpha * x + (1 - alpha) * v`` (the first
    observation of a quantity is taken as is). ``update(batch, tokens, seconds)`` folds in an
    observed ``tokens / seconds`` for that micro-batch size; with ``rescale_others`` (default) the
    other batch sizes' figures are scaled by the same ratio (a device that got slower is slower at
    every batch size). ``update_link(bytes, seconds, direction)`` does the same for the upload
    ('up') or download ('down') bandwidth, bytes/s. :meth:`apply` writes the figures into a
    :class:`PeerRecord`.
    """

    def __init__(
        self,
        alpha: float = 0.3,
        tokens_per_s: Optional[Mapping[int, float]] = None,
        upload_bps: Optional[float] = None,
        download_bps: Optional[float] = None,
        rescale_others: bool = True,
    ):
        if not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.alpha = float(alpha)
        self.rescale_others = rescale_others
        self._tps: dict[int, float] = {}
        for b, v in (tokens_per_s or {}).items():
            if int(b) < 1 or not (math.isfinite(v) and v > 0):
                raise ValueError(f"tokens_per_s[{b}]={v}: batch must be >= 1 and throughput > 0")
            self._tps[int(b)] = float(v)
        self._link: dict[str, Optional[float]] = {"up": None, "down": None}
        for direction, bps in (("up", upload_bps), ("down", download_bps)):
            if bps is not None:
                if not (math.isfinite(bps) and bps > 0):
                    raise ValueError(f"{direction}load_bps={bps} must be > 0")
                self._link[direction] = float(bps)

    def _ema(self, old: Optional[float], x: float, alpha: Optional[float] = None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        return x if old is None else a * x + (1.0 - a) * old

    def update(
        self,
        batch: int,
        tokens: int,
        seconds: float,
        alpha: Optional[float] = None,
        max_growth: Optional[float] = None,
        max_drop: Optional[float] = None,
    ) -> float:
        """Fold in ``tokens`` trained in ``seconds`` at micro-batch ``batch``; returns the new tokens/s.

        ``alpha`` overrides the weight of this observation (1.0: replace, e.g. a start-up profile
        by the first measurement taken in the swarm). ``max_growth`` (>= 1): the new figure is at
        most that many times the previous one for ``batch`` (or, when ``batch`` is new, the best
        figure known), e.g. :data:`MAX_TPS_GROWTH_PER_UPDATE`; ``max_drop`` (>= 1): at least the previous figure
        for ``batch`` over that, e.g. :data:`MAX_TPS_DROP_PER_UPDATE`. Raises ValueError for ``batch < 1``,
        ``tokens <= 0``, ``seconds <= 0``, ``alpha`` outside (0, 1], ``max_growth < 1`` or ``max_drop < 1``.
        """
        if alpha is not None and not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        if max_growth is not None and not max_growth >= 1:
            raise ValueError(f"max_growth={max_growth} must be >= 1")
        if max_drop is not None and not max_drop >= 1:
            raise ValueError(f"max_drop={max_drop} must be >= 1")
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"tokens={tokens} and seconds={seconds} must be > 0")
        old = self._tps.get(batch)
        new = self._ema(old, tokens / seconds, alpha)
        ref = old if old is not None else max(self._tps.values(), default=None)
        if max_growth is not None and ref is not None:
            new = min(new, ref * max_growth)
        if max_drop is not None and old is not None:
            new = max(new, old / max_drop)
        if old is not None and self.rescale_others:
            ratio = new / old
            for b in self._tps:
                if b != batch:
                    self._tps[b] *= ratio
        self._tps[batch] = new
        return new

    def update_link(self, nbytes: int, seconds: float, direction: str, alpha: Optional[float] = None) -> float:
        """Fold in a transfer of ``nbytes`` in ``seconds``; ``direction`` 'up'/'upload' or
        'down'/'download'; ``alpha`` as in :meth:`update`. Returns the new bytes/s. Raises
        ValueError for a bad direction, ``nbytes <= 0``, ``seconds <= 0`` or a bad ``alpha``."""
        if alpha is not None and not (0 < alpha <= 1):
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        key = {"up": "up", "upload": "up", "down": "down", "download": "down"}.get(direction)
        if key is None:
            raise ValueError(f"direction={direction!r}: expected 'up' or 'down'")
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"nbytes={nbytes} and seconds={seconds} must be > 0")
        new = self._link[key] = self._ema(self._link[key], nbytes / seconds, alpha)
        return new

    @property
    def tokens_per_s(self) -> dict[int, float]:
        return dict(sorted(self._tps.items()))

    @property
    def upload_bps(self) -> Optional[float]:
        return self._link["up"]

    @property
    def download_bps(self) -> Optional[float]:
        return self._link["down"]

    def record_fields(self) -> dict[str, Any]:
        """The known figures as PeerRecord fields (tokens_per_s, upload_bps, download_bps)."""
        out: dict[str, Any] = {}
        if self._tps:
            out["tokens_per_s"] = self.tokens_per_s
        if self.upload_bps is not None:
            out["upload_bps"] = self.upload_bps
        if self.download_bps is not None:
            out["download_bps"] = self.download_bps
        return out

    def apply(self, record: PeerRecord) -> PeerRecord:
        """A copy of ``record`` with the current figures (validated; timestamp unchanged)."""
        return PeerRecord.model_validate({**record.model_dump(), **self.record_fields()})
