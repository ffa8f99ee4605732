"""What a user reads (issue 14 #10): a lone client-only peer waits with one line, not an ERROR every
few seconds; a healthy swarm's logs carry no ERROR, traceback, destroyed task or raw gRPC core line."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.config.models import NodeConfig, RunConfig
from geomesh_p2p.round.rules import PlanRules
from geomesh_p2p.schema.peer import PeerRecord
from tests.records_util import peer_record
from tests.rules_util import make_rules
from geomesh_p2p.plan.agree import PlanDeferred

pytestmark = pytest.mark.timeout(60)


def _rec(ident: Identity, addr) -> PeerRecord:
    return peer_record(ident, address=addr, round=0, weights_digest="d")


def _policy_node() -> PlanRules:
    """The node's planning rules only: no transport, no model."""
    return make_rules(RunConfig(window_s=6.0), NodeConfig(), numel=1_000_000, digest="d").planning


def test_a_lone_client_only_peer_waits_with_one_line_per_state_change(caplog):
    me = Identity.generate()
    node = _policy_node()
    alone = [_rec(me, None)]  # nobody can dial it: client-only
    with caplog.at_level(logging.INFO, logger="geomesh_p2p"):
        for r in range(5):  # five retries of the driver: one line
            node.state.round = r
            with pytest.raises(PlanDeferred):
                node.make_plan(alone, alone[0].peer_id)
        other = _rec(Identity.generate(), "127.0.0.1:7001")
        node.state.round = 5
        plan = node.make_plan(alone + [other], alone[0].peer_id)
        node.state.round = 6
        with pytest.raises(PlanDeferred):
            node.make_plan(alone, alone[0].peer_id)
    names = {logging.INFO: "INFO", logging.WARNING: "WARNING"}
    msgs = [(names.get(r.levelno, "ERROR"), r.getMessage()) for r in caplog.records]
    assert [m for m in msgs if m[0] == "ERROR"] == []
    assert [m for m in msgs if "own a part" in m[1]] == [
        (
            "WARNING",
            "round 0: no reachable peer can own a part (1 peer(s) to plan, all client-only or on "
            "probation): waiting for one",
        ),
        ("INFO", "round 5: a peer can own a part again: planning"),
        (
            "WARNING",
            "round 6: no reachable peer can own a part (1 peer(s) to plan, all client-only or on "
            "probation): waiting for one",
        ),
    ]
    assert [a.peer_id for a in plan.assignments if a.owns_part] == [other.peer_id]
    assert plan.round == 5


async def test_a_wrong_run_id_is_not_reported_as_no_answer():
    """A bootstrap of another run answers (FAILED_PRECONDITION): the join says so and names --run-id, at
    the first attempt, instead of 'no bootstrap node answered' after its retries."""
    from geomesh_p2p.dht import DHTJoinError
    from tests.dht_helpers import start_node, stop_node

    boot = await start_node(run_id="run-a")
    try:
        with pytest.raises(DHTJoinError) as ei:
            await start_node([boot.transport.address], run_id="run-b", join_attempts=5)
        msg = str(ei.value)
        assert msg == (
            f"could not join the DHT: bootstrap {boot.transport.address} serves run 'run-a', "
            f"not the run 'run-b' asked for: check --run-id"
        )
    finally:
        await stop_node(boot)


async def test_a_peer_that_starts_below_min_peers_says_so(caplog):
    """--min-peers 2 with one peer: one line while it waits, one when it starts below it (virtual clock)."""
    from tests.unit.test_round_driver import FakeClock, _peers

    (lone,) = _peers(1)
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.node.peer.round"):
        await asyncio.wait_for(lone.driver(rounds=1, min_peers=2, wait_peers_s=30.0, clock=FakeClock()).run(), 30)
    lines = [r.getMessage() for r in caplog.records if "peers" in r.getMessage() and "round 0:" in r.getMessage()]
    assert (
        lines[0]
        == "round 0: waiting for 2 peers in all (this one included); 1 in step at this round, 1 live (up to 30 s)"
    )
    assert re.fullmatch(r"round 0: starting with 1 of the 2 peers wanted \(--min-peers\): waited 3\d s", lines[1]), (
        lines
    )
    assert [row.round for row in lone.drv.history] == [0]


# ------------------------------------------------------------------------------ processes (e2e)
# What a healthy run must not print (issue 14 #10): an ERROR record ("HH:MM:SS E name: ..."), a
# traceback, asyncio's reports of tasks left pending or of a closed loop, gRPC's C-core lines.
_BAD = re.compile(
    r"^\d\d:\d\d:\d\d E |ERROR|Traceback|Task was destroyed|Event loop is closed|^[EWF]\d{4} |\.cc:\d+", re.MULTILINE
)


def _bad_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if _BAD.search(line)]


async def test_a_bootstrap_name_that_does_not_resolve_fails_at_the_first_attempt():
    """Fresh-user trial: --bootstrap nosuchhost.invalid:31337 was retried 8 times over 41 s. A name that does not
    resolve is a typo, not a bootstrap still starting: one attempt, and the error names it."""
    from geomesh_p2p.dht import DHTJoinError
    from tests.dht_helpers import start_node

    with pytest.raises(DHTJoinError) as ei:
        await start_node(["nosuchhost.invalid:31337"], join_attempts=5)
    msg = str(ei.value)
    assert "(1 attempt(s) over" in msg and "nosuchhost.invalid:31337" in msg


async def test_a_wrong_run_id_is_named_before_the_proof_of_work(caplog):
    """A new identity's proof of work takes tens of seconds: a bootstrap of another run is named before it
    starts (a fresh user waited 41 s), by a client-only ping whose transport is gone again."""
    from geomesh_p2p.dht.state import OtherRunError
    from geomesh_p2p.node.peer import PeerNode
    from tests.dht_helpers import start_node, stop_node

    boot = await start_node(run_id="run-a")
    try:
        # 40 bits: a proof of work that would not end within this test's timeout
        node = PeerNode(
            RunConfig(seq_len=32, run_id="run-b", pow_bits=40),
            NodeConfig(bootstrap=[boot.transport.address]),
            identity=Identity.generate(),
        )
        with caplog.at_level(logging.INFO), pytest.raises(OtherRunError) as ei:
            await asyncio.wait_for(node.start(), 30)
        assert str(ei.value) == (
            f"could not join the DHT: bootstrap {boot.transport.address} serves run 'run-a', "
            f"not the run 'run-b' asked for: check --run-id"
        )
        assert not [r for r in caplog.records if "proof of work" in r.getMessage()]
        assert getattr(node, "transport", None) is None  # the node itself never listened
    finally:
        await stop_node(boot)
