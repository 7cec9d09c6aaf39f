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
