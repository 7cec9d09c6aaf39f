"""The commit stage of a decode step: what each verified job keeps (:func:`commit_row`: its KV
cache cropped, its taps, tokens and penalty state advanced, its counts, a ``StepEvent``) and
what the whole step teaches the policy (:func:`step_feedback`: one ``StepFeedback``).

Called by ``VerifierEngine.decode_step`` after verification, the commits under the target's
lock. Functions of their typed inputs: nothing here keeps state of its own (``commit_row``
advances its row's request, session and cache in place).
"""

from __future__ import annotations

import logging
import time

from dflash.core.finish import FINISH_CANCELLED
from dflash.core.logits_processors import token_logprobs
from dflash.core.stats import AcceptanceCounter
from verifier_svc.decode_state import DecodeState, StepRow, StepTiming
from verifier_svc.policy import StepFeedback
from verifier_svc.request import StepEvent
from verifier_svc.scheduler import StepPlan
from verifier_svc.suffix_drafts import AnswerStore, DraftSource, Sourced, SuffixCalibration, observe_walk
from verifier_svc.target_protocol import Target
from verifier_svc.tree import TreeVerified
from verifier_svc.verification import Verified

__all__ = ["commit_row", "step_feedback", "log_step"]

log = logging.getLogger("dflash.verifier")


def commit_row(r: StepRow, timing: StepTiming, target: Target, totals: AcceptanceCounter, *,
               suffix: bool, answers: AnswerStore, calibration: SuffixCalibration) -> StepEvent:
    """Keep what row ``r`` committed: crop its KV cache to it (a tree keeps its accepted
    path's entries first), keep its taps, advance its penalty state, count it (in its request's
    counts and ``totals``), and take the committed tokens' log-probabilities from its raw logits
    [block, V] if asked. With ``suffix`` on, the tokens extend the session's suffix index, a
    finished answer joins its tenant's ``answers``, and a tree's walk calibrates
    ``calibration``. The caller holds the target's lock."""
    st, v, d, src, n = r.state, r.verified, r.draft, r.sourced, r.cached
    assert v is not None and r.logits is not None      # verified before its commit
    s, taps = st.session, r.taps
    new = v.tokens
    nodes = suffix_nodes = suffix_accepted = 0
    kept = list(range(len(new)))               # the block rows that emitted the tokens
    if isinstance(v, TreeVerified):
        kept = [0] + v.path                    # the anchor and the accepted nodes
        target.keep(s.cache, n, kept)
        if taps is not None:
            taps = taps[kept]
        nodes = v.nodes
        if src is not None and src.trie_nodes:
            suffix_nodes, suffix_accepted = src.suffix_nodes, src.suffix_only(v.path)
            if r.offer is not None:
                observe_walk(calibration, r.offer, src, v.path)
    target.crop(s.cache, n + len(new))
    if s.drafter.tap_ids:
        assert taps is not None                 # the target taps the layers it is asked for
        s.drafter.taps.append(taps[:len(new)])
    s.tokens.extend(new)
    if suffix:
        s.suffix.extend(new)
    if v.finish and v.finish != FINISH_CANCELLED and suffix:
        answers.add(st.req.tenant, s.tokens[len(st.req.prompt):])
    if st.processor:
        st.processor.commit(new)
    grammar_accepted = _grammar_commit(r, v)
    sampling = st.req.sampling
    logprobs = (token_logprobs(r.logits, kept[:len(new)], new, sampling.top_logprobs)
                if sampling.logprobs else None)
    st.emitted += len(new)
    _count(st, totals, v, nodes, suffix_nodes, suffix_accepted)
    if r.grammar_nodes:
        for c in (st.stats, totals):
            c.record_grammar(r.grammar_nodes, grammar_accepted)
    draft_s = timing.draft_seconds if d.called else 0.0
    st.stats.verify_seconds += timing.verify_seconds
    st.stats.draft_seconds += draft_s
    if d.fallback:
        st.stats.fallback_steps += 1
    ev = StepEvent(tokens=new, accepted=v.accepted, drafted=v.drafted, finish=v.finish,
                   draft_seconds=draft_s, verify_seconds=timing.verify_seconds,
                   fallback=d.fallback, stats=st.stats, batch_size=timing.batch,
                   policy=timing.decision, step=st.steps, tree_nodes=nodes, logprobs=logprobs,
                   suffix_nodes=suffix_nodes, suffix_accepted=suffix_accepted,
                   grammar_accepted=grammar_accepted)
    st.steps += 1
    return ev


def _grammar_commit(r: StepRow, v: Verified) -> int:
    """Advance row ``r``'s matcher by its committed tokens (timed into ``r.grammar_seconds``);
    returns the accepted tokens only its grammar proposed (0 without a grammar)."""
    g = r.state.grammar
    if g is None:
        return 0
    t0 = time.perf_counter()
    g.commit(v.tokens)
    r.grammar_seconds += time.perf_counter() - t0
    return _grammar_accepted(r, v)


def _grammar_accepted(r: StepRow, v: Verified) -> int:
    """Accepted tokens of row ``r`` only its grammar proposed (forced, ``grammar_rows``)."""
    if not r.grammar_nodes:
        return 0
    if isinstance(v, TreeVerified):
        assert r.sourced is not None            # a tree row has its sources
        return sum(1 for j in v.path if r.sourced.sources[j] == DraftSource.GRAMMAR)
    return v.accepted                          # a forced chain: every draft is the grammar's


def _count(st: DecodeState, totals: AcceptanceCounter, v: Verified, nodes: int,
           suffix_nodes: int, suffix_accepted: int) -> None:
    """A row's drafts, acceptance and tree nodes, in its request's counts and the totals."""
    for c in (st.stats, totals):
        c.record(v.drafted, v.accepted)
        if nodes:
            c.record_tree(nodes)
        if suffix_nodes:
            c.record_suffix(suffix_nodes, suffix_accepted)


def step_feedback(plan: StepPlan, joining: bool, rows: list[StepRow], events: list[StepEvent],
                  timing: StepTiming, wasted_s: float, overhead: float | None) -> StepFeedback:
    """One observation of this step for the policy: ``rows`` and their ``events`` in job
    order; ``joining``: a drafter call uploaded a session's whole context; ``wasted_s``: seconds
    spent waiting on calls that brought no draft; ``overhead``: the cycle's seconds outside
    verify and draft (None: not a step's cost)."""
    by_label: dict[str, list[tuple[int, int]]] = {}
    trees: dict[str, list[tuple[int, int]]] = {}
    hybrid: dict[str, list[tuple[float, float]]] = {}
    for r, ev in zip(rows, events):
        proposer, src, v = r.state.req.proposer, r.sourced, r.verified
        if not ev.drafted or proposer is None or _no_drafter_node(src) \
                or (r.grammar_nodes and src is None):     # a forced chain: not the drafter's
            continue
        label = proposer.card.label
        if isinstance(v, TreeVerified):
            # the drafter's tree's value: what it would have committed of this path alone
            drafter = src.drafter_prefix(v.path) + 1 if src is not None and src.trie_nodes \
                else len(ev.tokens)
            trees.setdefault(label, []).append((r.shape.budget, min(drafter, len(ev.tokens))))
            if src is not None and src.trie_nodes:
                hybrid.setdefault(label, []).append(
                    (src.gain, len(ev.tokens) - min(drafter, len(ev.tokens))))
        else:
            by_label.setdefault(label, []).append((ev.drafted, ev.accepted))
    # Ramp steps (prompts waiting: no speculation whatever the cells say) and steps that
    # carry a joining session's prompt to the drafter are not what a steady step costs.
    # Waiting on calls that brought no draft is the drafter's failure (the circuit
    # breaker's business), not the price of the block the step ended up verifying.
    # A step that verified suffix candidates alone called no drafter: in the step cells
    # it would price the drafter's blocks of its size without their draft time (its verify
    # cell prices the suffix trees, SpeculationPolicy.suffix_cost).
    k = max(len(r.block) for r in rows) - 1
    called = any(r.draft.called for r in rows)
    return StepFeedback(
        batch=len(rows), k=k, verify_seconds=timing.verify_seconds,
        draft_seconds=max(0.0, timing.draft_seconds - wasted_s) if called else 0.0,
        record_cost=not (plan.waiting or joining or (k and not any(r.shape.k for r in rows))),
        blocks=by_label, trees=trees, hybrid=hybrid,
        committed=[len(ev.tokens) for ev in events], cycle_overhead=overhead,
        fell_back=frozenset(i for i, r in enumerate(rows) if r.draft.fallback))


def log_step(plan: StepPlan, joining: bool, fb: StepFeedback, timing: StepTiming) -> None:
    """The step's debug line: the policy's decision beside what the step measured."""
    if log.isEnabledFor(logging.DEBUG):
        d = timing.decision
        log.debug("step batch=%d waiting=%d joining=%s k=%d budget=%d explored=%s "
                  "expected=%.2f committed=%d estimated=%.1fms measured verify=%.1fms "
                  "draft=%.1fms mode=%s rows=%d",
                  fb.batch, plan.waiting, joining, d.k, d.budget, d.explored, d.expected_tokens,
                  sum(fb.committed), 1e3 * d.cost_seconds,
                  1e3 * timing.verify_seconds, 1e3 * timing.draft_seconds, d.mode or "-", fb.k + 1)


def _no_drafter_node(src: Sourced | None) -> bool:
    """Whether a step's tree holds no drafter node (suffix candidates alone): it says nothing
    of the drafter's acceptance."""
    return src is not None and not any(s & DraftSource.DRAFTER for s in src.sources[1:])
