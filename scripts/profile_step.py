"""Step profile on the real target: where a speculative step's time goes (batch 1, CPU).

    python scripts/profile_step.py [--drafter models/smollm2-dflash-b16] [--reps 10]

Prints, in ms: one-token target decode; target verify of 4/8/16 tokens; drafter call (context
update + block forward + LM head; full vocabulary and, when the drafter has one, its draft
vocabulary) in process; and the break-even tau for each block size. Wire and service overhead
are not in these figures: the running stack reports them (``dflash_spec_decode_wire_seconds``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def main():
    from dflash.core.proposer import ProposalRequest
    from dflash.core.sampling import Sampling
    from dflash.train.target_setup import setup_target
    from dflash_app.stack import DEFAULT_DRAFTER
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.target import TargetModel

    p = argparse.ArgumentParser()
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--context", type=int, default=300)
    a = p.parse_args()
    target_dir = setup_target()
    t = TargetModel(target_dir)
    d = DrafterEngine.from_pretrained(a.drafter, target_dir, draft_vocab_size=0)
    dv = DrafterEngine.from_pretrained(a.drafter, target_dir)     # its draft vocabulary, if any
    ids = tuple(d.card.target_layer_ids)
    prompt = torch.randint(100, 20000, (a.context,)).tolist()
    cache = t.new_cache()
    _, taps = t.forward(prompt, cache, ids)
    n = cache.get_seq_length()

    def verify(k):
        def f():
            t.forward(prompt[:k], cache, ids)
            t.crop(cache, n)
        return f

    rows = {"decode 1 token": timed(verify(1), a.reps)}
    for k in (4, 8, 16):
        rows[f"verify {k} tokens"] = timed(verify(k), a.reps)
    engines = [("full vocab", d)]
    if dv.draft_vocab is not None:
        engines.append((f"draft vocab {dv.draft_vocab.numel()}", dv))
    for label, eng in engines:
        req = ProposalRequest(session_id="p", context_start=0, context=taps, anchor_token=prompt[-1],
                              block_size=1, sampling=Sampling())
        eng.propose([req])
        for bs in (4, 8, 16):
            def draft(bs=bs, eng=eng):
                r = ProposalRequest(session_id="p", context_start=n - 2, context=taps[-2:],
                                    anchor_token=prompt[-1], block_size=bs, sampling=Sampling())
                assert not isinstance(eng.propose([r])[0], Exception)
            rows[f"drafter call, block {bs}" + ("" if eng is d else f" ({label})")] = timed(draft, a.reps)
    for k, v in rows.items():
        print(f"{k:28s} {v:8.1f} ms")
    dec = rows["decode 1 token"]
    for label, eng in engines:
        for bs in (4, 8, 16):
            step = rows[f"verify {bs} tokens"] + rows[f"drafter call, block {bs}" + ("" if eng is d else f" ({label})")]
            print(f"{label:18s} block {bs:2d}: step {step:6.1f} ms -> break-even tau {step / dec:.2f} "
                  f"(speedup = tau * {dec:.1f} / {step:.1f})")


if __name__ == "__main__":
    main()
