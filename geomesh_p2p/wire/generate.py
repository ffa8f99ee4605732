"""Regenerate the committed Python protobuf modules from ``geomesh_p2p/wire/*.proto`` (``make protos``).

The message modules (``*_pb2.py``) and their type stubs (``*_pb2.pyi``) are generated with
grpcio-tools' protoc and committed; ``tests/unit/test_wire.py`` regenerates them into a temporary folder and
fails when the committed ones are stale. No gRPC service stubs (``*_pb2_grpc.py``): the transport
registers and calls its methods by full name (``geomesh_p2p.net.transport``), the services in
``envelope.proto`` only document those names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WIRE = Path(__file__).resolve().parent
ROOT = WIRE.parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run protoc on every .proto in the wire folder; outputs land under ``out_dir/geomesh_p2p/wire``.

    Raises RuntimeError when protoc fails (its message is included).
    """
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(WIRE.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    (out_dir / "geomesh_p2p" / "wire").mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {[p.name for p in protos]}")
    return sorted((out_dir / "geomesh_p2p" / "wire").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT, help="root to write geomesh_p2p/wire/*_pb2.py(i) under")
    ns = ap.parse_args(argv)
    for p in generate(ns.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
