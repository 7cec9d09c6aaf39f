"""The prefix cache in the engine and through the services: a request that starts like an
earlier one of its tenant prefills only the rest, and decodes exactly what it decodes with the
cache off (every speculation mode, greedy and seeded sampled); another tenant never hits it;
sessions pin their K/V in the same cache between turns; cancelled requests leave nothing;
the bound holds; a new verifier starts empty; ``cached_tokens`` and the counters tell it.

Identity is exact (``helpers.assert_same_tokens`` reports the target's top-2 logit gap where a
token differs): in float32 a prefill of the prompt's rest rounds its last bits differently
from one of the whole prompt, so a near-tie could flip a token; the ``target`` fixture runs
every identity test in the batch-invariant mode too when the target offers it, where the
chunking changes no bit.
"""

from __future__ import annotations

import random

import openai
import pytest

from dflash.core.finish import FINISH_CANCELLED
from dflash.core.sampling import Sampling
from dflash.core.speculation import SpecMode
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.prefix_reuse import new_prefix_cache

from gateway_doubles import http_front
from helpers import Stack, assert_same_tokens, generate_ids, reference

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(48)]
N = 16


@pytest.fixture(scope="module", params=["default", "batch_invariant"])
def target(request, tiny_target, target_model):
    """The target, as served by default and batch-invariant (``--batch-invariant``)."""
    if request.param == "default":
        return target_model
    from verifier_svc.target import TargetModel

    return TargetModel(tiny_target, batch_invariant=True)


@pytest.fixture
def drafter(make_drafter, tiny_target):
    return DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target,
                                         device="cpu", context_threads=0)


def _engine(target, cache=True, mb=64.0, **kw):
    return VerifierEngine(target, prefix_cache=new_prefix_cache(target.pool, mb) if cache else None,
                          **kw)


def _run(engine, prompt, *, rid="r", tenant="", proposer=None, mode=SpecMode.OFF, sampling=None,
         sid="", n=N):
    evs = list(engine.generate(Request(request_id=rid, prompt=prompt, max_tokens=n,
                                       ignore_eos=True, proposer=proposer, spec_mode=mode,
                                       sampling=sampling or Sampling(), tenant=tenant,
                                       session_id=sid)))
    return [t for ev in evs for t in ev.tokens], evs[0].cached_prompt_tokens


MODES = [(SpecMode.OFF, False), (SpecMode.FIXED, True), (SpecMode.TREE, True), (SpecMode.ADAPTIVE, True),
         (SpecMode.HYBRID, True), (SpecMode.SUFFIX, False)]


@pytest.mark.parametrize("mode,with_drafter", MODES, ids=[m for m, _ in MODES])
def test_greedy_identical_with_the_cache_on_off_and_on_a_hit(target, hf_target, drafter, mode,
                                                             with_drafter):
    proposer = drafter if with_drafter else None
    on, off = _engine(target, spec_mode=mode), _engine(target, cache=False, spec_mode=mode)
    try:
        first, cached = _run(on, PROMPT, rid="a", proposer=proposer, mode=mode)
        assert cached == 0
        assert_same_tokens(hf_target, PROMPT, first, reference(hf_target, PROMPT, N, ignore_eos=True))
        again, cached = _run(on, PROMPT, rid="b", proposer=proposer, mode=mode)
        assert cached == len(PROMPT) - 1                     # all but the last prompt token
        assert_same_tokens(hf_target, PROMPT, again, first)
        # the next turn resends the conversation: its history is cached, answer included
        turn = PROMPT + first + [11, 12, 13]
        want = reference(hf_target, turn, N, ignore_eos=True)
        got, cached = _run(on, turn, rid="c", proposer=proposer, mode=mode)
        assert cached == len(PROMPT) + N - 1                 # the last answer token never ran
        assert_same_tokens(hf_target, turn, got, want)
        assert_same_tokens(hf_target, turn, _run(off, turn, rid="d", proposer=proposer,
                                                 mode=mode)[0], want)
    finally:
        on.close()
        off.close()


@pytest.mark.parametrize("with_drafter", [False, True])
def test_seeded_sampled_identical_hit_vs_miss(target, drafter, with_drafter):
    proposer = drafter if with_drafter else None
    mode = SpecMode.FIXED if with_drafter else SpecMode.OFF
    sampling = Sampling(temperature=1.0, seed=17)
    on, off = _engine(target, spec_mode=mode), _engine(target, cache=False, spec_mode=mode)
    try:
        miss, _ = _run(off, PROMPT, proposer=proposer, mode=mode, sampling=sampling)
        _run(on, PROMPT, rid="fill", proposer=proposer, mode=mode, sampling=sampling)
        hit, cached = _run(on, PROMPT, rid="hit", proposer=proposer, mode=mode, sampling=sampling)
        assert cached == len(PROMPT) - 1 and hit == miss
    finally:
        on.close()
        off.close()


def test_another_tenant_never_hits_and_the_owner_still_does(target_model):
    engine = _engine(target_model)
    try:
        assert _run(engine, PROMPT, rid="a", tenant="A")[1] == 0
        assert _run(engine, PROMPT, rid="b", tenant="B")[1] == 0      # not A's
        assert _run(engine, PROMPT, rid="c", tenant="")[1] == 0       # nor the anonymous one
        assert _run(engine, PROMPT, rid="d", tenant="A")[1] == len(PROMPT) - 1
        assert _run(engine, PROMPT, rid="e", tenant="B")[1] == len(PROMPT) - 1   # its own now
    finally:
        engine.close()


def test_a_declared_shared_prefix_serves_every_tenant(target_model, hf_target):
    system = PROMPT[:32]
    cache = new_prefix_cache(target_model.pool, 64, shared=[system])
    engine = VerifierEngine(target_model, prefix_cache=cache, spec_mode=SpecMode.OFF)
    try:
        assert _run(engine, system + [5, 6, 7], rid="a", tenant="A")[1] == 0
        q = system + [9, 9, 4, 4]
        got, cached = _run(engine, q, rid="b", tenant="B")
        assert cached == len(system)
        assert_same_tokens(hf_target, q, got, reference(hf_target, q, N, ignore_eos=True))
    finally:
        engine.close()


def test_a_session_pins_its_kv_between_turns_in_the_same_cache(target_model, hf_target):
    engine = _engine(target_model, mb=0.001)         # room for nothing but the pin
    cache = engine.prefix_cache
    try:
        first, _ = _run(engine, PROMPT, rid="t1", sid="S", tenant="A")
        assert cache.pinned_bytes > 0 and engine.cached_tokens == len(PROMPT) + N - 1
        for k in range(4):                         # other requests cannot evict it
            _run(engine, [k + 1] * 40, rid=f"o{k}", tenant="A")
        # while the session is idle, its tenant's one-shot requests read it
        assert _run(engine, PROMPT + [1], rid="peek", tenant="A")[1] == len(PROMPT)
        assert _run(engine, PROMPT + [1], rid="other", tenant="B")[1] == 0
        turn = PROMPT + first + [3, 4]
        got, cached = _run(engine, turn, rid="t2", sid="S", tenant="A")
        assert cached == len(PROMPT) + N - 1
        assert_same_tokens(hf_target, turn, got, reference(hf_target, turn, N, ignore_eos=True))
        assert engine.close_session("S")
        assert cache.pinned_bytes == 0 and engine.cached_tokens == 0
    finally:
        engine.close()


def test_a_cancelled_request_leaves_nothing_and_its_session_lets_go(target_model):
    engine = _engine(target_model)
    cache = engine.prefix_cache
    try:
        _run(engine, PROMPT, rid="t1", sid="S")
        assert cache.pinned_bytes > 0
        gone = {"now": False}
        gen = engine.generate(Request(request_id="t2", session_id="S", prompt=PROMPT + [1, 2],
                                      max_tokens=50, ignore_eos=True, spec_mode=SpecMode.OFF),
                              cancelled=lambda: gone["now"])
        assert next(gen).cached_prompt_tokens == len(PROMPT)       # its pin taken back
        gone["now"] = True
        assert [ev.finish for ev in gen][-1] == FINISH_CANCELLED
        assert engine.num_sessions == 0 and cache.pinned_bytes == 0
        # the turn had taken its K/V back, and a cancelled turn keeps nothing (its session
        # goes, as without the cache)
        assert _run(engine, PROMPT + [1, 2], rid="x")[1] == 0
        one_shot = engine.generate(Request(request_id="c", prompt=[9] * 40, max_tokens=50,
                                           ignore_eos=True, spec_mode=SpecMode.OFF),
                                   cancelled=lambda: True)
        list(one_shot)
        assert _run(engine, [9] * 41, rid="y")[1] == 0
    finally:
        engine.close()


def test_the_bound_holds_over_many_random_prompts_and_nothing_is_refused(target_model):
    engine = _engine(target_model, mb=0.05)
    cache = engine.prefix_cache
    rng = random.Random(3)
    try:
        for i in range(40):
            prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(17, 90))]
            got, _ = _run(engine, prompt, rid=f"r{i}", n=2, tenant=f"t{i % 3}")
            assert len(got) == 2
            assert cache.nbytes <= cache.max_bytes
        assert cache.stats.evicted > 0
    finally:
        engine.close()


def test_a_new_verifier_starts_empty_and_serves_the_same(target_model):
    engine = _engine(target_model)
    try:
        want, _ = _run(engine, PROMPT, rid="a")
        assert _run(engine, PROMPT, rid="b")[1] == len(PROMPT) - 1
    finally:
        engine.close()
    restarted = _engine(target_model)
    try:
        got, cached = _run(restarted, PROMPT, rid="c")
        assert cached == 0 and got == want
    finally:
        restarted.close()


def test_usage_counts_cached_tokens_over_grpc_and_http_per_client(target_model, tokenizer):
    from dflash.serving.telemetry import Telemetry

    telemetry: dict[str, Telemetry] = {}

    def make(service):
        return telemetry.setdefault(service, Telemetry(service=service))

    stack = Stack(target_model, tokenizer, telemetry=make,
                  prefix_cache=new_prefix_cache(target_model.pool, 64))
    h = http_front(stack.gateway.servicer, serving=lambda: stack.gateway.serving)
    try:
        v = stack.verifier_stub()
        for want in (0, len(PROMPT) - 1):
            _, last = generate_ids(v, PROMPT, max_tokens=4, ignore_eos=True, tenant="A")
            assert last.cached_prompt_tokens == want
        _, last = generate_ids(v, PROMPT, max_tokens=4, ignore_eos=True, tenant="B")
        assert last.cached_prompt_tokens == 0

        def chat(client_name):
            c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0,
                              timeout=60, default_headers={"x-dflash-client": client_name})
            try:
                r = c.completions.create(model="tiny", prompt="the cache " * 12, max_tokens=3,
                                         temperature=0)
            finally:
                c.close()
            return r.usage

        assert chat("alice").prompt_tokens_details.cached_tokens == 0
        u = chat("alice")
        assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1
        assert chat("bob").prompt_tokens_details.cached_tokens == 0
        reg = telemetry["verifier"].registry
        queries = reg.get_sample_value("vllm:prefix_cache_queries_total")
        hits = reg.get_sample_value("vllm:prefix_cache_hits_total")
        assert hits == (len(PROMPT) - 1) + u.prompt_tokens - 1
        assert queries == 3 * len(PROMPT) + 3 * u.prompt_tokens
        assert reg.get_sample_value("dflash_verifier_prefix_cache_entries") >= 3
    finally:
        h.stop()
        stack.close()


def test_the_shared_prefix_file_is_read_and_bad_ones_name_the_flag(tmp_path):
    from verifier_svc.prefix_reuse import read_shared

    good = tmp_path / "shared.json"
    good.write_text("[[1, 2, 3], [4, 5]]")
    assert read_shared(good, 10) == [[1, 2, 3], [4, 5]]
    for text, why in (("{", "cannot read"), ('{"a": 1}', "list of token-id lists"),
                      ("[[]]", "entry 0"), ("[[1], [2, 99]]", "entry 1: 99"),
                      ('[[1, "x"]]', "entry 0")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="--prefix-cache-shared") as e:
            read_shared(bad, 10)
        assert why in str(e.value)
    with pytest.raises(ValueError, match="--prefix-cache-shared: cannot read"):
        read_shared(tmp_path / "missing.json", 10)


def test_the_flags_turn_the_cache_on_by_default_off_and_declare_shared(target_model, tmp_path):
    from verifier_svc.flags import parse_args
    from verifier_svc.server import _engine_of

    shared = tmp_path / "shared.json"
    shared.write_text(f"[{PROMPT[:20]}]")
    engines = [_engine_of(parse_args(["--target", "t", *argv]), target_model, 0)
               for argv in ([], ["--prefix-cache", "off"],
                            ["--prefix-cache-mb", "3", "--prefix-cache-shared", str(shared)])]
    try:
        on, off, sized = engines
        assert on.prefix_cache is not None and on.prefix_cache.max_bytes == 2048 << 20
        assert off.prefix_cache is None
        assert sized.prefix_cache.max_bytes == 3 << 20
        assert sized.prefix_cache.shared_prefixes == [tuple(PROMPT[:20])]
    finally:
        for e in engines:
            e.close()
