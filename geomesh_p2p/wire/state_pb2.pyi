from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("round", "offset", "length")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    round: int
    offset: int
    length: int
    def __init__(self, round: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("round", "digest", "total_bytes", "offset", "data")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: str
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("round", "digest", "peer_id", "record")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: str
    peer_id: str
    record: bytes
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[str] = ..., peer_id: _Optional[str] = ..., record: _Optional[bytes] = ...) -> None: ...
