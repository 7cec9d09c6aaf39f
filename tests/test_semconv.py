"""The span attribute keys are the OpenTelemetry GenAI semantic conventions' own, and each old
name is still written beside its new one (dflash.serving.semconv)."""

from __future__ import annotations

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai

from dflash.serving import semconv as sc


def test_gen_ai_keys_are_the_conventions():
    ours = {v for k, v in vars(sc).items() if k.isupper() and isinstance(v, str)
            and v.startswith("gen_ai.")}
    theirs = {v for k, v in vars(genai).items() if k.startswith("GEN_AI_") and isinstance(v, str)}
    assert ours and ours <= theirs, sorted(ours - theirs)
    ops = {v.value for v in genai.GenAiOperationNameValues}
    assert {sc.OP_CHAT, sc.OP_TEXT_COMPLETION} <= ops


def test_replaced_names_are_the_deprecated_ones():
    # the library marks exactly these as replaced by our new keys
    assert sc.ALIASES[sc.INPUT_TOKENS] == genai.GEN_AI_USAGE_PROMPT_TOKENS
    assert sc.ALIASES[sc.OUTPUT_TOKENS] == genai.GEN_AI_USAGE_COMPLETION_TOKENS


def test_with_aliases_writes_old_beside_new():
    out = sc.with_aliases({sc.INPUT_TOKENS: 7, sc.TAU: 2.5})
    assert out == {sc.INPUT_TOKENS: 7, "gen_ai.usage.prompt_tokens": 7, sc.TAU: 2.5}


def test_span_name():
    assert sc.span_name(sc.OP_CHAT, "smollm2") == "chat smollm2"
    assert sc.span_name(sc.OP_CHAT, "") == "chat"
