"""A relay result served without the reader's own contribution and put back whole (``exchange/own_entry.py``,
issue 26): exact bytes, and what a reader refuses."""

from __future__ import annotations

import grpc
import pytest

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.exchange.own_entry import omit_entry, restore_entry
from geomesh_p2p.net.identity import EnvelopeError, Identity

pytestmark = pytest.mark.timeout(30)

OWNER = Identity.generate()
ENTRIES = [bytes([i]) * (300 + 50 * i) for i in range(4)]  # stand-ins for 4 signed contributions


def _result(entries: list[bytes]) -> bytes:
    """A relay result as build_result lays it out: a head, then one field-9 entry per contribution, signed."""
    payload: list[wire.Buffer] = [b"\x08\x07\x10\x02"]  # round 7, part 2
    for e in entries:
        payload.extend(wire.bytes_field(9, wire.bytes_field(1, [e])))
    return b"".join(wire.signed_parts(OWNER, run_id="run", round=7, kind="k", payload=payload))


def test_each_entry_left_out_and_put_back_gives_the_signed_bytes_back():
    signed = _result(ENTRIES)
    for k, own in enumerate(ENTRIES):
        served = b"".join(omit_entry(signed, k))
        assert len(signed) - len(served) >= len(own)  # the reader's own bytes are not sent back
        assert own not in served
        assert restore_entry(served, own) == signed
    assert restore_entry(signed, ENTRIES[0]) is signed  # an owner that sent everything: nothing to put back


def test_a_wrong_or_double_gap_does_not_restore_the_signed_bytes():
    signed = _result(ENTRIES)
    # the reader's own contribution put into another's gap: other bytes, so the owner's signature fails later
    assert restore_entry(b"".join(omit_entry(signed, 1)), ENTRIES[2]) != signed
    twice = b"".join(omit_entry(b"".join(omit_entry(signed, 0)), 3))
    with pytest.raises(EnvelopeError) as ei:
        restore_entry(twice, ENTRIES[0])
    assert (
        ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "leaves out 2 contributions, not one" in ei.value.reason
    )
    with pytest.raises(EnvelopeError, match="not a SignedMessage"):
        restore_entry(b"\x0a\xff", ENTRIES[0])
