"""A planned-out peer re-measures its link (issue 17 rerun of benchmarks/realswarm_netns.py: a peer whose
exchange measured a pessimistic link was planned out, and never exchanged again to correct it)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from geomesh_p2p.telemetry import events
from geomesh_p2p.node import links as node_mod
from geomesh_p2p.model.capability import ThroughputEMA
from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.node.links import LinkProber

pytestmark = pytest.mark.timeout(30)
BOOTSTRAPS = ["10.0.0.1:1", "10.0.0.2:1"]  # never dialled: probe_link is replaced in every test


def _node(**cfg) -> LinkProber:
    """The node's link prober: a transport (never dialled) and the link figures a congested exchange measured."""
    ema = ThroughputEMA(upload_bps=2.9e5, download_bps=3.0e5)  # what a congested exchange measured
    transport = object()
    node = LinkProber(NodeConfig(bootstrap=BOOTSTRAPS, **cfg), transport=lambda: transport, ema=lambda: ema)
    node.ema = ema  # type: ignore[attr-defined]  # what the tests read back
    return node


def test_the_probe_raises_the_exchange_figures_once_per_interval(monkeypatch):
    calls = []

    async def probe(transport, address, **kw):
        calls.append(address)
        if len(calls) == 1:
            raise RuntimeError("busy")  # whichever bootstrap comes first: the other is tried
        return SimpleNamespace(upload_bps=9.4e5, download_bps=2.0e5)

    monkeypatch.setattr(node_mod, "probe_link", probe)
    node = _node()
    with events.capture("link_reprobed") as got:
        asyncio.run(node.remeasure())
        asyncio.run(node.remeasure())  # within REPROBE_MIN_INTERVAL_S: no second probe
    assert sorted(calls) == BOOTSTRAPS
    # upload rises to the probe's figure; download keeps the higher old figure (a busy bootstrap's
    # queue counts as transfer time in a probe, so a probe never lowers a figure)
    assert (node.ema.upload_bps, node.ema.download_bps) == (940000.0, 300000.0)
    [ev] = got
    assert (ev["upload_bps"], ev["was_upload_bps"], ev["was_download_bps"]) == (940000.0, 2.9e5, 3.0e5)


def test_the_whole_reprobe_is_bounded(monkeypatch):
    """Two bootstraps that never answer cost REPROBE_TIMEOUT_S in all, not that much per call (review F3)."""

    async def hang(transport, address, **kw):
        await asyncio.Event().wait()

    monkeypatch.setattr(node_mod, "probe_link", hang)
    monkeypatch.setattr(node_mod, "REPROBE_TIMEOUT_S", 0.2)
    node = _node()
    t0 = time.monotonic()
    asyncio.run(node.remeasure())
    assert time.monotonic() - t0 < 2.0
    assert (node.ema.upload_bps, node.ema.download_bps) == (2.9e5, 3.0e5)


def test_stated_links_are_not_probed_and_one_stated_direction_is_kept(monkeypatch):
    calls = []

    async def probe(transport, address, **kw):
        calls.append(address)
        return SimpleNamespace(upload_bps=9.4e5, download_bps=9.2e5)

    monkeypatch.setattr(node_mod, "probe_link", probe)
    both = _node(upload_bps=1e6, download_bps=1e6)
    asyncio.run(both.remeasure())
    assert calls == []
    up_only = _node(upload_bps=1e6)
    asyncio.run(up_only.remeasure())
    assert len(calls) == 1
    assert (up_only.ema.upload_bps, up_only.ema.download_bps) == (2.9e5, 920000.0)
