"""``dflash diagnose`` prices suffix candidates (``dflash_app/diagnose_suffix.py``): the replay
accepts what a brute-force search of the stream says it can, commits what the verifier's engine
commits step by step with the verifier's own suffix settings, and its modes are in the table."""

from __future__ import annotations

import random

import pytest
import torch

from dflash.core.suffix import MAX_MATCH, MAX_OCCURRENCES, proposal_depth
from dflash_app.diagnose_suffix import (
    Stream,
    SuffixReplay,
    SuffixSettings,
    plain_costs,
    replays,
)
from verifier_svc.policy import SpeculationPolicy

from markov import TableTarget

B = 8
BIG = 64            # a node budget that holds every trie (MAX_TRIE_NODES)


def free_rows_policy() -> SpeculationPolicy:
    """Verify rows cost nothing: mode suffix then verifies every candidate it has."""
    p = SpeculationPolicy("suffix", explore_every=0)
    p.costs = plain_costs(0.01, 0.0, BIG)
    return p


def brute_accepted(stream: list[int], truth: list[int], limit: int) -> int:
    """Drafts greedy decoding accepts from the best earlier occurrence of the stream's longest
    suffix (SuffixDecoding), found by comparing every position: the longest match (at most
    MAX_MATCH tokens) whose occurrence has a next token, its most recent MAX_OCCURRENCES
    occurrences, each continuation ``proposal_depth(match, limit)`` deep, against ``truth``."""
    n, best, ends = len(stream), 0, []
    for e in range(n - 1):
        m = 0
        while m < MAX_MATCH and e - m >= 0 and stream[e - m] == stream[n - 1 - m]:
            m += 1
        if m > best:
            best, ends = m, [e]
        elif m == best and m:
            ends.append(e)
    if not best:
        return 0
    go = proposal_depth(best, limit)
    out = 0
    for e in ends[-MAX_OCCURRENCES:]:
        cont = stream[e + 1:e + 1 + go]
        k = 0
        while k < len(cont) and k < len(truth) and cont[k] == truth[k]:
            k += 1
        out = max(out, k)
    return out


def test_replay_accepts_what_a_brute_force_search_finds():
    """A continuation that copies its prompt, diverges, and repeats itself: every step of the
    replay (mode suffix, a budget that holds every candidate) accepts exactly the longest
    earlier continuation that matches the target's tokens."""
    prompt = list(range(50, 70)) + [1, 2]
    answer = list(range(55, 66)) + [90, 91] + list(range(57, 63)) + [92, 93, 90, 91, 92, 93, 94] \
        + list(range(60, 69)) + [95, 50, 51, 52]
    max_tokens = len(answer)
    tokens = prompt + answer
    s = SuffixSettings(enabled=True, answer_tokens=0, answer_total=0)
    r = SuffixReplay([Stream("x", tokens, len(prompt))], block_size=B, max_tokens=max_tokens,
                     settings=s, label="d").run(free_rows_policy(), "suffix", BIG)
    want, a, emitted = [], len(prompt), 1
    while a < len(tokens) - 1 and emitted < max_tokens:
        limit = min(B - 1, max_tokens - emitted - 1)
        acc = brute_accepted(tokens[:a + 1], tokens[a + 1:], limit) if limit else 0
        commit = min(acc + 1, len(tokens) - 1 - a)
        want.append((commit, acc))
        a += commit
        emitted += commit
    assert r.committed == want
    assert r.tokens == len(answer) - 1 and r.suffix_accepted == sum(x for _, x in want)
    assert max(c for c, _ in want) >= 5 and sum(c == 1 for c, _ in want) >= 3   # copies and misses


# ---------------------------------------------------------------------- the engine beside it
def _markov_target(seed: int = 3, v: int = 24) -> TableTarget:
    g = torch.Generator().manual_seed(seed)
    return TableTarget(torch.randn(2, v, v, generator=g) * 3)


def _engine_run(settings: SuffixSettings, mode: str, prompts, max_tokens: int, policy):
    from verifier_svc.engine import Request, VerifierEngine

    engine = VerifierEngine(_markov_target(), spec_mode=mode, suffix=settings.enabled,
                            answers=settings.answers())
    engine.policy.costs = policy.costs
    engine.policy.observe = lambda fb: None        # the same prices every step, as the replay
    out = []
    try:
        for i, p in enumerate(prompts):
            events = list(engine.generate(Request(request_id=f"r{i}", prompt=list(p),
                                                  max_tokens=max_tokens, block_size=B)))
            out.append(([t for ev in events for t in ev.tokens],
                        [(len(ev.tokens), ev.suffix_accepted) for ev in events[1:]]))
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("env", [{}, {"DFLASH_SUFFIX_ANSWER_TOKENS": "0"}, {"DFLASH_SUFFIX": "off"}])
@pytest.mark.parametrize("mode", ["suffix", "adaptive"])
def test_replay_commits_what_the_engine_commits_with_the_verifiers_settings(monkeypatch, env, mode):
    """The verifier's engine, built as its server builds it from the same flags' environment,
    and the replay with ``SuffixSettings.served()`` commit the same tokens at every step, over
    two requests of one tenant (the second repeats the first's prompt, so the tenant's recent
    answers decide its candidates). A replay with other index settings (answers kept or not,
    suffix on or off, another depth or budget) fails here."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = SuffixSettings.served()
    rng = random.Random(1)
    prompt = [rng.randrange(24) for _ in range(12)]
    max_tokens = 48
    costs_from = SpeculationPolicy("adaptive", explore_every=0)
    costs_from.costs = plain_costs(0.01, 0.001, BIG)
    ran = _engine_run(settings, mode, [prompt, prompt], max_tokens, costs_from)
    streams = [Stream("x", prompt + out, len(prompt)) for out, _ in ran]
    policy = SpeculationPolicy("adaptive", explore_every=0)
    policy.costs = costs_from.costs
    r = SuffixReplay(streams, block_size=B, max_tokens=max_tokens, settings=settings,
                     label="d").run(policy, mode, tree_budget=15)
    engine_steps = [step for _, steps in ran for step in steps]
    assert r.committed == engine_steps
    first, second = (sum(x for _, x in steps) for _, steps in ran)
    if not settings.enabled:
        assert first == second == 0
    elif settings.answer_tokens:
        assert second > first               # the first answer's copies add to its own
    else:
        assert second == first


def test_suffix_off_replays_nothing(monkeypatch):
    monkeypatch.setenv("DFLASH_SUFFIX", "off")
    assert replays([], None, None, block_size=B, max_tokens=8, label="d") == {}


# ---------------------------------------------------------------------- the table of modes
def _drafted_streams(n_prompts: int = 3):
    """Streams of a repeating table target, with a drafter that is right at its first draft
    position only (a chain accepts one draft; its top-2 holds the right token at depth 1)."""
    rng = random.Random(0)
    from verifier_svc.engine import Request, VerifierEngine

    engine = VerifierEngine(_markov_target(5), spec_mode="off")
    out = []
    try:
        for i in range(n_prompts):
            p = [rng.randrange(24) for _ in range(10)]
            toks = p + [t for ev in engine.generate(Request(request_id=f"p{i}", prompt=p,
                                                            max_tokens=40)) for t in ev.tokens]
            tops = {}
            for a in range(len(p), len(toks) - 1):
                ids = torch.tensor([[toks[a + 1], (toks[a + 1] + 1) % 24]] +
                                   [[23, 22]] * (B - 2))
                lp = torch.tensor([[-0.1, -2.5]] + [[-1.0, -1.5]] * (B - 2))
                tops[a] = (ids, lp)
            out.append(Stream("x", toks, len(p), {a: 1 for a in tops}, tops))
    finally:
        engine.close()
    return out


def test_diagnose_lists_suffix_and_hybrid_rows():
    from dflash_app.diagnose_cost import CostTable, payoff

    streams = _drafted_streams()
    costs = plain_costs(0.01, 0.0004, B - 1)
    table = CostTable(costs, {}, {}, "synthetic", [plain_costs(0.01, 0.0004, B - 1) for _ in range(2)])
    s = SuffixSettings(enabled=True, answer_tokens=0, answer_total=0)
    rp = SuffixReplay(streams, block_size=B, max_tokens=40, settings=s, label="diagnose")
    blocks = [(B - 1, 1)] * 100
    p = payoff(table, blocks, B, trees={3: 2.0, 7: 2.0}, tree_budgets=(3, 7), tree_budget=7,
               replay=rp)
    modes = [r.mode for r in p.rows]
    assert modes == ["off", "fixed", *(f"chain:{k}" for k in range(1, B - 1)), "tree:3", "tree:7",
                     "suffix", "hybrid:3", "hybrid:7", "adaptive", "adaptive (race)"]
    hybrid, suffix, ad = p.row("hybrid:7"), p.row("suffix"), p.row("adaptive")
    # a drafter node is right once per step; suffix candidates add to it in the hybrid tree
    assert hybrid.accepted_by_source["drafter"] > 0 and hybrid.accepted_by_source["suffix"] > 0
    assert hybrid.tokens > 2.0 and suffix.accepted_by_source["drafter"] == 0
    assert ad.accepted_by_source["suffix"] > 0 and "% of steps" in ad.choice
    assert "suffix" in p.sentence() and "hybrid 3 nodes" in p.sentence()
    assert p.as_dict()["adaptive_choice"] == ad.choice
    # the mode race plays the best priced of the modes it races; diagnose names the fastest
    # pinnable mode as the one adaptive should match
    from dflash_app.diagnose_modes import race_arms, should_match

    race, match = p.row("adaptive (race)"), should_match(p.rows)
    raced = [r for r in p.rows if r.mode in ("off", "fixed", "suffix", "hybrid:7", "adaptive")]
    from types import SimpleNamespace

    assert race_arms(SimpleNamespace(tree_budgets=(3, 7))) == ["adaptive", "off", "suffix", "hybrid:7", "fixed"]
    assert race.speedup == max(r.speedup for r in raced)
    assert race.choice.startswith("plays " + max(raced, key=lambda r: r.speedup).mode)
    assert match.speedup == max(r.speedup for r in p.rows if not r.mode.startswith("adaptive"))
    assert f"adaptive should match {match.mode}" in p.sentence()
    assert p.as_dict()["should_match"] == match.mode and p.best.mode != "adaptive (race)"


def test_a_deployments_accepted_tokens_by_source_are_read_from_its_metrics():
    from prometheus_client import CollectorRegistry

    from dflash.serving.metrics import VerifierMetrics
    from dflash.serving.telemetry import serve_metrics
    from dflash_app.diagnose_cost import scrape

    registry = CollectorRegistry()
    m = VerifierMetrics(registry)
    m.step("d@1", drafted=7, accepted=5, fallback=None, verify_s=0.01, draft_s=0.01, wire_s=0.0,
           context_bytes=0, tree_nodes=15, suffix_nodes=6, suffix_accepted=3)
    m.step("d@1", drafted=3, accepted=2, fallback=None, verify_s=0.01, draft_s=0.01, wire_s=0.0,
           context_bytes=0)
    server = serve_metrics(registry, 0, "127.0.0.1")
    try:
        dep = scrape(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert dep.by_source == {"d@1": {"drafter": 4.0, "suffix": 3.0}}
    assert dep.suffix_nodes == {"d@1": 6.0}


def test_hybrid_repriced_at_other_costs_is_its_replay_at_those_costs():
    """Hybrid's trees do not depend on the costs, so the spread's rounds reprice one replay:
    the same figures as replaying at those costs."""
    from dflash_app.diagnose_modes import Context

    streams = _drafted_streams(2)
    s = SuffixSettings(enabled=True, answer_tokens=0, answer_total=0)
    cheap, dear = plain_costs(0.01, 0.0001, B - 1), plain_costs(0.01, 0.003, B - 1)
    got = []
    for first in (None, cheap):
        rp = SuffixReplay(streams, block_size=B, max_tokens=40, settings=s, label="diagnose")
        if first is not None:
            rp.run(Context(first, [(B - 1, 1)] * 10, {7: 2.0}, B, (7,), 7).policy((7,)), "hybrid", 7)
        r = rp.run(Context(dear, [(B - 1, 1)] * 10, {7: 2.0}, B, (7,), 7).policy((7,)), "hybrid", 7)
        got.append((r.committed, round(r.seconds, 9)))
    assert got[0] == got[1] and got[0][1] > 0


# ---------------------------------------------------------------------- with a drafter
@pytest.mark.parametrize("mode, budget", [("hybrid", 3), ("hybrid", 7), ("adaptive", 7)])
def test_replay_commits_what_the_engine_commits_with_a_drafter(tmp_path, mode, budget):
    """Modes hybrid and adaptive with a real drafter (partial acceptance: a wrong rope spreads
    it) over a target whose text repeats: the engine and the replay, built from the probe's
    continuations, its per-anchor acceptance and top-k, commit the same tokens, and the same
    suffix-only accepted tokens, step by step (the drafter's tree, the suffix candidates above
    its marginal node, the merge under the budget; adaptive's chains, hybrid trees and suffix
    arms, from the same policy figures and each request's own counts)."""
    import json

    from dflash_app.diagnose_tf import Head, score
    from dflash_app.diagnose_trees import drafter_tops
    from dflash_app.probe import InProcessProbe
    from verifier_svc.engine import Request, VerifierEngine

    from tap_models import letter_prompt, make_probe_drafter, make_tap_target, mixed_prompt

    target = make_tap_target(tmp_path / "target")
    d = make_probe_drafter(tmp_path / "recent", target, recent=True, block_size=B)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1e8
    (d / "config.json").write_text(json.dumps(cfg))
    probe = InProcessProbe(target, d)
    prompts = [mixed_prompt(), mixed_prompt("c", "d", 28, 14), letter_prompt("k", 9)]
    max_new = 1 + 3 * B
    settings = SuffixSettings(enabled=True, answer_tokens=0, answer_total=0)
    label = probe.engine.card.label
    policy = SpeculationPolicy(mode, explore_every=0, tree_budgets=(budget,))
    policy.costs = plain_costs(0.01, 0.001, BIG)
    policy.observe_acceptance(label, [(B - 1, 1)] * 30 + [(B - 1, 3)] * 10)
    for _ in range(3):
        policy.acceptance.observe_trees(label, [(budget, 2)])
    engine = VerifierEngine(probe.target, spec_mode=mode, tree_budget=budget, tree_budgets=(budget,),
                            suffix=settings.enabled, answers=settings.answers())
    engine.policy.costs, engine.policy.acceptance = policy.costs, policy.acceptance
    engine.policy.observe, engine.policy.explore.every = lambda fb: None, 0
    try:
        want = []
        for i, p in enumerate(prompts):
            events = list(engine.generate(Request(request_id=f"h{i}", prompt=list(p),
                                                  max_tokens=max_new, proposer=probe.engine)))
            want += [(len(ev.tokens), ev.suffix_accepted) for ev in events[1:]]
        seqs = probe.collect(prompts, ["x"] * 3, max_new_tokens=max_new)
        head = Head.of(probe.head.lm_head, None)
        kw = dict(layer_ids=probe.layer_ids, mask_token_id=probe.drafter.cfg.mask_token_id)
        scores = score(probe.drafter, probe.head, head, seqs, **kw)
        tops = drafter_tops(probe.drafter, probe.head, head, seqs, [budget], **kw)
    finally:
        engine.close()
        probe.close()
    r = replays(seqs, scores, tops, block_size=B, max_tokens=max_new, label=label,
                settings=settings)["all"].run(policy, mode, budget)
    assert r.committed == want
    assert 0 < r.suffix_accepted and 0 < r.drafter_accepted
    if mode == "adaptive":      # it chose among several shapes
        assert len(r.shapes) > 1, r.shapes
