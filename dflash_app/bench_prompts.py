"""Prompt sets for ``dflash bench --prompts``: HumanEval, the held-out chat set (both
:mod:`dflash.train.eval_sets`, which training filters out), or a JSONL file.

A JSONL file holds one object per line with ``"prompt"`` (a user message) or ``"messages"``
(a chat list of ``{"role", "content"}``), and optionally ``"id"``.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.train.eval_sets import CHAT_EVAL, format_prompt, load_problems


def load_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """Chat message lists from a JSONL prompt file.

    Raises ``ValueError`` naming the file and line for a line that is not a JSON object with a
    non-empty string ``prompt`` or a ``messages`` list of role/content objects."""
    out = []
    for no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            out.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj.get("messages"), list) and obj["messages"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]):
            out.append([{"role": m["role"], "content": m["content"]} for m in obj["messages"]])
        else:
            raise ValueError(f"{where}: needs a non-empty string 'prompt' or a 'messages' list "
                             "of {role, content} objects")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def prompt_set(name: str, limit: int | None = None) -> list[tuple[str, list[dict[str, str]]]]:
    """``(id, chat messages)`` pairs for ``humaneval`` | ``chat`` | a JSONL file path, the first
    ``limit`` of them (all when None).

    Raises ``ValueError`` naming ``--prompts`` for an unknown name that is not a file."""
    if name == "humaneval":
        items = [(tid, format_prompt(p)) for tid, p in load_problems(limit)]
    elif name == "chat":
        items = [(f"chat/{i}", [{"role": "user", "content": p}]) for i, p in enumerate(CHAT_EVAL)]
    elif Path(name).is_file():
        items = [(f"{Path(name).stem}/{i}", m) for i, m in enumerate(load_jsonl(name))]
    else:
        raise ValueError(f"--prompts: expected humaneval, chat or a JSONL file, got {name!r}")
    return items[:limit] if limit else items
