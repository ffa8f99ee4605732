"""Protobuf wire format by hand for the collective's part-sized messages: build them with one copy
and read them without any (issue 17).

Why: with upb, constructing a message with a bytes field copies it, ``SerializeToString`` copies it
again, and every *read* of a bytes field returns a fresh copy; a contribution nested as
PushPartRequest > SignedMessage > PartContribution > packet was copied ~9 times on the sender and
~8 times on the owner, each copy a fresh part-sized buffer (at 50 MB, ~0.1 s of page faults each on
a busy 2-core host). Here:

* :func:`signed_parts` signs a payload given as a list of buffers (its SHA-256 computed over them
  incrementally, once) and returns the SignedMessage as a list of buffers; :func:`bytes_field`
  wraps such a list as a length-delimited field of an outer message; the caller joins the final
  list once (``b"".join``: the one copy);
* :func:`scan` splits a message into its fields, big ones as ``memoryview`` slices of the received
  bytes (no copy); :func:`small_fields` re-encodes the other fields for protobuf to parse (bytes).

The bytes are the protobuf encoding of the same messages (field order may differ, which protobuf
accepts), so a protobuf-built message is read the same way and vice versa.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence, Union

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.wire import envelope_pb2
from geomesh_p2p.wire.varint import WireError, read_varint, skip_value, varint

__all__ = ["Buffer", "varint", "bytes_field", "signed_parts", "scan", "small_fields", "WireError", "SignedView"]

Buffer = Union[bytes, bytearray, memoryview]


def _nbytes(parts: Iterable[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def bytes_field(field: int, parts: Sequence[Buffer]) -> list[Buffer]:
    """Field ``field`` (wire type 2) holding the concatenation of ``parts``: ``[tag + length] + parts``."""
    return [varint(field << 3 | 2) + varint(_nbytes(parts)), *parts]


def signed_parts(identity: Identity, *, run_id: str, round: int, kind: str, payload: Sequence[Buffer]) -> list[Buffer]:
    """The SignedMessage (envelope field 1, payload field 2) of the concatenated ``payload`` buffers,
    as a list of buffers (the payload's own buffers are not copied). Its SHA-256 is computed once,
    over the buffers in turn (``hashlib`` releases the GIL on large ones: run it in a worker thread)."""
    h = hashlib.sha256()
    for p in payload:
        h.update(p)
    env = identity.sign_message(
        run_id=run_id, round=round, kind=kind, payload=b"", payload_sha256=h.digest()
    ).envelope.SerializeToString()
    return [*bytes_field(1, [env]), *bytes_field(2, payload)]


def scan(data: Buffer) -> list[tuple[int, int, int, int]]:
    """The fields of a message as ``(field, wire type, start, end)`` byte spans of ``data`` (the whole
    key + value span is ``[start, end)``; the value of a wire-type-2 field is its last
    ``length`` bytes). Raises WireError on malformed input (groups are not supported)."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    out = []
    i = 0
    while i < n:
        start = i
        key, i = read_varint(mv, i, n)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        i = skip_value(mv, i, n, wire)
        if i > n:
            raise WireError("truncated field")
        out.append((field, wire, start, i))
    return out


def value(data: Buffer, span: tuple[int, int, int, int]) -> memoryview:
    """The value of a wire-type-2 field span from :func:`scan`, as a memoryview of ``data`` (no copy)."""
    mv = memoryview(data).cast("B")
    field, wire, start, end = span
    if wire != 2:
        raise WireError(f"field {field} is not length-delimited")
    _, i = read_varint(mv, start, end)  # key
    _, i = read_varint(mv, i, end)  # length
    return mv[i:end]


def small_fields(data: Buffer, spans: Sequence[tuple[int, int, int, int]], skip: Iterable[int]) -> bytes:
    """The bytes of every field span except those numbered in ``skip``: a copy of the small fields only,
    for protobuf to parse."""
    mv = memoryview(data).cast("B")
    skip = set(skip)
    return b"".join(mv[s:e] for f, _, s, e in spans if f not in skip)


def one_bytes_field(data: Buffer, spans: Sequence[tuple[int, int, int, int]], field: int, what: str) -> memoryview:
    """The value of ``field`` (length-delimited, at most once; empty when absent) as a memoryview.
    Raises WireError when it is repeated or has another wire type."""
    found = [s for s in spans if s[0] == field]
    if not found:
        return memoryview(b"")
    if len(found) > 1:
        raise WireError(f"{what}: field {field} repeated")
    return value(data, found[0])


class SignedView:
    """A SignedMessage read without copying its payload: ``envelope`` parsed by protobuf (small),
    ``payload`` a memoryview of the given bytes. Offers what ``identity.Verifier.verify`` reads
    (``HasField``, ``envelope``, ``payload``). Raises WireError when malformed."""

    __slots__ = ("envelope", "payload")

    def __init__(self, data: Buffer):
        spans = scan(data)
        env = one_bytes_field(data, spans, 1, "SignedMessage")
        if any(s[0] == 1 for s in spans):
            try:
                self.envelope = envelope_pb2.Envelope.FromString(bytes(env))
            except Exception as e:  # DecodeError
                raise WireError(f"bad envelope: {e}") from None
        else:
            self.envelope = None
        self.payload = one_bytes_field(data, spans, 2, "SignedMessage")

    def HasField(self, name: str) -> bool:  # noqa: N802  (protobuf's name)
        return name == "envelope" and self.envelope is not None
