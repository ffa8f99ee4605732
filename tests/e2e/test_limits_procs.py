"""The process-level tests of ``tests/integration/test_limits.py`` (they start OS processes)."""

from __future__ import annotations

import asyncio
import grpc
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.methods import DHT_PING, DHT_STORE
from tests.proc_util import MiB, bootstrap_args, signed_call
from tests.integration.test_limits import RUN, _valid_pings, ping_payload  # noqa: F401


async def _peak_rss_growth_mib(server, hwm0_kib: int, what: str) -> float:
    """After a flood: ``server`` still answers valid pings; returns (and prints) how much its peak RSS
    (VmHWM) grew since ``hwm0_kib``, in MiB."""
    await _valid_pings(server.address)
    grown_mib = (server.kib("VmHWM") - hwm0_kib) / 1024
    print(f"{what} peak RSS grew by {grown_mib:.0f} MiB")
    return grown_mib


# --------------------------------------------------------------------------- sizes, before receipt
async def test_bootstrap_refuses_oversized_requests_before_receiving_them(servers, tmp_path):
    """5 concurrent signed 64 MiB requests to a bootstrap: refused from their length prefix (the
    bootstrap's server-wide limit is its largest method's, ~4 MiB), so its memory does not grow by
    them. Before: the 128 MiB server-wide limit let each be received, parsed and hashed (+~0.3 GB)."""
    boot = servers(bootstrap_args(RUN, tmp_path / "boot.key", "--status-interval", "3600", "--log-level", "WARNING"))
    await _valid_pings(boot.address)
    hwm0 = boot.kib("VmHWM")
    attackers = [Identity.generate() for _ in range(5)]
    big = ping_payload(64 * MiB)
    codes = await asyncio.gather(
        *(signed_call(boot.address, a, DHT_PING, big, run=RUN) for a in attackers),
        *(signed_call(boot.address, a, DHT_STORE, big, run=RUN) for a in attackers),
    )
    del big
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 10
    grown_mib = await _peak_rss_growth_mib(boot, hwm0, "bootstrap")
    assert grown_mib < 32, f"bootstrap peak RSS grew by {grown_mib:.0f} MiB"


async def test_peer_receives_a_bounded_number_of_oversized_requests_at_once(servers):
    """A peer must accept 128 MiB messages (collective parts), so a 48 MiB request to Ping is received
    before it is refused; but only ``max_reads_per_ip`` (2) at a time per IP, and it is refused from
    its length, neither parsed nor verified. 6 concurrent ones: peak RSS grows by about 2 x (core
    buffer + bytes copy) ~ 200 MiB. Before: all 6 at once, each parsed and hashed (> 0.6 GB)."""
    peer = servers(["benchmarks/floods.py", "--serve", "peer", "--run-id", RUN])
    await _valid_pings(peer.address)
    hwm0 = peer.kib("VmHWM")
    attackers = [Identity.generate() for _ in range(6)]
    big = ping_payload(48 * MiB)
    codes = await asyncio.gather(*(signed_call(peer.address, a, DHT_PING, big, run=RUN) for a in attackers))
    del big
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
    grown_mib = await _peak_rss_growth_mib(peer, hwm0, "peer")
    assert grown_mib < 260, f"peer peak RSS grew by {grown_mib:.0f} MiB"
