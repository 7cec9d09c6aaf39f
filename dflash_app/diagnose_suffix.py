"""Suffix drafts for ``dflash diagnose``: the verifier's modes ``suffix`` and ``hybrid`` and
adaptive's suffix arms, replayed over the target's greedy continuations.

A suffix candidate's worth depends on the text the session has seen, so it cannot be scored per
anchor like a drafter's block: the replay decodes each continuation again, step by step, as the
verifier would (one session per prompt, the prompts in order as one tenant):

* the session's ``SuffixIndex`` is synced with the prompt and first token and extended by each
  step's committed tokens, the tenant's recent answers kept in the verifier's ``AnswerStore``
  (with its ``--suffix-answer-tokens`` / ``--suffix-answer-total``), the candidates of each
  step from ``offer_for`` with one verifier-wide ``SuffixCalibration`` and a ``SessionRates``
  per session, taught by ``observe_walk`` after each verified tree;
* the step's shape is the speculation policy's own ``choose_shapes`` for a job of that mode
  (the policy holding the measured costs and the probe's acceptance,
  ``diagnose_modes.Context.policy``), and the tree is built by the verifier's pieces:
  ``build_tree`` over the drafter's top-k at that anchor (``diagnose_trees.drafter_tops``),
  merged with the suffix candidates by ``verifier_svc.proposals.merge_sources``, serving's own;
* greedy acceptance is the longest path of the tree along the target's own tokens (a chain:
  the drafter's accepted prefix at that anchor, from the probe), and the step's seconds are
  what the policy prices that shape at (``suffix_cost`` for a tree of suffix candidates alone,
  ``StepCostModel.estimate`` otherwise).

The loop mirrors the engine's step (``verifier_svc.proposals.suffix_offers`` / ``sourced``,
``verifier_svc.commit.commit_row``) by calling their public pieces;
``tests/test_diagnose_suffix.py`` runs the engine beside it and checks they commit the same
tokens step by step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from types import SimpleNamespace

from dflash.core.speculation import SpecMode, suffix_depth
from dflash.core.stats import AcceptanceCounter
from dflash.core.suffix import SuffixIndex
from verifier_svc.cost_model import StepCostModel, relative_rows
from verifier_svc.policy import Shape, SpeculationPolicy
from verifier_svc.proposals import merge_sources
from verifier_svc.suffix_drafts import (
    AnswerStore,
    SessionRates,
    Sourced,
    SuffixCalibration,
    SuffixOffer,
    observe_walk,
    offer_for,
)
from verifier_svc.tree import DraftTree, build_tree

TENANT = "diagnose"     # every probe prompt is one client's


@dataclasses.dataclass(frozen=True)
class SuffixSettings:
    """The verifier's suffix flags: ``--suffix`` (on: ``enabled``), ``--suffix-answer-tokens``,
    ``--suffix-answer-total``, ``--suffix-corpus`` (``""``: none) and ``--suffix-corpus-tokens``;
    ``fingerprint``: the target's, which the corpus must have been written for (None: not
    checked)."""

    enabled: bool
    answer_tokens: int
    answer_total: int
    corpus: str = ""
    corpus_tokens: int = 0
    fingerprint: str | None = None

    @classmethod
    def served(cls, fingerprint: str | None = None) -> "SuffixSettings":
        """What ``python -m verifier_svc`` runs with: its parser's defaults and ``DFLASH_*``
        environment (``DFLASH_SUFFIX``, ``DFLASH_SUFFIX_ANSWER_TOKENS``, ...), for the target
        of ``fingerprint``."""
        from verifier_svc import server

        va = server.parse_args(["--target", "-"])
        return cls(va.suffix == "on", int(va.suffix_answer_tokens), int(va.suffix_answer_total),
                   va.suffix_corpus, int(va.suffix_corpus_tokens), fingerprint)

    @functools.cached_property
    def corpus_index(self) -> SuffixIndex | None:
        """The corpus, loaded once (``verifier_svc.suffix_corpus.load_corpus``; a DataError
        naming ``--suffix-corpus`` when it is another target's, as the verifier refuses it)."""
        if not self.corpus:
            return None
        from verifier_svc.suffix_corpus import load_corpus

        return load_corpus(self.corpus, max_tokens=self.corpus_tokens, fingerprint=self.fingerprint)

    def answers(self) -> AnswerStore:
        """A fresh answer store as the verifier builds it (``verifier_svc.server``)."""
        return AnswerStore(self.answer_tokens, self.answer_total, corpus=self.corpus_index)


@dataclasses.dataclass(frozen=True)
class Stream:
    """One prompt and the target's greedy continuation.

    ``tokens``: prompt + continuation (token ids; the first anchor, the prefill's token, at
    ``prompt_len``); ``chain``: anchor -> drafts the drafter's full block there gets accepted
    (None: no drafter); ``tops``: anchor -> the drafter's top-k per draft position
    (``diagnose_trees.Tops``; None: no drafter)."""

    domain: str
    tokens: list[int]
    prompt_len: int
    chain: dict[int, int] | None = None
    tops: dict | None = None


@dataclasses.dataclass
class Replayed:
    """One mode replayed over every stream: ``steps`` decode steps committing ``tokens`` (bonus
    tokens included, the prefill's first tokens not) in ``seconds`` (the policy's prices);
    accepted drafts by source (a node the drafter and the suffix index both proposed counts as
    the drafter's, as the verifier counts it); ``shapes``: steps per shape (``shape_name``);
    ``committed``: per step, (tokens committed, of them accepted suffix-only candidates);
    ``chosen``: per step, the shape verified."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafter_accepted: int = 0
    suffix_accepted: int = 0
    shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    committed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    chosen: list[Shape] = dataclasses.field(default_factory=list)     # per step

    @property
    def tau(self) -> float:
        """Tokens per step (bonus included)."""
        return self.tokens / self.steps if self.steps else 1.0

    def choice(self) -> str:
        """The shapes chosen, most frequent first, with their shares of the steps (the shape
        alone when every step chose it: "off", "k = 3")."""
        if set(self.shapes) <= {"off"}:
            return "off"
        top = self.shapes.most_common()
        if len(top) == 1:               # one shape every step: its name, as a policy's choice
            return top[0][0]
        head = f"{top[0][0]} at {100 * top[0][1] / self.steps:.0f}% of steps"
        rest = ", ".join(f"{name} {100 * n / self.steps:.0f}%" for name, n in top[1:4])
        return head + (f" ({rest})" if rest else "")


def shape_name(sh: Shape, src: Sourced | None) -> str:
    """How a step's shape reads in the report: off, k = K, tree of N nodes (hybrid when suffix
    candidates joined it), suffix tree of N."""
    if sh.budget and not sh.k:
        return f"suffix tree of {sh.budget}" if sh.suffix else "off"
    if sh.budget:
        hybrid = src is not None and bool(src.trie_nodes)
        return f"tree of {sh.budget} nodes" + (" (hybrid)" if hybrid else "")
    return f"k = {sh.k}" if sh.k else "off"


class SuffixReplay:
    """The streams of one domain and what the verifier would run over them.

    Args:
        streams: in the order the prompts run (their answers become the tenant's).
        block_size: the drafter's block (a job's ``block_limit``; its suffix depth is one less).
        max_tokens: each request's ``max_tokens`` (the probe's continuation length).
        settings: the verifier's suffix flags (:meth:`SuffixSettings.served`).
        label: the drafter label the policy's acceptance is held under.
    """

    def __init__(self, streams: Sequence[Stream], *, block_size: int, max_tokens: int,
                 settings: SuffixSettings, label: str):
        if block_size < 1 or max_tokens < 1:
            raise ValueError(f"block_size, max_tokens: must be >= 1, got {block_size}, {max_tokens}")
        self.streams = list(streams)
        self.block_size, self.max_tokens = block_size, max_tokens
        self.settings, self.label = settings, label
        self._cache: dict[tuple, Replayed] = {}

    def run(self, policy: SpeculationPolicy, mode: str, budget: int = 0, *,
            tree_budget: int = 0) -> Replayed:
        """Every stream decoded in ``mode`` (``suffix``, ``hybrid``, ``adaptive``) with ``budget``
        nodes (0: the verifier's ``tree_budget`` for suffix and hybrid, the largest of the
        policy's budgets for adaptive), choices and prices from ``policy``. Cached per mode,
        budget and cost model (the same costs give the same replay)."""
        if mode not in (SpecMode.SUFFIX, SpecMode.HYBRID, SpecMode.ADAPTIVE):
            raise ValueError(f"mode: {mode!r} is not suffix, hybrid or adaptive")
        key = (mode, budget, tree_budget, id(policy.costs))
        if key in self._cache:
            return self._cache[key]
        # hybrid's shapes and trees do not depend on the costs: other costs only reprice them
        base = self._cache.get((mode, budget, tree_budget, None)) if mode == SpecMode.HYBRID else None
        if base is not None:
            model = policy.costs.fit()
            out = dataclasses.replace(base, seconds=sum(_price(policy, sh, model) for sh in base.chosen))
        else:
            nodes = budget or (tree_budget if mode != SpecMode.ADAPTIVE else
                               max(policy.tree_budgets, default=tree_budget))
            out = Replayed()
            cal, answers = SuffixCalibration(), self.settings.answers()
            for s in self.streams:
                self._stream(policy, mode, nodes, s, cal, answers, out)
            if mode == SpecMode.HYBRID:
                self._cache[(mode, budget, tree_budget, None)] = out
        self._cache[key] = out
        return out

    def _stream(self, policy: SpeculationPolicy, mode: str, nodes: int, s: Stream,
                cal: SuffixCalibration, answers: AnswerStore, out: Replayed) -> None:
        """One session: prefill's token, then decode steps until the continuation is
        committed; its answer kept for the tenant (as ``verifier_svc.commit.commit_row`` on finish)."""
        B, toks, P = self.block_size, s.tokens, s.prompt_len
        index, rates, stats = SuffixIndex(), SessionRates(), AcceptanceCounter()
        index.sync(toks[:P + 1])
        drafter = s.chain is not None
        proposer = SimpleNamespace(card=SimpleNamespace(label=self.label)) if drafter else None
        depth = B - 1 if self.settings.enabled else 0      # a job's suffix_limit with a drafter
        a, emitted, model = P, 1, policy.costs.fit()
        while a < len(toks) - 1 and emitted < self.max_tokens:
            limit = suffix_depth(depth, self.max_tokens, emitted)
            offer = offer_for(index, answers.indexes(TENANT), limit, cal, rates) if limit else None
            job = SimpleNamespace(mode=mode, block_limit=B if drafter else 1, emitted=emitted,
                                  stats=stats, tree_budget=nodes, suffix_limit=depth,
                                  req=SimpleNamespace(max_tokens=self.max_tokens, proposer=proposer))
            sh = policy.choose_shapes([job], 0, [offer]).shapes[0]
            src = _sourced(policy, self.label, sh, s.tops.get(a) if s.tops else None, offer, limit)
            truth = toks[a + 1:]
            if src is not None:
                path = greedy_path(src.tree, truth)
                suffix = src.suffix_only(path)
                if src.trie_nodes and offer is not None:
                    observe_walk(cal, offer, src, path)
            else:
                path, suffix = [], 0
                if sh.k:                # a chain: the drafter's accepted prefix at this anchor
                    path = [0] * min(sh.k, (s.chain or {}).get(a, 0), len(truth))
            commit = min(len(path) + 1, len(truth))
            # the request's own counts, as the engine records them (adaptive's per-request table)
            stats.record(src.tree.max_depth if src is not None else sh.k, len(path))
            out.steps += 1
            out.tokens += commit
            out.seconds += _price(policy, sh, model)
            out.suffix_accepted += suffix
            out.drafter_accepted += len(path) - suffix
            out.shapes[shape_name(sh, src)] += 1
            out.committed.append((commit, suffix))
            out.chosen.append(sh)
            index.extend(toks[a + 1:a + 1 + commit])
            a += commit
            emitted += commit
        if self.settings.enabled:
            answers.add(TENANT, toks[P:a + 1])


def _sourced(policy: SpeculationPolicy, label: str, sh: Shape, tops, offer: SuffixOffer | None,
             limit: int) -> Sourced | None:
    """The tree a step verifies, as serving builds it (``verifier_svc.proposals.merge_sources``;
    a drafter that never fails: no fallback trees): the drafter's DDTree from its top-k
    (hybrid: the suffix candidates worth more than its marginal node merged in), suffix
    candidates alone, or None (a chain, or no speculation)."""
    tree = None
    if sh.budget and sh.k and tops is not None:
        top_ids, top_lp = tops
        tree = build_tree(top_ids[:sh.k], top_lp[:sh.k], sh.budget)
    return merge_sources(sh, tree, offer, limit,
                         lambda: policy.drafter_node_value(label, sh.budget, limit))


def _price(policy: SpeculationPolicy, sh: Shape, model) -> float:
    """Seconds of the step as the policy prices its shape (``choose_shapes``' arms). Costs
    without verify cells (a deployment's step cells) price a suffix tree as the policy's prior
    does, in decodes (``relative_rows``), times a plain step."""
    costs = policy.costs
    if sh.budget and sh.suffix and not sh.k:
        if costs.verify_estimate(1, 0) is None:
            return costs.estimate(1, 0, model) * relative_rows(sh.budget)
        return policy.suffix_cost(1, sh.budget, model)
    return costs.estimate(1, sh.verified, model)


def greedy_path(tree: DraftTree, truth: Sequence[int]) -> list[int]:
    """Block indices the greedy walk accepts when the target's tokens are ``truth`` (its
    continuation after the anchor): from the root, the child carrying the next token (the first
    of equal siblings, as ``verify_trees`` walks), until none does or ``truth`` ends."""
    children: dict[tuple[int, int], int] = {}
    for j, (tok, par) in enumerate(zip(tree.tokens, tree.parents[1:]), start=1):
        children.setdefault((par, tok), j)
    node, path = 0, []
    for tok in truth:
        nxt = children.get((node, int(tok)))
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def replays(seqs, scores, tops, *, block_size: int, max_tokens: int, label: str,
            settings: SuffixSettings | None = None) -> dict[str, SuffixReplay]:
    """One :class:`SuffixReplay` per domain (and ``"all"``) of the probe's sequences
    (``diagnose_tf.ProbeSeq``), with the served drafter's per-anchor acceptance ``scores``
    (``diagnose_tf.Scores``, every anchor) and top-k ``tops`` (``diagnose_trees.drafter_tops``).
    ``{}`` when the verifier serves no suffix candidates (``--suffix off``)."""
    settings = settings or SuffixSettings.served()
    if not settings.enabled:
        return {}
    chains: list[dict[int, int]] = [{} for _ in seqs]
    for p, a, acc in zip(scores.prompt.tolist(), scores.anchor.tolist(), scores.accepted.tolist()):
        chains[p][a] = acc
    streams = [Stream(s.domain, s.ids.tolist(), s.prompt_len, chains[i], tops[i] if tops else None)
               for i, s in enumerate(seqs)]
    out = {"all": streams}
    for st in streams:
        out.setdefault(st.domain, []).append(st)
    return {dom: SuffixReplay(v, block_size=block_size, max_tokens=max_tokens, settings=settings,
                              label=label) for dom, v in out.items()}


def plain_costs(seconds: float, per_row: float, top: int) -> StepCostModel:
    """A cost model of ``seconds + per_row * k`` per step and verify at every ``k <= top``
    (each cell confirmed): for tests and examples."""
    m = StepCostModel()
    for k in range(top + 1):
        for _ in range(2):
            m.observe_step(1, k, seconds + per_row * k)
            m.observe_verify(1, k, seconds + per_row * k)
    return m
