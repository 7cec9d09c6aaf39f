from dflash.v1 import common_pb2 as _common_pb2
from dflash.v1 import drafter_pb2 as _drafter_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("waiting", "running", "kv_cache_usage", "draining", "max_batch")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    kv_cache_usage: float
    draining: bool
    max_batch: int
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., draining: _Optional[bool] = ..., max_batch: _Optional[int] = ...) -> None: ...

class DescribeTargetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetCard(_message.Message):
    __slots__ = ("model", "hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings", "fingerprint", "eos_token_ids", "dtype", "rope_theta")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    model: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    rope_theta: float
    def __init__(self, model: _Optional[str] = ..., hidden_size: _Optional[int] = ..., num_hidden_layers: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., rope_theta: _Optional[float] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("enabled", "drafter_address", "block_size", "mode", "tree_budget")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    drafter_address: str
    block_size: int
    mode: str
    tree_budget: int
    def __init__(self, enabled: _Optional[bool] = ..., drafter_address: _Optional[str] = ..., block_size: _Optional[int] = ..., mode: _Optional[str] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class VerifierGenerateRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt_token_ids", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "speculation", "prefix_group", "tenant", "structured_output", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_GROUP_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    speculation: SpeculationParams
    prefix_group: str
    tenant: str
    structured_output: _common_pb2.StructuredOutput
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., prefix_group: _Optional[str] = ..., tenant: _Optional[str] = ..., structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class VerifierGenerateChunk(_message.Message):
    __slots__ = ("token_ids", "accepted", "finish_reason", "stats", "prompt_tokens", "cached_prompt_tokens", "drafted", "logprobs", "fallback", "tree_nodes", "draft_seconds", "verify_seconds", "suffix_nodes", "suffix_accepted")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_NODES_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.AcceptanceStats
    prompt_tokens: int
    cached_prompt_tokens: int
    drafted: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    fallback: bool
    tree_nodes: int
    draft_seconds: float
    verify_seconds: float
    suffix_nodes: int
    suffix_accepted: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.AcceptanceStats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., drafted: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., fallback: _Optional[bool] = ..., tree_nodes: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., suffix_nodes: _Optional[int] = ..., suffix_accepted: _Optional[int] = ...) -> None: ...

class CheckDrafterRequest(_message.Message):
    __slots__ = ("card", "address")
    CARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    card: _drafter_pb2.DrafterCard
    address: str
    def __init__(self, card: _Optional[_Union[_drafter_pb2.DrafterCard, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class CheckDrafterResponse(_message.Message):
    __slots__ = ("card",)
    CARD_FIELD_NUMBER: _ClassVar[int]
    card: _drafter_pb2.DrafterCard
    def __init__(self, card: _Optional[_Union[_drafter_pb2.DrafterCard, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
