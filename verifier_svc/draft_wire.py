"""The Draft stream's messages on the verifier's side: a step's ``ProposalRequest``s as
``DraftItem``s, a ``DraftResult`` as a ``Proposal`` or ``DraftError``, the breaker's probe, and
what a session's last draft call cost on the wire (:class:`WireStat`, for metrics and spans).
``verifier_svc.drafter_client.RemoteProposer`` sends and receives them."""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, runtime_checkable

import torch

from dflash.core import wire
from dflash.core.convert import draft_error_from_proto, sampling_to_proto
from dflash.core.proposer import DraftError, FallbackReason, Proposal, ProposalRequest
from dflash.serving.tracing import inject_context
from dflash.v1 import drafter_pb2

MAX_WIRE_STATS = 4096
# More context rows for one session than a steady step sends (its committed tokens, at most a
# block of 64, plus what --context-flush lets wait): an upload, not held to the step's budget.
UPLOAD_ROWS = 128


def is_upload(r: ProposalRequest) -> bool:
    """A session's context from position 0, from a cached prefix (the drafter may have to be
    sent all of it after all), or more than ``UPLOAD_ROWS`` rows of it."""
    return r.context_start == 0 or bool(r.prefix_key) or r.context.shape[0] > UPLOAD_ROWS




@dataclasses.dataclass(frozen=True)
class WireStat:
    """A session's last successful draft call as the verifier saw it (for metrics and spans)."""

    context_bytes: int           # hidden-state bytes sent for this session
    round_trip_seconds: float    # request queued -> reply received (the whole batch)
    drafter_seconds: float       # the drafter's own compute (DraftBatchResult.draft_seconds)


@runtime_checkable
class WireStats(Protocol):
    """A proposer that reports each session's last draft call (``RemoteProposer``)."""

    def take_wire_stat(self, session_id: str) -> WireStat | None: ...


class WireLog:
    """Each session's last successful draft call (:class:`WireStat`), taken once; the
    ``MAX_WIRE_STATS`` sessions recorded last are kept (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: dict[str, WireStat] = {}   # session id -> last call, oldest first

    def record(self, items: list[drafter_pb2.DraftItem], round_trip_s: float, drafter_s: float) -> None:
        with self._lock:
            for it in items:
                self._stats.pop(it.session_id, None)
                self._stats[it.session_id] = WireStat(len(it.context.data), round_trip_s, drafter_s)
            while len(self._stats) > MAX_WIRE_STATS:
                self._stats.pop(next(iter(self._stats)), None)

    def take(self, session_id: str) -> WireStat | None:
        with self._lock:
            return self._stats.pop(session_id, None)

    def drop(self, session_ids: list[str]) -> None:
        with self._lock:
            for s in session_ids:
                self._stats.pop(s, None)


def to_items(requests: list[ProposalRequest], wire_dtype=None) -> tuple[list[drafter_pb2.DraftItem], int]:
    """The ``DraftItem`` of each request, its context features in ``wire_dtype`` (None: as
    they are), and the context bytes they carry together."""
    items = []
    nbytes = 0
    caller = inject_context()  # the caller's span; each item may carry its request's own
    for r in requests:
        ctx = r.context if wire_dtype is None else r.context.to(wire_dtype)
        t = wire.to_proto(ctx)
        nbytes += len(t.data)
        items.append(drafter_pb2.DraftItem(
            session_id=r.session_id, context_start=r.context_start, context=t,
            anchor_token=r.anchor_token, block_size=r.block_size,
            sampling=sampling_to_proto(r.sampling), trace_context=r.trace_context or caller,
            top_k=r.top_k, no_learn=r.no_learn, context_ids=r.context_ids,
            prefix_key=r.prefix_key))
    return items, nbytes


def failed_sessions(resp: drafter_pb2.DraftBatchResult, ids: list[str]) -> list[str]:
    """The sessions of a batch (``ids``, in the order sent) that its reply ``resp`` failed:
    those whose result is an error, every one when the result count is off."""
    if len(resp.results) != len(ids):
        return ids
    return [r.session_id or sid for r, sid in zip(resp.results, ids) if r.error]


def probe_item(session_id: str, width: int, wire_dtype=None) -> drafter_pb2.DraftItem:
    """The breaker's probe: a one-row zero context of ``width`` features (in ``wire_dtype``),
    one draft position."""
    ctx = torch.zeros(1, width, dtype=torch.float32)
    if wire_dtype is not None:
        ctx = ctx.to(wire_dtype)
    return drafter_pb2.DraftItem(session_id=session_id, context_start=0,
                                 context=wire.to_proto(ctx), anchor_token=0, block_size=2)


def from_result(r: drafter_pb2.DraftResult) -> Proposal | DraftError:
    """A session's draft, or why the drafter refused it or sent one that cannot be read."""
    refused = draft_error_from_proto(r)
    if refused is not None:
        return refused
    try:
        probs = wire.from_proto(r.probs, "probs") if r.HasField("probs") else None
    except wire.WireError as e:
        return DraftError(FallbackReason.MALFORMED_PROBS, str(e))
    try:   # absent from a chain drafter; their shapes and values: DrafterSync.malformed
        top_ids = wire.from_proto(r.top_ids, "top_ids") if r.HasField("top_ids") else None
        top_lp = (wire.from_proto(r.top_logprobs, "top_logprobs")
                  if r.HasField("top_logprobs") else None)
    except wire.WireError as e:
        return DraftError(FallbackReason.MALFORMED_TOPK, str(e))
    return Proposal(tokens=torch.tensor(list(r.tokens), dtype=torch.int64), probs=probs,
                    top_ids=top_ids, top_logprobs=top_lp)
