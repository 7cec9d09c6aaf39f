"""The served-chain replay (``dflash.learn.walk``) against the serving drafter itself: driven
step by step as the verifier drives it (the taps of the committed positions, then the bonus
token), the drafter engine takes the same steps, at the same anchors, as the replay."""

from __future__ import annotations

import pytest
import torch

from dflash.core.checkpoint import load_drafter, load_target_head
from dflash.core.draft_vocab import load_draft_vocab, save_draft_vocab
from dflash.core.proposer import ProposalRequest
from dflash.core.sampling import Sampling
from dflash.learn.gate import score
from dflash.learn.learner import LearnConfig, Learner
from dflash.learn.walk import answer_runs, chain_walk, walk_tau
from drafter_svc.engine import DrafterEngine

from learn_helpers import LETTERS, fill_store

FAST = LearnConfig(lr=3e-3, warmup_steps=5, max_steps=400, ckpt_every=10**6, eval_every=10**6,
                   anchors_per_seq=8)


@pytest.fixture(scope="module")
def trained(tiny_target, make_drafter, tmp_path_factory):
    """(a drafter directory trained on the letter cycles, the conversations of its store):
    a drafter that accepts long and short prefixes, so the walk has something to get wrong."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("walk")
    d0 = make_drafter(block_size=4)
    cfg = load_drafter(d0).cfg
    fill_store(root / "learn" / "store", tiny_target, cfg.target_layer_ids, 40,
               fingerprint=cfg.target_fingerprint)
    lr = Learner(root / "learn", d0, tiny_target, cfg=FAST)
    lr.run(60)
    out = lr.save_candidate(root / "drafter", version="2")
    convs = lr.store.read("train")[:8]
    torch.set_num_threads(n)
    return out, convs


def served_steps(engine: DrafterEngine, conv: dict, sid: str) -> tuple[int, int, list[int]]:
    """(steps, tokens, anchors) of greedy chain speculation over ``conv``'s answer, the drafter
    engine called as the verifier calls it; the target's tokens are the stored ones."""
    ids, taps = conv["input_ids"], conv["taps"].float()
    (first, last), = answer_runs(conv["loss_mask"])
    B = engine.cfg.block_size
    a, start, steps, tokens, anchors = first, 0, 0, 0, []
    while a < last:
        req = ProposalRequest(session_id=sid, context_start=start, context=taps[start:a],
                              anchor_token=int(ids[a]), block_size=B, sampling=Sampling())
        drafts = engine.propose([req])[0].tokens.tolist()
        acc = 0
        while acc < len(drafts) and a + 1 + acc <= last and drafts[acc] == int(ids[a + 1 + acc]):
            acc += 1
        gen = min(acc + 1, last - a)
        anchors.append(a)
        steps, tokens, start, a = steps + 1, tokens + gen, a, a + gen
    engine.release([sid])
    return steps, tokens, anchors


@pytest.mark.parametrize("subset", [False, True], ids=["full-vocab", "draft-vocab"])
def test_walk_takes_the_serving_drafters_steps(trained, tiny_target, tmp_path, subset):
    src, convs = trained
    d = tmp_path / "drafter"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    if subset:        # a draft vocabulary without "c": a draft can never be that letter
        ids = torch.tensor([i for i in range(load_drafter(d).cfg.vocab_size) if i != LETTERS[2]])
        save_draft_vocab(d, ids)
    engine = DrafterEngine.from_pretrained(d, tiny_target)
    drafter = load_drafter(d, dtype=torch.float32)
    vocab = load_draft_vocab(d, drafter.cfg.vocab_size)
    assert (vocab is not None) == subset
    try:
        want = [served_steps(engine, c, f"s{i}") for i, c in enumerate(convs)]
    finally:
        engine.close()
    got = chain_walk(drafter, load_target_head(tiny_target), convs, vocab=vocab, batch=3)
    assert [(w.steps, w.tokens, list(w.anchors)) for w in got] == want
    assert [w.seq for w in got] == [int(c["seq"]) for c in convs]
    accepted = [w.accepted for w in got]
    assert sum(accepted) > 0                               # the drafter does accept drafts ...
    assert any(w.accepted < w.steps * 3 for w in got)      # ... and also misses
    if subset:
        assert walk_tau(got) < walk_tau(chain_walk(drafter, load_target_head(tiny_target), convs))


def test_walk_stays_inside_the_known_answer(trained, tiny_target):
    """Holes in the answer (ids the capture did not see) are never anchors nor matched; each
    run of known ids is walked to its end, one bonus token per step at least."""
    src, convs = trained
    c = dict(convs[0])
    mask = c["loss_mask"].clone()
    runs = answer_runs(mask)
    first, last = runs[0]
    hole = range(first + 6, first + 9)
    mask[list(hole)] = 0
    c["loss_mask"] = mask
    (w,) = chain_walk(load_drafter(src, dtype=torch.float32), load_target_head(tiny_target), [c])
    new_runs = answer_runs(mask)
    assert new_runs == [(first, first + 5), (first + 9, last)]
    assert w.tokens == sum(b - a for a, b in new_runs)
    assert not set(w.anchors) & set(hole)
    assert all(any(a <= x < b for a, b in new_runs) for x in w.anchors)
    assert answer_runs(torch.tensor([0, 1, 0, 1, 1, 0, 1, 1, 1])) == [(3, 4), (6, 8)]


def test_served_score_and_an_unknown_metric(trained, tiny_target):
    src, convs = trained
    drafter, head = load_drafter(src, dtype=torch.float32), load_target_head(tiny_target)
    walks = chain_walk(drafter, head, convs)
    sc = score(drafter, head, convs)                        # "served" is the default
    assert [(s.seq, s.accepted, s.blocks) for s in sc] == [(w.seq, w.accepted, w.steps) for w in walks]
    with pytest.raises(ValueError, match="metric"):
        score(drafter, head, convs, metric="uniform")
    with pytest.raises(ValueError, match="gate_metric"):
        LearnConfig(gate_metric="uniform")


def test_a_captured_conversation_replays_what_was_served(stack, make_drafter, tiny_target, hf_target,
                                                        tmp_path):
    """Through the verifier: a candidate that memorised two answers serves them again with
    capture on; the capture's record of each conversation (steps, tokens) is what the walk of
    that drafter over the stored conversation takes, and every stream equals the target's."""
    from dflash.learn.capture import Capture
    from dflash.learn.store import CaptureStore

    from helpers import MAX_NEW, PROMPTS, assert_same_tokens, generate_ids, reference, spec, wait_until

    def serve(drafter_dir, learn_dir, tag):
        engine = DrafterEngine.from_pretrained(drafter_dir, tiny_target)
        store = CaptureStore(learn_dir / "store", max_bytes=1 << 30,
                             fingerprint=engine.card.target_fingerprint)
        engine.capture = Capture(store, min_answer_tokens=1, served_by=engine.card.label)
        addr = stack.add_drafter(engine)
        for i, prompt in enumerate(PROMPTS):
            got, _ = generate_ids(stack.verifier_stub(), prompt, max_tokens=MAX_NEW,
                                  session_id=f"{tag}{i}", speculation=spec(addr))
            assert_same_tokens(hf_target, prompt, got, reference(hf_target, prompt))
        wait_until(lambda: engine.capture.written >= len(PROMPTS), 30, "the captured conversations")
        return store.read("train") + store.read("heldout"), engine.card.label

    d0 = make_drafter(block_size=4)
    serve(d0, tmp_path / "a", "a")
    lr = Learner(tmp_path / "a", d0, tiny_target, cfg=FAST)
    lr.run(150)                                  # memorises the two training conversations
    v2 = lr.save_candidate(tmp_path / "v2", version="2")
    convs, label = serve(v2, tmp_path / "b", "b")
    assert label == "tiny-drafter@2" and len(convs) == len(PROMPTS)
    drafter = load_drafter(v2, dtype=torch.float32)
    walks = chain_walk(drafter, load_target_head(tiny_target), convs,
                       vocab=load_draft_vocab(v2, drafter.cfg.vocab_size))
    assert [(c["served"].by, c["served"].steps, c["served"].tokens) for c in convs] == \
        [(label, w.steps, w.tokens) for w in walks]
    assert sum(w.accepted for w in walks) >= 10              # it did accept drafts
