"""General chat training prompts from text this machine already has (no data set hub).

Two sources, both deterministic per seed on the same environment:

* ``passage``: a prose paragraph from the long descriptions (``*.dist-info/METADATA``) of the
  installed packages and from the standard library's module docstrings, put to the target with
  an everyday instruction (summarise, explain simply, list key points, rewrite, write an email
  about it, answer a question about it ...). Answers restate and copy from the passage, which is
  what a drafter must learn to do with its context.
* ``magpie``: user turns the target writes itself (Magpie, arXiv 2406.08464): the chat template
  up to the user header, then sampled text up to the end of the turn; see
  :func:`dflash.train.datagen.magpie_instructions`. This module only filters and deduplicates them.

Nothing here is, or contains, a prompt of the evaluation chat set
(:data:`dflash.train.eval_sets.CHAT_EVAL`) or HumanEval: :func:`is_eval_prompt` filters both.
"""

from __future__ import annotations

import ast
import email.parser
import functools
import random
import re
import sysconfig
from pathlib import Path

_TASKS = (
    "Summarize the following text in two or three sentences.\n\n{p}",
    "Explain what this text says to someone who has never heard of it.\n\n{p}",
    "List the three most important points of this passage as bullet points.\n\n{p}",
    "Rewrite the following paragraph in simpler words.\n\n{p}",
    "Write a short, friendly email to a colleague that tells them about this:\n\n{p}",
    "What is the main idea of this passage? Answer in one paragraph.\n\n{p}",
    "Read the text below and write three questions a student could ask about it, with answers.\n\n{p}",
    "Give this paragraph a short title, then explain why you chose it.\n\n{p}",
    "Turn this description into a short announcement for a newsletter.\n\n{p}",
    "{p}\n\nCan you explain this in plain English?",
    "{p}\n\nWhat are the advantages described here?",
    "Here is a paragraph:\n\n{p}\n\nRewrite it as a short story for a child.",
)
_MIN_CHARS, _MAX_CHARS = 200, 900


def _prose(par: str) -> bool:
    """A paragraph of sentences, not code, a table, a list of links or a licence."""
    letters = sum(c.isalpha() or c.isspace() for c in par)
    return (_MIN_CHARS <= len(par) <= _MAX_CHARS and letters / len(par) > 0.9 and par.count(".") >= 2
            and not re.search(r"https?://|```|>>>|\|\s*-|\.\.\s+\w+::|copyright|licen[cs]e", par, re.I))


def _paragraphs(text: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", text):
        par = " ".join(line.strip() for line in block.splitlines())
        par = re.sub(r"\s+", " ", par).strip()
        if _prose(par):
            out.append(par)
    return out


@functools.lru_cache(maxsize=4)
def passages(roots: tuple[Path, ...] | None = None) -> tuple[str, ...]:
    """Distinct prose paragraphs, in a stable order: package long descriptions under the
    site-packages roots, then stdlib module docstrings (files parsed with :mod:`ast`, never
    imported)."""
    paths = sysconfig.get_paths()
    if roots is None:
        roots = tuple(dict.fromkeys(Path(paths[k]) for k in ("purelib", "platlib", "stdlib")))
    out: list[str] = []
    for root in roots:
        if not root.is_dir():
            continue
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            out += _paragraphs(str(msg.get_payload() or ""))
        for py in sorted(root.glob("*.py")):           # top-level stdlib modules only
            try:
                doc = ast.get_docstring(ast.parse(py.read_text(encoding="utf-8")))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            out += _paragraphs(doc or "")
    return tuple(dict.fromkeys(out))


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text).strip().lower()


@functools.lru_cache(maxsize=1)
def _eval_texts() -> frozenset[str]:
    from dflash.train.eval_sets import CHAT_EVAL, load_problems

    return frozenset(_norm(t) for t in list(CHAT_EVAL) + [p for _, p in load_problems()])


def is_eval_prompt(text: str) -> bool:
    """True when ``text`` (up to case and punctuation) is, contains, or is a 40+ character part
    of an evaluation prompt: the chat evaluation set or a HumanEval problem."""
    n = _norm(text)
    return any(e and (e == n or e in n or (len(n) >= 40 and n in e)) for e in _eval_texts())


def passage_prompts(n: int, seed: int = 0, roots: tuple[Path, ...] | None = None) -> list[str]:
    """The first ``n`` user messages of a seeded order of all passages, each with an instruction
    (prefix-stable: ``passage_prompts(m)`` is the first m of ``passage_prompts(n)`` for m <= n).

    Raises ``ValueError`` naming ``num_prompts`` when fewer passages exist than asked for."""
    pool = [p for p in passages(roots) if not is_eval_prompt(p)]
    if len(pool) < n:
        raise ValueError(f"num_prompts: only {len(pool)} passages available, asked for {n}")
    order = random.Random(seed).sample(pool, len(pool))
    tasks = random.Random(seed + 1)
    return [tasks.choice(_TASKS).format(p=p) for p in order[:n]]


def clean_instruction(text: str) -> str | None:
    """A sampled Magpie user turn, stripped, or None when it is unusable: too short or long,
    mostly not words, a role marker left in, or an evaluation prompt."""
    t = text.strip()
    if not 12 <= len(t) <= 600 or "<|im_" in t or t.count("\n") > 12:
        return None
    if sum(c.isalpha() or c.isspace() for c in t) / len(t) < 0.75 or is_eval_prompt(t):
        return None
    return t


def dedupe(texts: list[str], seen: set[str] | None = None) -> list[str]:
    """Texts in order, dropping any whose normalised form was seen before (``seen`` is updated)."""
    seen = set() if seen is None else seen
    out = []
    for t in texts:
        k = _norm(t)
        if k and k not in seen:
            seen.add(k)
            out.append(t)
    return out
