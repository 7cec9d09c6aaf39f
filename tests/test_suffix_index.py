"""The suffix index (``dflash.core.suffix``) against brute force, property-based: random token
streams over small alphabets (so matches are frequent and long), grown and rewound in random
orders as sessions are (steps append, a new turn whose prompt diverges rewinds)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from dflash.core.suffix import (
    EMPTY,
    MAX_MATCH,
    MAX_OCCURRENCES,
    MAX_TRIE_NODES,
    NGRAM_SIZES,
    SuffixIndex,
    build_trie,
    proposal_depth,
)

streams = st.lists(st.integers(0, 3), max_size=120)
# an edit: ("extend", tokens) or ("truncate", fraction of the length kept)
edits = st.lists(st.one_of(st.tuples(st.just("extend"), st.lists(st.integers(0, 3), max_size=30)),
                           st.tuples(st.just("truncate"), st.floats(0, 1))), max_size=12)


def match_length(toks: list[int], e: int, tail: list[int]) -> int:
    n = 0
    while n < MAX_MATCH and n < len(tail) and e - n >= 0 and toks[e - n] == tail[-1 - n]:
        n += 1
    return n


def brute_matches(toks: list[int], tail: list[int]) -> list[tuple[int, int]]:
    """The spec of ``SuffixIndex.matches``: the longest key size whose n-gram (``tail``'s last n
    tokens) ends somewhere with a token after it; those ends, most recent first, at most
    MAX_OCCURRENCES, each with its exact match length."""
    for n in NGRAM_SIZES:
        if n > len(tail):
            continue
        ends = [e for e in range(len(toks) - 1) if e - n + 1 >= 0 and toks[e - n + 1:e + 1] == tail[-n:]]
        if ends:
            return [(match_length(toks, e, tail), e) for e in reversed(ends)][:MAX_OCCURRENCES]
    return []


def state(ix: SuffixIndex) -> dict:
    return {k: list(v) for k, v in ix._ends.items()}


@settings(max_examples=300, deadline=None)
@given(streams, edits)
def test_incremental_index_equals_a_fresh_one(start, ops):
    ix = SuffixIndex(start)
    ref = list(start)
    for op, arg in ops:
        if op == "extend":
            ix.extend(arg)
            ref += arg
        else:
            keep = int(arg * len(ref))
            ix.truncate(keep)
            del ref[keep:]
        assert ix.tokens == ref
    assert state(ix) == state(SuffixIndex(ref))


@settings(max_examples=300, deadline=None)
@given(streams, streams)
def test_sync_rewinds_to_the_common_prefix(a, b):
    ix = SuffixIndex(a)
    ix.sync(a[:len(a) // 2] + b)
    assert ix.tokens == a[:len(a) // 2] + b
    assert state(ix) == state(SuffixIndex(ix.tokens))


@settings(max_examples=400, deadline=None)
@given(streams, edits)
def test_matches_equal_brute_force_after_edits(start, ops):
    ix = SuffixIndex(start)
    for op, arg in ops:
        if op == "extend":
            ix.extend(arg)
        else:
            ix.truncate(int(arg * len(ix)))
    toks = ix.tokens
    got = [(m.length, m.end) for m in ix.matches(toks[-MAX_MATCH - 1:], own=True)]
    assert got == brute_matches(toks, toks[-MAX_MATCH - 1:])
    # with few occurrences nothing is cut: the longest match anywhere is found
    every = [match_length(toks, e, toks) for e in range(len(toks) - 1)]
    if got and len(got) < MAX_OCCURRENCES:
        assert max(n for n, _ in got) == max(every)
    if not got and toks:
        assert toks[-1] not in toks[:-1]


@settings(max_examples=200, deadline=None)
@given(streams, streams)
def test_matches_in_another_stream(a, tail):
    ix = SuffixIndex(a)
    got = [(m.length, m.end) for m in ix.matches(tail)]
    assert got == brute_matches(a, tail)


@settings(max_examples=300, deadline=None)
@given(streams, st.integers(1, 20))
def test_trie_counts_every_continuation_of_the_longest_matches(toks, depth):
    ix = SuffixIndex(toks)
    trie = build_trie(toks, [(ix, True)], depth)
    found = ix.matches(toks[-MAX_MATCH - 1:], own=True)
    if not found:
        assert trie == EMPTY
        return
    best = max(m.length for m in found)
    assert trie.match == best
    go = proposal_depth(best, depth)
    conts = [tuple(toks[m.end + 1:m.end + 1 + go]) for m in found if m.length == best]
    assert trie.total == len(conts)
    # node j's count = continuations through its root-to-node path
    for j in range(1, len(trie.parents)):
        path = []
        i = j
        while i > 0:
            path.append(trie.tokens[i - 1])
            i = trie.parents[i]
        path.reverse()
        assert trie.parents[j] < j
        assert trie.counts[j] == sum(1 for c in conts if c[:len(path)] == tuple(path))
    # and every continuation is in the trie, up to its node cap (the most recent first)
    distinct = {c[:n] for c in conts for n in range(1, len(c) + 1)}
    assert len(trie.tokens) == min(MAX_TRIE_NODES, len(distinct))
    assert trie.depths == [0] + [trie.depths[trie.parents[j]] + 1 for j in range(1, len(trie.parents))]


def test_a_copy_is_proposed_as_deep_as_its_match():
    text = list(range(100, 140))
    ix = SuffixIndex(text + [7, 8] + text[:10])
    trie = build_trie(ix.tokens, [(ix, True)], depth=16)
    assert trie.match == 10
    assert trie.tokens == text[10:26]          # one occurrence: a chain, 16 deep
    assert trie.counts == [1] * 17
