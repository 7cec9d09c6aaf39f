"""The structured-output benchmark (scripts/bench_structured.py, dflash_app/bench_structured*.py):
its sets' shape (every line parses, every schema passes JSON Schema's meta-schema with 4-10
fields all required and no others, every answer valid and written in its passage, the
tool_choice forms), the checks that judge outputs and tool calls, its figures from made-up rows,
its flags, and one smoke run on tiny models through the real stack and the ``openai`` client.
No timing is asserted (the figures are for docs/bench)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from dflash_app import bench_structured as bs, bench_structured_report as report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_structured.py"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "member": {"type": "boolean"}},
          "required": ["name", "age", "city", "member"], "additionalProperties": False}
ITEM = {"id": "x", "passage": "Ada Byron, 36, lives in London and is a member.", "schema": SCHEMA,
        "answer": {"name": "Ada Byron", "age": 36, "city": "London", "member": True}, "instruction": "Extract."}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
TOOL_ITEM = {"id": "t", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [TOOL],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "expected_tool": "get_weather"}


def _kinds(schema: dict, out: set[str]) -> set[str]:
    for p in schema.get("properties", {}).values():
        out.add("enum" if "enum" in p else p["type"])
        if p.get("type") == "object":
            _kinds(p, out)
        if p.get("type") == "array":
            out.add("array of " + ("enum" if "enum" in p["items"] else p["items"]["type"]))
    return out


def test_the_extraction_set_parses_and_every_schema_is_a_valid_4_to_10_field_schema():
    items = bs.read_jsonl(bs.EXTRACTION)
    assert len(items) >= 24 and len({i["id"] for i in items}) == len(items)
    kinds: set[str] = set()
    for item in items:
        schema = item["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert 4 <= len(schema["properties"]) <= 10, item["id"]
        assert sorted(schema["required"]) == sorted(schema["properties"]), item["id"]
        assert schema["additionalProperties"] is False, item["id"]
        jsonschema.validate(item["answer"], schema)
        assert bs.check_extraction(item) == [], item["id"]      # and every value is in the passage
        assert bs.extraction_messages(item)[0]["content"].endswith(item["passage"])
        kinds = _kinds(schema, kinds)
    assert {"string", "integer", "number", "boolean", "enum", "object", "array of string"} <= kinds


def test_the_tools_set_parses_with_both_tool_choice_forms():
    items = bs.read_jsonl(bs.TOOLS)
    assert len(items) >= 12
    named = 0
    for item in items:
        assert bs.check_tools(item) == [], item["id"]
        assert 1 <= len(item["tools"]) <= 3
        for t in item["tools"]:
            jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])
        name = bs.named_tool(item["tool_choice"])
        named += name is not None
        assert name is None or name == item["expected_tool"]
    assert 0 < named < len(items)                     # both "required" and named functions
    assert bs.load_sets()[0] and bs.load_sets()[1]


def test_the_line_checks_catch_what_is_wrong():
    assert bs.check_extraction(ITEM) == []
    assert "not a valid JSON Schema" in bs.check_schema({"type": 5})[0]
    three = {**SCHEMA, "properties": dict(list(SCHEMA["properties"].items())[:3]), "required": ["name", "age", "city"]}
    assert bs.check_schema(three) == ["schema.properties: 3 fields, expected 4-10"]
    assert bs.check_schema({**SCHEMA, "required": ["name"]}) == ["schema.required: must name every property"]
    assert bs.check_schema({k: v for k, v in SCHEMA.items() if k != "additionalProperties"}) == \
        ["schema.additionalProperties: must be false"]
    assert bs.check_extraction({**ITEM, "answer": {**ITEM["answer"], "city": "Paris"}}) == \
        ["answer.city: 'Paris' is not in the passage"]
    assert bs.check_extraction({**ITEM, "answer": {**ITEM["answer"], "age": "36"}})[0].startswith("answer: not valid")
    assert bs.check_tools(TOOL_ITEM) == []
    assert "tool_choice" in bs.check_tools({**TOOL_ITEM, "tool_choice": "auto"})[0]
    other = {"type": "function", "function": {"name": "get_time"}}
    assert bs.check_tools({**TOOL_ITEM, "tool_choice": other})[0] == "tool_choice: names 'get_time', not one of the tools"


def test_load_sets_names_the_bad_line(tmp_path):
    ex, tl = tmp_path / "e.jsonl", tmp_path / "t.jsonl"
    ex.write_text(json.dumps(ITEM) + "\n" + json.dumps({**ITEM, "id": "bad", "answer": {**ITEM["answer"], "city": "Rome"}}) + "\n")
    tl.write_text(json.dumps(TOOL_ITEM) + "\n")
    with pytest.raises(ValueError, match="bad: answer.city: 'Rome' is not in the passage"):
        bs.load_sets(ex, tl)
    ex.write_text("{not json\n")
    with pytest.raises(ValueError, match="e.jsonl:1: not JSON"):
        bs.load_sets(ex, tl)


def test_validity_and_fields_are_judged_by_jsonschema_and_the_answer():
    good = json.dumps(ITEM["answer"])
    assert bs.valid(good, SCHEMA) and bs.correct_fields(good, ITEM["answer"]) == 4
    assert not bs.valid(good[:-1], SCHEMA)                                          # cut short
    assert not bs.valid(json.dumps({**ITEM["answer"], "age": 36.5}), SCHEMA)         # wrong type
    assert not bs.valid(json.dumps({**ITEM["answer"], "extra": 1}), SCHEMA)          # not allowed
    assert bs.correct_fields(json.dumps({**ITEM["answer"], "name": " ada byron", "age": 35}), ITEM["answer"]) == 3
    assert bs.correct_fields("[1]", ITEM["answer"]) == 0


def test_bounded_schemas_shorten_strings_and_bound_numbers():
    s = bs.bounded({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 40}, "n": {"type": "number"}, "y": {"type": "integer", "minimum": 1900},
        "z": {"type": "integer", "minimum": -60, "maximum": 60},
        "l": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 8}}})
    p = s["properties"]
    assert p["a"]["maxLength"] == 4 and p["n"] == {"type": "integer", "minimum": 0, "maximum": 99}
    assert p["y"] == {"type": "integer", "minimum": 1900, "maximum": 1999}     # from its one bound
    assert p["z"] == {"type": "integer", "minimum": -60, "maximum": 60}      # bounded already: kept
    assert (p["l"]["minItems"], p["l"]["maxItems"], p["l"]["items"]["maxLength"]) == (2, 2, 4)
    for item in bs.read_jsonl(bs.EXTRACTION):
        jsonschema.Draft202012Validator.check_schema(bs.bounded(item["schema"]))


def test_tool_calls_are_judged_by_shape_name_and_parameters():
    ok = {"id": "call_1", "type": "function", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert bs.tool_problems(TOOL_ITEM, [ok], "tool_calls") == []
    assert bs.tool_problems(TOOL_ITEM, [ok], "stop") == ["finish_reason 'stop', not 'tool_calls'"]
    assert bs.tool_problems(TOOL_ITEM, [ok], "tool_calls", "hi") == ["content 'hi' beside the call"]
    assert bs.tool_problems(TOOL_ITEM, [ok, ok], "tool_calls") == ["2 tool calls, expected 1"]
    assert bs.tool_problems(TOOL_ITEM, [{**ok, "id": "x"}], "tool_calls") == ["id 'x' is not a call id"]
    assert bs.tool_problems(TOOL_ITEM, [{**ok, "arguments": '{"city": "Oslo"'}], "tool_calls") == ["arguments: not JSON"]
    assert bs.tool_problems(TOOL_ITEM, [{**ok, "arguments": '{"city": 3}'}], "tool_calls")[0].startswith(
        "arguments: not valid")
    two = {**TOOL_ITEM, "tools": [TOOL, {"type": "function", "function": {"name": "get_time"}}]}
    assert bs.tool_problems(two, [{**ok, "name": "get_time", "arguments": "{}"}], "tool_calls") == \
        ["function 'get_time' is not the named one"]
    assert bs.tool_problems({**two, "tool_choice": "required"}, [{**ok, "name": "get_time", "arguments": "{}"}],
                            "tool_calls") == []


def _row(arm, id_, *, valid=True, tokens=11, decode_s=1.0, toks=("aa",), sd=None, gs=0.0, gr=0, fields=(4, 4)):
    return {"id": id_, "arm": arm, "tokens": tokens, "token_bytes": list(toks), "finish": "stop" if valid else "length",
            "ttft_s": 0.1, "decode_s": decode_s, "valid": valid, "correct_fields": fields[0], "fields": fields[1],
            "sd": sd, "grammar_s": gs, "grammar_rows": gr}


def test_the_figures_from_made_up_rows():
    sd = {"num_spec_steps": 4, "num_accepted_draft_tokens": 6,
          "num_accepted_tokens_by_source": {"drafter": 2, "suffix": 1, "grammar": 3}}
    rows = {bs.OFF: [_row(bs.OFF, "a", gs=0.02, gr=10), _row(bs.OFF, "b", toks=("bb",), gs=0.02, gr=10)],
            "adaptive": [_row("adaptive", "a", decode_s=0.25, sd=sd, gs=0.01, gr=4),
                         _row("adaptive", "b", toks=("cc",), valid=False, decode_s=0.25, sd=sd, gs=0.01, gr=4)],
            bs.PLAIN: [_row(bs.PLAIN, "a", decode_s=0.5, fields=(0, 0)), _row(bs.PLAIN, "b", decode_s=0.5, fields=(0, 0))]}
    ex = report.extraction_summary(rows)
    off, ad = ex["arms"][bs.OFF], ex["arms"]["adaptive"]
    assert off["decode_tok_s"] == pytest.approx(10.0) and ad["speedup_vs_off"] == pytest.approx(4.0)
    assert (ad["valid"], ad["finished"], ad["identical_to_off"]) == (1, 1, 1)
    assert ad["tau"] == pytest.approx(1 + 12 / 8)
    assert ad["accepted_by_source"] == {"drafter": 4, "suffix": 2, "grammar": 6}
    assert "identical_to_off" not in ex["arms"][bs.PLAIN]
    assert ex["plain_step_ms"] == pytest.approx(50.0)                  # 20 tokens in 1 s
    assert off["grammar_ms_per_step"] == pytest.approx(2.0)
    assert ex["mask_cost_vs_plain_step"][bs.OFF] == pytest.approx(0.04)
    tools = report.tool_summary([
        {"id": "t", "variant": "whole", "problems": [], "name": "f", "arguments": "{}", "expected_tool": "f"},
        {"id": "t", "variant": "stream", "problems": ["x"], "name": "f", "arguments": "{ }", "expected_tool": "g"}])
    assert tools["whole"]["ok"] == 1 and tools["stream"]["problems"] == {"t": ["x"]}
    assert tools["stream_equals_whole"] == 0 and tools["stream"]["expected_tool"] == 0
    res = {"extraction": ex, "tools": tools, "hook": {"ns_per_row": 150.0, "plain_step_ms": 50.0,
                                                      "throughput_ratio": 0.999997, "plain_grammar_rows": 0},
           "config": {"extraction_prompts": 2, "tool_prompts": 1, "commit": "abc", "target": "t", "drafter": "d",
                      "host": {"cpus": 2, "machine": "x86_64"}, "max_tokens": 8, "tiny": True, "tool_mode": "adaptive"}}
    md = report.markdown(res)
    assert "| outputs valid against the schema (jsonschema): 100% | off 2/2, adaptive 1/2 | **not met** |" in md
    assert "| adaptive >= 2.5x constrained off | 4.00x | met |" in md
    assert "| grammar time per step <= 10% of a plain decode step (batch 1) | 4.0% (2.00 ms of 50.0 ms) | met |" in md
    assert "| tool calls (stream): valid arguments and OpenAI shape, 100% | 0/1 | **not met** |" in md
    assert "| requests without a grammar: >= 0.99x | 0.999997x (the hook: 150 ns per row; grammar rows during plain requests: 0) | met |" in md


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_structured_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_flags(script, capsys):
    a = script.parse_args(["--out", "x", "--tiny"])
    assert (a.max_tokens, a.modes, a.tool_mode) == (400, ["adaptive", "hybrid", "fixed"], "adaptive")
    assert script.parse_args(["--out", "x", "--modes", "tree,adaptive"]).max_tokens == 192
    for bad in ("off", "adaptive,adaptive", "warp"):
        with pytest.raises(SystemExit):
            script.parse_args(["--out", "x", "--modes", bad])
        assert "--modes" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_on_tiny_models(tmp_path, tiny_target, make_drafter):
    """--tiny end to end: every constrained output valid (jsonschema, recomputed here), equal to
    constrained off, forced tokens counted as the grammar's; every tool call valid, whole and
    streamed; the plain requests never entered the grammar code."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--target", str(tiny_target), "--drafter",
         str(make_drafter(block_size=8)), "--limit", "3", "--tool-limit", "3", "--modes", "adaptive",
         "--hook-calls", "1000", "--out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "DFLASH_PANEL_LINEAR": "off"})    # no kernel compiled and timed at start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "structured.json").read_text())
    assert "| target | measured | verdict |" in (out / "structured.md").read_text()
    schemas = {i["id"]: i["schema"] for i in bs.read_jsonl(bs.EXTRACTION)}
    arms = res["extraction"]["arms"]
    assert set(arms) == {bs.OFF, "adaptive", bs.PLAIN}
    for arm in (bs.OFF, "adaptive"):
        rows = res["rows"]["extraction"][arm]
        assert len(rows) == 3
        for r in rows:
            jsonschema.validate(json.loads(r["text"]), schemas[r["id"]])
        assert arms[arm]["valid"] == arms[arm]["identical_to_off"] == 3
        assert arms[arm]["grammar_rows"] > 0 and arms[arm]["grammar_s"] > 0
    assert arms["adaptive"]["accepted_by_source"]["grammar"] > 0 and arms["adaptive"]["tau"] > 1
    assert arms[bs.OFF]["spec_steps"] == 0
    assert arms[bs.PLAIN]["grammar_rows"] == 0 and res["hook"]["plain_grammar_rows"] == 0
    assert res["hook"]["ns_per_row"] > 0 and res["extraction"]["mask_cost_vs_plain_step"][bs.OFF] is not None
    t = res["tools"]
    assert t["whole"]["ok"] == t["stream"]["ok"] == 3 and t["stream_equals_whole"] == 3
