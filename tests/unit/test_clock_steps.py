"""Issue 29 #3 (rippled#3101): time that moves while the peer runs.

Before: the DHT re-measured the offset to the bootstraps, but a new offset over 60 s only warned once and
the old one was kept, and envelopes were stamped and judged by the raw wall clock against +-120 s. After an
NTP step of +90 s the peer's swarm time was 90 s ahead (planned out for good); at +150 s every call it made
was refused. Now a step of the wall clock (seen against a steady clock) corrects the offset at once, a jump
no step explains is followed once several measurements agree, and envelopes are stamped and judged in swarm
time. The clocks here are injected (no sockets): a node's wall clock steps while its steady clock does not;
a suspend moves both.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import grpc
import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.join import CLOCK_CONFIRMATIONS
from geomesh_p2p.dht.state import Contact
from geomesh_p2p.net import swarm_time as clock
from geomesh_p2p.net.identity import EnvelopeError, Identity, Verifier, canonical_header
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig

pytestmark = pytest.mark.timeout(30)
RUN = "clock-steps"
BOOT = "127.0.0.1:1"


class Clocks:
    """A machine's wall clock (``wall``, steppable) and steady clock (``steady``), both moved by hand; the
    true time is what the wall clock would read had it never been stepped."""

    def __init__(self) -> None:
        self.t0, self.elapsed, self.step = 1_700_000_000.0, 0.0, 0.0

    def wall(self) -> float:
        return self.t0 + self.elapsed + self.step

    def steady(self) -> float:
        return 5_000.0 + self.elapsed

    def true(self) -> float:
        return self.t0 + self.elapsed


def _node(c: Clocks) -> tuple[DHTNode, Contact]:
    """A DHT node (not started: no socket) on ``c``'s clocks that joined with offset 0 to one bootstrap."""
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    node = DHTNode(t, clock=c.wall, steady_clock=c.steady)
    boot = Contact(Identity.generate().peer_id, BOOT)
    node._offsets[boot.peer_id] = 0.0
    node._measure_clock([boot], refuse=True)  # join: the clocks agree
    return node, boot


def _remeasure(node: DHTNode, boot: Contact, c: Clocks, other_clock_ahead_s: float = 0.0) -> None:
    """One bootstrap ping's measurement: the bootstrap's clock (true time + ``other_clock_ahead_s``) minus
    this machine's wall clock."""
    node._offsets[boot.peer_id] = c.true() + other_clock_ahead_s - c.wall()
    node._measure_clock([boot], refuse=False)


@pytest.mark.parametrize("step_s", [90.0, 150.0, -150.0])
def test_a_step_of_the_wall_clock_leaves_swarm_time_and_the_envelopes_right(step_s, monkeypatch, caplog):
    c = Clocks()
    node, boot = _node(c)
    c.elapsed = 30.0
    assert node.now() == c.true()
    c.step = step_s  # NTP steps this machine's clock (or someone runs date -s)
    assert node.clock_offset_s == -step_s  # corrected at once, no re-measurement needed
    assert node.now() == c.true()
    c.elapsed = 45.0
    assert node.now() == c.true()  # and it keeps running with the steady clock
    with caplog.at_level(logging.DEBUG, logger="geomesh_p2p.dht.node"):
        for _ in range(CLOCK_CONFIRMATIONS + 1):  # the next pings confirm it: nothing to change, nothing to say
            _remeasure(node, boot, c)
    assert node.clock_offset_s == pytest.approx(-step_s)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], [r.getMessage() for r in caplog.records]

    # This process's swarm time follows the node (as a peer does: node/peer.py); envelopes are stamped with it,
    # and a peer whose clock was never stepped (swarm time = true time) accepts them within its +-120 s.
    monkeypatch.setattr(clock, "time", SimpleNamespace(time=c.wall))
    clock.follow(lambda: node.clock_offset_s)
    try:
        assert clock.swarm_time() == c.true()
        msg = node.identity.sign_message(run_id=RUN, round=3, kind="k", payload=b"part")
        assert msg.envelope.timestamp == c.true()
        honest = Verifier(RUN, max_skew_s=120.0, clock=c.true)
        assert honest.verify(msg).payload == b"part"
        # this peer judges the honest peer's envelopes in the same time
        theirs = Identity.generate()
        stamped = theirs.sign_message(run_id=RUN, round=3, kind="k", payload=b"x")
        assert Verifier(RUN, max_skew_s=120.0).verify(stamped).sender == theirs.peer_id
    finally:
        clock.follow(None)
        clock.set_offset(0.0)


def test_the_raw_clock_after_a_150_s_step_is_refused_as_before():
    # What the peer sent before this change (the raw wall clock): refused by every peer with the right time.
    c = Clocks()
    c.step = 150.0
    honest = Verifier(RUN, max_skew_s=120.0, clock=c.true)
    ident = Identity.generate()
    env = ident.sign_message(run_id=RUN, round=3, kind="k", payload=b"p")
    env.envelope.timestamp = c.wall()
    env.envelope.signature = ident.sign(canonical_header(env.envelope))
    with pytest.raises(EnvelopeError) as e:
        honest.verify(env)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_a_suspend_moves_both_clocks_and_changes_nothing():
    c = Clocks()
    node, boot = _node(c)
    c.elapsed = 600.0  # the laptop slept 10 minutes: CLOCK_BOOTTIME counted them, the wall clock too
    assert node.clock_offset_s == 0.0 and node.now() == c.true()
    _remeasure(node, boot, c)
    assert node.clock_offset_s == 0.0


@pytest.mark.parametrize("jump_s", [50.0, -55.0, 20.0])
def test_a_jump_no_step_explains_is_followed_once_confirmed_with_one_warning(jump_s, caplog):
    # The bootstraps' clock moved (or a suspend the steady clock did not count): the measured offset jumps.
    c = Clocks()
    node, boot = _node(c)
    c.elapsed = 10.0
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.dht.node"):
        for i in range(CLOCK_CONFIRMATIONS - 1):
            c.elapsed += 15.0
            _remeasure(node, boot, c, other_clock_ahead_s=jump_s)
            assert node.clock_offset_s == 0.0  # one or two replies are not a moved clock yet
        c.elapsed += 15.0
        _remeasure(node, boot, c, other_clock_ahead_s=jump_s)
    # followed (before: a jump over 60 s only warned, and the old offset stayed for good)
    assert node.clock_offset_s == jump_s
    assert node.now() == c.true() + jump_s
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].startswith(f"swarm time moved {jump_s:+.1f} s against this machine's clock")
    assert "set it right (NTP)" not in lines[0]


@pytest.mark.parametrize("jump_s", [90.0, -150.0, 100_000.0])
def test_the_bootstraps_time_is_not_followed_past_the_skew_the_swarm_tolerates(jump_s, caplog):
    """Red team: one hostile bootstrap moved a peer's swarm time by 100,000 s in one confirmed jump, and every
    honest peer then refused its envelopes. Past max_clock_skew_s from where it stood at join (against the
    steady clock), the bootstraps' time is not followed: one WARNING, the offset stays."""
    c = Clocks()
    node, boot = _node(c)
    with caplog.at_level(logging.INFO, logger="geomesh_p2p.dht.node"):
        for _ in range(2 * CLOCK_CONFIRMATIONS):
            c.elapsed += 15.0
            _remeasure(node, boot, c, other_clock_ahead_s=jump_s)
    assert node.clock_offset_s == 0.0 and node.now() == c.true()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and f"moved {jump_s:+.0f} s since this node joined" in lines[0]
    assert "not followed past 60 s" in lines[0]


def test_a_walk_in_small_steps_stops_at_the_tolerated_skew():
    c = Clocks()
    node, boot = _node(c)
    ahead = 0.0
    for _ in range(30):  # 4.9 s at a time: each under CLOCK_JUMP_S, followed at once as drift
        ahead += 4.9
        c.elapsed += 15.0
        _remeasure(node, boot, c, other_clock_ahead_s=ahead)
    assert node.clock_offset_s == pytest.approx(58.8)  # 12 steps; the 13th would pass 60 s
    # a step of this machine's own wall clock is still corrected in full (it moves the steady anchor too)
    c.step = 500.0
    assert node.now() == pytest.approx(c.true() + 58.8)


def test_one_hostile_bootstrap_of_two_cannot_move_the_offset():
    c = Clocks()
    node, boot = _node(c)
    liar = Contact(Identity.generate().peer_id, "127.0.0.1:2")
    for _ in range(2 * CLOCK_CONFIRMATIONS):
        c.elapsed += 15.0
        node._offsets[boot.peer_id] = c.true() - c.wall()
        node._offsets[liar.peer_id] = c.true() + 40.0 - c.wall()  # the median of two is the larger
        node._measure_clock([boot, liar], refuse=False)
    assert node.clock_offset_s == 0.0


def test_measurements_that_disagree_do_not_move_the_offset():
    c = Clocks()
    node, boot = _node(c)
    for ahead in (40.0, 90.0, 40.0, 90.0):  # replies delayed in queues, not a clock that moved
        c.elapsed += 15.0
        _remeasure(node, boot, c, other_clock_ahead_s=ahead)
    assert node.clock_offset_s == 0.0
    c.elapsed += 15.0
    _remeasure(node, boot, c, other_clock_ahead_s=2.0)  # drift under CLOCK_JUMP_S: followed at once
    assert node.clock_offset_s == 2.0


async def test_a_wrong_step_correction_is_dropped_when_every_bootstrap_refuses_this_nodes_time(caplog):
    # A suspend on a system whose steady clock stopped meanwhile looks like a step: the correction makes the
    # swarm time wrong and the bootstraps refuse the pings; the node drops the correction and measures again.
    c = Clocks()
    node, boot = _node(c)
    node.bootstrap_addresses = [BOOT]
    c.step = 600.0  # the wall clock ran on during the suspend, the steady clock did not
    assert node.now() == c.true()  # corrected as a step: 600 s behind the bootstraps' time
    offered: list[float] = []

    async def ping(address, *, expected=None):
        offered.append(node.now())
        if abs(node.now() - (c.true() + 600.0)) > 120:
            raise RpcError(
                address, "dht.Ping", grpc.StatusCode.OUT_OF_RANGE, "timestamp is -600.0s from this node's clock"
            )
        node._offsets[boot.peer_id] = c.true() + 600.0 - c.wall()
        return boot

    node.ping = ping  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="geomesh_p2p.dht.node"):
        assert await node.ping_bootstraps() == 0
        assert node.now() == c.wall()  # the correction is gone: this machine's clock plus the measured 0 s
        assert await node.ping_bootstraps() == 1
    assert node.clock_offset_s == 0.0 and node.now() == c.true() + 600.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("every bootstrap refuses this node's time after a +600 s change")
    await node.shutdown()


def test_the_process_clock_corrects_a_step_when_it_follows_no_node(monkeypatch):
    # A bootstrap sets its offset once and follows no DHT: its envelopes stay right across a step too.
    c = Clocks()
    monkeypatch.setattr(clock, "time", SimpleNamespace(time=c.wall))
    monkeypatch.setattr(clock, "_steps", clock.StepWatch(c.wall, c.steady))
    try:
        clock.set_offset(0.0)
        c.step, c.elapsed = 90.0, 5.0
        assert clock.offset() == -90.0 and clock.swarm_time() == c.true()
        c.step = 0.4  # under STEP_MIN_S: left to the re-measurement
        assert clock.offset() == 0.0
    finally:
        clock.set_offset(0.0)


def test_the_real_steady_clock_does_not_see_steps_of_its_own():
    w = clock.StepWatch()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.05:
        assert w.moved() == 0.0


def test_a_drift_only_one_of_two_bootstraps_measures_is_not_followed():
    c = Clocks()
    node, boot = _node(c)
    liar = Contact(Identity.generate().peer_id, "127.0.0.1:2")
    c.elapsed += 15.0
    node._offsets[boot.peer_id] = c.true() - c.wall()
    node._offsets[liar.peer_id] = c.true() + 4.9 - c.wall()
    node._measure_clock([boot, liar], refuse=False)
    assert node.clock_offset_s == 0.0
    node._offsets[liar.peer_id] = c.true() + 0.8 - c.wall()  # jitter both measure: followed
    node._measure_clock([boot, liar], refuse=False)
    assert node.clock_offset_s == pytest.approx(0.8)
