"""Verified-work evidence's size on the wire (issue 25): version 1 (the verifier's signed evidence as one
DHT value) against version 2 (:mod:`geomesh_p2p.trust.evidence`: zlib of the same signed bytes, inline or
head + chunks of 60,000 bytes via :mod:`geomesh_p2p.dht.chunked`), at N parts of a synthetic evidence
(tests/evidence_util.py: every part's range and packet digest, 128-element parts), with the CPU time to
encode (sign + compress + split) and to decode (inflate + open: parse and check the signatures).

Usage (the table of docs/round.md, "Verified-work evidence on the wire"):

    .venv/bin/python benchmarks/evidence_size.py               # N = 4 100 512 600 1024 4096
    .venv/bin/python benchmarks/evidence_size.py 2048
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geomesh_p2p.dht.chunked import parse_head  # noqa: E402
from geomesh_p2p.net.identity import Identity  # noqa: E402
from geomesh_p2p.trust import evidence as EV  # noqa: E402
from tests.evidence_util import big_evidence  # noqa: E402

RUN = "run-2026-12-01-geomesh"


def row(n: int, v: Identity) -> dict:
    """Sizes (bytes) and times (ms) for one evidence of ``n`` parts."""
    ev = big_evidence(n, run_id=RUN, verifier=v, seed=n)
    t = time.perf_counter()
    signed = ev.to_signed(v)
    wire = EV.encode_value(signed)
    encode_ms = 1e3 * (time.perf_counter() - t)
    head = parse_head(wire.head, EV.evidence_format())
    body = head.body if head.body is not None else b"".join(wire.chunks)
    t = time.perf_counter()
    assert EV.Evidence.open(EV.decode_value(body), RUN) == ev
    decode_ms = 1e3 * (time.perf_counter() - t)
    return {
        "n": n,
        "v1": len(signed),
        "v1_fits": len(signed) <= 64 << 10,
        "v2_body": wire.body_bytes,
        "v2_head": len(wire.head),
        "v2_chunks": len(wire.chunks),
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
    }


def main(argv: list[str]) -> None:
    ns = [int(a) for a in argv] or [4, 100, 512, 600, 1024, 4096]
    v = Identity.generate()
    print(f"values of at most {EV.MAX_VALUE_BYTES} bytes; DHT limit 65536")
    print("| parts | v1 signed | fits one value | v2 body (zlib) | v2 head | v2 chunks | encode ms | decode ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        r = row(n, v)
        print(
            f"| {r['n']:,} | {r['v1']:,} | {'yes' if r['v1_fits'] else 'no'} | {r['v2_body']:,} | {r['v2_head']:,}"
            f" | {r['v2_chunks']} | {r['encode_ms']:.1f} | {r['decode_ms']:.1f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
