"""Speculation policy: off / fixed / adaptive, per deployment and per request, and what it sees."""

from __future__ import annotations

import grpc
import pytest

from dflash.core.sampling import InvalidParam
from dflash.v1 import verifier_pb2
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.policy import CANDIDATES, SpeculationPolicy, bucket

from doubles import ReferenceDrafter, chains, policy_job
from helpers import PROMPTS, Stack, generate_ids, reference, wait_until

LABEL = "d@1"


def job(mode="adaptive", block=16, max_tokens=1000, emitted=1):
    return policy_job(LABEL, mode=mode, block=block, max_tokens=max_tokens, emitted=emitted)


def trained(rate_fn, cost_fn, batch=1, steps=400):
    """A policy that has seen acceptance ``rate_fn(p)`` per position and cost ``cost_fn(k)``."""
    p = SpeculationPolicy("adaptive", explore_every=0)
    _state[0] = 0                 # the same draws whichever tests ran before
    for _ in range(steps):
        acc = 0
        while acc < 15 and _coin(rate_fn, acc):
            acc += 1
        p.observe_acceptance(LABEL, [(15, acc)])
    for k in CANDIDATES:
        if k <= 15:
            for _ in range(2):    # confirmed cells (one step is provisional: _Cell)
                p.observe_step(batch, k, cost_fn(k), 0.0)
    return p


_state = [0]


def _coin(rate_fn, pos):  # deterministic: conditional acceptance rate_fn(pos) as a fraction
    _state[0] = (_state[0] * 1103515245 + 12345) % 2**31
    return _state[0] / 2**31 < rate_fn(pos)


def test_fixed_and_off_choices():
    p = SpeculationPolicy("fixed")
    jobs = [job("fixed", 8), job("off", 8), job("fixed", 8, max_tokens=3, emitted=1)]
    assert p.choose(jobs) == [7, 0, 1]    # the last block is shortened to max_tokens
    with pytest.raises(ValueError, match="spec_mode"):
        SpeculationPolicy("sometimes")


def test_adaptive_speculates_when_drafts_are_good_and_verify_is_flat():
    p = trained(lambda pos: 0.95, lambda k: 0.010 + 0.0002 * k)
    c = p.choose_shapes([job()])
    k = c.ks[0]
    assert k >= 11
    assert c.decision.k == k and c.decision.expected_tokens > 5


def test_adaptive_stops_speculating_when_drafts_fail_and_verify_grows():
    p = trained(lambda pos: 0.05, lambda k: 0.010 * (1 + k))
    assert p.choose([job()]) == [0]


def test_adaptive_shortens_blocks_as_the_batch_grows():
    p = trained(lambda pos: 0.8, lambda k: 0.010 * (1 + 0.25 * k))
    k1 = p.choose([job()])[0]
    assert 2 <= k1 <= 9
    # bucket 8 was never measured: its cost comes from the line fitted to the measured cells
    c = p.choose_shapes([job() for _ in range(5)])
    k8 = c.ks[0]
    assert bucket(5) == 8 and k8 < k1
    assert c.decision.explored and c.decision.cost_seconds > 0


def test_candidates_tried_in_order_until_a_cost_line_exists():
    p = SpeculationPolicy("adaptive", explore_every=0)
    tried = []
    for _ in range(2):
        c = p.choose_shapes([job()])
        tried.append(c.ks[0])
        assert c.decision.explored
        p.observe_step(1, tried[-1], 0.01 * (1 + tried[-1]), 0.0)
    assert tried == list(CANDIDATES[:2])
    # cost grows as fast as tokens: with the optimistic prior, no speculation is still best
    c = p.choose_shapes([job()])
    assert c.ks == [0] and not c.decision.explored


def test_expected_tokens_from_rates():
    p = SpeculationPolicy("adaptive")
    for acc in (0, 1, 2, 3):
        p.observe_acceptance(LABEL, [(3, acc)])
    assert p.rates(LABEL) == pytest.approx([0.75, 0.5, 0.25], abs=1e-9)
    assert p.expected_tokens(LABEL, 2) == pytest.approx(1 + 0.75 + 0.5)
    # beyond measured positions: geometric with the last conditional rate (0.25 / 0.5)
    assert p.expected_tokens(LABEL, 4) == pytest.approx(1 + 0.75 + 0.5 + 0.25 + 0.125)


class Recording(ReferenceDrafter):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.items = []

    def propose(self, requests):
        self.items += [(r.context_start, r.context.shape[0], r.block_size) for r in requests]
        return super().propose(requests)


def test_no_speculation_steps_still_send_context(target_model, hf_target):
    """Adaptive k = 0 steps send block_size 1 (context only); when speculation resumes the
    drafter's context is contiguous and the oracle's drafts are all accepted again."""
    p = PROMPTS[1]
    n = 30
    ref = p + reference(hf_target, p, n, ignore_eos=True)
    oracle = Recording(target_model, {"s": ref}, block_size=4)
    engine = VerifierEngine(target_model, spec_mode="adaptive", context_flush=1)
    plan = iter([0, 0, 0, 3, 3, 0, 3] + [3] * 40)
    engine.policy.choose_shapes = chains(lambda jobs, waiting=0: [min(next(plan), max(0, j.req.max_tokens - j.emitted - 1))
                                         for j in jobs])
    evs = list(engine.generate(Request(request_id="r", session_id="s", prompt=p, max_tokens=n,
                                       ignore_eos=True, proposer=oracle)))
    got = [t for ev in evs for t in ev.tokens]
    assert got == ref[len(p):]
    assert [ev.drafted for ev in evs[1:4]] == [0, 0, 0]
    assert [ev.accepted for ev in evs[4:6]] == [3, 3]           # resumed at full acceptance
    assert [bs for _, _, bs in oracle.items[:3]] == [1, 1, 1]   # context-only updates
    pos = 0
    for start, rows, _ in oracle.items:
        assert start == pos, "context must stay contiguous across no-speculation steps"
        pos = start + rows
    engine.close()


def test_context_flushed_every_n_rows_without_speculation(target_model, hf_target):
    p = PROMPTS[2]
    n = 30
    ref = p + reference(hf_target, p, n, ignore_eos=True)
    oracle = Recording(target_model, {"s": ref}, block_size=4)
    engine = VerifierEngine(target_model, spec_mode="adaptive", context_flush=4)
    plan = iter([0] * 10 + [3] * 40)
    engine.policy.choose_shapes = chains(lambda jobs, waiting=0: [min(next(plan), max(0, j.req.max_tokens - j.emitted - 1))
                                         for j in jobs])
    evs = list(engine.generate(Request(request_id="r", session_id="s", prompt=p, max_tokens=n,
                                       ignore_eos=True, proposer=oracle)))
    assert [t for ev in evs for t in ev.tokens] == ref[len(p):]
    only_context = [(start, rows) for start, rows, bs in oracle.items if bs == 1]
    assert only_context[0] == (0, len(p))                         # the prompt's context at once
    assert [rows for _, rows in only_context[1:]] == [4, 4]        # then every 4 rows, not every step
    assert evs[11].drafted == 3 and evs[11].accepted == 3          # full acceptance on resuming
    pos = 0
    for start, rows, _ in oracle.items:
        assert start == pos
        pos = start + rows
    engine.close()


def run_overlapping(engine, proposer, prompts: dict[str, list[int]], n: int, after: int) -> None:
    """Greedy requests, one per session id, ``n`` tokens each: the first starts alone, each
    next one joins right after the previous one's ``after``-th event (the scheduler thread,
    which never waits for readers, holds that step's end until the next request is submitted,
    so the join point does not depend on thread timing); then the engine is closed."""
    import threading

    threads, errors = [], []
    items = list(prompts.items())
    gates = {sid: threading.Event() for sid, _ in items}

    def hold(req, ev):
        # events: the prefill's, then one per decode step (listeners see decode steps)
        if ev.step + 2 == after and req.request_id in gates and not gates[req.request_id].is_set():
            gates[req.request_id].set()
            if req.request_id != items[-1][0]:
                wait_until(lambda: engine.scheduler._incoming, 10, "the next request's submission",
                           interval=0.001)

    engine.step_listeners.append(hold)
    for sid, prompt in items:
        def run(sid=sid, prompt=prompt):
            try:
                for _ in engine.generate(Request(
                        request_id=sid, session_id=sid, prompt=prompt, max_tokens=n,
                        ignore_eos=True, proposer=proposer)):
                    pass
            except Exception as e:   # re-raised below, in the test's thread
                errors.append(e)
            gates[sid].set()

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        assert gates[sid].wait(60)
    for t in threads:
        t.join(60)
    engine.close()
    if errors:
        raise errors[0]


def test_sessions_without_speculation_flush_together(target_model, hf_target):
    """Without speculation, once the drafter is called in a step (a session's context is due, or
    a session joins) every session with unsent context rides along in that call."""
    pa, pb = PROMPTS[1], PROMPTS[2]
    n = 30
    refs = {"a": pa + reference(hf_target, pa, n, ignore_eos=True),
            "b": pb + reference(hf_target, pb, n, ignore_eos=True)}
    oracle = ReferenceDrafter(target_model, refs, block_size=4)
    engine = VerifierEngine(target_model, spec_mode="adaptive", context_flush=4)
    engine.policy.choose_shapes = chains(lambda jobs, waiting=0: [0] * len(jobs))
    real = engine.sync.draft
    calls = []                      # per step with a drafter call: [(unsent, room, sent)] per job

    def draft_all(items, *budget):
        before = [(it.cached - it.state.length, it.room) for it in items]
        out = real(items, *budget)
        sent = [it.state.length == it.cached and u > 0 for it, (u, _) in zip(items, before)]
        if any(sent):
            calls.append([(u, room, s) for (u, room), s in zip(before, sent)])
        return out

    engine.sync.draft = draft_all
    run_overlapping(engine, oracle, {"a": pa, "b": pb}, n, after=3)
    for call in calls:
        for unsent, room, sent in call:
            assert sent == (room and unsent > 0), calls
    # the batch did run calls where a session not yet due (fewer than 4 rows) rode along
    assert any(len(c) == 2 and all(s for _, _, s in c) and min(u for u, _, _ in c) < 4 for c in calls), calls


def test_cost_cells_skip_ramp_and_joining_steps(target_model, hf_target):
    """Steps with prompts waiting for prefill (forced k = 0) and steps that carry a joining
    session's whole prompt to the drafter do not feed the cost cells; steady steps do."""
    pa, pb = PROMPTS[1], PROMPTS[2] * 4
    n = 24
    refs = {"a": pa + reference(hf_target, pa, n, ignore_eos=True),
            "b": pb + reference(hf_target, pb, n, ignore_eos=True)}
    oracle = ReferenceDrafter(target_model, refs, block_size=4)
    engine = VerifierEngine(target_model, spec_mode="adaptive", prefill_chunk=4)
    steps = []                      # [waiting, joining, recorded] per decode step
    real_decode, real_observe = engine.decode_step, engine.policy.observe_step

    def decode(plan):
        steps.append([plan.waiting, any(j.decode.session.drafter.length == 0 for j in plan.jobs), False])
        return real_decode(plan)

    def observe(*a):
        steps[-1][2] = True
        real_observe(*a)

    engine.decode_step, engine.policy.observe_step = decode, observe
    run_overlapping(engine, oracle, {"a": pa, "b": pb}, n, after=4)
    assert [w > 0 for w, _, _ in steps].count(True) >= 2, steps      # a ramp happened
    assert [j for _, j, _ in steps].count(True) >= 2, steps          # both sessions joined
    assert [r for _, _, r in steps].count(True) >= 5, steps
    for waiting, joining, recorded in steps:
        assert recorded == (waiting == 0 and not joining), steps


def test_session_table_moves_the_prior_towards_the_request():
    from dflash.core.stats import AcceptanceCounter
    from verifier_svc.policy import SESSION_PRIOR_STEPS, session_table

    prior = [1.0, 1.8, 2.4, 2.85, 3.2]                  # rates 0.8, 0.6, 0.45, 0.35
    assert session_table(prior, None) == prior
    assert session_table(prior, AcceptanceCounter()) == prior
    low = AcceptanceCounter()
    for _ in range(12):
        low.record(2, 0)                                # drafted positions 1-2, never accepted
    t = session_table(prior, low)
    m = SESSION_PRIOR_STEPS
    r1 = m * 0.8 / (12 + m)
    assert t[1] == pytest.approx(1 + r1)
    r2 = m * 0.6 / (12 + m)
    assert t[2] - t[1] == pytest.approx(r2)
    assert t[3] - t[2] == pytest.approx(r2 * 0.45 / 0.6)     # untried: the prior's decay
    high = AcceptanceCounter()
    for _ in range(12):
        high.record(4, 4)
    h = session_table(prior, high)
    assert all(h[k] > prior[k] for k in range(1, 5))
    assert all(h[k + 1] - h[k] <= h[k] - h[k - 1] + 1e-12 for k in range(1, 4))


def test_choice_follows_each_requests_own_acceptance():
    """Same drafter EMA, same costs: a batch of requests whose drafts keep failing does not
    speculate; one whose drafts are accepted does."""
    from dflash.core.stats import AcceptanceCounter

    def batch(accepted):
        jobs = [job() for _ in range(4)]
        for j in jobs:
            j.stats = AcceptanceCounter()
            for _ in range(20):
                j.stats.record(3, accepted)
        return jobs

    p = trained(lambda pos: 0.6 * 0.8 ** pos, lambda k: 0.030 + 0.006 * k, batch=4)
    assert p.choose(batch(0))[0] == 0
    assert p.choose(batch(3))[0] >= 3


def test_expected_gain_is_calibrated_by_what_steps_commit():
    """Expected drafted tokens are scaled by committed / expected of recent speculative steps:
    steps that commit what was expected keep the choice; steps that commit only the bonus
    token drive the policy to no speculation."""
    p = trained(lambda pos: 0.6 * 0.8 ** pos, lambda k: 0.030 + 0.006 * k, batch=4)
    jobs = [job() for _ in range(4)]
    k = p.choose(jobs)[0]
    assert k > 0 and p.accuracy == 1.0
    owed = 0.0
    for _ in range(30):                       # commits the expectation (whole tokens, carried)
        ks = p.choose(jobs)
        owed += 4 * (p.expected_tokens(LABEL, ks[0]) - 1)
        total, owed = int(owed), owed - int(owed)
        p.observe_outcome([1 + total // 4 + (i < total % 4) for i in range(4)])
    assert ks[0] > 0 and 0.9 < p.accuracy < 1.1
    for _ in range(60):                       # every draft rejected
        ks = p.choose(jobs)
        p.observe_outcome([1] * 4)
        if ks[0] == 0:
            break
    assert ks[0] == 0 and p.accuracy < 0.5
    p.observe_outcome([5] * 4)                # no speculative step pending: ignored
    assert p.accuracy < 0.5


def spec(addr, mode=""):
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, mode=mode)


def test_mode_pinned_per_request_and_per_deployment(target_model, tokenizer, hf_target):
    s = Stack(target_model, tokenizer, spec_mode="off")
    try:
        p = PROMPTS[0]
        ref = p + reference(hf_target, p, 25, ignore_eos=True)
        addr = s.add_drafter(ReferenceDrafter(target_model, {"a": ref, "b": ref, "c": ref}, block_size=4))
        v = s.verifier_stub()
        got, last = generate_ids(v, p, max_tokens=25, ignore_eos=True, session_id="a", speculation=spec(addr))
        assert got == ref[len(p):] and last.stats.drafts == 0           # deployment default: off
        got, last = generate_ids(v, p, max_tokens=25, ignore_eos=True, session_id="b",
                                 speculation=spec(addr, "fixed"))
        assert got == ref[len(p):] and last.stats.mean_acceptance_length == pytest.approx(4)
        got, last = generate_ids(v, p, max_tokens=25, ignore_eos=True, session_id="c",
                                 speculation=spec(addr, "adaptive"))
        assert got == ref[len(p):] and last.stats.drafts > 0
        with pytest.raises(grpc.RpcError) as e:
            generate_ids(v, p, max_tokens=5, speculation=spec(addr, "sometimes"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.mode" in e.value.details()
    finally:
        s.close()


def test_engine_refuses_unknown_mode(target_model):
    engine = VerifierEngine(target_model)
    with pytest.raises(InvalidParam, match="speculation.mode"):
        engine.validate(Request(request_id="x", prompt=[1, 2], spec_mode="maybe"))


def test_policy_inputs_in_metrics_and_step_spans(target_model, tokenizer, hf_target):
    from test_observability import Traced, scrape

    traced = Traced()
    s = Stack(target_model, tokenizer, telemetry=traced, spec_mode="adaptive")
    try:
        p = PROMPTS[0]
        ref = p + reference(hf_target, p, 20, ignore_eos=True)
        addr = s.add_drafter(ReferenceDrafter(target_model, {"m": ref}, block_size=4), label="oracle@1")
        got, last = generate_ids(s.verifier_stub(), p, max_tokens=20, ignore_eos=True, session_id="m",
                                 speculation=spec(addr))
        assert got == ref[len(p):]
        spans = traced.spans(until=lambda x: any(y.name == "verifier.decode" for y in x))
        steps = [x for x in spans if x.name == "verifier.step"]
        assert steps and all(x.attributes["dflash.spec_mode"] == "adaptive" for x in steps)
        assert all(x.attributes["dflash.batch_size"] == 1 for x in steps)
        assert all("dflash.policy.drafts" in x.attributes and "dflash.policy.cost_seconds" in x.attributes
                   for x in steps)
        m = scrape(traced.by_service["verifier"][0].registry)
        rates = {k: v for k, v in m.items() if k[0] == "dflash_spec_policy_acceptance_rate"}
        assert rates and all(dict(k[1])["drafter_version"] == "oracle@1" for k in rates)
        assert all(v == pytest.approx(1.0) for v in rates.values())    # the oracle is always right
        assert any(k[0] == "dflash_spec_policy_step_seconds" for k in m)
        assert any(k[0] == "dflash_spec_policy_overhead_seconds" for k in m)
        assert any(k[0] == "dflash_spec_decode_policy_drafts_count" and dict(k[1])["mode"] == "adaptive"
                   for k in m)
    finally:
        s.close()


def test_acceptance_memory_is_counted_in_steps_not_sessions():
    """One step of 32 sessions that all rejected their first draft moves the rates as far as one
    step of one session would (alpha x the miss), not 32 times as far; a step's blocks of
    different lengths count each position over the blocks that drafted it."""
    p = trained(lambda pos: 0.5, lambda k: 0.01)
    before = p.rates(LABEL)
    p.observe_acceptance(LABEL, [(15, 0)] * 32)
    after = p.rates(LABEL)
    assert after == pytest.approx([r * (1 - p.alpha) for r in before])   # one step's worth
    assert after[0] > 0.75 * before[0]            # per block: before * 0.95**32 = 0.19 before
    fresh = SpeculationPolicy("adaptive")
    fresh.observe_acceptance(LABEL, [(1, 1), (3, 3), (3, 1), (0, 0)])
    assert fresh.rates(LABEL) == pytest.approx([1.0, 0.5, 0.5])


def test_no_adaptive_speculation_while_prompts_wait_for_prefill():
    """A waiting prompt is prefilled after this step: adaptive sessions take the short step
    (no drafts) so it joins sooner; fixed sessions keep their blocks; with nothing waiting the
    same policy speculates again."""
    p = trained(lambda pos: 0.95, lambda k: 0.010 + 0.0002 * k)
    jobs = [job(), job(), job("fixed", 8)]
    c = p.choose_shapes(jobs, waiting=3)
    assert c.ks == [0, 0, 7]
    d = c.decision
    assert (d.k, d.waiting, d.batch) == (0, 3, 3)
    p.observe_step(3, 7, 0.011, 0.0)
    c = p.choose_shapes(jobs)
    ks = c.ks
    assert ks[0] == ks[1] > 0 and ks[2] == 7 and c.decision.waiting == 0


def test_per_step_overhead_makes_speculation_pay():
    """Verify+draft alone favour no speculation (1 token / 10 ms > 1.1 / 12 ms for k = 1), but
    every cycle also pays 20 ms outside them, once per step whatever k is: then speculating wins
    (1.1 / 32 ms > 1 / 30 ms)."""
    p = trained(lambda pos: 0.1 if pos == 0 else 0.2, lambda k: 0.010 + 0.002 * k)
    assert 0.07 < p.rates(LABEL)[0] < 0.2
    assert p.choose([job()]) == [0]
    for _ in range(50):
        p.observe_overhead(0.020)
    assert abs(p.overhead_seconds - 0.020) < 1e-9
    c = p.choose_shapes([job()])
    assert c.ks[0] > 0
    assert c.decision.cost_seconds > 0.020


def test_a_slow_reader_is_not_cycle_overhead(target_model):
    """The scheduler never waits for readers: one that takes 30 ms per event adds nothing to
    the policy's per-cycle overhead (the steps ran ahead, their events buffered)."""
    import threading
    import time

    engine = VerifierEngine(target_model)

    def run(rid):
        for _ in engine.generate(Request(request_id=rid, prompt=[3, 4, 5], max_tokens=12,
                                         ignore_eos=True)):
            time.sleep(0.03)   # the behaviour: a reader that takes 30 ms per event

    t = threading.Thread(target=run, args=("a",))
    t.start()
    t.join(60)
    engine.close()
    assert engine.policy.overhead_seconds < 0.01, engine.policy.overhead_seconds



def _true_cost(b, k):   # per step: fixed + per session (KV gather/scatter) + per verified token
    return 0.05 + 0.03 * b + 0.01 * b * (k + 1)


def test_unmeasured_large_batch_priced_per_session_and_per_token():
    """Its first step at batch 32 measures no speculation; then, with every k > 0 measured only
    at batches 1-4, the policy prices batch 32 from both slopes and picks the k the true cost
    would; a line in tokens alone (1 session x 16 tokens costs what 16 sessions
    x 1 token cost) makes 32-session speculation look far too cheap."""
    p = trained(lambda pos: 0.5, lambda k: _true_cost(1, k))
    for b, k in ((2, 0), (2, 3), (2, 7), (4, 0), (4, 3)):
        p.observe_step(b, k, _true_cost(b, k), 0.0)
    assert p._cost_model() == pytest.approx((0.05, 0.03, 0.01), abs=1e-6)
    jobs = [job() for _ in range(20)]
    assert bucket(20) == 32
    c = p.choose_shapes(jobs)
    assert c.ks[0] == 0 and c.decision.explored   # the bucket's baseline first
    p.observe_step(20, 0, _true_cost(32, 0), 0.0)
    c = p.choose_shapes(jobs)
    k = c.ks[0]
    e = p.expected_table(LABEL, 15)
    best = max((c for c in CANDIDATES if c <= 15), key=lambda c: 20 * e[c] / _true_cost(32, c))
    assert k == best and best <= 2
    assert c.decision.cost_seconds == pytest.approx(_true_cost(32, k))



def test_unmeasured_cell_never_cheaper_than_a_measured_smaller_one():
    """A step with more sessions and no fewer drafts never costs less than a measured one: one
    expensive cell (confirmed by two steps) among many cheap ones hardly moves the
    least-squares fit, but it bounds every bigger cell's estimate from below."""
    flat = lambda b, k: 0.070 + 0.002 * b * (k + 1)                  # noqa: E731
    p = trained(lambda pos: 0.95, lambda k: flat(1, k))
    for b in (2, 4):
        for k in CANDIDATES:
            if k <= 15:
                for _ in range(2):
                    p.observe_step(b, k, 1.5 if (b, k) == (4, 7) else flat(b, k), 0.0)
    model = p._cost_model()
    a, per_session, per_token = model
    assert a + per_session * 8 + per_token * 8 * 8 < 1.0             # the fit alone: cheap
    assert p._estimate(8, 7, model) >= 1.5 and p._estimate(8, 15, model) >= 1.5
    assert p._estimate(8, 5, model) < 1.0                            # k=7 does not bound k=5
    p.observe_step(6, 0, flat(8, 0), 0.0)                            # bucket 8: only k=0
    c = p.choose_shapes([job() for _ in range(6)])
    k = c.ks[0]
    assert k < 7 or c.decision.cost_seconds >= 1.5


def test_a_slow_first_measurement_does_not_price_a_block_out():
    """A cell starts from the faster of its first two steps (timing noise only adds time), then
    is a running mean turning into an EMA: one stalled first step of k = 3 leaves no trace,
    while a lasting change of cost is followed (a plain EMA from the first value still priced
    k = 3 twice its cost after 20 steps)."""
    p = SpeculationPolicy("adaptive", explore_every=0)
    p.observe_step(1, 3, 0.300, 0.0)                  # the stalled first step
    assert p.cost_table()[(1, 3)] == pytest.approx(0.300) and p._cost[(1, 3)].provisional
    p.observe_step(1, 3, 0.075, 0.0)
    assert p.cost_table()[(1, 3)] == pytest.approx(0.075) and not p._cost[(1, 3)].provisional
    p.observe_step(1, 3, 0.105, 0.0)                  # later steps: a running mean ...
    assert p.cost_table()[(1, 3)] == pytest.approx(0.090)
    for _ in range(200):                              # ... then an EMA that follows the cost
        p.observe_step(1, 3, 0.150, 0.0)
    assert p.cost_table()[(1, 3)] == pytest.approx(0.150, abs=1e-4)


def test_one_stalled_step_neither_prices_its_block_out_nor_bounds_longer_ones():
    """Session 20's c=4 log: the only steps measured at k = 3 and 4 were stalls (~2.5x), and as
    the floor of every longer block they steered the batch to k = 11 (35 tokens/s where k = 1
    ran 50). A cell measured once is priced no dearer than the cost model predicts and bounds no
    other cell; its second step confirms what it costs."""
    cost = lambda b, k: 0.060 + 0.015 * b + 0.004 * b * (k + 1)       # noqa: E731
    p = trained(lambda pos: 0.8, lambda k: cost(1, k))
    for k in (0, 1, 2, 11):
        for _ in range(2):
            p.observe_step(4, k, cost(4, k), 0.0)
    p.observe_step(4, 3, 2.5 * cost(4, 3), 0.0)                     # one stall
    model = p._cost_model()
    ovh = p.overhead_seconds
    assert p._estimate(4, 3, model) - ovh < 1.2 * cost(4, 3)
    assert p._estimate(4, 5, model) - ovh < 1.2 * cost(4, 5)         # not floored by the stall
    k = p.choose([job() for _ in range(4)])[0]
    e = p.expected_table(LABEL, 15)
    best = max((c for c in CANDIDATES if c <= 15), key=lambda c: e[c] / cost(4, c))
    assert 3 <= best <= 9 and k == best
    p.observe_step(4, 3, 2.5 * cost(4, 3), 0.0)                     # a second slow step: real
    assert p._estimate(4, 3, p._cost_model()) - ovh == pytest.approx(2.5 * cost(4, 3))
    assert p._estimate(4, 5, p._cost_model()) - ovh >= 2.5 * cost(4, 3)


def test_exploration_from_no_speculation_always_tries_a_longer_block():
    """At the bottom of the candidates (k = 0 best) every exploration step tries k = 1; the
    alternation with the shorter neighbour wasted every other one on a plain k = 0 step."""
    p = SpeculationPolicy("adaptive", explore_every=5, explore_backoff=1)
    p.observe_acceptance(LABEL, [(15, 0)] * 4)             # drafts always rejected
    for k in CANDIDATES:
        p.observe_step(1, k, 0.060 + 0.010 * k, 0.0)
    choices = [p.choose_shapes([job()]) for _ in range(21)]
    picks = [c.ks[0] for c in choices]
    explored = [i for i, c in enumerate(choices) if c.decision.explored]
    assert explored == [5, 10, 15, 20]                     # every 5 steps after the first
    assert set(picks) == {0, 1} and all(picks[i] == 1 for i in explored)
    assert picks.count(1) == 4


def test_exploration_backs_off_while_the_best_arm_stays():
    """Drafts always rejected: k = 0 stays the best arm, and each exploration that leaves it in
    place doubles the gap to the next, up to ``explore_backoff`` times ``explore_every``."""
    p = SpeculationPolicy("adaptive", explore_every=5, explore_backoff=4)
    p.observe_acceptance(LABEL, [(15, 0)] * 4)
    for k in CANDIDATES:
        p.observe_step(1, k, 0.060 + 0.010 * k, 0.0)
    choices = [p.choose_shapes([job()]) for _ in range(120)]
    explored = [i for i, c in enumerate(choices) if c.decision.explored]
    assert explored[0] == 5                               # explore_every after it first led
    assert [b - a for a, b in zip(explored, explored[1:])] == [10, 20, 20, 20, 20, 20]
    assert all(c.ks == [0] for i, c in enumerate(choices) if i not in explored)
    with pytest.raises(ValueError, match="explore_backoff"):
        SpeculationPolicy("adaptive", explore_backoff=0)
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationPolicy("adaptive", explore_every=-1)


def test_exploration_returns_to_its_first_gap_when_the_best_arm_changes():
    """Once backed off, a new best arm (acceptance rose) is explored around within
    ``explore_every`` steps, and the gaps grow from there again."""
    p = SpeculationPolicy("adaptive", explore_every=5, explore_backoff=8)
    p.observe_acceptance(LABEL, [(15, 0)] * 4)
    for k in CANDIDATES:
        p.observe_step(1, k, 0.060 + 0.001 * k, 0.0)
    before = [p.choose_shapes([job()]).decision.explored for _ in range(60)]
    assert sum(before) == 3                               # steps 6, 16, 36 (then 76)
    for _ in range(200):                                  # the drafts now always land
        p.observe_acceptance(LABEL, [(15, 15)])
    after = [p.choose_shapes([job()]) for _ in range(30)]
    assert after[0].ks[0] > 0                             # a new best arm: a long block
    explored = [i for i, c in enumerate(after) if c.decision.explored]
    assert explored == [5, 15]                            # the first gap again, then doubling


def test_mode_suffix_steps_are_not_joining_steps(target_model, hf_target):
    """Mode suffix sends its drafter nothing, so the drafter never holds the session's context;
    that is no join (no prompt upload rides on the step): its steps without candidates price
    the step without speculation like any other, instead of never being recorded."""
    p = PROMPTS[1] * 3                                    # repeats: candidates on most steps
    n = 24
    oracle = ReferenceDrafter(target_model, {"s": p + reference(hf_target, p, n, ignore_eos=True)},
                              block_size=4)
    engine = VerifierEngine(target_model, spec_mode="suffix")
    steps = []                                            # [rows verified, recorded] per step
    real_decode, real_observe = engine.decode_step, engine.policy.observe_step

    def decode(plan):
        steps.append([0, False])
        events = real_decode(plan)
        steps[-1][0] = 1 + sum(ev.tree_nodes for ev in events)
        return events

    def observe(*a):
        steps[-1][1] = True
        real_observe(*a)

    engine.decode_step, engine.policy.observe_step = decode, observe
    try:
        out = [t for ev in engine.generate(Request(request_id="s", session_id="s", prompt=p,
                                                   max_tokens=n, ignore_eos=True, proposer=oracle))
               for t in ev.tokens]
    finally:
        engine.close()
    assert out == reference(hf_target, p, n, ignore_eos=True)
    plain = [rec for rows, rec in steps if rows == 1]
    assert plain and all(plain), steps                    # every step without candidates counts
    assert not any(rec for rows, rec in steps if rows > 1), steps   # suffix trees: verify cells


def test_no_exploration_at_all_with_explore_every_zero():
    from verifier_svc.exploration import Exploration
    from verifier_svc.shapes import Arm

    never = Exploration(0)
    assert not any(never.now(step, Arm(k), 1) for step in range(1, 500) for k in (0, step % 5))
    assert never.count == 0
