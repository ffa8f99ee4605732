"""The process-level tests of ``tests/integration/test_dht_guard.py`` (they start OS processes)."""

from __future__ import annotations

import time
import grpc
from geomesh_p2p.dht import make_record
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import RpcError, Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.net.methods import DHT_STORE
from geomesh_p2p.trust.admission import solve_pow
from geomesh_p2p.wire import dht_pb2
from tests.proc_util import MiB, bootstrap_args
from tests.integration.test_dht_guard import _store_req  # noqa: F401


async def test_bootstrap_memory_under_a_store_flood_from_one_identity(servers, tmp_path):
    """One identity offers 256 MiB of signed 64 KiB records with a 24 h lifetime to a bootstrap: it
    keeps its quota's worth (2 MiB) and its memory stays flat. Before: every record was kept."""
    run = "flood-test"
    boot = servers(
        bootstrap_args(
            run, tmp_path / "boot.key", "--status-interval", "3600", "--log-level", "ERROR", "--pow-bits", "8"
        )
    )
    me = Identity.generate()
    # the work a record under a run key needs (0.10.0): this identity has it, so the quota is what is tested
    nonce = solve_pow(run, bytes(me.peer_id), 8)
    client = Transport(me, run, TransportConfig(client_only=True))
    try:
        warm = [
            make_record(f"{run}/warm/{i}", b"w", time.time() + 60, owner=me, run_id=run, pow_nonce=nonce)
            for i in range(4)
        ]
        await client.call(boot.address, DHT_STORE, _store_req(me, warm))
        hwm0 = boot.kib("VmHWM")
        value = bytes(64 << 10)
        day = time.time() + 24 * 3600 - 60
        stored = 0
        for batch in range(64):  # 64 x 64 records x 64 KiB = 256 MiB
            recs = [
                make_record(f"{run}/flood/{batch}/{i}", value, day, owner=me, run_id=run, pow_nonce=nonce)
                for i in range(64)
            ]
            try:
                reply = await client.call(boot.address, DHT_STORE, _store_req(me, recs), timeout=30)
                stored += sum(o.stored for o in dht_pb2.StoreResponse.FromString(reply.payload).outcomes)
            except RpcError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        grown_mib = (boot.kib("VmHWM") - hwm0) / 1024
        print(f"stored {stored} records; bootstrap peak RSS grew by {grown_mib:.0f} MiB")
        assert 0 < stored and stored * (64 << 10) <= 2 * MiB  # its quota's worth taken, no more
        assert grown_mib < 64, f"bootstrap peak RSS grew by {grown_mib:.0f} MiB"
    finally:
        await client.stop()
