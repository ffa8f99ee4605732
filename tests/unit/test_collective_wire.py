"""Issue 17: the collective's hand-written wire format (collective/wire.py) is protobuf's, messages are
read without copies, and the one-pass finiteness check catches every NaN / Inf."""

import hashlib

import numpy as np
import pytest
import torch

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.codec._format import all_finite
from geomesh_p2p.net.identity import Identity, Verifier
from geomesh_p2p.wire import collective_pb2, envelope_pb2

pytestmark = pytest.mark.timeout(60)


def test_hand_built_signed_contribution_is_protobufs_and_verifies():
    ident = Identity.generate()
    packet = np.arange(1000, dtype="<f4")
    head = collective_pb2.PartContribution(
        round=3, part=1, start=10, end=1010, tokens=7, spec_id=b"s" * 32, encoding="fp32", compute_end=1.5
    ).SerializeToString()
    payload = [head, *wire.bytes_field(8, [memoryview(packet).cast("B")])]
    signed = b"".join(wire.signed_parts(ident, run_id="r", round=3, kind="k", payload=payload))
    msg = envelope_pb2.SignedMessage.FromString(signed)  # protobuf reads the hand-built bytes
    c = collective_pb2.PartContribution.FromString(msg.payload)
    assert (c.round, c.part, c.start, c.end, c.tokens, c.encoding, c.compute_end) == (3, 1, 10, 1010, 7, "fp32", 1.5)
    assert c.packet == packet.tobytes()
    assert msg.envelope.payload_sha256 == hashlib.sha256(msg.payload).digest()
    view = wire.SignedView(signed)  # and the scanner reads it without copying the payload
    assert isinstance(view.payload, memoryview) and view.payload.obj is signed
    assert bytes(view.payload) == msg.payload
    v = Verifier("r").verify(view, kind="k", check_replay=False)
    assert v.sender == ident.peer_id and v.round == 3


def test_scanner_reads_protobuf_built_messages_and_refuses_malformed():
    res = collective_pb2.PartResult(
        round=2, part=0, contributors=[b"a" * 32, b"b" * 32], tokens=[1, 2], aggregate=b"\x01\x02\x03", mode="reencode"
    )
    res.contributions.extend([collective_pb2.Contribution(signed_message=b"xyz")])
    data = res.SerializeToString()
    spans = wire.scan(data)
    assert bytes(wire.one_bytes_field(data, spans, 10, "PartResult")) == b"\x01\x02\x03"
    small = collective_pb2.PartResult.FromString(wire.small_fields(data, spans, (9, 10)))
    assert list(small.tokens) == [1, 2] and small.aggregate == b"" and len(small.contributions) == 0
    item = wire.value(data, next(s for s in spans if s[0] == 9))
    assert bytes(wire.one_bytes_field(item, wire.scan(item), 1, "Contribution")) == b"xyz"
    for bad in (data[:-1], b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b", b"\x00\x01"):
        with pytest.raises(wire.WireError):
            wire.scan(bad)
    with pytest.raises(wire.WireError):  # a payload field given twice
        wire.SignedView(b"\x12\x01a\x12\x01b")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 777_777, 2_000_000 - 1])
def test_all_finite_one_pass_catches_every_non_finite(bad, where):
    t = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    assert all_finite(t)
    t[where] = bad
    assert not all_finite(t)
    assert not all_finite(t[: where + 1]) and (where == 0 or all_finite(t[:where]))
