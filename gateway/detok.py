"""Incremental detokenization with stop strings.

Text is emitted only once it is final: a UTF-8 character split across byte-level tokens shows as
U+FFFD until its last byte arrives, so trailing U+FFFD is held back; and the tail that could
still grow into a stop string is held back until it cannot. The emitted deltas always join to a
prefix of ``decode(all tokens)``; :meth:`finish` emits the rest, so joined deltas equal the full
text (TGI ``decode_token`` / vLLM ``detokenize_incrementally`` idea, done on the full decode).
"""

from __future__ import annotations

import dataclasses

REPLACEMENT = "\ufffd"


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]


class IncrementalDetokenizer:
    """Feed generated token ids; get text deltas. ``stop`` strings end the text before them.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        stop: stop strings; the output ends right before the first occurrence of any.
        skip_special_tokens: drop EOS and other specials from the text (ids are still reported).
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""
        self._pending_ids: list[int] = []
        self.stopped = False
        self.num_tokens = 0   # tokens consumed up to (and including) the one completing a stop

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=self.skip,
                               clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> Delta:
        """Consume tokens one at a time until a stop string appears; return the new final text."""
        out, ids_out = [], []
        for t in token_ids:
            if self.stopped:
                break
            self.ids.append(t)
            self.num_tokens += 1
            self._pending_ids.append(t)
            full = self._decode()
            hit = self._find_stop(full)
            if hit is not None:
                self.stopped = True
                text = full[:hit][len(self.emitted):]
                out.append(text)
                ids_out += self._pending_ids
                self._pending_ids = []
                self.emitted += text
                break
            safe = full.rstrip(REPLACEMENT)
            safe = safe[:len(safe) - self._stop_prefix_len(safe)]
            if len(safe) > len(self.emitted) and safe.startswith(self.emitted):
                text = safe[len(self.emitted):]
                out.append(text)
                ids_out += self._pending_ids
                self._pending_ids = []
                self.emitted = safe
        return Delta("".join(out), ids_out)

    def finish(self) -> Delta:
        """Flush what was held back (an incomplete character at the very end stays as U+FFFD)."""
        if self.stopped:
            return Delta("", [])
        full = self._decode()
        text = full[len(self.emitted):] if full.startswith(self.emitted) else ""
        self.emitted += text
        ids, self._pending_ids = self._pending_ids, []
        return Delta(text, ids)

    def _find_stop(self, full: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, len(self.emitted) - max(len(s) for s in self.stop))
        hits = [i for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
