"""What the sync and asyncio clients share: request building and collecting a stream.

Imports only grpcio, protobuf and the generated stubs (``dflash.v1``), never torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import grpc

from dflash.v1 import common_pb2, gateway_pb2

MAX_MESSAGE_MB = 256
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_MB << 20),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_MB << 20)]


class GenerateError(grpc.RpcError):
    """A Generate call the gateway refused or failed: ``code()`` (grpc.StatusCode),
    ``details()`` (the message, naming the field for INVALID_ARGUMENT) and ``retry_after_ms``
    (the server's hint with RESOURCE_EXHAUSTED, else None). A grpc.RpcError, as the calls'
    own errors are."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int | None = None):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self.retry_after_ms = code, details, retry_after_ms

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> "GenerateError":
        hint = next((v for k, v in (e.trailing_metadata() or ()) if k == "retry-after-ms"), None)
        return cls(e.code(), e.details() or "", int(hint) if hint and hint.isdigit() else None)


@dataclasses.dataclass
class Completion:
    """One finished sample as the client saw it."""

    text: str
    token_ids: list[int]
    finish_reason: str                 # "length" | "stop" | "cancelled" | "?"
    usage: gateway_pb2.Usage
    acceptance: common_pb2.AcceptanceStats
    drafter: str                       # name@version ("" = speculation off)
    ttft_s: float                      # client-side time to first text
    latency_s: float                   # client-side end-to-end
    token_times: list[float]           # client-side arrival time of each delta (s since start)
    delta_tokens: list[int] = dataclasses.field(default_factory=list)  # token ids per delta
    logprobs: list[common_pb2.TokenLogprob] = dataclasses.field(default_factory=list)
    index: int = 0                     # which of the request's n samples


def finish_name(reason: int) -> str:
    """``FINISH_REASON_LENGTH`` -> ``"length"`` ("?" for an unknown value)."""
    try:
        return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return "?"


def build_request(prompt: str | None = None, messages: Sequence[Mapping[str, str]] | None = None,
                  *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 0.0,
                  top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), speculation: bool = True,
                  drafter: str = "", session_id: str = "", block_size: int = 0,
                  speculation_mode: str = "", tree_budget: int = 0, n: int = 1,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float = 0.0, min_p: float = 0.0,
                  logit_bias: Mapping[int, float] | None = None, logprobs: bool = False,
                  top_logprobs: int = 0) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest: raw ``prompt`` text, or chat ``messages`` (``{"role", "content"}``,
    rendered with the target's chat template). 0 / "" mean the server's default or off (see
    proto/dflash/v1/gateway.proto and common.proto); the server validates every field."""
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p,
        logit_bias=dict(logit_bias or {}), logprobs=logprobs, top_logprobs=top_logprobs)
    if seed is not None:
        sampling.seed = seed
    r = gateway_pb2.GenerateRequest(sampling=sampling, max_tokens=max_tokens, stop=list(stop),
                                    stop_token_ids=list(stop_token_ids), speculation=speculation,
                                    drafter=drafter, session_id=session_id, block_size=block_size,
                                    speculation_mode=speculation_mode, tree_budget=tree_budget, n=n)
    if messages is not None:
        r.chat.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"])
                               for m in messages)
    else:
        r.prompt = prompt or ""
    return r


class Collector:
    """Folds a Generate stream into one Completion per sample (``index``)."""

    def __init__(self, on_text=None):
        self.t0 = time.perf_counter()
        self.on_text = on_text
        self.parts: dict[int, dict] = {}
        self.finals: dict[int, gateway_pb2.GenerateResponse] = {}

    def _part(self, i: int) -> dict:
        return self.parts.setdefault(i, {"text": [], "ids": [], "times": [], "counts": [],
                                         "logprobs": [], "ttft": None})

    def add(self, r: gateway_pb2.GenerateResponse) -> None:
        now = time.perf_counter() - self.t0
        p = self._part(r.index)
        if r.text or r.token_ids:
            if p["ttft"] is None:
                p["ttft"] = now
            p["times"].append(now)
            p["counts"].append(len(r.token_ids))
            p["text"].append(r.text)
            p["ids"] += list(r.token_ids)
            p["logprobs"] += list(r.logprobs)
            if self.on_text:
                self.on_text(r.text)
        if r.HasField("usage"):
            self.finals[r.index] = r

    def completions(self) -> list[Completion]:
        latency = time.perf_counter() - self.t0
        out = []
        for i in sorted(self.parts.keys() | self.finals.keys()):
            p, last = self._part(i), self.finals.get(i, gateway_pb2.GenerateResponse())
            out.append(Completion(
                text="".join(p["text"]), token_ids=p["ids"],
                finish_reason=finish_name(last.finish_reason) if i in self.finals else "?",
                usage=last.usage, acceptance=last.acceptance, drafter=last.drafter,
                ttft_s=p["ttft"] or 0.0, latency_s=latency, token_times=p["times"],
                delta_tokens=p["counts"], logprobs=p["logprobs"], index=i))
        return out


def channel_credentials(tls) -> grpc.ChannelCredentials | None:
    """``tls`` as channel credentials: grpc.ChannelCredentials as they are, or an object with
    ``credentials()`` (``dflash.serving.tls.ClientTLS``); None = plaintext."""
    if tls is None or isinstance(tls, grpc.ChannelCredentials):
        return tls
    return tls.credentials()


def call_metadata(api_key: str | None, metadata: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    md = list(metadata)
    if api_key:
        md.append(("authorization", f"Bearer {api_key}"))
    return md


def summary_line(c: Completion) -> str:
    a = c.acceptance
    rates = ", ".join(f"{x / a.drafts:.2f}" for x in a.accepted_per_position) if a.drafts else "-"
    return (f"[{c.finish_reason}] {c.usage.prompt_tokens} prompt + {c.usage.completion_tokens} "
            f"completion tokens in {c.latency_s:.2f}s (TTFT {c.ttft_s * 1000:.0f} ms); drafter "
            f"{c.drafter or 'off'}: tau {a.mean_acceptance_length or 1.0:.2f}, drafts {a.drafts}, "
            f"accepted {a.accepted_tokens}/{a.draft_tokens} (drafter "
            f"{a.accepted_tokens - a.suffix_accepted_tokens}, suffix {a.suffix_accepted_tokens}), "
            f"per-position [{rates}]")
