from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "tenant", "priority", "lora", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    tenant: str
    priority: _common_pb2.Priority
    lora: str
    slo: _common_pb2.Slo
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., tenant: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., lora: _Optional[str] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "kv", "generator_state", "cached_tokens", "other_choices")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OTHER_CHOICES_FIELD_NUMBER: _ClassVar[int]
    first: _common_pb2.TokenEvent
    kv: _common_pb2.KVHandle
    generator_state: bytes
    cached_tokens: int
    other_choices: _containers.RepeatedCompositeFieldContainer[ChoiceStart]
    def __init__(self, first: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., generator_state: _Optional[bytes] = ..., cached_tokens: _Optional[int] = ..., other_choices: _Optional[_Iterable[_Union[ChoiceStart, _Mapping]]] = ...) -> None: ...

class ChoiceStart(_message.Message):
    __slots__ = ("first", "generator_state")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    first: _common_pb2.TokenEvent
    generator_state: bytes
    def __init__(self, first: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., generator_state: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "tenant", "kv", "first", "generator_state", "cached_tokens", "priority", "other_choices", "lora", "admitted", "resumed_token_ids", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OTHER_CHOICES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    tenant: str
    kv: _common_pb2.KVHandle
    first: _common_pb2.TokenEvent
    generator_state: bytes
    cached_tokens: int
    priority: _common_pb2.Priority
    other_choices: _containers.RepeatedCompositeFieldContainer[ChoiceStart]
    lora: str
    admitted: bool
    resumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    slo: _common_pb2.Slo
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., tenant: _Optional[str] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., first: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., generator_state: _Optional[bytes] = ..., cached_tokens: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., other_choices: _Optional[_Iterable[_Union[ChoiceStart, _Mapping]]] = ..., lora: _Optional[str] = ..., admitted: _Optional[bool] = ..., resumed_token_ids: _Optional[_Iterable[int]] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "tokens", "priority", "lease_ms", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: int
    priority: _common_pb2.Priority
    lease_ms: int
    slo: _common_pb2.Slo
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., lease_ms: _Optional[int] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnreserveRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class UnreserveResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("request_id", "incarnation", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    incarnation: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
