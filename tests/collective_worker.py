"""One collective peer in its own OS process, for the multi-process failure tests.

    python tests/collective_worker.py [--client-only] [--run RUN]

Protocol, JSON lines on stdin/stdout:

1. prints ``{"event": "ready", "peer_id": ..., "address": ...}`` (address null when client-only);
2. reads ``{"spec": CollectiveSpec.to_dict(), "seed": int, "tokens": int, "out": path,
   "stall_after_part": int | null}``; its delta is ``torch.randn(numel, generator=seed)``;
   with ``stall_after_part = k`` it delivers only part ``k`` (then prints
   ``{"event": "delivered", "part": k}``) and never delivers the others (to be killed mid-round);
3. runs the all-reduce, writes the aggregate to ``out`` (raw little-endian fp32) and prints
   ``{"event": "done", "missing": [...], "contributors": {...}, "pushed": {...}, "finished_at": unix s}``;
4. keeps serving (others may still pull from it) until it reads ``exit`` or EOF, then stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

import torch

from geomesh_p2p.exchange import CollectiveService, CollectiveSpec
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class StallingService(CollectiveService):
    stall_after_part = None

    async def _before_push(self, spec, part):
        if self.stall_after_part is not None and part != self.stall_after_part:
            await asyncio.Event().wait()  # never delivers this part

    async def _deliver(self, state, j, delta, tokens, uploads=None):
        ok = await super()._deliver(state, j, delta, tokens, uploads)
        if self.stall_after_part == j:
            emit({"event": "delivered", "part": j, "accepted": ok})
        return ok


async def read_line(loop) -> str:
    return await loop.run_in_executor(None, sys.stdin.readline)


async def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--client-only", action="store_true")
    ap.add_argument("--run", default="collective-test")
    ns = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    ident = Identity.generate()
    transport = Transport(ident, ns.run, TransportConfig(client_only=ns.client_only))
    service = StallingService(transport)
    address = await transport.start()
    emit({"event": "ready", "peer_id": ident.peer_id.to_string(), "address": address})
    loop = asyncio.get_running_loop()
    try:
        job = json.loads(await read_line(loop))
        spec = CollectiveSpec.from_dict(job["spec"])
        service.stall_after_part = job.get("stall_after_part")
        delta = torch.randn(spec.numel, generator=torch.Generator().manual_seed(job["seed"]))
        res = await service.all_reduce(spec, delta, job["tokens"])
        finished = time.time()
        with open(job["out"], "wb") as f:
            f.write(res.aggregate.numpy().astype("<f4").tobytes())
        emit(
            {
                "event": "done",
                "missing": res.missing_parts,
                "finished_at": finished,
                "contributors": {str(j): c for j, c in res.contributors.items()},
                "pushed": {str(j): ok for j, ok in res.pushed.items()},
                "bytes_sent": res.bytes_sent,
                "bytes_received": res.bytes_received,
            }
        )
        while True:
            line = await read_line(loop)
            if not line or line.strip() == "exit":
                break
    finally:
        await service.close()
        await transport.stop(grace=0.2)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
