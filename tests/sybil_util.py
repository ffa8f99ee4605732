"""A Sybil announcer for tests and benchmarks (issue 12): ONE process announces ``n`` identities as fast
GPUs that never take part.

Each identity carries a valid proof of work at the run's difficulty, copies the round, digest and run
config the honest peers announce (so it looks in sync and is "planned in"), claims 20x the honest
peers' best tokens/s, 80 GB, batch 256 and 1 GB/s links, and vouches for the other Sybils with full
standing (32 rounds) so that a fresh joiner reads them as having history. The records point at this
process's own gRPC server, which serves the DHT and nothing else: a Sybil never pushes a contribution,
never serves a part, never publishes a plan.

    python -m tests.sybil_util --bootstrap 127.0.0.1:PORT --run-id test-swarm --pow-bits 8 --n 30

Logs ``sybil: announced N identities at round R`` (one line per round it first announces) and runs
until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections import Counter
from typing import Optional, Sequence

log = logging.getLogger("sybil")

#: What each Sybil claims, relative to the best honest peer it sees (the planner bounds claims to 8x
#: the median; claiming more is free).
SYBIL_SPEEDUP = 20.0
SYBIL_MEMORY = 80 << 30
SYBIL_BATCH = 256
SYBIL_LINK_BPS = 1e9


async def announce_sybils(
    bootstrap: Sequence[str],
    *,
    n: int,
    run_id: str,
    pow_bits: int,
    period_s: float = 2.0,
    poll_s: float = 0.2,
    ttl_s: float = 8.0,
    vouch: bool = True,
    store_concurrency: int = 8,
    from_round: int = 0,
    stop: Optional[asyncio.Event] = None,
    host: str = "127.0.0.1",
) -> None:
    """Announce ``n`` Sybil identities until ``stop`` is set (see the module doc): the honest records are
    read every ``poll_s`` seconds and the Sybils re-announced at once when the honest (round, digest)
    moves (so they are in sync when the honest peers gather), else every ``period_s`` seconds, at most
    ``store_concurrency`` stores at a time (this process is also a DHT node that the honest peers read
    from: a burst of 30 concurrent stores keeps its event loop busy, and every honest DHT read waits for
    its slowest replica, up to ~1.5 s on 2 cores: that is the DHT's to bound, not the planner's). Nothing
    is announced before the honest peers reach round ``from_round`` (so a test can start this process
    early and still have clean rounds)."""
    from geomesh_p2p.trust.admission import solve_pow
    from geomesh_p2p.dht import DHTNode, live_peers, peers_key
    from geomesh_p2p.net.identity import Identity
    from geomesh_p2p.schema.peer import PeerRecord
    from geomesh_p2p.trust.standing import DEFAULT_WINDOW, attest_key
    from geomesh_p2p.net.transport import Transport
    from geomesh_p2p.net.transport_config import TransportConfig

    stop = stop or asyncio.Event()
    transport = Transport(Identity.generate(), run_id, TransportConfig(host=host, port=0))
    dht = DHTNode(transport, join_attempts=8)
    address = await transport.start()
    try:
        await dht.join(list(bootstrap))
        ids = [Identity.generate() for _ in range(n)]
        nonces = [solve_pow(run_id, bytes(i.peer_id), pow_bits) for i in ids]
        mine = {str(i.peer_id) for i in ids}
        vouches = {attest_key(p): DEFAULT_WINDOW for p in sorted(mine)} if vouch else {}
        last_round, last_state, last_t = None, None, 0.0
        gate = asyncio.Semaphore(max(1, store_concurrency))

        async def limited(coro):
            async with gate:
                return await coro

        while not stop.is_set():
            honest = [r for r in await live_peers(dht, run_id) if r.peer_id not in mine and r.weights_digest]
            top = max((r.round for r in honest), default=None)
            digest = (
                Counter(r.weights_digest for r in honest if r.round == top).most_common(1)[0][0] if honest else None
            )
            if honest and top >= from_round and ((top, digest) != last_state or time.monotonic() - last_t >= period_s):
                last_state, last_t = (top, digest), time.monotonic()
                template = next(r for r in honest if r.round == top and r.weights_digest == digest)
                best = max(r.best_tokens_per_s() for r in honest)
                now = time.time()
                base = template.model_dump()
                stores = []
                for ident, nonce in zip(ids, nonces):
                    pid = str(ident.peer_id)
                    rec = PeerRecord.model_validate(
                        {
                            **base,
                            "peer_id": pid,
                            "address": address,
                            "device": "NVIDIA H100 80GB HBM3",
                            "memory_bytes": SYBIL_MEMORY,
                            "max_batch": SYBIL_BATCH,
                            "tokens_per_s": {
                                b: min(1e10, v * SYBIL_SPEEDUP * best / max(template.best_tokens_per_s(), 1e-9))
                                for b, v in template.tokens_per_s.items()
                            },
                            "upload_bps": SYBIL_LINK_BPS,
                            "download_bps": SYBIL_LINK_BPS,
                            "pow_nonce": nonce,
                            "standing": {k: c for k, c in vouches.items() if k != attest_key(pid)},
                            "leaving": False,
                            "timestamp": now,
                        }
                    )
                    stores.append(
                        limited(dht.store(peers_key(run_id), rec.to_bytes(), now + ttl_s, subkey=pid, owner=ident))
                    )
                ok = await asyncio.gather(*stores, return_exceptions=True)
                if top != last_round:
                    last_round = top
                    log.info(
                        "sybil: announced %d identities at round %d (%d stored)",
                        n,
                        top,
                        sum(1 for x in ok if x is True),
                    )
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
    finally:
        await dht.shutdown()
        await transport.stop(grace=0.2)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sybil_util", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", action="append", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--pow-bits", type=int, default=22)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--period-s", type=float, default=2.0)
    ap.add_argument("--no-vouch", action="store_true", help="the identities do not vouch for each other")
    ap.add_argument("--store-concurrency", type=int, default=8, help="DHT stores in flight at once")
    ap.add_argument("--from-round", type=int, default=0, help="announce nothing before the honest peers reach it")
    ns = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        await announce_sybils(
            ns.bootstrap,
            n=ns.n,
            run_id=ns.run_id,
            pow_bits=ns.pow_bits,
            period_s=ns.period_s,
            vouch=not ns.no_vouch,
            store_concurrency=ns.store_concurrency,
            from_round=ns.from_round,
            stop=stop,
        )

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
