from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PartContribution(_message.Message):
    __slots__ = ("round", "part", "start", "end", "tokens", "spec_id", "encoding", "packet", "compute_end", "members", "member_tokens", "group_inputs", "group_spec_id", "group_commitment")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PACKET_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_END_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_INPUTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    start: int
    end: int
    tokens: int
    spec_id: bytes
    encoding: str
    packet: bytes
    compute_end: float
    members: _containers.RepeatedScalarFieldContainer[bytes]
    member_tokens: _containers.RepeatedScalarFieldContainer[int]
    group_inputs: _containers.RepeatedScalarFieldContainer[bytes]
    group_spec_id: bytes
    group_commitment: bytes
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., tokens: _Optional[int] = ..., spec_id: _Optional[bytes] = ..., encoding: _Optional[str] = ..., packet: _Optional[bytes] = ..., compute_end: _Optional[float] = ..., members: _Optional[_Iterable[bytes]] = ..., member_tokens: _Optional[_Iterable[int]] = ..., group_inputs: _Optional[_Iterable[bytes]] = ..., group_spec_id: _Optional[bytes] = ..., group_commitment: _Optional[bytes] = ...) -> None: ...

class GroupCommitment(_message.Message):
    __slots__ = ("round", "spec_id", "part", "group_spec_id", "group_inputs")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    GROUP_SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INPUTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    spec_id: bytes
    part: int
    group_spec_id: bytes
    group_inputs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[int] = ..., spec_id: _Optional[bytes] = ..., part: _Optional[int] = ..., group_spec_id: _Optional[bytes] = ..., group_inputs: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PushPartRequest(_message.Message):
    __slots__ = ("contribution", "witness")
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    WITNESS_FIELD_NUMBER: _ClassVar[int]
    contribution: bytes
    witness: bool
    def __init__(self, contribution: _Optional[bytes] = ..., witness: _Optional[bool] = ...) -> None: ...

class PushPartResponse(_message.Message):
    __slots__ = ("accepted", "reason", "held_s", "receipt")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    held_s: float
    receipt: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., held_s: _Optional[float] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("round", "part", "spec_id", "sender", "tokens", "contribution_sha256")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_SHA256_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    spec_id: bytes
    sender: bytes
    tokens: int
    contribution_sha256: bytes
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., spec_id: _Optional[bytes] = ..., sender: _Optional[bytes] = ..., tokens: _Optional[int] = ..., contribution_sha256: _Optional[bytes] = ...) -> None: ...

class PullPartRequest(_message.Message):
    __slots__ = ("round", "part", "wait_s", "spec_id", "unless_sha256", "omit_caller")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    UNLESS_SHA256_FIELD_NUMBER: _ClassVar[int]
    OMIT_CALLER_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    wait_s: float
    spec_id: bytes
    unless_sha256: bytes
    omit_caller: bool
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., wait_s: _Optional[float] = ..., spec_id: _Optional[bytes] = ..., unless_sha256: _Optional[bytes] = ..., omit_caller: _Optional[bool] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("signed_message",)
    SIGNED_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    signed_message: bytes
    def __init__(self, signed_message: _Optional[bytes] = ...) -> None: ...

class PartResult(_message.Message):
    __slots__ = ("round", "part", "start", "end", "spec_id", "mode", "contributors", "tokens", "contributions", "aggregate", "aggregate_encoding", "closed_by", "last_compute_end", "inputs", "witness_receipt", "member_counts", "members", "member_tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    CLOSED_BY_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPUTE_END_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    WITNESS_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    start: int
    end: int
    spec_id: bytes
    mode: str
    contributors: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    contributions: _containers.RepeatedCompositeFieldContainer[Contribution]
    aggregate: bytes
    aggregate_encoding: str
    closed_by: str
    last_compute_end: float
    inputs: bytes
    witness_receipt: bytes
    member_counts: _containers.RepeatedScalarFieldContainer[int]
    members: _containers.RepeatedScalarFieldContainer[bytes]
    member_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., spec_id: _Optional[bytes] = ..., mode: _Optional[str] = ..., contributors: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[_Iterable[int]] = ..., contributions: _Optional[_Iterable[_Union[Contribution, _Mapping]]] = ..., aggregate: _Optional[bytes] = ..., aggregate_encoding: _Optional[str] = ..., closed_by: _Optional[str] = ..., last_compute_end: _Optional[float] = ..., inputs: _Optional[bytes] = ..., witness_receipt: _Optional[bytes] = ..., member_counts: _Optional[_Iterable[int]] = ..., members: _Optional[_Iterable[bytes]] = ..., member_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PullInputsRequest(_message.Message):
    __slots__ = ("round", "part", "spec_id", "first", "from_sender", "omit_caller", "count", "commitments_only")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    FROM_SENDER_FIELD_NUMBER: _ClassVar[int]
    OMIT_CALLER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    COMMITMENTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    spec_id: bytes
    first: int
    from_sender: bool
    omit_caller: bool
    count: int
    commitments_only: bool
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., spec_id: _Optional[bytes] = ..., first: _Optional[int] = ..., from_sender: _Optional[bool] = ..., omit_caller: _Optional[bool] = ..., count: _Optional[int] = ..., commitments_only: _Optional[bool] = ...) -> None: ...

class PullInputsResponse(_message.Message):
    __slots__ = ("round", "part", "contributions", "total")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    contributions: _containers.RepeatedScalarFieldContainer[bytes]
    total: int
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., contributions: _Optional[_Iterable[bytes]] = ..., total: _Optional[int] = ...) -> None: ...

class AccountabilityProof(_message.Message):
    __slots__ = ("kind", "result", "receipt", "other_result", "contributions", "spec_json", "contribution", "cross_spec_json", "input_counts", "commitment", "other_commitment")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    OTHER_RESULT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    CROSS_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    INPUT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    OTHER_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    result: bytes
    receipt: bytes
    other_result: bytes
    contributions: _containers.RepeatedScalarFieldContainer[bytes]
    spec_json: str
    contribution: bytes
    cross_spec_json: str
    input_counts: _containers.RepeatedScalarFieldContainer[int]
    commitment: bytes
    other_commitment: bytes
    def __init__(self, kind: _Optional[str] = ..., result: _Optional[bytes] = ..., receipt: _Optional[bytes] = ..., other_result: _Optional[bytes] = ..., contributions: _Optional[_Iterable[bytes]] = ..., spec_json: _Optional[str] = ..., contribution: _Optional[bytes] = ..., cross_spec_json: _Optional[str] = ..., input_counts: _Optional[_Iterable[int]] = ..., commitment: _Optional[bytes] = ..., other_commitment: _Optional[bytes] = ...) -> None: ...

class PullPartResponse(_message.Message):
    __slots__ = ("round", "part", "ready", "signed_result", "held_s", "same")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SIGNED_RESULT_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    SAME_FIELD_NUMBER: _ClassVar[int]
    round: int
    part: int
    ready: bool
    signed_result: bytes
    held_s: float
    same: bool
    def __init__(self, round: _Optional[int] = ..., part: _Optional[int] = ..., ready: _Optional[bool] = ..., signed_result: _Optional[bytes] = ..., held_s: _Optional[float] = ..., same: _Optional[bool] = ...) -> None: ...
