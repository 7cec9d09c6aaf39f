#!/usr/bin/env python3
"""What suffix candidates cost per decode step: the session index's update and the lookup that
builds one step's candidates, at contexts of 1k-32k tokens of real target text (the training
set's token ids, data/train, conversations concatenated as one long session).

    python scripts/suffix_cost.py [--out docs/bench/suffix-cost/cost.json]

Prints a table (microseconds per step: append one step's tokens, look up and score the
candidates, both together; index memory) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dflash.core.suffix import SuffixIndex
from verifier_svc.suffix_drafts import AnswerStore, SessionRates, SuffixCalibration, offer_for

ROOT = Path(__file__).resolve().parents[1]


def stream() -> list[int]:
    ids: list[int] = []
    for shard in sorted((ROOT / "data/train").glob("*.npz")):
        ids.extend(np.load(shard)["ids"].astype(np.int64).tolist())
    return ids


def measure(tokens: list[int], context: int, steps: int, answers: AnswerStore) -> dict:
    ix = SuffixIndex(tokens[:context])
    cal, rates = SuffixCalibration(), SessionRates()
    upd, look, nodes = [], [], []
    pos = context
    for _ in range(steps):
        new = tokens[pos:pos + 3]                # a step commits ~3 tokens with speculation
        pos += 3
        t0 = time.perf_counter()
        ix.extend(new)
        t1 = time.perf_counter()
        offer = offer_for(ix, answers.indexes("t"), 16, cal, rates)
        t2 = time.perf_counter()
        upd.append(t1 - t0)
        look.append(t2 - t1)
        nodes.append(offer.size if offer else 0)
    return {"context": context, "update_us": 1e6 * statistics.median(upd),
            "lookup_us": 1e6 * statistics.median(look),
            "lookup_p99_us": 1e6 * sorted(look)[int(0.99 * len(look))],
            "step_us": 1e6 * statistics.median(u + lk for u, lk in zip(upd, look)),
            "candidates": statistics.mean(nodes), "index_mb": ix.nbytes / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs/bench/suffix-cost/cost.json"))
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    toks = stream()
    answers = AnswerStore()
    for i in range(64):                          # a tenant's 64 recent answers of ~200 tokens
        answers.add("t", toks[-(i + 1) * 200:-i * 200 or None])
    t0 = time.perf_counter()
    SuffixIndex(toks[:8192])
    build = (time.perf_counter() - t0) / 8192
    rows = [measure(toks, n, a.steps, answers) for n in (1024, 8192, 32768)]
    print(f"index build: {1e6 * build:.2f} us per token (a prompt's prefill); tenant store: "
          f"{answers.tokens} tokens in 64 answers, {answers.nbytes / 2**20:.1f} MB")
    print("| context tokens | update us/step | lookup us/step (p50) | lookup p99 | step total us | candidates | index MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['update_us']:.1f} | {r['lookup_us']:.1f} | {r['lookup_p99_us']:.1f} | "
              f"{r['step_us']:.1f} | {r['candidates']:.1f} | {r['index_mb']:.2f} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"build_us_per_token": 1e6 * build, "rows": rows,
                               "answer_store_tokens": answers.tokens}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
