"""What each job of a decode step proposes for verification: its suffix candidates
(:func:`suffix_offers`), what it asks its drafter (:func:`draft_item`), and the tree it verifies,
built from the drafter's answer and those candidates (:func:`sourced`; None: a chain).

Called by ``VerifierEngine.decode_step`` around the policy's choice, before the target's
forward. Functions of their typed inputs: they keep no state, and read the policy, the
calibration and the suffix indexes without changing them.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash.core.proposer import MAX_TOP_K
from dflash.core.speculation import SpecMode, suffix_depth
from verifier_svc.decode_state import DecodeState, StepRow
from verifier_svc.drafter_sync import DraftItem, DraftOutcome
from verifier_svc.policy import Shape, SpeculationPolicy, bucket
from verifier_svc.suffix_drafts import (
    AnswerStore,
    DraftSource,
    Sourced,
    SuffixCalibration,
    SuffixOffer,
    hybrid_tree,
    offer_for,
    suffix_tree,
)
from verifier_svc.tree import DraftTree, build_tree

__all__ = ["suffix_offers", "draft_item", "sourced", "merge_sources", "drafter_tree"]


def suffix_offers(states: list[DecodeState], answers: AnswerStore,
                  calibration: SuffixCalibration) -> list[SuffixOffer | None]:
    """Each job's suffix candidates this step, from its session's suffix index and its
    tenant's ``answers`` (None: it may verify none, or none matched)."""
    out = []
    for st in states:
        depth = suffix_depth(st.suffix_limit, st.req.max_tokens, st.emitted)
        s = st.session
        out.append(offer_for(s.suffix, answers.indexes(st.req.tenant), depth,
                             calibration, s.suffix_rates) if depth > 0 else None)
    return out


def draft_item(r: StepRow) -> DraftItem:
    """What row ``r`` asks its drafter this step (``verifier_svc.drafter_sync.DrafterSync.draft``);
    a traced request's step span starts here, so the drafter's span is its child."""
    st, sh = r.state, r.shape
    s, req = st.session, st.req
    ctx = req.trace.step_started(st.steps) if req.trace is not None else {}
    return DraftItem(session_id=s.id, state=s.drafter, proposer=req.proposer, cached=r.cached,
                     anchor=s.tokens[-1], k=sh.k,
                     # mode suffix never asks the drafter: it gets no context updates
                     # either; a later turn that drafts sends all it lacks in one call
                     room=st.mode != SpecMode.SUFFIX and st.block_limit > 1
                     and req.max_tokens - st.emitted > 1,
                     sampling=req.sampling.for_drafter(), trace_context=ctx,
                     top_k=min(sh.budget, MAX_TOP_K) if sh.budget and sh.k else 0,
                     no_learn=req.no_learn, tokens=s.tokens, prompt_len=len(req.prompt))


def sourced(r: StepRow, d: DraftOutcome, batch: int, policy: SpeculationPolicy) -> Sourced | None:
    """The tree row ``r`` verifies this step with its nodes' sources, or None for a chain:
    :func:`merge_sources` of the drafter's DDTree and the suffix candidates, or, when the
    drafter's block is missing, suffix candidates alone (the fallback still speculates).
    ``d``: its drafter's answer; ``batch``: the step's jobs (the fallback's size is priced at
    that batch)."""
    st, sh, offer = r.state, r.shape, r.offer
    limit = suffix_depth(st.suffix_limit, st.req.max_tokens, st.emitted)
    tree = drafter_tree(sh, d)
    label = st.req.proposer.card.label if st.req.proposer is not None else ""
    out = merge_sources(sh, tree, offer, limit,
                        lambda: policy.drafter_node_value(label, sh.budget, limit))
    if out is None and tree is None and offer is not None and limit > 0 \
            and d.fallback and not len(d.tokens) and sh.k:
        n = policy.suffix_size(offer, bucket(batch), st.tree_budget, limit)
        return suffix_tree(offer, n, limit) if n else None
    return out


def merge_sources(sh: Shape, tree: DraftTree | None, offer: SuffixOffer | None, limit: int,
                  theta: Callable[[], float]) -> Sourced | None:
    """The tree of shape ``sh`` from the drafter's DDTree ``tree`` (None: a chain or no
    drafts) and the suffix candidates ``offer``, at most ``limit`` deep: hybrid (the candidates
    worth more than the drafter's marginal node, ``theta()``, merged in), the drafter's tree
    alone, suffix candidates alone (a suffix-only shape), or None. ``dflash diagnose`` replays
    steps through this same choice."""
    if tree is not None:
        if sh.suffix and offer is not None and limit > 0:
            return hybrid_tree(tree, offer, sh.budget, theta(), limit)
        return Sourced(tree, [DraftSource(0)] + [DraftSource.DRAFTER] * len(tree.tokens), {})
    if offer is not None and limit > 0 and sh.suffix and not sh.k:
        return suffix_tree(offer, sh.budget, limit)
    return None


def drafter_tree(sh: Shape, d: DraftOutcome) -> DraftTree | None:
    """The tree a job verifies this step, or None for a chain (no tree asked, no drafts, or a
    drafter that sent no top-k: a chain drafter keeps working)."""
    if not sh.budget or not len(d.tokens) or d.top_ids is None or d.top_logprobs is None:
        return None
    depth = len(d.tokens)
    return build_tree(d.top_ids[:depth], d.top_logprobs[:depth], sh.budget)
