"""The re-measurement of a planned-out peer's device (:class:`DeviceProber`).

Why: a peer's announced tokens/s come from its start-up profile until it trains in a round, and only a round it
trains in measures them again (:meth:`~geomesh_p2p.round.rules.profiling.Reprofiler.update_throughput`). A profile
taken while the machine was busy (16 peer processes starting on 2 cores: the first one measured 8 tokens/s at
batch 4, its peers 60-370) makes every leader plan it out as too slow for the window, and a peer that never trains
never measures again: it stayed out of every round of the run (0 rounds trained, exit 0). The link figures had the
same trap and got a re-probe (:class:`~geomesh_p2p.node.links.LinkProber`); this is its device half.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from geomesh_p2p.model.capability import MAX_TPS_GROWTH_PER_UPDATE
from geomesh_p2p.model.profile import remeasure_tps
from geomesh_p2p.node.links import REPROBE_MIN_INTERVAL_S, REPROBE_TIMEOUT_S
from geomesh_p2p.telemetry import events

if TYPE_CHECKING:
    import torch

    from geomesh_p2p.model.capability import ThroughputEMA

log = logging.getLogger("geomesh_p2p.node.peer")

__all__ = ["DeviceProber"]


class DeviceProber:
    """Re-measures this peer's tokens/s when a leader planned it out.

    Args:
        seq_len: the run's sequence length (tokens per sequence).
        speed_factor, amp: the node's ``--speed-factor`` and ``--amp`` (as its inner steps train).
        model: the live model (None before the start-up built it); measured in place, weights untouched.
        device: the model's device.
        vocab_size: the data's vocabulary size.
        ema: the tokens/s EMAs a re-measurement raises (None before the start-up profile).
        measured_in_swarm: whether a round this peer trained has measured its tokens/s already.
        multi_rank: whether this peer trains on several ranks (its model is shared with them: never measured alone).
    """

    def __init__(
        self,
        seq_len: int,
        speed_factor: float,
        amp: bool,
        *,
        model: Callable[[], Optional[torch.nn.Module]],
        device: Callable[[], Optional[torch.device]],
        vocab_size: Callable[[], Optional[int]],
        ema: Callable[[], Optional[ThroughputEMA]],
        measured_in_swarm: Callable[[], bool],
        multi_rank: Callable[[], bool],
    ):
        self.seq_len, self.speed_factor, self.amp = seq_len, speed_factor, amp
        self._model, self._device, self._vocab, self._ema = model, device, vocab_size, ema
        self._measured, self._multi_rank = measured_in_swarm, multi_rank
        self.measured_at = time.monotonic()  # the start-up profile counts: no re-measurement in its first interval

    @classmethod
    def for_node(cls, node: Any) -> DeviceProber:
        """The prober of a :class:`~geomesh_p2p.node.peer.PeerNode` (its run and node configs read now; model,
        device, data, EMAs and ranks read at each use, since the node builds them after this)."""
        return cls(
            node.run_cfg.seq_len,
            node.cfg.speed_factor,
            node.cfg.amp,
            model=lambda: getattr(node, "model", None),
            device=lambda: getattr(node, "device", None),
            vocab_size=lambda: getattr(getattr(node, "dataset", None), "vocab_size", None),
            ema=lambda: node.profile.ema,
            measured_in_swarm=lambda: "tps" in node.profile.measured,
            multi_rank=lambda: getattr(node, "rank_channel", None) is not None,
        )

    async def remeasure(self) -> Optional[float]:
        """One or two timed steps at the smallest batch this peer announces (:func:`remeasure_tps`, worker thread;
        one step when the first takes over half of :data:`REPROBE_TIMEOUT_S`), folded into its EMAs as the link
        re-probe does: a figure above the announced one replaces it (the other batch sizes scaled alike), one
        below leaves it (a busy moment never lowers it). Until a round has measured this peer it is a second
        start-up profile and replaces the first as is; after, it moves the figure at most
        :data:`MAX_TPS_GROWTH_PER_UPDATE` x, as a round's measurement does. At most once per
        :data:`REPROBE_MIN_INTERVAL_S`; nothing for a multi-rank peer or before the start-up profile. The
        caller runs it while nothing else trains, evaluates in place or loads the model (a planned-out
        peer's wait for the round's end). Returns the measured tokens/s, or None when it measured nothing.
        Raises what the step raises (an out-of-memory error included)."""
        model, device, vocab, ema = self._model(), self._device(), self._vocab(), self._ema()
        if model is None or device is None or not vocab or ema is None or not ema.tokens_per_s or self._multi_rank():
            return None
        now = time.monotonic()
        if now - self.measured_at < REPROBE_MIN_INTERVAL_S:
            return None
        self.measured_at = now
        batch = min(ema.tokens_per_s)
        tps = await asyncio.to_thread(
            remeasure_tps,
            model,
            self.seq_len,
            batch,
            device,
            vocab,
            speed_factor=self.speed_factor,
            amp=self.amp,
            budget_s=REPROBE_TIMEOUT_S,
        )
        was = ema.tokens_per_s[batch]
        if tps > was:
            tokens = batch * self.seq_len
            growth = MAX_TPS_GROWTH_PER_UPDATE if self._measured() else None
            ema.update(batch, tokens, tokens / tps, alpha=1.0, max_growth=growth)
        # "planned out:" misled on a peer that had just joined and was still syncing (fresh user 50): the caller waits
        # outside the round's plan for any reason (joined, syncing, too slow, other weights); a lower figure is kept
        events.emit(
            log,
            logging.INFO,
            "device_reprobed",
            "while waiting outside this round's plan: device re-measured: batch %d at %.0f tokens/s (announced %.0f, "
            "now %.0f%s)",
            batch,
            tps,
            was,
            ema.tokens_per_s[batch],
            "" if tps >= was else "; a lower measurement never lowers the announced figure",
            batch=batch,
            tokens_per_s=tps,
            was_tokens_per_s=was,
            announced_tokens_per_s=ema.tokens_per_s[batch],
        )
        return tps
