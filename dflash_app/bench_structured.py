"""The structured-output benchmark's sets, checks and figures (``scripts/bench_structured.py``
runs them on a stack; docs/structured-outputs.md, "Benchmark").

Sets (``data/bench``): ``extraction.jsonl``, one passage per line with a JSON schema of 4-10
fields whose values are in the passage (``{"id", "passage", "schema", "answer",
"instruction"}``: every field required, no others); ``tools.jsonl``, one request per line with
1-3 OpenAI tools and a ``tool_choice`` of ``"required"`` or a named function (``{"id",
"messages", "tools", "tool_choice", "expected_tool"}``). :func:`check_extraction` and
:func:`check_tools` say what is wrong with a line; outputs are judged with ``jsonschema`` only
(the ``bench`` extra's, imported where it is used).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

MIN_FIELDS, MAX_FIELDS = 4, 10
MAX_TOOLS = 3
OFF = "off"                 # the baseline arm: the grammar, speculation off
PLAIN = "plain-off"         # no grammar, speculation off: the plain decode step
ROOT = Path(__file__).resolve().parents[1]
EXTRACTION = ROOT / "data" / "bench" / "extraction.jsonl"
TOOLS = ROOT / "data" / "bench" / "tools.jsonl"


# ---- the sets -------------------------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[dict]:
    """Every line of ``path`` as a JSON object. Raises ValueError naming the file and line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object")
        out.append(obj)
    return out


def check_schema(schema: Any) -> list[str]:
    """What makes ``schema`` unusable as an extraction schema: not a valid JSON Schema (the
    meta-schema's check), not an object of 4-10 properties all required, or extra properties
    allowed."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return [f"schema: not a valid JSON Schema: {e.message}"]
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return ["schema: must be an object schema"]
    props = schema.get("properties", {})
    problems = []
    if not MIN_FIELDS <= len(props) <= MAX_FIELDS:
        problems.append(f"schema.properties: {len(props)} fields, expected {MIN_FIELDS}-{MAX_FIELDS}")
    if sorted(schema.get("required", [])) != sorted(props):
        problems.append("schema.required: must name every property")
    if schema.get("additionalProperties") is not False:
        problems.append("schema.additionalProperties: must be false")
    return problems


def _in_passage(value: Any, passage: str) -> bool:
    """Whether a string or number ``value`` is written in ``passage`` (booleans are implied by
    the text, not written; containers: every member)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, dict):
        return all(_in_passage(v, passage) for v in value.values())
    if isinstance(value, list):
        return all(_in_passage(v, passage) for v in value)
    if isinstance(value, (int, float)):       # a whole number in the text (318.4 as "318.40" too)
        whole = float(value).is_integer()
        digits = str(int(value)) + r"(\.0+)?" if whole else re.escape(repr(float(value))) + "0*"
        return re.search(rf"(?<![\d.]){digits}(?![\d]|\.\d)", passage) is not None
    return str(value).lower() in passage.lower()


def check_extraction(item: dict) -> list[str]:
    """What is wrong with one ``extraction.jsonl`` line (empty: nothing): its keys, its schema
    (:func:`check_schema`), and its answer (valid against the schema, each value in the passage)."""
    import jsonschema

    missing = [k for k in ("id", "passage", "schema", "answer", "instruction") if k not in item]
    if missing:
        return [f"missing {', '.join(missing)}"]
    problems = check_schema(item["schema"])
    if problems:
        return problems
    try:
        jsonschema.validate(item["answer"], item["schema"])
    except jsonschema.ValidationError as e:
        return [f"answer: not valid against the schema: {e.message}"]
    return [f"answer.{k}: {v!r} is not in the passage" for k, v in item["answer"].items()
            if not _in_passage(v, item["passage"])]


def named_tool(choice: Any) -> str | None:
    """The function a ``tool_choice`` names (None for ``"required"``). Raises ValueError for
    any other form."""
    if choice == "required":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise ValueError(f"tool_choice: expected \"required\" or a named function, got {choice!r}")


def check_tools(item: dict) -> list[str]:
    """What is wrong with one ``tools.jsonl`` line (empty: nothing)."""
    import jsonschema

    missing = [k for k in ("id", "messages", "tools", "tool_choice", "expected_tool") if k not in item]
    if missing:
        return [f"missing {', '.join(missing)}"]
    tools = item["tools"]
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        return [f"tools: expected 1-{MAX_TOOLS} tools"]
    problems, names = [], []
    for i, t in enumerate(tools):
        f = t.get("function", {}) if isinstance(t, dict) else {}
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f.get("name"), str):
            problems.append(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
            continue
        names.append(f["name"])
        try:
            jsonschema.Draft202012Validator.check_schema(f.get("parameters", {}))
        except jsonschema.SchemaError as e:
            problems.append(f"tools[{i}].function.parameters: {e.message}")
    try:
        named = named_tool(item["tool_choice"])
    except ValueError as e:
        return problems + [str(e)]
    if named is not None and named not in names:
        problems.append(f"tool_choice: names {named!r}, not one of the tools")
    if item["expected_tool"] not in names or (named is not None and item["expected_tool"] != named):
        problems.append(f"expected_tool: {item['expected_tool']!r} is not the tool to call")
    return problems


def load_sets(extraction: str | Path = EXTRACTION, tools: str | Path = TOOLS) -> tuple[list[dict], list[dict]]:
    """Both sets, checked. Raises ValueError naming the first bad line's id and problem."""
    ex, tl = read_jsonl(extraction), read_jsonl(tools)
    for items, check in ((ex, check_extraction), (tl, check_tools)):
        for item in items:
            problems = check(item)
            if problems:
                raise ValueError(f"{item.get('id', '?')}: {problems[0]}")
    return ex, tl


def extraction_messages(item: dict) -> list[dict[str, str]]:
    """The chat request of one extraction line: its instruction, then the passage."""
    return [{"role": "user", "content": f"{item['instruction']}\n\n{item['passage']}"}]


def bounded(schema: Any, chars: int = 4, items: int = 2) -> Any:
    """``schema`` with every string at most ``chars`` long, every number an integer of its
    bounds ([0, 99] without any, 100 values from the one given), every array at most ``items``
    long: the smoke run's schemas (tiny random models end neither a free string nor a number's
    digits). Its outputs are valid against ``schema``."""
    if isinstance(schema, list):
        return [bounded(s, chars, items) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, chars, items) for k, v in schema.items()}
    if out.get("type") == "string":
        out["maxLength"] = min(out.get("maxLength", chars), chars)
    elif out.get("type") in ("integer", "number"):
        lo = out.get("minimum", 0 if "maximum" not in out else out["maximum"] - 99)
        out.update(type="integer", minimum=lo, maximum=out.get("maximum", lo + 99))
    elif out.get("type") == "array":
        out["maxItems"] = min(out.get("maxItems", items), items)
        out["minItems"] = min(out.get("minItems", 0), out["maxItems"])
    return out


# ---- judging outputs ------------------------------------------------------------------------


def valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON valid against ``schema`` (``jsonschema``)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, str) and isinstance(got, str):
        return got.strip().lower() == want.strip().lower()
    if isinstance(want, (int, float)) and not isinstance(want, bool) and \
            isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-9)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    return got == want


def correct_fields(text: str, answer: dict) -> int:
    """Top-level fields of the output ``text`` equal to the passage's ``answer`` (strings
    compared without case and surrounding space); 0 when the text is not a JSON object."""
    try:
        got = json.loads(text)
    except ValueError:
        return 0
    if not isinstance(got, dict):
        return 0
    return sum(1 for k, v in answer.items() if k in got and _same(got[k], v))


def tool_problems(item: dict, calls: list[dict], finish: str | None, content: str | None = None) -> list[str]:
    """What is wrong with one response to a tools line: ``calls`` as ``[{"id", "type",
    "name", "arguments"}]`` (the OpenAI ``tool_calls``, whole or reassembled from a stream),
    ``finish`` its finish reason, ``content`` the message's text. Empty: OpenAI's shape (no
    text), one call, the named function when one is named, and arguments that parse as JSON
    valid against the tool's parameters."""
    import jsonschema

    problems = [] if finish == "tool_calls" else [f"finish_reason {finish!r}, not 'tool_calls'"]
    if content:
        problems.append(f"content {content[:40]!r} beside the call")
    if len(calls) != 1:
        return problems + [f"{len(calls)} tool calls, expected 1"]
    c = calls[0]
    if not isinstance(c.get("id"), str) or not c["id"].startswith("call_"):
        problems.append(f"id {c.get('id')!r} is not a call id")
    if c.get("type") != "function":
        problems.append(f"type {c.get('type')!r}, not 'function'")
    params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in item["tools"]}
    named = named_tool(item["tool_choice"])
    if c.get("name") not in params or (named is not None and c.get("name") != named):
        return problems + [f"function {c.get('name')!r} is not {'the named' if named else 'a given'} one"]
    try:
        jsonschema.validate(json.loads(c.get("arguments") or ""), params[c["name"]])
    except ValueError:
        problems.append("arguments: not JSON")
    except jsonschema.ValidationError as e:
        problems.append(f"arguments: not valid against the parameters: {e.message}")
    return problems
