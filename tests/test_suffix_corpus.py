"""The operator's suffix corpus (``verifier_svc/suffix_corpus.py``, ``--suffix-corpus``): answers
of a token-shard folder as suffix candidates for every tenant, checked and bounded on load,
never written by a tenant; greedy output unchanged."""

from __future__ import annotations

import types

import numpy as np
import pytest

from dflash.core.speculation import SpecMode
from dflash.core.suffix import SEPARATOR
from dflash.core.token_shards import DataError
from dflash.train.tokdata import TokenSeq, TokenStore
from verifier_svc import server
from verifier_svc.engine import VerifierEngine
from verifier_svc.suffix_corpus import load_corpus
from verifier_svc.suffix_drafts import AnswerStore

from test_suffix_engine import V, cycle_target, run

FP = "sha256:corpus-test"


def seq(prompt: list[int], answer: list[int]) -> TokenSeq:
    return TokenSeq(np.array(prompt + answer, dtype=np.int64),
                    np.array([0] * len(prompt) + [1] * len(answer), dtype=np.uint8))


def write(root, seqs: list[TokenSeq], fingerprint: str = FP, name: str = "shard_chat_s0_0000.npz"):
    store = TokenStore(root, fingerprint=fingerprint)
    store.add(name, seqs, source="chat", vocab_size=100)
    return store


def test_only_answers_are_kept_each_followed_by_a_separator(tmp_path):
    write(tmp_path, [seq([90, 91], [1, 2, 3]), seq([92], [4, 5]), seq([93, 94], [6])])
    index = load_corpus(tmp_path, max_tokens=1000, fingerprint=FP)
    # the prompts (90-94) are not kept, nor a one-token answer; no continuation crosses answers
    assert index.tokens == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]


def test_the_bound_keeps_the_first_tokens_in_manifest_order(tmp_path):
    store = write(tmp_path, [seq([90], list(range(10, 20)))])
    store.add("shard_chat_s0_0001.npz", [seq([90], list(range(30, 40)))], source="chat", vocab_size=100)
    assert len(load_corpus(tmp_path, max_tokens=1000, fingerprint=FP)) == 22
    assert load_corpus(tmp_path, max_tokens=5, fingerprint=FP).tokens == [10, 11, 12, 13, 14]


def test_another_targets_or_a_damaged_folder_is_refused_naming_the_flag(tmp_path):
    write(tmp_path, [seq([90], [1, 2, 3])])
    with pytest.raises(DataError, match="--suffix-corpus.*target_fingerprint"):
        load_corpus(tmp_path, max_tokens=100, fingerprint="sha256:another")
    shard = next(tmp_path.glob("*.npz"))
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(DataError, match="--suffix-corpus.*sha256"):
        load_corpus(tmp_path, max_tokens=100, fingerprint=FP)
    with pytest.raises(DataError, match="--suffix-corpus.*manifest"):
        load_corpus(tmp_path / "nowhere", max_tokens=100, fingerprint=FP)


def test_the_verifier_exits_naming_the_flag_and_loads_a_good_corpus(tmp_path):
    write(tmp_path, [seq([90], [1, 2, 3])])
    a = server.parse_args(["--target", "-", "--suffix-corpus", str(tmp_path)])
    with pytest.raises(SystemExit, match="--suffix-corpus"):
        server.corpus_of(a, types.SimpleNamespace(fingerprint="sha256:another"))
    assert server.corpus_of(a, types.SimpleNamespace(fingerprint=FP)).tokens == [1, 2, 3, SEPARATOR]
    off = server.parse_args(["--target", "-", "--suffix-corpus", str(tmp_path), "--suffix", "off"])
    assert server.corpus_of(off, types.SimpleNamespace(fingerprint=FP)) is None


def test_every_tenant_reads_the_corpus_after_its_own_answers_and_none_writes_it(tmp_path):
    write(tmp_path, [seq([90], [1, 2, 3, 4])])
    corpus = load_corpus(tmp_path, max_tokens=100, fingerprint=FP)
    store = AnswerStore(max_tokens=100, corpus=corpus)
    store.add("a", [7, 8, 9])
    assert [ix.tokens for ix in store.indexes("a")] == [[7, 8, 9], corpus.tokens]
    assert store.indexes("b") == [corpus]
    assert store.corpus_tokens == 5 and store.tokens == 3     # the corpus is not a tenant's
    assert store.nbytes > corpus.nbytes
    assert AnswerStore(max_tokens=0, corpus=corpus).indexes("a") == [corpus]


def test_a_continuation_only_in_the_corpus_is_accepted_and_output_is_unchanged(tmp_path):
    target, order = cycle_target(2)
    write(tmp_path, [seq([0], order + order[:4])])     # the target's answer once round the cycle
    corpus = load_corpus(tmp_path, max_tokens=1000, fingerprint=FP)
    held = list(corpus.tokens)
    engine = VerifierEngine(target, spec_mode="suffix", answers=AnswerStore(max_tokens=0, corpus=corpus))
    bare = VerifierEngine(target, spec_mode="suffix", answers=AnswerStore(max_tokens=0))
    base = VerifierEngine(target, spec_mode=SpecMode.OFF)
    try:
        prompt = order[7:8]
        want, _ = run(base, prompt, V)
        for tenant in ("a", "b"):
            got, events = run(engine, prompt, V, tenant=tenant)
            assert got == want
            # copied from the corpus from the first decode step, whatever the tenant
            assert events[1].suffix_nodes > 0
            assert events[-1].stats.suffix_accepted_tokens >= V // 2
        got, events = run(bare, prompt, V)
        assert got == want and events[-1].stats.suffix_accepted_tokens == 0
        assert corpus.tokens == held                    # served answers never enter it
    finally:
        for e in (engine, bare, base):
            e.close()


def test_diagnose_replays_refuse_another_targets_corpus(tmp_path):
    """diagnose's suffix replay loads the corpus as the verifier does: for the probed target's
    fingerprint, or not at all."""
    from dflash_app.diagnose_suffix import SuffixSettings

    write(tmp_path, [seq([1], [2, 3])])
    other = SuffixSettings(True, 0, 0, str(tmp_path), 100, fingerprint="sha256:another")
    with pytest.raises(DataError, match="--suffix-corpus.*target_fingerprint"):
        _ = other.corpus_index
    ours = SuffixSettings(True, 0, 0, str(tmp_path), 100, fingerprint=FP)
    assert ours.corpus_index is not None and ours.corpus_index.tokens == [2, 3, SEPARATOR]
