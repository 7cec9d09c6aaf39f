"""gRPC servicer of the Verifier service: protobuf in -> one engine call -> protobuf out."""

from __future__ import annotations

import logging
import threading
import uuid

import grpc

from dflash.core.cards import check_drafter_card
from dflash.core.convert import (
    FINISH,
    card_from_proto,
    card_to_proto,
    grammar_from_proto,
    sampling_from_proto,
    stats_to_proto,
)
from dflash.core.proposer import FallbackReason
from dflash.core.sampling import InvalidParam
from dflash.serving.authz import caller_identity
from dflash.serving.owners import SessionOwners
from dflash.serving.server import RETRY_AFTER_KEY
from dflash.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.breaker import BreakerConfig
from verifier_svc.drafter_client import RemoteProposer, describe
from verifier_svc.engine import VerifierEngine
from verifier_svc.load import load_of
from verifier_svc.request import PreconditionError, Request, RequestTrace, SlowConsumer, StepEvent
from verifier_svc.scheduler import Overloaded
from verifier_svc.target import TargetUnavailable

log = logging.getLogger("dflash.verifier")


class DrafterPool:
    """One checked ``RemoteProposer`` per drafter address, created on first use.

    ``aliases`` (``--drafter-alias``): named address -> the address dialed for it, so replicas
    on one host behind a gateway that names one drafter address each reach their own drafter.
    ``get`` raises PreconditionError when the drafter does not fit the target, and
    ``grpc.RpcError`` when it cannot be reached.
    """

    def __init__(self, engine: VerifierEngine, *, timeout_s: float = 2.0, wire_dtype=None,
                 breaker: BreakerConfig = BreakerConfig(), tls=None,
                 aliases: dict[str, str] | None = None):
        self.engine = engine
        self.tls = tls   # dflash.serving.tls.ClientTLS to drafters, None = plaintext
        self.timeout_s = timeout_s
        self.wire_dtype = wire_dtype
        self.breaker = breaker
        self.aliases = dict(aliases or {})
        self._proposers: dict[str, RemoteProposer] = {}
        self._lock = threading.Lock()

    def dial(self, address: str) -> str:
        """The address this verifier connects to for the drafter named ``address``."""
        return self.aliases.get(address, address)

    def get(self, address: str) -> RemoteProposer:
        """The proposer for the drafter named ``address`` (keyed by that name, dialed at
        :meth:`dial`)."""
        with self._lock:
            p = self._proposers.get(address)
        if p is not None:
            return p
        dialed = self.dial(address)
        card = describe(dialed, tls=self.tls)
        for w in check_drafter_card(card, self.engine.target):
            log.warning("drafter %s at %s: %s", card.label, dialed, w)
        with self._lock:
            p = self._proposers.setdefault(address, RemoteProposer(
                dialed, card, timeout_s=self.timeout_s, wire_dtype=self.wire_dtype,
                breaker=self.breaker, tls=self.tls))
        return p

    def proposers(self) -> list[RemoteProposer]:
        """The drafters in use (for the circuit-breaker gauges)."""
        with self._lock:
            return list(self._proposers.values())

    def close(self) -> None:
        with self._lock:
            for p in self._proposers.values():
                p.close()
            self._proposers.clear()


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``require_registered``: speculate only with drafter addresses that passed CheckDrafter
    here (the gateway checks every drafter it registers); a Generate naming another address
    is refused with FAILED_PRECONDITION ``speculation.drafter_address``, so no context
    feature goes to an address nobody registered. Attribute, settable after construction.

    Over mTLS a session belongs to the identity whose call first named it
    (:class:`dflash.serving.owners.SessionOwners`): Generate or CloseSession naming it from
    another identity gets PERMISSION_DENIED ``session_id`` and leaves it intact."""

    def __init__(self, engine: VerifierEngine | None, pool: DrafterPool | None, metrics=None,
                 *, require_registered: bool = False):
        self.engine = engine
        self.pool = pool
        self.metrics = metrics
        self.require_registered = require_registered
        self.no_learn_tenants: frozenset[str] = frozenset()   # never captured by a learning drafter
        self._registered: set[str] = set()    # addresses whose CheckDrafter succeeded
        self._registered_lock = threading.Lock()
        self.owners = SessionOwners()
        self.draining = lambda: False         # the server is stopping: set by server.build

    def registered_drafters(self) -> set[str]:
        """Drafter addresses that passed CheckDrafter (a copy)."""
        with self._registered_lock:
            return set(self._registered)

    def _ready(self, context) -> VerifierEngine:
        engine = self.engine
        if engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "verifier is loading")
            raise AssertionError("unreachable: context.abort raises")
        failure = engine.target.failure
        if failure:  # an expert-parallel rank died: fail fast, never queue behind a dead group
            context.abort(grpc.StatusCode.UNAVAILABLE, f"target unavailable: {failure}")
        return engine

    def Load(self, request, context):
        """The Model Server Protocol's figures (:func:`verifier_svc.load.load_of`)."""
        return load_of(self.engine, draining=self.draining())

    def Describe(self, request, context):
        t = self._ready(context).target
        return verifier_pb2.TargetCard(
            model=str(t.path), hidden_size=t.hidden_size, num_hidden_layers=t.num_layers,
            vocab_size=t.vocab_size, max_position_embeddings=t.max_positions,
            fingerprint=t.fingerprint, eos_token_ids=sorted(t.eos_token_ids),
            dtype=str(t.dtype).replace("torch.", ""), rope_theta=t.rope_theta)

    def CheckDrafter(self, request, context):
        engine = self._ready(context)
        try:
            if request.WhichOneof("drafter") == "address":
                dialed = self.pool.dial(request.address) if self.pool else request.address
                card = describe(dialed, tls=self.pool.tls if self.pool else None)
            elif request.WhichOneof("drafter") == "card":
                card = card_from_proto(request.card)
            else:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drafter: give a card or an address")
            check_drafter_card(card, engine.target)
        except PreconditionError as e:
            context.abort(grpc.StatusCode[e.status], str(e))
        except grpc.RpcError as e:
            # The details say why (a refused TLS handshake: wrong CA, host name, expired).
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"address: drafter unreachable ({e.code()}: {e.details()})")
        if request.WhichOneof("drafter") == "address":
            with self._registered_lock:
                self._registered.add(request.address)
        return verifier_pb2.CheckDrafterResponse(card=card_to_proto(card))

    def CloseSession(self, request, context):
        engine = self._ready(context)
        try:
            self.owners.check(request.session_id, caller_identity(context))
        except PreconditionError as e:
            context.abort(grpc.StatusCode[e.status], str(e))
        existed = engine.close_session(request.session_id)
        self.owners.forget(request.session_id)
        return verifier_pb2.CloseSessionResponse(existed=existed)

    def Generate(self, request, context):
        return self._generate(request, context, None)

    def _generate(self, request, context, trace: RequestTrace | None):
        engine = self._ready(context)
        try:
            req = self._request(request)
            self.owners.claim(req.session_id, caller_identity(context))
            # before the session is touched: a refused turn keeps its session's cache
            engine.scheduler.check_admission(len(req.prompt))
            req.proposer = self._proposer(request, context)
            req.trace = trace
            events = engine.generate(req, cancelled=lambda: not context.is_active())
            first = next(events)  # validation errors surface here, before anything is streamed
        except (InvalidParam, PreconditionError) as e:   # the field errors: one status lookup
            context.abort(grpc.StatusCode[e.status], str(e))
        except TargetUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Overloaded as e:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        prompt_tokens, cached = first.prompt_tokens, first.cached_prompt_tokens
        try:
            for ev in _chain(first, events):
                chunk = verifier_pb2.VerifierGenerateChunk(token_ids=ev.tokens, accepted=ev.accepted,
                                                           drafted=ev.drafted)
                _add_step_work(chunk, ev)
                if ev.logprobs:
                    chunk.logprobs.extend(common_pb2.TokenLogprob(
                        token_id=lp.token_id, logprob=lp.logprob, top_ids=lp.top_ids,
                        top_logprobs=lp.top_logprobs) for lp in ev.logprobs)
                if ev.finish:
                    chunk.finish_reason = FINISH[ev.finish]
                    chunk.stats.CopyFrom(stats_to_proto(ev.stats))
                    chunk.prompt_tokens = prompt_tokens
                    chunk.cached_prompt_tokens = cached
                yield chunk
        except TargetUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except SlowConsumer as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            events.close()  # a cancelled stream frees the session now, not at garbage collection

    def _request(self, m: verifier_pb2.VerifierGenerateRequest) -> Request:
        stops = frozenset(int(t) for t in m.stop_token_ids)
        return Request(request_id=m.request_id or uuid.uuid4().hex, session_id=m.session_id,
                       prompt=list(m.prompt_token_ids), sampling=sampling_from_proto(m.sampling),
                       max_tokens=m.max_tokens, stop_token_ids=stops, ignore_eos=m.ignore_eos,
                       block_size=m.speculation.block_size, spec_mode=m.speculation.mode,
                       tree_budget=m.speculation.tree_budget, prefix_group=m.prefix_group,
                       tenant=m.tenant, resumed=m.resumed_tokens, no_learn=m.tenant in self.no_learn_tenants,
                       grammar=grammar_from_proto(m.structured_output))

    def _proposer(self, m, context):
        spec = m.speculation
        if not spec.enabled:
            return None
        if not spec.drafter_address:
            raise InvalidParam("speculation.drafter_address", "required when speculation is enabled")
        if self.require_registered:
            with self._registered_lock:
                known = spec.drafter_address in self._registered
            if not known:   # refused before any connection to it: nothing is sent there
                raise PreconditionError("speculation.drafter_address",
                                        f"{spec.drafter_address[:64]!r} is not a registered "
                                        "drafter (register it through the gateway's admin plane)")
        assert self.pool is not None            # set with the engine, which _ready found
        try:
            return self.pool.get(spec.drafter_address)
        except grpc.RpcError as e:
            # A drafter failure never fails a request: run without speculation.
            log.warning("drafter %s unreachable (%s): request %s runs without speculation",
                        spec.drafter_address, e.code(), m.request_id)
            if self.metrics:
                self.metrics.fallback(FallbackReason.UNAVAILABLE, "unknown")
            return None


def _add_step_work(chunk: verifier_pb2.VerifierGenerateChunk, ev: StepEvent) -> None:
    """The step's share of the request's statistics (what ``engine`` adds to ``ev.stats`` for
    it), so a stream cut early still counts the work of the steps it received. The prefill
    event's seconds are not in the statistics and are left out here too."""
    if ev.step < 0:
        return
    chunk.fallback = bool(ev.fallback)           # as the engine counts fallback_steps
    chunk.tree_nodes = ev.tree_nodes
    chunk.suffix_nodes = ev.suffix_nodes
    chunk.suffix_accepted = ev.suffix_accepted
    chunk.draft_seconds = ev.draft_seconds
    chunk.verify_seconds = ev.verify_seconds


def _chain(first, rest):
    yield first
    yield from rest
