"""Structured outputs on the HTTP API: an OpenAI body's ``response_format``, vLLM's
``structured_outputs`` or ``tools`` + ``tool_choice`` as the ``StructuredOutput`` the verifier
masks with (:func:`structured_output`), and the constrained text back as OpenAI ``tool_calls``,
whole (:func:`tool_calls`) or streamed (:class:`ToolCallStream`). docs/structured-outputs.md.

Tool calls: with ``tool_choice`` naming a function the output is that function's arguments
(its ``parameters`` schema); with ``"required"`` it is ``{"name": <one of the tools>,
"arguments": <its parameters>}`` (an ``anyOf`` of one object per tool, the name first), and the
gateway takes the call apart. The model is told of the tools in a system message (the chat
template's own tool support is not used). ``"auto"`` (the default when tools are given) is
refused: it needs a tool-call parser for the model's own format.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from dflash.core.sampling import InvalidParam
from dflash.v1 import common_pb2

__all__ = ["ToolPlan", "structured_output", "tool_system_message", "tool_calls", "ToolCallStream",
           "call_prefix"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
MAX_TOOLS = 128
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What the output of a tool-calling request is: ``named`` set, that function's arguments;
    else a ``{"name", "arguments"}`` object naming one of ``names``."""

    names: tuple[str, ...]
    named: str | None
    descriptions: str                      # the system message telling the model of the tools


def call_prefix(name: str) -> str:
    """How a ``"required"`` output starts for tool ``name`` (the grammar's compact JSON)."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _schema_text(field: str, schema: Any) -> str:
    if not isinstance(schema, (dict, bool)):
        raise InvalidParam(field, "must be a JSON schema (an object)")
    return json.dumps(schema)


def _from_structured_outputs(so: dict) -> common_pb2.StructuredOutput:
    keys = [k for k in STRUCTURED_KEYS if so.get(k) is not None]
    extra = set(so) - set(STRUCTURED_KEYS)
    if extra:
        raise InvalidParam(f"structured_outputs.{sorted(extra)[0]}", "is not supported "
                           f"(one of {', '.join(STRUCTURED_KEYS)})")
    if len(keys) != 1:
        raise InvalidParam("structured_outputs", f"needs exactly one of {', '.join(STRUCTURED_KEYS)}")
    k = keys[0]
    field = f"structured_outputs.{k}"
    v = so[k]
    m = common_pb2.StructuredOutput(field=field)
    if k == "json":
        m.json_schema = v if isinstance(v, str) else _schema_text(field, v)
    elif k == "choice":
        if not isinstance(v, list) or not v or any(not isinstance(c, str) or not c for c in v):
            raise InvalidParam(field, "must be a list of non-empty strings")
        m.choice.choices.extend(v)
    else:
        if not isinstance(v, str) or not v:
            raise InvalidParam(field, "must be a non-empty string")
        if k == "regex":
            m.regex = v
        else:
            m.grammar = v
    return m


def _tools(b) -> tuple[ToolPlan, common_pb2.StructuredOutput] | None:
    """The plan and grammar of ``tools`` + ``tool_choice`` (None: no tool calling asked)."""
    choice = b.tool_choice
    if not b.tools:
        if choice not in (None, "none"):
            raise InvalidParam("tool_choice", "needs tools")
        return None
    if choice == "none":
        return None
    if choice is None:
        raise InvalidParam("tools", 'need tool_choice "required" or a named function (the default '
                           '"auto" needs a tool-call parser this server does not have)')
    if choice == "auto":
        raise InvalidParam("tool_choice", '"auto" is not supported (the chat template\'s tool '
                           'calls are not parsed); use "required" or a named function')
    if len(b.tools) > MAX_TOOLS:
        raise InvalidParam("tools", f"{len(b.tools)} tools, more than {MAX_TOOLS}")
    params: dict[str, Any] = {}
    lines = []
    for i, t in enumerate(b.tools):
        f = t.function
        if not TOOL_NAME.fullmatch(f.name):
            raise InvalidParam(f"tools[{i}].function.name", "must be 1-64 letters, digits, _ or -")
        if f.name in params:
            raise InvalidParam(f"tools[{i}].function.name", f"{f.name!r} given twice")
        params[f.name] = f.parameters if f.parameters is not None else {"type": "object"}
        lines.append(json.dumps({"name": f.name, "description": f.description or "",
                                 "parameters": params[f.name]}))
    if choice == "required":
        named = None
        field = "tools"
        schema: Any = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": n}, "arguments": p}, "required": ["name", "arguments"],
            "additionalProperties": False} for n, p in params.items()]}
        ask = 'Call one of these functions; answer with {"name": ..., "arguments": ...} only.'
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        named = choice["function"]["name"]
        if named not in params:
            raise InvalidParam("tool_choice.function.name", f"{named[:64]!r} is not one of the tools")
        field = f"tools[{list(params).index(named)}].function.parameters"
        schema = params[named]
        ask = f"Call the function {named}; answer with its arguments as a JSON object only."
    else:
        raise InvalidParam("tool_choice", 'must be "none", "required" or {"type": "function", '
                           '"function": {"name": ...}}')
    m = common_pb2.StructuredOutput(field=field, json_schema=_schema_text(field, schema))
    desc = "You can call these functions:\n" + "\n".join(lines) + "\n" + ask
    return ToolPlan(tuple(params), named, desc), m


def structured_output(b, chat: bool) -> tuple[common_pb2.StructuredOutput | None, ToolPlan | None]:
    """The constraint an OpenAI body asks for, and its tool plan (chat with tools).

    Raises:
        InvalidParam: naming the parameter: an unknown ``response_format.type``, a
            ``json_schema`` without its schema, ``structured_outputs`` with not exactly one
            kind, tools without ``"required"`` or a named ``tool_choice``, or more than one of
            the three.
    """
    asked: list[tuple[str, common_pb2.StructuredOutput]] = []
    plan = None
    rf = b.response_format if chat else None
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", common_pb2.StructuredOutput(
                field="response_format", json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidParam("response_format.json_schema.schema", "required")
            field = "response_format.json_schema.schema"
            asked.append(("response_format", common_pb2.StructuredOutput(
                field=field, json_schema=_schema_text(field, rf.json_schema.schema_))))
        else:
            raise InvalidParam("response_format.type", f"{rf.type[:32]!r} is not one of text, "
                               "json_object, json_schema")
    if b.structured_outputs is not None:
        asked.append(("structured_outputs", _from_structured_outputs(b.structured_outputs)))
    if chat:
        tools = _tools(b)
        if tools is not None:
            plan = tools[0]
            asked.append(("tools", tools[1]))
    if len(asked) > 1:
        raise InvalidParam(asked[1][0], f"cannot be combined with {asked[0][0]}")
    return (asked[0][1] if asked else None), plan


def tool_system_message(plan: ToolPlan) -> str:
    return plan.descriptions


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(plan: ToolPlan, text: str) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of a finished constrained output (None: the text is not a
    whole call, e.g. cut by ``max_tokens``); the arguments are the output's own text, the same
    as :class:`ToolCallStream` streams."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if plan.named is not None:
        name, args = plan.named, text
    elif isinstance(obj, dict) and obj.get("name") in plan.names and "arguments" in obj:
        name = obj["name"]
        # the arguments' own text, as ToolCallStream sends it (a re-serialisation would
        # escape what the model wrote unescaped: the whole and streamed calls would differ)
        args = text[len(call_prefix(name)):-1] if text.startswith(call_prefix(name)) and text.endswith("}") \
            else json.dumps(obj["arguments"], ensure_ascii=False)
    else:
        return None
    return [{"id": _call_id(), "type": "function", "function": {"name": name, "arguments": args}}]


class ToolCallStream:
    """Turns a tool call's text deltas into OpenAI's streamed ``tool_calls`` deltas: the call's
    id and name first, then its arguments' text as it comes. A ``"required"`` output's
    ``{"name": ..., "arguments": `` prefix is held until whole, and its closing ``}`` is never
    sent."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.name: str | None = plan.named
        self.sent_header = False
        self.sent = 0                  # characters of the arguments sent
        self.id = _call_id()

    def _header(self) -> dict:
        self.sent_header = True
        return {"index": 0, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}

    def feed(self, text: str) -> list[dict]:
        """The ``tool_calls`` delta entries for ``text`` (possibly none)."""
        self.buf += text
        out = []
        if self.name is None:
            for n in self.plan.names:
                if self.buf.startswith(call_prefix(n)):
                    self.name = n
                    break
            if self.name is None:
                return []
        if not self.sent_header:
            out.append(self._header())
        args = self._args()
        # hold the last character of a "required" object back: it may be the call's closing }
        end = len(args) if self.plan.named is not None else len(args) - 1
        if end > self.sent:
            out.append({"index": 0, "function": {"arguments": args[self.sent:end]}})
            self.sent = end
        return out

    def _args(self) -> str:
        if self.plan.named is not None:
            return self.buf
        assert self.name is not None
        return self.buf[len(call_prefix(self.name)):]

    def finish(self) -> list[dict]:
        """What is left to send when the output ended (the arguments' last characters)."""
        if self.name is None:
            return []
        out = [] if self.sent_header else [self._header()]
        args = self._args()
        if self.plan.named is None and args.endswith("}"):
            args = args[:-1]
        if len(args) > self.sent:
            out.append({"index": 0, "function": {"arguments": args[self.sent:]}})
            self.sent = len(args)
        return out
