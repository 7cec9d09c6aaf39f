"""Suffix drafts in the verifier: each session's index, the tenant's recent answers, calibrated
candidate probabilities, and the trees they become (alone, or merged into a drafter's DDTree).

* :class:`SuffixOffer`: one step's candidates for one session (``dflash.core.suffix.build_trie``
  over the session's own stream and its tenant's recent answers), each node with ``probs[j]``,
  the estimated probability that the target's walk reaches it::

      probs[j] = probs[parent] * counts[j] / counts[parent] * rate(match bucket, depth j)

  the frequency score (SuffixDecoding) times a measured conditional acceptance
  (:class:`SuffixCalibration`), so the sum of a tree's probabilities plus one is its expected
  committed tokens, the figure the speculation policy trades against verify cost.
* :func:`suffix_tree`: the ``n`` most probable nodes as a tree (mode ``suffix``; the fallback
  when a drafter fails).
* :func:`hybrid_tree`: a drafter's DDTree and the suffix nodes worth more than the drafter's
  marginal node, under one node budget, shared prefixes merged (mode ``hybrid``; adaptive's
  trees).
* :class:`AnswerStore`: recent answers per tenant (bounded in tokens, least recently used
  tenants dropped first); a tenant's lookups read only its own answers.

Sources of a tree's nodes (``sources[j]`` per block index): :data:`DRAFTER`, :data:`SUFFIX` or
both; a node both proposed counts as the drafter's in the per-source statistics (``suffix``
counts what only the suffix index added).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence

from dflash.core.suffix import MAX_MATCH, SuffixIndex, SuffixTrie, build_trie
from verifier_svc.tree import DraftTree

__all__ = ["DRAFTER", "SUFFIX", "SuffixCalibration", "SessionRates", "SuffixOffer", "AnswerStore",
           "suffix_tree", "hybrid_tree", "match_bucket", "Sourced"]

DRAFTER = 1
SUFFIX = 2
#: Upper ends of the match-length buckets (tokens): 1, 2, 3-4, 5-8, 9-16.
MATCH_BUCKETS = (1, 2, 4, 8, MAX_MATCH)
#: Conditional acceptance per bucket before anything is measured: short matches are guesses,
#: long ones copies.
PRIOR_RATES = (0.3, 0.45, 0.6, 0.75, 0.85)
MAX_DEPTH = 16                  # depths beyond share the last cell
PRIOR_WEIGHT = 4.0              # pseudo-observations of the prior (global) and of the global
                                # rate in a session's own estimate
GLOBAL_WINDOW = 400.0           # the global sums are halved past this many offers per cell


def match_bucket(match: int) -> int:
    for b, hi in enumerate(MATCH_BUCKETS):
        if match <= hi:
            return b
    return len(MATCH_BUCKETS) - 1


class SessionRates:
    """One session's own suffix outcomes: (bucket, depth) -> [accepted, offered]."""

    def __init__(self) -> None:
        self.cells: dict[tuple[int, int], list[float]] = {}


class SuffixCalibration:
    """Conditional acceptance of suffix candidates by (match bucket, depth): the chance the
    target takes a candidate, per unit of its frequency score, once the walk reached its parent.
    Verifier-wide sums (a window of recent offers) are the prior of each session's own
    (:class:`SessionRates`), so a session whose text copies well is trusted more and one whose
    matches keep failing is asked less."""

    def __init__(self) -> None:
        self._acc = [[PRIOR_RATES[b] * PRIOR_WEIGHT] * MAX_DEPTH for b in range(len(MATCH_BUCKETS))]
        self._off = [[PRIOR_WEIGHT] * MAX_DEPTH for _ in MATCH_BUCKETS]

    def rate(self, b: int, depth: int, own: SessionRates | None) -> float:
        d = min(depth, MAX_DEPTH) - 1
        g = self._acc[b][d] / self._off[b][d]
        cell = own.cells.get((b, d)) if own is not None else None
        if cell is None:
            return g
        return (cell[0] + PRIOR_WEIGHT * g) / (cell[1] + PRIOR_WEIGHT)

    def observe(self, b: int, depth: int, offered: float, accepted: bool, own: SessionRates | None
                ) -> None:
        """A candidate of frequency score ``offered`` (given its parent) at ``depth`` whose
        parent the walk reached, and whether the walk took it."""
        d = min(depth, MAX_DEPTH) - 1
        self._acc[b][d] += float(accepted)
        self._off[b][d] += offered
        if self._off[b][d] > GLOBAL_WINDOW:
            self._acc[b][d] *= 0.5
            self._off[b][d] *= 0.5
        if own is not None:
            cell = own.cells.setdefault((b, d), [0.0, 0.0])
            cell[0] += float(accepted)
            cell[1] += offered

    def table(self) -> list[list[float]]:
        """Per bucket, per depth: the verifier-wide conditional rate (a copy, for metrics)."""
        return [[a / o for a, o in zip(acc, off)] for acc, off in zip(self._acc, self._off)]


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
        b = match_bucket(trie.match)
        depths = trie.depths
        probs = [1.0] * len(trie.parents)
        for j in range(1, len(trie.parents)):
            p = trie.parents[j]
            probs[j] = probs[p] * trie.counts[j] / trie.counts[p] * calibration.rate(b, depths[j], rates)
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
    sources: list[int]
    trie_nodes: dict[int, int]

    def suffix_only(self, path: Sequence[int]) -> int:
        """Accepted nodes of ``path`` (block indices) that only the suffix index proposed."""
        return sum(1 for j in path if self.sources[j] == SUFFIX)

    @property
    def suffix_nodes(self) -> int:
        return sum(1 for s in self.sources[1:] if s & SUFFIX)

    def drafter_prefix(self, path: Sequence[int]) -> int:
        """Accepted path nodes before the first node only the suffix index proposed: what the
        drafter's own tree would have committed of this path."""
        n = 0
        for j in path:
            if self.sources[j] == SUFFIX:
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


def hybrid_tree(drafter: DraftTree, offer: SuffixOffer | None, budget: int, threshold: float,
                limit: int) -> Sourced:
    """The drafter's tree ``drafter`` (pop order, at most ``budget`` nodes) with ``offer``'s
    nodes worth more than ``threshold`` (the drafter's marginal node, measured) merged in, at
    most ``budget`` nodes in all: the drafter keeps its first ``m`` nodes for the largest ``m``
    that fits, a suffix node equal to a drafter node costs nothing."""
    chosen = sorted(offer.above(threshold, limit)[:budget]) if offer is not None else []
    if offer is None or not chosen:
        return Sourced(drafter, [0] + [DRAFTER] * len(drafter.tokens), {})
    n_d = len(drafter.tokens)
    for m in range(min(n_d, budget), -1, -1):
        merged = _merge(_prefix(drafter, m), offer, chosen)
        if len(merged.tree.tokens) <= budget:
            return merged
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
    sources = [0] + [DRAFTER] * len(tokens)
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
            sources.append(0)
            children.append({})
            found = len(tokens)
            children[parent][tok] = found
        j = found
        sources[j] |= SUFFIX
        where[t] = j
        trie_nodes[j] = t
    return Sourced(DraftTree(tokens=tokens, parents=parents, depths=depths), sources, trie_nodes)


def observe_walk(calibration: SuffixCalibration, offer: SuffixOffer, sourced: Sourced,
                 path: Sequence[int]) -> None:
    """Teach ``calibration`` one verified tree's suffix candidates: every suffix node whose
    parent the walk reached (the root, or a node of ``path``) was offered at its frequency
    score given its parent, and accepted iff it is on ``path``."""
    reached = {0, *path}
    trie, b = offer.trie, match_bucket(offer.trie.match)
    depths = sourced.tree.depths
    for j, t in sourced.trie_nodes.items():
        if sourced.tree.parents[j] not in reached:
            continue
        p = trie.parents[t]
        calibration.observe(b, depths[j], trie.counts[t] / trie.counts[p], j in reached,
                            offer.rates)


class AnswerStore:
    """Recent answers, one list per tenant, each answer indexed on its own.

    Args:
        max_tokens: tokens kept per tenant (oldest answers dropped first; 0 disables the store).
        max_total: tokens kept over all tenants (least recently used tenants dropped first).
        max_answers: answers kept per tenant (bounds a lookup: each answer is a few dict reads).

    A tenant (the gateway's client identity: the API key's name, else the peer's address) sees
    only its own answers: another tenant's text never becomes its candidate, and its lookups
    never read another's entries. Thread-safe (the scheduler thread adds and reads; metrics
    read the sizes).
    """

    def __init__(self, max_tokens: int = 16384, max_total: int = 262144, max_answers: int = 64):
        if min(max_tokens, max_total, max_answers) < 0:
            raise ValueError("suffix answer store bounds must be >= 0")
        self.max_tokens, self.max_total, self.max_answers = max_tokens, max_total, max_answers
        self._tenants: OrderedDict[str, list[SuffixIndex]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(ix.nbytes for answers in self._tenants.values() for ix in answers)

    def add(self, tenant: str, answer: Sequence[int]) -> None:
        """Keep ``answer`` (token ids) for ``tenant``'s later lookups."""
        if not self.max_tokens or len(answer) < 2:
            return
        ix = SuffixIndex(answer[-self.max_tokens:])
        with self._lock:
            answers = self._tenants.pop(tenant, [])
            answers.append(ix)
            self._tenants[tenant] = answers            # most recently used last
            self._tokens += len(ix)
            held = sum(len(a) for a in answers)
            while answers and (held > self.max_tokens or len(answers) > self.max_answers):
                old = answers.pop(0)
                held -= len(old)
                self._tokens -= len(old)
            while self._tokens > self.max_total and self._tenants:
                name, drop = next(iter(self._tenants.items()))
                del self._tenants[name]
                self._tokens -= sum(len(a) for a in drop)

    def indexes(self, tenant: str) -> list[SuffixIndex]:
        """``tenant``'s answers (a copy of the list; the indexes are never changed once stored)."""
        with self._lock:
            return list(self._tenants.get(tenant, ()))


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
