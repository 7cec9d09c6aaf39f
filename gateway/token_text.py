"""A token's text and its exact bytes, for OpenAI's logprobs (``token``, ``bytes``): a
byte-level token (GPT-2's alphabet) or a byte-fallback one (``<0xNN>``) may hold part of a
character, which its decoded text shows as U+FFFD."""

from __future__ import annotations

import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decodes_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is a fast (``tokenizers``-backed) one with a ByteLevel decoder;
    False for anything else (a slow tokenizer, a test double)."""
    from tokenizers import decoders  # here: transformers loads only where a tokenizer does
    from transformers import PreTrainedTokenizerFast

    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel))


class TokenText:
    """A token's text (``decode([id])``, specials included) and its exact bytes (a byte-level
    token may hold part of a character, which its text shows as U+FFFD), cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._byte_level = _byte_level_chars() if _decodes_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tok.decode([token_id], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
            raw = None
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self._byte_level is not None and all(c in self._byte_level for c in piece):
                    raw = [self._byte_level[c] for c in piece]
                elif (m := _BYTE_FALLBACK.fullmatch(piece)):
                    raw = [int(m.group(1), 16)]
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = hit
        return hit
