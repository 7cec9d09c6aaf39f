"""An HTTP request body parsed as JSON within limits, before any model sees it.

:func:`parse_body` refuses, each with :class:`BodyError` naming the parameter at fault (an HTTP
400 in OpenAI's error shape): text that is not JSON; bytes that are not UTF-8 and strings or
keys holding a lone UTF-16 surrogate (``"\\ud800"``: a valid JSON escape with no UTF-8
encoding, which the tokenizer and every encoder after it would fail on); JSON's non-standard
constants (``NaN``, ``Infinity``: Python's parser accepts them); integers of more digits than
Python converts; values nested deeper than :data:`MAX_JSON_DEPTH` (Python's parser recurses:
100,000 levels would be a RecursionError). The body's size is bounded before, by bytes
(``OpenAIFront.max_request_bytes``, 413).
"""

from __future__ import annotations

import json
import re

# Nesting of the deepest body OpenAI's parameters need (a message's content part's
# image_url object: body > messages > [i] > content > [j] > part > image_url) is 7; tools'
# JSON schemas (accepted only empty here) rarely pass 10.
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 4300          # Python's int conversion limit (sys.get_int_max_str_digits)
_SURROGATE = re.compile("[\ud800-\udfff]")
# JSON strings (with a following ':' when a key) and brackets: what the depth scan reads.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"\s*:?|[\[\]{}]')


class BodyError(ValueError):
    """A body refused before validation: ``param`` (None = the body as a whole) and the
    message, which starts with it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


class _Refused:
    """A parsed value that is refused where :func:`check_value` finds it (so the message can
    name its parameter): a non-standard constant or an over-long integer."""

    def __init__(self, message: str):
        self.message = message


def _constant(name: str) -> _Refused:
    return _Refused(f"{name} is not JSON: numbers must be finite")


def _integer(digits: str) -> int | _Refused:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        return _Refused(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(digits)


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + p
    return out


def check_value(obj, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed JSON value without recursion. Raises BodyError naming the top-level
    parameter of a value nested deeper than ``max_depth``, or the full path (cut to 128
    characters; a surrogate in a key shown as ``?``) of a string or key with a lone surrogate
    or of a refused number.

    Paths are built per container, scalars are checked in their container's loop: a list of a
    million numbers costs one pass over it, not a million paths."""
    if not isinstance(obj, (dict, list)):
        _check_scalar(obj, ())
        return
    stack: list[tuple[dict | list, tuple]] = [(obj, ())]
    while stack:
        value, parts = stack.pop()
        deep = len(parts) >= max_depth       # its members would be nested too deep
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                raise BodyError(_path(parts + (_SURROGATE.sub("?", k),))[:128],
                                "is a key that is not valid UTF-8 (invalid bytes or a lone "
                                "UTF-16 surrogate escape)")
            if deep:
                raise BodyError(_path(parts[:1] or (k,)), f"nested deeper than {max_depth} levels")
            t = type(v)
            if t is dict or t is list:
                stack.append((v, parts + (k,)))
            elif t is str or t is _Refused:
                _check_scalar(v, parts + (k,))


def _check_scalar(v, parts: tuple) -> None:
    if isinstance(v, _Refused):
        raise BodyError(_path(parts)[:128] or None, v.message)
    if isinstance(v, str) and not v.isascii() and _SURROGATE.search(v):
        raise BodyError(_path(parts)[:128] or None, "is not valid UTF-8 (invalid bytes or a "
                        "lone UTF-16 surrogate escape)")


def _deep_key(text: str, max_depth: int) -> str | None:
    """The top-level key under which ``text`` nests deeper than ``max_depth`` (None: not
    found). Read only after the parser gave up, so its cost is paid by such bodies alone."""
    depth, key = 0, None
    for m in _TOKENS.finditer(text):
        t = m.group()
        if t[0] == '"':
            if depth == 1 and t.endswith(":"):
                key = t.rstrip(": \t\r\n")[1:-1]
        elif t in "[{":
            depth += 1
            if depth > max_depth + 1:
                return _SURROGATE.sub("?", key) if key is not None else None
        else:
            depth -= 1
    return None


def parse_body(raw: bytes) -> dict:
    """``raw`` (UTF-8) as a JSON object, checked by :func:`check_value`. Raises BodyError."""
    # Invalid bytes become lone surrogates, which check_value then finds with their parameter.
    text = raw.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    try:
        try:
            obj = json.loads(text, parse_constant=_constant)
        except ValueError as e:
            if "integer string conversion" not in str(e):
                raise
            # Python's digit limit: parse again, the hook marking where (a call per integer,
            # so only for such bodies)
            obj = json.loads(text, parse_constant=_constant, parse_int=_integer)
    except RecursionError:
        raise BodyError(_deep_key(text, MAX_JSON_DEPTH),
                        f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:        # JSONDecodeError
        raise BodyError(None, f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BodyError(None, "the body must be a JSON object")
    check_value(obj)
    return obj
