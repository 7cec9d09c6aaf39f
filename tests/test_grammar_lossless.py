"""Grammar masks are lossless under speculation, and the output never leaves the grammar.

Greedy part (the tiny random-weight target, byte tokenizer): for a JSON schema, a regex and a
choice, the engine's output with speculation off, with chains and with trees equals, token for
token, a slow reference loop that runs the target over the full context for every token and
takes the argmax of the logits masked by an llguidance matcher of its own (not the engine's
code). The drafter proposes that reference at most positions and, at others, a wrong token first
(``t + 1``: mostly outside the grammar) with the reference as its sibling, so chains are cut by
pruning and trees hold refused and admitted branches side by side.

Sampled part (``tests/markov.py``'s table target over the alphabet a, b, c and EOS): the regex
``(?:[bc]|a[bc])*a?`` (no "aa") makes the mask depend on the path; the sampled tokens follow the
masked, renormalised target distribution with chains, trees and without speculation (the summed
Pearson chi-square over the (parity, last-token-is-a) states, as tests/test_penalties_lossless.py
does), and a flat mask (every row masked with the committed state, the bug TensorRT-LLM #18892
describes) is caught: its output leaves the grammar.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from scipy import stats

from dflash.core.grammar import MAX_FORCED, GrammarCache, GrammarSpec, GrammarState, GrammarTokenizer
from dflash.core.sampling import Sampling, probs_from_logits
from verifier_svc.engine import Request, VerifierEngine

from doubles import ReferenceDrafter
from helpers import fixed_os_randomness
from markov import TableDrafter, TableTarget

PROMPTS = [[72, 101, 108, 108, 111], [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12]]
BLOCK = 8
TREE_BUDGET = 16
MAX_NEW = 70
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "n", "ok", "color"], "additionalProperties": False}
REGEX = r"[a-f]{2,5}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMARS = {
    "json": (GrammarSpec("json_schema", json.dumps(SCHEMA)),
             lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
    "regex": (GrammarSpec("regex", REGEX), lambda s: re.fullmatch(REGEX, s) is not None),
    "choice": (GrammarSpec("choice", json.dumps(CHOICES)), lambda s: s in CHOICES),
}


def _text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8")


def reference_constrained(hf_target, tokenizer, prompt: list[int], spec: GrammarSpec, eos: int,
                          n: int = MAX_NEW) -> list[int]:
    """Greedy constrained decoding, one full forward per token, masked by llguidance directly."""
    import llguidance
    import llguidance.hf
    V = hf_target.config.vocab_size
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=V, eos_token=[eos])
    if spec.kind == "json_schema":
        g = llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(spec.text), overrides={"whitespace_flexible": False, "item_separator": ", ",
                                              "key_separator": ": "})
    elif spec.kind == "regex":
        g = llguidance.LLMatcher.grammar_from_regex(spec.text)
    else:
        g = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(spec.text)))
    m = llguidance.LLMatcher(lt, g)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_target(torch.tensor([prompt + out])).logits[0, -1].float()
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                                 bitorder="little")[:V].astype(bool)
            t = int(logits.masked_fill(~torch.from_numpy(bits), -torch.inf).argmax())
            out.append(t)
            if t == eos:
                break
            assert m.consume_token(t)
    return out


@pytest.fixture(scope="module")
def engine(target_model):
    e = VerifierEngine(target_model, spec_mode="fixed", tree_budget=TREE_BUDGET)
    yield e
    e.close()


def _ranks(sid: str, pos: int) -> int:
    """The reference ranks second (a wrong token first) at some positions, first elsewhere."""
    return 1 if pos % 3 == 1 else 0


def run(engine, target_model, prompt, spec, mode, want, sid, drafter=True):
    proposer = None
    if drafter and mode != "off":
        proposer = ReferenceDrafter(target_model, {sid: prompt + want}, block_size=BLOCK,
                                    ranks=_ranks, name=f"ref-{sid}")
    req = Request(request_id=sid, session_id=sid, prompt=list(prompt), max_tokens=MAX_NEW,
                  proposer=proposer, spec_mode=mode, grammar=spec)
    events = list(engine.generate(req))
    engine.close_session(sid)
    return [t for ev in events for t in ev.tokens], events


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_masks_lossless_and_inside_the_grammar(engine, target_model, hf_target, tokenizer, name):
    spec, valid = GRAMMARS[name]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = tree_steps = 0
    for i, prompt in enumerate(PROMPTS):
        want = reference_constrained(hf_target, tokenizer, prompt, spec, eos)
        assert want[-1] == eos and valid(_text(want[:-1])), _text(want)
        for mode in ("off", "fixed", "tree"):
            got, events = run(engine, target_model, prompt, spec, mode, want, f"{name}-{i}-{mode}")
            assert got == want, f"{name} {mode} prompt {i}: {_text(got)!r} != {_text(want)!r}"
            assert events[-1].finish == "stop"
            if mode == "off":
                assert events[-1].stats.drafts == 0       # no speculation, no forced drafts
            for ev in events[1:]:
                # the wrong first token is refused before the forward: a chain stops short
                cut += mode == "fixed" and ev.drafted < BLOCK - 1 and ev.finish is None
                tree_steps += ev.tree_nodes > 0
    assert tree_steps > 0
    assert cut > 0 or name == "choice"    # a choice is forced after its first token: no drafts cut


def test_refused_drafts_are_pruned_with_their_subtrees(engine):
    """walk() keeps a node iff its parent's mask admits it, and masks each row by its path."""
    g = engine.grammars.state(GrammarSpec("regex", "ab(c|d)e"))
    a, b, c, d, e, x = (ord(ch) for ch in "abcdex")
    # root -> a -> b -> {c -> e, x -> e, d}; root -> x -> a
    tokens, parents = [a, b, c, x, d, e, e, x, a], [-1, 0, 1, 2, 2, 2, 3, 4, 0, 8]
    keep, masks = g.walk(tokens, parents)
    assert keep == [0, 1, 2, 3, 5, 6]             # x after b, its child, and the x root branch pruned
    allowed = [set(torch.nonzero(m)[:, 0].tolist()) for m in masks]
    assert allowed[:4] == [{a}, {b}, {c, d}, {e}]
    assert allowed[4] == {e}                      # after "abd"
    assert g.walk([], [-1])[0] == [0] and g.mask()[a]   # the matcher is back where it began


def test_a_fully_forced_schema_needs_no_drafter(engine, target_model, tokenizer):
    """A const schema: every token is forced; speculation without a drafter verifies the whole
    answer in one block, and the output equals the one with speculation off."""
    schema = {"const": {"id": 7, "tags": ["a", "b"], "ok": True}}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outs = {}
    for mode in ("off", "fixed"):
        got, events = run(engine, target_model, PROMPTS[0], spec, mode, [], f"const-{mode}", drafter=False)
        outs[mode] = (got, events)
    got, events = outs["fixed"]
    assert got == outs["off"][0] and got[-1] == eos
    assert json.loads(_text(got[:-1])) == schema["const"]
    st = events[-1].stats
    # every forced draft accepted: each step commits its block and one bonus token
    assert st.grammar_accepted_tokens == st.grammar_nodes == st.accepted_tokens == len(got) - 1 - st.drafts
    assert len(events) == 1 + st.drafts == 1 + -(-(len(got) - 1) // (MAX_FORCED + 1))
    assert outs["off"][1][-1].stats.grammar_nodes == 0


def test_a_forced_stretch_as_deep_as_the_block_asks_the_drafter_nothing(engine, target_model):
    """A const schema with a drafter (blocks of BLOCK - 1 drafts): every step whose forced
    stretch holds at least that many tokens verifies it without a draft call (a draft there
    could only repeat it or be refused); only the tail, shorter than a block, asks the drafter.
    Output and steps equal those without a drafter."""
    schema = {"const": {"name": "a forced stretch", "tags": ["x", "y", "z"], "n": 12345}}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    want, plain = run(engine, target_model, PROMPTS[0], spec, "fixed", [], "deep-none", drafter=False)
    proposer = ReferenceDrafter(target_model, {"deep": PROMPTS[0] + want}, block_size=BLOCK,
                                name="ref-deep")
    asked: list[int] = []
    inner = proposer.propose
    proposer.propose = lambda reqs: (asked.extend(r.block_size for r in reqs if r.block_size > 1),
                                     inner(reqs))[1]
    req = Request(request_id="deep", session_id="deep", prompt=list(PROMPTS[0]), max_tokens=MAX_NEW,
                  proposer=proposer, spec_mode="fixed", grammar=spec)
    events = list(engine.generate(req))
    engine.close_session("deep")
    assert [t for ev in events for t in ev.tokens] == want
    assert len(events) == len(plain) >= 4          # several full forced steps
    assert len(asked) <= 1, asked                  # at most the tail asked for drafts


def test_forced_stretches_are_accepted_through_the_tree(engine, target_model, hf_target, tokenizer):
    spec = GRAMMARS["json"][0]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = reference_constrained(hf_target, tokenizer, PROMPTS[1], spec, eos)
    got, events = run(engine, target_model, PROMPTS[1], spec, "tree", want, "forced-tree")
    assert got == want
    st = events[-1].stats
    assert st.tree_drafts > 0 and st.grammar_nodes > 0 and st.grammar_accepted_tokens > 0
    assert st.drafter_accepted_tokens + st.grammar_accepted_tokens + st.suffix_accepted_tokens \
        == st.accepted_tokens


# ---------------------------------------------------------------------------- sampled: chi-square
V = 4                      # a, b, c, EOS (never drawn: its logit is -inf)
EOS = 3
ALPHA = 1e-3
TOKENS = 8
N_REQUESTS = 1200
MIN_VISITS = 30
NO_AA = "(?:[bc]|a[bc])*a?"
BASE = torch.tensor([[1.2, 0.3, -0.5, -torch.inf], [-0.2, 0.8, 0.4, -torch.inf]])
TABLE = BASE[:, None, :].expand(2, V, V).contiguous()
SAMPLING = Sampling(temperature=1.0)


@functools.cache
def abc_grammars() -> GrammarCache:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    return GrammarCache(GrammarTokenizer(fast, V, [EOS]))


def exact_probs(parity: int, after_a: bool) -> np.ndarray:
    x = BASE[parity].clone()
    if after_a:
        x[0] = -torch.inf
    return probs_from_logits(x, SAMPLING).double().numpy()


@functools.cache
def sample_run(mode: str) -> tuple[dict, dict, int]:
    eng = VerifierEngine(TableTarget(TABLE), spec_mode=mode, tree_budget=6, grammars=abc_grammars())
    q = 0.6 * probs_from_logits(TABLE, SAMPLING) + 0.4 * torch.tensor([1 / 3] * 3 + [0.0])
    drafter = TableDrafter(q, 4) if mode != "off" else None
    counts: dict[tuple, np.ndarray] = {}
    info = {"accepted": 0, "rejected": 0}
    outside = 0
    try:
        with fixed_os_randomness(1_000_000 * ("fixed", "tree", "off").index(mode)):
            for i in range(N_REQUESTS):
                req = Request(request_id=f"{mode}{i}", prompt=[2], max_tokens=TOKENS, ignore_eos=True,
                              sampling=SAMPLING, proposer=drafter, grammar=GrammarSpec("regex", NO_AA))
                out: list[int] = []
                for ev in eng.generate(req):
                    out += ev.tokens
                    if ev.drafted and ev.finish is None:
                        info["accepted"] += ev.accepted
                        info["rejected"] += ev.accepted < ev.drafted
                assert len(out) == TOKENS
                outside += any(a == b == 0 for a, b in zip(out, out[1:]))
                for j, t in enumerate(out):
                    key = (j % 2, j > 0 and out[j - 1] == 0)   # the prompt [2] sits at position 0
                    counts.setdefault(key, np.zeros(V, dtype=np.int64))[t] += 1
    finally:
        eng.close()
    return counts, info, outside


def goodness_of_fit(c: dict[tuple, np.ndarray]) -> tuple[float, int, float]:
    stat, df = 0.0, 0
    for (parity, after_a), row in c.items():
        n = int(row.sum())
        if n < MIN_VISITS:
            continue
        p = exact_probs(parity, after_a)
        support = p > 0
        assert row[~support].sum() == 0, f"state {parity, after_a} emitted a masked token"
        stat += stats.chisquare(row[support], n * p[support] / p[support].sum())[0]
        df += int(support.sum()) - 1
    return stat, df, float(stats.chi2.sf(stat, df))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "tree", "off"])
def test_sampled_output_follows_the_masked_target(mode):
    counts, info, outside = sample_run(mode)
    assert outside == 0
    if mode != "off":
        assert info["accepted"] > N_REQUESTS and info["rejected"] > 0.2 * N_REQUESTS
    stat, df, pval = goodness_of_fit(counts)
    assert df >= 6
    assert pval > ALPHA, f"{mode}: biased, chi2={stat:.1f} df={df} p={pval:.2e}"


@pytest.mark.slow
def test_the_test_catches_a_flat_mask(monkeypatch):
    """Every row of a block masked with the committed state: drafts leave the grammar."""
    def flat(self, tokens, parents):
        root = self.mask()
        return list(range(len(parents))), root.expand(len(parents), -1).clone()

    monkeypatch.setattr(GrammarState, "walk", flat)
    sample_run.cache_clear()
    try:
        _, _, outside = sample_run("fixed")
    finally:
        sample_run.cache_clear()
    assert outside > 0
