"""Replay the online-learning bench's rounds offline on a store it captured, and score every
version it would release by the gate's served walk on another store
(docs/bench/learning-history/README.md, "Schedules end at the gate").

Round r trains on the store's first ``--rounds-at[r]`` conversations (the order they were
captured: the bench's rounds saw them so), ``--steps`` optimizer steps over a schedule of
``--max-steps`` (default: the steps, so each candidate is annealed at its gate), then gates and
releases as ``scripts/bench_learn.py`` does. ``--score-store`` (e.g. the bench's fresh prompts,
answered with capture on into a store of their own) is walked by every version, the starting
one included, over its conversations with ``seq`` below ``--score-first``.

Usage:
  python scripts/learn_rounds_offline.py --store <bench out>/learn/store --out /tmp/rounds \\
      --drafter models/smollm2-dflash-b16 --score-store /tmp/fresh/store --score-first 32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path


def walk_tau(drafter_dir: str, head, convs: list, vocab) -> float:
    """τ of the gate's served walk of ``drafter_dir`` over ``convs``."""
    import torch

    from dflash.core.checkpoint import load_drafter
    from dflash.learn.gate import score

    m = load_drafter(drafter_dir, dtype=torch.float32).eval()
    sc = score(m, head, convs, metric="served", vocab=vocab)
    return round(1 + sum(s.accepted for s in sc) / max(1, sum(s.blocks for s in sc)), 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="the captured store (<learn dir>/store)")
    p.add_argument("--out", required=True, help="a new learn dir (its store: links to --store)")
    p.add_argument("--drafter", required=True, help="the starting version")
    p.add_argument("--target", default=str(Path.home() / ".cache/dflash-serve/smollm2-135m-instruct"))
    p.add_argument("--rounds-at", default="144,272,400", help="conversations each round sees")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--max-steps", type=int, default=0, help="the schedule's length (0: --steps)")
    p.add_argument("--score-store", help="a store whose conversations every version is walked over")
    p.add_argument("--score-first", type=int, default=10**9)
    a = p.parse_args(argv)

    from dflash.core.checkpoint import load_target_head
    from dflash.core.draft_vocab import load_draft_vocab
    from dflash.learn import release as rel
    from dflash.learn.learner import LearnConfig, Learner
    from dflash.learn.store import CaptureStore

    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "store").mkdir(parents=True)
    files = sorted(Path(a.store).glob("conv_*.safetensors"))
    cfg = LearnConfig(max_steps=a.max_steps or a.steps)
    versions, serving = [a.drafter], a.drafter
    for r, n in enumerate(int(x) for x in a.rounds_at.split(",")):
        for f in files[:n]:
            if not (out / "store" / f.name).exists():
                os.symlink(f.resolve(), out / "store" / f.name)
        lr = Learner(out, serving, a.target, cfg=cfg)
        lr.run(a.steps)
        released = rel.release(lr)
        d = rel.decisions(out)[-1]
        print(json.dumps({"round": r, "conversations": n, "decision": d["decision"], "reason": d["reason"]}),
              flush=True)
        if released is not None:
            serving = str(released)
            versions.append(serving)
    if a.score_store:
        # every released version drafts over the starting one's vocabulary (save_candidate)
        head = load_target_head(a.target)
        vocab = load_draft_vocab(a.drafter, lr.serving.cfg.vocab_size)
        st = CaptureStore(a.score_store, writer=False)
        convs = [c for c in st.read("train") + st.read("heldout") if int(c["seq"]) < a.score_first]
        scores = {Path(v).name: walk_tau(v, head, convs, vocab) for v in versions}
        print(json.dumps({"conversations": len(convs), "served_walk_tau": scores}), flush=True)
        (out / "scores.json").write_text(json.dumps(scores, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
