"""The round plan's size on the wire (issue 25): version 1 (the plan's JSON as one DHT value) against
version 2 (:mod:`geomesh_p2p.plan.wire`: columnar JSON, zlib; chunks over 60,000 bytes), at N participants
of a synthetic plan with realistic fields (tests/plan_util.py: random PeerIDs and IPv4 addresses, float
predictions), and the CPU time to encode and to decode (one run, this machine's load included).

Usage (the table of docs/round.md, "The plan's size on the wire"):

    .venv/bin/python benchmarks/plan_size.py               # N = 4 16 100 200 1024 4096
    .venv/bin/python benchmarks/plan_size.py 512 2048
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.plan.wire import PLAN_VALUE_BYTES, decode_body, split_plan  # noqa: E402
from tests.plan_util import big_plan  # noqa: E402


def row(n: int) -> dict:
    """Sizes (bytes) and times (ms) for one plan of ``n`` participants."""
    plan = big_plan(n, seed=n)
    v1 = plan.to_bytes()
    t = time.perf_counter()
    wire = split_plan(plan)
    encode_ms = 1e3 * (time.perf_counter() - t)
    body = b"".join(wire.chunks) if wire.chunks else wire.head[9:]
    t = time.perf_counter()
    assert decode_body(body) == plan
    decode_ms = 1e3 * (time.perf_counter() - t)
    return {
        "n": n,
        "v1_json": len(v1),
        "v1_fits": len(v1) <= 64 << 10,
        "v1_json_zlib": len(zlib.compress(v1, 9)),
        "v2_body": wire.body_bytes,
        "v2_head": len(wire.head),
        "v2_chunks": len(wire.chunks),
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
    }


def main(argv: list[str]) -> None:
    ns = [int(a) for a in argv] or [4, 16, 100, 200, 1024, 4096]
    print(f"values of at most {PLAN_VALUE_BYTES} bytes; DHT limit 65536")
    print("| N | v1 JSON | fits one value | JSON+zlib | v2 body | v2 head | v2 chunks | encode ms | decode ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in ns:
        r = row(n)
        print(
            f"| {r['n']} | {r['v1_json']} | {'yes' if r['v1_fits'] else 'no'} | {r['v1_json_zlib']} | {r['v2_body']}"
            f" | {r['v2_head']} | {r['v2_chunks']} | {r['encode_ms']:.1f} | {r['decode_ms']:.1f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
