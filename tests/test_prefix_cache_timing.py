"""Tenant B sending tenant A's exact prompt cannot time A's cached prefix (issue 61): B's
request does exactly the work of a tenant the cache has never seen, so no clock could tell
them apart.

Counted instead of timed (wall time on a shared or loaded CPU is noise, and tests never time):
the target's forwards and the tokens in each, the prefix cache's index probes, and what the
drafter is sent (rows, from which position, whether from a kept prefix). A's own repeat is the
control: a hit changes every one of those counts, so the comparison can see a hit.
"""

from __future__ import annotations

import pytest

from dflash.core.speculation import SpecMode
from drafter_svc.engine import DrafterEngine
from verifier_svc.engine import Request, VerifierEngine
from verifier_svc.prefix_reuse import new_prefix_cache

PROMPT = [(11 * i + 5) % 230 + 4 for i in range(64)]
N = 12


class Probes(dict):
    """The cache's block-hash index, counting its lookups."""

    probes = 0

    def get(self, key, default=None):
        self.probes += 1
        return super().get(key, default)


class Counted:
    """The drafter, counting what each item carries: (context_start, rows, from a prefix)."""

    def __init__(self, engine):
        self.engine, self.card, self.items = engine, engine.card, []

    def propose(self, requests):
        self.items += [(r.context_start, int(r.context.shape[0]), bool(r.prefix_key))
                       for r in requests]
        return self.engine.propose(requests)

    def release(self, ids):
        self.engine.release(ids)

    def keep_prefix(self, sid, key, length):
        self.engine.keep_prefix(sid, key, length)


@pytest.fixture
def counted(target_model, make_drafter, tiny_target, monkeypatch):
    """An engine with the cache on and a drafter, and ``work(rid, tenant)``: one request's
    tokens, cached prompt tokens and the work it did."""
    forwards: list[tuple[str, tuple[int, ...]]] = []
    single, batch = target_model.forward, target_model.forward_batch

    def forward(tokens, *a, **kw):
        forwards.append(("forward", (len(tokens),)))
        return single(tokens, *a, **kw)

    def forward_batch(blocks, *a, **kw):
        forwards.append(("batch", tuple(len(b) for b in blocks)))
        return batch(blocks, *a, **kw)

    monkeypatch.setattr(target_model, "forward", forward)
    monkeypatch.setattr(target_model, "forward_batch", forward_batch)
    drafter = Counted(DrafterEngine.from_pretrained(make_drafter(block_size=4), tiny_target,
                                                    device="cpu", context_threads=0))
    engine = VerifierEngine(target_model, spec_mode=SpecMode.FIXED,
                            prefix_cache=new_prefix_cache(target_model.pool, 64.0))
    index = engine.prefix_cache._index = Probes()

    def work(rid, tenant):
        forwards.clear()
        drafter.items.clear()
        index.probes = 0
        evs = list(engine.generate(Request(request_id=rid, prompt=PROMPT, max_tokens=N,
                                           ignore_eos=True, proposer=drafter,
                                           spec_mode=SpecMode.FIXED, tenant=tenant)))
        done = (list(forwards), index.probes, list(drafter.items))
        return [t for ev in evs for t in ev.tokens], evs[0].cached_prompt_tokens, done

    yield work
    engine.close()
    drafter.engine.close()


def test_another_tenant_does_the_work_of_a_tenant_never_seen(counted):
    first, cached, _ = counted("a1", "A")
    assert cached == 0
    got_b, cached_b, work_b = counted("b", "B")           # A's exact prompt
    got_c, cached_c, work_c = counted("c", "C")           # a tenant the cache never saw
    assert cached_b == cached_c == 0
    assert got_b == got_c == first
    assert work_b == work_c                               # forwards, probes, uploads: the same
    prefill, probes, uploads = work_b
    assert prefill[0] == ("forward", (len(PROMPT),))     # the whole prompt, as for a stranger
    assert uploads[0][:2] == (0, len(PROMPT)) and not uploads[0][2]
    # the control: A's own repeat is a hit, and every count shows it
    got_a, cached_a, work_a = counted("a2", "A")
    assert got_a == first and cached_a == len(PROMPT) - 1
    a_prefill, a_probes, a_uploads = work_a
    assert a_prefill[0] == ("forward", (1,)) and a_probes > probes
    assert a_uploads[0][2] and a_uploads[0][0] > 0          # from A's kept drafter context
