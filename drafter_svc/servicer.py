"""gRPC servicer of the Drafter service: protobuf in -> one engine call -> protobuf out."""

from __future__ import annotations

import hashlib
import logging
import time

import grpc

from dflash.core import wire
from dflash.core.convert import card_to_proto, draft_error_to_proto, sampling_from_proto
from dflash.core.errors import PreconditionError
from dflash.core.proposer import MAX_PREFIX_KEY, DraftError, FallbackReason, PrefixKeeper, Proposal, ProposalRequest
from dflash.core.sampling import InvalidParam
from dflash.serving.authz import caller_identity
from dflash.serving.owners import SessionOwners
from dflash.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("dflash.drafter")


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Serves one engine implementing the Proposer protocol (DFlash, or a test double).

    Over mTLS a session belongs to the verifier identity whose Draft stream first sent it
    (:class:`dflash.serving.owners.SessionOwners`): another identity's items for it get a
    ``bad_request`` DraftError naming ``session_id`` and its releases of it are ignored, so
    neither reads, overwrites nor frees that context. Kept prefixes are the caller's too: their
    keys are scoped by its identity (:func:`scoped_key`), so no other verifier names them."""

    def __init__(self, engine):
        self.engine = engine
        self.owners = SessionOwners()

    def _ready(self, context) -> None:
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is loading")

    def Describe(self, request, context):
        self._ready(context)
        return card_to_proto(self.engine.card)

    def Draft(self, request_iterator, context):
        self._ready(context)
        caller = caller_identity(context)       # None without mTLS: nothing is checked
        seen: set[str] = set()
        try:
            for batch in request_iterator:
                if batch.keep_prefixes:
                    self._keep(batch.keep_prefixes, caller)
                    seen.difference_update(k.session_id for k in batch.keep_prefixes)
                if batch.release_sessions:
                    mine = self.owners.release(batch.release_sessions, caller)
                    self.engine.release(mine)
                    seen.difference_update(mine)
                t0 = time.perf_counter()
                reqs = []
                results: list = [None] * len(batch.items)   # a DraftResult for each item below
                for i, item in enumerate(batch.items):
                    try:
                        r = _request(item, caller)
                        self.owners.claim(item.session_id, caller)
                        reqs.append((i, r))
                        seen.add(item.session_id)
                    except (wire.WireError, InvalidParam, PreconditionError) as e:
                        results[i] = draft_error_to_proto(item.session_id,
                                                          DraftError(FallbackReason.BAD_REQUEST, str(e)))
                if reqs:
                    outs = self.engine.propose([r for _, r in reqs])
                    for (i, r), out in zip(reqs, outs):
                        results[i] = _result(r.session_id, out)
                yield drafter_pb2.DraftBatchResult(batch_id=batch.batch_id, results=results,
                                                   draft_seconds=time.perf_counter() - t0)
        finally:
            # The verifier on the other end is gone: its sessions' context is useless now.
            if seen:
                self.engine.release(self.owners.release(sorted(seen), caller))


    def _keep(self, keeps, caller: str | None) -> None:
        """Each session ends; its context becomes a prefix under its scoped key (an engine
        that keeps no prefixes, or a malformed keep, only releases it)."""
        mine = set(self.owners.release([k.session_id for k in keeps], caller))
        for k in keeps:
            if k.session_id not in mine:
                continue
            if isinstance(self.engine, PrefixKeeper) and 0 < len(k.key) <= MAX_PREFIX_KEY:
                self.engine.keep_prefix(k.session_id, scoped_key(k.key, caller), k.length)
            else:
                self.engine.release([k.session_id])


def scoped_key(key: bytes, caller: str | None) -> bytes:
    """A prefix key as the engine holds it: the caller's own (a digest with its identity) over
    mTLS, the verifier's key as it is without."""
    if caller is None:
        return key
    return hashlib.blake2b(key, digest_size=32, person=b"dflash-prefix", salt=b"",
                           key=hashlib.blake2b(caller.encode(), digest_size=32).digest()).digest()


def _request(item: drafter_pb2.DraftItem, caller: str | None = None) -> ProposalRequest:
    if not item.session_id:
        raise InvalidParam("session_id", "must not be empty")
    if len(item.prefix_key) > MAX_PREFIX_KEY:
        raise InvalidParam("prefix_key", f"{len(item.prefix_key)} bytes, more than {MAX_PREFIX_KEY}")
    context = wire.from_proto(item.context, "context")
    rows = context.shape[0] if context.dim() else 0
    if item.context_ids and len(item.context_ids) != rows:
        raise InvalidParam("context_ids", f"{len(item.context_ids)} ids for {rows} context rows")
    return ProposalRequest(session_id=item.session_id, context_start=item.context_start,
                           context=context,
                           anchor_token=item.anchor_token, block_size=item.block_size,
                           sampling=sampling_from_proto(item.sampling), top_k=item.top_k,
                           no_learn=item.no_learn, context_ids=tuple(item.context_ids),
                           prefix_key=scoped_key(item.prefix_key, caller) if item.prefix_key else b"")


def _result(session_id: str, out: Proposal | DraftError) -> drafter_pb2.DraftResult:
    if isinstance(out, DraftError):
        return draft_error_to_proto(session_id, out)
    r = drafter_pb2.DraftResult(session_id=session_id, tokens=out.tokens.tolist())
    if out.probs is not None:
        r.probs.CopyFrom(wire.to_proto(out.probs.float()))
    if out.top_ids is not None:
        r.top_ids.CopyFrom(wire.to_proto(out.top_ids.long()))
    if out.top_logprobs is not None:
        r.top_logprobs.CopyFrom(wire.to_proto(out.top_logprobs.float()))
    return r
