"""What each job of a decode step proposes for verification: its suffix candidates
(:func:`suffix_offers`), what it asks its drafter (:func:`draft_item`), and the tree it verifies,
built from the drafter's answer and those candidates (:func:`sourced`; None: a chain).

Called by ``VerifierEngine.decode_step`` around the policy's choice, before the target's
forward. Functions of their typed inputs: they keep no state, and read the policy, the
calibration and the suffix indexes without changing them.
"""

from __future__ import annotations

from dflash.core.proposer import MAX_TOP_K
from dflash.core.speculation import MODE_SUFFIX
from verifier_svc.decode_state import DecodeState, StepRow
from verifier_svc.drafter_sync import DraftItem, DraftOutcome
from verifier_svc.policy import Shape, SpeculationPolicy, bucket
from verifier_svc.suffix_drafts import (
    DRAFTER,
    AnswerStore,
    Sourced,
    SuffixCalibration,
    SuffixOffer,
    hybrid_tree,
    offer_for,
    suffix_tree,
)
from verifier_svc.tree import DraftTree, build_tree

__all__ = ["suffix_offers", "draft_item", "sourced", "drafter_tree"]


def suffix_offers(states: list[DecodeState], answers: AnswerStore,
                  calibration: SuffixCalibration) -> list[SuffixOffer | None]:
    """Each job's suffix candidates this step, from its session's suffix index and its
    tenant's ``answers`` (None: it may verify none, or none matched)."""
    out = []
    for st in states:
        depth = min(st.suffix_limit, st.req.max_tokens - st.emitted - 1)
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
                     room=st.mode != MODE_SUFFIX and st.block_limit > 1
                     and req.max_tokens - st.emitted > 1,
                     sampling=req.sampling.for_drafter(), trace_context=ctx,
                     top_k=min(sh.budget, MAX_TOP_K) if sh.budget and sh.k else 0,
                     no_learn=req.no_learn)


def sourced(r: StepRow, d: DraftOutcome, batch: int, policy: SpeculationPolicy) -> Sourced | None:
    """The tree row ``r`` verifies this step with its nodes' sources, or None for a chain:
    the drafter's DDTree (hybrid: with suffix candidates merged in), suffix candidates alone
    (asked for, or the drafter's block is missing: the fallback still speculates), or none.
    ``d``: its drafter's answer; ``batch``: the step's jobs (the fallback's size is priced at
    that batch)."""
    st, sh, offer = r.state, r.shape, r.offer
    limit = min(st.suffix_limit, st.req.max_tokens - st.emitted - 1)
    tree = drafter_tree(sh, d)
    if tree is not None:
        if sh.suffix and offer is not None and limit > 0:
            label = st.req.proposer.card.label if st.req.proposer is not None else ""
            theta = policy.drafter_node_value(label, sh.budget, limit)
            return hybrid_tree(tree, offer, sh.budget, theta, limit)
        return Sourced(tree, [0] + [DRAFTER] * len(tree.tokens), {})
    if offer is None or limit <= 0:
        return None
    if sh.suffix and not sh.k:
        return suffix_tree(offer, sh.budget, limit)
    if d.fallback and not len(d.tokens) and sh.k:
        n = policy.suffix_size(offer, bucket(batch), st.tree_budget, limit)
        return suffix_tree(offer, n, limit) if n else None
    return None


def drafter_tree(sh: Shape, d: DraftOutcome) -> DraftTree | None:
    """The tree a job verifies this step, or None for a chain (no tree asked, no drafts, or a
    drafter that sent no top-k: a chain drafter keeps working)."""
    if not sh.budget or not len(d.tokens) or d.top_ids is None or d.top_logprobs is None:
        return None
    depth = len(d.tokens)
    return build_tree(d.top_ids[:depth], d.top_logprobs[:depth], sh.budget)
