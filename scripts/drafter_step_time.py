"""Drafter step time, DFlash (v6) against DFlash2 (v7), on this machine's CPU path.

One drafter step = one ``DrafterEngine.propose`` of a block (default 16) for one session whose
context is already cached (the serving step): the drafter forward, the LM head, and for DFlash2
the grouped convolutions and the selector's walk. Both engines take the same product choices
(``--packed-linear`` / ``--panel-linear``; the conv's and the selector's projections are linear
layers like the rest and take them too). The two are timed interleaved, ``--iters`` rounds of
one step each, and the medians reported; one torch thread by default.

Without ``--v7`` the DFlash2 drafter is v6 turned into DFlash2 (``init_from_dflash``): the cost
of a v7 of that shape, whatever its weights.

    python scripts/drafter_step_time.py --target-dir ~/.cache/dflash-serve/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.core.checkpoint import load_drafter, load_target_head  # noqa: E402
from dflash.core.config import DFLASH2  # noqa: E402
from dflash.core.dflash2 import DFlash2Drafter  # noqa: E402
from dflash.core.draft_vocab import load_draft_vocab  # noqa: E402
from dflash.core.proposer import ProposalRequest  # noqa: E402
from dflash.core.sampling import Sampling  # noqa: E402
from drafter_svc.engine import DrafterEngine  # noqa: E402


def engine(drafter, args) -> DrafterEngine:
    head = load_target_head(args.target_dir, dtype=next(drafter.parameters()).dtype)
    vocab = load_draft_vocab(args.v6, drafter.cfg.vocab_size, -1)
    return DrafterEngine(drafter, head, draft_vocab=vocab, packed_linear=args.packed_linear,
                         panel_linear=args.panel_linear, context_threads=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--v6", default=str(ROOT / "models/smollm2-dflash-b16"))
    p.add_argument("--v7", default=None, help="a DFlash2 drafter dir (default: v6 made DFlash2)")
    p.add_argument("--target-dir", required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--context", type=int, default=256, help="cached context rows")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top-k", type=int, default=16, help="selector candidates (made-up v7 only)")
    p.add_argument("--packed-linear", default="off", choices=("on", "off"))
    p.add_argument("--panel-linear", default="off", choices=("on", "off"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    v6 = load_drafter(args.v6, dtype=dt)
    if args.v7:
        v7 = load_drafter(args.v7, dtype=dt)
    else:
        cfg = dataclasses.replace(v6.cfg, architecture=DFLASH2, conv_kernel_size=2,
                                  conv_group_size=16, selector_rank=64, selector_top_k=args.top_k)
        v7 = DFlash2Drafter(cfg)
        v7.init_from_dflash(v6.float())
        v7 = v7.to(dt).eval()
    engines = {"v6": engine(v6, args), "v7": engine(v7, args)}
    ctx = torch.randn(args.context, v6.cfg.context_size)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for e in engines.values():       # the context once, then a warm-up step
        e.propose([ProposalRequest(session_id="s", context_start=0, context=ctx, anchor_token=1,
                                   block_size=args.block, sampling=Sampling())])
    empty = torch.zeros(0, v6.cfg.context_size)
    for i in range(args.iters):
        for name, e in engines.items():
            r = ProposalRequest(session_id="s", context_start=args.context, context=empty,
                                anchor_token=1 + i % 100, block_size=args.block, sampling=Sampling())
            t0 = time.perf_counter()
            e.propose([r])
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k}: {v:.2f} ms per step (median of {args.iters}, block {args.block}, "
              f"{args.context} context rows, {args.dtype}, {args.threads} thread(s))")
    print(f"v7 / v6: {med['v7'] / med['v6']:.3f}")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
