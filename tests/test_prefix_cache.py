"""The prefix cache's bookkeeping (``verifier_svc.prefix_cache``), without a model: longest
exact prefix per tenant, taps that must match, covered entries dropped, references that are
never evicted, LRU eviction under a byte bound that holds for many random prefixes, pins,
and the operator's shared prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from verifier_svc.prefix_cache import PrefixCache
from verifier_svc.tap_buffer import TapRows

KVB = 10                  # bytes per position in these tests


class Seq:
    """A stand-in for a spilled pool sequence."""

    def __init__(self, n: int):
        self.n = n

    def get_seq_length(self) -> int:
        return self.n


def put(cache, tenant, tokens, *, taps=None, tap_ids=(), pin=False):
    rows = None
    if taps is not None:
        rows = TapRows()
        rows.append(torch.zeros(taps, 2))
    return cache.put(tenant, tokens, Seq(len(tokens)), rows, tap_ids, pin=pin)


def look(cache, tenant, prompt, tap_ids=(), limit=None):
    e, n = cache.lookup(tenant, prompt, tap_ids, len(prompt) - 1 if limit is None else limit)
    if e is not None:
        cache.release(e)
    return e, n


def test_longest_exact_prefix_within_the_tenant_only():
    c = PrefixCache(1 << 20, KVB, block=4)
    a = put(c, "A", list(range(40)))
    b = put(c, "A", list(range(20)) + [99] * 20)
    assert a is not None and b is not None
    e, n = look(c, "A", list(range(33)) + [7, 7])
    assert e is a and n == 33                          # exact past the last full block
    e, n = look(c, "A", list(range(20)) + [99] * 5)
    assert e is b and n == 24
    assert look(c, "A", list(range(40)) + [1])[1] == 40
    assert look(c, "A", list(range(40)))[1] == 39      # the last prompt token always runs
    assert look(c, "B", list(range(40)) + [1]) == (None, 0)   # another tenant: nothing
    assert look(c, "A", [5] + list(range(40))) == (None, 0)
    assert c.stats.queries > 0 and c.stats.hits == 33 + 24 + 40 + 39


def test_a_request_with_taps_needs_the_same_taps():
    c = PrefixCache(1 << 20, KVB, block=4)
    put(c, "A", list(range(30)), taps=30, tap_ids=(1, 2))
    prompt = list(range(30)) + [5]
    assert look(c, "A", prompt, (1, 2))[1] == 30
    assert look(c, "A", prompt, (3,)) == (None, 0)      # other layers: its taps are useless
    assert look(c, "A", prompt)[1] == 30                # a request without a drafter reads K/V
    put(c, "A", list(range(100, 130)), taps=12, tap_ids=(1, 2))   # taps shorter than the K/V
    assert look(c, "A", list(range(100, 131)), (1, 2))[1] == 12


def test_a_longer_turn_covers_the_earlier_one_and_a_held_prefix_is_not_kept_twice():
    c = PrefixCache(1 << 20, KVB, block=4)
    first = put(c, "A", list(range(24)))
    longer = put(c, "A", list(range(40)))
    assert first is not None and longer is not None
    assert c.entries == 1 and c.stats.covered == 1 and c.nbytes == 40 * KVB
    assert put(c, "A", list(range(30))) is None        # held by the longer one already
    assert c.entries == 1
    put(c, "B", list(range(24)))                       # another tenant's is its own
    assert c.entries == 2


def test_eviction_is_lru_and_never_takes_a_referenced_entry():
    c = PrefixCache(100 * KVB, KVB, block=4)
    old = put(c, "A", [1] * 40)
    held, n = c.lookup("A", [1] * 41, (), 40)          # a hit being copied holds a reference
    assert held is old and n == 40
    mid = put(c, "A", [2] * 40)
    put(c, "A", [3] * 40)                               # 120 positions > 100: one must go
    assert c.stats.evicted == 1
    assert mid is not None and look(c, "A", [2] * 41) == (None, 0)   # the oldest free one
    assert look(c, "A", [1] * 41)[1] == 40
    c.release(held)
    put(c, "A", [4] * 40)               # [1] was read after [3] was kept: [3] goes first
    assert look(c, "A", [3] * 41) == (None, 0) and look(c, "A", [1] * 41)[1] == 40
    assert c.nbytes <= c.max_bytes and c.stats.evicted == 2


def test_entries_larger_than_the_bound_are_not_kept():
    c = PrefixCache(10 * KVB, KVB, block=4)
    assert put(c, "A", list(range(20))) is None and c.nbytes == 0
    assert put(c, "A", [1, 2]) is None                  # shorter than a block: never found


def test_a_bound_that_holds_under_many_random_prefixes():
    rng = random.Random(5)
    c = PrefixCache(20000 * KVB, KVB, block=8)
    system = [rng.randrange(1000) for _ in range(64)]
    for i in range(3000):
        head = system if i % 3 == 0 else []
        tokens = head + [rng.randrange(1000) for _ in range(rng.randrange(1, 300))]
        e, n = c.lookup(f"t{i % 7}", tokens + [0], (), len(tokens))
        if e is not None:
            assert tuple(tokens[:n]) == e.tokens[:n]    # a hit is always the exact prefix
            c.release(e)
        put(c, f"t{i % 7}", tokens)
        assert c.nbytes <= c.max_bytes
    assert c.stats.evicted > 100 and c.stats.hits > 0


def test_a_pin_is_never_evicted_and_checkout_takes_it_back():
    c = PrefixCache(50 * KVB, KVB, block=4)
    pinned = put(c, "A", list(range(40)), pin=True, taps=40, tap_ids=(1,))
    assert pinned is not None and pinned.pinned
    for k in range(5):
        put(c, "A", [k + 100] * 40)
    assert look(c, "A", list(range(41)), (1,))[0] is pinned      # its tenant may read it
    assert c.pinned_bytes == pinned.nbytes
    seq, taps = c.checkout(pinned)
    assert seq.get_seq_length() == 40 and len(taps) == 40
    assert look(c, "A", list(range(41))) == (None, 0) and c.pinned_bytes == 0
    again = put(c, "A", list(range(40)), pin=True)
    c.unpin(again)                                     # its session closed: evictable now
    put(c, "A", [200] * 40)
    put(c, "A", [201] * 40)
    assert look(c, "A", list(range(41))) == (None, 0)


def test_declared_shared_prefixes_are_read_by_every_tenant():
    system = list(range(500, 530))
    c = PrefixCache(1 << 20, KVB, block=4, shared=[system])
    assert c.wants_shared(system + [1, 2], ()) == [30]
    assert c.wants_shared(list(range(30)), ()) == []
    c.put_shared(system, Seq(30), None, ())
    assert c.wants_shared(system + [1, 2], ()) == []
    for tenant in ("A", "B", ""):
        e, n = look(c, tenant, system + [7, 8])
        assert e is not None and e.shared and n == 30
    assert look(c, "A", system[:10] + [1]) == (None, 0)   # only the whole declared prefix
    put(c, "A", system + [7, 8, 9, 10])                # a tenant's own longer prefix wins
    assert look(c, "A", system + [7, 8, 9, 10, 11])[1] == 34
    assert look(c, "B", system + [7, 8, 9, 10, 11])[1] == 30
    c.put_shared(list(range(9)), Seq(9), None, ())      # not declared: ignored
    assert c.entries == 2
    c.clear()
    assert c.entries == 0 and c.nbytes == 0


@pytest.mark.parametrize("field,kw", [("max_bytes", {"max_bytes": -1, "kv_bytes_per_token": 1}),
                                      ("kv_bytes_per_token", {"max_bytes": 1, "kv_bytes_per_token": 0}),
                                      ("block", {"max_bytes": 1, "kv_bytes_per_token": 1, "block": 0})])
def test_bad_bounds_name_their_field(field, kw):
    with pytest.raises(ValueError, match=field):
        PrefixCache(**kw)
