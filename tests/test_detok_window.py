"""The detokenizer decodes a bounded window of ids per token (O(1), not the whole output),
joins to the full decode for byte-level and SentencePiece-style (Metaspace) tokenizers, and
keeps each token's pushed extra (its logprob) with its id, cut where a stop string cuts.
tests/test_streaming.py holds the emoji / CJK / stop-string guarantees; per-token timings are
scripts/detok_bench.py's, not a test's."""

from __future__ import annotations

import random

import pytest

from gateway.detok import IncrementalDetokenizer

TEXT = "Streaming 😀🎉 世界你好 mixed ©☃ text 𝄞 — and a long tail of plain words. "


class CountingTokenizer:
    """Wraps a tokenizer; records how many ids each decode call saw."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def _stream(tok, ids, stop=(), extras=None, seed=0):
    d = IncrementalDetokenizer(tok, list(stop))
    rng = random.Random(seed)
    out, got_ids, got_extras, i = [], [], [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        delta = d.push(ids[i:i + n], extras[i:i + n] if extras is not None else None)
        out.append(delta.text)
        got_ids += delta.token_ids
        got_extras += delta.extras
        i += n
    end = d.finish()
    return "".join(out) + end.text, got_ids + end.token_ids, got_extras + end.extras, d


def test_each_token_decodes_a_bounded_window(tokenizer):
    ids = tokenizer.encode(TEXT * 40)               # ~3,000 byte tokens
    spy = CountingTokenizer(tokenizer)
    text, got, _, _ = _stream(spy, ids, stop=["<never>"])
    assert text == tokenizer.decode(ids) and got == ids
    # a 4-byte character is the longest wait: never more than a handful of ids per decode
    assert max(spy.sizes) <= 8, max(spy.sizes)
    assert len(spy.sizes) <= 2 * len(ids) + 1


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style word tokenizer: "▁" marks a space, stripped at the start of a
    decode (so decoding a window alone would lose a space the full decode keeps)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(TEXT.split())) + ["x"]
    vocab = {"<unk>": 0, "</s>": 1}
    for w in words:
        vocab.setdefault("▁" + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("seed", range(3))
def test_a_leading_space_decoder_joins_to_the_full_decode(metaspace, seed):
    ids = metaspace.encode(TEXT * 3) + [metaspace.eos_token_id] + metaspace.encode(" x")
    full = metaspace.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    text, got, _, _ = _stream(metaspace, ids, seed=seed)
    assert text == full and got == ids
    assert " mixed " in text             # the spaces between words survive the windows


@pytest.mark.parametrize("stop", ["世界", "text 𝄞", "tail"])
def test_extras_follow_their_ids_and_are_cut_at_a_stop(tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    extras = [("lp", i) for i in range(len(ids))]
    text, got, got_extras, d = _stream(tokenizer, ids, stop=[stop], extras=extras)
    assert text == TEXT[:TEXT.index(stop)]
    n = len(TEXT[:TEXT.index(stop) + len(stop)].encode())     # ids up to the stop's last byte
    assert got == ids[:n] == ids[:d.num_tokens]
    assert got_extras == extras[:n]


def test_extras_must_match_the_ids(tokenizer):
    d = IncrementalDetokenizer(tokenizer)
    with pytest.raises(ValueError, match="extras"):
        d.push([65, 66], ["only one"])
