"""gRPC servicer of the Gateway: validate, tokenize, forward to the verifier, stream text.

Every check that costs little runs before tokenisation (:class:`InputLimits`, roles, stop
strings and ids, names), so an oversized or malformed request is refused without touching the
tokenizer. Errors name the field and quote at most :data:`ECHO_CHARS` characters of a value.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import grpc
from jinja2 import TemplateError

from dflash.convert import FINISH_NAME, sampling_from_proto, sampling_to_proto
from dflash.sampling import InvalidParam
from dflash.speculation import MAX_TREE_BUDGET, MODES
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2
from gateway.detok import IncrementalDetokenizer
from gateway.emitted import EmittedStats
from gateway.inputs import (ROLES, InputLimits, NotOwner, check_session_id, client_identity,
                            short)
from gateway.registry import DrafterRegistry

log = logging.getLogger("dflash.gateway")
_PASSTHROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
RETRY_AFTER = "retry-after-ms"      # the verifier's admission hint, passed on to the client


@dataclasses.dataclass
class _Session:
    drafter: str            # label the session sticks to ("" = none)
    last_used: float
    owner: str = ""         # client_identity of its creator


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Args: tokenizer (transformers), verifier stub, registry, context window, session TTL,
    input limits, and the vocabulary size stop token ids must fall in (default: the
    tokenizer's, ``len(tokenizer)``).

    Sessions belong to the client that created them (``identity(context)``: by default
    :func:`client_identity`; with API keys, ``gateway.auth.ClientAuth.identity``, the key's
    name); another client continuing or closing one gets PERMISSION_DENIED and the session is
    left as it was.
    """

    def __init__(self, tokenizer, verifier, registry: DrafterRegistry, *, max_positions: int,
                 session_ttl_s: float = 600.0, limits: InputLimits | None = None,
                 vocab_size: int | None = None, identity=client_identity):
        self.identity = identity
        self.tok = tokenizer
        self.verifier = verifier
        self.registry = registry
        self.max_positions = max_positions
        self.session_ttl_s = session_ttl_s
        self.limits = limits or InputLimits()
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ checks before tokenising
    def _check(self, r: gateway_pb2.GenerateRequest):
        """Every check that does not need the tokenizer; returns the validated Sampling.
        Raises InvalidParam naming the field."""
        lim = self.limits
        kind = r.WhichOneof("input")
        if kind == "prompt":
            if not r.prompt:
                raise InvalidParam("prompt", "must not be empty")
            if len(r.prompt) > lim.max_prompt_chars:
                raise InvalidParam("prompt", f"{len(r.prompt)} characters, more than the limit "
                                   f"of {lim.max_prompt_chars}")
        elif kind == "chat":
            self._check_chat(r.chat.messages)
        else:
            raise InvalidParam("prompt", "give a prompt or chat messages")
        if r.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be >= 1, got {r.max_tokens}")
        sampling = sampling_from_proto(r.sampling)
        if len(r.stop) > lim.max_stop_strings:
            raise InvalidParam("stop", f"{len(r.stop)} stop strings, more than the limit of "
                               f"{lim.max_stop_strings}")
        for i, s in enumerate(r.stop):
            if not s:
                raise InvalidParam(f"stop[{i}]", "must not be empty")
            if len(s) > lim.max_stop_chars:
                raise InvalidParam(f"stop[{i}]", f"{len(s)} characters, more than the limit of "
                                   f"{lim.max_stop_chars}")
        if len(r.stop_token_ids) > lim.max_stop_token_ids:
            raise InvalidParam("stop_token_ids", f"{len(r.stop_token_ids)} ids, more than the "
                               f"limit of {lim.max_stop_token_ids}")
        for i, t in enumerate(r.stop_token_ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidParam(f"stop_token_ids[{i}]", f"token id {t} outside the vocabulary "
                                   f"[0, {self.vocab_size})")
        if r.session_id:
            check_session_id(r.session_id, lim.max_session_id_chars)
        if len(r.drafter) > lim.max_name_chars:
            raise InvalidParam("drafter", f"{len(r.drafter)} characters, more than the limit of "
                               f"{lim.max_name_chars}")
        if r.block_size < 0:
            raise InvalidParam("block_size", "must be >= 0")
        if r.speculation_mode not in ("", *MODES):
            raise InvalidParam("speculation_mode",
                               f"{short(r.speculation_mode)} not one of {', '.join(MODES)}")
        if not 0 <= r.tree_budget <= MAX_TREE_BUDGET:
            raise InvalidParam("tree_budget", f"must be in [0, {MAX_TREE_BUDGET}], got {r.tree_budget}")
        return sampling

    def _check_chat(self, messages) -> None:
        lim = self.limits
        if not messages:
            raise InvalidParam("chat.messages", "must not be empty")
        if len(messages) > lim.max_chat_messages:
            raise InvalidParam("chat.messages", f"{len(messages)} messages, more than the limit "
                               f"of {lim.max_chat_messages}")
        chars = 0
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidParam(f"chat.messages[{i}].role", "must not be empty")
            if m.role not in ROLES:
                raise InvalidParam(f"chat.messages[{i}].role",
                                   f"{short(m.role)} not one of {', '.join(ROLES)}")
            chars += len(m.content)
            if chars > lim.max_prompt_chars:
                raise InvalidParam(f"chat.messages[{i}].content", "the contents exceed the limit "
                                   f"of {lim.max_prompt_chars} characters in all")

    # ------------------------------------------------------------------ tokenising
    def _prompt_ids(self, r: gateway_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids (call after :meth:`_check`). Raises InvalidParam."""
        if r.WhichOneof("input") == "prompt":
            return list(self.tok.encode(r.prompt))
        return self._chat_ids([{"role": m.role, "content": m.content} for m in r.chat.messages])

    def _chat_ids(self, msgs: list[dict]) -> list[int]:
        """Render the chat template and encode it; special tokens typed in a content stay text.

        transformers' ``sanitize_control_tokens``: control tokens in the messages are marked
        before rendering and encoded as ordinary text, so only the template's own become control
        tokens (without any typed, the ids equal encoding the rendered text). Raises
        InvalidParam("chat.messages") when the template refuses the chat or the tokenizer cannot
        keep a typed control token as text.
        """
        try:
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, sanitize_control_tokens=True)
        except (ValueError, TemplateError) as e:
            raise InvalidParam("chat.messages", f"cannot be rendered: {str(e)[:120]}")
        return list(ids)

    def _drafter(self, r: gateway_pb2.GenerateRequest) -> str:
        """The drafter label for this request; a session sticks to its first choice. A named
        drafter must be registered even when speculation is off. Raises InvalidParam."""
        entry = None
        if r.drafter:
            try:
                entry = self.registry.resolve(r.drafter)
            except InvalidParam:
                known = ", ".join(e.label for e, _ in self.registry.entries()) or "none registered"
                raise InvalidParam("drafter", f"unknown drafter {short(r.drafter)} (known: {known})")
        if r.HasField("speculation") and not r.speculation:
            return ""
        if not r.drafter:
            with self._lock:
                s = self._sessions.get(r.session_id) if r.session_id else None
            if s is not None and s.drafter and self.registry.get(s.drafter):
                return s.drafter  # sticky while it stays registered
            entry = self.registry.resolve("")
        return entry.label if entry else ""

    # ------------------------------------------------------------------ sessions
    def _check_owner(self, session_id: str, owner: str) -> None:
        """Raises NotOwner when ``session_id`` is held by a client other than ``owner``."""
        with self._lock:
            s = self._sessions.get(session_id) if session_id else None
        if s is not None and s.owner != owner:
            raise NotOwner("session_id", "belongs to another client")

    def _claim(self, session_id: str, label: str, owner: str) -> None:
        """Record the session for ``owner`` (atomic with the owner check). Raises NotOwner."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None and s.owner != owner:
                raise NotOwner("session_id", "belongs to another client")
            self._sessions[session_id] = _Session(label, time.monotonic(), owner)

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
        """INVALID_ARGUMENT for a malformed session_id; PERMISSION_DENIED for another client's."""
        try:
            if not request.session_id:
                raise InvalidParam("session_id", "must not be empty")
            check_session_id(request.session_id, self.limits.max_session_id_chars)
            self._check_owner(request.session_id, self.identity(context))
        except NotOwner as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except InvalidParam as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gateway_pb2.GatewayCloseSessionResponse(existed=self._close(request.session_id))

    def ListDrafters(self, request, context):
        from gateway.admin import list_proto

        return list_proto(self.registry)

    def Generate(self, request, context):
        t0 = time.perf_counter()
        try:
            owner = self.identity(context)
            sampling = self._check(request)
            self._check_owner(request.session_id, owner)
            label = self._drafter(request)
            prompt = self._prompt_ids(request)
            if len(prompt) >= self.max_positions:
                raise InvalidParam("prompt", f"{len(prompt)} tokens do not fit the context window "
                                   f"of {self.max_positions} tokens")
            if request.session_id:
                self._claim(request.session_id, label, owner)
        except NotOwner as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except InvalidParam as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        entry = self.registry.get(label) if label else None
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
        emitted = EmittedStats()
        ttft = None
        last = None
        try:
            for chunk in call:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                before = detok.num_tokens
                d = detok.push(list(chunk.token_ids))
                emitted.step(detok.num_tokens - before, chunk.accepted, chunk.drafted)
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
            hint = [(k, v) for k, v in (e.trailing_metadata() or ()) if k == RETRY_AFTER]
            if hint:
                context.set_trailing_metadata(hint)
            context.abort(code, f"verifier: {e.details()}")
        if not detok.stopped:
            d = detok.finish()
            if d.text or d.token_ids:
                yield gateway_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids)
        if request.session_id:
            with self._lock:
                self._sessions[request.session_id] = _Session(label, time.monotonic(), owner)
        final = gateway_pb2.GenerateResponse(drafter=label, ttft_seconds=ttft or 0.0)
        final.finish_reason = (common_pb2.FINISH_REASON_STOP if detok.stopped
                               else (last.finish_reason if last else common_pb2.FINISH_REASON_CANCELLED))
        final.usage.prompt_tokens = len(prompt)
        final.usage.completion_tokens = detok.num_tokens
        verifier_stats = last.stats if last is not None and last.HasField("stats") else None
        if last is not None:
            final.usage.cached_prompt_tokens = last.cached_prompt_tokens
        if verifier_stats is not None and not detok.stopped:
            final.acceptance.CopyFrom(verifier_stats)   # every token it committed was emitted
        else:   # a stop string cut the output (or the stream ended without statistics)
            final.acceptance.CopyFrom(emitted.to_proto(verifier_stats))
        log.info("request done: %d+%d tokens, finish=%s, drafter=%s, tau=%.2f", len(prompt),
                 detok.num_tokens, FINISH_NAME.get(final.finish_reason), label or "-",
                 final.acceptance.mean_acceptance_length or 1.0)
        yield final
