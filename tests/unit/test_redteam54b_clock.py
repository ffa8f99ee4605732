"""Red team 54b: the round-trip bound on a bootstrap's clock sample (commits 6e54faec, 6ac2384a;
``DHTProtocol._clock_sample_ok``). Fixed after: the bound follows the shortest of a bootstrap's last
``CLOCK_RTT_WINDOW`` pings (a link that became slow is followed again), only bootstraps' samples are kept (no eviction
makes a stalled ping a "first" sample), and the round trip is measured on the steady clock.

Clocks injected as in tests/unit/test_clock_steps.py and tests/unit/test_redteam54_clock.py (no sockets).
"""

from __future__ import annotations

import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.preflight import DHT_PROTOCOL_VERSION
from geomesh_p2p.dht.state import Contact
from geomesh_p2p.net.identity import Identity, Verified
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.wire import dht_pb2
from tests.unit.test_clock_steps import RUN, Clocks

pytestmark = pytest.mark.timeout(30)


class Link:
    """How one bootstrap answers: ``out_s`` on the wire to it, ``back_s`` back; its clock reads true time +
    ``ahead_s``; ``stall_s``: this process is stopped after the answer arrived, before it reads it; ``step_s``:
    this machine's wall clock is stepped by this much while it is stopped."""

    def __init__(self, address: str, out_s=0.001, back_s=0.001, ahead_s=0.0) -> None:
        self.id, self.address = Identity.generate(), address
        self.out_s, self.back_s, self.ahead_s, self.stall_s, self.step_s = out_s, back_s, ahead_s, 0.0, 0.0


def _node(c: Clocks, links: list[Link]) -> DHTNode:
    """A DHT node on ``c``'s clocks joined (offset 0: the clocks agree) to the bootstraps of ``links``, whose
    transport answers as those links say."""
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    node = DHTNode(t, clock=c.wall, steady_clock=c.steady)
    node.bootstrap_addresses = [x.address for x in links]
    by_address = {x.address: x for x in links}

    async def call(address, method, payload, timeout=None, **kw):
        x = by_address[address]
        c.elapsed += x.out_s
        answered_at = c.true() + x.ahead_s
        c.elapsed += x.back_s + x.stall_s
        c.step += x.step_s
        resp = dht_pb2.PingResponse(node=node.self_info(), time=answered_at, dht_protocol=DHT_PROTOCOL_VERSION)
        return Verified(x.id.peer_id, x.id.public_key_bytes, RUN, 0, method, answered_at, resp.SerializeToString())

    t.call = call  # type: ignore[method-assign]
    return node


async def _join(node: DHTNode, links: list[Link]) -> None:
    for x in links:  # the join's pings (DHTJoin.join pings each bootstrap, then measures the clock)
        await node.ping(x.address)
    node._measure_clock([Contact(x.id.peer_id, x.address) for x in links], refuse=True)


async def _follows_in_40_pings(node: DHTNode, c: Clocks, ahead_s: float, answering: int) -> None:
    """40 bootstrap pings, 15 s apart (10 minutes at ``bootstrap_refresh_s`` 15), each answered by ``answering``
    bootstraps; then swarm time is within 0.7 s of the bootstraps' clock, ``ahead_s`` ahead of the true time."""
    for _ in range(40):
        c.elapsed += 15.0
        assert await node.ping_bootstraps() == answering
    swarm = c.true() + ahead_s
    assert abs(node.now() - swarm) < 0.7, f"swarm time off by {node.now() - swarm:+.2f} s after 40 pings"


async def test_a_link_that_became_slow_still_follows_the_bootstraps_clock():
    c = Clocks()
    boot = Link("127.0.0.1:1")
    node = _node(c, [boot])
    await _join(node, [boot])
    assert node.now() == pytest.approx(c.true(), abs=0.01)
    boot.out_s = boot.back_s = 0.6  # from now on the route (or the bootstrap, under load) takes 1.2 s
    boot.ahead_s = 3.0  # the bootstraps' (the swarm's) clock was set 3 s forward
    await _follows_in_40_pings(node, c, 3.0, answering=1)


async def test_control_the_same_move_on_a_fast_link_is_followed():
    c = Clocks()
    boot = Link("127.0.0.1:1")
    node = _node(c, [boot])
    await _join(node, [boot])
    boot.ahead_s = 3.0
    c.elapsed += 15.0
    await node.ping_bootstraps()
    assert node.now() == pytest.approx(c.true() + 3.0, abs=0.01)


async def test_stale_samples_of_slow_bootstraps_do_not_outvote_a_fresh_one():
    c = Clocks()
    links = [Link(f"127.0.0.1:{i}") for i in (1, 2, 3)]
    node = _node(c, links)
    await _join(node, links)
    for x in links:
        x.ahead_s = 3.0  # NTP on the bootstraps moved the swarm's clock
    for x in links[1:]:
        x.out_s = x.back_s = 0.6
    await _follows_in_40_pings(node, c, 3.0, answering=3)


async def test_a_stalled_ping_after_the_offsets_table_was_cleared_does_not_move_swarm_time():
    c = Clocks()
    boot, other = Link("127.0.0.1:1"), Link("127.0.0.1:2")
    node = _node(c, [boot, other])
    node.bootstrap_addresses = [boot.address]
    await _join(node, [boot])
    c.elapsed += 30.0
    for i in range(64 * node.k):  # nodes pinged over a long run in a churning swarm (ids only matter here)
        node._offsets[f"n{i}"] = 0.0  # type: ignore[index]
    await node.ping(other.address)  # one more ping (a bucket's least recently seen node): the table was cleared
    assert boot.id.peer_id in node._offsets  # fixed: only bootstraps' samples are kept, nothing evicts them
    boot.stall_s = 9.0  # the peer is stopped (SIGSTOP, a loop stall) with the bootstrap's answer unread
    c.elapsed += 15.0
    assert await node.ping_bootstraps() == 1
    err = node.now() - c.true()
    assert abs(err) < 1.0, f"swarm time off by {err:+.2f} s after one ping read 9 s late"


async def test_a_stalled_ping_across_a_backward_step_does_not_move_swarm_time():
    c = Clocks()
    boot = Link("127.0.0.1:1")
    node = _node(c, [boot])
    await _join(node, [boot])
    c.elapsed += 30.0
    boot.stall_s, boot.step_s = 4.5, -4.0
    assert await node.ping_bootstraps() == 1
    boot.stall_s = boot.step_s = 0.0
    err = node.now() - c.true()
    assert abs(err) < 1.0, f"swarm time off by {err:+.2f} s"


async def test_a_slow_first_sample_at_join_is_bounded_and_corrected_by_the_next_ping():
    """Evidence (passes): the join's first sample is taken whatever its round trip (a 3 s stall: 1.5 s off, bounded
    by half the DHT's rpc timeout, 3 s by default); the next fast bootstrap ping (15 s later) corrects it at once."""
    c = Clocks()
    boot = Link("127.0.0.1:1")
    boot.stall_s = 2.9
    node = _node(c, [boot])
    await _join(node, [boot])
    assert node.now() - c.true() == pytest.approx(-1.45, abs=0.01)
    boot.stall_s = 0.0
    c.elapsed += 15.0
    await node.ping_bootstraps()
    assert node.now() == pytest.approx(c.true(), abs=0.01)
