"""Suffix drafts: the continuations of the current context that text the target has seen
already offers (its prompt, what it generated, earlier answers), as a tree of candidates.

Source: SuffixDecoding (Oliaro et al., arXiv 2411.04975; served in Snowflake's
ArcticInference): find the longest suffix of the context that occurred before, and propose what
followed it, each continuation scored by how often it followed (the frequency score
``count(node) / count(root)``); the deeper the match, the deeper the proposal may go. We keep an
n-gram table instead of a suffix tree (``docs/suffix.md``, "The index"): it appends and rewinds in
O(n-gram sizes) per token, and a lookup is a handful of dict reads, whatever the context length.

Pure Python, no torch: the verifier's engine turns a :class:`SuffixTrie` into tree nodes
(``verifier_svc/suffix_drafts.py``).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable, Sequence

__all__ = ["NGRAM_SIZES", "MAX_MATCH", "SEPARATOR", "SuffixIndex", "SuffixTrie", "Match", "build_trie",
           "proposal_depth"]

#: Lengths of the n-grams indexed (each token ends one of each). A lookup starts with the
#: longest that occurs and extends each hit by comparing tokens, so matches of any length up to
#: :data:`MAX_MATCH` are measured exactly; geometric sizes keep the per-token cost at four keys.
NGRAM_SIZES = (8, 4, 2, 1)
#: Matches are measured up to this many tokens: longer ones count as this long (all of them
#: then score together, SuffixDecoding's bounded pattern length).
MAX_MATCH = 16
#: Occurrences of the longest key read per lookup, the most recent first (bounds a lookup's
#: cost in repetitive text).
MAX_OCCURRENCES = 32
#: Nodes a trie may hold: continuations are merged most recent first, and once the trie is
#: full they only count through the nodes it has (a verify never takes more than a few dozen).
MAX_TRIE_NODES = 64
#: Between two texts in one index (a tenant's answers): never a token id, so no match spans it
#: and continuations stop at it.
SEPARATOR = -1


def proposal_depth(match: int, limit: int) -> int:
    """How deep the continuations after a match of ``match`` tokens may go: ``2 + 2 * match``,
    at most ``limit`` (SuffixDecoding's ``max_spec_factor * match + offset``: a long match is a
    copy and goes far, a one-token match only a step or two)."""
    return max(0, min(limit, 2 + 2 * match))


@dataclasses.dataclass(frozen=True)
class Match:
    """One earlier occurrence of the context's suffix: ``length`` tokens matched (at most
    :data:`MAX_MATCH`) ending at position ``end`` of ``index``'s tokens."""

    length: int
    end: int
    index: "SuffixIndex"


class SuffixIndex:
    """The n-gram positions of one token stream, kept in step with it.

    ``tokens``: the stream (a copy owned by the index). :meth:`extend` appends, :meth:`truncate`
    rewinds (a new turn whose prompt diverges from what the session holds); both cost
    ``len(NGRAM_SIZES)`` dict operations per token. Memory: about :attr:`nbytes`.
    """

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        # n-gram -> end positions (index of its last token), ascending
        self._ends: dict[tuple[int, ...], array] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Approximate bytes held: per key its tuple and dict slot and array header, 4 per
        position, 8 per token (the stream's list)."""
        return 160 * len(self._ends) + 4 * len(NGRAM_SIZES) * len(self.tokens) + 8 * len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        toks, ends = self.tokens, self._ends
        longest = NGRAM_SIZES[0]
        for t in new:
            toks.append(int(t))
            i = len(toks) - 1
            last = tuple(toks[max(0, i - longest + 1):])   # the longest key; the others end it
            for n in NGRAM_SIZES:
                if n > i + 1:
                    continue
                key = last[-n:] if n < len(last) else last
                lst = ends.get(key)
                if lst is None:
                    ends[key] = array("i", (i,))
                else:
                    lst.append(i)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (no-op when the stream is not longer)."""
        toks, ends = self.tokens, self._ends
        while len(toks) > max(length, 0):
            i = len(toks) - 1
            for n in NGRAM_SIZES:
                if n > i + 1:
                    continue
                key = tuple(toks[i - n + 1:i + 1])
                lst = ends[key]
                lst.pop()                    # positions are ascending: i is the last one
                if not lst:
                    del ends[key]
            toks.pop()

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the stream ``tokens``: rewind to the common prefix, append the rest."""
        n = min(len(tokens), len(self.tokens))
        if self.tokens[:n] != list(tokens[:n]):
            lo, hi = 0, n                    # the common prefix, by bisection on slices (C speed)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.tokens[:mid] == list(tokens[:mid]):
                    lo = mid
                else:
                    hi = mid - 1
            n = lo
        self.truncate(n)
        self.extend(tokens[n:])

    def matches(self, tail: Sequence[int], *, own: bool = False) -> list[Match]:
        """Earlier occurrences of the longest suffix of ``tail`` found here (up to
        :data:`MAX_OCCURRENCES`, most recent first), each with its exact match length (at most
        :data:`MAX_MATCH`); only occurrences followed by at least one token (not by
        :data:`SEPARATOR`). ``own``: ``tail``
        is this stream's own end, whose occurrence there is not a match. Empty when not even the
        last token occurred."""
        toks = self.tokens
        m = len(tail)
        for n in NGRAM_SIZES:
            if n > m:
                continue
            lst = self._ends.get(tuple(tail[m - n:]))
            if not lst:
                continue
            last = len(toks) - 1             # an occurrence there has no continuation
            out: list[Match] = []
            for j in range(len(lst) - 1, -1, -1):
                e = lst[j]
                if e >= last or toks[e + 1] == SEPARATOR:
                    continue
                # extend the match beyond the key by comparing tokens backwards
                length = n
                while length < MAX_MATCH and length < m and e - length >= 0 \
                        and toks[e - length] == tail[m - 1 - length]:
                    length += 1
                out.append(Match(length, e, self))
                if len(out) >= MAX_OCCURRENCES:
                    break
            if out:
                return out                   # else only the stream's own end: shorter keys
        return []


@dataclasses.dataclass(frozen=True)
class SuffixTrie:
    """Continuations after the longest matches, merged into a trie rooted at the context's end.

    Trie indexing as a draft tree's block: index 0 is the root (the context's last token),
    ``tokens[j - 1]`` is node j's token, ``parents[j] < j`` its parent, ``counts[j]`` how many
    of the ``total`` occurrences continue through it (``counts[0] = total``). ``match``: the
    matched suffix's length (tokens). Every node comes after its parent.
    """

    tokens: list[int]
    parents: list[int]
    counts: list[int]
    match: int
    depths: list[int]                  # depths[j]: node j's depth (0: the root)

    @property
    def total(self) -> int:
        return self.counts[0] if self.counts else 0


EMPTY = SuffixTrie(tokens=[], parents=[-1], counts=[0], match=0, depths=[0])


def build_trie(tail: Sequence[int], indexes: Sequence[tuple[SuffixIndex, bool]], depth: int
               ) -> SuffixTrie:
    """The continuations after ``tail``'s longest matches in ``indexes``.

    Args:
        tail: the context's last tokens (the anchor last); at most :data:`MAX_MATCH` are read.
        indexes: ``(index, own)`` pairs: ``own`` True for the index of the stream ``tail``
            ends (its own end is no match).
        depth: the deepest continuation wanted (the caller's block limit); each continuation
            stops at :func:`proposal_depth` of the match length.

    Returns:
        :data:`EMPTY` when nothing matched, else the trie of the continuations of every
        occurrence whose match is as long as the longest one (the frequency score's
        population, SuffixDecoding's "occurrences of the pattern"), at most
        :data:`MAX_TRIE_NODES` nodes (the most recent occurrences first; later ones count
        only as far as the trie's nodes go).
    """
    tail = list(tail[-MAX_MATCH - 1:])
    found: list[Match] = []
    for idx, own in indexes:
        found.extend(idx.matches(tail, own=own))
    if not found or depth < 1:
        return EMPTY
    best = max(m.length for m in found)
    top = [m for m in found if m.length >= best]
    go = proposal_depth(best, depth)
    tokens: list[int] = []
    parents: list[int] = [-1]
    depths: list[int] = [0]
    counts: list[int] = [len(top)]
    children: list[dict[int, int]] = [{}]
    for m in top:
        toks = m.index.tokens
        node = 0
        for t in toks[m.end + 1:m.end + 1 + go]:
            if t == SEPARATOR:
                break
            nxt = children[node].get(t)
            if nxt is None:
                if len(tokens) >= MAX_TRIE_NODES:
                    break
                tokens.append(t)
                parents.append(node)
                depths.append(depths[node] + 1)
                counts.append(0)
                children.append({})
                nxt = len(tokens)
                children[node][t] = nxt
            counts[nxt] += 1
            node = nxt
    return SuffixTrie(tokens=tokens, parents=parents, counts=counts, match=best, depths=depths)
