"""Bounded tables under a flood of identities: the link-probe rate table (geomesh_p2p.links) and the
collective owner's held pushes for unknown rounds (geomesh_p2p.collective.owner)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from geomesh_p2p.identity import EnvelopeError
from geomesh_p2p.links import LinkProbeService

pytestmark = pytest.mark.timeout(60)


def _probe_service(**kw) -> LinkProbeService:
    """A LinkProbeService on a stand-in transport (only ``add_unary`` is used at construction)."""
    return LinkProbeService(SimpleNamespace(add_unary=lambda *a, **k: None), **kw)


def test_probe_rate_table_is_capped_lru_and_a_staying_caller_keeps_its_count():
    svc = _probe_service(max_per_minute=3, max_callers=100)
    svc._admit("stayer", 0)
    svc._admit("stayer", 0)
    for i in range(10_000):
        svc._admit(f"sybil-{i}", 0)
        if i % 50 == 0:  # the honest caller keeps probing now and then, so it stays recent
            try:
                svc._admit("stayer", 0)
            except EnvelopeError as err:
                assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(svc._recent) <= 100
    assert len(svc._recent) == 100
    assert "stayer" in svc._recent and len(svc._recent["stayer"]) == 3  # its 3 probes of this minute
    assert "sybil-0" not in svc._recent and "sybil-9999" in svc._recent  # least recent forgotten first
    with pytest.raises(EnvelopeError) as e:
        svc._admit("stayer", 0)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in a minute" in e.value.reason


def test_probe_rate_table_cap_must_be_positive():
    with pytest.raises(ValueError):
        _probe_service(max_callers=0)
