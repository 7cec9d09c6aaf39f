"""Acceptance statistics after a stop string: they count only the tokens the client received.

A stop string ends the request at the gateway, which cancels the verifier stream, so the
verifier's own final statistics never arrive (or count the discarded tail). The gateway rebuilds
them from the chunks up to the cut (``gateway.emitted.EmittedStats``): a step cut after ``c``
tokens accepted ``min(accepted, c)`` emitted drafts; the work of each emitted step (fallback,
tree nodes, draft and verify seconds) comes with its chunk and counts whole.
"""

from __future__ import annotations

import pytest
import torch

from dflash.core.proposer import DraftError, Proposal
from dflash.v1 import common_pb2, gateway_pb2, verifier_pb2
from gateway.emitted import EmittedStats

from doubles import ReferenceDrafter, client_session_id
from helpers import Stack, generate_ids

B = 8
N = 1 + 3 * B                     # the prefill token, then three full blocks
PROMPTS = ["Hi", "Hello", "abc", "The", "x", "Write", "42", "ok"]


# ---------------------------------------------------------------------------- unit
def test_emitted_stats_counts_only_kept_tokens():
    e = EmittedStats()
    e.step(1, 0, 0)               # prefill: no draft
    e.step(8, 7, 7)               # a full block: 7 accepted drafts + the bonus
    e.step(3, 5, 7)               # cut after 3 of its 6 tokens (5 accepted + bonus)
    p = e.to_proto(None)
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (2, 14, 10)
    assert list(p.accepted_per_position) == [2, 2, 2, 1, 1, 1, 1]
    assert p.mean_acceptance_length == pytest.approx(1 + 10 / 2)


def test_emitted_stats_cut_on_the_bonus_keeps_every_accepted_draft():
    e = EmittedStats()
    e.step(4, 3, 7)               # 3 accepted + bonus, all 4 kept
    p = e.to_proto(common_pb2.AcceptanceStats(fallback_steps=2, verify_seconds=0.5, tree_nodes=9,
                                              tree_drafts=1, accepted_tokens=99, drafts=99))
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (1, 7, 3)
    # Work figures come from the verifier; counts never do.
    assert (p.fallback_steps, p.verify_seconds, p.tree_nodes, p.tree_drafts) == (2, 0.5, 9, 1)


def test_emitted_stats_without_drafts():
    e = EmittedStats()
    for _ in range(5):
        e.step(1, 0, 0)
    p = e.to_proto(None)
    assert (p.drafts, p.accepted_tokens) == (0, 0)
    assert p.mean_acceptance_length == 1.0


def test_emitted_stats_count_the_work_of_emitted_steps_only():
    e = EmittedStats()
    e.chunk(1, verifier_pb2.VerifierGenerateChunk(token_ids=[5]))       # prefill: no work
    e.chunk(1, verifier_pb2.VerifierGenerateChunk(token_ids=[6], fallback=True, draft_seconds=0.25,
                                                  verify_seconds=0.5))
    e.chunk(2, verifier_pb2.VerifierGenerateChunk(token_ids=[7, 8, 9, 10], accepted=3, drafted=4,
                                                  tree_nodes=9, draft_seconds=0.125,
                                                  verify_seconds=0.25))    # cut after 2 tokens
    e.chunk(0, verifier_pb2.VerifierGenerateChunk(token_ids=[11], fallback=True, tree_nodes=5,
                                                  verify_seconds=4.0))     # after the cut
    p = e.to_proto(None)
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (1, 4, 2)
    assert (p.fallback_steps, p.tree_drafts, p.tree_nodes) == (1, 1, 9)
    assert (p.draft_seconds, p.verify_seconds) == (0.375, 0.75)


# ---------------------------------------------------------------------------- through the stack
def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _continuation(tokenizer, hf_target, prompt: str) -> list[int] | None:
    """The target's greedy continuation of ``prompt``, N + B tokens (room for every block that
    holds a cut, so none is shortened by max_tokens); None when it ends at EOS before that."""
    tp = tokenizer.encode(prompt)
    cont = hf_target.generate(torch.tensor([tp]), max_new_tokens=N + B,
                              do_sample=False)[0, len(tp):].tolist()
    return cont if len(cont) == N + B and tokenizer.eos_token_id not in cont else None


def _first_completion(tok, out, stop) -> int | None:
    """Index of the token whose text first makes ``stop`` appear (the detokenizer's rule)."""
    return next((i for i in range(len(out)) if stop in _decode(tok, out[:i + 1])), None)


def _expected(n: int) -> tuple[int, int, int, list[int]]:
    """(drafts, draft_tokens, accepted_tokens, accepted_per_position) for ``n`` emitted tokens:
    the prefill token, then blocks of B - 1 accepted drafts + the bonus (the oracle, fixed k)."""
    full, c = divmod(n - 1, B)
    drafts = full + (1 if c else 0)
    kept = [B - 1] * full + ([min(B - 1, c)] if c else [])
    per_pos = [sum(1 for a in kept if a > i) for i in range(B - 1)]
    return drafts, drafts * (B - 1), sum(kept), per_pos


@pytest.fixture(scope="module")
def oracle(target_model, tokenizer, hf_target):
    """A stack whose default drafter proposes the target's own greedy continuation."""
    s = Stack(target_model, tokenizer)
    drafter = ReferenceDrafter(target_model, {}, block_size=B)
    addr = s.add_drafter(drafter, label="oracle@1", default=True)
    yield s, drafter, addr
    s.close()


def _cases(tokenizer, hf_target):
    """(prompt, continuation, stop string, index of the token completing it); at most two
    cases per cut offset c = 1..B of a block (c = B keeps the bonus token)."""
    out = []
    per_c: dict[int, int] = {}
    for prompt in PROMPTS:
        cont = _continuation(tokenizer, hf_target, prompt)
        if cont is None:
            continue
        for i in range(1, N):
            text = _decode(tokenizer, cont[:i + 1])
            for k in (1, 2, 3):
                stop = text[-k:]
                if len(stop) == k and "\ufffd" not in stop and \
                        _first_completion(tokenizer, cont, stop) == i:
                    c = (i - 1) % B + 1
                    if per_c.get(c, 0) < 2:
                        per_c[c] = per_c.get(c, 0) + 1
                        out.append((prompt, cont, stop, i))
                    break
    return out, per_c


def test_stop_string_at_each_offset_counts_only_emitted_tokens(oracle, tokenizer, hf_target):
    stack, drafter, addr = oracle
    cases, per_c = _cases(tokenizer, hf_target)
    assert set(per_c) == set(range(1, B + 1)), f"offsets covered: {sorted(per_c)}"
    gw, vf = stack.gateway_stub(), stack.verifier_stub()
    for n_case, (prompt, cont, stop, i) in enumerate(cases):
        sid = f"stop-{n_case}"
        drafter.refs[sid] = tokenizer.encode(prompt) + cont
        resps = list(gw.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, max_tokens=len(cont), stop=[stop], session_id=sid,
            speculation_mode="fixed"), timeout=60))
        last = resps[-1]
        where = f"case {n_case}: prompt {prompt!r}, stop {stop!r} completed by token {i}"
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP, where
        n = last.usage.completion_tokens
        assert n == i + 1, where
        assert [t for r in resps for t in r.token_ids] == cont[:n], where
        drafts, draft_tokens, accepted, per_pos = _expected(n)
        a = last.acceptance
        assert (a.drafts, a.draft_tokens, a.accepted_tokens) == (drafts, draft_tokens, accepted), where
        assert list(a.accepted_per_position) == per_pos, where
        assert a.mean_acceptance_length == pytest.approx(1 + accepted / drafts), where
        # The verifier, cut by a stop token id at the same token, counts the same.
        if cont.index(cont[i]) == i:
            vid = f"stop-v{n_case}"
            drafter.refs[vid] = drafter.refs[sid]
            _, vlast = generate_ids(
                vf, tokenizer.encode(prompt), max_tokens=len(cont), session_id=vid,
                stop_token_ids=[cont[i]], ignore_eos=True,
                speculation=verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr,
                                                           mode="fixed"))
            v = vlast.stats
            assert (v.drafts, v.draft_tokens, v.accepted_tokens) == \
                (a.drafts, a.draft_tokens, a.accepted_tokens), where
            assert list(v.accepted_per_position) == list(a.accepted_per_position), where


def test_without_a_stop_string_the_verifier_statistics_pass_through(oracle, tokenizer, hf_target):
    stack, drafter, _ = oracle
    cont = _continuation(tokenizer, hf_target, "Hi")
    assert cont is not None
    drafter.refs["nostop"] = tokenizer.encode("Hi") + cont
    resps = list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt="Hi", max_tokens=N, session_id="nostop", speculation_mode="fixed"), timeout=60))
    a = resps[-1].acceptance
    n = resps[-1].usage.completion_tokens
    drafts, draft_tokens, accepted, per_pos = _expected(n)
    assert (a.drafts, a.draft_tokens, a.accepted_tokens) == (drafts, draft_tokens, accepted)
    assert list(a.accepted_per_position) == per_pos
    assert a.verify_seconds > 0        # the verifier's own figures, not a rebuild


# ---------------------------------------------------------------------------- fallback and trees
FAIL_EVERY = 3      # the planted drafter fails every third draft of a session


class PlantedFailures(ReferenceDrafter):
    """The oracle, but every ``FAIL_EVERY``-th draft (the third, sixth...) of a session in
    ``sessions`` is a per-session error: that step runs without speculation (a fallback step),
    and an answered call never trips the breaker. Counted per session, so two generations of
    the same reference fail at the same steps."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sessions: set[str] = set()
        self.calls: dict[str, int] = {}

    def propose(self, requests):
        out = super().propose(requests)
        for j, r in enumerate(requests):
            if client_session_id(r.session_id) not in self.sessions or not isinstance(out[j], Proposal):
                continue
            n = self.calls[r.session_id] = self.calls.get(r.session_id, 0) + 1
            if n % FAIL_EVERY == 0:
                out[j] = DraftError("planted")
        return out


@pytest.fixture(scope="module")
def planted(target_model, tokenizer):
    # suffix candidates off: the test runs each generation twice and compares their steps, and
    # which candidates a step verifies depends on the suffix calibration learnt in between
    s = Stack(target_model, tokenizer, suffix=False)
    drafter = PlantedFailures(target_model, {}, block_size=B)
    addr = s.add_drafter(drafter, label="planted@1", default=True)
    yield s, drafter, addr
    s.close()


def _stop_at(tokenizer, cont: list[int], i: int) -> str | None:
    """A stop string (1-3 characters) that first appears with token ``i``, or None."""
    text = _decode(tokenizer, cont[:i + 1])
    for k in (1, 2, 3):
        stop = text[-k:]
        if len(stop) == k and "\ufffd" not in stop and _first_completion(tokenizer, cont, stop) == i:
            return stop
    return None


@pytest.mark.parametrize("mode", ["fixed", "tree"])
def test_stop_string_statistics_count_fallback_steps_and_trees_of_the_emitted_steps(
        planted, tokenizer, hf_target, mode):
    """A stop string cuts the stream before the verifier's last chunk: the fallback steps, tree
    counts and seconds are those of the steps up to the cut, as the verifier's own chunks of
    the same generation say (they were 0 before the chunks carried them)."""
    stack, drafter, addr = planted
    gw, vf = stack.gateway_stub(), stack.verifier_stub()
    spec = verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, mode=mode)
    checked = with_fallback = 0
    for prompt in PROMPTS:
        cont = _continuation(tokenizer, hf_target, prompt)
        if cont is None:
            continue
        ids = tokenizer.encode(prompt)
        # The whole generation on the verifier: per-chunk work, summed, is its statistics.
        full = f"full-{mode}-{prompt}"
        drafter.refs[full] = ids + cont
        drafter.sessions.add(full)
        chunks = list(vf.Generate(verifier_pb2.VerifierGenerateRequest(
            prompt_token_ids=ids, max_tokens=len(cont), session_id=full, speculation=spec,
            ignore_eos=True), timeout=60))
        assert [t for c in chunks for t in c.token_ids] == cont
        st = chunks[-1].stats
        assert sum(c.fallback for c in chunks) == st.fallback_steps > 0
        assert sum(c.tree_nodes for c in chunks) == st.tree_nodes
        assert sum(c.tree_nodes > 0 for c in chunks) == st.tree_drafts
        assert (st.tree_drafts > 0) == (mode == "tree")
        assert sum(c.verify_seconds for c in chunks) == pytest.approx(st.verify_seconds)
        assert sum(c.draft_seconds for c in chunks) == pytest.approx(st.draft_seconds)
        ends = [sum(len(c.token_ids) for c in chunks[:k + 1]) for k in range(len(chunks))]
        for i in range(4, len(cont) - B, 5):
            stop = _stop_at(tokenizer, cont, i)
            if stop is None:
                continue
            k = next(k for k, end in enumerate(ends) if end > i)    # the chunk holding token i
            kept = chunks[:k + 1]
            sid = f"cut-{mode}-{prompt}-{i}"
            drafter.refs[sid] = drafter.refs[full]
            drafter.sessions.add(sid)
            resps = list(gw.Generate(gateway_pb2.GenerateRequest(
                prompt=prompt, max_tokens=len(cont), stop=[stop], session_id=sid,
                speculation_mode=mode), timeout=60))
            last, where = resps[-1], f"{mode}: prompt {prompt!r}, stop {stop!r} at token {i}"
            assert last.finish_reason == common_pb2.FINISH_REASON_STOP, where
            assert last.usage.completion_tokens == i + 1 and k < len(chunks) - 1, where
            a = last.acceptance
            assert a.fallback_steps == sum(c.fallback for c in kept), where
            assert a.tree_nodes == sum(c.tree_nodes for c in kept), where
            assert a.tree_drafts == sum(c.tree_nodes > 0 for c in kept), where
            assert a.drafts == sum(c.drafted > 0 for c in kept), where
            assert a.drafts > 0 and a.verify_seconds > 0 and a.draft_seconds > 0, where
            checked += 1
            with_fallback += a.fallback_steps > 0
    assert checked >= 4 and with_fallback >= 2, (checked, with_fallback)
