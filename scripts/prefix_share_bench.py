"""Shared prompt prefill for ``n`` samples: the same request with and without a prefix group.

Runs ``n`` samples of one prompt on the verifier engine (speculation off, greedy, the real
target of ``dflash setup-target``), started as the gateway starts them (sample 0 first, the
others at its first token), either in one prefix group (the others copy sample 0's prompt KV)
or without (each prefills the prompt). The two arms alternate, ``--reps`` times each; prints
the seconds until every sample has its first token and until all are done, per arm. A figure
for docs, not a timed test:

    .venv/bin/python scripts/prefix_share_bench.py [--prompt-tokens 600] [--n 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.train.target_setup import target_dir  # noqa: E402
from verifier_svc.engine import Request, VerifierEngine  # noqa: E402
from verifier_svc.target import TargetModel  # noqa: E402


def run(engine: VerifierEngine, prompt: list[int], n: int, max_tokens: int, group: str
        ) -> tuple[float, float, list[int]]:
    """(seconds until every sample's first token, seconds until all finished, cached prompt
    tokens per sample)."""
    t0 = time.perf_counter()
    first = [0.0] * n
    cached = [0] * n
    lead = threading.Event()

    def sample(i: int) -> None:
        if i:
            lead.wait()
        req = Request(request_id=f"{group or 'solo'}-{i}-{t0}", prompt=prompt, max_tokens=max_tokens,
                      ignore_eos=True, prefix_group=group, spec_mode="off")
        for k, ev in enumerate(engine.generate(req)):
            if k == 0:
                first[i], cached[i] = time.perf_counter() - t0, ev.cached_prompt_tokens
                if i == 0:
                    lead.set()

    threads = [threading.Thread(target=sample, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(first), time.perf_counter() - t0, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    target = TargetModel(target_dir())
    engine = VerifierEngine(target, spec_mode="off")
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
    try:
        run(engine, prompt[:64], 2, 2, "")                    # warm-up
        res: dict[str, list[tuple[float, float]]] = {"shared": [], "each prefills": []}
        cached: dict[str, list[int]] = {}
        for rep in range(args.reps):
            for arm in ("shared", "each prefills"):
                ttft, total, c = run(engine, prompt, args.n, args.max_tokens,
                                     f"bench-{rep}" if arm == "shared" else "")
                res[arm].append((ttft, total))
                cached[arm] = c
        print(f"n={args.n} samples of a {args.prompt_tokens}-token prompt, {args.max_tokens} "
              f"tokens each, speculation off, {args.reps} alternating reps (median):")
        print(f"{'arm':<15} {'all first tokens s':>19} {'all done s':>11}  cached prompt tokens")
        for arm, rows in res.items():
            print(f"{arm:<15} {statistics.median(r[0] for r in rows):>19.3f} "
                  f"{statistics.median(r[1] for r in rows):>11.3f}  {cached[arm]}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
