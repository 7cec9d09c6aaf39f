"""Continuous batching: many requests in one decode loop give exactly what they give alone.

Through the real services (in-process gRPC): the verifier's scheduler verifies every running
session in one target forward and sends the drafter one message per step; these tests check
that batching changes nothing a request can observe.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dflash.v1 import common_pb2, verifier_pb2
from drafter_svc.engine import DrafterEngine

from helpers import Stack, assert_same_tokens, generate_ids, reference, wait_until

LENGTHS = [2, 3, 5, 8, 11, 17, 25, 40, 60, 90, 130, 180, 240, 300, 7, 50]
MAX_NEW = 32
MODES = ["fixed", "adaptive", "off", ""]


def prompts(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist() for i in range(n)]


def spec(addr, mode="", block_size=0):
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, mode=mode,
                                          block_size=block_size)


@pytest.fixture
def batch_stack(target_model, tokenizer):
    s = Stack(target_model, tokenizer, prefill_chunk=64)
    sizes: list[int] = []
    s.engine.step_listeners.append(lambda req, ev: sizes.append(ev.batch_size))
    s.batch_sizes = sizes
    yield s
    s.close()


def run_all(stub, calls):
    """Start every call at once (a barrier), return their (ids, last chunk)."""
    barrier = threading.Barrier(len(calls))

    def one(kw):
        barrier.wait()
        return generate_ids(stub, **kw)

    with ThreadPoolExecutor(len(calls)) as ex:
        return list(ex.map(one, calls))


def test_16_concurrent_greedy_requests_identical_to_alone(batch_stack, make_drafter, tiny_target,
                                                          hf_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = batch_stack.add_drafter(engine)
    ps = prompts()
    calls = [dict(prompt_ids=p, max_tokens=MAX_NEW, speculation=spec(addr, MODES[i % 4]))
             for i, p in enumerate(ps)]
    results = run_all(batch_stack.verifier_stub(), calls)
    assert max(batch_stack.batch_sizes) >= 8, "requests did not run as one batch"
    for p, (got, _last) in zip(ps, results):
        assert_same_tokens(hf_target, p, got, reference(hf_target, p, MAX_NEW))
    assert any(last.stats.drafts for _, last in results)
    assert batch_stack.engine.num_sessions == 0
    # the drafter was told to forget every one-shot session
    wait_until(lambda: engine.num_sessions == 0, 5,
               lambda: f"the drafter to forget its one-shot sessions ({engine.num_sessions} left)")


def test_sampled_greedy_and_seeded_in_one_batch_do_not_interact(batch_stack, make_drafter,
                                                                 tiny_target, hf_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = batch_stack.add_drafter(engine)
    v = batch_stack.verifier_stub()
    ps = prompts(10, seed=3)
    seeded = [common_pb2.SamplingParams(temperature=0.8, seed=7),
              common_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=123)]
    # a seeded request's output is its output without speculation (coupled sampling), in
    # every mode, alone or in a batch, whatever the drafts, block lengths or a late drafter
    alone = [generate_ids(v, ps[i], max_tokens=MAX_NEW, sampling=s, speculation=spec(addr, "off"))[0]
             for i, s in enumerate(seeded)]
    for mode in ("fixed", "tree", "adaptive"):
        for i, s in enumerate(seeded):
            got, last = generate_ids(v, ps[i], max_tokens=MAX_NEW, sampling=s,
                                     speculation=spec(addr, mode))
            assert got == alone[i], f"seeded request {i} in mode {mode} differs from no speculation"
            assert last.stats.drafts > 0 or mode == "adaptive"
    for other_seed in (1, 2):  # two different batch compositions around the seeded requests
        others = prompts(8, seed=10 + other_seed)
        calls = [dict(prompt_ids=ps[i], max_tokens=MAX_NEW, sampling=s,
                      speculation=spec(addr, ("fixed", "tree")[other_seed - 1]))
                 for i, s in enumerate(seeded)]
        calls += [dict(prompt_ids=p, max_tokens=MAX_NEW, speculation=spec(addr, MODES[i % 4]))
                  for i, p in enumerate(others[:4])]                                # greedy
        calls += [dict(prompt_ids=p, max_tokens=MAX_NEW + 8 * other_seed, speculation=spec(addr),
                       sampling=common_pb2.SamplingParams(temperature=1.0))         # unseeded
                  for p in others[4:]]
        results = run_all(v, calls)
        assert max(batch_stack.batch_sizes) >= 6
        for i in range(len(seeded)):
            assert results[i][0] == alone[i], f"seeded request {i} changed with the batch"
        for p, (got, _) in zip(others[:4], results[2:6]):
            assert_same_tokens(hf_target, p, got, reference(hf_target, p, MAX_NEW))
        assert all(len(got) >= 1 for got, _ in results[6:])


def test_cancel_in_the_middle_of_a_batch_frees_state_others_unaffected(batch_stack, make_drafter,
                                                                       tiny_target, hf_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = batch_stack.add_drafter(engine)
    v = batch_stack.verifier_stub()
    ps = prompts(4, seed=5)
    n = 150
    reqs = [verifier_pb2.VerifierGenerateRequest(
        request_id=f"c{i}", prompt_token_ids=p, max_tokens=n, ignore_eos=True,
        sampling=common_pb2.SamplingParams(), speculation=spec(addr, "fixed")) for i, p in enumerate(ps)]
    calls = [v.Generate(r) for r in reqs]
    done = [threading.Event() for _ in calls]
    outs: list[list[int]] = [[] for _ in calls]

    def consume(i):
        for chunk in calls[i]:
            outs[i] += list(chunk.token_ids)
        done[i].set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(1, 4)]
    for t in threads:
        t.start()
    it = iter(calls[0])
    for _ in range(3):
        next(it)
    calls[0].cancel()
    wait_until(lambda: "req-c0" not in batch_stack.engine._sessions and "req-c0" not in engine._sessions,
               10, lambda: f"the cancelled session to be freed (verifier keeps it: "
                           f"{'req-c0' in batch_stack.engine._sessions}, drafter keeps its context: "
                           f"{'req-c0' in engine._sessions})")
    assert not any(d.is_set() for d in done[1:]), "the others should still be running"
    for t in threads:
        t.join(60)
    for i in range(1, 4):
        want = reference(hf_target, ps[i], n, ignore_eos=True)
        assert_same_tokens(hf_target, ps[i], outs[i], want)


def test_long_prefill_is_chunked_between_decode_steps(target_model, hf_target):
    """A 900-token prompt joining a running request is prefilled 64 tokens at a time, with a
    decode step of the running request after every chunk; both outputs stay exact."""
    from verifier_svc.engine import Request, VerifierEngine

    engine = VerifierEngine(target_model, prefill_chunk=64)
    log = []
    real_prefill, real_decode = engine.prefill_chunk, engine.decode_step
    engine.prefill_chunk = lambda job, budget: log.append(("prefill", job.req.request_id)) or \
        real_prefill(job, budget)
    engine.decode_step = lambda plan: log.append(("decode", tuple(j.req.request_id for j in plan.jobs))) or \
        real_decode(plan)
    short, long = prompts(1, seed=9)[0], list(range(200, 250)) * 18
    out = {}
    started = threading.Event()

    def run(rid, p, n):
        evs = engine.generate(Request(request_id=rid, prompt=p, max_tokens=n, ignore_eos=True))
        out[rid] = []
        for ev in evs:
            out[rid] += ev.tokens
            started.set()

    a = threading.Thread(target=run, args=("a", short, 60))
    a.start()
    started.wait()
    b = threading.Thread(target=run, args=("b", long, 8))
    b.start()
    a.join()
    b.join()
    engine.close()
    chunks = [i for i, (kind, rid) in enumerate(log) if kind == "prefill" and rid == "b"]
    assert len(chunks) == -(-len(long) // 64)
    for i in chunks[:-1]:   # after each chunk but the last, the running request steps
        assert log[i + 1] == ("decode", ("a",)), log[i:i + 2]
    assert_same_tokens(hf_target, short, out["a"], reference(hf_target, short, 60, ignore_eos=True))
    assert_same_tokens(hf_target, long, out["b"], reference(hf_target, long, 8, ignore_eos=True))


def _run_readers(engine, delays, n):
    """Requests read with a pause after each event (a gRPC write + client turnaround)."""
    from verifier_svc.engine import Request

    steps = []
    real = engine.decode_step
    engine.decode_step = lambda plan: steps.append(tuple(j.req.request_id for j in plan.jobs)) or real(plan)
    done = {}

    def run(rid, delay):
        toks = []
        for ev in engine.generate(Request(request_id=rid, prompt=[5, 6, 7, 8], max_tokens=n,
                                          ignore_eos=True)):
            toks += ev.tokens
            time.sleep(delay)   # the behaviour: a reader that comes back slowly
        done[rid] = (toks, time.monotonic())

    ts = [threading.Thread(target=run, args=(f"r{i}", d)) for i, d in enumerate(delays)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return steps, done


def test_steps_wait_for_readers_that_come_back_slowly(target_model):
    """Two readers that take 30 ms to ask again still share every step (before the fix, a
    fixed 10 ms wait ran them as alternating singletons)."""
    from verifier_svc.engine import VerifierEngine

    engine = VerifierEngine(target_model)
    try:
        steps, done = _run_readers(engine, [0.03, 0.03], 24)
    finally:
        engine.close()
    both = [s for s in steps if len(s) == 2]
    alone = [s for s in steps if len(s) == 1]
    assert len(both) >= 18 and len(alone) <= 6, steps
    assert done["r0"][0] == done["r1"][0]          # same prompt, greedy: same tokens


def test_a_slow_reader_does_not_hold_back_the_batch(target_model):
    """A reader that takes 120 ms per event is not waited for: the fast request runs at its
    own pace and finishes long before the slow one."""
    from verifier_svc.engine import VerifierEngine

    engine = VerifierEngine(target_model)
    try:
        t0 = time.monotonic()
        steps, done = _run_readers(engine, [0.0, 0.12], 12)
    finally:
        engine.close()
    fast, slow = done["r0"][1] - t0, done["r1"][1] - t0
    assert fast < 0.5 * slow, (fast, slow)
    assert sum("r0" in s for s in steps) >= 11


def test_pool_rows_are_reused_with_no_growth_over_1000_join_leave_cycles():
    """The batch KV pool hands freed rows to new sequences: 1,000 cycles of sequences joining
    (up to 8 at once, random lengths) and leaving keep the rows at the peak of live sequences,
    reallocate only while the capacity first grows, and return the memory when all are gone
    (a pool above ``keep_idle_bytes``, after ``shrink_after_s``; smaller ones keep their
    buffers for the next request)."""
    import random

    from dflash.core.kv_pool import KVPool

    rng = random.Random(0)
    pool = KVPool(2, 2, 4, room=32, keep_idle_bytes=0)
    live, peak, grown_at = [], 0, {}
    for cycle in range(1000):
        seq = pool.new_seq()
        n = rng.randint(1, 60)
        row = pool.ensure_resident(seq)
        pool.reserve(n)
        for layer in range(2):
            k = torch.full((1, 2, n, 4), float(cycle))
            pool.write(layer, row, 0, k, k)
        pool.advance([seq], [n])
        live.append((seq, cycle, n))
        del seq                                           # only ``live`` holds sequences
        peak = max(peak, len(live))
        if len(live) > rng.randint(1, 8):
            live.pop(rng.randrange(len(live)))
        rows = pool.arrange([s for s, _, _ in live])        # the next step's batch
        assert sorted(rows) == list(range(len(live)))
        for r, (s, c, m) in zip(rows, live):                # every row still holds its own K/V
            assert s.row == r and torch.equal(pool.k[1][r, :, :m], torch.full((2, m, 4), float(c)))
        assert pool.rows <= peak and pool.resident == len(live)
        grown_at[cycle] = pool.grown
    assert grown_at[999] == grown_at[100] <= 8, grown_at[999]
    pool.shrink_after_s = 0                               # shrink at once once over-provisioned
    live.clear()
    del s
    assert pool.resident == 0 and pool.rows == 0 and not pool.k   # memory given back
    kept = KVPool(2, 2, 4)
    kept.ensure_resident(kept.new_seq())                  # the handle is dropped at once
    assert kept.resident == 0 and kept.k and kept.nbytes <= kept.keep_idle_bytes


def test_engine_frees_pool_rows_of_finished_requests(tiny_target):
    """Requests that come and go (one-shot and kept sessions, some concurrent) leave no rows
    behind: one-shot sessions free theirs, kept sessions spill out of the pool between turns."""
    from verifier_svc.engine import Request, VerifierEngine
    from verifier_svc.target import TargetModel

    # a target of its own: the shared one's pool holds other tests' idle sessions, which may
    # spill while this test runs
    target_model = TargetModel(tiny_target)
    engine = VerifierEngine(target_model)
    pool = target_model.pool
    before = pool.resident

    def worker(w):
        # a kept session belongs to one worker: two turns of one session never overlap (the
        # engine refuses that, PreconditionError), whatever order the threads run in
        for j in range(30):
            i = 30 * w + j
            sid = f"kept-{w}" if w < 3 and j % 2 else ""
            for _ in engine.generate(Request(request_id=f"j{i}", session_id=sid,
                                             prompt=[5 + i % 7, 6, 7], max_tokens=3,
                                             ignore_eos=True)):
                pass

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(worker, range(4)))
    assert pool.resident == before
    assert engine.num_sessions == 3
    for sid in ("kept-0", "kept-1", "kept-2"):
        engine.close_session(sid)
    engine.close()


def test_a_stalled_reader_neither_blocks_nor_slows_the_others_and_is_cancelled(target_model):
    """The scheduler never waits for readers: a client that stops reading after its first
    event does not hold back a neighbour (which finishes while the stalled one still waits,
    at its usual inter-token latency); its events are buffered up to ``max_unread``, then its
    request is cancelled with SlowConsumer."""
    from verifier_svc.engine import Request, SlowConsumer, VerifierEngine

    engine = VerifierEngine(target_model, max_unread=16)

    def itl(rid):
        times = []
        for _ev in engine.generate(Request(request_id=rid, prompt=[9, 8, 7], max_tokens=48,
                                          ignore_eos=True)):
            times.append(time.perf_counter())
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2]

    alone = itl("alone")
    release, first, got = threading.Event(), threading.Event(), {}

    def stalled():
        evs = engine.generate(Request(request_id="stalled", prompt=[1, 2, 3], max_tokens=400,
                                      ignore_eos=True))
        got["first"] = next(evs)
        first.set()
        release.wait(60)
        try:
            for _ in evs:
                got["n"] = got.get("n", 0) + 1
        except SlowConsumer as e:
            got["error"] = e

    t = threading.Thread(target=stalled)
    t.start()
    assert first.wait(60), "the stalled request's first event"
    beside = itl("beside")
    assert not release.is_set() and t.is_alive()        # the neighbour finished meanwhile
    release.set()
    t.join(60)
    engine.close()
    assert isinstance(got.get("error"), SlowConsumer), got
    assert got.get("n", 0) <= 16                          # buffered events, then the error
    assert beside < 3 * alone + 0.005, (beside, alone)
    assert engine.num_sessions == 0

def test_a_step_that_loses_events_fails_its_requests_instead_of_hanging(target_model):
    """If a decode step returns fewer events than it had jobs, the scheduler fails the requests
    with an error (their readers would otherwise wait for an event that never comes)."""
    from verifier_svc.engine import Request, VerifierEngine

    engine = VerifierEngine(target_model)
    engine.decode_step = lambda plan: []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="0 events for 1 jobs"):
        for _ in engine.generate(Request(request_id="x", prompt=[5, 6, 7], max_tokens=4,
                                         ignore_eos=True)):
            pass
    assert time.monotonic() - t0 < 30
    engine.close()


def test_a_cancelled_turn_of_a_kept_session_frees_the_session(target_model):
    """A turn cancelled between steps may have left part of its prompt in the cache: the
    session is closed (not kept for prefix reuse), like a one-shot request."""
    from verifier_svc.engine import Request, VerifierEngine

    engine = VerifierEngine(target_model)
    cancel = threading.Event()
    evs = []
    for ev in engine.generate(Request(request_id="c", session_id="kept", prompt=[4, 5, 6, 7],
                                      max_tokens=200, ignore_eos=True), cancelled=cancel.is_set):
        evs.append(ev)
        cancel.set()
    engine.close()
    assert evs[-1].finish == "cancelled" and len(evs) < 200
    assert "kept" not in engine._sessions
