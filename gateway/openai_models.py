"""OpenAI's request and response bodies for ``/v1/completions`` and ``/v1/chat/completions``.

Requests: the OpenAI parameters this server honours, the few it accepts only at their no-op
value (``echo: false``, ``response_format: {"type": "text"}``...), and the extensions (vLLM's
names where vLLM has one: ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``chat_template_kwargs``; and ``drafter``, ``speculation``, ``speculation_mode``,
``tree_budget``, ``block_size``, ``session_id``). Any other field is refused (``extra="forbid"``):
nothing a client sends is silently ignored. Integer fields take JSON integers only
(``StrictInt``): ``true``, ``"5"`` or ``1.0`` for a seed or a token count is a 400 naming the
field, not a silent 1 or 5; numbers take JSON numbers only (``StrictFloat``: ``"0.5"`` or
``true`` for a temperature is a 400) within OpenAI's documented ranges (temperature 0-2,
top_p 0-1, presence / frequency penalties -2-2; min_p 0-1 as vLLM), never NaN or infinite;
booleans take ``true`` / ``false`` only (``StrictBool``: ``"yes"`` or ``1`` is a 400). The
body reaching these models was parsed within depth and encoding limits
(``gateway.openai_body``). Responses follow ``openai.types`` (field names and
shapes are checked against them in tests/test_http_api.py) plus ``metrics.speculative_decoding``
(vLLM's per-request statistics) at the top level and on each choice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

Temperature = Annotated[StrictFloat, Field(ge=0, le=2)]      # OpenAI's range
Probability = Annotated[StrictFloat, Field(ge=0, le=1)]      # top_p (OpenAI), min_p (vLLM)
Penalty = Annotated[StrictFloat, Field(ge=-2, le=2)]         # presence / frequency (OpenAI)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: Temperature | None = None    # OpenAI's default is 1.0
    top_p: Probability | None = None
    n: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, StrictFloat] | None = None   # values -100..100 (openai_convert)
    user: str | None = None                   # an end-user id for the caller's records; no effect
    # extensions (vLLM's names)
    top_k: StrictInt | None = None
    min_p: Probability | None = None
    repetition_penalty: StrictFloat | None = None   # (0, 10], 0 = off (dflash.core.sampling)
    stop_token_ids: list[StrictInt] | None = None
    # extensions (this server)
    drafter: str | None = None                # "name" or "name@version"
    speculation: StrictBool | None = None     # false: no drafter (the baseline)
    speculation_mode: str | None = None       # "off" | "fixed" | "adaptive" | "tree"
    tree_budget: StrictInt | None = None
    block_size: StrictInt | None = None
    session_id: str | None = None
    # vLLM's: exactly one of json (a schema), regex, choice, grammar (docs/structured-outputs.md)
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any]
    logprobs: StrictInt | None = None         # top alternatives per token, 0..20
    # accepted only at their no-op values
    best_of: StrictInt | None = None          # == n
    echo: StrictBool | None = None            # false
    suffix: str | None = None                 # null or ""


class ChatMessageIn(_Body):
    role: str
    content: str | list[dict] | None = None   # a string, or text parts


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: str                                  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class FunctionIn(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolIn(_Body):
    type: Literal["function"]
    function: FunctionIn


class ChatRequest(_Sampling):
    messages: list[ChatMessageIn]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Any = None       # "none" | "required" | {"type": "function", "function": {"name"}}
    # accepted only at their no-op values
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None                 # false
    modalities: list[str] | None = None             # ["text"]
    safety_identifier: str | None = None            # like ``user``: no effect


# ---------------------------------------------------------------------------------- responses
class SpeculativeDecoding(BaseModel):
    """vLLM's per-request statistics (``--per-request-spec-decode-metrics summary``), from this
    request's AcceptanceStats: tau = 1 + accepted / steps (the bonus token included)."""

    mean_acceptance_length: float
    draft_acceptance_rate: float           # accepted / draft tokens
    num_spec_steps: int                    # verify steps that carried a draft
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_accepted_tokens_per_pos: list[int]  # position i: steps that accepted > i drafts
    acceptance_histogram: list[int]        # j: steps that accepted exactly j drafts
    num_spec_tokens: int                   # the longest draft (positions counted)
    drafter: str | None = None             # name@version (None: no drafter)
    # accepted draft tokens by who proposed them: "drafter" (a candidate the suffix index or the
    # grammar also proposed included), "suffix" (the suffix index alone) and "grammar" (forced by
    # the request's grammar alone); they sum to num_accepted_draft_tokens
    num_accepted_tokens_by_source: dict[str, int] = Field(default_factory=dict)


class Metrics(BaseModel):
    speculative_decoding: SpeculativeDecoding | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    metrics: Metrics | None = None


class Completion(BaseModel):
    """Also each streamed chunk of ``/v1/completions`` (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    metrics: Metrics | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                 # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    metrics: Metrics | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    metrics: Metrics | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    metrics: Metrics | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    metrics: Metrics | None = None


class DrafterInfo(BaseModel):
    name: str
    version: str
    label: str              # name@version, what ``drafter`` accepts
    is_default: bool
    weight: float


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash-serve"
    max_model_len: int
    drafters: list[DrafterInfo] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Fields of ours that OpenAI's types do not have (the test of the shapes allows exactly these).
EXTENSIONS = {
    "CompletionRequest": {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "drafter",
                          "speculation", "speculation_mode", "tree_budget", "block_size",
                          "session_id", "structured_outputs"},
    "Completion": {"metrics"}, "CompletionChoice": {"metrics"}, "ChatCompletion": {"metrics"},
    "ChatChoice": {"metrics"}, "ChatCompletionChunk": {"metrics"}, "ChunkChoice": {"metrics"},
    "ModelCard": {"max_model_len", "drafters"},
}
EXTENSIONS["ChatRequest"] = EXTENSIONS["CompletionRequest"] | {"chat_template_kwargs"}
