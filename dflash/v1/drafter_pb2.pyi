from dflash.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_ERROR_UNSPECIFIED: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_BAD_REQUEST: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CONTEXT_GAP: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_NO_CONTEXT: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_INTERNAL: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_PREFIX_MISS: _ClassVar[DraftErrorCode]
DRAFT_ERROR_UNSPECIFIED: DraftErrorCode
DRAFT_ERROR_BAD_REQUEST: DraftErrorCode
DRAFT_ERROR_CONTEXT_GAP: DraftErrorCode
DRAFT_ERROR_NO_CONTEXT: DraftErrorCode
DRAFT_ERROR_INTERNAL: DraftErrorCode
DRAFT_ERROR_PREFIX_MISS: DraftErrorCode

class DescribeDrafterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterCard(_message.Message):
    __slots__ = ("name", "version", "block_size", "mask_token_id", "target_layer_ids", "hidden_size", "vocab_size", "dtype", "target_fingerprint", "num_hidden_layers", "rope_theta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    block_size: int
    mask_token_id: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    vocab_size: int
    dtype: str
    target_fingerprint: str
    num_hidden_layers: int
    rope_theta: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., block_size: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., target_fingerprint: _Optional[str] = ..., num_hidden_layers: _Optional[int] = ..., rope_theta: _Optional[float] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("batch_id", "items", "release_sessions", "keep_prefixes")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    release_sessions: _containers.RepeatedScalarFieldContainer[str]
    keep_prefixes: _containers.RepeatedCompositeFieldContainer[KeepPrefix]
    def __init__(self, batch_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., release_sessions: _Optional[_Iterable[str]] = ..., keep_prefixes: _Optional[_Iterable[_Union[KeepPrefix, _Mapping]]] = ...) -> None: ...

class KeepPrefix(_message.Message):
    __slots__ = ("session_id", "key", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    key: bytes
    length: int
    def __init__(self, session_id: _Optional[str] = ..., key: _Optional[bytes] = ..., length: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("session_id", "context_start", "context", "anchor_token", "block_size", "sampling", "trace_context", "top_k", "no_learn", "context_ids", "prefix_key")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NO_LEARN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_start: int
    context: _common_pb2.Tensor
    anchor_token: int
    block_size: int
    sampling: _common_pb2.SamplingParams
    trace_context: _containers.ScalarMap[str, str]
    top_k: int
    no_learn: bool
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_key: bytes
    def __init__(self, session_id: _Optional[str] = ..., context_start: _Optional[int] = ..., context: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., anchor_token: _Optional[int] = ..., block_size: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., top_k: _Optional[int] = ..., no_learn: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., prefix_key: _Optional[bytes] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("session_id", "tokens", "probs", "error", "error_code", "top_ids", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _common_pb2.Tensor
    error: str
    error_code: DraftErrorCode
    top_ids: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., error: _Optional[str] = ..., error_code: _Optional[_Union[DraftErrorCode, str]] = ..., top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftBatchResult(_message.Message):
    __slots__ = ("batch_id", "results", "draft_seconds")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    draft_seconds: float
    def __init__(self, batch_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., draft_seconds: _Optional[float] = ...) -> None: ...
