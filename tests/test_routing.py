"""The router's scores (gateway.routing): load, KV use, prefix affinity from the gateway's own
routing history keyed by the prefix cache's block hashes, and session stickiness."""

from __future__ import annotations

import pytest

from gateway.routing import WEIGHTS, Candidate, PrefixHistory, choose, round_robin, score


def test_the_least_loaded_replica_wins_without_a_prefix():
    cands = [Candidate("a", waiting=4, running=8), Candidate("b", waiting=0, running=2),
             Candidate("c", waiting=1, running=8)]
    c = choose(cands, {}, 0)
    assert c.address == "b" and c.why == "score"
    assert c.parts["queue"] == pytest.approx(1 - 2 / 12)


def test_the_gateways_own_open_streams_count_before_a_report_catches_up():
    # both report an idle batch; b already has 3 of this gateway's streams
    c = choose([Candidate("b", open_streams=3), Candidate("a")], {}, 0)
    assert c.address == "a"


def test_kv_use_breaks_an_equal_queue():
    cands = [Candidate("a", running=2, kv_cache_usage=0.9), Candidate("b", running=2, kv_cache_usage=0.2)]
    (sa, pa), (sb, pb) = score(cands, {}, 0)
    assert pa["kv"] == pytest.approx(0.1) and pb["kv"] == pytest.approx(0.8)
    assert choose(cands, {}, 0).address == "b"


def test_prefix_affinity_outweighs_a_moderate_load_difference():
    # a holds the whole prefix (8 of 8 blocks) and runs 2 more requests than b
    cands = [Candidate("a", running=4), Candidate("b", running=2)]
    c = choose(cands, {"a": 8}, 8)
    assert c.address == "a"
    assert c.score == pytest.approx(WEIGHTS["queue"] * 0 + WEIGHTS["kv"] + WEIGHTS["prefix"])
    # but not an overloaded one: b idle, a with a long queue and a full cache of K/V
    cands = [Candidate("a", waiting=30, running=8, kv_cache_usage=1.0), Candidate("b")]
    assert choose(cands, {"a": 2}, 8).address == "b"


def test_a_session_sticks_while_its_replica_is_a_candidate():
    cands = [Candidate("a", waiting=9), Candidate("b")]
    c = choose(cands, {}, 0, sticky="a")
    assert c.address == "a" and c.why == "session"
    # its replica is gone (unhealthy or draining: not a candidate): scored as any request
    assert choose([Candidate("b"), Candidate("c", waiting=1)], {}, 0, sticky="a").address == "b"


def test_ties_rotate():
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert {choose(cands, {}, 0, turn=t).address for t in range(3)} == {"a", "b", "c"}


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError, match="cands"):
        choose([], {}, 0)
    with pytest.raises(ValueError, match="cands"):
        round_robin([], 0)


def test_round_robin_ignores_load_and_takes_turns():
    cands = [Candidate("a", waiting=40, kv_cache_usage=1.0), Candidate("b"), Candidate("c")]
    picks = [round_robin(cands, t) for t in range(6)]
    assert [c.address for c in picks] == ["a", "b", "c", "a", "b", "c"]
    assert {c.why for c in picks} == {"round-robin"}


def test_history_uses_the_prefix_caches_own_block_hashes():
    from verifier_svc.prefix_cache import BLOCK, block_hashes

    h = PrefixHistory()
    prompt = list(range(100))
    assert h.block == BLOCK
    assert h.hashes("t", prompt) == block_hashes("t", prompt)
    assert len(h.hashes("t", prompt)) == 100 // BLOCK


def test_history_counts_leading_blocks_per_replica():
    h = PrefixHistory()
    turn1 = list(range(40))                       # 2 full blocks
    turn2 = turn1 + list(range(100, 140))         # 5 full blocks, the first 2 turn1's
    h.record(h.hashes("t", turn1), "a")
    assert h.matched(h.hashes("t", turn2)) == {"a": 2}
    h.record(h.hashes("t", turn2), "b")
    assert h.matched(h.hashes("t", turn2)) == {"a": 2, "b": 5}
    # another tenant's identical prompt matches nothing: the hashes are salted by tenant
    assert h.matched(h.hashes("u", turn2)) == {}
    # a prompt that differs in its first block matches nothing, whatever follows
    assert h.matched(h.hashes("t", [7] + turn2[1:])) == {}
    h.forget("b")
    assert h.matched(h.hashes("t", turn2)) == {"a": 2}


def test_history_is_bounded():
    h = PrefixHistory(max_blocks=4)
    h.record(h.hashes("t", list(range(16 * 6))), "a")
    assert len(h) == 4
    # the oldest (the leading blocks) went first: nothing leads any more
    assert h.matched(h.hashes("t", list(range(16 * 6)))) == {}
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixHistory(max_blocks=0)
