"""Where a batched verify step's time goes on the real target, for the commit it runs in.

    python scripts/step_breakdown.py [--batches 1,8,32] [--context 200] [--reps 7] [--json out.json]

Per batch size b: b sessions with ``--context`` cached positions each (different prompts,
lengths staggered by up to 8), then one batched target step of 1 token (decode, speculation
off) and of 4 tokens (anchor + 3 drafts) per session, each followed by the crop a commit does.
Reported, in ms (medians): ``forward`` = the whole ``TargetModel.forward_batch`` call (on
commits before the persistent KV pool it includes gathering every session's cache into a
padded batch); ``model`` = the transformers forward inside it (profiled by wrapping the
model's ``forward``), so ``forward - model`` is the cache bookkeeping (gather / arrange /
per-row writes); ``verify`` = greedy acceptance of the 4-token blocks (the per-session loop
``VerifierEngine._verify`` where it exists, else ``verification.verify_batch``).
Only the target's public interface is used, so the same script measures old and new commits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    from dflash.core.sampling import Sampling
    from dflash.train.target_setup import setup_target
    from verifier_svc.target import TargetModel

    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    t = TargetModel(setup_target())
    model_s = [0.0]
    real = t.model.forward

    def timed_forward(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        model_s[0] += time.perf_counter() - t0
        return out

    t.model.forward = timed_forward
    g = torch.Generator().manual_seed(0)
    results = []
    for b in [int(x) for x in a.batches.split(",")]:
        caches, lens = [], []
        for i in range(b):
            n = a.context + (i % 8)
            c = t.new_cache()
            t.forward(torch.randint(100, 20000, (n,), generator=g).tolist(), c, None, logits_to_keep=1)
            caches.append(c)
            lens.append(n)
        row = {"batch": b}
        for q in (1, 4):
            fw, md = [], []
            for _ in range(a.reps + 1):
                blocks = [torch.randint(100, 20000, (q,), generator=g).tolist() for _ in range(b)]
                model_s[0] = 0.0
                t0 = time.perf_counter()
                outs = t.forward_batch(blocks, caches, [()] * b)
                fw.append(time.perf_counter() - t0)
                md.append(model_s[0])
                for c, n in zip(caches, lens):
                    t.crop(c, n)
            row[f"forward_{q}_ms"] = 1e3 * statistics.median(fw[1:])
            row[f"model_{q}_ms"] = 1e3 * statistics.median(md[1:])
        drafts = [torch.randint(100, 20000, (3,), generator=g) for _ in range(b)]
        logits = [lg for lg, _ in outs]
        vt = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            _verify_all(drafts, logits, Sampling())
            vt.append(time.perf_counter() - t0)
        row["verify_ms"] = 1e3 * statistics.median(vt)
        row["bookkeeping_1_ms"] = row["forward_1_ms"] - row["model_1_ms"]
        row["bookkeeping_4_ms"] = row["forward_4_ms"] - row["model_4_ms"]
        results.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        del caches
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _verify_all(drafts, logits, sampling):
    """Greedy acceptance of every row the way this commit's engine does it."""
    try:
        from verifier_svc.verification import RowParams, verify_batch
    except ImportError:   # before the batched verification: one kernel call per session
        from verifier_svc.engine import VerifierEngine

        gen = torch.Generator()
        for d, lg in zip(drafts, logits):
            VerifierEngine._verify(None, [0] + d.tolist(), lg, None, sampling, gen)
        return
    verify_batch(drafts, logits, [None] * len(drafts),
                 [RowParams(sampling, None, frozenset(), 100) for _ in drafts])


if __name__ == "__main__":
    main()
