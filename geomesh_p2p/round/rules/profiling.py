"""Re-profiling of the round rules (:class:`Reprofiler`): after each round, this peer's measured tokens/s and
link figures folded into its EMAs (what its record announces and its plans assume), the exchange's measured
CPU cost per element pass, and the rates the last round's deliveries support (the next leader's evidence).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional

from geomesh_p2p.model import capability
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan import planner
from geomesh_p2p.round.rules.state import RoundState

if TYPE_CHECKING:
    from geomesh_p2p.config.models import NodeConfig
    from geomesh_p2p.model.capability import ThroughputEMA

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["Reprofiler", "EXCHANGE_COST_STEP"]

#: The measured cost per element pass of the exchange moves at most this factor per round (either way).
EXCHANGE_COST_STEP = 4.0
#: delivered-work rates a checkpoint may restore (as many as a round's participants, with room)
MAX_RESTORED_RATES = 4096


def _restored_rates(tps) -> Optional[dict[str, float]]:
    """``tps`` (a checkpoint's ``{peer id: tokens/s}``) when it holds at most :data:`MAX_RESTORED_RATES` entries of
    PeerID-length ids and finite, non-negative rates (an integer too large for a float is not finite); None
    otherwise (the whole map: an edited file)."""
    if not isinstance(tps, dict) or len(tps) > MAX_RESTORED_RATES:
        return None
    rates: dict[str, float] = {}
    for p, v in tps.items():
        if not isinstance(p, str) or not 0 < len(p) <= 64 or isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        try:
            rate = float(v)
        except OverflowError:  # a JSON integer past a float's range (red team 39: it ended --resume in a traceback)
            return None
        if not (math.isfinite(rate) and rate >= 0):
            return None
        rates[p] = rate
    return rates


class Reprofiler:
    """This peer's re-profiled figures.

    Args:
        cfg: the node config (``upload_bps`` / ``download_bps`` stated by flags, ``min_link_sample_bytes``,
            ``link_step_ratio``).
        state: this peer's :class:`RoundState` (``round``, ``numel``).
        ema: the tokens/s and link EMAs (None until the node's start-up profile made them).
        codec_s_per_element: the exchange's CPU seconds per element pass (None: not calibrated).

    Attributes:
        measured: quantities measured in a round at least once ("tps", "up", "down"): the first sample of
            each replaces the start-up figure.
        supported_tps: (round, peer id -> tokens/s its delivered contribution supports), or None.
        unseen_tps: (round, :meth:`unseen_rates` of it), or None.
    """

    def __init__(
        self,
        cfg: NodeConfig,
        state: RoundState,
        ema: Optional[ThroughputEMA] = None,
        codec_s_per_element: Optional[float] = None,
    ):
        self.cfg = cfg
        self.state = state
        self.ema = ema
        self.codec_s_per_element = codec_s_per_element
        self.measured: set[str] = set()
        self.exchange_cost_measured = False
        self.supported_tps: Optional[tuple[int, dict[str, float]]] = None
        self.unseen_tps: Optional[tuple[int, dict[str, float]]] = None

    def throughput_ema(self) -> ThroughputEMA:
        """``self.ema``: the re-profiled tokens/s and link figures.

        Raises:
            RuntimeError: before the node's start-up profile (``start``) created it.
        """
        if self.ema is None:
            raise RuntimeError("the throughput EMAs do not exist yet (the node has not profiled its device)")
        return self.ema

    def after_round(self, r: int, plan, micro_batch: int, result, ar) -> None:
        """Tokens/s and link EMAs of round ``r``, and the rates its deliveries support."""
        self.update_throughput(micro_batch, result)
        self.update_links(ar)
        self.supported_tps = (r, self.delivered_rates(plan, ar))
        self.unseen_tps = (r, self.unseen_rates(plan, ar))

    def delivered_meta(self) -> Optional[dict]:
        """:attr:`supported_tps` as JSON-able data for a checkpoint (``{"round": r, "tps": {peer: tokens/s}}``), with
        :attr:`unseen_tps` of the same round as ``"unseen": {peer: tokens/s}`` when it names any peer; None before
        any round was applied.

        Why the unseen rates (issue 28, session 39): without them a follower resumed from the checkpoint of a round
        in which it missed a part bounded the participants that part would list at the newcomer seed again, and
        refused the next honest plan that gave one of them its rate (session 38's 85 of 400). Older releases read
        ``round`` and ``tps`` only, and a checkpoint without ``unseen`` resumes with none (as before)."""
        if self.supported_tps is None:
            return None
        r, tps = self.supported_tps
        out: dict = {"round": int(r), "tps": {str(p): float(v) for p, v in tps.items()}}
        if self.unseen_tps is not None and self.unseen_tps[0] == r and self.unseen_tps[1]:
            out["unseen"] = {str(p): float(v) for p, v in self.unseen_tps[1].items()}
        return out

    def restore_delivered(self, meta, state_round: int) -> bool:
        """Take :meth:`delivered_meta` back from a checkpoint of the state of round ``state_round`` (``--resume``):
        only the evidence of round ``state_round - 1``, the round that made that state (the evidence every peer
        that applied it holds), with at most :data:`MAX_RESTORED_RATES` finite, non-negative rates; anything else
        is ignored (an edited file must not end the node). Its ``unseen`` rates (absent in checkpoints before
        0.12.1's session 39) are taken into :attr:`unseen_tps` under the same rules; a malformed ``unseen`` alone
        is dropped (the follower then bounds those peers at the seed, as before). Returns whether the delivered
        rates were taken."""
        if not isinstance(meta, dict) or type(meta.get("round")) is not int or meta["round"] != int(state_round) - 1:
            return False
        rates = _restored_rates(meta.get("tps"))
        if rates is None:
            return False
        self.supported_tps = (meta["round"], rates)
        unseen = _restored_rates(meta.get("unseen")) if "unseen" in meta else None
        self.unseen_tps = (meta["round"], unseen) if unseen else None
        return True

    def update_exchange_cost(self, spec, ar) -> None:
        """Fold this round's exchange into ``codec_s_per_element`` (seconds per element pass), as the link
        EMAs fold its transfers: the call's wall time less the wait for the last contributor to finish
        computing and less the network busy time, over the round's element passes. The first sample
        replaces the start-up calibration (taken alone); later ones move the figure by an EMA (alpha 0.5),
        at most ``EXCHANGE_COST_STEP`` x either way per round. Skipped for a call without a wall time."""
        cur = self.codec_s_per_element
        wall = float(getattr(ar, "wall_s", 0.0) or 0.0)
        numel = self.state.numel
        if not cur or wall <= 0 or not numel:
            return
        t0 = swarm_time() - wall  # last_compute_end is swarm time
        wait = max(0.0, min(wall, float(ar.last_compute_end or 0.0) - t0))
        net = sum(x.seconds for x in (ar.upload, ar.download) if x is not None)
        cpu = max(0.0, wall - wait - net)
        sample = cpu / (
            numel * planner.exchange_passes(max(1, len(spec.participants)), spec.mode, spec.validators_per_part)
        )
        first = not self.exchange_cost_measured
        self.exchange_cost_measured = True
        sample = min(max(sample, cur / EXCHANGE_COST_STEP), cur * EXCHANGE_COST_STEP)
        self.codec_s_per_element = sample if first else 0.5 * cur + 0.5 * sample
        log.debug(
            "round %d: exchange %.2fs (%.2fs waiting, %.2fs network): %.2f ns per element pass, EMA %.2f ns",
            spec.round,
            wall,
            wait,
            net,
            sample * 1e9,
            self.codec_s_per_element * 1e9,
        )

    @staticmethod
    def delivered_rates(plan, ar) -> dict[str, float]:
        """peer_id -> tokens/s its contribution to this round supports: the tokens the owners took from
        it (its claim, capped to its plan budget; the most over the parts) over the compute seconds its
        plan predicted. The next leader plans no peer above ``planner.EVIDENCE_GROWTH`` x this. It bounds
        how fast a peer's planned rate can grow, not a claim made at the budget: telling work done from
        a claim is verified work's job (geomesh_p2p.trust.verify)."""
        delivered: dict[str, int] = {}
        for part in ar.contributors.values():
            for pid, n in part:
                delivered[pid] = max(delivered.get(pid, 0), int(n))
        rates = {}
        for a in plan.assignments:
            # capped here, by every reader alike: an owner's list is the owner's word (red team: one owner
            # listing a peer at 1e15 tokens lifted that peer's next budget 8x)
            n = min(delivered.get(a.peer_id, 0), int(a.token_budget))
            if n > 0 and a.predicted_compute_s > 0:
                rates[a.peer_id] = n / a.predicted_compute_s
        return rates

    @staticmethod
    def unseen_rates(plan, ar) -> dict[str, float]:
        """peer_id -> tokens/s its plan gave it (token budget over predicted compute seconds: the most
        :meth:`delivered_rates` can give it) for the participants of ``plan`` that no part result this peer read
        lists, when it missed a part (``ar.missing_parts``): they may have contributed there, and a leader that
        read that part holds their rate (session 38: a follower lacking a fast peer's rate bounded it at the
        newcomer seed and refused 85 of 400 honest plans). Empty when every part was read: a participant absent
        from all of them delivered nothing, for every reader alike."""
        if not getattr(ar, "missing_parts", None):
            return {}
        listed = {pid for part in ar.contributors.values() for pid, _ in part}
        return {
            a.peer_id: a.token_budget / a.predicted_compute_s
            for a in plan.assignments
            if a.peer_id not in listed and a.predicted_compute_s > 0 and a.token_budget > 0
        }

    def update_throughput(self, micro_batch: int, result) -> None:
        """Re-profiling (beyond the paper's one-off profile): EMA of this round's measured tokens/s
        (the other micro-batch sizes are rescaled by the same ratio, capability.ThroughputEMA), growing
        at most ``capability.MAX_TPS_GROWTH_PER_UPDATE`` x and falling at most ``capability.MAX_TPS_DROP_PER_UPDATE``
        x per round."""
        if result.compute_s > 0 and result.tokens > 0:
            # The start-up profile is a prior, taken alone and with other processes starting up; the
            # first measurement in the swarm replaces it (then the EMA smooths round-to-round noise).
            first = "tps" not in self.measured
            self.measured.add("tps")
            # A self-measured compute time is not evidence (a free rider can report ~0 s): the announced
            # figure grows at most capability.MAX_TPS_GROWTH_PER_UPDATE x per round, first measurement included.
            self.throughput_ema().update(
                micro_batch,
                result.tokens,
                result.compute_s,
                alpha=1.0 if first else None,
                max_growth=capability.MAX_TPS_GROWTH_PER_UPDATE,
                max_drop=capability.MAX_TPS_DROP_PER_UPDATE,  # a plan from the record before still passes
            )

    def update_links(self, ar) -> None:
        """Fold this round's measured exchange into the link EMAs (links.py). A direction stated by
        a flag stays as stated; samples under ``min_link_sample_bytes`` (latency-bound) are skipped.
        The busy time keeps its latency (the RTT to the bootstrap says nothing about the RTT to the
        owners). A sample moves the figure by at most ``link_step_ratio`` either way per round: the
        owners state their own hold times, so a lying owner can skew one sample, not the record."""
        c = self.cfg
        for direction, sample, stated in (("up", ar.upload, c.upload_bps), ("down", ar.download, c.download_bps)):
            if stated or sample is None or sample.nbytes < c.min_link_sample_bytes:
                continue
            seconds = sample.seconds
            ema = self.throughput_ema()
            current = ema.upload_bps if direction == "up" else ema.download_bps
            if current:
                rate = sample.nbytes / seconds
                rate = min(max(rate, current / c.link_step_ratio), current * c.link_step_ratio)
                seconds = sample.nbytes / rate
            first = direction not in self.measured  # the first real exchange replaces the probe's figure
            self.measured.add(direction)
            new = ema.update_link(sample.nbytes, seconds, direction, alpha=1.0 if first else None)
            log.debug(
                "round %d: %sload %.1f Mbit/s measured (%d bytes in %.3fs), EMA %.1f Mbit/s",
                self.state.round - 1,
                direction,
                sample.nbytes / seconds * 8e-6,
                sample.nbytes,
                seconds,
                new * 8e-6,
            )
