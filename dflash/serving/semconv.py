"""Span names and attribute keys: the OpenTelemetry GenAI semantic conventions plus ``dflash.*``.

The ``gen_ai.*`` keys are those of the GenAI conventions (the ``gen_ai_attributes`` module of
``opentelemetry-semantic-conventions``; tests/test_semconv.py checks each against it), so
generic GenAI dashboards read our spans as they read vLLM's. The ``dflash.*`` keys are ours:
speculative-decoding acceptance, named as in docs/architecture.md.

Older names are still written beside the new ones for one release (:data:`ALIASES`, applied by
:func:`with_aliases`); docs/observability.md has the table old -> new.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# --- GenAI conventions --------------------------------------------------------------------
OPERATION = "gen_ai.operation.name"
OP_CHAT = "chat"                       # a chat.messages request (chat template applied)
OP_TEXT_COMPLETION = "text_completion"  # a raw prompt
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"   # seconds: TTFT
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CHOICE_COUNT = "gen_ai.request.choice.count"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
TOP_K = "gen_ai.request.top_k"
SEED = "gen_ai.request.seed"
STREAM = "gen_ai.request.stream"

# --- dflash: speculative decoding ---------------------------------------------------------
TAU = "dflash.mean_acceptance_length"          # 1 + accepted / drafts (bonus token included)
DRAFTS = "dflash.drafts"
DRAFT_TOKENS = "dflash.draft_tokens"
ACCEPTED_TOKENS = "dflash.accepted_tokens"
ACCEPTED_PER_POSITION = "dflash.accepted_per_position"
DRAFTER_VERSION = "dflash.drafter_version"     # name@version
E2E_SECONDS = "dflash.e2e_seconds"

# --- dflash: spans of the services (verifier_svc/observe.py, drafter_svc/observe.py) -------
SPAN_VERIFIER_PREFILL = "verifier.prefill"     # a request's prompt into the target's cache
SPAN_VERIFIER_DECODE = "verifier.decode"       # a request's decode steps, parent of each step
SPAN_VERIFIER_STEP = "verifier.step"           # one decode step of one request
SPAN_DRAFTER_DRAFT = "drafter.draft"           # one session's part of a draft batch

# --- dflash: attribute keys of those spans and of the GenAI span -----------------------------
ACCEPTED = "dflash.accepted"
ACCEPTED_DRAFTER = "dflash.accepted.drafter"
ACCEPTED_SUFFIX = "dflash.accepted.suffix"
ACCEPTED_TOKENS_DRAFTER = "dflash.accepted_tokens.drafter"
ACCEPTED_TOKENS_SUFFIX = "dflash.accepted_tokens.suffix"
BATCH_ITEMS = "dflash.batch_items"
BATCH_SIZE = "dflash.batch_size"
BLOCK_SIZE = "dflash.block_size"
CANCELLED = "dflash.cancelled"
CONTEXT_BYTES = "dflash.context_bytes"
CONTEXT_ROWS = "dflash.context_rows"
CONTEXT_START = "dflash.context_start"
DRAFT_SECONDS = "dflash.draft_seconds"
DRAFTED = "dflash.drafted"
DRAFTER_ADDRESS = "dflash.drafter_address"
DRAFTER_REQUESTED = "dflash.drafter_requested"
EMITTED = "dflash.emitted"
FALLBACK = "dflash.fallback"
FALLBACK_STEPS = "dflash.fallback_steps"
FINISH_REASON = "dflash.finish_reason"
POLICY_BATCH = "dflash.policy.batch"
POLICY_COST_SECONDS = "dflash.policy.cost_seconds"
POLICY_DRAFTS = "dflash.policy.drafts"
POLICY_EXPECTED_TOKENS = "dflash.policy.expected_tokens"
POLICY_EXPLORED = "dflash.policy.explored"
POLICY_TREE_BUDGET = "dflash.policy.tree_budget"
POLICY_WAITING = "dflash.policy.waiting"
REQUEST_ID = "dflash.request_id"
SESSION_ID = "dflash.session_id"
SPEC_MODE = "dflash.spec_mode"
SPECULATION = "dflash.speculation"
STEP = "dflash.step"
STEP_SUFFIX_NODES = "dflash.suffix.nodes"          # verifier.step; the request's: SUFFIX_NODES
SUFFIX_DRAFTS = "dflash.suffix_drafts"
SUFFIX_NODES = "dflash.suffix_nodes"
STEP_TREE_NODES = "dflash.tree.nodes"              # verifier.step; the request's: TREE_NODES
STEP_TREE_PATH_LENGTH = "dflash.tree.path_length"
TREE_DRAFTS = "dflash.tree_drafts"
TREE_NODES = "dflash.tree_nodes"
VERIFY_SECONDS = "dflash.verify_seconds"
WIRE_SECONDS = "dflash.wire_seconds"

# new name -> the name it replaces (still written, until the next release)
ALIASES: Mapping[str, str] = {
    INPUT_TOKENS: "gen_ai.usage.prompt_tokens",
    OUTPUT_TOKENS: "gen_ai.usage.completion_tokens",
    TIME_TO_FIRST_CHUNK: "gen_ai.latency.time_to_first_token",
    E2E_SECONDS: "gen_ai.latency.e2e",
    CHOICE_COUNT: "gen_ai.request.n",
    CACHE_READ_INPUT_TOKENS: "dflash.cached_prompt_tokens",
}


def with_aliases(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """``attrs`` plus, for each new key in :data:`ALIASES`, the same value under its old key."""
    out = dict(attrs)
    for new, old in ALIASES.items():
        if new in attrs:
            out[old] = attrs[new]
    return out


def span_name(operation: str, model: str) -> str:
    """The GenAI span name: ``"{gen_ai.operation.name} {gen_ai.request.model}"``."""
    return f"{operation} {model}" if model else operation
