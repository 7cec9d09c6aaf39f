"""Tree verification (DDTree): the draft tree, its construction, and the walk that verifies it.

Source: Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft Trees"
(arXiv 2604.12989), reference code liranringel/ddtree (``build_ddtree_tree``). One DFlash
forward gives a distribution at every block position; instead of keeping only the top token of
each (a chain), :func:`build_tree` keeps the ``budget`` most likely *prefixes* under the
factorised drafter distribution, which form a tree rooted at the anchor (bonus) token. The target
verifies every node in one forward under :func:`ancestor_mask` (each node sees the context and its
own root-to-node path, at position ``start + depth``), and :func:`verify_trees` walks the tree.

Block indexing, used throughout: the verified block is ``[anchor] + tree.tokens``; block index 0
is the root (the anchor), block index ``j >= 1`` is node ``tree.tokens[j - 1]``.

The walk (DDTree's verification): at block index ``j`` the target makes its own choice ``t_j``
(greedy: ``argmax(logits[j])``; sampled: one draw from ``probs_from_logits(logits[j])``); if a
child of ``j`` carries ``t_j`` the walk moves to it, else it stops and ``t_j`` is the bonus token.

Why the sampled walk is lossless. The candidates at a node are chosen deterministically from the
drafter's top-k (nothing is sampled from the drafter), so each child ``x_i`` is a proposal with a
point-mass distribution ``delta(x_i)``. Multi-candidate (recursive) rejection sampling over the
children -- SpecInfer (Miao et al., ASPLOS 2024, multi-step speculative sampling) and Sequoia
(Chen et al. 2024, sampling without replacement) -- accepts ``x_i`` with probability
``min(1, r(x_i) / delta(x_i)(x_i)) = r(x_i)`` where ``r`` starts as the target's ``p`` and, after a
rejection, becomes ``norm(max(r - delta(x_i), 0))``: ``r`` with ``x_i`` removed and
renormalised. Telescoping, child ``x_i`` is accepted with probability exactly ``p(x_i)``, and
when every child is rejected the bonus token comes from ``p`` restricted to the other tokens, so
each token ``y`` is emitted with probability ``p(y)`` -- which is exactly "draw ``t ~ p``, move to
the child carrying ``t`` if any". Each visited node draws fresh numbers and its ``p`` is the
target's distribution given the path so far (the tree forward gives each node the logits of its
own path), and the tree's shape depends only on the drafter, so by induction the emitted sequence
is distributed exactly as the target's own sampling (temperature, top-k, top-p as processed by
:func:`dflash.core.sampling.probs_from_logits`); greedy is the same walk with ``t_j = argmax``. No
drafter probabilities are needed, unlike chain rejection sampling (Leviathan et al. 2023).
A seeded row draws with the noise of the sequence index it fills
(:func:`dflash.core.sampling.position_noise`): same law, and the token decoding without
speculation would have chosen there, whatever the tree.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from dflash.core.sampling import coupled_choice, position_noise, probs_from_logits, sample_from
from dflash.core.speculation import MAX_TREE_BUDGET  # nodes per tree (root not counted)
from verifier_svc.verification import RowParams, Verified, commit_cut

__all__ = ["MAX_TREE_BUDGET", "DraftTree", "TreeVerified", "build_tree", "ancestor_mask",
           "verify_trees"]



@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A draft tree over the block ``[anchor] + tokens`` (see the module docstring's indexing).

    ``tokens``: the n node tokens in best-first pop order (every parent before its children);
    ``parents``: len n + 1, ``parents[0] = -1`` (the root), ``0 <= parents[j] < j`` the block index
    of node j's parent; ``depths``: len n + 1, ``depths[0] = 0``, ``depths[j] = depths[parents[j]]
    + 1`` (the target's position id of block index j is ``start + depths[j]``).

    Raises:
        ValueError: naming the field, when the lists do not describe such a tree.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def __post_init__(self):
        n = len(self.tokens)
        check_tree(self.parents, n, "parents")
        if len(self.depths) != n + 1 or self.depths[0] != 0:
            raise ValueError(f"depths: expected {n + 1} entries starting with 0, got "
                             f"{self.depths[:4]}... ({len(self.depths)})")
        for j in range(1, n + 1):
            if self.depths[j] != self.depths[self.parents[j]] + 1:
                raise ValueError(f"depths[{j}] = {self.depths[j]}, but its parent "
                                 f"{self.parents[j]} has depth {self.depths[self.parents[j]]}")

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0 for a tree without nodes): the positions offered."""
        return max(self.depths)

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        """The chain ``anchor -> tokens[0] -> tokens[1] -> ...`` as a tree."""
        k = len(tokens)
        return DraftTree(tokens=list(tokens), parents=list(range(-1, k)), depths=list(range(k + 1)))


def build_tree(top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree's best-first tree: the ``budget`` highest-scoring prefixes of the drafter's top-k.

    Args:
        top_ids: integer (int64) ``[L, K]``; row d holds the drafter's K most likely tokens at
            block position d + 1, most likely first.
        top_logprobs: float (float32) ``[L, K]``; their log-probabilities, each row
            non-increasing. Values above 0 (rounding in a log-softmax) count as 0 so that a
            child never outscores its parent.
        budget: the most nodes the tree may have (root not counted), ``1..MAX_TREE_BUDGET``.

    Returns:
        The tree of the ``min(budget, #prefixes)`` best prefixes of length 1..L, where a prefix
        choosing rank ``r_d`` at depth d scores ``sum_d top_logprobs[d - 1, r_d]`` (summed from
        depth 1 down, in Python floats). Nodes are in pop order: score descending, ties broken
        by the rank tuple ``(r_1, ..., r_d)`` in lexicographic order (a prefix of a tuple comes
        before it), so the result is one deterministic function of the inputs.

    Method (liranringel/ddtree ``build_ddtree_tree``): a heap starts with rank 0 at depth 1; each
    pop adds a node and pushes its next-rank sibling and its rank-0 child (if depth < L). Every
    prefix is pushed only by its predecessor (the sibling one rank better, or its parent for rank
    0), which scores at least as much and sorts before it on ties, so the pops come in exactly
    the order above and the tree is prefix-closed. Only the first ``min(K, budget)`` columns can
    be used (rank r needs r better siblings in the tree), so the rest are never read.

    Raises:
        ValueError: naming the argument, for tensors that are not 2-D of one shape with L, K >= 1,
            ids that are not integers, log-probs that are not floating, NaN or +inf, rows not
            sorted descending, or a budget that is not an int in ``1..MAX_TREE_BUDGET``.
    """
    ids, lp = _usable_tops(top_ids, top_logprobs, budget)
    depth_limit, k = len(ids), len(ids[0])
    tokens: list[int] = []
    parents: list[int] = [-1]
    depths: list[int] = [0]
    # Entries: (-score, rank tuple, depth, rank, parent block index, parent score). Rank tuples
    # are unique, so comparisons never reach the non-key fields.
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-lp[0][0], (0,), 1, 0, 0, 0.0)]
    while heap and len(tokens) < budget:
        neg, ranks, d, r, parent, parent_score = heapq.heappop(heap)
        tokens.append(ids[d - 1][r])
        parents.append(parent)
        depths.append(d)
        node = len(tokens)              # this node's block index
        if r + 1 < k:
            s = parent_score + lp[d - 1][r + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (r + 1,), d, r + 1, parent, parent_score))
        if d < depth_limit:
            s = -neg + lp[d][0]
            heapq.heappush(heap, (-s, ranks + (0,), d + 1, 0, node, -neg))
    return DraftTree(tokens=tokens, parents=parents, depths=depths)


def _usable_tops(top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int
                 ) -> tuple[list[list[int]], list[list[float]]]:
    """:func:`build_tree`'s arguments checked (the ValueErrors its docstring lists), and the
    columns it can use, ``[L, min(K, budget)]``, as Python lists: the ids, and the log-probs as
    float32 values read as Python floats with those above 0 counted as 0."""
    if isinstance(budget, bool) or not isinstance(budget, int) \
            or not 1 <= budget <= MAX_TREE_BUDGET:
        raise ValueError(f"budget: must be an int in [1, {MAX_TREE_BUDGET}], got {budget!r}")
    if top_ids.dim() != 2 or top_ids.dtype.is_floating_point or top_ids.dtype == torch.bool:
        raise ValueError(f"top_ids: expected a 2-D integer tensor [L, K], got {top_ids.dtype} "
                         f"{tuple(top_ids.shape)}")
    if top_logprobs.dim() != 2 or not top_logprobs.dtype.is_floating_point:
        raise ValueError(f"top_logprobs: expected a 2-D float tensor [L, K], got "
                         f"{top_logprobs.dtype} {tuple(top_logprobs.shape)}")
    if top_ids.shape != top_logprobs.shape or top_ids.shape[0] < 1 or top_ids.shape[1] < 1:
        raise ValueError(f"top_logprobs: shape {tuple(top_logprobs.shape)} must equal top_ids' "
                         f"{tuple(top_ids.shape)}, with L >= 1 and K >= 1")
    k = min(top_ids.shape[1], budget)
    lp_t = top_logprobs[:, :k].float()
    # ``<=`` is False against NaN, so this also finds a NaN anywhere but column 0 (checked below).
    if k > 1 and not bool((lp_t[:, 1:] <= lp_t[:, :-1]).all()):
        raise ValueError("top_logprobs: each row must be sorted descending, without NaN")
    ids = top_ids[:, :k].tolist()
    lp = lp_t.tolist()
    for d, row in enumerate(lp):
        if not -math.inf <= row[0] < math.inf:
            raise ValueError(f"top_logprobs: row {d} starts with {row[0]} (NaN or +inf)")
        if row[0] > 0.0:                 # sorted: only a row's first values can be above 0
            lp[d] = [min(v, 0.0) for v in row]
    return ids, lp


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """The tree's visibility: bool ``[n + 1, n + 1]``, ``[i, j]`` True when block index j is i
    or an ancestor of i (DDTree's ancestor-only attention inside the tree; the context columns
    are the caller's).

    Raises:
        ValueError: naming ``parents`` when it is not a tree (``parents[0] = -1``,
            ``0 <= parents[j] < j``).
    """
    n = len(parents) - 1
    check_tree(parents, n, "parents")
    size = n + 1
    flat: list[int] = []
    ancestors: list[list[int]] = []     # per block index: itself and its ancestors
    for j, p in enumerate(parents):
        row = ([j] + ancestors[p]) if p >= 0 else [j]
        ancestors.append(row)
        flat.extend(j * size + a for a in row)
    mask = torch.zeros(size * size, dtype=torch.bool)
    mask[torch.tensor(flat, dtype=torch.int64)] = True
    return mask.view(size, size)


@dataclasses.dataclass(frozen=True)
class TreeVerified(Verified):
    """What one tree row commits: :class:`~verifier_svc.verification.Verified` plus the path.

    ``tokens``: the accepted nodes' tokens then the bonus token, cut at stops / room exactly as
    ``verify_batch`` (:func:`~verifier_svc.verification.commit_cut`); ``accepted``: accepted
    nodes among the committed tokens; ``drafted``: ``tree.max_depth`` (positions offered: depth d
    counts as accepted iff the path reaches it, so per-position rates compare with chains);
    ``path``: block indices of the accepted nodes, increasing, root excluded, cut with the tokens
    (``len(path) == accepted``); ``nodes``: the tree's node count n.
    """

    path: list[int]
    nodes: int


def verify_trees(trees: list[DraftTree], logits: list[torch.Tensor], params: list[RowParams]
                 ) -> list[TreeVerified]:
    """Walk every row's tree against the target's logits (module docstring: method, proof).

    Args:
        trees: one :class:`DraftTree` per row (n_i nodes).
        logits: float (float32 from the target) ``[n_i + 1, V]`` per row, V common; row j is the
            target's logits after block index j given that node's own root-to-node path (after
            the request's penalties and logit bias, with that path's tokens counted: the
            engine applies them, ``dflash.core.logits_processors``).
        params: one :class:`RowParams` per row (sampling, generator, stops, room).

    Returns:
        One :class:`TreeVerified` per row, in row order.

    Choice at a visited block index j: greedy rows take ``argmax(logits[j])`` (first index on
    ties, as ``kernels.greedy_accept``) and draw nothing; seeded rows take
    ``coupled_choice(p, position_noise(seed, position + depth))`` (the noise of the sequence
    index the node's child fills, so the output is the one without speculation) and draw
    nothing either; unseeded sampled rows draw one token with
    :func:`dflash.core.sampling.sample_from` from ``probs_from_logits(logits[j], sampling)`` moved to
    the generator's device, one draw (Exp(1) noise ``[V]``) per visited node, in walk order,
    rows in order, so a generator shared by rows is consumed as by a loop over them. If siblings carry the same token the first (lowest block
    index) is taken.

    Raises:
        ValueError: naming the argument, when the lists differ in length, an element has the
            wrong type, or a row's logits are not ``[n_i + 1, V]`` with the common V.
    """
    n_rows = len(trees)
    for name, seq in (("logits", logits), ("params", params)):
        if len(seq) != n_rows:
            raise ValueError(f"{name}: {len(seq)} rows, but trees has {n_rows}")
    vocab = None
    for i, (tree, lg, par) in enumerate(zip(trees, logits, params)):
        if not isinstance(tree, DraftTree):
            raise ValueError(f"trees[{i}]: expected DraftTree, got {type(tree).__name__}")
        if not isinstance(par, RowParams):
            raise ValueError(f"params[{i}]: expected RowParams, got {type(par).__name__}")
        rows = len(tree.tokens) + 1
        if lg.dim() != 2 or lg.shape[0] != rows:
            raise ValueError(f"logits[{i}]: expected [n + 1 = {rows}, V], got {tuple(lg.shape)}")
        if vocab is None:
            vocab = lg.shape[1]
        elif lg.shape[1] != vocab:
            raise ValueError(f"logits[{i}]: vocab size {lg.shape[1]} != {vocab} of row 0")
    return [_walk(tree, lg, par) for tree, lg, par in zip(trees, logits, params)]


def _walk(tree: DraftTree, logits: torch.Tensor, par: RowParams) -> TreeVerified:
    """One row's walk from the root, then the commit cut."""
    children: list[dict[int, int]] = [{} for _ in tree.parents]
    for j in range(len(tree.tokens), 0, -1):   # backwards: the first of equal siblings wins
        children[tree.parents[j]][tree.tokens[j - 1]] = j
    if par.sampling.greedy:
        def choose(j: int) -> int:
            # Per visited node, not all n + 1 rows at once: a walk visits few of a wide tree's
            # rows, and each row is a reduction over the whole vocabulary.
            return int(logits[j].argmax())
    elif par.coupled:
        seed = par.sampling.seed
        assert seed is not None                 # coupled = seeded
        depth = [0] * len(tree.parents)
        for j in range(1, len(tree.parents)):
            depth[j] = depth[tree.parents[j]] + 1

        def choose(j: int) -> int:
            # keyed by the sequence index the choice fills: the output is the one without drafts
            e = position_noise(seed, [par.position + depth[j]], logits.shape[-1], logits.device)
            return int(coupled_choice(probs_from_logits(logits[j], par.sampling), e[0]))
    else:
        gen = par.generator
        assert gen is not None                  # RowParams requires one for an unseeded row

        def choose(j: int) -> int:
            p = probs_from_logits(logits[j], par.sampling).to(gen.device)
            return int(sample_from(p, gen))

    path: list[int] = []
    j = 0
    while True:
        t = choose(j)
        nxt = children[j].get(t)
        if nxt is None:
            break
        path.append(nxt)
        j = nxt
    new = [tree.tokens[c - 1] for c in path] + [t]
    new, accepted, finish = commit_cut(new, len(path), par)
    return TreeVerified(tokens=new, accepted=accepted, drafted=tree.max_depth, finish=finish,
                        path=path[:accepted], nodes=len(tree.tokens))


def check_tree(parents: list[int], n: int, name: str) -> None:
    """Raise ValueError naming ``name`` unless ``parents`` is a tree over a block of ``n``
    nodes plus the root: ``n + 1`` entries, ``parents[0] == -1``, ``0 <= parents[j] < j``."""
    if len(parents) != n + 1 or parents[0] != -1:
        raise ValueError(f"{name}: expected {n + 1} entries starting with -1, got "
                         f"{list(parents[:4])}... ({len(parents)})")
    for j in range(1, n + 1):
        if not 0 <= parents[j] < j:
            raise ValueError(f"{name}[{j}] = {parents[j]}: must be a block index in [0, {j})")
