"""Log-probabilities are the target's, from the verification logits: equal with speculation on
and off (chains and trees), equal to the target run over the full context, raw (before the
penalties), one per emitted token, and on the wire one per token id of each chunk."""

from __future__ import annotations

import pytest
import torch

from dflash.core.sampling import Sampling
from dflash.v1 import common_pb2, verifier_pb2
from verifier_svc.engine import Request, VerifierEngine

from doubles import ReferenceDrafter
from helpers import generate_ids
from markov import TableDrafter, TableTarget

PROMPTS = [[72, 101, 108, 108, 111], [3, 250, 17, 99, 42, 8, 199, 64, 10, 11, 12]]
MAX_NEW = 24
BLOCK = 8
TOL = 1e-5          # speculation on vs off: the same target, rows computed in other batches
REF_TOL = 1e-4      # against transformers' own forward over the full context


@pytest.fixture(scope="module")
def engine(target_model):
    e = VerifierEngine(target_model, spec_mode="fixed", tree_budget=16)
    yield e
    e.close()


def full_context_logprobs(hf_target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """``[len(out), V]``: the target's log_softmax before each output token, in one forward."""
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + out])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(out)].log_softmax(-1)


def greedy(hf_target, prompt, n=MAX_NEW):
    out = hf_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=hf_target.config.vocab_size + 1)
    return out[0, len(prompt):].tolist()


def _ranks(sid: str, pos: int) -> int:
    # proposed at most positions, a sibling at some (chains reject), absent at others
    return 1000 if pos % 5 == 3 else (1 if pos % 4 == 1 else 0)


def run(engine, target_model, prompt, s: Sampling, mode: str, ref: list[int] | None, sid: str,
        n: int = MAX_NEW):
    proposer = None
    if mode != "off":
        proposer = ReferenceDrafter(target_model, {sid: prompt + (ref or [0] * n)},
                                    block_size=BLOCK, ranks=_ranks)
    req = Request(request_id=sid, session_id=sid, prompt=list(prompt), sampling=s, max_tokens=n,
                  ignore_eos=True, proposer=proposer, spec_mode=mode)
    events = list(engine.generate(req))
    engine.close_session(sid)
    for ev in events:
        assert ev.logprobs is not None and [lp.token_id for lp in ev.logprobs] == ev.tokens
    return [t for ev in events for t in ev.tokens], [lp for ev in events for lp in ev.logprobs], events


def test_greedy_logprobs_equal_with_and_without_speculation(engine, target_model, hf_target):
    s = Sampling(logprobs=True, top_logprobs=5)
    for i, prompt in enumerate(PROMPTS):
        ref = greedy(hf_target, prompt)
        full = full_context_logprobs(hf_target, prompt, ref)
        base_toks, base, _ = run(engine, target_model, prompt, s, "off", None, f"l{i}off")
        assert base_toks == ref
        for mode in ("fixed", "tree"):
            toks, lps, events = run(engine, target_model, prompt, s, mode, ref, f"l{i}{mode}")
            assert toks == ref
            assert sum(ev.accepted for ev in events) > 3       # blocks were accepted ...
            assert any(ev.accepted < ev.drafted for ev in events[1:-1])   # ... and rejected
            for j, (a, b) in enumerate(zip(lps, base, strict=True)):
                assert a.logprob == pytest.approx(b.logprob, abs=TOL), (mode, j)
                assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=TOL), (mode, j)
                assert a.top_ids == b.top_ids, (mode, j)
        for j, lp in enumerate(base):
            assert len(lp.top_ids) == len(lp.top_logprobs) == 5
            assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
            # greedy: the emitted token is the most likely one
            assert lp.top_ids[0] == lp.token_id and lp.top_logprobs[0] == lp.logprob
            assert lp.logprob == pytest.approx(float(full[j, lp.token_id]), abs=REF_TOL)
            want = full[j].topk(5)
            assert lp.top_ids == want.indices.tolist()
            assert lp.top_logprobs == pytest.approx(want.values.tolist(), abs=REF_TOL)


def test_logprobs_are_raw_under_penalties(engine, target_model, hf_target):
    """With penalties the emitted token is often not the target's most likely one; its logprob
    is still the target's own (before the penalties), equal with speculation on and off."""
    s = Sampling(presence_penalty=2.0, frequency_penalty=1.0, logprobs=True, top_logprobs=2)
    prompt = PROMPTS[0]
    toks, base, _ = run(engine, target_model, prompt, s, "off", None, "raw-off")
    full = full_context_logprobs(hf_target, prompt, toks)
    not_top = 0
    for j, lp in enumerate(base):
        assert lp.logprob == pytest.approx(float(full[j, lp.token_id]), abs=REF_TOL)
        assert lp.top_logprobs[0] == pytest.approx(float(full[j].max()), abs=REF_TOL)
        not_top += lp.token_id != lp.top_ids[0]
        assert lp.logprob <= lp.top_logprobs[0]
    assert not_top >= 3
    for mode in ("fixed", "tree"):
        got, lps, _ = run(engine, target_model, prompt, s, mode, toks, f"raw-{mode}")
        assert got == toks
        assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in base], abs=TOL)


@pytest.mark.parametrize("mode", ["off", "fixed", "tree"])
def test_sampled_logprobs_match_the_full_context(engine, target_model, hf_target, mode):
    """Sampled tokens (mostly rejected drafts here: recovered and bonus tokens): each one's
    logprob is the target's at its prefix."""
    prompt = PROMPTS[1]
    s = Sampling(temperature=0.5, seed=3, logprobs=True)
    toks, lps, _ = run(engine, target_model, prompt, s, mode, greedy(hf_target, prompt),
                       f"s-{mode}")
    full = full_context_logprobs(hf_target, prompt, toks)
    assert [lp.logprob for lp in lps] == pytest.approx(
        [float(full[j, t]) for j, t in enumerate(toks)], abs=REF_TOL)
    assert all(lp.top_ids == [] and lp.top_logprobs == [] for lp in lps)


TABLE = torch.tensor([
    [[1.0, 0.4, 0.0, -1.6], [0.0, 1.2, -1.4, 0.5], [-1.5, 0.2, 0.9, 0.3], [0.6, -1.8, 0.1, 1.0]],
    [[0.2, -1.7, 1.1, 0.5], [1.0, 0.3, 0.6, -1.5], [0.4, 0.8, -1.6, 0.0], [-1.4, 0.7, 0.3, 1.1]],
])


@pytest.mark.parametrize("mode", ["off", "fixed", "tree"])
def test_sampled_logprobs_under_speculation(mode):
    """A target whose logits are a known table (``tests/markov.py``) and a drafter close to it:
    drafts are accepted deep and rejected, sampled with penalties, and every emitted token's
    logprob is exactly the table row's raw log_softmax at its position."""
    target = TableTarget(TABLE)
    eng = VerifierEngine(target, spec_mode=mode, tree_budget=6)
    q = 0.7 * TABLE.softmax(-1) + 0.3 / 4
    s = Sampling(temperature=1.0, seed=11, frequency_penalty=0.5, logit_bias={3: 0.5},
                 logprobs=True, top_logprobs=4)
    req = Request(request_id="t", prompt=[0], max_tokens=300, sampling=s,
                  proposer=TableDrafter(q, 6) if mode != "off" else None)
    try:
        events = list(eng.generate(req))
    finally:
        eng.close()
    seq = [0] + [t for ev in events for t in ev.tokens]
    lps = [lp for ev in events for lp in ev.logprobs]
    assert len(lps) == len(seq) - 1 == 300
    want = TABLE.log_softmax(-1)
    for i, lp in enumerate(lps):               # token i + 1 follows position i
        row = want[i % 2, seq[i]]
        assert lp.token_id == seq[i + 1]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-6)
        assert lp.top_ids == row.argsort(descending=True).tolist()
    if mode != "off":
        assert sum(ev.accepted >= 2 for ev in events) > 20
        assert sum(ev.accepted < ev.drafted for ev in events[1:-1]) > 20


def test_no_logprobs_unless_asked(engine, target_model):
    req = Request(request_id="none", prompt=list(PROMPTS[0]), max_tokens=5, ignore_eos=True)
    assert all(ev.logprobs is None for ev in engine.generate(req))


def test_logprobs_on_the_wire(stack, target_model, hf_target):
    """Verifier.Generate sends one TokenLogprob per token id of each chunk, in order."""
    prompt = PROMPTS[0]
    ref = greedy(hf_target, prompt, 16)
    addr = stack.add_drafter(ReferenceDrafter(target_model, {"w": prompt + ref}, block_size=4),
                             label="ref@1")
    full = full_context_logprobs(hf_target, prompt, ref)
    v = stack.verifier_stub()
    for spec in (None, verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr)):
        req = verifier_pb2.VerifierGenerateRequest(
            prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, session_id="w",
            sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=3), speculation=spec)
        ids, lps = [], []
        for chunk in v.Generate(req):
            assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
            ids += chunk.token_ids
            lps += chunk.logprobs
        assert ids == ref
        for j, lp in enumerate(lps):
            assert lp.logprob == pytest.approx(float(full[j, lp.token_id]), abs=REF_TOL)
            assert list(lp.top_ids) == full[j].topk(3).indices.tolist()
        v.CloseSession(verifier_pb2.CloseSessionRequest(session_id="w"))
    ids, last = generate_ids(v, prompt, max_tokens=4, ignore_eos=True)
    assert len(ids) == 4 and not last.logprobs
