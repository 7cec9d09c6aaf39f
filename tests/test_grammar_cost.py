"""The grammar's cost and its forced tokens in the verifier's metrics (the tiny random target,
byte tokenizer): every decode step of a structured request counts one row in
``dflash_verifier_grammar_rows_total`` and adds its grammar seconds, a request without a grammar
adds nothing; the tokens only the grammar forced are the ``grammar`` source of
``dflash_spec_decode_num_accepted_tokens_by_source`` (not the drafter's), and the three sources
sum to the accepted tokens."""

from __future__ import annotations

import json

import pytest

from dflash.core.grammar import GrammarSpec
from dflash.serving.telemetry import Telemetry
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.observe import VerifierObserver

SCHEMA = {"type": "object", "properties": {"id": {"const": 7}, "tags": {"const": ["a", "b"]},
                                           "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 4}},
          "required": ["id", "tags", "ok", "name"], "additionalProperties": False}


@pytest.fixture()
def observed(target_model):
    e = VerifierEngine(target_model, spec_mode="fixed", tree_budget=8)
    tel = Telemetry(service="verifier")
    VerifierObserver(tel).bind(e)
    yield e, tel.registry
    e.close()


def _samples(registry, name: str) -> dict[str, float]:
    """``name``'s samples by their ``source`` label ("" without one), summed over the rest."""
    out: dict[str, float] = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get("source", "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def _generate(engine, sid: str, grammar: GrammarSpec | None):
    req = Request(request_id=sid, session_id=sid, prompt=[72, 101, 108, 108, 111], max_tokens=60,
                  spec_mode="fixed", grammar=grammar)
    events = list(engine.generate(req))
    engine.close_session(sid)
    return events


def test_grammar_rows_and_seconds_count_the_structured_steps_only(observed):
    engine, registry = observed
    events = _generate(engine, "g", GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rows = _samples(registry, "dflash_verifier_grammar_rows_total")[""]
    seconds = _samples(registry, "dflash_verifier_grammar_seconds_total")[""]
    assert rows == len(events) - 1 == engine.grammar_time.rows    # every decode step (not the prefill)
    assert seconds > 0 and seconds == pytest.approx(engine.grammar_time.seconds)
    _generate(engine, "free", None)
    assert _samples(registry, "dflash_verifier_grammar_rows_total")[""] == rows
    assert _samples(registry, "dflash_verifier_grammar_seconds_total")[""] == seconds


def test_forced_tokens_are_the_grammars_source_in_the_metrics(observed):
    engine, registry = observed
    events = _generate(engine, "forced", GrammarSpec("json_schema", json.dumps(SCHEMA)))
    st = events[-1].stats
    assert st.grammar_accepted_tokens > 0              # no drafter: only forced stretches drafted
    assert sum(ev.grammar_accepted for ev in events) == st.grammar_accepted_tokens
    by = _samples(registry, "dflash_spec_decode_num_accepted_tokens_by_source_total")
    assert by["grammar"] == st.grammar_accepted_tokens
    assert by["drafter"] == st.drafter_accepted_tokens == st.accepted_tokens - st.grammar_accepted_tokens \
        - st.suffix_accepted_tokens
    assert sum(by.values()) == _samples(registry, "dflash_spec_decode_num_accepted_tokens_total")[""]
