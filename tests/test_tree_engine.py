"""Tree verification (DDTree) through the real services: lossless, accepted through siblings,
mixed with chains in one batch, seeded, visible in the statistics."""

from __future__ import annotations

import threading

import pytest

from dflash.v1 import common_pb2, verifier_pb2
from drafter_svc.engine import DrafterEngine

from doubles import ReferenceDrafter
from helpers import MAX_NEW, PROMPTS, assert_same_tokens, generate_ids, reference


def spec(addr, mode="tree", budget=0, block_size=0):
    return verifier_pb2.SpeculationParams(enabled=True, drafter_address=addr, block_size=block_size,
                                          mode=mode, tree_budget=budget)


@pytest.mark.parametrize("budget", [1, 3, 8, 40])
def test_tree_greedy_identical_to_generate(stack, make_drafter, tiny_target, hf_target, budget):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    for prompt in PROMPTS:
        want = reference(hf_target, prompt)
        got, last = generate_ids(v, prompt, max_tokens=MAX_NEW, speculation=spec(addr, budget=budget))
        assert_same_tokens(hf_target, prompt, got, want)
        st = last.stats
        assert st.tree_drafts > 0 and st.tree_drafts == st.drafts
        assert st.tree_drafts <= st.tree_nodes <= budget * st.tree_drafts
        assert st.draft_tokens <= 7 * st.drafts          # depths, at most block - 1


def test_oracle_at_rank_two_is_accepted_through_the_tree(stack, target_model, hf_target):
    """The reference token at rank 1 (the second choice) at every third position: a chain of
    the drafter's top-1 tokens stops there, the tree walks through the sibling."""
    block, n = 8, 33
    refs = {f"r{i}{kind}": p + reference(hf_target, p, n) for i, p in enumerate(PROMPTS)
            for kind in ("c", "t")}
    ranks = {pos: 1 for pos in range(0, 200) if pos % 3 == 0}
    oracle = ReferenceDrafter(target_model, refs, block_size=block, ranks=ranks, name="ranked")
    addr = stack.add_drafter(oracle, label="ranked@1")
    v = stack.verifier_stub()
    for i, p in enumerate(PROMPTS):
        want = refs[f"r{i}c"][len(p):]
        chain, c_last = generate_ids(v, p, max_tokens=n, session_id=f"r{i}c", ignore_eos=True,
                                     speculation=spec(addr, mode="fixed"))
        tree, t_last = generate_ids(v, p, max_tokens=n, session_id=f"r{i}t", ignore_eos=True,
                                    speculation=spec(addr, budget=32))
        assert chain == want and tree == want
        assert c_last.stats.fallback_steps == 0 and t_last.stats.fallback_steps == 0
        # a chain accepts at most the 2 positions before a planted rank-1 token
        assert c_last.stats.mean_acceptance_length <= 3.0
        assert t_last.stats.mean_acceptance_length > c_last.stats.mean_acceptance_length + 1.0


def test_adversarial_tree_tau_one_output_identical(stack, target_model, hf_target):
    refs = {f"a{i}": p + reference(hf_target, p) for i, p in enumerate(PROMPTS)}
    bad = ReferenceDrafter(target_model, refs, block_size=8, adversarial=True, name="adversarial")
    addr = stack.add_drafter(bad, label="adversarial@1")
    v = stack.verifier_stub()
    for i, p in enumerate(PROMPTS):
        got, last = generate_ids(v, p, max_tokens=MAX_NEW, session_id=f"a{i}",
                                 speculation=spec(addr, budget=16))
        assert_same_tokens(hf_target, p, got, refs[f"a{i}"][len(p):])
        assert last.stats.tree_drafts > 0
        assert last.stats.accepted_tokens == 0 and last.stats.mean_acceptance_length == 1.0


def test_trees_and_chains_in_one_batch_keep_their_outputs(stack, make_drafter, tiny_target, hf_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    modes = [("tree", 16), ("fixed", 0), ("tree", 4), ("off", 0), ("tree", 40), ("fixed", 0)]
    jobs = [(PROMPTS[i % len(PROMPTS)], m, b) for i, (m, b) in enumerate(modes)]
    batch_sizes = []
    stack.engine.step_listeners.append(lambda req, ev: batch_sizes.append(ev.batch_size))
    out: dict[int, list[int]] = {}
    gate = threading.Barrier(len(jobs))

    def run(i, prompt, mode, budget):
        gate.wait()
        out[i], _ = generate_ids(v, prompt, max_tokens=MAX_NEW, speculation=spec(addr, mode, budget))

    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert max(batch_sizes) > 1                 # they did share steps
    for i, (prompt, _, _) in enumerate(jobs):
        assert_same_tokens(hf_target, prompt, out[i], reference(hf_target, prompt))


def test_seeded_sampled_trees_reproduce(stack, make_drafter, tiny_target):
    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    runs = [generate_ids(v, PROMPTS[1], max_tokens=MAX_NEW, sampling=sampling,
                         speculation=spec(addr, budget=12))[0] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == MAX_NEW


def test_bad_tree_budget_is_refused_naming_the_field(stack, make_drafter, tiny_target):
    import grpc

    engine = DrafterEngine.from_pretrained(make_drafter(block_size=8), tiny_target)
    addr = stack.add_drafter(engine)
    v = stack.verifier_stub()
    with pytest.raises(grpc.RpcError) as e:
        generate_ids(v, PROMPTS[0], max_tokens=4, speculation=spec(addr, budget=65))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree_budget" in e.value.details()
    got, _ = generate_ids(v, PROMPTS[0], max_tokens=4)       # the service is still up
    assert len(got) == 4


def test_adaptive_request_capped_at_one_node_verifies_chains_only(stack, target_model, hf_target):
    """`tree_budget` caps the adaptive policy's trees per request; 1 (a one-node tree is a chain
    of one draft) leaves it chains only, which is how `dflash bench --spec-modes adaptive:1,adaptive`
    compares chain-only and tree-using adaptive speculation in one run. Without the cap the same
    request tries trees (each budget is explored early)."""
    block, n = 8, 40
    refs = {f"a{kind}": PROMPTS[0] + reference(hf_target, PROMPTS[0], n) for kind in ("c", "t")}
    oracle = ReferenceDrafter(target_model, refs, block_size=block, ranks={3: 1, 9: 1}, name="capped")
    addr = stack.add_drafter(oracle, label="capped@1")
    v = stack.verifier_stub()
    want = refs["ac"][len(PROMPTS[0]):]
    chains, c_last = generate_ids(v, PROMPTS[0], max_tokens=n, session_id="ac", ignore_eos=True,
                                  speculation=spec(addr, mode="adaptive", budget=1))
    trees, t_last = generate_ids(v, PROMPTS[0], max_tokens=n, session_id="at", ignore_eos=True,
                                 speculation=spec(addr, mode="adaptive"))
    assert chains == want and trees == want
    # the drafter's blocks are chains; a tree, if any, is one suffix candidate (the cap holds
    # for suffix trees too, and the choice takes one when its measured cost says it pays)
    st = c_last.stats
    assert st.drafts > 0 and st.tree_nodes == st.tree_drafts == st.suffix_nodes, st
    assert t_last.stats.tree_nodes > t_last.stats.suffix_nodes     # the drafter's trees too
