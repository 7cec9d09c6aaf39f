"""Replay a bench run's greedy outputs through the verifier's suffix candidates (no model runs):
how well ``SuffixCalibration``'s probabilities predict what the target took, and what a threshold
on them (a hybrid tree's drafter marginal node) costs the suffix candidates alone.

    .venv/bin/python scripts/suffix_calibration_replay.py [BENCH_JSON] [PROMPTS] [LIMIT]

Defaults: docs/bench/suffix-chat-amd/bench.json, chat, 12. Each step offers the session's
candidates (tenant answers off, as the bench runs), verifies a tree of the 15 best, commits what
the greedy walk accepts plus the bonus token, and teaches the calibration as the engine does.
Needs the SmolLM2 target's tokenizer (``dflash setup-target``). Figures: docs/suffix.md.
"""

from __future__ import annotations

import json
import os
import sys

from transformers import AutoTokenizer

from dflash.core.suffix import SuffixIndex
from dflash_app.bench_prompts import prompt_set
from verifier_svc.suffix_drafts import SessionRates, Sourced, SuffixCalibration, observe_walk, offer_for, suffix_tree

BUDGET = 15
THRESHOLDS = (0.0, 0.01, 0.02, 0.04, 0.08)


def greedy_path(src: Sourced, truth: list[int]) -> list[int]:
    """Block indices of the nodes the greedy walk accepts against the target's own tokens."""
    tree, node, path = src.tree, 0, []
    for tok in truth:
        kids = [j for j in range(1, len(tree.parents)) if tree.parents[j] == node
                and tree.tokens[j - 1] == tok]
        if not kids:
            break
        node = kids[0]
        path.append(node)
    return path


def main(bench: str, prompts: str, limit: int) -> None:
    tok = AutoTokenizer.from_pretrained(os.path.expanduser("~/.cache/dflash-serve/smollm2-135m-instruct"))
    outputs = json.load(open(bench))["rows"]["off"]
    cal = SuffixCalibration()
    accepted = {t: 0 for t in THRESHOLDS}
    steps = offered = 0
    expected = got = 0.0
    for (_, messages), row in zip(prompt_set(prompts, limit), outputs):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        out, index, rates, p = row["token_ids"], SuffixIndex(list(ids)), SessionRates(), 0
        while p < len(out) - 1:
            truth = out[p:]
            offer = offer_for(index, [], min(BUDGET, len(truth) - 1), cal, rates)
            a = 0
            if offer is not None:
                for t in THRESHOLDS:
                    n = sum(1 for j in offer.order[:BUDGET] if offer.probs[j] > t)
                    src = suffix_tree(offer, n, BUDGET) if n else None
                    accepted[t] += len(greedy_path(src, truth)) if src else 0
                src = suffix_tree(offer, BUDGET, BUDGET)
                assert src is not None
                path = greedy_path(src, truth)
                expected += offer.expected(BUDGET) - 1.0
                got += (a := len(path))
                offered += 1
                observe_walk(cal, offer, src, path)
            steps += 1
            index.extend(out[p:p + a + 1])
            p += a + 1
    print(f"{steps} steps, {offered} with candidates: expected accepted {expected:.0f}, "
          f"accepted {got:.0f} (a tree of the {BUDGET} best)")
    for t in THRESHOLDS:
        print(f"candidates above p = {t}: {accepted[t]} accepted, {1 + accepted[t] / steps:.3f} "
              f"tokens per step")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "docs/bench/suffix-chat-amd/bench.json", a[1] if len(a) > 1 else "chat",
         int(a[2]) if len(a) > 2 else 12)
