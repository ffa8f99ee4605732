"""The node's link measurements (:class:`LinkProber`): the start-up probe against a bootstrap, and the
re-probe of a peer planned out (its announced link figures came from its last exchange).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from geomesh_p2p.net.links import probe_link
from geomesh_p2p.telemetry import events

if TYPE_CHECKING:
    from geomesh_p2p.config.models import NodeConfig
    from geomesh_p2p.model.capability import ThroughputEMA

log = logging.getLogger("geomesh_p2p.node.peer")

__all__ = ["LinkProber", "REPROBE_MIN_INTERVAL_S", "REPROBE_TIMEOUT_S"]

#: A planned-out peer re-probes its link at most this often (seconds), and gives a probe this long.
REPROBE_MIN_INTERVAL_S = 20.0
REPROBE_TIMEOUT_S = 10.0


def _mbit(bps: Optional[float]) -> str:
    """``bps`` (bytes/s) as Mbit/s text, or "unknown"."""
    return "unknown" if bps is None else f"{bps * 8e-6:.1f}"


class LinkProber:
    """Probes of this peer's link.

    Args:
        cfg: the node config (``bootstrap``, ``probe_bytes``, stated ``upload_bps`` / ``download_bps``).
        transport: the node's transport (None before it started or after shutdown).
        ema: the link EMAs a re-probe raises (None before the start-up profile).

    Attributes:
        probe_result: the start-up probe's :class:`~geomesh_p2p.net.links.ProbeResult`, if one was made.
        reprobed_at: monotonic seconds of the last probe (the start-up probe counts).
    """

    def __init__(self, cfg: NodeConfig, transport: Callable[[], Any], ema: Callable[[], Optional[ThroughputEMA]]):
        self.cfg = cfg
        self._transport = transport
        self._ema = ema
        self.probe_result: Any = None
        self.reprobed_at = -1e18

    async def probe(self):
        """Measure this peer's link against the first bootstrap that answers (links.probe_link);
        None when both directions are stated by flags or no bootstrap answers the probe."""

        c = self.cfg
        if c.upload_bps and c.download_bps:
            return None
        for b in c.bootstrap:
            try:
                res = await probe_link(self._transport(), b, nbytes=c.probe_bytes, repeats=2, timeout_s=30.0)
            except Exception as e:  # an old or busy bootstrap: the first rounds will measure instead
                log.info("link probe of %s failed (%s); bandwidth will be measured in the first round", b, e)
                continue
            log.info(
                "link to %s: upload %.1f Mbit/s, download %.1f Mbit/s, RTT %.1f ms (probe, up to %d KiB)",
                b,
                res.upload_bps * 8e-6,
                res.download_bps * 8e-6,
                res.rtt_s * 1e3,
                res.nbytes >> 10,
            )
            self.probe_result = res
            self.reprobed_at = time.monotonic()  # a newcomer planned out at once does not probe twice
            return res
        return None

    async def remeasure(self) -> None:
        """Round driver port (:meth:`~geomesh_p2p.round.ports.Membership.remeasure`): a planned-out
        peer probes its link again against a bootstrap (:func:`~geomesh_p2p.net.links.probe_link`, as at
        start-up: ``--probe-bytes`` each way, one repeat; bootstraps in random order, so peers planned out
        together do not all queue at the first), so its next record is not the pessimistic figure of the
        exchange that got it planned out. Each direction becomes the larger of the old figure and the
        probe's: a probe slowed by a busy bootstrap (its queue counts as transfer time) never lowers it.
        The whole re-probe is bounded by :data:`REPROBE_TIMEOUT_S` (then the old figures stay). At most once
        per :data:`REPROBE_MIN_INTERVAL_S` (the start-up probe counts); nothing when both directions are
        stated by flags."""
        c = self.cfg
        now = time.monotonic()
        if (c.upload_bps and c.download_bps) or self._ema() is None or self._transport() is None:
            return
        if now - self.reprobed_at < REPROBE_MIN_INTERVAL_S:
            return
        self.reprobed_at = now
        try:
            await asyncio.wait_for(self._reprobe(), REPROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.debug("link re-probe gave no answer within %.0f s; the link figures stay", REPROBE_TIMEOUT_S)

    async def _reprobe(self) -> None:
        """The probes of :meth:`remeasure`: the first bootstrap that answers (random order)."""
        c, ema, transport = self.cfg, self._ema(), self._transport()
        assert ema is not None and transport is not None  # checked by remeasure
        for b in random.sample(list(c.bootstrap), len(c.bootstrap)):
            try:
                res = await probe_link(transport, b, nbytes=c.probe_bytes, repeats=1, timeout_s=REPROBE_TIMEOUT_S)
            except Exception as e:  # a busy bootstrap: try the next
                log.debug("link re-probe of %s failed: %s", b, e)
                continue
            old = (ema.upload_bps, ema.download_bps)
            for direction, was, bps, stated in (
                ("up", old[0], res.upload_bps, c.upload_bps),
                ("down", old[1], res.download_bps, c.download_bps),
            ):
                if not stated:
                    ema.update_link(max(1, int(max(bps, was or 0.0))), 1.0, direction, alpha=1.0)
            events.emit(
                log,
                logging.INFO,
                "link_reprobed",
                "planned out: link re-measured against %s: upload %.1f, download %.1f Mbit/s (was %s, %s)",
                b,
                res.upload_bps * 8e-6,
                res.download_bps * 8e-6,
                _mbit(old[0]),
                _mbit(old[1]),
                upload_bps=ema.upload_bps,
                download_bps=ema.download_bps,
                was_upload_bps=old[0],
                was_download_bps=old[1],
            )
            return
