"""``python -m geomesh_p2p.dht``: a small DHT client for checks by hand and process tests.

Joins a swarm through --bootstrap, optionally announces a minimal PeerRecord (as a peer that does not
train would), stores --put KEY=VALUE values, and prints one JSON line per --period::

    {"peer_id": "...", "address": "...", "reachable": true, "peers": ["<PeerID>", ...],
     "values": {"KEY": "VALUE"|null}, "progress": 12|null}

where ``address`` is what others dial (null: client-only, or the bootstrap could not dial it back),
``reachable`` the bootstrap's dial-back verdict (null: not checked), ``peers`` the live peers of
the run, ``values`` the --get keys and ``progress`` the newest round a bootstrap saw the run at
(null: none known). Without --watch it prints
once and exits; with --watch it runs until SIGINT/SIGTERM (exit 0). Exit 2 on bad options, 1 when
the join fails.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a program: silence gRPC's C core before grpc is first imported below
    from geomesh_p2p.util.grpc_env import quiet_grpc_core

    quiet_grpc_core()

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional

from geomesh_p2p.config.flags import add_log_level, number_type
from geomesh_p2p.config.models import DEFAULT_RUN_ID, MAX_WAIT_S
from geomesh_p2p import __version__
from geomesh_p2p.dht import DHTJoinError, DHTNode, PeerAnnouncer, live_peers
from geomesh_p2p.dht.progress import swarm_progress
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig
from geomesh_p2p.schema.shards import check_shards
from geomesh_p2p.util.exit_gc import skip_exit_collections


def _shards(text: str) -> int:
    """A --record-shards value (:func:`~geomesh_p2p.schema.shards.check_shards`); argparse's error otherwise."""
    try:
        return check_shards(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m geomesh_p2p.dht", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="node to join through (repeatable; default: none)",
    )
    ap.add_argument("--run-id", default=DEFAULT_RUN_ID, help="run id (default: %(default)s)")
    ap.add_argument(
        "--identity", default=None, metavar="PATH", help="Ed25519 key file (default: a fresh key for this process)"
    )
    ap.add_argument("--host", default="127.0.0.1", help="interface to serve on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=0, help="port; 0 = any free one (default: %(default)s)")
    ap.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="host others dial, when it differs from --host (default: --host)",
    )
    ap.add_argument("--client-only", action="store_true", help="do not serve; only call others (default: off)")
    ap.add_argument("--announce", action="store_true", help="announce a minimal PeerRecord (default: off)")
    ap.add_argument("--round", type=int, default=0, help="round the announced PeerRecord names (default: %(default)s)")
    ap.add_argument(
        "--put",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="store VALUE (UTF-8) under KEY, signed by this node, re-stored every period (repeatable; default: none)",
    )
    ap.add_argument("--get", action="append", default=[], metavar="KEY", help="key to read and print (repeatable)")
    ap.add_argument(
        "--record-shards",
        type=_shards,
        default=1,
        metavar="S",
        help="the run's --record-shards (a power of two, 1..256): the keys its peer records live under, read for "
        "'peers' and used by --announce (default: %(default)s)",
    )
    seconds = number_type(float, gt=0, le=MAX_WAIT_S)  # finite: inf and nan parse as floats
    ap.add_argument("--period", type=seconds, default=1.0, help="seconds between prints (default: %(default)s)")
    ap.add_argument("--ttl", type=seconds, default=None, help="lifetime of stored values, s (default: 3 x period)")
    ap.add_argument("--watch", action="store_true", help="keep printing until stopped (default: print once)")
    add_log_level(ap, "WARNING")
    return ap


async def run(ns: argparse.Namespace) -> int:
    identity = Identity.load_or_create(ns.identity) if ns.identity else Identity.generate()
    transport = Transport(
        identity,
        ns.run_id,
        TransportConfig(host=ns.host, port=ns.port, client_only=ns.client_only, advertise_host=ns.advertise_host),
    )
    node = DHTNode(transport, refresh_period_s=max(1.0, 5 * ns.period), republish_period_s=max(1.0, 5 * ns.period))
    ttl = ns.ttl or 3 * ns.period
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await transport.start()
        except OSError as e:
            print(f"python -m geomesh_p2p.dht: {e}", file=sys.stderr)
            return 1
        try:
            await node.join(ns.bootstrap)
        except DHTJoinError as e:
            print(f"python -m geomesh_p2p.dht: {e}", file=sys.stderr)
            return 1
        if ns.announce:
            record = PeerRecord(
                peer_id=identity.peer_id.to_string(),
                address=node.advertised_address,
                device="dht-tool",
                memory_bytes=0,
                max_batch=1,
                upload_bps=1.0,
                download_bps=1.0,
                version=__version__,
                run_config_hash="none",
                round=ns.round,
            )
            PeerAnnouncer(node, record, period_s=ns.period, ttl_s=ttl, shards=ns.record_shards).start()
        puts = [p.split("=", 1) for p in ns.put]
        while True:
            for key, value in puts:
                # signed by this node: values under a run's keys must be, and nodes keep unsigned ones briefly
                await node.store(key, value.encode(), node.now() + ttl, owner=identity)
            peers = [r.peer_id for r in await live_peers(node, ns.run_id, shards=ns.record_shards)]
            values = {}
            for key in ns.get:
                found = await node.get(key)
                values[key] = found[None].value.decode(errors="replace") if None in found else None
            progress = await swarm_progress(node)
            print(
                json.dumps(
                    {
                        "peer_id": identity.peer_id.to_string(),
                        "address": node.advertised_address,
                        "reachable": node.reachability.reachable,
                        "peers": peers,
                        "values": values,
                        "progress": None if progress is None else progress.round,
                    }
                ),
                flush=True,
            )
            if not ns.watch:
                return 0
            try:
                await asyncio.wait_for(stop.wait(), timeout=ns.period)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                return 0
    finally:
        await node.shutdown()
        await transport.stop(grace=0.5)


def main(argv: Optional[list[str]] = None) -> int:
    skip_exit_collections()  # as geomesh-peer's (docs/exit-lag.md): ~220,000 objects imported with grpc and pydantic
    ns = build_parser().parse_args(argv)
    if any("=" not in p for p in ns.put):
        print("python -m geomesh_p2p.dht: --put expects KEY=VALUE", file=sys.stderr)
        return 2
    if ns.log_level != "DEBUG":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    try:
        return asyncio.run(run(ns))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
