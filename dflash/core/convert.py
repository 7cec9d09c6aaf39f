"""Protobuf <-> domain conversions shared by the services (symmetric to/from pairs).

Tensors go through :mod:`dflash.core.wire`; everything else that two services both speak lives here.
"""

from __future__ import annotations

import json

from dflash.core.finish import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP
from dflash.core.grammar import GrammarSpec
from dflash.core.proposer import DrafterCard, DraftError, FallbackReason
from dflash.core.sampling import InvalidParam, Sampling
from dflash.core.stats import AcceptanceCounter
from dflash.v1 import common_pb2, drafter_pb2

FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
FINISH_NAME = {v: k for k, v in FINISH.items()}

# a drafter's refusal of one session: DraftError.reason <-> the wire's DraftErrorCode
DRAFT_ERROR = {
    FallbackReason.BAD_REQUEST: drafter_pb2.DRAFT_ERROR_BAD_REQUEST,
    FallbackReason.CONTEXT_GAP: drafter_pb2.DRAFT_ERROR_CONTEXT_GAP,
    FallbackReason.NO_CONTEXT: drafter_pb2.DRAFT_ERROR_NO_CONTEXT,
    FallbackReason.PREFIX_MISS: drafter_pb2.DRAFT_ERROR_PREFIX_MISS,
}
DRAFT_ERROR_NAME = {v: k for k, v in DRAFT_ERROR.items()}


def draft_error_to_proto(session_id: str, e: DraftError) -> drafter_pb2.DraftResult:
    """The DraftResult of a refused session: its code (``DRAFT_ERROR_INTERNAL`` for a reason
    without one) and the message."""
    return drafter_pb2.DraftResult(session_id=session_id, error=str(e) or e.reason,
                                   error_code=DRAFT_ERROR.get(e.reason, drafter_pb2.DRAFT_ERROR_INTERNAL))


def draft_error_from_proto(r: drafter_pb2.DraftResult) -> DraftError | None:
    """The refusal a DraftResult carries (None on success): its reason from the code, never
    from the message; ``"error"`` from a drafter that sends no code, ``"internal"`` for
    DRAFT_ERROR_INTERNAL or a code this version does not know."""
    if not r.error and not r.error_code:
        return None
    if not r.error_code:
        return DraftError(FallbackReason.ERROR, r.error)
    return DraftError(DRAFT_ERROR_NAME.get(r.error_code, FallbackReason.INTERNAL), r.error)


def card_to_proto(c: DrafterCard) -> drafter_pb2.DrafterCard:
    return drafter_pb2.DrafterCard(
        name=c.name, version=c.version, block_size=c.block_size, mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids), hidden_size=c.hidden_size,
        vocab_size=c.vocab_size, dtype=c.dtype, target_fingerprint=c.target_fingerprint,
        num_hidden_layers=c.num_hidden_layers, rope_theta=c.rope_theta)


def card_from_proto(m: drafter_pb2.DrafterCard) -> DrafterCard:
    return DrafterCard(
        name=m.name, version=m.version, block_size=m.block_size, mask_token_id=m.mask_token_id,
        target_layer_ids=tuple(m.target_layer_ids), hidden_size=m.hidden_size,
        vocab_size=m.vocab_size, dtype=m.dtype, target_fingerprint=m.target_fingerprint,
        num_hidden_layers=m.num_hidden_layers, rope_theta=m.rope_theta)


def sampling_to_proto(s: Sampling) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1.0 else 0.0,
        min_p=s.min_p, logit_bias=dict(s.logit_bias), logprobs=s.logprobs,
        top_logprobs=s.top_logprobs)
    if s.seed is not None:
        m.seed = s.seed
    return m


def sampling_from_proto(m: common_pb2.SamplingParams) -> Sampling:
    """Validate; raises InvalidParam naming the field. ``top_p`` 0 means disabled (1.0), and
    ``repetition_penalty`` 0 means off (1.0)."""
    top_p = m.top_p if m.top_p != 0 else 1.0
    if m.top_p < 0:
        raise InvalidParam("top_p", f"must be in (0, 1], got {m.top_p}")
    return Sampling(temperature=float(m.temperature), top_k=int(m.top_k), top_p=float(top_p),
                    seed=m.seed if m.HasField("seed") else None,
                    presence_penalty=float(m.presence_penalty),
                    frequency_penalty=float(m.frequency_penalty),
                    repetition_penalty=float(m.repetition_penalty), min_p=float(m.min_p),
                    logit_bias=[(int(k), float(v)) for k, v in m.logit_bias.items()],
                    logprobs=bool(m.logprobs), top_logprobs=int(m.top_logprobs))


def stats_to_proto(s: AcceptanceCounter) -> common_pb2.AcceptanceStats:
    return common_pb2.AcceptanceStats(
        drafts=s.drafts, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        accepted_per_position=list(s.accepted_per_position),
        mean_acceptance_length=s.mean_acceptance_length, fallback_steps=s.fallback_steps,
        draft_seconds=s.draft_seconds, verify_seconds=s.verify_seconds,
        tree_drafts=s.tree_drafts, tree_nodes=s.tree_nodes, suffix_drafts=s.suffix_drafts,
        suffix_nodes=s.suffix_nodes, suffix_accepted_tokens=s.suffix_accepted_tokens,
        grammar_drafts=s.grammar_drafts, grammar_nodes=s.grammar_nodes,
        grammar_accepted_tokens=s.grammar_accepted_tokens)


def stats_from_proto(m: common_pb2.AcceptanceStats) -> AcceptanceCounter:
    return AcceptanceCounter(
        drafts=m.drafts, draft_tokens=m.draft_tokens, accepted_tokens=m.accepted_tokens,
        accepted_per_position=list(m.accepted_per_position), fallback_steps=m.fallback_steps,
        draft_seconds=m.draft_seconds, verify_seconds=m.verify_seconds,
        tree_drafts=m.tree_drafts, tree_nodes=m.tree_nodes, suffix_drafts=m.suffix_drafts,
        suffix_nodes=m.suffix_nodes, suffix_accepted_tokens=m.suffix_accepted_tokens,
        grammar_drafts=m.grammar_drafts, grammar_nodes=m.grammar_nodes,
        grammar_accepted_tokens=m.grammar_accepted_tokens)


def grammar_to_proto(g: GrammarSpec) -> common_pb2.StructuredOutput:
    m = common_pb2.StructuredOutput(field=g.field)
    if g.kind == "json_schema":
        m.json_schema = g.text
    elif g.kind == "json_object":
        m.json_object = True
    elif g.kind == "regex":
        m.regex = g.text
    elif g.kind == "choice":
        m.choice.choices.extend(json.loads(g.text))
    else:
        m.grammar = g.text
    return m


def grammar_from_proto(m: common_pb2.StructuredOutput) -> GrammarSpec | None:
    """The request's grammar (None: no kind set). Raises InvalidParam naming the field for a
    text over the bounds of ``GrammarSpec``."""
    kind = m.WhichOneof("kind")
    if kind is None:
        return None
    field = m.field or "structured_output"
    if kind == "json_object":
        return GrammarSpec("json_object", "", field)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(m.choice.choices)), field)
    return GrammarSpec("lark" if kind == "grammar" else kind, getattr(m, kind), field)
