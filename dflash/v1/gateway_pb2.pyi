from dflash.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "sampling", "max_tokens", "stop", "stop_token_ids", "speculation", "drafter", "session_id", "block_size", "speculation_mode", "tree_budget", "n", "structured_output")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MODE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: bool
    drafter: str
    session_id: str
    block_size: int
    speculation_mode: str
    tree_budget: int
    n: int
    structured_output: _common_pb2.StructuredOutput
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[bool] = ..., drafter: _Optional[str] = ..., session_id: _Optional[str] = ..., block_size: _Optional[int] = ..., speculation_mode: _Optional[str] = ..., tree_budget: _Optional[int] = ..., n: _Optional[int] = ..., structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "resumes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    resumes: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., resumes: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "acceptance", "drafter", "ttft_seconds", "logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    acceptance: _common_pb2.AcceptanceStats
    drafter: str
    ttft_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., acceptance: _Optional[_Union[_common_pb2.AcceptanceStats, _Mapping]] = ..., drafter: _Optional[str] = ..., ttft_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class GatewayCloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GatewayCloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class ListDraftersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterEntry(_message.Message):
    __slots__ = ("name", "version", "address", "is_default", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    address: str
    is_default: bool
    weight: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., address: _Optional[str] = ..., is_default: _Optional[bool] = ..., weight: _Optional[float] = ...) -> None: ...

class RegisterDrafterRequest(_message.Message):
    __slots__ = ("address", "name", "version", "weight", "make_default")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAKE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    version: str
    weight: float
    make_default: bool
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., weight: _Optional[float] = ..., make_default: _Optional[bool] = ...) -> None: ...

class DrafterRef(_message.Message):
    __slots__ = ("drafter",)
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    def __init__(self, drafter: _Optional[str] = ...) -> None: ...

class SetDrafterWeightsRequest(_message.Message):
    __slots__ = ("weights",)
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.ScalarMap[str, float]
    def __init__(self, weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ListDraftersResponse(_message.Message):
    __slots__ = ("drafters",)
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterEntry]
    def __init__(self, drafters: _Optional[_Iterable[_Union[DrafterEntry, _Mapping]]] = ...) -> None: ...
