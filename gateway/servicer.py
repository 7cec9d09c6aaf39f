"""gRPC servicer of the Gateway: validate, tokenize, forward to the verifier, stream text.

:meth:`GatewayServicer.stream` is the one Generate path: the gRPC ``Generate`` and the HTTP
front (:mod:`gateway.openai_api`) both call it, and map what it raises to their status codes
through one table (:mod:`gateway.status`). Every check that costs little runs before
tokenisation (:class:`InputLimits`, roles, stop strings and ids, names), so an oversized or
malformed request is refused without touching the tokenizer. Errors name the field and quote at
most :data:`ECHO_CHARS` characters of a value.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import grpc

from dflash.core.convert import FINISH_NAME, sampling_from_proto, sampling_to_proto
from dflash.core.errors import FieldError
from dflash.core.sampling import InvalidParam, Sampling
from dflash.core.speculation import MAX_TREE_BUDGET, MODES, SpecMode
from dflash.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from gateway.chat_template import chat_ids, check_template_kwargs
from gateway.generation import Cancel, merge, sample_stream
from gateway.inputs import ROLES, InputLimits, NotOwner, check_session_id, client_identity, short, verifier_session_id
from gateway.registry import DrafterRegistry
from gateway.resent import ResentAnswers
from gateway.status import RETRY_AFTER, UpstreamError, grpc_code

log = logging.getLogger("dflash.gateway")


@dataclasses.dataclass
class _Session:
    drafter: str            # label the session sticks to ("" = none)
    last_used: float
    owner: str = ""         # client_identity of its creator


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Args: tokenizer (transformers), verifier stub, registry, context window, session TTL,
    input limits, and the vocabulary size stop token ids must fall in (default: the
    tokenizer's, ``len(tokenizer)``). ``resent``: the tenants' remembered answers
    (:mod:`gateway.resent`; None: every prompt tokenized from its text alone).

    Sessions belong to the client that created them (``identity(context)``: by default
    :func:`client_identity`; with API keys, ``gateway.auth.ClientAuth.identity``, the key's
    name); another client continuing or closing one gets PERMISSION_DENIED and the session is
    left as it was.
    """

    def __init__(self, tokenizer, verifier, registry: DrafterRegistry, *, max_positions: int,
                 session_ttl_s: float = 600.0, limits: InputLimits | None = None,
                 vocab_size: int | None = None, identity=client_identity,
                 resent: ResentAnswers | None = None):
        self.identity = identity
        self.resent = resent
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
    def _check(self, r: gateway_pb2.GenerateRequest, fill_context: bool = False):
        """Every check that does not need the tokenizer; returns the validated Sampling.
        ``fill_context``: max_tokens 0 stands for the rest of the context window. Raises
        InvalidParam naming the field."""
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
        if r.max_tokens < 1 and not (fill_context and r.max_tokens == 0):
            raise InvalidParam("max_tokens", f"must be >= 1, got {r.max_tokens}")
        sampling = sampling_from_proto(r.sampling)
        bad = next((t for t, _ in sampling.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidParam("logit_bias", f"token id {bad} outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if not 0 <= r.n <= lim.max_n:
            raise InvalidParam("n", f"must be in [1, {lim.max_n}], got {r.n}")
        if r.n > 1 and r.session_id:
            raise InvalidParam("n", "must be 1 with a session_id (one session holds one sample)")
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
    def _prompt_ids(self, r: gateway_pb2.GenerateRequest,
                    template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids (call after :meth:`_check`). Raises InvalidParam."""
        if r.WhichOneof("input") == "prompt":
            if template_kwargs:
                raise InvalidParam("chat_template_kwargs", "only with chat messages")
            return list(self.tok.encode(r.prompt))
        return chat_ids(self.tok, [{"role": m.role, "content": m.content} for m in r.chat.messages],
                        template_kwargs)

    def _tokenized(self, r: gateway_pb2.GenerateRequest, owner: str,
                   template_kwargs: dict | None) -> tuple[list[int], str | None]:
        """The prompt's ids (:meth:`_prompt_ids`, or ``owner``'s remembered answer's ids + the
        rest's, ``gateway.resent``) and, when the resent-answer memory may remember this turn,
        its rendered text (else None). Raises InvalidParam."""
        if self.resent is None or r.WhichOneof("input") != "chat":
            return self._prompt_ids(r, template_kwargs), None
        msgs = [{"role": m.role, "content": m.content} for m in r.chat.messages]
        kwargs = template_kwargs or {}
        check_template_kwargs(kwargs)
        text = self.resent.render(msgs, kwargs)
        ids = self.resent.splice(owner, msgs, text) if text is not None else None
        return (ids if ids is not None else chat_ids(self.tok, msgs, kwargs)), text

    def _drafter(self, r: gateway_pb2.GenerateRequest) -> str:
        """The drafter label for this request; a session sticks to its first choice. A named
        drafter must be registered even when speculation is off. Raises InvalidParam."""
        entry = None
        if r.drafter:
            try:
                entry = self.registry.resolve(r.drafter)
            except InvalidParam:
                known = ", ".join(e.label for e, _ in self.registry.entries()) or "none registered"
                raise InvalidParam("drafter", f"unknown drafter {short(r.drafter)} (known: {known})") from None
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
            old = [(k, s.owner) for k, s in self._sessions.items()
                   if now - s.last_used > self.session_ttl_s]
        for k, owner in old:
            self._close(k, owner)
        return len(old)

    def _close(self, session_id: str, owner: str) -> bool:
        """Forget ``owner``'s session here and free its state on the verifier."""
        with self._lock:
            existed = self._sessions.pop(session_id, None) is not None
        try:
            r = self.verifier.CloseSession(verifier_pb2.CloseSessionRequest(
                session_id=verifier_session_id(owner, session_id)), timeout=5)
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
            owner = self.identity(context)
            self._check_owner(request.session_id, owner)
        except NotOwner as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except InvalidParam as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gateway_pb2.GatewayCloseSessionResponse(existed=self._close(request.session_id, owner))

    def ListDrafters(self, request, context):
        from gateway.admin import list_proto

        return list_proto(self.registry)


    # ------------------------------------------------------------------ the Generate core
    def _verifier_request(self, r: gateway_pb2.GenerateRequest, prompt: list[int],
                          sampling: Sampling, entry, index: int, group: str, owner: str
                          ) -> verifier_pb2.VerifierGenerateRequest:
        """Sample ``index``'s verifier request: its seed is the request's + ``index`` (mod
        2**64; without a seed each sample draws its own from the OS). ``group``: the request's
        prefix group (its samples share the prompt's prefill; empty for one sample). The
        session is ``owner``'s (:func:`gateway.inputs.verifier_session_id`)."""
        if sampling.seed is not None and index:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**64)
        return verifier_pb2.VerifierGenerateRequest(
            request_id=uuid.uuid4().hex, session_id=verifier_session_id(owner, r.session_id),
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(sampling), max_tokens=r.max_tokens,
            stop_token_ids=list(r.stop_token_ids), prefix_group=group, tenant=owner,
            structured_output=r.structured_output if r.HasField("structured_output") else None,
            speculation=verifier_pb2.SpeculationParams(
                enabled=entry is not None, drafter_address=entry.address if entry else "",
                block_size=r.block_size, tree_budget=r.tree_budget,
                # speculation turned off is off: no suffix drafts either
                mode=SpecMode.OFF if r.HasField("speculation") and not r.speculation
                else r.speculation_mode))

    def _fit_window(self, request: gateway_pb2.GenerateRequest, prompt_len: int
                    ) -> gateway_pb2.GenerateRequest:
        """``request`` with ``max_tokens`` 0 (fill_context) made the rest of the context window.
        Raises InvalidParam naming ``prompt`` or ``max_tokens`` when they do not fit it."""
        if prompt_len >= self.max_positions:
            raise InvalidParam("prompt", f"{prompt_len} tokens do not fit the context window "
                               f"of {self.max_positions} tokens")
        if request.max_tokens == 0:    # fill_context: the rest of the window
            filled = gateway_pb2.GenerateRequest()
            filled.CopyFrom(request)
            filled.max_tokens = self.max_positions - prompt_len
            request = filled
        if prompt_len + request.max_tokens > self.max_positions:
            raise InvalidParam("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens "
                               f"({request.max_tokens}) exceeds the context window of "
                               f"{self.max_positions} tokens")
        return request

    def stream(self, request: gateway_pb2.GenerateRequest, owner: str, cancel: Cancel | None = None,
               *, chat_template_kwargs: dict | None = None, fill_context: bool = False
               ) -> Iterator[gateway_pb2.GenerateResponse]:
        """The one Generate path (gRPC and HTTP): check, tokenize, choose the drafter, run the
        request's ``n`` samples on the verifier (concurrently when several), stream their text.

        Yields deltas (text, ``token_ids``, ``logprobs``, ``index``) and, per sample, a final
        message with finish reason, usage, acceptance statistics, drafter and TTFT. ``owner``
        is the caller's identity (sessions belong to it); ``cancel`` cancels the verifier calls
        (the client went away); ``chat_template_kwargs``: extra chat-template variables;
        ``fill_context``: ``max_tokens`` 0 asks for the rest of the context window (the HTTP
        API's default when a chat request gives none).

        Raises (lazily, at the first ``next``): InvalidParam naming the field, NotOwner for
        another client's session, UpstreamError for the verifier's refusal or failure.
        """
        t0 = time.perf_counter()
        cancel = cancel or Cancel()
        sampling = self._check(request, fill_context)
        self._check_owner(request.session_id, owner)
        label = self._drafter(request)
        prompt, text = self._tokenized(request, owner, chat_template_kwargs)
        request = self._fit_window(request, len(prompt))
        if request.session_id:
            self._claim(request.session_id, label, owner)
        entry = self.registry.get(label) if label else None
        stop = list(request.stop)
        # one group per request, never per client: another client's prompt never shares
        group = uuid.uuid4().hex if request.n > 1 else ""
        lead = threading.Event() if group else None    # sample 0 prefills, the others copy
        samples = [sample_stream(self.verifier, self.tok,
                                 self._verifier_request(request, prompt, sampling, entry, i, group, owner),
                                 stop=stop, index=i, cancel=cancel, t0=t0,
                                 prefilled=lead if i == 0 else None)
                   for i in range(max(1, request.n))]
        merged = merge(samples, cancel, lead)
        if text is not None and self.resent is not None:
            merged = self.resent.remembering(merged, owner, text, prompt)
        try:
            for r in merged:
                if r.HasField("usage"):
                    r.drafter = label
                    log.info("request done: %d+%d tokens, finish=%s, drafter=%s, tau=%.2f%s",
                             len(prompt), r.usage.completion_tokens,
                             FINISH_NAME.get(r.finish_reason), label or "-",
                             r.acceptance.mean_acceptance_length or 1.0,
                             f", sample {r.index}" if request.n > 1 else "")
                yield r
        finally:
            merged.close()
        if request.session_id:
            with self._lock:
                self._sessions[request.session_id] = _Session(label, time.monotonic(), owner)

    def observed_stream(self, request: gateway_pb2.GenerateRequest, owner: str, cancel: Cancel,
                        *, trace_headers: dict | None = None, response_id: str | None = None,
                        stream: bool | None = None, **kw
                        ) -> Iterator[gateway_pb2.GenerateResponse]:
        """:meth:`stream` (``kw``: its keywords) for callers outside gRPC (the HTTP front); the
        observed servicer traces and measures it (``trace_headers``: the client's W3C context;
        ``response_id`` and ``stream``: what the HTTP response is, for its span)."""
        return self.stream(request, owner, cancel, **kw)

    def Generate(self, request, context):
        cancel = Cancel()
        context.add_callback(cancel.cancel)
        try:
            yield from self.stream(request, self.identity(context), cancel)
        except UpstreamError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER, str(e.retry_after_ms)),))
            context.abort(e.code, str(e))
        except FieldError as e:
            context.abort(grpc_code(e), str(e))
