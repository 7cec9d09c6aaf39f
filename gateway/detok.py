"""Incremental detokenization with stop strings, in O(1) per token.

Text is emitted only once it is final: a UTF-8 character split across byte-level tokens shows as
U+FFFD until its last byte arrives, so text ending in U+FFFD is held back; and the tail that
could still grow into a stop string is held back until it cannot. :meth:`finish` emits the rest,
so joined deltas equal ``decode(all tokens)``.

Each token decodes a short window of ids, never the whole output (vLLM
``detokenize_incrementally`` / TGI ``decode_token``): ``ids[prefix:read]`` are tokens whose text
is out, kept as context because a decoder may render a token differently at the start of a
string (a leading-space strip); ``ids[read:]`` are tokens whose text is not final yet. Decoding
``ids[prefix:]`` and removing the text of ``ids[prefix:read]`` gives the new text. Stop strings
are searched in the held text plus the last ``len(longest stop) - 1`` emitted characters.
"""

from __future__ import annotations

import dataclasses

REPLACEMENT = "\ufffd"


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]
    # what was pushed beside each id (the verifier's TokenLogprob), cut where the ids are cut
    extras: list = dataclasses.field(default_factory=list)


class IncrementalDetokenizer:
    """Feed generated token ids; get text deltas. ``stop`` strings end the text before them.

    A delta carries the ids consumed since the previous text came out (the ids whose text
    completed), and ``extras``: the objects pushed beside those ids, one per id. After a stop
    string the delta ends at the token that completed it (:attr:`num_tokens` counts up to it).

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        stop: stop strings; the output ends right before the first occurrence of any.
        skip_special_tokens: drop EOS and other specials from the text (ids are still reported).
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self._keep = max((len(s) for s in self.stop), default=1) - 1   # emitted chars searched again
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0               # ids[_prefix:_read]: context whose text is out
        self._read = 0                 # ids[_read:]: text not final yet
        self._prefix_text = ""         # decode(ids[_prefix:_read])
        self._held = ""                # final text held back (it may begin a stop string)
        self._out: list[str] = []      # emitted pieces
        self._tail = ""                # the last _keep emitted characters
        self._pending_ids: list[int] = []
        self._pending_extras: list = []
        self.stopped = False
        self.num_tokens = 0   # tokens consumed up to (and including) the one completing a stop

    @property
    def emitted(self) -> str:
        """All text emitted so far (joins the pieces: O(length), for callers that need it)."""
        return "".join(self._out)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip,
                               clean_up_tokenization_spaces=False)

    def _final_text(self) -> str:
        """Text that the newest token made final ("" while it ends in an incomplete character)."""
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return new

    def push(self, token_ids: list[int], extras=None) -> Delta:
        """Consume tokens one at a time until a stop string appears; return the new final text.

        ``extras``: None, or one object per token id (kept with its id; a shorter list is an
        error). Raises ValueError when ``extras`` does not match ``token_ids`` in length."""
        if extras is not None and len(extras) != len(token_ids):
            raise ValueError(f"extras: {len(extras)} for {len(token_ids)} token ids")
        out, ids_out, extras_out = [], [], []
        for i, t in enumerate(token_ids):
            if self.stopped:
                break
            self.ids.append(t)
            self.num_tokens += 1
            self._pending_ids.append(t)
            if extras is not None:
                self._pending_extras.append(extras[i])
            new = self._final_text()
            if not new:
                continue
            self._held += new
            hit = self._find_stop()
            if hit is not None:
                self.stopped = True
                text = self._held[:hit]
                self._held = ""
            else:
                keep = self._stop_prefix_len(self._held)
                text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if text or self.stopped:
                self._emit(text)
                out.append(text)
                ids_out += self._pending_ids
                extras_out += self._pending_extras
                self._pending_ids, self._pending_extras = [], []
        return Delta("".join(out), ids_out, extras_out)

    def finish(self) -> Delta:
        """Flush what was held back (an incomplete character at the very end stays as U+FFFD)."""
        if self.stopped:
            return Delta("", [])
        rest = self._decode(self.ids[self._prefix:])[len(self._prefix_text):]
        text = self._held + rest
        self._held = ""
        self._prefix = self._read = len(self.ids)
        self._prefix_text = ""
        self._emit(text)
        ids, self._pending_ids = self._pending_ids, []
        extras, self._pending_extras = self._pending_extras, []
        return Delta(text, ids, extras)

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(text)
            self._tail = (self._tail + text)[-self._keep:] if self._keep else ""

    def _find_stop(self) -> int | None:
        """Index in the held text where the first stop string begins, or None.

        A stop string found now ends in the held text (else it was found before); the part of
        it before the held text is a stop prefix that was held too, so the index is >= 0."""
        if not self.stop:
            return None
        window = self._tail + self._held
        hits = [i for s in self.stop if (i := window.find(s)) >= 0]
        return max(0, min(hits) - len(self._tail)) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
