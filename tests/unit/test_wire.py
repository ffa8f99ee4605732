"""The committed protobuf modules are exactly what `make protos` generates from the .proto files."""

from __future__ import annotations

import pytest

from geomesh_p2p.wire.generate import WIRE, generate

pytestmark = pytest.mark.timeout(60)


def test_committed_stubs_are_fresh(tmp_path):
    generated = generate(tmp_path)
    assert generated, "protoc produced nothing"
    stale = []
    for g in generated:
        committed = WIRE / g.name
        if not committed.exists() or committed.read_bytes() != g.read_bytes():
            stale.append(g.name)
    assert not stale, f"stale stubs {stale}: run `make protos` and commit"
    # nothing committed that protoc no longer generates (e.g. the *_pb2_grpc.py service stubs)
    extra = sorted({p.name for p in WIRE.glob("*_pb2*.py*")} - {g.name for g in generated})
    assert not extra, f"committed modules that `make protos` does not generate: {extra}"
    # every committed stub has a source
    protos = {p.stem for p in WIRE.glob("*.proto")}
    for p in WIRE.glob("*_pb2*.py"):
        assert p.name.split("_pb2")[0] in protos, f"{p.name} has no .proto"
