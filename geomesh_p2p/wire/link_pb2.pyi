from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LinkProbeRequest(_message.Message):
    __slots__ = ("reply_bytes", "padding")
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    reply_bytes: int
    padding: bytes
    def __init__(self, reply_bytes: _Optional[int] = ..., padding: _Optional[bytes] = ...) -> None: ...

class LinkProbeResponse(_message.Message):
    __slots__ = ("received_bytes", "padding", "held_s")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    padding: bytes
    held_s: float
    def __init__(self, received_bytes: _Optional[int] = ..., padding: _Optional[bytes] = ..., held_s: _Optional[float] = ...) -> None: ...
