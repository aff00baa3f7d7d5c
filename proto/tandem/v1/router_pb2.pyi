from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "tenant", "model", "priority", "session", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingOptions
    tenant: str
    model: str
    priority: _common_pb2.Priority
    session: str
    slo: _common_pb2.Slo
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., session: _Optional[str] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ...) -> None: ...

class RouteReport(_message.Message):
    __slots__ = ("request", "started", "ended")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    started: LegStarted
    ended: LegEnded
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., started: _Optional[_Union[LegStarted, _Mapping]] = ..., ended: _Optional[_Union[LegEnded, _Mapping]] = ...) -> None: ...

class LegStarted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LegEnded(_message.Message):
    __slots__ = ("token_ids", "code", "details", "retry_after_ms", "room_tokens", "moved")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    ROOM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    code: int
    details: str
    retry_after_ms: int
    room_tokens: int
    moved: _common_pb2.MovedKV
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., room_tokens: _Optional[int] = ..., moved: _Optional[_Union[_common_pb2.MovedKV, _Mapping]] = ...) -> None: ...

class DecodeLeg(_message.Message):
    __slots__ = ("worker_id", "address", "request")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    request: _worker_pb2.DecodeRequest
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., request: _Optional[_Union[_worker_pb2.DecodeRequest, _Mapping]] = ...) -> None: ...

class RouteStep(_message.Message):
    __slots__ = ("event", "decode")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.TokenEvent
    decode: DecodeLeg
    def __init__(self, event: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., decode: _Optional[_Union[DecodeLeg, _Mapping]] = ...) -> None: ...
