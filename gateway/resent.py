"""Resent answers: the token ids of a tenant's recent answers, used again when the answer comes
back as text in a later chat request (``docs/prefix-cache.md``, "Resent answers").

OpenAI clients resend the whole conversation every turn, the assistant's answers as text. Text
does not always re-tokenize to the ids the target generated (SmolLM2 emits ``"\\n\\n"`` as one
token, the same text encodes to two), so the verifier's prefix cache, which matches ids, would
stop at the first such difference. :class:`ResentAnswers` keeps, per tenant, each finished
turn's prompt text (as the chat template rendered it, generation prompt included) and the ids
sent for it plus the ids generated for the answer. A later chat request whose rendered text
starts with that prompt text and answer text, followed by a special token (the template's
end-of-turn marker: tokenizing the rest apart then gives the ids a whole encoding gives), is
tokenized as those ids + the rest's ids. The result must decode to the rendered text exactly,
or the request is tokenized as before.

Only chat requests, never raw prompts (their seam is arbitrary text); never another tenant's
turns; never a request or an answer holding control-token text or ids (typed ones are encoded as
text by the servicer's sanitising path, which this one does not reproduce).
"""

from __future__ import annotations

import array
import dataclasses
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Generator, Iterator

from jinja2 import TemplateError

from dflash.v1 import common_pb2, gateway_pb2

ASSISTANT = "assistant"
MAX_TURNS_PER_ANSWER = 4      # turns kept under one answer text (a short "OK" recurs)
TURN_OVERHEAD_BYTES = 128     # the entry's objects besides its text and ids
FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


@dataclasses.dataclass(frozen=True)
class _Turn:
    prompt_text: str          # the rendered prompt, generation prompt included
    ids: array.array          # int64: the prompt's ids as sent + the answer's (no stop token)
    nbytes: int


def _strings(value) -> Iterator[str]:
    """Every string in ``value`` (a template variable: str, list, dict keys and values)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


class ResentAnswers:
    """Per-tenant memory of finished chat turns' token ids, least recently used evicted past
    ``max_bytes`` (the turns' text and ids; each turn costs about its prompt's characters + 8
    bytes per id). ``tokenizer``: the gateway's (transformers, with a chat template). Thread-safe.

    :meth:`render` gives a request's rendered text, :meth:`splice` its ids from a remembered
    turn (or None), :meth:`remembering` records the turns of a response stream as they finish.
    Counters: ``spliced`` (requests whose ids came from a remembered turn), ``evictions``.
    Raises ValueError naming ``max_bytes`` when it is below 1.
    """

    def __init__(self, tokenizer, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.tok = tokenizer
        self.max_bytes = max_bytes
        added = dict(tokenizer.added_tokens_decoder)           # id -> AddedToken
        self._added_ids = frozenset(added)
        self._special_ids = (frozenset(i for i, t in added.items() if t.special)
                             | frozenset(tokenizer.all_special_ids))
        texts = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._turns: OrderedDict[tuple[str, str], list[_Turn]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.spliced = 0
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._turns.values())

    # ------------------------------------------------------------------ reading
    def render(self, messages: list[dict], template_kwargs: dict) -> str | None:
        """The chat template's text for ``messages`` (generation prompt added, ``template_kwargs``
        already checked); None when a message or variable holds an added token's text (the
        sanitising path encodes it as text: not reproduced here) or the template refuses them
        (the servicer's own tokenisation then raises the error)."""
        if self._control is not None:
            for s in _strings([m["content"] for m in messages] + [template_kwargs]):
                if self._control.search(s):
                    return None
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False, **template_kwargs)
        except (ValueError, TypeError, TemplateError):
            return None
        return text if isinstance(text, str) else None

    def splice(self, tenant: str, messages: list[dict], text: str) -> list[int] | None:
        """The prompt ids of ``text`` (``messages`` rendered) from ``tenant``'s remembered turn
        whose answer is an assistant message of ``messages`` (the latest one that applies), +
        the rest tokenized; None when none applies. The ids decode to ``text`` exactly."""
        for m in reversed(messages):
            if m["role"] != ASSISTANT:
                continue
            for turn in self._candidates(tenant, m["content"]):
                ids = self._spliced_ids(turn, m["content"], text)
                if ids is not None:
                    with self._lock:
                        self.spliced += 1
                    return ids
        return None

    def _candidates(self, tenant: str, answer: str) -> list[_Turn]:
        with self._lock:
            key = (tenant, answer)
            turns = self._turns.get(key)
            if turns is None:
                return []
            self._turns.move_to_end(key)
            return list(turns)

    def _spliced_ids(self, turn: _Turn, answer: str, text: str) -> list[int] | None:
        """``turn``'s ids + the ids of ``text`` after its prompt and ``answer``, when that rest
        starts with a special token and the whole decodes to ``text``; else None."""
        start = len(turn.prompt_text)
        if not (text.startswith(turn.prompt_text) and text.startswith(answer, start)):
            return None
        rest = self.tok(text[start + len(answer):], add_special_tokens=False)["input_ids"]
        if not rest or rest[0] not in self._special_ids:
            return None       # not the end-of-turn marker: the seam would re-tokenize
        ids = turn.ids.tolist() + list(rest)
        if self._decode(ids) != text:
            return None
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ writing
    def remember(self, tenant: str, prompt_text: str, prompt_ids: list[int],
                 answer_ids: list[int], answer_text: str) -> bool:
        """Keep one finished turn: ``prompt_text`` (rendered, generation prompt included) sent
        as ``prompt_ids``, answered with ``answer_ids`` shown as ``answer_text``. A trailing
        special token (the stop token: the template writes its own end-of-turn marker after a
        resent answer) is left out. Not kept (returns False) when the rest holds an added token
        or does not decode to ``answer_text`` (a stop string cut it), or it exceeds the bound."""
        content = list(answer_ids)
        if content and content[-1] in self._special_ids:
            content.pop()
        if any(i in self._added_ids for i in content) or self._decode(content) != answer_text:
            return False
        ids = array.array("q", prompt_ids)
        ids.extend(content)
        nbytes = (sys.getsizeof(prompt_text) + sys.getsizeof(answer_text)
                  + ids.itemsize * len(ids) + TURN_OVERHEAD_BYTES)
        if nbytes > self.max_bytes:
            return False
        self._put((tenant, answer_text), _Turn(prompt_text, ids, nbytes))
        return True

    def _put(self, key: tuple[str, str], turn: _Turn) -> None:
        with self._lock:
            old = self._turns.pop(key, [])
            kept = [turn] + [t for t in old if t.prompt_text != turn.prompt_text]
            self.nbytes += sum(t.nbytes for t in kept[:MAX_TURNS_PER_ANSWER])
            self.nbytes -= sum(t.nbytes for t in old)
            self._turns[key] = kept[:MAX_TURNS_PER_ANSWER]
            while self.nbytes > self.max_bytes:
                _, evicted = self._turns.popitem(last=False)
                self.nbytes -= sum(t.nbytes for t in evicted)
                self.evictions += len(evicted)

    def remembering(self, responses: Generator[gateway_pb2.GenerateResponse, None, None], tenant: str,
                    prompt_text: str, prompt_ids: list[int]
                    ) -> Generator[gateway_pb2.GenerateResponse, None, None]:
        """``responses`` (one request's, every sample) passed through; each sample that finishes
        (stop or length) is remembered before its final message goes on, so a client that
        sends its next turn on seeing it finds it."""
        ids: dict[int, list[int]] = {}
        texts: dict[int, list[str]] = {}
        try:
            for r in responses:
                if not r.HasField("usage"):
                    ids.setdefault(r.index, []).extend(r.token_ids)
                    texts.setdefault(r.index, []).append(r.text)
                elif r.finish_reason in FINISHED:
                    self.remember(tenant, prompt_text, prompt_ids, ids.get(r.index, []),
                                  "".join(texts.get(r.index, [])))
                yield r
        finally:
            responses.close()     # closed early (the client went away): cancel the samples now
