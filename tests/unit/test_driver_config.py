"""DriverConfig takes its defaults and a node's values from NodeConfig (issue 15: every default once)."""

import dataclasses

import pytest

from geomesh_p2p.config.models import NodeConfig
from geomesh_p2p.round.driver import DriverConfig

pytestmark = pytest.mark.timeout(30)

SHARED = [f.name for f in dataclasses.fields(DriverConfig) if f.name in NodeConfig.model_fields]


def test_shared_knobs_default_to_node_config():
    assert set(SHARED) >= {"min_peers", "wait_peers_s", "gather_wait_s", "plan_timeout_s", "eval_batches"}
    d = DriverConfig()
    for name in SHARED:
        assert getattr(d, name) == NodeConfig.model_fields[name].default, name


def test_from_node_copies_every_shared_field_and_applies_overrides():
    node = NodeConfig(min_peers=3, wait_peers_s=7.5, gather_wait_s=1.25, plan_timeout_s=9.0, eval_batches=2, rounds=11)
    d = DriverConfig.from_node(node, checkpointing=True, exchanges_gradient=True)
    assert (d.min_peers, d.wait_peers_s, d.gather_wait_s, d.plan_timeout_s, d.eval_batches, d.rounds) == (
        3,
        7.5,
        1.25,
        9.0,
        2,
        11,
    )
    assert d.checkpointing and d.exchanges_gradient
    assert d.digest_wait_s == DriverConfig().digest_wait_s  # a driver-only knob keeps its own default
    with pytest.raises(TypeError):
        DriverConfig.from_node(node, no_such_knob=1)
