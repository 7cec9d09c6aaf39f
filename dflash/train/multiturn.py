"""Second turns on answered conversations: multi-turn chat, and follow-ups that make the target copy.

Source ``chat2`` (:mod:`dflash.train.datagen`): batch k continues the conversations of the
store's ``shard_magpie_s<seed>_<k>`` (user turn + the target's answer, ids kept exactly as
generated) with a second user turn, and the target answers it. Half of the second turns are
written by the target itself (Magpie: the template up to the next user header, then sampled
text); half are follow-ups that ask it to repeat or rework its answer ("rewrite your answer as a
numbered list"), so the answer copies long runs from its own context, which is what a drafter
must learn to predict (in a repetition loop the served drafter accepted only 31% of first
drafts). Only the second answer is trained on (its loss mask); the first answer is context.
"""

from __future__ import annotations

import random

FOLLOW_UPS = (
    "Repeat your previous answer word for word.",
    "Rewrite your answer as a numbered list.",
    "Say that again, but shorter.",
    "Rewrite your answer in simpler words, keeping its structure.",
    "Put your previous answer into a single paragraph.",
    "Copy your answer above and add a short title at the top.",
    "Rewrite the answer above, fixing any mistakes you find.",
    "Repeat your answer, but replace every \"you\" with \"we\".",
    "Rewrite your answer as bullet points.",
    "Give me the same answer again, formatted as a short email.",
    "Repeat the first two sentences of your answer.",
    "Rewrite your answer so that each sentence starts on a new line.",
)

_M1, _M2, _M3 = "\u2063ONE\u2063", "\u2063TWO\u2063", "\u2063THREE\u2063"


def turn_separators(tok) -> tuple[list[int], list[int], str]:
    """``(user_head, assistant_head, eos_text)`` of the target's chat template for a second turn.

    ``user_head`` are the ids between an assistant answer's end-of-turn token and the next user
    message; ``assistant_head`` the ids between that message and the next answer. Derived by
    rendering the template with marker strings, so any ChatML-like template works. Raises
    ``ValueError`` when the template does not put the end-of-turn token after an answer."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": _M1}, {"role": "assistant", "content": _M2},
         {"role": "user", "content": _M3}], tokenize=False, add_generation_prompt=True)
    between = text[text.index(_M2) + len(_M2):text.index(_M3)]
    eos = tok.eos_token
    if not between.startswith(eos):
        raise ValueError(f"chat template: expected {eos!r} after an assistant turn, got {between[:20]!r}")
    after = text[text.index(_M3) + len(_M3):]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    return enc(between[len(eos):]), enc(after), eos


def follow_up_plan(n: int, seed: int) -> list[str | None]:
    """Per conversation: a fixed follow-up (copying) or ``None`` (the target writes the turn).

    Deterministic per ``seed``; about half of each."""
    rng = random.Random(seed)
    return [rng.choice(FOLLOW_UPS) if rng.random() < 0.5 else None for _ in range(n)]


def second_turn_prompt(first: list[int], user_text_ids: list[int], user_head: list[int],
                       assistant_head: list[int]) -> list[int]:
    """Ids of ``first`` (a whole first turn ending with the end-of-turn token) + the next user
    message + the assistant header: what the target answers."""
    return first + user_head + user_text_ids + assistant_head
