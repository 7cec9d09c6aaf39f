"""The proposer protocol: what the verifier's decode loop needs from a drafter.

``propose(requests) -> results`` carries, per session, the context features of newly committed
positions plus the anchor token, and returns a draft block. Implementations: the in-process
DFlash drafter engine (``drafter_svc.engine.DrafterEngine``), the gRPC client of a remote
drafter (``verifier_svc.drafter_client.RemoteProposer``), and test doubles (oracle,
adversarial). Domain types only; no protobuf here.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch

from dflash.core.sampling import Sampling

#: Most top-k alternatives per block position a drafter returns (``ProposalRequest.top_k``):
#: DDTree needs K = min(node budget, vocabulary) per depth (Ringel & Romano, arXiv 2604.12989,
#: section 3); 64 bounds the wire and the drafter's top-k work per block.
MAX_TOP_K = 64
#: Largest block (anchor + drafts) a drafter may declare or a request may ask for.
MAX_BLOCK_SIZE = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterCard:
    """What a drafter is and which target it fits (mirrors ``dflash.v1.DrafterCard``)."""

    name: str
    version: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    dtype: str
    target_fingerprint: str = ""
    num_hidden_layers: int = 0
    rope_theta: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


@dataclasses.dataclass(kw_only=True)
class ProposalRequest:
    """One session's input for one step."""

    session_id: str
    context_start: int          # absolute position of context row 0
    context: torch.Tensor       # [n, len(target_layer_ids) * H] taps of committed positions
    anchor_token: int           # the bonus token, at position context_start + n
    block_size: int             # anchor + (block_size - 1) drafts; <= 1: context update only
    sampling: Sampling
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # W3C, this request's step span
    top_k: int = 0              # alternatives per draft position (Proposal.top_ids); 0 = none
    no_learn: bool = False      # its tenant opted out: never captured (dflash.learn.capture)
    # committed ids of the context rows' positions, -1 where withheld (the prompt); () = not sent
    context_ids: tuple[int, ...] = ()
    # non-empty: start over from the first context_start positions of the drafter's cached
    # prefix with this key (PrefixKeeper.keep_prefix); DraftError(PREFIX_MISS) when not held
    prefix_key: bytes = b""


@dataclasses.dataclass(kw_only=True)
class Proposal:
    """A draft block: ``tokens`` int64 [K]; ``probs`` float32 [K, V] when sampling, else None.

    With ``ProposalRequest.top_k`` > 0 (and K > 0) also the drafter's top alternatives per draft
    position, from the same forward, what DDTree builds its tree from (liranringel/ddtree
    ``build_ddtree_tree``): ``top_ids`` int64 [K, c] target-vocabulary ids, distinct per row,
    and ``top_logprobs`` float32 [K, c] their log-probabilities under the drafter's own
    distribution at temperature 1 (log-softmax of its logits, whatever the request's sampling),
    sorted descending along the last dim; c = min(top_k, the drafter's vocabulary). None from a
    chain drafter that predates top-k. ``tokens`` and ``probs`` do not depend on ``top_k``.
    """

    tokens: torch.Tensor                        # [K] int64
    probs: torch.Tensor | None = None           # [K, V] float32
    top_ids: torch.Tensor | None = None         # [K, c] int64
    top_logprobs: torch.Tensor | None = None    # [K, c] float32, descending per row


class FallbackReason(StrEnum):
    """Why a step verified none of a session's drafts: ``DraftError.reason``,
    ``StepEvent.fallback``, and the ``reason`` label of ``dflash_spec_decode_fallback_steps``
    (values are public: docs/observability.md). One value per cause."""

    # the drafter refused the session (on the wire: ``dflash.core.convert.DRAFT_ERROR``)
    BAD_REQUEST = "bad_request"
    CONTEXT_GAP = "context_gap"        # the drafter holds fewer positions than the request assumes
    NO_CONTEXT = "no_context"          # the drafter holds no context for the session
    PREFIX_MISS = "prefix_miss"        # the drafter holds no cached prefix under the item's key
    INTERNAL = "internal"              # DRAFT_ERROR_INTERNAL, or a code this version does not know
    ERROR = "error"                    # a refusal from a drafter that sends no code
    # the call failed (``verifier_svc.drafter_client``, ``verifier_svc.drafter_sync``)
    TIMEOUT = "timeout"                # no reply within --draft-timeout
    LATE = "late"                      # the step stopped waiting (its draft budget); the drafter
    #                                    still takes the context in
    UNAVAILABLE = "unavailable"        # the stream is down or reconnecting
    CIRCUIT_OPEN = "circuit_open"      # the drafter's breaker keeps it out of the step path
    EXCEPTION = "exception"            # the proposer raised
    # the reply is unusable (``DrafterSync.malformed``)
    MALFORMED_BLOCK = "malformed_block"
    OUT_OF_VOCAB = "out_of_vocab"
    MALFORMED_PROBS = "malformed_probs"
    MALFORMED_TOPK = "malformed_topk"


class DraftError(RuntimeError):
    """A drafter failed for one session or one step. ``reason`` (a :class:`FallbackReason`; a
    plain string only from test doubles) is a metric label."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


def check_top_k(top_k: int) -> None:
    """Raises ``DraftError("bad_request", ...)`` naming ``top_k`` unless 0 <= top_k <= MAX_TOP_K
    (a drafter refuses that session alone; the rest of its batch is drafted)."""
    if not 0 <= top_k <= MAX_TOP_K:
        raise DraftError(FallbackReason.BAD_REQUEST, f"top_k: must be in [0, {MAX_TOP_K}], got {top_k}")


class Proposer(Protocol):
    """A source of draft blocks."""

    card: DrafterCard

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        """One result per request, in order; a failure for one session is a ``DraftError``."""
        ...

    def release(self, session_ids: list[str]) -> None:
        """Forget these sessions' context."""
        ...


#: Longest key of a kept prefix (``PrefixKeeper.keep_prefix``, ``ProposalRequest.prefix_key``).
MAX_PREFIX_KEY = 64


@runtime_checkable
class PrefixKeeper(Protocol):
    """A proposer that keeps finished sessions' context as prefixes later sessions start from
    (the drafter's side of the verifier's prefix cache, ``docs/drafter-context.md``)."""

    def keep_prefix(self, session_id: str, key: bytes, length: int) -> None:
        """The session ends; its context becomes the prefix ``key`` when the drafter holds
        exactly ``length`` positions for it (else nothing is kept). Never raises for a
        drafter's failure: a later item naming ``key`` is then a ``PREFIX_MISS``."""
        ...
