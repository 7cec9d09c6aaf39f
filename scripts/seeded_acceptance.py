"""Acceptance of seeded (coupled) against unseeded (rejection) sampled speculation, in-process.

    python scripts/seeded_acceptance.py [--prompts humaneval] [--limit 8] [--max-tokens 96]
        [--temperatures 0.7,1.0] [--seeds 3] [--mode fixed] [--json out.json]

The real target (SmolLM2, ``dflash_app.target_setup``) and the committed drafter
(``models/smollm2-dflash-b16``, ``--dtype auto``) in one process, no gRPC. Per temperature and
prompt, ``--seeds`` requests with a seed (coupled sampling: draft and target race the same
position noise, the output is the one without speculation) and as many without (rejection
sampling against the drafter's q), interleaved. Reported: tau = 1 + accepted / drafted steps,
and the acceptance rate of draft position 1, per path. Also checks that every seeded output
equals the same seed's output without speculation (count of mismatches, expected 0).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from dflash.core.sampling import Sampling
    from dflash.train.eval_sets import encode_messages
    from dflash.train.target_setup import setup_target
    from dflash_app.bench_prompts import prompt_set
    from dflash_app.stack import DEFAULT_DRAFTER
    from drafter_svc.engine import DrafterEngine
    from verifier_svc.engine import Request, VerifierEngine
    from verifier_svc.target import TargetModel

    p = argparse.ArgumentParser()
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--mode", default="fixed")
    p.add_argument("--json", default="")
    a = p.parse_args()

    target_dir = setup_target()
    target = TargetModel(target_dir)
    drafter = DrafterEngine.from_pretrained(DEFAULT_DRAFTER, target_dir, dtype="auto")
    drafter.warmup()
    engine = VerifierEngine(target)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [encode_messages(tok, m) for _, m in prompt_set(a.prompts, a.limit)]

    def run(prompt, sampling, mode, proposer):
        steps = accepted = first = 0
        out = []
        for ev in engine.generate(Request(request_id="r", prompt=prompt, max_tokens=a.max_tokens,
                                          sampling=sampling, proposer=proposer, spec_mode=mode,
                                          ignore_eos=True)):
            out += ev.tokens
            if ev.drafted:
                steps += 1
                accepted += ev.accepted
                first += ev.accepted >= 1
        return out, steps, accepted, first

    rows = []
    for t in [float(x) for x in a.temperatures.split(",")]:
        tot = {"seeded": [0, 0, 0], "unseeded": [0, 0, 0]}
        mismatches = 0
        for i, prompt in enumerate(prompts):
            for s in range(a.seeds):
                seed = 1000 * i + s
                got, *c = run(prompt, Sampling(temperature=t, seed=seed), a.mode, drafter)
                off, *_ = run(prompt, Sampling(temperature=t, seed=seed), "off", None)
                mismatches += got != off
                tot["seeded"] = [x + y for x, y in zip(tot["seeded"], c)]
                _, *c = run(prompt, Sampling(temperature=t), a.mode, drafter)
                tot["unseeded"] = [x + y for x, y in zip(tot["unseeded"], c)]
        row = {"temperature": t, "requests_per_path": len(prompts) * a.seeds,
               "seeded_equal_to_off_mismatches": mismatches}
        for path, (steps, acc, first) in tot.items():
            row[path] = {"drafted_steps": steps, "tau": round(1 + acc / max(steps, 1), 3),
                         "first_draft_acceptance": round(first / max(steps, 1), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.close()
    drafter.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "threads": torch.get_num_threads(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
