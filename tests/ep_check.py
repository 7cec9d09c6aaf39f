"""Run by tests/test_ep.py in its own process (a process group must not live in pytest's):
DistributedTarget with 2 ranks vs TargetModel on one rank; prints one JSON line of differences.

Usage: python tests/ep_check.py MOE_TARGET_DIR
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from kernels.skinny_linear import SkinnyLinear
from verifier_svc.ep import DistributedTarget
from verifier_svc.target import TargetModel


def main(path: str) -> None:
    torch.set_num_threads(1)
    one = TargetModel(path)
    ep = DistributedTarget(path, ep_size=2, threads=1, skinny_max_rows=8)
    assert ep.fingerprint == one.fingerprint and ep.vocab_size == one.vocab_size
    logit_diff, tap_diff, same = 0.0, 0.0, True

    def check(a, b):
        nonlocal logit_diff, same
        logit_diff = max(logit_diff, float((a - b).abs().max()))
        same = same and torch.equal(a.argmax(-1), b.argmax(-1))

    c1, c2 = one.new_cache(), ep.new_cache()
    with ep.lock:
        a, ta = one.forward(list(range(20, 60)), c1, (0, 2))
        b, tb = ep.forward(list(range(20, 60)), c2, (0, 2))
        check(a, b)
        tap_diff = float((ta - tb).abs().max())
        for _ in range(4):  # verify a block, keep part of it (crop), as the engine does
            block = [int(a[-1].argmax()), 5, 6, 7]
            a, _ = one.forward(block, c1, None)
            b, _ = ep.forward(block, c2, None)
            check(a, b)
            one.crop(c1, c1.get_seq_length() - 2)
            ep.crop(c2, c2.get_seq_length() - 2)
        assert c2.get_seq_length() == c1.get_seq_length()
        if hasattr(one, "forward_batch"):
            c3, c4 = one.new_cache(), ep.new_cache()
            one.forward([1, 2, 3], c3, None)
            ep.forward([1, 2, 3], c4, None)
            for x, y in zip(one.forward_batch([[9, 8], [7, 6, 5]], [c1, c3], [(), ()]),
                            ep.forward_batch([[9, 8], [7, 6, 5]], [c2, c4], [(), ()])):
                check(x[0], y[0])
            if hasattr(one, "own"):  # batched caches back to tensors of their own, every rank
                one.own(c1)
                ep.own(c2)
                check(one.forward([3], c1, None)[0], ep.forward([3], c2, None)[0])
    del c2
    gc.collect()  # the freed cache id rides on the next op
    with ep.lock:
        c5 = ep.new_cache()
        ep.forward([4, 5], c5, None)
    ep.close()
    print(json.dumps({"max_logit_diff": logit_diff, "max_tap_diff": tap_diff, "same_argmax": same,
                      "worker_exit_codes": [p.returncode for p in ep.workers],
                      "worker_args": [list(p.args) for p in ep.workers],
                      "rank0_skinny_rows": sorted({m.skinny_max_rows for m in ep.shard.model.modules()
                                                   if isinstance(m, SkinnyLinear)})}))


if __name__ == "__main__":
    main(sys.argv[1])
