"""Lossless at the edges: a draft token the target gives probability 0 is never emitted.

Rejection sampling accepts draft ``d`` when ``u * q(d) <= p(d)``; that alone holds as ``0 <= 0``
when ``q(d) = 0`` (a drafter whose q is 0 on its own draft) or ``u = 0`` (float32 ``torch.rand``
returns exactly 0 once in 2^24 draws) with ``p(d) = 0``. Covered here, layer by layer:

* the kernels (torch reference, and the Triton kernel under the Triton interpreter, as in
  ``tests/test_kernels.py``): planted ``q(d) = 0``, ``p(d) = 0`` and ``u = 0`` are never
  accepted, and the token emitted instead lies in the target's support;
* ``verify_batch`` draws its uniforms in (0, 1] without consuming more random numbers;
* ``DrafterSync.malformed`` refuses a q that is not finite, negative, or 0 on a draft;
* end to end (the real ``VerifierEngine`` decode loop over a fake previous-token target): a
  drafter whose q is 0 on its drafts (drafts the target's top-k / top-p removes) falls back at
  every step and no emitted token lies outside the target's support; with the malformed check
  bypassed, the kernel's rule alone still keeps every token in the support.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

import kernels
from dflash.core.proposer import DrafterCard, DraftError, Proposal
from dflash.core.sampling import Sampling, exp_noise, probs_from_logits
from kernels import reference as ref
from verifier_svc import verification
from verifier_svc.drafter_sync import DrafterSync
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.verification import RowParams, verify_batch

from doubles import TargetDouble

_KERNEL_MODULES = ("kernels.triton_common", "kernels.triton_greedy", "kernels.triton_rejection",
                   "kernels.triton_pack")
SMALL_SPLIT = {"block_v": 128, "chunk": 256}  # V=1000 -> 4 chunks, the last one partial


@pytest.fixture(scope="module")
def tk():
    """Kernel modules defined under the Triton interpreter (the ``tk`` fixture of
    tests/test_kernels.py: set the variable, import fresh, restore everything on teardown)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    saved = {n: sys.modules.pop(n) for n in _KERNEL_MODULES if n in sys.modules}
    try:
        pytest.importorskip("triton")
        yield SimpleNamespace(rejection=importlib.import_module("kernels.triton_rejection"))
    finally:
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
            if hasattr(kernels, name.split(".")[1]):
                delattr(kernels, name.split(".")[1])
        sys.modules.update(saved)
        mp.undo()


# ------------------------------------------------------------------------------- kernels

def planted_case(vocab: int = 1000):
    """Six rows of K = 4 drafts, one planted edge at position 2 of rows 0-3 (positions 0-1 are
    sure accepts: q = p there, u = 0.5), ordinary rows 4-5 as controls.

    Row 0: q(d) = 0, p(d) > 0.  Row 1: q(d) = 0, p(d) = 0.  Row 2: u = 0, p(d) = 0, q(d) > 0.
    Row 3: u = 0, q(d) = 0, p(d) = 0 (all three).  Row 4: u = 0, p(d) > 0, q(d) > 0: accepted
    (0 <= p / q). Row 5: every draft accepted (q = p): the bonus row.
    Returns (drafts int64 [6, 4], q [6, 4, V], p [6, 5, V], u [6, 4], e [6, 5, V]).
    """
    b, k = 6, 4
    g = torch.Generator().manual_seed(25)
    logits = torch.randn(b, k + 1, vocab, generator=g) * 2
    logits[torch.rand(b, k + 1, vocab, generator=g) < 0.5] = float("-inf")   # top-k style zeros
    logits[..., 0] = 0.0                                                      # rows non-empty
    p = torch.softmax(logits, dim=-1)
    q = p[:, :k].clone()
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(b, k)
    u = torch.full((b, k), 0.5)
    e = torch.empty(b, k + 1, vocab).exponential_(generator=g)
    zero_p = int((p[1, 2] == 0).nonzero()[0])          # a token the target gives 0
    rows = torch.arange(b)

    def plant(row: int, token: int, *, q_d: float | None = None, p_d: float | None = None):
        drafts[row, 2] = token
        if q_d is not None:   # move q's mass off (or onto) the draft, keeping the row a law
            q[row, 2] = 0.0
            q[row, 2, 0] = 1.0 - q_d
            q[row, 2, token] += q_d
        if p_d is not None:
            p[row, 2, token] = p_d

    plant(0, zero_p, q_d=0.0, p_d=0.3)
    plant(1, zero_p, q_d=0.0, p_d=0.0)
    plant(2, zero_p, q_d=0.4, p_d=0.0)
    u[2, 2] = 0.0
    plant(3, zero_p, q_d=0.0, p_d=0.0)
    u[3, 2] = 0.0
    u[4, 2] = 0.0
    assert p[4, 2, drafts[4, 2]] > 0 and q[4, 2, drafts[4, 2]] > 0
    q_d = q[rows[:, None], torch.arange(k), drafts]
    p_d = p[rows[:, None], torch.arange(k), drafts]
    # The planted edges are real: the product test alone would accept every one of them.
    assert bool((u[:4, 2] * q_d[:4, 2] <= p_d[:4, 2]).all())
    return drafts, q, p, u, e


def check_planted(accepted: torch.Tensor, output: torch.Tensor, p: torch.Tensor):
    assert accepted.tolist() == [2, 2, 2, 2, 4, 4]
    for row in range(6):
        a = int(accepted[row])
        tok = int(output[row, a])
        assert p[row, a, tok] > 0, f"row {row}: emitted token {tok} has p = 0 at position {a}"
        assert output[row, a + 1:].eq(-1).all()


def test_reference_never_accepts_a_zero_edge():
    drafts, q, p, u, e = planted_case()
    accepted, output = ref.rejection_sample(drafts, q, p, u, e)
    check_planted(accepted, output, p)
    assert kernels.rejection_sample(drafts, q, p, u, e)[0].tolist() == accepted.tolist()  # CPU


def test_kernel_never_accepts_a_zero_edge(tk):
    drafts, q, p, u, e = planted_case()
    want = ref.rejection_sample(drafts, q, p, u, e)
    for split in (SMALL_SPLIT, {}):
        got = tk.rejection.rejection_sample(drafts, q, p, u, e, **split)
        for g_, w in zip(got, want):
            assert g_.dtype == w.dtype and torch.equal(g_, w), f"\n{g_}\n!=\n{w}"
    check_planted(*want, p)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_zero_edges_at_every_position(impl, request):
    """q(d) = 0 planted at each position j of a block q == p everywhere else: accepted == j."""
    run = ref.rejection_sample
    if impl == "kernel":
        run = request.getfixturevalue("tk").rejection.rejection_sample
    k, vocab = 5, 64
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(k + 1, k + 1, vocab, generator=g), dim=-1)   # k+1 rows
    p[..., 7] = 0.0
    p /= p.sum(-1, keepdim=True)
    q = p[:, :k].clone()
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(k + 1, k)
    u = torch.zeros(k + 1, k)                      # u = 0 everywhere: only the rule can reject
    e = torch.empty(k + 1, k + 1, vocab).exponential_(generator=g)
    for j in range(k):                             # row j: draft j is token 7, q = p = 0 there
        drafts[j, j] = 7
    accepted, output = run(drafts, q, p, u, e)
    assert accepted.tolist() == list(range(k)) + [k]
    assert not (output == 7).any()


# ------------------------------------------------------------------------- verify_batch

def test_uniforms_are_drawn_in_open_closed_interval(monkeypatch):
    """A drawn 0 reaches the kernel as 1; the generator advances exactly as before."""
    k, vocab = 4, 16
    seen = []
    real_rand, real_rs = torch.rand, kernels.rejection_sample

    def zero_rand(*a, **kw):   # the real draw (same consumption), then the rare value planted
        return real_rand(*a, **kw).zero_()

    def spy(d, q, p, u, e):
        seen.append(u.clone())
        return real_rs(d, q, p, u, e)

    monkeypatch.setattr(torch, "rand", zero_rand)
    monkeypatch.setattr(verification.kernels, "rejection_sample", spy)
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(temperature=1.0, top_k=2)
    p = probs_from_logits(logits, sampling)
    outside = [int((p[j] == 0).nonzero()[0]) for j in range(k)]   # drafts top-k removes
    q = torch.full((k, vocab), 1.0 / vocab)
    gen, twin = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    (v,) = verify_batch([torch.tensor(outside)], [logits], [q],
                        [RowParams(sampling, gen, frozenset(), 100)])
    assert seen and torch.equal(seen[0], torch.ones(1, k))
    assert v.accepted == 0 and len(v.tokens) == 1 and p[0, v.tokens[0]] > 0
    real_rand((1, k), generator=twin)
    exp_noise((1, k + 1, vocab), twin)
    assert torch.equal(gen.get_state(), twin.get_state())


def test_open_closed_mapping_changes_nothing_else():
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(1))
    u[[3, 77]] = 0.0
    got = verification._uniforms_open_closed(u.clone())
    assert got[[3, 77]].tolist() == [1.0, 1.0]
    keep = torch.ones_like(u, dtype=torch.bool)
    keep[[3, 77]] = False
    assert torch.equal(got[keep], u[keep])
    assert bool(((got > 0) & (got <= 1)).all())


# ------------------------------------------------------------------- DrafterSync.malformed

def test_malformed_probs_refused():
    V, k = 10, 3
    sync = DrafterSync(vocab_size=V)
    toks = torch.tensor([1, 4, 9])
    good = torch.full((k, V), 1.0 / V)

    def with_q(q):
        return Proposal(tokens=toks, probs=q)

    assert sync.malformed(with_q(good), k) is None
    assert sync.malformed(Proposal(tokens=toks), k) is None          # no q: one-hot in verify
    assert sync.malformed(Proposal(tokens=toks[:0], probs=good[:0]), 0) is None

    def planted(row: int, col: int, value: float) -> torch.Tensor:
        q = good.clone()
        q[row, col] = value
        return q

    assert sync.malformed(with_q(planted(1, 5, 0.0)), k) is None      # 0 off the drafts: fine
    bad = {"zero on its draft": planted(1, 4, 0.0),
           "zero on the last draft": planted(2, 9, 0.0),
           "NaN": planted(0, 3, float("nan")),
           "+inf": planted(2, 9, float("inf")),
           "negative": planted(2, 0, -1e-6),
           "wrong shape": good[:, :V - 1],
           "too few rows": good[:2],
           "integer": torch.ones((k, V), dtype=torch.int64)}
    for what, q in bad.items():
        assert sync.malformed(with_q(q), k) == "malformed_probs", what
    assert sync.malformed(DraftError("timeout", "slow"), k) == "timeout"


# ------------------------------------------------------------------------ end to end

V = 6
# Next-token logits by previous token: distinct values, so top-2 and top-p 0.5 are clear.
TABLE = torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0, 0.0],
                      [0.0, 2.5, 1.0, -0.5, 0.3, -1.5],
                      [1.2, -1.0, 2.2, 0.1, -0.4, 0.6],
                      [-0.3, 0.9, 0.4, 2.0, -1.2, 1.3],
                      [0.8, -0.6, 1.5, 0.2, 2.4, -0.9],
                      [1.1, 0.2, -0.8, 1.6, 0.0, 2.1]])


@dataclasses.dataclass(eq=False)
class TableTarget(TargetDouble):
    """Stands in for ``TargetModel``: the logits after token t are ``TABLE[t]``."""

    vocab_size: int = V
    supports_trees: bool = False

    def forward(self, tokens, cache, layer_ids, logits_to_keep=0, parents=None):
        cache.tokens.extend(tokens)
        logits = TABLE[torch.tensor(tokens)]
        taps = torch.zeros(len(tokens), len(layer_ids) * self.hidden_size) if layer_ids else None
        return logits[-logits_to_keep:], taps


class ZeroOnDraftDrafter:
    """A broken drafter: drafts the token the target likes least after the previous draft (one
    top-k / top-p removes) and sends a q that is 0 on it (all of q's mass on token 0 or 1)."""

    def __init__(self, block_size: int = 6):
        self.card = DrafterCard(name="zero-q", version="1", block_size=block_size,
                                mask_token_id=0, target_layer_ids=(0,),
                                hidden_size=TableTarget.hidden_size, vocab_size=V,
                                dtype="float32")
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        out = []
        for r in requests:
            prev, toks = r.anchor_token, []
            for _ in range(r.block_size - 1):
                prev = int(TABLE[prev].argmin())
                toks.append(prev)
            q = torch.zeros(len(toks), V)
            q[torch.arange(len(toks)), [1 if t == 0 else 0 for t in toks]] = 1.0
            out.append(Proposal(tokens=torch.tensor(toks, dtype=torch.int64), probs=q))
        return out

    def release(self, session_ids):
        pass


def support(sampling: Sampling) -> torch.Tensor:
    """[V, V] bool: which next tokens the target can emit after each token."""
    return probs_from_logits(TABLE, sampling) > 0


SAMPLINGS = [Sampling(temperature=1.0, top_k=2), Sampling(temperature=0.8, top_p=0.5)]


def _generate(engine, drafter, sampling, seed, n=60):
    req = Request(request_id=f"edge{seed}", prompt=[0, 3], max_tokens=n, ignore_eos=True,
                  sampling=Sampling(temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, seed=seed),
                  proposer=drafter, spec_mode="fixed")
    events = list(engine.generate(req))
    out = [t for ev in events for t in ev.tokens]
    assert len(out) == n
    return [3] + out, events          # the last prompt token, then what was emitted


def assert_in_support(seq, sampling):
    """Every transition of ``seq`` (a token, then each emitted one) has target probability > 0."""
    ok = support(sampling)
    bad = [(a, b) for a, b in zip(seq, seq[1:]) if not ok[a, b]]
    assert not bad, f"{len(bad)} emitted tokens outside the target's support, e.g. {bad[:5]}"


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["top_k2", "top_p0.5"])
def test_zero_q_drafter_falls_back_and_stays_in_support(sampling):
    engine = VerifierEngine(TableTarget())
    try:
        drafter = ZeroOnDraftDrafter()
        for seed in range(3):
            seq, events = _generate(engine, drafter, sampling, seed)
            assert_in_support(seq, sampling)
            steps = [ev for ev in events if ev.step >= 0]
            assert all(ev.drafted == 0 and ev.accepted == 0 for ev in steps)
            # Every step falls back but the last: with one token of room left there is no block.
            assert [ev.fallback for ev in steps[:-1]] == ["malformed_probs"] * (len(steps) - 1)
            assert events[-1].stats.fallback_steps == len(steps) - 1
        assert drafter.calls > 0
        # The same seed without speculation gives the same tokens: the fallback is plain decoding.
        plain, _ = _generate(engine, None, sampling, 1)
        assert plain == _generate(engine, drafter, sampling, 1)[0]
    finally:
        engine.close()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["top_k2", "top_p0.5"])
def test_kernel_rule_alone_keeps_zero_q_drafts_out(sampling, monkeypatch):
    """Defence in depth: with the malformed check bypassed, the zero-q drafts reach
    verification, and the acceptance rule alone rejects every one of them."""
    engine = VerifierEngine(TableTarget())
    monkeypatch.setattr(engine.sync, "malformed", lambda res, k, top_k=0: None)
    try:
        drafted = 0
        for seed in range(3):
            seq, events = _generate(engine, ZeroOnDraftDrafter(), sampling, seed)
            assert_in_support(seq, sampling)
            steps = [ev for ev in events if ev.step >= 0]
            assert all(ev.fallback is None and ev.accepted == 0 for ev in steps)
            assert all(ev.drafted > 0 for ev in steps[:-1])
            drafted += sum(ev.drafted for ev in steps)
        assert drafted > 0
    finally:
        engine.close()
