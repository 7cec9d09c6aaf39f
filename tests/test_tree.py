"""verifier_svc.tree: DDTree construction, the ancestor mask and the tree walk (greedy, sampled).

References used below, all written here from their definitions:

* construction: every prefix of ranks (r_1..r_d), d <= L, r < K enumerated and sorted by score
  (the sum of its per-depth log-probs) then rank tuple; the tree is the first ``budget``;
* the target: :class:`PathTarget`, whose logits after a token sequence are a fixed random
  function of the whole sequence, so a node's logits depend on its own path (as the tree forward
  gives them) and greedy decoding / the exact distribution of sampled decoding are computable;
* chains: ``verification.verify_batch`` on the same drafts and logits.

Sampled walk, lossless: Pearson's chi-square goodness of fit of the first TWO emitted tokens
(decode steps are repeated until two tokens are out) against their exact joint distribution
``p(t1 | ctx) * p(t2 | ctx, t1)`` under ``probs_from_logits``; cells whose expected count is
below 5 are pooled into one (the usual validity condition of the chi-square approximation).
Power (:func:`required_draws`, asserted): the alternative moves BIAS = 2 percentage points of
probability between the two most likely cells (the hardest 2-point shift to see: it has the
smallest noncentrality); its noncentrality is ``N * BIAS**2 * (1/P_a + 1/P_b)``, and N must make
``P(ncx2(df, lam) > chi2.isf(ALPHA, df)) >= POWER`` (ALPHA = 1e-3, POWER = 0.9). For the five
settings (df 8 to 35 after pooling) that is N = 5,277 to 7,489 draws; each setting gets 8,000.
Three deliberately wrong walks fail the same test, one of them moving only ~2 points of the
first token's mass. Everything is seeded: the test is deterministic, ALPHA only says how
unlikely a correct walk would be to fail with an unlucky choice of seeds.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
import torch
from scipy import stats
from scipy.optimize import brentq

from dflash.core.sampling import Sampling, coupled_choice, exp_noise, position_noise, probs_from_logits
from verifier_svc.tree import MAX_TREE_BUDGET, DraftTree, TreeVerified, ancestor_mask, build_tree, verify_trees
from verifier_svc.verification import RowParams, commit_cut, verify_batch

ALPHA = 1e-3
POWER = 0.9
BIAS = 0.02
GREEDY = Sampling()


# ------------------------------------------------------------------------------------ helpers

def random_topk(rng: random.Random, depth: int, k: int, vocab: int, ties: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's top-k per block position: ids int64 [depth, k], log-probs float32 [depth, k]
    from a log-softmax over ``vocab`` (>= k). ``ties`` rounds the logits (many equal scores);
    some vocab entries may be -inf so that top-k reaches -inf log-probs."""
    gen = torch.Generator().manual_seed(rng.randrange(2**62))
    logits = torch.randn((depth, vocab), generator=gen) * rng.choice([0.5, 2.0, 5.0])
    if ties:
        logits = logits.round()
    if rng.random() < 0.2 and vocab > 1:
        logits[:, rng.randrange(vocab)] = -math.inf
    lp, ids = logits.log_softmax(-1).topk(k, dim=-1)
    return ids, lp


def brute_force_tree(top_ids: torch.Tensor, top_logprobs: torch.Tensor, budget: int) -> DraftTree:
    """Every prefix enumerated, scored (summed from depth 1 down), sorted, the best kept."""
    depth, k = top_ids.shape
    lp, ids = top_logprobs.tolist(), top_ids.tolist()
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = 0.0
            for level, r in enumerate(ranks):
                s = s + lp[level][r]
            scored.append((-s, ranks))
    scored.sort()
    chosen = [ranks for _, ranks in scored[:budget]]
    index = {(): 0}
    tokens, parents, depths = [], [-1], [0]
    for j, ranks in enumerate(chosen, start=1):
        index[ranks] = j
        tokens.append(ids[len(ranks) - 1][ranks[-1]])
        parents.append(index[ranks[:-1]])   # KeyError if the top-`budget` were not prefix-closed
        depths.append(len(ranks))
    return DraftTree(tokens=tokens, parents=parents, depths=depths)


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Per block index, the tokens from the root (excluded) down to it."""
    paths: list[tuple[int, ...]] = [()]
    for j in range(1, len(tree.parents)):
        paths.append(paths[tree.parents[j]] + (tree.tokens[j - 1],))
    return paths


class PathTarget:
    """Next-token logits float32 [V] after a sequence: a fixed random function of the sequence."""

    def __init__(self, vocab: int, seed: int, scale: float):
        self.vocab, self.seed, self.scale = vocab, seed, scale
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, seq: tuple[int, ...]) -> torch.Tensor:
        if seq not in self._memo:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, seq)).encode()))
            self._memo[seq] = torch.randn(self.vocab, generator=g) * self.scale
        return self._memo[seq]

    def tree_logits(self, context: tuple[int, ...], tree: DraftTree) -> torch.Tensor:
        """[n + 1, V]: row j = logits after ``context`` (ending with the anchor) + node j's path."""
        return torch.stack([self.logits(context + p) for p in node_paths(tree)])

    def greedy(self, context: tuple[int, ...], n: int) -> list[int]:
        seq = context
        for _ in range(n):
            seq = seq + (int(self.logits(seq).argmax()),)
        return list(seq[len(context):])


def params(sampling: Sampling = GREEDY, gen: torch.Generator | None = None,
           stops: frozenset[int] = frozenset(), room: int = 1000, position: int = 0) -> RowParams:
    return RowParams(sampling=sampling, generator=gen, stops=stops, room=room, position=position)


def planted_topk(truth: list[int], ranks: list[int], k: int, vocab: int,
                 rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k whose depth-d row holds ``truth[d]`` at rank ``ranks[d]``, other ranks filled with
    other tokens; ``rows[d]`` are the (descending) probabilities of the ranks."""
    ids = []
    for d, (tok, r) in enumerate(zip(truth, ranks)):
        others = [t for t in range(vocab) if t != tok][d:d + k - 1]   # varied per depth
        ids.append(others[:r] + [tok] + others[r:])
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(rows).log()


# ------------------------------------------------------------------------------ construction

def test_build_tree_matches_brute_force():
    rng = random.Random(2024)
    seen_budgets, seen_short, seen_wide = set(), False, False
    for case in range(600):
        depth, k = rng.randint(1, 4), rng.randint(1, 4)
        budget = case % 32 + 1
        ids, lp = random_topk(rng, depth, k, rng.randint(k, 9), ties=rng.random() < 0.4)
        assert (lp <= 0).all()                 # log-probs: the brute force needs no clamp
        tree = build_tree(ids, lp, budget)
        expected = brute_force_tree(ids, lp, budget)
        assert tree == expected, (case, ids, lp, budget)

        n = len(tree.tokens)
        n_prefixes = sum(k ** d for d in range(1, depth + 1))
        assert n == min(budget, n_prefixes)
        assert tree.parents[0] == -1 and all(0 <= tree.parents[j] < j for j in range(1, n + 1))
        assert tree.depths[0] == 0
        assert all(tree.depths[j] == tree.depths[tree.parents[j]] + 1 for j in range(1, n + 1))
        assert max(tree.depths) <= depth and tree.max_depth == max(tree.depths)
        # prefix-closed, and nodes are distinct prefixes (as token paths: top-k ids are distinct)
        paths = node_paths(tree)
        assert len(set(paths)) == n + 1
        assert all(p[:-1] in set(paths) for p in paths[1:])
        # node j at depth d is top_ids[d - 1, r] for some r
        assert all(tree.tokens[j - 1] in ids[tree.depths[j] - 1].tolist() for j in range(1, n + 1))
        seen_budgets.add(budget)
        seen_short |= n < budget
        seen_wide |= k > budget
    assert seen_budgets == set(range(1, 33)) and seen_short and seen_wide


def test_build_tree_picks_the_best_scores():
    """The selected prefixes' scores are the `budget` best of all prefixes (rule-independent)."""
    rng = random.Random(7)
    for _ in range(100):
        depth, k, budget = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 40)
        ids, lp = random_topk(rng, depth, k, 12)
        tree = build_tree(ids, lp, budget)
        rows = lp.tolist()
        all_scores = sorted((sum(rows[d][r] for d, r in enumerate(ranks))
                             for d_max in range(1, depth + 1)
                             for ranks in itertools.product(range(k), repeat=d_max)),
                            reverse=True)
        idx = [{t: r for r, t in enumerate(row)} for row in ids.tolist()]
        got = []
        for p in node_paths(tree)[1:]:
            got.append(sum(rows[d][idx[d][t]] for d, t in enumerate(p)))
        assert sorted(got, reverse=True) == pytest.approx(all_scores[:len(got)], abs=1e-9)
        # best-first: pop order never increases the score
        assert all(a >= b - 1e-12 for a, b in zip(got, got[1:]))


def test_build_tree_small_cases():
    ids = torch.tensor([[5, 3, 9]])
    lp = torch.tensor([[0.6, 0.3, 0.1]]).log()
    # L = 1: the top-`budget` tokens, all children of the root
    assert build_tree(ids, lp, 2) == DraftTree(tokens=[5, 3], parents=[-1, 0, 0], depths=[0, 1, 1])
    # K smaller than the budget: every prefix, fewer nodes than the budget
    assert build_tree(ids, lp, 10) == DraftTree(tokens=[5, 3, 9], parents=[-1, 0, 0, 0],
                                                depths=[0, 1, 1, 1])
    # K = 1: a chain of the top tokens
    ids2, lp2 = torch.tensor([[4], [7], [1]]), torch.tensor([[-0.1], [-0.2], [-0.3]])
    assert build_tree(ids2, lp2, 64) == DraftTree.chain([4, 7, 1])
    assert build_tree(ids2, lp2, 2) == DraftTree.chain([4, 7])
    # by hand: 0.5, then 0.5*0.9 = 0.45 beats the sibling 0.3, then 0.3*0.9 = 0.27 beats
    # 0.5*0.1 = 0.05
    ids3 = torch.tensor([[10, 11], [20, 21]])
    lp3 = torch.tensor([[0.5, 0.3], [0.9, 0.1]]).log()
    assert build_tree(ids3, lp3, 4) == DraftTree(tokens=[10, 20, 11, 20], parents=[-1, 0, 1, 0, 3],
                                                 depths=[0, 1, 2, 1, 2])
    assert build_tree(ids3, lp3, 5).tokens == [10, 20, 11, 20, 21]
    # ties: the lexicographically smaller rank tuple first, a parent before its child
    ids4 = torch.tensor([[1, 2], [3, 4]])
    lp4 = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    assert build_tree(ids4, lp4, 6).tokens == [1, 3, 4, 2, 3, 4]
    assert build_tree(ids4, lp4, 6).parents == [-1, 0, 1, 1, 0, 4, 4]


def test_build_tree_clamps_positive_logprobs_and_accepts_other_dtypes():
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lp = torch.tensor([[0.3, 0.0], [0.2, -0.1]], dtype=torch.float64)
    tree = build_tree(ids, lp, 3)
    # scored as [0, 0], [0, -0.1]: (1,), (1, 3) and (2,) tie at 0 (unclamped, (1, 3) at 0.5 and
    # (1, 4) at 0.2 would both beat (2,) at 0)
    assert tree == DraftTree(tokens=[1, 3, 2], parents=[-1, 0, 1, 0], depths=[0, 1, 2, 1])
    assert all(isinstance(t, int) for t in tree.tokens)
    rng, g = random.Random(6), torch.Generator().manual_seed(6)
    for _ in range(200):
        depth, k = rng.randint(1, 4), rng.randint(1, 4)
        raw = torch.randn((depth, k), generator=g) + rng.choice([0.1, 0.5])
        raw = raw.sort(-1, descending=True).values
        ids = torch.arange(depth * k).view(depth, k)
        budget = rng.randint(1, 30)
        assert build_tree(ids, raw, budget) == brute_force_tree(ids, raw.clamp(max=0.0), budget)


def test_build_tree_ignores_columns_beyond_the_budget():
    rng = random.Random(3)
    ids, lp = random_topk(rng, 3, 8, 20)
    assert build_tree(ids, lp, 3) == build_tree(ids[:, :3], lp[:, :3], 3)


@pytest.mark.parametrize("args, name", [
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 3)), 0), "budget"),
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 3)), MAX_TREE_BUDGET + 1), "budget"),
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 3)), True), "budget"),
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 3)), 4.0), "budget"),
    ((torch.zeros(3, dtype=torch.int64), torch.zeros(3), 4), "top_ids"),
    ((torch.zeros((2, 3)), torch.zeros((2, 3)), 4), "top_ids"),
    ((torch.zeros((2, 3), dtype=torch.bool), torch.zeros((2, 3)), 4), "top_ids"),
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 3), dtype=torch.int64), 4),
     "top_logprobs"),
    ((torch.zeros((2, 3), dtype=torch.int64), torch.zeros((2, 2)), 4), "top_logprobs"),
    ((torch.zeros((0, 3), dtype=torch.int64), torch.zeros((0, 3)), 4), "top_logprobs"),
    ((torch.zeros((2, 0), dtype=torch.int64), torch.zeros((2, 0)), 4), "top_logprobs"),
    ((torch.zeros((1, 3), dtype=torch.int64), torch.tensor([[-2.0, -1.0, -3.0]]), 4),
     "top_logprobs"),
    ((torch.zeros((1, 3), dtype=torch.int64), torch.tensor([[-1.0, math.nan, -3.0]]), 4),
     "top_logprobs"),
    ((torch.zeros((1, 3), dtype=torch.int64), torch.tensor([[math.nan, -1.0, -3.0]]), 4),
     "top_logprobs"),
    ((torch.zeros((1, 1), dtype=torch.int64), torch.tensor([[math.nan]]), 4), "top_logprobs"),
    ((torch.zeros((1, 2), dtype=torch.int64), torch.tensor([[math.inf, -1.0]]), 4),
     "top_logprobs"),
])
def test_build_tree_bad_inputs(args, name):
    with pytest.raises(ValueError, match=name):
        build_tree(*args)


def test_build_tree_max_budget_is_accepted():
    rng = random.Random(11)
    ids, lp = random_topk(rng, 15, MAX_TREE_BUDGET, 200)
    assert len(build_tree(ids, lp, MAX_TREE_BUDGET).tokens) == MAX_TREE_BUDGET


def test_draft_tree_chain_and_validation():
    t = DraftTree.chain([7, 8, 9])
    assert (t.tokens, t.parents, t.depths) == ([7, 8, 9], [-1, 0, 1, 2], [0, 1, 2, 3])
    assert t.max_depth == 3
    assert DraftTree.chain([]) == DraftTree(tokens=[], parents=[-1], depths=[0])
    assert DraftTree.chain([]).max_depth == 0
    with pytest.raises(ValueError, match="parents"):
        DraftTree(tokens=[1], parents=[0, 0], depths=[0, 1])
    with pytest.raises(ValueError, match="parents"):
        DraftTree(tokens=[1, 2], parents=[-1, 0], depths=[0, 1, 2])
    with pytest.raises(ValueError, match=r"parents\[2\]"):
        DraftTree(tokens=[1, 2], parents=[-1, 0, 2], depths=[0, 1, 2])
    with pytest.raises(ValueError, match="depths"):
        DraftTree(tokens=[1, 2], parents=[-1, 0, 0], depths=[0, 1])
    with pytest.raises(ValueError, match=r"depths\[2\]"):
        DraftTree(tokens=[1, 2], parents=[-1, 0, 0], depths=[0, 1, 2])


# ------------------------------------------------------------------------------ ancestor mask

def test_ancestor_mask_against_definition():
    rng = random.Random(5)
    trees = [[-1]] + [[-1] + [rng.randrange(j) for j in range(1, rng.randint(2, 40))]
                      for _ in range(60)]
    for _ in range(20):
        ids, lp = random_topk(rng, rng.randint(1, 15), 6, 30)
        trees.append(build_tree(ids, lp, rng.randint(1, MAX_TREE_BUDGET)).parents)
    for parents in trees:
        m = ancestor_mask(parents)
        size = len(parents)
        assert m.dtype == torch.bool and m.shape == (size, size)
        for i in range(size):
            line, a = set(), i
            while a != -1:                   # i and every ancestor, by following parents
                line.add(a)
                a = parents[a]
            assert m[i].tolist() == [j in line for j in range(size)]


def test_ancestor_mask_bad_parents():
    with pytest.raises(ValueError, match="parents"):
        ancestor_mask([0, 0])
    with pytest.raises(ValueError, match="parents"):
        ancestor_mask([-1, 1])


# ------------------------------------------------------------------------------ greedy walk

def test_greedy_walk_is_greedy_decoding():
    """Committed tokens = greedy decoding of the target for len(path) + 1 tokens; the path is the
    longest greedy prefix present in the tree."""
    rng = random.Random(99)
    vocab = 12
    seen_acc, seen_sibling = set(), 0
    for case in range(300):
        target = PathTarget(vocab, seed=case, scale=2.0)
        context = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
        depth, k, budget = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 32)
        truth = target.greedy(context, depth)
        ids, lp = random_topk(rng, depth, k, vocab)
        for d in range(depth):            # plant the greedy token at a random rank, or not at all
            if rng.random() < 0.8 and truth[d] not in ids[d].tolist():
                ids[d, rng.randrange(k)] = truth[d]
        tree = build_tree(ids, lp, budget)
        v, = verify_trees([tree], [target.tree_logits(context, tree)], [params()])

        paths = node_paths(tree)
        longest = max(m for m in range(depth + 1) if tuple(truth[:m]) in set(paths))
        assert isinstance(v, TreeVerified)
        assert v.tokens == target.greedy(context, longest + 1)
        assert v.accepted == longest == len(v.path)
        assert [paths[j] for j in v.path] == [tuple(truth[:m]) for m in range(1, longest + 1)]
        assert v.path == sorted(v.path)
        assert (v.drafted, v.nodes, v.finish) == (tree.max_depth, len(tree.tokens), None)
        seen_acc.add(longest)
        seen_sibling += any(tree.tokens[j - 1] != ids[tree.depths[j] - 1, 0] for j in v.path)
    assert {0, 1, 2, 3} <= seen_acc
    assert seen_sibling >= 20           # accepted through non-top-ranked alternatives


PEAKED = [0.85, 0.05, 0.05, 0.05]   # the drafter is sure at depths where it is right at rank 0
FLAT = [0.3, 0.25, 0.25, 0.2]       # and unsure where the right token is further down


@pytest.mark.parametrize("ranks", [[2, 0, 0, 0], [0, 3, 0, 1], [3, 2, 0, 0], [0, 0, 3, 2]])
def test_greedy_accepts_planted_lower_ranks(ranks):
    """An oracle drafter whose right token is at rank 1-3 at chosen depths: the tree holds it and
    the walk accepts the whole block, where the rank-0 chain stops at the first such depth. The
    budget is the planted path's last node's place in best-first order: one node less and that
    node is out (a smaller budget's tree is the first nodes of a larger one's)."""
    vocab, context = 20, (3,)
    target = PathTarget(vocab, seed=123, scale=3.0)
    truth = target.greedy(context, 4)
    ids, lp = planted_topk(truth, ranks, 4, vocab, [FLAT if r else PEAKED for r in ranks])
    full = build_tree(ids, lp, MAX_TREE_BUDGET)
    budget = node_paths(full).index(tuple(truth))
    assert budget > 4                             # alternatives come before the planted path
    tree = build_tree(ids, lp, budget)
    assert tree.tokens == full.tokens[:budget] and tree.parents == full.parents[:budget + 1]
    v, = verify_trees([tree], [target.tree_logits(context, tree)], [params()])
    assert v.tokens == target.greedy(context, 5)
    assert v.accepted == 4 and len(v.path) == 4 and v.drafted == 4
    # one node less: the path's last node is not in the tree, the walk accepts 3
    small = build_tree(ids, lp, budget - 1)
    w, = verify_trees([small], [target.tree_logits(context, small)], [params()])
    assert w.accepted == 3 and w.tokens == target.greedy(context, 4)
    chain = DraftTree.chain(ids[:, 0].tolist())
    c, = verify_trees([chain], [target.tree_logits(context, chain)], [params()])
    assert c.accepted == next(d for d, r in enumerate(ranks) if r)
    assert c.tokens == target.greedy(context, c.accepted + 1)


def test_no_matching_node_gives_the_bonus_only():
    vocab = 20
    rng = random.Random(4)
    ids, lp = random_topk(rng, 4, 4, 10)        # every node token < 10
    tree = build_tree(ids, lp, 16)
    logits = torch.randn((len(tree.tokens) + 1, vocab), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(len(tree.tokens) + 1)
    logits[rows, 10 + rows % 10] = 100.0        # the target's argmax is >= 10 at every node
    v, = verify_trees([tree], [logits], [params()])
    assert v == TreeVerified(tokens=[int(logits[0].argmax())], accepted=0, drafted=tree.max_depth,
                             finish=None, path=[], nodes=16)


def test_greedy_ties_take_the_first_index():
    tree = DraftTree(tokens=[2, 1], parents=[-1, 0, 0], depths=[0, 1, 1])
    logits = torch.zeros((3, 4))
    logits[0, [1, 2]] = 5.0                      # tie between tokens 1 and 2: 1 wins
    v, = verify_trees([tree], [logits], [params()])
    assert v.path == [2] and v.tokens == [1, 0]  # then all-zero logits: token 0


def test_equal_siblings_take_the_first():
    tree = DraftTree(tokens=[4, 4], parents=[-1, 0, 0], depths=[0, 1, 1])
    logits = torch.zeros((3, 6))
    logits[0, 4] = 1.0
    logits[1, 5] = 1.0
    logits[2, 3] = 1.0
    v, = verify_trees([tree], [logits], [params()])
    assert v.path == [1] and v.tokens == [4, 5]


def _random_chain_row(rng: random.Random, tg: torch.Generator, vocab: int):
    k = rng.choice([0, 1, 3, 7])
    logits = torch.randn((k + 1, vocab), generator=tg) * rng.choice([0.5, 3.0])
    argmax = logits.argmax(-1).tolist()
    hit = rng.choice([0.5, 0.9, 1.0])
    drafts = [argmax[j] if rng.random() < hit else rng.randrange(vocab) for j in range(k)]
    stops = frozenset(rng.sample(range(vocab), 2)) if rng.random() < 0.4 else frozenset()
    return drafts, logits, stops, rng.randint(1, 10)


def test_chain_tree_matches_verify_batch_greedy():
    rng = random.Random(8)
    tg = torch.Generator().manual_seed(8)
    seen_finish = set()
    for _ in range(400):
        drafts, logits, stops, room = _random_chain_row(rng, tg, 30)
        par = params(stops=stops, room=room)
        ref, = verify_batch([torch.tensor(drafts, dtype=torch.int64)], [logits], [None], [par])
        v, = verify_trees([DraftTree.chain(drafts)], [logits], [par])
        assert (v.tokens, v.accepted, v.drafted, v.finish) == \
            (ref.tokens, ref.accepted, ref.drafted, ref.finish)
        assert v.path == list(range(1, v.accepted + 1))
        seen_finish.add(v.finish)
    assert seen_finish == {None, "stop", "length"}


def test_chain_tree_matches_verify_batch_when_sampling_is_deterministic():
    """Seeded sampled rows with top_k = 1 (p one-hot): both must give the same tokens. (With a
    spread-out p the two consume their generators differently -- verify_batch draws u [k] then
    noise [k + 1, V], the walk one noise [V] per visited node -- so they agree in distribution,
    checked in test_chain_tree_matches_verify_batch_in_distribution.)"""
    rng = random.Random(9)
    tg = torch.Generator().manual_seed(9)
    for i in range(200):
        drafts, logits, stops, room = _random_chain_row(rng, tg, 30)
        s = Sampling(temperature=rng.choice([0.7, 1.0]), top_k=1, seed=i)
        ref, = verify_batch([torch.tensor(drafts, dtype=torch.int64)], [logits], [None],
                            [params(s, s.generator(), stops, room)])
        v, = verify_trees([DraftTree.chain(drafts)], [logits],
                          [params(s, s.generator(), stops, room)])
        assert (v.tokens, v.accepted, v.drafted, v.finish) == \
            (ref.tokens, ref.accepted, ref.drafted, ref.finish)


def _gof(counts: dict, probs: dict, n: int) -> tuple[float, int, dict]:
    """Pearson chi-square p-value, df, and the pooled expected bins; counts outside the support
    are a failure by themselves."""
    assert all(probs.get(c, 0.0) > 0 for c in counts), "an impossible outcome was emitted"
    small = [c for c, p in probs.items() if n * p < 5]
    bins_p = {c: p for c, p in probs.items() if n * p >= 5}
    bins_o = {c: counts.get(c, 0) for c in bins_p}
    if small:
        bins_p["rest"] = sum(probs[c] for c in small)
        bins_o["rest"] = sum(counts.get(c, 0) for c in small)
    chi = sum((bins_o[c] - n * p) ** 2 / (n * p) for c, p in bins_p.items())
    df = len(bins_p) - 1
    return float(stats.chi2.sf(chi, df)), df, bins_p


def required_draws(bins_p: dict, df: int) -> int:
    """Draws needed to see BIAS moved between the two most likely bins (module docstring)."""
    crit = stats.chi2.isf(ALPHA, df)
    lam = brentq(lambda x: stats.ncx2.sf(crit, df, x) - POWER, 1e-6, 1e5)
    a, b = sorted(bins_p.values(), reverse=True)[:2]
    return math.ceil(lam / (BIAS ** 2 * (1 / a + 1 / b)))


def test_chain_tree_matches_verify_batch_in_distribution():
    """Sampled chain, fixed logits: (accepted, emitted token) has the exact law
    P(m, t) = prod_{j<m} p_j(d_j) * (p_m(t) if m == k else p_m(t) [t != d_m]); both fit it."""
    vocab, k, n = 5, 3, 7000   # n >= required_draws (asserted; 6,409)
    s = Sampling(temperature=1.0)
    logits = torch.randn((k + 1, vocab), generator=torch.Generator().manual_seed(21))
    p = probs_from_logits(logits, s).double().tolist()
    drafts = [int(torch.tensor(p[j]).argmax()) for j in range(k)]
    exact, reach = {}, 1.0
    for m in range(k + 1):
        for t in range(vocab):
            if m == k or t != drafts[m]:
                exact[(m, t)] = reach * p[m][t]
        if m < k:
            reach *= p[m][drafts[m]]
    assert sum(exact.values()) == pytest.approx(1.0)
    par = params(s, torch.Generator().manual_seed(5))
    for fn in ("batch", "trees"):
        if fn == "batch":
            out = verify_batch([torch.tensor(drafts)] * n, [logits] * n, [None] * n, [par] * n)
        else:
            out = verify_trees([DraftTree.chain(drafts)] * n, [logits] * n, [par] * n)
        counts: dict = {}
        for v in out:
            counts[(v.accepted, v.tokens[-1])] = counts.get((v.accepted, v.tokens[-1]), 0) + 1
        pval, df, bins = _gof(counts, exact, n)
        assert n >= required_draws(bins, df)
        assert pval > ALPHA, (fn, pval)


# ------------------------------------------------------------------------------ commit cut

def test_stop_and_room_cut_like_verify_batch():
    vocab, context = 20, (3,)
    target = PathTarget(vocab, seed=77, scale=3.0)
    truth = target.greedy(context, 5)                        # 4 accepted + the bonus
    ids, lp = planted_topk(truth[:4], [1, 0, 2, 0], 4, vocab, [FLAT, PEAKED, FLAT, PEAKED])
    tree = build_tree(ids, lp, 40)
    logits = target.tree_logits(context, tree)
    full, = verify_trees([tree], [logits], [params()])
    assert full.tokens == truth and full.accepted == 4
    assert len(set(truth)) == 5                              # each stop below cuts at one place

    cases = [  # (stops, room) -> (tokens, accepted, finish)
        (frozenset({truth[1]}), 100, (truth[:2], 2, "stop")),        # stop inside the path
        (frozenset({truth[4]}), 100, (truth, 4, "stop")),            # stop on the bonus token
        (frozenset(), 3, (truth[:3], 3, "length")),                  # room shorter than the path
        (frozenset(), 5, (truth, 4, "length")),                      # room exactly used
        (frozenset(), 6, (truth, 4, None)),
        (frozenset({truth[3]}), 2, (truth[:2], 2, "stop")),          # both: as verify_batch
        (frozenset({truth[0], truth[2]}), 100, (truth[:1], 1, "stop")),
    ]
    for stops, room, (tokens, accepted, finish) in cases:
        par = params(stops=stops, room=room)
        v, = verify_trees([tree], [logits], [par])
        assert (v.tokens, v.accepted, v.finish) == (tokens, accepted, finish), (stops, room)
        assert v.path == full.path[:accepted]
        assert (v.tokens, v.accepted, v.finish) == commit_cut(full.tokens, full.accepted, par)
        # the same accepted path as a chain through verify_batch cuts the same way
        chain_logits = logits[[0] + full.path]
        ref, = verify_batch([torch.tensor(truth[:4])], [chain_logits], [None], [par])
        assert (ref.tokens, ref.accepted, ref.finish) == (tokens, accepted, finish)


# ------------------------------------------------------------------------------ sampled walk

LOSSLESS_SETTINGS = [
    Sampling(temperature=0.7), Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_p=0.8), Sampling(temperature=1.0, top_p=0.8),
    Sampling(temperature=1.0, top_k=3),
]
V_TINY = 6
N_DRAWS = 8000            # >= required_draws for every setting (asserted; at most 7,489)
CONTEXT = (0,)
# The drafter's per-position distributions (3 positions), unlike the target's: at the root it
# ranks the target's second choice first and its first choice second, and leaves out its third
# (so empty paths, sibling acceptances and paths of 2-3 nodes all happen, asserted below).
DRAFT_LOGITS = torch.tensor([[0.6, 0.0, -2.0, 1.0, -2.0, -2.5],
                             [0.3, 1.1, -0.2, 0.9, 0.0, -0.8],
                             [-0.4, 0.2, 1.3, 0.1, 0.7, -1.2]])


def _lossless_setup():
    target = PathTarget(V_TINY, seed=31, scale=0.6)
    lp, ids = DRAFT_LOGITS.log_softmax(-1).topk(V_TINY, dim=-1)
    tree = build_tree(ids, lp, 10)
    return target, tree


def exact_first_two(target: PathTarget, s: Sampling) -> dict[tuple[int, int], float]:
    p1 = probs_from_logits(target.logits(CONTEXT), s).double().tolist()
    out = {}
    for a in range(V_TINY):
        p2 = probs_from_logits(target.logits(CONTEXT + (a,)), s).double().tolist()
        for b in range(V_TINY):
            if p1[a] * p2[b] > 0:
                out[(a, b)] = p1[a] * p2[b]
    return out


def first_two(walk, target: PathTarget, tree: DraftTree, s: Sampling, n: int, seed: int):
    """Decode steps (each a tree walk rooted at the last committed token) until every one of the
    n requests has two tokens; returns their counts, and step 1's accepted paths."""
    gen = torch.Generator().manual_seed(seed)
    par = params(s, gen)
    out = walk([tree] * n, [target.tree_logits(CONTEXT, tree)] * n, [par] * n)
    seqs = [list(v.tokens) for v in out]
    paths = [v.path for v in out]
    short = [i for i, q in enumerate(seqs) if len(q) < 2]
    if short:   # one token emitted: the next step's tree is rooted at it
        lg = {a: target.tree_logits(CONTEXT + (a,), tree) for a in range(V_TINY)}
        more = walk([tree] * len(short), [lg[seqs[i][0]] for i in short], [par] * len(short))
        for i, v in zip(short, more):
            seqs[i].extend(v.tokens)
    counts: dict[tuple[int, int], int] = {}
    for q in seqs:
        counts[(q[0], q[1])] = counts.get((q[0], q[1]), 0) + 1
    return counts, paths


@pytest.mark.parametrize("s", LOSSLESS_SETTINGS,
                         ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_sampled_walk_is_lossless(s):
    target, tree = _lossless_setup()
    exact = exact_first_two(target, s)
    counts, paths = first_two(verify_trees, target, tree, s, N_DRAWS, seed=1000)
    pval, df, bins = _gof(counts, exact, N_DRAWS)
    assert N_DRAWS >= required_draws(bins, df)
    assert pval > ALPHA, pval
    # the walk really went through the tree: empty, one-node and longer paths, and alternatives
    lengths = {min(len(p), 2) for p in paths}
    first_child = next(j for j in range(1, len(tree.parents)) if tree.parents[j] == 0)
    assert lengths == {0, 1, 2}
    assert sum(1 for p in paths if p and p[0] != first_child) > N_DRAWS // 50


def _biased_walk(mode: str):
    """Deliberately wrong walks over the same inputs, to show that the test has power:
    ``first_child`` always moves to a node's first child; ``no_renorm`` tries the children in
    order, accepting x with probability p(x) without renormalising the residual after a
    rejection, then draws the bonus from p without the children (the classic mistake);
    ``leaky`` is the right walk except that at the root, 3% of the time, it moves to the first
    child whatever was drawn (about 2 points of the first token's mass moved)."""
    def walk(trees, logits, pars):
        out = []
        for tree, lg, par in zip(trees, logits, pars):
            kids: list[list[int]] = [[] for _ in tree.parents]
            for j in range(1, len(tree.parents)):
                kids[tree.parents[j]].append(j)
            gen, j, path = par.generator, 0, []
            while True:
                p = probs_from_logits(lg[j], par.sampling)
                nxt = None
                if mode == "first_child" and kids[j]:
                    nxt = kids[j][0]
                elif mode == "leaky":
                    t = int(torch.multinomial(p, 1, generator=gen))
                    if j == 0 and float(torch.rand((), generator=gen)) < 0.03:
                        t = tree.tokens[kids[0][0] - 1]
                    nxt = next((c for c in kids[j] if tree.tokens[c - 1] == t), None)
                    if nxt is None:
                        break
                elif mode == "no_renorm":
                    for c in kids[j]:
                        if float(torch.rand((), generator=gen)) < float(p[tree.tokens[c - 1]]):
                            nxt = c
                            break
                if nxt is None:       # first_child, no_renorm: the bonus token
                    rest = p.clone()
                    rest[[tree.tokens[c - 1] for c in kids[j]]] = 0.0
                    if mode == "first_child" or float(rest.sum()) <= 0:
                        rest = p
                    t = int(torch.multinomial(rest, 1, generator=gen))
                    break
                path.append(nxt)
                j = nxt
            out.append(TreeVerified(tokens=[tree.tokens[c - 1] for c in path] + [t],
                                    accepted=len(path), drafted=tree.max_depth, finish=None,
                                    path=path, nodes=len(tree.tokens)))
        return out
    return walk


@pytest.mark.parametrize("mode", ["first_child", "no_renorm", "leaky"])
def test_the_lossless_test_catches_a_biased_walk(mode):
    s = Sampling(temperature=1.0)
    target, tree = _lossless_setup()
    counts, _ = first_two(_biased_walk(mode), target, tree, s, N_DRAWS, seed=1000)
    pval, _, _ = _gof({c: n for c, n in counts.items() if c in exact_first_two(target, s)},
                      exact_first_two(target, s), N_DRAWS)
    assert pval < ALPHA


def test_sampled_walk_draws_one_noise_per_visited_node():
    target, tree = _lossless_setup()
    logits = target.tree_logits(CONTEXT, tree)
    s = Sampling(temperature=1.0)                             # unseeded: the row's generator
    seen = set()
    for seed in range(40):
        gen, twin = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        v, = verify_trees([tree], [logits], [params(s, gen)])
        for _ in range(len(v.path) + 1):
            exp_noise((V_TINY,), twin)
        assert torch.equal(gen.get_state(), twin.get_state())
        again, = verify_trees([tree], [logits], [params(s, torch.Generator().manual_seed(seed))])
        assert again == v                                     # same generator: reproducible
        seen.add(len(v.path))
    assert len(seen) >= 3
    g = torch.Generator().manual_seed(4)
    verify_trees([tree], [logits], [params(GREEDY, g)])       # greedy rows draw nothing
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(4).get_state())


def test_seeded_walk_emits_the_tokens_of_decoding_without_drafts():
    """A seeded row takes, at each visited node, the race of p against the noise of the
    sequence index it fills: the emitted tokens are those decoding would choose one at a time
    (each the race at its own index), whatever the tree; the row's generator is not used."""
    target, tree = _lossless_setup()
    logits = target.tree_logits(CONTEXT, tree)
    seen = set()
    for seed in range(40):
        s = Sampling(temperature=1.0, top_p=0.9, seed=seed)
        start = len(CONTEXT) + seed                       # any sequence index of the anchor's child
        g = torch.Generator().manual_seed(4)
        v, = verify_trees([tree], [logits], [params(s, g, position=start)])
        assert torch.equal(g.get_state(), torch.Generator().manual_seed(4).get_state())
        seq = tuple(CONTEXT)
        for m, tok in enumerate(v.tokens):                # decoding, one token at a time
            p = probs_from_logits(target.logits(seq), s)
            want = int(coupled_choice(p, position_noise(seed, [start + m], p.shape[-1])[0]))
            assert tok == want, f"seed {seed}: token {m} is {tok}, decoding chooses {want}"
            seq += (tok,)
        seen.add(v.accepted)
    assert len(seen) >= 2                                 # drafts were accepted and rejected


# ------------------------------------------------------------------------------ batches

def test_batch_equals_each_row_alone():
    rng = random.Random(17)
    vocab = 16
    settings = [GREEDY, Sampling(temperature=0.7), Sampling(temperature=1.0, top_p=0.9),
                Sampling(temperature=1.3, top_k=4), Sampling(temperature=1.0, top_k=2, top_p=0.5)]
    for case in range(40):
        target = PathTarget(vocab, seed=500 + case, scale=rng.choice([1.0, 3.0]))
        rows = []
        for _ in range(rng.randint(1, 8)):
            context = (rng.randrange(vocab),)
            kind = rng.random()
            if kind < 0.15:
                tree = DraftTree.chain([])
            elif kind < 0.35:
                tree = DraftTree.chain(target.greedy(context, rng.randint(1, 5)))
            else:
                ids, lp = random_topk(rng, rng.randint(1, 6), rng.randint(1, 5), vocab)
                tree = build_tree(ids, lp, rng.randint(1, 24))
            s = rng.choice(settings)
            stops = frozenset(rng.sample(range(vocab), 2)) if rng.random() < 0.3 else frozenset()
            rows.append((tree, target.tree_logits(context, tree), s, rng.randrange(2**62), stops,
                         rng.randint(1, 8)))

        def pars(rows):
            out, shared = [], None
            for i, (_, _, s, seed, stops, room) in enumerate(rows):
                g = None if s.greedy else torch.Generator().manual_seed(seed)
                if not s.greedy and i % 3 == 2:   # some rows share a generator: row order counts
                    shared = shared or g
                    g = shared
                out.append(params(s, g, stops, room))
            return out

        batch = verify_trees([r[0] for r in rows], [r[1] for r in rows], pars(rows))
        alone_pars = pars(rows)
        alone = [verify_trees([r[0]], [r[1]], [p])[0] for r, p in zip(rows, alone_pars)]
        assert batch == alone
        assert all(v.nodes == len(r[0].tokens) and v.drafted == r[0].max_depth
                   for v, r in zip(batch, rows))


def test_verify_trees_bad_inputs():
    tree = DraftTree.chain([1, 2])
    lg = torch.zeros((3, 5))
    par = params()
    assert verify_trees([], [], []) == []
    with pytest.raises(ValueError, match="logits"):
        verify_trees([tree], [], [par])
    with pytest.raises(ValueError, match="params"):
        verify_trees([tree], [lg], [])
    with pytest.raises(ValueError, match=r"logits\[0\]"):
        verify_trees([tree], [torch.zeros((2, 5))], [par])
    with pytest.raises(ValueError, match=r"logits\[0\]"):
        verify_trees([tree], [torch.zeros((3,))], [par])
    with pytest.raises(ValueError, match=r"logits\[1\]"):
        verify_trees([tree, tree], [lg, torch.zeros((3, 6))], [par, par])
    with pytest.raises(ValueError, match=r"trees\[0\]"):
        verify_trees([[1, 2]], [lg], [par])
    with pytest.raises(ValueError, match=r"params\[0\]"):
        verify_trees([tree], [lg], [object()])
