"""A small client of the Gateway service (used by ``dflash generate``, the demo and the bench)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import grpc

from dflash.server import channel_options
from dflash.tls import ClientTLS, channel as tls_channel
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclasses.dataclass
class Completion:
    """One finished generation as the client saw it."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: gateway_pb2.Usage
    acceptance: common_pb2.AcceptanceStats
    drafter: str
    ttft_s: float            # client-side time to first text
    latency_s: float         # client-side end-to-end
    token_times: list[float]  # client-side arrival time of each streamed delta (s since start)
    delta_tokens: list[int] = dataclasses.field(default_factory=list)  # token ids per delta


def build_request(prompt: str | None = None, messages: list[dict] | None = None, *,
                  max_tokens: int = 128, temperature: float = 0.0, top_p: float = 0.0,
                  top_k: int = 0, seed: int | None = None, stop: list[str] = (),
                  speculation: bool = True, drafter: str = "", session_id: str = "",
                  block_size: int = 0, speculation_mode: str = "",
                  tree_budget: int = 0) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        sampling.seed = seed
    r = gateway_pb2.GenerateRequest(sampling=sampling, max_tokens=max_tokens, stop=list(stop),
                                    speculation=speculation, drafter=drafter,
                                    session_id=session_id, block_size=block_size,
                                    speculation_mode=speculation_mode, tree_budget=tree_budget)
    if messages is not None:
        r.chat.messages.extend(gateway_pb2.ChatMessage(**m) for m in messages)
    else:
        r.prompt = prompt or ""
    return r


class GatewayClient:
    """Gateway stub over one channel to ``address``: TLS when ``tls`` (``dflash.tls.ClientTLS``:
    the CA that signed the gateway, and a client certificate for mTLS), plaintext otherwise."""

    def __init__(self, address: str, tls: ClientTLS | None = None):
        self.channel = tls_channel(address, tls, options=channel_options())
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def stream(self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
               ) -> Iterator[gateway_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout)

    def complete(self, request: gateway_pb2.GenerateRequest, on_text=None,
                 timeout: float | None = None) -> Completion:
        t0 = time.perf_counter()
        text, ids, times, counts, ttft, last = [], [], [], [], None, None
        for r in self.stream(request, timeout=timeout):
            now = time.perf_counter() - t0
            if r.text or r.token_ids:
                if ttft is None:
                    ttft = now
                times.append(now)
                counts.append(len(r.token_ids))
                text.append(r.text)
                ids += list(r.token_ids)
                if on_text:
                    on_text(r.text)
            last = r
        from dflash.convert import FINISH_NAME

        return Completion(text="".join(text), token_ids=ids,
                          finish_reason=FINISH_NAME.get(last.finish_reason) or "?",
                          usage=last.usage, acceptance=last.acceptance, drafter=last.drafter,
                          ttft_s=ttft or 0.0, latency_s=time.perf_counter() - t0, token_times=times,
                          delta_tokens=counts)

    def close(self) -> None:
        self.channel.close()


def summary_line(c: Completion) -> str:
    a = c.acceptance
    rates = ", ".join(f"{x / a.drafts:.2f}" for x in a.accepted_per_position) if a.drafts else "-"
    return (f"[{c.finish_reason}] {c.usage.prompt_tokens} prompt + {c.usage.completion_tokens} "
            f"completion tokens in {c.latency_s:.2f}s (TTFT {c.ttft_s * 1000:.0f} ms); drafter "
            f"{c.drafter or 'off'}: tau {a.mean_acceptance_length or 1.0:.2f}, drafts {a.drafts}, "
            f"accepted {a.accepted_tokens}/{a.draft_tokens}, per-position [{rates}]")
