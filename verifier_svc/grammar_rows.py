"""A structured request's rows in a decode step: its drafts pruned by its grammar, the tokens
its grammar forces added as drafts (a third source beside the drafter and the suffix index),
and the mask of every verified row, each with the grammar state of its own path
(``dflash.core.grammar.GrammarState.walk``).

Called by ``VerifierEngine.decode_step`` twice: before drafting (:func:`plan_forced`: the
forced stretch is known from the committed tokens alone, and where it reaches as deep as the
drafter's block would, the drafter is not asked), and after the drafts and the tree are known,
before the target's forward (:func:`constrain`), so a refused draft never costs a node. Forced tokens need no drafter: a
request without one (speculation on, mode not ``off``) still verifies the grammar's forced
stretch as a chain. They are verified like every draft (the masked target accepts them with
the probability it gives them), so the output stays that of constrained decoding without
speculation.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dflash.core.grammar import MAX_FORCED, GrammarState
from dflash.core.logits_processors import chain_parents
from dflash.core.speculation import MAX_TREE_BUDGET, SpecMode
from verifier_svc.decode_state import StepRow
from verifier_svc.suffix_drafts import DraftSource, Sourced
from verifier_svc.tree import DraftTree

__all__ = ["GrammarTime", "constrain", "plan_forced", "with_forced"]


@dataclasses.dataclass
class GrammarTime:
    """Decode-step time spent on grammars: ``seconds`` summed over ``rows``, the step rows that
    verified under a grammar (at batch 1 a row is a step)."""

    seconds: float = 0.0
    rows: int = 0

    def add(self, rows: list[StepRow]) -> None:
        """One step's rows, once they are committed (rows without a grammar count nowhere)."""
        for r in rows:
            if r.state.grammar is not None:
                self.rows += 1
                self.seconds += r.grammar_seconds


def plan_forced(r: StepRow) -> None:
    """Before drafting: set ``r.forced``, the tokens row ``r``'s grammar forces after its
    committed ones (at most a block's, and what ``max_tokens`` leaves), and where they are at
    least as many as the drafts its shape asks for (``r.shape.k``), ask none (``k`` 0: the
    drafter is not called for it, its context rides along on a later call). A draft there
    could only repeat the forced tokens or be refused by the mask, and a chain that differs
    from them is replaced by them anyway (:func:`constrain`): the call adds nothing and costs
    the drafter's forward. Suffix candidates still join a suffix or hybrid shape's tree. Rows
    without a grammar are left alone; the seconds go to ``r.grammar_seconds``."""
    g = r.state.grammar
    if g is None:
        return
    t0 = time.perf_counter()
    st = r.state
    room = st.req.max_tokens - st.emitted - 1      # drafts committable beside the bonus token
    r.forced = g.forced(min(MAX_FORCED, room)) if st.mode != SpecMode.OFF else []
    if r.shape.k and len(r.forced) >= r.shape.k:
        r.shape = dataclasses.replace(r.shape, k=0)
    r.grammar_seconds += time.perf_counter() - t0


def constrain(r: StepRow) -> None:
    """Prune row ``r``'s drafts (chain) or tree by its grammar, add its forced tokens, and set
    ``r.masks`` (bool ``[block, V]``); the seconds it took go to ``r.grammar_seconds``. Rows
    without a grammar are left alone."""
    g = r.state.grammar
    if g is None:
        return
    t0 = time.perf_counter()
    _constrain(r, g)
    r.grammar_seconds += time.perf_counter() - t0


def _constrain(r: StepRow, g: GrammarState) -> None:
    forced = r.forced if r.forced is not None else []
    if r.sourced is not None:
        src = r.sourced
        if forced:
            src = with_forced(src, forced[:max(0, MAX_TREE_BUDGET - len(src.tree.tokens))])
        keep, r.masks = g.walk(src.tree.tokens, src.tree.parents)
        r.sourced = _kept(src, keep)
        r.grammar_nodes = sum(1 for s in r.sourced.sources[1:] if s == DraftSource.GRAMMAR)
        return
    d = r.draft
    drafts: list[int] = d.tokens.tolist()
    probs = d.probs
    if forced and drafts[:len(forced)] != forced:
        drafts, probs = list(forced), None         # a point-mass proposal: one-hot q
        r.grammar_nodes = len(forced)
    keep, r.masks = g.walk(drafts, chain_parents(len(drafts)))
    m = len(keep) - 1
    r.grammar_nodes = min(r.grammar_nodes, m)
    if drafts[:m] != d.tokens.tolist():
        r.draft = dataclasses.replace(
            d, tokens=torch.tensor(drafts[:m], dtype=torch.int64),
            probs=probs[:m] if probs is not None else None,
            top_ids=d.top_ids[:m] if d.top_ids is not None and not r.grammar_nodes else None,
            top_logprobs=d.top_logprobs[:m] if d.top_logprobs is not None and not r.grammar_nodes else None)


def with_forced(src: Sourced, forced: list[int]) -> Sourced:
    """``src``'s tree with the path ``forced`` from the root merged in: nodes on it gain the
    ``DraftSource.GRAMMAR`` source, new nodes are appended (parents before children)."""
    tokens, parents = list(src.tree.tokens), list(src.tree.parents)
    depths, sources = list(src.tree.depths), list(src.sources)
    children: dict[tuple[int, int], int] = {}
    for j in range(len(tokens), 0, -1):           # the first of equal siblings is the walk's
        children[(parents[j], tokens[j - 1])] = j
    at = 0
    for t in forced:
        nxt = children.get((at, t))
        if nxt is None:
            tokens.append(t)
            parents.append(at)
            depths.append(depths[at] + 1)
            sources.append(DraftSource.GRAMMAR)
            nxt = len(tokens)
        else:
            sources[nxt] |= DraftSource.GRAMMAR
        at = nxt
    return Sourced(DraftTree(tokens=tokens, parents=parents, depths=depths), sources,
                   dict(src.trie_nodes), src.gain)


def _kept(src: Sourced, keep: list[int]) -> Sourced:
    """``src`` restricted to the block indices ``keep`` (increasing, 0 first, prefix-closed),
    renumbered."""
    if len(keep) == len(src.sources):
        return src
    new = {j: i for i, j in enumerate(keep)}
    tree = src.tree
    return Sourced(DraftTree(tokens=[tree.tokens[j - 1] for j in keep[1:]],
                             parents=[-1] + [new[tree.parents[j]] for j in keep[1:]],
                             depths=[tree.depths[j] for j in keep]),
                   [src.sources[j] for j in keep],
                   {new[j]: t for j, t in src.trie_nodes.items() if j in new}, src.gain)
