"""Red team 54: a peer whose process is paused (SIGSTOP, a swapped-out laptop, an event loop that stalls) while a
bootstrap ping is in flight.

The DHT re-measures the offset to the bootstraps at every bootstrap ping (``DHTNode.ping_bootstraps``) with NTP's
one-exchange estimate, ``their_time - (t0 + t1) / 2`` (``dht/protocol.ping_offset``), and no bound on the exchange's
round trip. Fixed (``dht.protocol.MAX_CLOCK_RTT_S``): a ping of a longer round trip than 1 s does not replace a
contact's clock sample. A reply that waited P seconds to be read (the peer was stopped, or its event loop stalled, after the
bootstrap answered) gives an offset P/2 too small; a change under ``CLOCK_JUMP_S`` (5 s) is "drift, followed at once"
(docs/dht.md, "Swarm time, and a clock that moves"). So a pause of 2-10 s during a ping moves the peer's swarm time
by 1-5 s against every other peer's until the next bootstrap ping (``refresh_period_s``, 60 s) -- while
docs/round.md asks that "owners and readers must agree on swarm time within well under late_pull_s (5 s)". NTP
drops or down-weights samples whose round trip is long; the same estimate, kept only when the round trip was short
(or taken from the shortest of several), would not move.

The clocks are injected as in tests/unit/test_clock_steps.py (no sockets): the bootstrap's clock is the true time,
this machine's clock is right (offset 0 at join), and the fake transport answers at once but the answer is read
``pause_s`` later.
"""

from __future__ import annotations

import collections

import pytest

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.dht.preflight import DHT_PROTOCOL_VERSION
from geomesh_p2p.net.identity import Identity, Verified
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.wire import dht_pb2
from tests.unit.test_clock_steps import BOOT, RUN, Clocks

pytestmark = pytest.mark.timeout(30)


def _node_and_bootstrap(c: Clocks, pause_s: float, send_late_s: float = 0.0) -> DHTNode:
    """A DHT node on ``c``'s clocks that joined one bootstrap (offset 0: the clocks agree); its transport's calls are
    answered by a bootstrap on the true clock, and the answer is read ``pause_s`` seconds after it was sent; the
    request goes out ``send_late_s`` seconds after the ping read its start time (the process stopped in between)."""
    boot = Identity.generate()
    t = Transport(Identity.generate(), RUN, TransportConfig(host="127.0.0.1", port=0))
    node = DHTNode(t, clock=c.wall, steady_clock=c.steady)
    node.bootstrap_addresses = [BOOT]
    node._offsets[boot.peer_id] = 0.0
    from geomesh_p2p.dht.state import Contact

    node._measure_clock([Contact(boot.peer_id, BOOT)], refuse=True)
    assert node.clock_offset_s == 0.0

    async def call(address, method, payload, timeout=None, **kw):
        c.elapsed += send_late_s
        c.elapsed += 0.002  # 2 ms on the wire, answered at once on the bootstrap's (true) clock
        answered_at = c.true()
        resp = dht_pb2.PingResponse(node=node.self_info(), time=answered_at, dht_protocol=DHT_PROTOCOL_VERSION)
        c.elapsed += pause_s  # ... and read by this process only after it was continued
        return Verified(boot.peer_id, boot.public_key_bytes, RUN, 0, method, answered_at, resp.SerializeToString())

    t.call = call  # type: ignore[method-assign]
    return node


@pytest.mark.parametrize(
    "read_late_s, sent_late_s",
    [(0.0, 0.0), (0.5, 0.0), (3.0, 0.0), (9.0, 0.0), (0.0, 3.0), (0.0, 9.0)],
)
async def test_a_ping_read_or_sent_late_after_a_pause_does_not_move_swarm_time(read_late_s, sent_late_s):
    """Read late, the reply's time is taken as P/2 too early (swarm time back by P/2); sent late, as P/2 too late."""
    c = Clocks()
    node = _node_and_bootstrap(c, read_late_s, send_late_s=sent_late_s)
    c.elapsed = 30.0
    assert await node.ping_bootstraps() == 1
    # nothing moved any clock: this machine's clock is still right, so swarm time must still be the true time
    err = node.now() - c.true()
    assert abs(err) < (0.5 if read_late_s + sent_late_s < 1.0 else 1.0), f"swarm time off by {err:+.2f} s"


async def test_a_slow_link_keeps_following_the_bootstraps_clock():
    """The bound is relative on a slow link: a bootstrap that always answers in 1.5 s (a satellite link under load)
    still moves this node's offset (its estimate is off by at most 0.75 s there), and a pause on top of it does not."""
    c = Clocks()
    node = _node_and_bootstrap(c, 1.5)
    boot = next(iter(node._offsets))
    c.elapsed = 30.0
    assert await node.ping_bootstraps() == 1  # 1.5 s: its window's shortest, taken (its error: the 0.75 s below)
    assert list(node._rtts[boot]) == [pytest.approx(1.502)]
    assert node._offsets[boot] == pytest.approx(-0.749, abs=1e-3)
    node2 = _node_and_bootstrap(c, 1.5 + 9.0)
    node2._rtts[next(iter(node2._offsets))] = collections.deque([1.502], maxlen=4)
    before = node2.now() - c.true()
    assert await node2.ping_bootstraps() == 1  # 10.5 s: over 2 x 1.5 s, not taken
    assert node2.now() - c.true() == pytest.approx(before)
