#!/usr/bin/env python3
"""Write the copy-heavy prompt set ``data/bench/edit.jsonl`` from this repository's own sources:
functions of 6-24 lines, each behind one of six edit requests (rewrite, type hints, refactor,
style fix, summarise-then-quote, and a second turn that revises a first answer), so the answers
copy much of their prompt. Deterministic: the same sources give the same file.

    python scripts/make_edit_prompts.py [--count 24] [--out data/bench/edit.jsonl]

The set is committed, so benchmarks do not move when the code they quote changes.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dflash/core", "dflash/serving", "gateway", "verifier_svc", "drafter_svc", "kernels")
FENCE = "```"

TEMPLATES = (
    lambda name, src: [{"role": "user", "content": "Rewrite this Python function with clearer "
                        f"variable names. Keep its behaviour the same.\n\n{FENCE}python\n{src}\n{FENCE}"}],
    lambda name, src: [{"role": "user", "content": "Add type hints to the arguments of this "
                        f"function and return the whole function.\n\n{FENCE}python\n{src}\n{FENCE}"}],
    lambda name, src: [{"role": "user", "content": f"Here is a function:\n\n{FENCE}python\n{src}\n"
                        f"{FENCE}\n\nFirst say in one sentence what it does, then quote its first "
                        "three lines exactly."}],
    lambda name, src: [{"role": "user", "content": f"Write a Python function named {name}."},
                       {"role": "assistant", "content": f"{FENCE}python\n{src}\n{FENCE}"},
                       {"role": "user", "content": "Revise your answer: add a short docstring and "
                        "keep the rest of the code exactly the same."}],
    lambda name, src: [{"role": "user", "content": "Refactor this function to use early returns "
                        f"where it can, and print the whole function.\n\n{FENCE}python\n{src}\n{FENCE}"}],
    lambda name, src: [{"role": "user", "content": "Fix the style of this code (PEP 8) without "
                        f"changing what it does.\n\n{FENCE}python\n{src}\n{FENCE}"}],
)


def functions() -> list[tuple[str, str, str]]:
    """(module path, function name, source) of every top-level function of 6-24 lines with a
    docstring stripped, sorted by path and name."""
    out = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            tree = ast.parse(text)
            for node in tree.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                    continue
                body, doc = node.body, None
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    doc, body = body[0], body[1:]    # the docstring: the edit requests add their own
                if not body:
                    continue
                lines = text.splitlines()
                sig_end = (doc.lineno if doc else body[0].lineno) - 1
                src = "\n".join(lines[node.lineno - 1:sig_end] + lines[body[0].lineno - 1:node.end_lineno])
                n = src.count("\n") + 1
                if 6 <= n <= 24:
                    out.append((str(path.relative_to(ROOT)), node.name, src))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--out", default=str(ROOT / "data/bench/edit.jsonl"))
    a = p.parse_args()
    found = functions()
    step = max(1, len(found) // a.count)
    chosen = found[::step][:a.count]
    with open(a.out, "w") as f:
        for i, (_path, name, src) in enumerate(chosen):
            f.write(json.dumps({"id": f"edit/{i}:{name}", "messages": TEMPLATES[i % len(TEMPLATES)](name, src)}) + "\n")
    print(f"wrote {len(chosen)} prompts (of {len(found)} functions) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
