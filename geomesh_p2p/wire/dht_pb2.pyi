from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "peer_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: bytes
    address: str
    peer_id: bytes
    def __init__(self, node_id: _Optional[bytes] = ..., address: _Optional[str] = ..., peer_id: _Optional[bytes] = ...) -> None: ...

class SignedRecord(_message.Message):
    __slots__ = ("key", "subkey", "value", "expiration_time", "owner_public_key", "signature", "pow_nonce")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_TIME_FIELD_NUMBER: _ClassVar[int]
    OWNER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    POW_NONCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    subkey: str
    value: bytes
    expiration_time: float
    owner_public_key: bytes
    signature: bytes
    pow_nonce: int
    def __init__(self, key: _Optional[str] = ..., subkey: _Optional[str] = ..., value: _Optional[bytes] = ..., expiration_time: _Optional[float] = ..., owner_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., pow_nonce: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("sender", "dht_protocol", "software_version")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DHT_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    sender: NodeInfo
    dht_protocol: int
    software_version: str
    def __init__(self, sender: _Optional[_Union[NodeInfo, _Mapping]] = ..., dht_protocol: _Optional[int] = ..., software_version: _Optional[str] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("node", "time", "dht_protocol", "software_version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DHT_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    time: float
    dht_protocol: int
    software_version: str
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., time: _Optional[float] = ..., dht_protocol: _Optional[int] = ..., software_version: _Optional[str] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("sender", "records")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    sender: NodeInfo
    records: _containers.RepeatedCompositeFieldContainer[SignedRecord]
    def __init__(self, sender: _Optional[_Union[NodeInfo, _Mapping]] = ..., records: _Optional[_Iterable[_Union[SignedRecord, _Mapping]]] = ...) -> None: ...

class StoreOutcome(_message.Message):
    __slots__ = ("stored", "code", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    code: int
    reason: str
    def __init__(self, stored: _Optional[bool] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[StoreOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[StoreOutcome, _Mapping]]] = ...) -> None: ...

class FindRequest(_message.Message):
    __slots__ = ("sender", "keys", "nodes_only", "subkeys")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NODES_ONLY_FIELD_NUMBER: _ClassVar[int]
    SUBKEYS_FIELD_NUMBER: _ClassVar[int]
    sender: NodeInfo
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    nodes_only: bool
    subkeys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sender: _Optional[_Union[NodeInfo, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., nodes_only: _Optional[bool] = ..., subkeys: _Optional[_Iterable[str]] = ...) -> None: ...

class FindResult(_message.Message):
    __slots__ = ("key", "records", "nearest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    records: _containers.RepeatedCompositeFieldContainer[SignedRecord]
    nearest: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, key: _Optional[bytes] = ..., records: _Optional[_Iterable[_Union[SignedRecord, _Mapping]]] = ..., nearest: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class FindResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[FindResult]
    def __init__(self, results: _Optional[_Iterable[_Union[FindResult, _Mapping]]] = ...) -> None: ...
