"""Prompt sets for ``dflash bench --prompts``: HumanEval, a held-out chat set, or a JSONL file.

``CHAT_EVAL`` was written for this project as an evaluation set only: general requests of the
kinds users send a chat model (explain, summarise, write a letter, advise, compare, plan). No
training source draws from it, and the training prompt builders filter it out
(:func:`dflash.train.chat_prompts.is_eval_prompt`), so it measures acceptance on chat the drafter
has never seen.

A JSONL file holds one object per line with ``"prompt"`` (a user message) or ``"messages"``
(a chat list of ``{"role", "content"}``), and optionally ``"id"``.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_EVAL: tuple[str, ...] = (
    "Explain why the sky looks blue during the day and red at sunset.",
    "Write a short letter to my landlord asking to fix the heating in my flat.",
    "What are some good habits for getting better sleep?",
    "Summarise this in two sentences: The town council met on Tuesday to discuss the new bicycle "
    "lanes. Some shop owners worried that fewer parking spaces would hurt their business, while "
    "cyclists said the lanes would make the streets safer. The council agreed to test the lanes "
    "for six months before deciding.",
    "Give me three ideas for a birthday party for a seven-year-old.",
    "How do I make a simple tomato soup?",
    "Explain the difference between weather and climate.",
    "Write a thank-you note to a teacher who helped me prepare for an exam.",
    "What should I pack for a weekend hiking trip?",
    "Describe how a bill becomes a law, in simple terms.",
    "I feel nervous before giving presentations. Any advice?",
    "Compare trains and planes for travelling between two cities 500 km apart.",
    "Write a short poem about autumn leaves.",
    "What is photosynthesis and why is it important?",
    "Plan a three-day visit to a city for someone who loves museums.",
    "Explain what inflation is to a high school student.",
    "Write an email to my team saying that Friday's meeting is moved to Monday at 10 am.",
    "What are the pros and cons of working from home?",
    "How can I start learning to play the guitar as an adult?",
    "Tell me a short story about a lost dog that finds its way home.",
    "Why do we have seasons on Earth?",
    "Give me some tips for saving money on groceries.",
    "Explain how vaccines help the body fight disease.",
    "Write a product description for a reusable water bottle.",
    "What is the best way to prepare for a job interview?",
    "Summarise the main causes of the First World War.",
    "How does recycling help the environment?",
    "Write a polite message declining an invitation to a wedding.",
    "What are black holes? Explain it simply.",
    "Suggest a weekly exercise routine for a beginner.",
    "Explain the rules of chess in a few paragraphs.",
    "Write a short speech to welcome new students to a school.",
)


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
        from dflash_app.humaneval import format_prompt, load_problems

        items = [(tid, format_prompt(p)) for tid, p in load_problems(limit)]
    elif name == "chat":
        items = [(f"chat/{i}", [{"role": "user", "content": p}]) for i, p in enumerate(CHAT_EVAL)]
    elif Path(name).is_file():
        items = [(f"{Path(name).stem}/{i}", m) for i, m in enumerate(load_jsonl(name))]
    else:
        raise ValueError(f"--prompts: expected humaneval, chat or a JSONL file, got {name!r}")
    return items[:limit] if limit else items
