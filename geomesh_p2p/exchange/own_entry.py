"""A relay result served without the reader's own contribution, and put back whole by the reader (issue 26).

In relay mode a part's owner-signed result forwards every signed contribution of the part, the reader's own
included: with N readers each pulling N - 1 parts, ~1/N of the relay bytes every peer receives are its own pushes
coming back (25% at 4 peers, 12.5% at 8). A reader that asks so (``PullPartRequest.omit_caller``) gets the result
with its own entry emptied (:func:`omit_entry`, the owner's side) and puts back the exact signed bytes it pushed
(:func:`restore_entry`) before it checks the owner's signature. The signature covers the payload's SHA-256, so a
result put back wrong (another position, other bytes) fails that check like any tampered result; the restored bytes
are those every other reader got, so result hashes and digests agree. An older owner ignores the flag and sends
everything (nothing to restore); only a reader that asked accepts an empty entry.

Wire layout (what :func:`~geomesh_p2p.exchange.messages.build_result` signs): SignedMessage = field 1 (envelope,
with ``payload_sha256``) + field 2 (payload); the payload's relayed contributions are its field-9 entries, each
``Contribution { bytes signed_message = 1 }``, in the result's order (sorted by raw PeerID).
"""

from __future__ import annotations

import asyncio

import grpc

from geomesh_p2p.exchange import frames as wire
from geomesh_p2p.net.identity import EnvelopeError
from geomesh_p2p.wire import envelope_pb2

__all__ = ["entry_positions", "omit_entry", "restore_entry", "restore"]

Code = grpc.StatusCode

#: The field-9 entry that stands for a left-out contribution: ``Contribution`` with an empty ``signed_message``.
_EMPTY_ENTRY = b"".join(wire.bytes_field(9, wire.bytes_field(1, [b""])))


def _split(signed: wire.Buffer) -> tuple[memoryview, memoryview, list[tuple[int, int, int, int]]]:
    """(envelope, payload, the payload's field spans) of a SignedMessage. Raises WireError when malformed."""
    spans = wire.scan(signed)
    env = wire.one_bytes_field(signed, spans, 1, "SignedMessage")
    payload = wire.one_bytes_field(signed, spans, 2, "SignedMessage")
    return env, payload, wire.scan(payload)


def entry_positions(signed: wire.Buffer) -> dict[bytes, int]:
    """Raw PeerID (the sender its envelope names, 32 bytes) -> position of its relayed contribution in the result
    ``signed``; a sender listed twice is left out (ambiguous: served whole). Read from the result itself, not from
    what the owner meant to list (a result built otherwise, by a subclass or an adversary, keeps its own order).
    One envelope parse per entry: the owner computes it once per part. Raises WireError / DecodeError when
    malformed."""
    _, payload, spans = _split(signed)
    out: dict[bytes, int] = {}
    twice: set[bytes] = set()
    for k, span in enumerate(s for s in spans if s[0] == 9):
        item = wire.value(payload, span)
        inner = wire.one_bytes_field(item, wire.scan(item), 1, "Contribution")
        env = wire.one_bytes_field(inner, wire.scan(inner), 1, "SignedMessage")
        sender = bytes(envelope_pb2.Envelope.FromString(bytes(env)).sender)
        if sender in out:
            twice.add(sender)
        out[sender] = k
    return {p: k for p, k in out.items() if p not in twice}


def omit_entry(signed: wire.Buffer, k: int) -> list[wire.Buffer]:
    """The owner-signed relay result ``signed`` with its ``k``-th relayed contribution (0-based, in the result's
    order) replaced by an empty entry, as buffers to join (views of ``signed``: no copy here). The owner's side:
    ``k`` is the caller's position. Raises WireError when ``signed`` is malformed, IndexError when it relays fewer
    than ``k + 1`` contributions."""
    env, payload, spans = _split(signed)
    _, _, start, end = [s for s in spans if s[0] == 9][k]
    return [*wire.bytes_field(1, [env]), *wire.bytes_field(2, [payload[:start], _EMPTY_ENTRY, payload[end:]])]


def restore_entry(signed: wire.Buffer, own: wire.Buffer) -> wire.Buffer:
    """``signed`` with its one empty relayed entry filled with ``own`` (the SignedMessage bytes of the reader's
    contribution to the part, as it pushed them); ``signed`` itself when no entry is empty (an owner that sent
    everything). The reader's side, before the owner's signature is checked. Raises EnvelopeError
    (INVALID_ARGUMENT) when more than one entry is empty or ``signed`` is malformed."""
    try:
        env, payload, spans = _split(signed)
        empty = [s for s in spans if s[0] == 9 and s[3] - s[2] == len(_EMPTY_ENTRY) and _is_empty(payload, s)]
    except wire.WireError:
        raise EnvelopeError(Code.INVALID_ARGUMENT, "part result is not a SignedMessage") from None
    if not empty:
        return signed
    if len(empty) > 1:
        raise EnvelopeError(Code.INVALID_ARGUMENT, f"part result leaves out {len(empty)} contributions, not one")
    _, _, start, end = empty[0]
    entry = wire.bytes_field(9, wire.bytes_field(1, [own]))
    return b"".join([*wire.bytes_field(1, [env]), *wire.bytes_field(2, [payload[:start], *entry, payload[end:]])])


#: A result at least this long (bytes) is restored in a worker thread (the restore copies it once).
THREAD_BYTES = 1 << 20


async def restore(signed: wire.Buffer, own: wire.Buffer) -> wire.Buffer:
    """:func:`restore_entry` off the event loop when ``signed`` is large (:data:`THREAD_BYTES`); same errors."""
    if len(signed) > THREAD_BYTES:
        return await asyncio.to_thread(restore_entry, signed, own)
    return restore_entry(signed, own)


def _is_empty(payload: memoryview, span: tuple[int, int, int, int]) -> bool:
    """True when the field-9 entry at ``span`` is the empty one (:data:`_EMPTY_ENTRY`)."""
    return bytes(payload[span[2] : span[3]]) == _EMPTY_ENTRY
