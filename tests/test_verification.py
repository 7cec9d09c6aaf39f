"""verifier_svc.verification.verify_batch against the per-session loop it replaces.

The reference below is ``VerifierEngine._verify`` plus the commit cut of ``decode_step``
(verifier_svc/engine.py), copied so that the batched function is held to the old behaviour
bit for bit, random-number consumption included.
"""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from dflash.core.sampling import Sampling, exp_noise, probs_from_logits
from verifier_svc import verification
from verifier_svc.verification import RowParams, Verified, verify_batch

V = 50
KS = (0, 1, 3, 7)


# --- reference: engine.py's per-session code, copied -------------------------------------------

def _ref_verify(block: list[int], logits: torch.Tensor, draft_probs: torch.Tensor | None,
                sampling: Sampling, gen: torch.Generator) -> tuple[int, list[int]]:
    k = len(block) - 1
    drafts = torch.tensor([block[1:]], dtype=torch.int64)
    if sampling.greedy:
        acc, out = kernels.greedy_accept(drafts, logits[None])
    else:
        p = probs_from_logits(logits, sampling)[None]                    # [1, K+1, V]
        q = draft_probs[None].float() if draft_probs is not None else \
            torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
        u = torch.rand((1, k), generator=gen)
        e = exp_noise(tuple(p.shape), gen)
        acc, out = kernels.rejection_sample(drafts, q, p, u, e)
    a = int(acc[0])
    return a, out[0, :a + 1].tolist()


def _ref_row(anchor, drafts, logits, probs, sampling, gen, stops, emitted, max_tokens):
    block = [anchor] + drafts
    accepted, out = _ref_verify(block, logits, probs, sampling, gen)
    new = out[:accepted + 1]
    finish = None
    for i, tok in enumerate(new):
        if tok in stops:
            new, finish = new[:i + 1], "stop"
            break
    if emitted + len(new) >= max_tokens:
        new, finish = new[:max_tokens - emitted], finish or "length"
    acc_emitted = min(accepted, len(new))
    return new, acc_emitted, finish


# --- random batches -----------------------------------------------------------------------------

def _random_sampling(rng: random.Random) -> Sampling:
    if rng.random() < 0.4:
        return Sampling(temperature=0.0)
    return Sampling(temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
                    top_k=rng.choice([0, 0, 3, 10, 60]),
                    top_p=rng.choice([1.0, 1.0, 0.9, 0.5]))


def _random_row(rng: random.Random, tg: torch.Generator):
    k = rng.choice(KS)
    sampling = _random_sampling(rng)
    scale = rng.choice([0.5, 2.0, 6.0])      # flat to peaky target distributions
    logits = torch.randn((k + 1, V), generator=tg) * scale
    argmax = logits.argmax(-1).tolist()
    hit = rng.choice([0.0, 0.5, 0.9, 1.0])   # how often a draft is the target's argmax
    drafts = [argmax[j] if rng.random() < hit else rng.randrange(V) for j in range(k)]
    if sampling.greedy or rng.random() < 0.3:
        probs = None if rng.random() < 0.5 else torch.rand((k, V), generator=tg).softmax(-1)
    else:   # a drafter near the target, processed the same way
        noisy = logits + torch.randn((k + 1, V), generator=tg) * rng.choice([0.1, 1.0])
        probs = probs_from_logits(noisy[:k], sampling)
        # drafts the drafter could have sampled (q(d) > 0), often its argmax
        for j in range(k):
            if probs[j, drafts[j]] <= 0:
                drafts[j] = int(probs[j].argmax())
    stops = frozenset()
    if rng.random() < 0.3:
        stops = frozenset(rng.sample(argmax, rng.randint(1, len(argmax))))
    elif rng.random() < 0.2:
        stops = frozenset(rng.sample(range(V), 3))
    max_tokens = rng.randint(1, 40)
    emitted = rng.randint(0, max_tokens - 1)
    if rng.random() < 0.3:
        emitted = max(0, max_tokens - rng.randint(1, 3))   # little room left
    return dict(drafts=drafts, logits=logits, probs=probs, sampling=sampling, stops=stops,
                emitted=emitted, max_tokens=max_tokens, anchor=rng.randrange(V),
                seed=rng.randrange(2**62))


def _gens(rows, shared: dict[int, int]):
    """Fresh generators for the sampled rows; rows in ``shared`` reuse an earlier row's one."""
    gens: list[torch.Generator | None] = []
    for i, r in enumerate(rows):
        if r["sampling"].greedy:
            gens.append(None)
        elif i in shared:
            gens.append(gens[shared[i]])
        else:
            g = torch.Generator()
            g.manual_seed(r["seed"])
            gens.append(g)
    return gens


def test_matches_per_row_reference():
    rng = random.Random(1234)
    tg = torch.Generator().manual_seed(99)
    seen_acc, seen_finish, seen_groups = set(), set(), 0
    for _ in range(200):
        rows = [_random_row(rng, tg) for _ in range(rng.randint(1, 12))]
        sampled = [i for i, r in enumerate(rows) if not r["sampling"].greedy]
        shared = {}
        if len(sampled) >= 2 and rng.random() < 0.2:   # two rows on one generator: row order
            shared[sampled[-1]] = sampled[0]
        ref_gens, gens = _gens(rows, shared), _gens(rows, shared)

        expected = []
        for r, g in zip(rows, ref_gens):
            expected.append(_ref_row(r["anchor"], r["drafts"], r["logits"], r["probs"],
                                     r["sampling"], g, r["stops"], r["emitted"], r["max_tokens"]))
        got = verify_batch(
            [torch.tensor(r["drafts"], dtype=torch.int64) for r in rows],
            [r["logits"] for r in rows],
            [r["probs"] for r in rows],
            [RowParams(sampling=r["sampling"], generator=g, stops=r["stops"],
                       room=r["max_tokens"] - r["emitted"]) for r, g in zip(rows, gens)])

        assert len(got) == len(rows)
        for r, v, (tokens, acc, finish), g_ref, g in zip(rows, got, expected, ref_gens, gens):
            assert isinstance(v, Verified)
            assert (v.tokens, v.accepted, v.finish) == (tokens, acc, finish)
            assert v.drafted == len(r["drafts"])
            assert all(isinstance(t, int) for t in v.tokens)
            if g is not None:
                assert torch.equal(g.get_state(), g_ref.get_state())
            seen_acc.add(acc)
            seen_finish.add(finish)
        seen_groups = max(seen_groups, len({(r["sampling"].greedy, len(r["drafts"]))
                                            for r in rows}))
    # the random batches exercised what they should
    assert seen_acc == set(range(max(KS) + 1))
    assert seen_finish == {None, "stop", "length"}
    assert seen_groups >= 5


def test_sampled_rows_consume_their_generators():
    """A seeded sampled row draws u [1, k] then e [1, k + 1, V] from its generator, nothing else;
    a greedy row draws nothing."""
    k = 3
    g = torch.Generator().manual_seed(7)
    twin = torch.Generator().manual_seed(7)
    other = torch.Generator().manual_seed(8)
    logits = torch.randn((k + 1, V), generator=torch.Generator().manual_seed(0))
    verify_batch([torch.tensor([1, 2, 3])] * 2, [logits] * 2, [None, None],
                 [RowParams(Sampling(temperature=1.0), g, frozenset(), 10),
                  RowParams(Sampling(temperature=0.0), other, frozenset(), 10)])
    torch.rand((1, k), generator=twin)
    exp_noise((1, k + 1, V), twin)
    assert torch.equal(g.get_state(), twin.get_state())
    assert torch.equal(other.get_state(), torch.Generator().manual_seed(8).get_state())


def test_one_kernel_call_for_a_greedy_batch(monkeypatch):
    calls = []
    real = kernels.greedy_accept

    def counting(d, lg):
        calls.append((tuple(d.shape), tuple(lg.shape)))
        return real(d, lg)

    monkeypatch.setattr(verification.kernels, "greedy_accept", counting)
    tg = torch.Generator().manual_seed(3)
    n, k = 32, 7
    logits = [torch.randn((k + 1, V), generator=tg) for _ in range(n)]
    drafts = [lg[:k].argmax(-1) for lg in logits]   # all accepted
    got = verify_batch(drafts, logits, [None] * n,
                       [RowParams(Sampling(), None, frozenset(), 100)] * n)
    assert calls == [((n, k), (n, k + 1, V))]
    for lg, v in zip(logits, got):
        assert v.tokens == lg.argmax(-1).tolist() and v.accepted == k and v.finish is None


def test_groups_by_mode_and_k(monkeypatch):
    calls = []
    real_g, real_r = kernels.greedy_accept, kernels.rejection_sample

    def greedy(d, lg):
        calls.append(("greedy", tuple(d.shape)))
        return real_g(d, lg)

    def rejection(d, q, p, u, e):
        calls.append(("sampled", tuple(d.shape)))
        return real_r(d, q, p, u, e)

    monkeypatch.setattr(verification.kernels, "greedy_accept", greedy)
    monkeypatch.setattr(verification.kernels, "rejection_sample", rejection)
    ks = [3, 0, 3, 3, 0, 7]
    modes = [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    tg = torch.Generator().manual_seed(5)
    verify_batch([torch.zeros(k, dtype=torch.int64) for k in ks],
                 [torch.randn((k + 1, V), generator=tg) for k in ks], [None] * len(ks),
                 [RowParams(Sampling(temperature=t), torch.Generator().manual_seed(i),
                            frozenset(), 5) for i, t in enumerate(modes)])
    assert sorted(calls) == sorted([("greedy", (2, 3)), ("greedy", (1, 0)),
                                    ("sampled", (1, 3)), ("sampled", (1, 0)),
                                    ("sampled", (1, 7))])


def test_k_zero_commits_one_token():
    lg = torch.randn((1, V), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    v_greedy, v_sampled = verify_batch(
        [torch.zeros(0, dtype=torch.int64)] * 2, [lg, lg], [None, torch.zeros((0, V))],
        [RowParams(Sampling(), None, frozenset(), 3),
         RowParams(Sampling(temperature=1.0), g, frozenset(), 3)])
    assert v_greedy == Verified(tokens=[int(lg.argmax())], accepted=0, drafted=0, finish=None)
    assert len(v_sampled.tokens) == 1 and v_sampled.accepted == 0 and v_sampled.drafted == 0


def test_empty_batch():
    assert verify_batch([], [], [], []) == []


def _row(k=2, sampled=False):
    s = Sampling(temperature=1.0 if sampled else 0.0)
    return (torch.zeros(k, dtype=torch.int64), torch.zeros((k + 1, V)), None,
            RowParams(s, torch.Generator().manual_seed(0) if sampled else None, frozenset(), 4))


@pytest.mark.parametrize("drop", ["logits", "draft_probs", "params"])
def test_mismatched_list_lengths(drop):
    d, lg, q, p = _row()
    args = {"drafts": [d, d], "logits": [lg, lg], "draft_probs": [q, q], "params": [p, p]}
    args[drop] = args[drop][:1]
    with pytest.raises(ValueError, match=drop):
        verify_batch(**args)


def test_bad_shapes():
    d, lg, q, p = _row(k=2)
    with pytest.raises(ValueError, match=r"logits\[1\]"):           # rows != k + 1
        verify_batch([d, d], [lg, torch.zeros((2, V))], [q, q], [p, p])
    with pytest.raises(ValueError, match=r"logits\[1\]"):           # vocab differs
        verify_batch([d, d], [lg, torch.zeros((3, V + 1))], [q, q], [p, p])
    with pytest.raises(ValueError, match=r"logits\[0\]"):           # not 2-D
        verify_batch([d], [lg[None]], [q], [p])
    with pytest.raises(ValueError, match=r"drafts\[0\]"):           # 2-D drafts
        verify_batch([d[None]], [lg], [q], [p])
    with pytest.raises(ValueError, match=r"drafts\[0\]"):           # float drafts
        verify_batch([d.float()], [lg], [q], [p])
    d, lg, q, p = _row(k=2, sampled=True)
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        verify_batch([d], [lg], [torch.zeros((3, V))], [p])
    with pytest.raises(ValueError, match=r"params\[0\]"):
        verify_batch([d], [lg], [q], [object()])


def test_row_params_validation():
    with pytest.raises(ValueError, match="room"):
        RowParams(Sampling(), None, frozenset(), 0)
    with pytest.raises(ValueError, match="generator"):
        RowParams(Sampling(temperature=0.8), None, frozenset(), 1)
