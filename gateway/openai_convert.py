"""OpenAI bodies <-> the gateway's GenerateRequest / GenerateResponse (the only module that sees
both): :func:`completion_request` and :func:`chat_request` turn a validated body into the
request the gRPC path serves; :class:`Assembler` turns that path's responses into OpenAI's
response body or its stream chunks. Errors are InvalidParam naming the OpenAI parameter.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from dflash.core.convert import FINISH_NAME
from dflash.core.finish import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP
from dflash.core.sampling import InvalidParam
from dflash.v1 import common_pb2, gateway_pb2
from gateway.openai_models import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessageOut,
    ChatRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaToolCall,
    Metrics,
    PromptTokensDetails,
    SpeculativeDecoding,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from gateway.structured import ToolCallStream, ToolPlan, structured_output, tool_calls
from gateway.token_text import TokenText

COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 20
INT32 = 2**31 - 1
# "developer" is OpenAI's newer name for the system role
ROLE_ALIASES = {"developer": "system"}
# our finish reason -> OpenAI's (its names are its wire values, kept as literals)
OPENAI_ABORT = "abort"
FINISH_REASON = {FINISH_LENGTH: "length", FINISH_STOP: "stop", FINISH_CANCELLED: OPENAI_ABORT}
OPENAI_TOOL_CALLS = "tool_calls"      # a tool call's output finished (its grammar's end)


@dataclasses.dataclass
class Prepared:
    """What an OpenAI body asks of the Generate path."""

    request: gateway_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    fill_context: bool                     # no max_tokens: up to the context window
    max_tokens_param: str = "max_tokens"   # the name the client used
    chat_template_kwargs: dict | None = None
    tools: ToolPlan | None = None          # the output is a tool call (gateway.structured)


def _int(name: str, v: int | None, lo: int = -INT32 - 1, hi: int = INT32) -> int:
    """``v`` (0 when None) checked to fit the proto field. Raises InvalidParam."""
    if v is None:
        return 0
    if not lo <= v <= hi:
        raise InvalidParam(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _sampling(b, logprobs: bool, top_logprobs: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p, top_k=_int("top_k", b.top_k),
        presence_penalty=b.presence_penalty or 0.0, frequency_penalty=b.frequency_penalty or 0.0,
        repetition_penalty=b.repetition_penalty or 0.0, min_p=b.min_p or 0.0,
        logprobs=logprobs, top_logprobs=top_logprobs)
    if b.seed is not None:
        s.seed = _int("seed", b.seed, 0, 2**64 - 1)
    for key, bias in (b.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise InvalidParam("logit_bias", f"key {key[:32]!r} is not a token id") from None
        s.logit_bias[_int("logit_bias", tok, 0, 2**63 - 1)] = bias
    return s


def _common(r: gateway_pb2.GenerateRequest, b, *, logprobs: bool, top_logprobs: int) -> None:
    """The fields both endpoints share, onto ``r``."""
    r.sampling.CopyFrom(_sampling(b, logprobs, top_logprobs))
    r.stop.extend([b.stop] if isinstance(b.stop, str) else (b.stop or []))
    r.n = _int("n", b.n, 1)
    for t in b.stop_token_ids or ():
        r.stop_token_ids.append(_int("stop_token_ids", t, 0, 2**63 - 1))
    if b.speculation is not None:
        r.speculation = b.speculation
    r.drafter = b.drafter or ""
    r.session_id = b.session_id or ""
    r.speculation_mode = b.speculation_mode or ""
    r.tree_budget = _int("tree_budget", b.tree_budget)
    r.block_size = _int("block_size", b.block_size)
    if b.stream_options is not None and not b.stream:
        raise InvalidParam("stream_options", "only with stream: true")


def completion_request(b: CompletionRequest) -> Prepared:
    """``/v1/completions``. Raises InvalidParam naming the parameter."""
    prompt = b.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidParam("prompt", "must be a string (or a list of one string): batches "
                               "and token-id prompts are not supported")
        prompt = prompt[0]
    if b.echo:
        raise InvalidParam("echo", "is not supported (only false)")
    if b.suffix:
        raise InvalidParam("suffix", "is not supported (no insertion)")
    if b.best_of is not None and b.best_of != (b.n or 1):
        raise InvalidParam("best_of", "must equal n (no best-of selection)")
    if b.logprobs is not None and not 0 <= b.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidParam("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {b.logprobs}")
    r = gateway_pb2.GenerateRequest(prompt=prompt)
    _common(r, b, logprobs=b.logprobs is not None, top_logprobs=b.logprobs or 0)
    so, _ = structured_output(b, chat=False)
    if so is not None:
        r.structured_output.CopyFrom(so)
    r.max_tokens = COMPLETION_MAX_TOKENS if b.max_tokens is None else _int("max_tokens", b.max_tokens)
    return Prepared(r, stream=b.stream, include_usage=bool(b.stream_options and b.stream_options.include_usage),
                    logprobs=b.logprobs is not None, fill_context=False)


def _content(i: int, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise InvalidParam(f"messages[{i}].content[{j}].type",
                               f"{str(part.get('type'))[:32]!r}: only text parts are supported")
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise InvalidParam(f"messages[{i}].content[{j}]", 'expected {"type": "text", "text": str}')
        texts.append(part["text"])
    return "\n".join(texts)


def chat_request(b: ChatRequest) -> Prepared:
    """``/v1/chat/completions``. Raises InvalidParam naming the parameter."""
    so, plan = structured_output(b, chat=True)
    if b.store:
        raise InvalidParam("store", "is not supported (only false)")
    if b.modalities not in (None, ["text"]):
        raise InvalidParam("modalities", 'only ["text"] is supported')
    r = gateway_pb2.GenerateRequest()
    r.chat.SetInParent()
    if plan is not None:
        r.chat.messages.add(role="system", content=plan.descriptions)
    for i, m in enumerate(b.messages):
        r.chat.messages.add(role=ROLE_ALIASES.get(m.role, m.role), content=_content(i, m.content))
    _common(r, b, logprobs=bool(b.logprobs), top_logprobs=_int("top_logprobs", b.top_logprobs))
    if so is not None:
        r.structured_output.CopyFrom(so)
    param, max_tokens = (("max_completion_tokens", b.max_completion_tokens)
                         if b.max_completion_tokens is not None else ("max_tokens", b.max_tokens))
    r.max_tokens = _int(param, max_tokens)
    return Prepared(r, stream=b.stream, include_usage=bool(b.stream_options and b.stream_options.include_usage),
                    logprobs=bool(b.logprobs), fill_context=max_tokens is None,
                    max_tokens_param=param, chat_template_kwargs=b.chat_template_kwargs, tools=plan)


def http_param(field: str, p: Prepared | None, chat: bool) -> str:
    """The OpenAI parameter a core error's field stands for."""
    if field.startswith("chat.messages"):
        return field.removeprefix("chat.")
    if field == "max_tokens" and p is not None:
        return p.max_tokens_param
    if field == "top_logprobs" and not chat:
        return "logprobs"
    return field


# ---------------------------------------------------------------------------------- responses
def _tool_delta(calls: list[dict]) -> ChoiceDelta:
    return ChoiceDelta(tool_calls=[DeltaToolCall.model_validate(c) for c in calls])


def speculative_decoding(a: common_pb2.AcceptanceStats, drafter: str) -> SpeculativeDecoding | None:
    """vLLM's summary of one sample's (or a sum's) statistics; None without speculation (no
    drafter, and no suffix candidates verified)."""
    if not drafter and not a.drafts:
        return None
    per = list(a.accepted_per_position)
    # per[i] counts steps that accepted more than i drafts, so exactly j: per[j-1] - per[j]
    bounds = [a.drafts] + per + [0]
    hist = [bounds[j] - bounds[j + 1] for j in range(len(per) + 1)]
    return SpeculativeDecoding(
        mean_acceptance_length=1.0 + a.accepted_tokens / a.drafts if a.drafts else 1.0,
        draft_acceptance_rate=a.accepted_tokens / a.draft_tokens if a.draft_tokens else 0.0,
        num_spec_steps=a.drafts, num_draft_tokens=a.draft_tokens,
        num_accepted_draft_tokens=a.accepted_tokens, num_accepted_tokens_per_pos=per,
        acceptance_histogram=hist, num_spec_tokens=len(per), drafter=drafter or None,
        num_accepted_tokens_by_source={
            "drafter": a.accepted_tokens - a.suffix_accepted_tokens - a.grammar_accepted_tokens,
            "suffix": a.suffix_accepted_tokens, "grammar": a.grammar_accepted_tokens})


def sum_stats(stats: list[common_pb2.AcceptanceStats]) -> common_pb2.AcceptanceStats:
    out = common_pb2.AcceptanceStats()
    per: list[int] = []
    for a in stats:
        out.drafts += a.drafts
        out.draft_tokens += a.draft_tokens
        out.accepted_tokens += a.accepted_tokens
        out.suffix_drafts += a.suffix_drafts
        out.suffix_nodes += a.suffix_nodes
        out.suffix_accepted_tokens += a.suffix_accepted_tokens
        out.grammar_drafts += a.grammar_drafts
        out.grammar_nodes += a.grammar_nodes
        out.grammar_accepted_tokens += a.grammar_accepted_tokens
        per += [0] * (len(a.accepted_per_position) - len(per))
        for i, c in enumerate(a.accepted_per_position):
            per[i] += c
    out.accepted_per_position.extend(per)
    return out


class Assembler:
    """Builds one request's OpenAI response from the Generate path's messages.

    :meth:`chunks` maps a message to the stream chunks it produces (deltas, a choice's finish
    chunk); :meth:`usage_chunk` is the last chunk with ``include_usage``; :meth:`body` the
    whole response (non-streaming). ``top_logprobs``: the alternatives asked for.
    """

    def __init__(self, *, chat: bool, model: str, n: int, token_text: TokenText,
                 logprobs: bool, top_logprobs: int, tools: ToolPlan | None = None):
        self.chat, self.model, self.n = chat, model, n
        self.tools = tools if chat else None
        self.calls = {i: ToolCallStream(self.tools) for i in range(n)} if self.tools else {}
        self.token_text, self.want_logprobs, self.top = token_text, logprobs, top_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text: dict[int, list[str]] = {i: [] for i in range(n)}
        self.logprobs: dict[int, list] = {i: [] for i in range(n)}
        self.offsets = dict.fromkeys(range(n), 0)   # completions' text_offset per choice
        self.finals: dict[int, gateway_pb2.GenerateResponse] = {}

    # ------------------------------------------------------------------ pieces
    def _chat_logprobs(self, lps) -> ChoiceLogprobs:
        out = []
        for lp in lps:
            text, raw = self.token_text(lp.token_id)
            tops = []
            for tid, v in list(zip(lp.top_ids, lp.top_logprobs))[:self.top]:
                t, b = self.token_text(tid)
                tops.append(TopLogprob(token=t, logprob=v, bytes=b))
            out.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=tops))
        return ChoiceLogprobs(content=out)

    def _completion_logprobs(self, index: int, lps) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            text, _ = self.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            tops: dict[str, float] = {}
            for tid, v in list(zip(lp.top_ids, lp.top_logprobs))[:self.top]:
                tops.setdefault(self.token_text(tid)[0], v)
            out.top_logprobs.append(tops)
            out.text_offset.append(self.offsets[index])
            self.offsets[index] += len(text)
        return out

    def _metrics(self, stats: common_pb2.AcceptanceStats, drafter: str) -> Metrics | None:
        sd = speculative_decoding(stats, drafter)
        return Metrics(speculative_decoding=sd) if sd is not None else None

    def _finish_reason(self, f: gateway_pb2.GenerateResponse) -> str:
        reason = FINISH_REASON.get(FINISH_NAME.get(f.finish_reason) or "", "stop")
        return OPENAI_TOOL_CALLS if self.tools is not None and reason == "stop" else reason

    def usage(self) -> Usage:
        finals = [self.finals[i] for i in sorted(self.finals)]
        prompt = finals[0].usage.prompt_tokens if finals else 0
        completion = sum(f.usage.completion_tokens for f in finals)
        cached = finals[0].usage.cached_prompt_tokens if finals else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def metrics(self) -> Metrics | None:
        """The request's statistics: its samples summed (n = 1: the sample's)."""
        finals = list(self.finals.values())
        if not finals:
            return None
        return self._metrics(sum_stats([f.acceptance for f in finals]), finals[0].drafter)

    # ------------------------------------------------------------------ streaming
    def role_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role (as OpenAI and vLLM do)."""
        if not self.chat:
            return []
        return [self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def chunks(self, r: gateway_pb2.GenerateResponse) -> list[dict]:
        self.add(r)
        i = r.index
        if r.HasField("usage"):
            f = self.finals[i]
            metrics = self._metrics(f.acceptance, f.drafter)
            if self.chat:
                out = []
                if self.tools is not None:
                    rest = self.calls[i].finish()
                    if rest:
                        out.append(self._chunk([ChunkChoice(index=i, delta=_tool_delta(rest))]))
                return out + [self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(), metrics=metrics,
                                                       finish_reason=self._finish_reason(f))])]
            return [self._chunk([CompletionChoice(index=i, text="", metrics=metrics,
                                                  finish_reason=self._finish_reason(f))])]
        lps = list(r.logprobs) if self.want_logprobs else []
        if not r.text and not lps:
            return []
        if self.tools is not None:
            calls = self.calls[i].feed(r.text)
            return [self._chunk([ChunkChoice(index=i, delta=_tool_delta(calls))])] if calls else []
        if self.chat:
            return [self._chunk([ChunkChoice(
                index=i, delta=ChoiceDelta(content=r.text),
                logprobs=self._chat_logprobs(lps) if self.want_logprobs else None)])]
        return [self._chunk([CompletionChoice(
            index=i, text=r.text,
            logprobs=self._completion_logprobs(i, lps) if self.want_logprobs else None)])]

    def usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage(), metrics=self.metrics())

    def _chunk(self, choices, **extra) -> dict:
        cls = ChatCompletionChunk if self.chat else Completion
        body = cls(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
        return body.model_dump(exclude_none=False, exclude=set() if extra else {"usage", "metrics"})

    # ------------------------------------------------------------------ whole body
    def add(self, r: gateway_pb2.GenerateResponse) -> None:
        if r.HasField("usage"):
            self.finals[r.index] = r
            return
        self.text[r.index].append(r.text)
        if self.want_logprobs:
            self.logprobs[r.index] += list(r.logprobs)

    def body(self) -> dict:
        choices: list = []   # ChatChoice or CompletionChoice, as self.chat says
        for i in range(self.n):
            f = self.finals.get(i)
            reason = self._finish_reason(f) if f is not None else OPENAI_ABORT
            metrics = self._metrics(f.acceptance, f.drafter) if f is not None else None
            text = "".join(self.text[i])
            if self.chat:
                calls = tool_calls(self.tools, text) if self.tools is not None else None
                if self.tools is not None and calls is None and reason == OPENAI_TOOL_CALLS:
                    reason = "stop"     # not a whole call: the text goes back as content
                message = (ChatMessageOut(content=None, tool_calls=[ToolCall.model_validate(c) for c in calls])
                           if calls is not None
                           else ChatMessageOut(content=text))
                choices.append(ChatChoice(
                    index=i, message=message, finish_reason=reason,
                    metrics=metrics,
                    logprobs=self._chat_logprobs(self.logprobs[i]) if self.want_logprobs else None))
            else:
                self.offsets[i] = 0
                choices.append(CompletionChoice(
                    index=i, text=text, finish_reason=reason, metrics=metrics,
                    logprobs=(self._completion_logprobs(i, self.logprobs[i])
                              if self.want_logprobs else None)))
        cls = ChatCompletion if self.chat else Completion
        return cls(id=self.id, created=self.created, model=self.model, choices=choices,
                   usage=self.usage(), metrics=self.metrics()).model_dump()
