"""gRPC servicer of the Gateway: validate, tokenize, forward to the verifier, stream text."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import grpc

from dflash.convert import FINISH, FINISH_NAME, sampling_from_proto, sampling_to_proto
from dflash.sampling import InvalidParam
from dflash.speculation import MAX_TREE_BUDGET, MODES
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2
from gateway.detok import IncrementalDetokenizer
from gateway.registry import DrafterRegistry

log = logging.getLogger("dflash.gateway")
_PASSTHROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclasses.dataclass
class _Session:
    drafter: str            # label the session sticks to ("" = none)
    last_used: float


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Args: tokenizer (transformers), verifier stub, registry, context window, session TTL."""

    def __init__(self, tokenizer, verifier, registry: DrafterRegistry, *, max_positions: int,
                 session_ttl_s: float = 600.0):
        self.tok = tokenizer
        self.verifier = verifier
        self.registry = registry
        self.max_positions = max_positions
        self.session_ttl_s = session_ttl_s
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ helpers
    def _prompt_ids(self, r: gateway_pb2.GenerateRequest) -> list[int]:
        kind = r.WhichOneof("input")
        if kind == "prompt":
            if not r.prompt:
                raise InvalidParam("prompt", "must not be empty")
            return list(self.tok.encode(r.prompt))
        if kind == "chat":
            if not r.chat.messages:
                raise InvalidParam("chat.messages", "must not be empty")
            for i, m in enumerate(r.chat.messages):
                if not m.role:
                    raise InvalidParam(f"chat.messages[{i}].role", "must not be empty")
            msgs = [{"role": m.role, "content": m.content} for m in r.chat.messages]
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return list(self.tok.encode(text, add_special_tokens=False))
        raise InvalidParam("prompt", "give a prompt or chat messages")

    def _validate(self, r: gateway_pb2.GenerateRequest, n_prompt: int):
        if r.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be >= 1, got {r.max_tokens}")
        sampling = sampling_from_proto(r.sampling)
        if n_prompt >= self.max_positions:
            raise InvalidParam("prompt", f"{n_prompt} tokens do not fit the context window of "
                               f"{self.max_positions} tokens")
        if r.block_size < 0:
            raise InvalidParam("block_size", "must be >= 0")
        if r.speculation_mode not in ("", *MODES):
            raise InvalidParam("speculation_mode",
                               f"{r.speculation_mode!r} not one of {', '.join(MODES)}")
        if not 0 <= r.tree_budget <= MAX_TREE_BUDGET:
            raise InvalidParam("tree_budget", f"must be in [0, {MAX_TREE_BUDGET}], got {r.tree_budget}")
        return sampling

    def _drafter(self, r: gateway_pb2.GenerateRequest) -> str:
        """The drafter label for this request; a session sticks to its first choice."""
        if r.HasField("speculation") and not r.speculation:
            return ""
        with self._lock:
            s = self._sessions.get(r.session_id) if r.session_id else None
        if s is not None and not r.drafter and s.drafter and self.registry.get(s.drafter):
            return s.drafter  # sticky while it stays registered
        entry = self.registry.resolve(r.drafter)
        return entry.label if entry else ""

    def expire_sessions(self) -> int:
        now = time.monotonic()
        with self._lock:
            old = [k for k, s in self._sessions.items() if now - s.last_used > self.session_ttl_s]
        for k in old:
            self._close(k)
        return len(old)

    def _close(self, session_id: str) -> bool:
        with self._lock:
            existed = self._sessions.pop(session_id, None) is not None
        try:
            r = self.verifier.CloseSession(verifier_pb2.CloseSessionRequest(session_id=session_id),
                                           timeout=5)
            existed = existed or r.existed
        except grpc.RpcError:
            log.warning("verifier CloseSession failed for %s", session_id)
        return existed

    # ------------------------------------------------------------------ RPCs
    def CloseSession(self, request, context):
        return gateway_pb2.GatewayCloseSessionResponse(existed=self._close(request.session_id))

    def ListDrafters(self, request, context):
        from gateway.admin import list_proto

        return list_proto(self.registry)

    def Generate(self, request, context):
        t0 = time.perf_counter()
        try:
            prompt = self._prompt_ids(request)
            sampling = self._validate(request, len(prompt))
            label = self._drafter(request)
        except InvalidParam as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        entry = self.registry.get(label) if label else None
        if request.session_id:
            with self._lock:
                self._sessions[request.session_id] = _Session(label, time.monotonic())
        vreq = verifier_pb2.VerifierGenerateRequest(
            request_id=uuid.uuid4().hex, session_id=request.session_id, prompt_token_ids=prompt,
            sampling=sampling_to_proto(sampling), max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            speculation=verifier_pb2.SpeculationParams(
                enabled=entry is not None, drafter_address=entry.address if entry else "",
                block_size=request.block_size, mode=request.speculation_mode,
                tree_budget=request.tree_budget))
        call = self.verifier.Generate(vreq)
        context.add_callback(call.cancel)
        detok = IncrementalDetokenizer(self.tok, list(request.stop))
        ttft = None
        last = None
        try:
            for chunk in call:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                d = detok.push(list(chunk.token_ids))
                if d.text or d.token_ids:
                    yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids)
                last = chunk
                if detok.stopped:
                    call.cancel()
                    break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return
            code = e.code() if e.code() in _PASSTHROUGH else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"verifier: {e.details()}")
        if not detok.stopped:
            d = detok.finish()
            if d.text or d.token_ids:
                yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids)
        if request.session_id:
            with self._lock:
                self._sessions[request.session_id] = _Session(label, time.monotonic())
        final = gateway_pb2.GenerateResponse(drafter=label, ttft_seconds=ttft or 0.0)
        final.finish_reason = (common_pb2.FINISH_REASON_STOP if detok.stopped
                               else (last.finish_reason if last else common_pb2.FINISH_REASON_CANCELLED))
        final.usage.prompt_tokens = len(prompt)
        final.usage.completion_tokens = detok.num_tokens
        if last is not None:
            final.usage.cached_prompt_tokens = last.cached_prompt_tokens
            if last.HasField("stats"):
                final.acceptance.CopyFrom(last.stats)
        log.info("request done: %d+%d tokens, finish=%s, drafter=%s, tau=%.2f", len(prompt),
                 detok.num_tokens, FINISH_NAME.get(final.finish_reason), label or "-",
                 final.acceptance.mean_acceptance_length or 1.0)
        yield final
