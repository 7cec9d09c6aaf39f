"""Suffix drafts in the verifier: each session's index, the tenant's recent answers, calibrated
candidate probabilities, and the trees they become (alone, or merged into a drafter's DDTree).

* :class:`SuffixOffer`: one step's candidates for one session (``dflash.core.suffix.build_trie``
  over the session's own stream and its tenant's recent answers), each node with ``probs[j]``,
  the estimated probability that the target's walk reaches it::

      probs[j] = probs[parent] * rate(cell(match, depth j, counts[parent], counts[j]))

  a measured conditional acceptance (:class:`SuffixCalibration`) per match length, depth,
  support (the occurrences through the parent) and frequency share (SuffixDecoding's score
  ``counts[j] / counts[parent]``), so the sum of a tree's probabilities plus one is its expected
  committed tokens, the figure the speculation policy trades against verify cost.
* :func:`suffix_tree`: the ``n`` most probable nodes as a tree (mode ``suffix``; the fallback
  when a drafter fails).
* :func:`hybrid_tree`: a drafter's DDTree and the suffix nodes worth more than the drafter's
  marginal node, under one node budget, shared prefixes merged (mode ``hybrid``; adaptive's
  trees).
* :class:`AnswerStore`: recent answers per tenant (bounded in tokens, least recently used
  tenants dropped first); a tenant's lookups read only its own answers.

Sources of a tree's nodes (``sources[j]`` per block index, a :class:`DraftSource`): the drafter,
the suffix index, a grammar (tokens it forces, ``verifier_svc/grammar_rows.py``), or several; a node
the drafter proposed counts as the drafter's in the per-source statistics (``suffix`` and
``grammar`` count what only that source added).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from enum import IntFlag

from dflash.core.suffix import MAX_MATCH, SEPARATOR, SuffixIndex, SuffixTrie, build_trie
from verifier_svc.tree import DraftTree

__all__ = ["DraftSource", "SuffixCalibration", "SessionRates", "SuffixOffer", "AnswerStore", "cell",
           "suffix_tree", "hybrid_tree", "suffix_gain", "match_bucket", "Sourced"]


class DraftSource(IntFlag):
    """Who proposed a tree node (bits: several may propose the same node; 0: none, the root)."""

    DRAFTER = 1
    SUFFIX = 2
    GRAMMAR = 4


#: Upper ends of the match-length buckets (tokens): 1, 2, 3-4, 5-8, 9-16.
MATCH_BUCKETS = (1, 2, 4, 8, MAX_MATCH)
#: Upper ends of the depth buckets: 1, 2-3, 4-7, 8+.
DEPTH_BUCKETS = (1, 3, 7, 1 << 30)
#: Upper ends of the support buckets (occurrences that continue through the parent): 1, 2,
#: 3-4, 5+. A continuation several earlier occurrences agree on is taken far more often than
#: one seen once: on the chat set, 0.39 at one occurrence against 0.9 at three (docs/suffix.md).
SUPPORT_BUCKETS = (1, 2, 4, 1 << 30)
#: Lower ends of the frequency buckets (the candidate's share of its parent's occurrences).
FREQUENCY_BUCKETS = (0.999, 0.5, 0.25, 0.0)
#: Acceptance once the parent is reached, before anything is measured, for an unanimous
#: continuation: short matches are guesses, long ones copies (scaled by the frequency score).
PRIOR_RATES = (0.3, 0.45, 0.6, 0.75, 0.85)
PRIOR_WEIGHT = 4.0              # pseudo-observations of the coarser estimate in a finer one
GLOBAL_WINDOW = 400.0           # the global sums are halved past this many offers per cell


def match_bucket(match: int) -> int:
    return _bucket(match, MATCH_BUCKETS)


def _bucket(x: int, upper: Sequence[int]) -> int:
    for b, hi in enumerate(upper):
        if x <= hi:
            return b
    return len(upper) - 1


#: (match bucket, depth bucket, support bucket, frequency bucket)
Cell = tuple[int, int, int, int]


def cell(match: int, depth: int, support: int, count: int) -> Cell:
    """The calibration cell of a trie node ``count`` of whose parent's ``support``
    occurrences continue through it, at ``depth``, after a match of ``match`` tokens."""
    share = count / support
    f = next(i for i, lo in enumerate(FREQUENCY_BUCKETS) if share >= lo)
    return (match_bucket(match), _bucket(depth, DEPTH_BUCKETS), _bucket(support, SUPPORT_BUCKETS), f)


class SessionRates:
    """One session's own suffix outcomes against the verifier-wide rates: candidates taken, and
    the sum of their verifier-wide probabilities (once the walk reached their parents)."""

    def __init__(self) -> None:
        self.accepted = 0.0
        self.expected = 0.0

    def factor(self) -> float:
        """How much more (> 1) or less this session's candidates are taken than the
        verifier-wide rates say, shrunk towards 1 by :data:`PRIOR_WEIGHT` pseudo-outcomes."""
        return (self.accepted + PRIOR_WEIGHT) / (self.expected + PRIOR_WEIGHT)


class SuffixCalibration:
    """Acceptance of suffix candidates once the walk reached their parent, per :func:`cell`
    (match length, depth, support, frequency share): a probability, never above 1, so a child
    is never more probable than its parent. A cell with few outcomes leans on its match and
    frequency buckets' pooled rate, and that on :data:`PRIOR_RATES`. The verifier-wide rates (a
    window of recent offers) are scaled by each session's own taken / expected ratio
    (:class:`SessionRates`), so a session whose text copies well is trusted more and one whose
    matches keep failing is asked less."""

    def __init__(self) -> None:
        # fine cells, and their match and frequency buckets pooled under (b, -1, -1, f)
        self._sums: dict[Cell, list[float]] = {}

    def rate(self, c: Cell, share: float, own: SessionRates | None) -> float:
        """The probability the walk takes a candidate of cell ``c`` (frequency share ``share``
        of its parent's occurrences) once it reached the parent."""
        acc, off = self._sums.get(_pooled(c), (0.0, 0.0))
        g = (acc + PRIOR_WEIGHT * PRIOR_RATES[c[0]] * share) / (off + PRIOR_WEIGHT)
        acc, off = self._sums.get(c, (0.0, 0.0))
        g = (acc + PRIOR_WEIGHT * g) / (off + PRIOR_WEIGHT)
        return min(1.0, g * own.factor() if own is not None else g)

    def observe(self, c: Cell, share: float, accepted: bool, own: SessionRates | None) -> None:
        """A candidate of cell ``c`` (frequency share ``share``) whose parent the walk reached,
        and whether it took it."""
        if own is not None:
            own.accepted += float(accepted)
            own.expected += self.rate(c, share, None)
        for key in (c, _pooled(c)):
            sums = self._sums.setdefault(key, [0.0, 0.0])
            sums[0] += float(accepted)
            sums[1] += 1.0
            if sums[1] > GLOBAL_WINDOW:
                sums[0] *= 0.5
                sums[1] *= 0.5


def _pooled(c: Cell) -> Cell:
    return (c[0], -1, -1, c[3])


def node_cell(trie: SuffixTrie, j: int) -> Cell:
    """Trie node ``j``'s :func:`cell`."""
    p = trie.parents[j]
    return cell(trie.match, trie.depths[j], trie.counts[p], trie.counts[j])


@dataclasses.dataclass(frozen=True)
class SuffixOffer:
    """One session's suffix candidates this step (module docstring). ``order``: node indices of
    ``trie`` by probability, highest first (parents before children); ``cumulative[n]``: the sum
    of the first ``n`` probabilities (``cumulative[0] = 0``)."""

    trie: SuffixTrie
    probs: list[float]
    order: list[int]
    cumulative: list[float]
    rates: SessionRates | None

    @staticmethod
    def build(trie: SuffixTrie, calibration: SuffixCalibration, rates: SessionRates | None
              ) -> "SuffixOffer":
        probs = [1.0] * len(trie.parents)
        for j in range(1, len(trie.parents)):
            p = trie.parents[j]
            probs[j] = probs[p] * calibration.rate(node_cell(trie, j), trie.counts[j] / trie.counts[p],
                                                   rates)
        order = sorted(range(1, len(trie.parents)), key=lambda j: (-probs[j], j))
        cum = [0.0]
        for j in order:
            cum.append(cum[-1] + probs[j])
        return SuffixOffer(trie=trie, probs=probs, order=order, cumulative=cum, rates=rates)

    @property
    def size(self) -> int:
        return len(self.order)

    def expected(self, n: int) -> float:
        """Expected committed tokens (bonus included) of a tree of its ``n`` best nodes."""
        return 1.0 + self.cumulative[min(n, self.size)]

    def above(self, threshold: float, limit: int) -> list[int]:
        """Its nodes worth more than ``threshold`` and no deeper than ``limit``, best first."""
        depths = self.trie.depths
        return [j for j in self.order if self.probs[j] > threshold and depths[j] <= limit]


@dataclasses.dataclass(frozen=True)
class Sourced:
    """A tree to verify, each block index's sources, and the trie node each suffix node is
    (block index -> trie node, for :func:`observe_walk`)."""

    tree: DraftTree
    sources: list[DraftSource]
    trie_nodes: dict[int, int]
    gain: float = 0.0       # a hybrid tree: its suffix candidates' :func:`suffix_gain`

    def suffix_only(self, path: Sequence[int]) -> int:
        """Accepted nodes of ``path`` (block indices) that only the suffix index proposed."""
        return sum(1 for j in path if self.sources[j] == DraftSource.SUFFIX)

    @property
    def suffix_nodes(self) -> int:
        return sum(1 for s in self.sources[1:] if s & DraftSource.SUFFIX)

    def drafter_prefix(self, path: Sequence[int]) -> int:
        """Accepted path nodes before the first node no drafter proposed: what the drafter's
        own tree would have committed of this path."""
        n = 0
        for j in path:
            if not self.sources[j] & DraftSource.DRAFTER:
                break
            n += 1
        return n


def suffix_tree(offer: SuffixOffer, n: int, limit: int) -> Sourced | None:
    """The tree of ``offer``'s ``n`` most probable nodes no deeper than ``limit`` (None when
    that leaves none)."""
    depths = offer.trie.depths
    chosen = [j for j in offer.order if depths[j] <= limit][:n]
    if not chosen:
        return None
    return _merge(None, offer, sorted(chosen))


def suffix_gain(offer: SuffixOffer | None, threshold: float, limit: int, budget: int) -> float:
    """What ``offer``'s candidates are predicted to add to a drafter's tree, uncalibrated: each
    worth more than ``threshold`` (the drafter's marginal node), best first, at most ``budget``,
    adds the difference. Overlap with the drafter's own nodes is not known before it drafts
    (``AcceptanceEstimator.hybrid_factor`` measures it)."""
    if offer is None or limit < 1:
        return 0.0
    return sum(offer.probs[j] - threshold for j in offer.above(threshold, limit)[:budget])


def hybrid_tree(drafter: DraftTree, offer: SuffixOffer | None, budget: int, threshold: float,
                limit: int) -> Sourced:
    """The drafter's tree ``drafter`` (pop order, at most ``budget`` nodes) with ``offer``'s
    nodes worth more than ``threshold`` (the drafter's marginal node, measured) merged in, at
    most ``budget`` nodes in all: the drafter keeps its first ``m`` nodes for the largest ``m``
    that fits, a suffix node equal to a drafter node costs nothing."""
    chosen = sorted(offer.above(threshold, limit)[:budget]) if offer is not None else []
    if offer is None or not chosen:
        return Sourced(drafter, [DraftSource(0)] + [DraftSource.DRAFTER] * len(drafter.tokens), {})
    n_d = len(drafter.tokens)
    gain = suffix_gain(offer, threshold, limit, budget)
    for m in range(min(n_d, budget), -1, -1):
        merged = _merge(_prefix(drafter, m), offer, chosen)
        if len(merged.tree.tokens) <= budget:
            return dataclasses.replace(merged, gain=gain)
    raise AssertionError("unreachable: m = 0 keeps at most budget suffix nodes")


def _prefix(tree: DraftTree, m: int) -> DraftTree:
    """The first ``m`` nodes of a pop-ordered tree (prefix-closed: parents come first)."""
    return DraftTree(tokens=tree.tokens[:m], parents=tree.parents[:m + 1], depths=tree.depths[:m + 1])


def _merge(drafter: DraftTree | None, offer: SuffixOffer, chosen: list[int]) -> Sourced:
    """``drafter``'s nodes, then the ``chosen`` trie nodes (ascending, so parents first; a
    prefix-closed set) not already there."""
    tokens = list(drafter.tokens) if drafter else []
    parents = list(drafter.parents) if drafter else [-1]
    depths = list(drafter.depths) if drafter else [0]
    sources = [DraftSource(0)] + [DraftSource.DRAFTER] * len(tokens)
    children: list[dict[int, int]] = [{} for _ in parents]
    for j in range(len(tokens), 0, -1):         # the first of equal siblings is the walk's
        children[parents[j]][tokens[j - 1]] = j
    where = {0: 0}                              # trie node -> block index
    trie_nodes: dict[int, int] = {}
    trie = offer.trie
    for t in chosen:
        parent = where[trie.parents[t]]
        tok = trie.tokens[t - 1]
        found = children[parent].get(tok)
        if found is None:
            tokens.append(tok)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            sources.append(DraftSource(0))
            children.append({})
            found = len(tokens)
            children[parent][tok] = found
        j = found
        sources[j] |= DraftSource.SUFFIX
        where[t] = j
        trie_nodes[j] = t
    return Sourced(DraftTree(tokens=tokens, parents=parents, depths=depths), sources, trie_nodes)


def observe_walk(calibration: SuffixCalibration, offer: SuffixOffer, sourced: Sourced,
                 path: Sequence[int]) -> None:
    """Teach ``calibration`` one verified tree's suffix candidates: every suffix node whose
    parent the walk reached (the root, or a node of ``path``) was offered, and accepted iff it
    is on ``path``."""
    reached = {0, *path}
    for j, t in sourced.trie_nodes.items():
        if sourced.tree.parents[j] in reached:
            p = offer.trie.parents[t]
            calibration.observe(node_cell(offer.trie, t), offer.trie.counts[t] / offer.trie.counts[p],
                                j in reached, offer.rates)


class AnswerStore:
    """Recent answers, per tenant, in a few segment indexes.

    Args:
        max_tokens: tokens kept per tenant (0 disables the store).
        max_total: tokens kept over all tenants (least recently used tenants dropped first).
        segments: a tenant's answers fill segments of ``max_tokens / segments`` tokens, answers
            separated by :data:`dflash.core.suffix.SEPARATOR`; past ``max_tokens`` the oldest
            segment goes. A lookup reads ``segments + 1`` indexes at most, whatever the number
            of answers (one index per answer cost ~3 us each per step).

        corpus: the operator's read-only corpus (``verifier_svc.suffix_corpus``), read by every
            tenant after its own answers; None: none.

    A tenant (the gateway's client identity: the API key's name, else the peer's address) sees
    only its own answers: another tenant's text never becomes its candidate, and its lookups
    never read another's entries. The scheduler thread adds and reads; metrics read the sizes.
    """

    def __init__(self, max_tokens: int = 16384, max_total: int = 262144, segments: int = 4,
                 corpus: SuffixIndex | None = None):
        if min(max_tokens, max_total) < 0 or segments < 1:
            raise ValueError("suffix answer store bounds must be >= 0 (segments >= 1)")
        self.max_tokens, self.max_total = max_tokens, max_total
        self.corpus = corpus if corpus is not None and len(corpus) else None
        self._corpus_bytes = self.corpus.nbytes if self.corpus is not None else 0
        self.segment_tokens = max(1, max_tokens // segments)
        self._tenants: OrderedDict[str, list[SuffixIndex]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def corpus_tokens(self) -> int:
        return len(self.corpus) if self.corpus is not None else 0

    @property
    def nbytes(self) -> int:
        """Approximate bytes of the tenants' answers and the corpus."""
        with self._lock:
            return self._corpus_bytes + sum(ix.nbytes for segs in self._tenants.values() for ix in segs)

    def add(self, tenant: str, answer: Sequence[int]) -> None:
        """Keep ``answer`` (token ids) for ``tenant``'s later lookups."""
        if not self.max_tokens or len(answer) < 2:
            return
        answer = list(answer[-self.segment_tokens:])
        with self._lock:
            segs = self._tenants.pop(tenant, [])
            self._tenants[tenant] = segs               # most recently used last
            if segs and len(segs[-1]) + 1 + len(answer) <= self.segment_tokens:
                segs[-1].extend([SEPARATOR, *answer])
                self._tokens += 1 + len(answer)
            else:
                segs.append(SuffixIndex(answer))
                self._tokens += len(answer)
            held = sum(len(ix) for ix in segs)
            while held > self.max_tokens and len(segs) > 1:
                old = segs.pop(0)
                held -= len(old)
                self._tokens -= len(old)
            while self._tokens > self.max_total and self._tenants:
                name, drop = next(iter(self._tenants.items()))
                del self._tenants[name]
                self._tokens -= sum(len(ix) for ix in drop)

    def indexes(self, tenant: str) -> list[SuffixIndex]:
        """``tenant``'s segment indexes, then the corpus (a new list: ``build_trie`` prefers
        the earlier indexes' occurrences when the trie fills)."""
        with self._lock:
            own = list(self._tenants.get(tenant, ()))
        return own + [self.corpus] if self.corpus is not None else own


def offer_for(index: SuffixIndex, answers: Sequence[SuffixIndex], depth: int,
              calibration: SuffixCalibration, rates: SessionRates | None) -> SuffixOffer | None:
    """The offer after ``index``'s end (the session's stream, anchor last) from itself and the
    tenant's ``answers``; None when nothing matched."""
    if depth < 1 or not index.tokens:
        return None
    tail = index.tokens[-MAX_MATCH - 1:]
    trie = build_trie(tail, [(index, True)] + [(a, False) for a in answers], depth)
    if not trie.tokens:
        return None
    return SuffixOffer.build(trie, calibration, rates)
