"""Reading a received :class:`~geomesh_p2p.wire.envelope_pb2.SignedMessage` (a request on the server, a
reply on the client) without protobuf's copies of its payload: :func:`_split_request` parses the
envelope and slices the payload out once.
"""

from __future__ import annotations

from geomesh_p2p.wire import envelope_pb2
from geomesh_p2p.wire.varint import read_varint, skip_value

SignedMessage = envelope_pb2.SignedMessage


class _Request:
    """A request SignedMessage split by :func:`_split_request`: ``envelope`` parsed by protobuf (it is
    small), ``payload`` one ``bytes`` slice of the received buffer. It offers what
    ``identity.Verifier.verify`` reads (``HasField``, ``envelope``, ``payload``) and ``ByteSize``."""

    __slots__ = ("envelope", "payload", "_size")

    def __init__(self, envelope, payload: bytes, size: int):
        self.envelope, self.payload, self._size = envelope, payload, size

    def HasField(self, name: str) -> bool:  # noqa: N802  (protobuf's name)
        return name == "envelope" and self.envelope is not None

    def ByteSize(self) -> int:  # noqa: N802
        return self._size


def _split_request(data: bytes):
    """Parse a SignedMessage without protobuf's copy of its payload: with upb, every read of
    ``msg.payload`` returns a fresh copy (a 100 MiB payload: ~0.5 s and 100 MiB each time, and the
    verifier reads it three times, on the event loop). Fields 1 (envelope) and 2 (payload) at most
    once each, unknown fields skipped; anything else is malformed and becomes an empty message."""
    try:
        n = len(data)
        env_at = payload_at = None
        i = 0
        while i < n:
            key, i = read_varint(data, i, n)
            field, wire = key >> 3, key & 7
            if wire == 2:
                length, i = read_varint(data, i, n)
                if i + length > n:
                    raise ValueError("truncated field")
                if field in (1, 2):
                    if (env_at if field == 1 else payload_at) is not None:
                        raise ValueError("repeated field")
                    if field == 1:
                        env_at = (i, i + length)
                    else:
                        payload_at = (i, i + length)
                i += length
            elif field in (1, 2):
                raise ValueError("wrong wire type")
            else:
                i = skip_value(data, i, n, wire)
            if i > n:
                raise ValueError("truncated field")
        envelope = envelope_pb2.Envelope.FromString(data[env_at[0] : env_at[1]]) if env_at is not None else None
        payload = data[payload_at[0] : payload_at[1]] if payload_at is not None else b""
        return _Request(envelope, payload, n)
    except Exception:  # ValueError, DecodeError: not a SignedMessage
        return SignedMessage()
