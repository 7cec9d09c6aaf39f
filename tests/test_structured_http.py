"""Structured outputs and tool calls on the HTTP API, with the real ``openai`` client.

A real in-process verifier and gateway on the tiny random target (byte tokenizer) with the tiny
DFlash drafter: ``response_format`` json_object / json_schema, vLLM's ``structured_outputs``
(json, regex, choice, grammar) give outputs inside their grammar, speculative or not, and the
same text either way; ``tools`` with ``tool_choice`` required or named come back as OpenAI
``tool_calls`` (``finish_reason: "tool_calls"``), whole and streamed, parsed by the client; a
grammar that cannot finish within ``max_tokens`` ends with ``length``; every bad input is a 400
naming its field; gRPC takes a ``StructuredOutput`` too; 100 concurrent requests with distinct
schemas all end inside their schema and the compiled-grammar cache stays within its bound.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from dflash.v1 import common_pb2, gateway_pb2

from gateway_doubles import http_front, request
from helpers import Stack

B = 4
CHAT = [{"role": "user", "content": "Give me the record."}]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "rain": {"type": "boolean"}}, "required": ["city", "year", "rain"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(target_model, tokenizer, make_drafter, tiny_target):
    from drafter_svc.engine import DrafterEngine

    stack = Stack(target_model, tokenizer, spec_mode="fixed", tree_budget=8)
    stack.add_drafter(DrafterEngine.from_pretrained(make_drafter(block_size=B), tiny_target),
                      default=True)
    h = http_front(stack.gateway.servicer, serving=lambda: stack.gateway.serving)
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield stack, h, client
    client.close()
    h.stop()
    stack.close()


def _chat(client, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 80), extra_body=extra, **kw)


def test_json_schema_and_json_object_stay_inside_and_equal_without_speculation(served):
    _, _, client = served
    rf = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    outs = {}
    for spec in (True, False):
        r = _chat(client, response_format=rf, extra_body={"speculation": spec})
        (c,) = r.choices
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        outs[spec] = (c.message.content, r.metrics["speculative_decoding"] if spec else None)
    assert outs[True][0] == outs[False][0]
    assert outs[True][1]["num_accepted_tokens_by_source"]["grammar"] > 0   # forced keys and separators
    r = _chat(client, response_format={"type": "json_object"}, max_tokens=60)
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.startswith("{")


@pytest.mark.parametrize("kind,value,check", [
    ("json", SCHEMA, lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
    ("regex", r"[0-9]{2}-[a-c]{3}", lambda s: re.fullmatch(r"[0-9]{2}-[a-c]{3}", s) is not None),
    ("choice", ["yes", "no", "maybe"], lambda s: s in ("yes", "no", "maybe")),
    ("grammar", 'start: "x" ("+" "x")~1..3', lambda s: re.fullmatch(r"x(\+x){1,3}", s) is not None),
])
def test_vllm_structured_outputs(served, kind, value, check):
    _, _, client = served
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            text = _chat(client, extra_body={"structured_outputs": {kind: value}}).choices[0].message.content
        else:
            text = client.completions.create(model="tiny", prompt="Answer:", max_tokens=80, temperature=0,
                                             extra_body={"structured_outputs": {kind: value}}).choices[0].text
        assert check(text), (kind, endpoint, text)


def test_a_grammar_that_cannot_finish_ends_with_length(served):
    _, _, client = served
    r = _chat(client, max_tokens=5, response_format={"type": "json_schema", "json_schema": {
        "name": "rec", "schema": SCHEMA}})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert c.message.content == '{"cit'                  # one byte per token: cut inside a key


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_shape_whole_and_streamed(served, choice):
    _, _, client = served
    r = _chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    params = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, params)

    stream = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=80,
                                            tools=[WEATHER, TIME], tool_choice=choice, stream=True)
    name, pieces, finish, ids = None, [], None, set()
    for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content
            for tc in ch.delta.tool_calls or ():
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name = tc.function.name
                if tc.function and tc.function.arguments:
                    pieces.append(tc.function.arguments)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1 and name == call.function.name
    assert "".join(pieces) == call.function.arguments   # greedy: the same call, the same text
    assert json.loads("".join(pieces)) == args
    assert len(pieces) > 1                            # the arguments came in several deltas


@pytest.mark.parametrize("named", [True, False])
def test_a_whole_calls_arguments_are_the_outputs_own_text(named):
    """Not re-serialised: what the model wrote unescaped stays unescaped, as in the stream."""
    from gateway.structured import ToolCallStream, ToolPlan, call_prefix, tool_calls

    args = '{"city": "Zürich", "note": "\\u00e9 \\"q\\""}'
    plan = ToolPlan(("get_weather", "get_time"), "get_weather" if named else None, "")
    text = args if named else call_prefix("get_weather") + args + "}"
    (call,) = tool_calls(plan, text)
    assert call["function"] == {"name": "get_weather", "arguments": args}
    stream = ToolCallStream(plan)
    pieces = [d["function"]["arguments"] for i in range(0, len(text), 5) for d in stream.feed(text[i:i + 5])]
    pieces += [d["function"]["arguments"] for d in stream.finish()]
    assert "".join(pieces) == args


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex"),
    ({"tools": [WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_structured_inputs_are_400s_naming_the_field(served, extra, param):
    _, h, _ = served
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **extra}
    status, _, out = request(h.url + "/v1/chat/completions", "POST", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    assert f"{param}: " in out["error"]["message"], out


def test_a_grammar_over_the_parser_limits_is_refused_naming_its_field(tokenizer):
    """Compilation is bounded by llguidance's limits: a grammar over them is an InvalidParam
    (a 400 / INVALID_ARGUMENT) naming the field, never a long compile."""
    from dflash.core.grammar import LIMITS, GrammarCache, GrammarSpec, GrammarTokenizer
    from dflash.core.sampling import InvalidParam

    tight = GrammarCache(GrammarTokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]),
                         limits={**LIMITS, "max_grammar_size": 50})
    big = GrammarSpec("lark", "start: " + " | ".join(f'"w{i}"' for i in range(400)), field="structured_outputs.grammar")
    with pytest.raises(InvalidParam, match=r"^structured_outputs\.grammar: "):
        tight.compile(big)
    small = GrammarSpec("lark", 'start: "a" | "b"', field="structured_outputs.grammar")
    assert tight.compile(small) and len(tight) == 1


def test_grpc_structured_output(served):
    stack, _, _ = served
    so = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["red", "green"]))
    resps = list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt="Color:", max_tokens=10, structured_output=so), timeout=120))
    assert "".join(r.text for r in resps) in ("red", "green")
    assert resps[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_100_concurrent_distinct_schemas_stay_valid_and_bounded(served):
    stack, h, _ = served

    def one(i: int):
        schema = {"type": "object", "properties": {f"k{i}": {"enum": [f"v{i}", "w"]},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": i}},
                  "required": [f"k{i}", "n"], "additionalProperties": False}
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
        status, _, out = request(h.url + "/v1/chat/completions", "POST", body)
        assert status == 200, out
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
        return i

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        assert sorted(pool.map(one, range(100))) == list(range(100))
    cache = stack.engine.grammars
    assert len(cache) <= cache.max_entries and cache.chars <= cache.max_chars
    assert cache.compiles >= 100
    assert stack.engine.num_sessions == 0             # every one-shot session freed
    status, _, _ = request(h.url + "/health", "GET")
    assert status == 200
