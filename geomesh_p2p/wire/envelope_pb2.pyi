from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Envelope(_message.Message):
    __slots__ = ("run_id", "round", "sender", "public_key", "timestamp", "nonce", "payload_sha256", "kind", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    sender: bytes
    public_key: bytes
    timestamp: float
    nonce: bytes
    payload_sha256: bytes
    kind: str
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., sender: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., timestamp: _Optional[float] = ..., nonce: _Optional[bytes] = ..., payload_sha256: _Optional[bytes] = ..., kind: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SignedMessage(_message.Message):
    __slots__ = ("envelope", "payload")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    payload: bytes
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...
