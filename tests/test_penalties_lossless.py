"""Penalties, logit bias and min-p are lossless under speculation.

Greedy part (the tiny random-weight target): for each processor alone and combined, the
engine's output with speculation off, with chains and with trees equals, token for token, a slow
reference loop that runs the target over the full context for every token and applies the
penalty formulae written out here (not the engine's code). The drafter proposes that reference
(the penalised target's own choices) at most positions and a wrong token at the rest, so blocks
are both accepted deep (where the penalty state must advance inside the block) and rejected
(asserted). Each setting also changes the output against no processor (so the test can fail),
except min-p, which cannot change a greedy choice (asserted equal).

Sampled part (a fake target whose logits are a known table, ``tests/markov.py``): the tokens
sampled with penalties follow the penalised target's distribution, with chains, trees and
without speculation. The next-token distribution depends on the position's parity and on how
often each token was generated so far, so each transition is keyed by that state; conditional on
the states' visit counts the transition counts are multinomial with the exact penalised
probabilities (Anderson & Goodman 1957), and the summed Pearson chi-square over the states
visited at least ``MIN_VISITS`` times (a choice that depends on the visit counts only) is
chi-square with the summed degrees of freedom. With 1,600 requests of 8 tokens (about 12,000
transitions in the states tested) it sees, at alpha 1e-3 with power 0.9, a shift of 3.2 to 3.9
points of probability between the two most likely tokens of every state, depending on the
setting. :func:`test_the_test_catches_a_frozen_block_state` shows it failing on the bug that
speculative engines have shipped: every row of a block penalised with the state from before the
block (p < 1e-70 here).
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest
import torch
from scipy import stats

from dflash.core.sampling import Sampling, probs_from_logits
from verifier_svc import engine as engine_module
from verifier_svc.engine import Request, VerifierEngine

from doubles import ReferenceDrafter
from markov import TableDrafter, TableTarget

PROMPTS = [[72, 101, 108, 108, 111], [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12],
           [200, 201, 7, 7, 7, 31, 90, 114, 115, 116]]
MAX_NEW = 32
BLOCK = 8
TREE_BUDGET = 16


# ---------------------------------------------------------------------------- the reference
def penalise(logits: torch.Tensor, prompt: list[int], out: list[int], s: Sampling) -> torch.Tensor:
    """The processors' formulae on one row ``[V]``, token by token: repetition (prompt and
    output), then frequency and presence (output), then the bias."""
    x = logits.float().clone()
    r = s.repetition_penalty
    if r != 1.0:
        for t in set(prompt) | set(out):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in collections.Counter(out).items():
        x[t] = x[t] - s.frequency_penalty * c
        x[t] = x[t] - s.presence_penalty
    for t, b in s.logit_bias:
        x[t] = x[t] + b
    return x


def reference_greedy(hf_target, prompt: list[int], s: Sampling, n: int = MAX_NEW) -> list[int]:
    """Greedy decoding with the processors, the whole context through the target each token."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_target(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(penalise(logits, prompt, out, s).argmax()))
    return out


def plain_greedy(hf_target, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    return reference_greedy(hf_target, prompt, Sampling(), n)


def greedy_settings(banned: int, liked: int) -> dict[str, Sampling]:
    return {
        "presence": Sampling(presence_penalty=1.5),
        "frequency": Sampling(frequency_penalty=0.7),
        "frequency-negative": Sampling(frequency_penalty=-1.2, presence_penalty=0.4),
        "repetition": Sampling(repetition_penalty=1.8),
        "logit-bias": Sampling(logit_bias={banned: -100.0, liked: 3.0}),
        "min-p": Sampling(min_p=0.5),
        "combined": Sampling(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                             min_p=0.2, logit_bias={banned: -4.0}),
    }


SETTING_NAMES = list(greedy_settings(0, 1))


@pytest.fixture(scope="module")
def engine(target_model):
    e = VerifierEngine(target_model, spec_mode="fixed", tree_budget=TREE_BUDGET)
    yield e
    e.close()


def _ranks(sid: str, pos: int) -> int:
    """Where the drafter ranks the reference: first (proposed) at most positions, second
    (a chain proposes a wrong token; a tree holds it as a sibling) at some, out of its top-k
    (rejected by chains and trees alike) at others."""
    if pos % 5 == 3:
        return 1000
    return 1 if pos % 4 == 1 else 0


def run_engine(engine, target_model, prompt, s: Sampling, mode: str, want: list[int], sid: str
               ) -> tuple[list[int], list]:
    proposer = None
    if mode != "off":
        proposer = ReferenceDrafter(target_model, {sid: prompt + want}, block_size=BLOCK,
                                    ranks=_ranks, name=f"ref-{sid}")
    req = Request(request_id=sid, session_id=sid, prompt=list(prompt), sampling=s,
                  max_tokens=len(want), ignore_eos=True, proposer=proposer, spec_mode=mode)
    events = list(engine.generate(req))
    engine.close_session(sid)
    return [t for ev in events for t in ev.tokens], events


@pytest.mark.parametrize("setting", SETTING_NAMES)
def test_greedy_penalties_lossless(engine, target_model, hf_target, setting):
    accepted = rejected = tree_steps = 0
    changed = False
    for i, prompt in enumerate(PROMPTS):
        plain = plain_greedy(hf_target, prompt)
        banned = collections.Counter(plain).most_common(1)[0][0]
        s = greedy_settings(banned, (banned + 7) % 256)[setting]
        want = reference_greedy(hf_target, prompt, s)
        changed |= want != plain
        for mode in ("off", "fixed", "tree"):
            got, events = run_engine(engine, target_model, prompt, s, mode, want,
                                     f"g-{setting}-{i}-{mode}")
            assert got == want, f"{setting} {mode} prompt {i}: diverged at " \
                                f"{next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))}"
            for ev in events[1:]:
                accepted += ev.accepted
                rejected += ev.accepted < ev.drafted and ev.finish is None
                tree_steps += ev.tree_nodes > 0
            if mode != "off":
                assert events[-1].stats.drafts > 0
    if setting == "min-p":
        assert not changed        # min-p never removes the most likely token
    else:
        assert changed, f"{setting} did not change any output: the test could not fail"
    assert accepted > 3 * len(PROMPTS) and rejected > 3 * len(PROMPTS) and tree_steps > 0


def test_logit_bias_forces_and_bans(engine, target_model, hf_target):
    """A +100 bias makes its token the only greedy choice; -100 keeps one out entirely."""
    prompt = PROMPTS[0]
    forced = Sampling(logit_bias={42: 100.0})
    got, _ = run_engine(engine, target_model, prompt, forced, "fixed", [42] * 12, "force")
    assert got == [42] * 12
    plain = plain_greedy(hf_target, prompt, 12)
    ban = Sampling(logit_bias={t: -100.0 for t in set(plain)})
    want = reference_greedy(hf_target, prompt, ban, 12)
    got, _ = run_engine(engine, target_model, prompt, ban, "tree", want, "ban")
    assert got == want and not set(got) & set(plain)


# ---------------------------------------------------------------------------- sampled: chi-square
V = 3
ALPHA = 1e-3
TOKENS = 8                  # per request: the first from prefill, then one or two blocks
SAMPLE_BLOCK = 4
SAMPLE_BUDGET = 6
MIN_VISITS = 30
PROMPT = [0]
N_REQUESTS = 1600
# The target's logits by the position's parity (the same for every previous token, so the
# state is (parity, counts) and stays small); the drafter's q mixes the unpenalised target with
# the uniform distribution, so drafts are accepted and rejected.
BASE = torch.tensor([[1.0, 0.3, -0.5], [-0.2, 0.8, 0.4]])
TABLE = BASE[:, None, :].expand(2, V, V).contiguous()
SAMPLE_SETTINGS = {
    "freq-presence-rep": Sampling(temperature=1.0, frequency_penalty=0.6, presence_penalty=0.4,
                                  repetition_penalty=1.5),
    "freq-bias-top_p-min_p": Sampling(temperature=0.8, top_p=0.9, min_p=0.2,
                                      frequency_penalty=0.5, logit_bias={2: 0.7}),
    "neg-presence-bias": Sampling(temperature=1.0, presence_penalty=-0.6, frequency_penalty=0.3,
                                  logit_bias={0: -1.0}),
}


def exact_probs(s: Sampling, parity: int, counts: tuple[int, ...]) -> np.ndarray:
    """The penalised target's next-token distribution in a state (the prompt is ``PROMPT``)."""
    out = [t for t in range(V) for _ in range(counts[t])]
    x = penalise(BASE[parity], PROMPT, out, s)
    return probs_from_logits(x, s).double().numpy()


def state_counts(sequences: list[list[int]]) -> dict[tuple, np.ndarray]:
    """(parity of the last token's position, output counts so far) -> next-token counts."""
    c: dict[tuple, np.ndarray] = {}
    for out in sequences:
        counts = [0] * V
        for i, t in enumerate(out):
            key = ((len(PROMPT) - 1 + i) % 2, tuple(counts))
            c.setdefault(key, np.zeros(V, dtype=np.int64))[t] += 1
            counts[t] += 1
    return c


def goodness_of_fit(c: dict[tuple, np.ndarray], s: Sampling) -> tuple[float, int, float, int]:
    """Summed Pearson chi-square over the states visited >= MIN_VISITS times.
    Returns (statistic, df, p-value, transitions tested)."""
    stat, df, used = 0.0, 0, 0
    for (parity, counts), row in c.items():
        n = int(row.sum())
        if n < MIN_VISITS:
            continue
        p = exact_probs(s, parity, counts)
        support = p > 0
        assert row[~support].sum() == 0, f"state {parity, counts} emitted a token of probability 0"
        if support.sum() < 2:
            continue
        stat += stats.chisquare(row[support], n * p[support] / p[support].sum())[0]
        df += int(support.sum()) - 1
        used += n
    return stat, df, float(stats.chi2.sf(stat, df)), used


@functools.cache
def sample_run(setting: str, mode: str) -> tuple[dict, dict]:
    s = SAMPLE_SETTINGS[setting]
    eng = VerifierEngine(TableTarget(TABLE), spec_mode=mode, tree_budget=SAMPLE_BUDGET)
    q = 0.6 * probs_from_logits(TABLE, Sampling(temperature=s.temperature)) + 0.4 / V
    drafter = TableDrafter(q, SAMPLE_BLOCK) if mode != "off" else None
    seqs, info = [], {"accepted": 0, "rejected": 0, "deep": 0}
    try:
        for i in range(N_REQUESTS):
            req = Request(request_id=f"{mode}{i}", prompt=list(PROMPT), max_tokens=TOKENS,
                          sampling=Sampling(**{**vars(s), "seed": 10_000 * len(mode) + i}),
                          proposer=drafter)
            out = []
            for ev in eng.generate(req):
                out += ev.tokens
                if ev.drafted and ev.finish is None:
                    info["accepted"] += ev.accepted
                    info["rejected"] += ev.accepted < ev.drafted
                    info["deep"] += ev.accepted >= 2
            assert len(out) == TOKENS
            seqs.append(out)
    finally:
        eng.close()
    return state_counts(seqs), info


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "tree", "off"])
@pytest.mark.parametrize("setting", list(SAMPLE_SETTINGS))
def test_sampled_penalties_follow_the_penalised_target(setting, mode):
    counts, info = sample_run(setting, mode)
    if mode != "off":
        # accepted deep into blocks (the state advanced inside them) and rejected too
        assert info["deep"] > 0.1 * N_REQUESTS and info["rejected"] > 0.2 * N_REQUESTS
    stat, df, pval, used = goodness_of_fit(counts, SAMPLE_SETTINGS[setting])
    assert used > 0.8 * N_REQUESTS * TOKENS and df > 20
    assert pval > ALPHA, f"{setting} {mode}: biased, chi2={stat:.1f} df={df} p={pval:.2e}"


@pytest.mark.slow
def test_the_test_catches_a_frozen_block_state(monkeypatch):
    """Every row of a block penalised with the state before the block (drafts not counted)."""
    def frozen(row):
        logits, processor = row.logits, row.state.processor
        if processor is None:
            return logits
        return torch.cat([processor.apply(logits[r:r + 1]) for r in range(logits.shape[0])])

    monkeypatch.setattr(engine_module, "_processed", frozen)
    sample_run.cache_clear()
    try:
        counts, _ = sample_run("freq-presence-rep", "fixed")
    finally:
        sample_run.cache_clear()
    _, _, pval, _ = goodness_of_fit(counts, SAMPLE_SETTINGS["freq-presence-rep"])
    assert pval < ALPHA
