"""CLI: ``python -m dflash.train {datagen,train,pipeline} ...``.

``pipeline`` = target setup (idempotent) + data generation (time budgeted) + training (time
budgeted, resumable) + final save. Threads default to 1: on this shared 2-core machine, 2 OpenMP
threads under oversubscription made decode steps 5-7x slower (measured 84 s vs 12-17 s for 16
steps of batch 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch


def _gen_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--gen-budget-min", type=float, default=25.0)
    ap.add_argument("--start-batch", type=int, default=0,
                    help="skip batches before this index (several writers on disjoint ranges)")
    ap.add_argument("--code-fraction", type=float, default=0.75,
                    help="share of prompts that are stubs of real stdlib/site-packages functions "
                         "(dflash.train.code_prompts); the rest are synthetic templates")
    ap.add_argument("--reverse", action="store_true",
                    help="generate batches last-to-first (a second writer next to a running one)")
    ap.add_argument("--prompt-seed", type=int, default=0,
                    help="seed of the prompt draw: another seed gives other prompts, to add data "
                         "to a run whose batches are all answered (with --start-batch past them)")


def _train_args(ap: argparse.ArgumentParser) -> None:
    from dflash.train.trainer import TrainConfig

    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    ap.add_argument("--block-size", type=int, default=d["block_size"])
    ap.add_argument("--gamma", type=float, default=None)
    ap.add_argument("--num-layers", type=int, default=d["num_layers"])
    ap.add_argument("--lr", type=float, default=d["lr"])
    ap.add_argument("--max-steps", type=int, default=d["max_steps"])
    ap.add_argument("--time-budget-min", type=float, default=None)
    ap.add_argument("--seqs-per-step", type=int, default=d["seqs_per_step"])
    ap.add_argument("--anchors-per-seq", type=int, default=d["anchors_per_seq"])
    ap.add_argument("--full-vocab", action="store_true", help="train the softmax over all ids")
    ap.add_argument("--full-vocab-after", type=float, default=None,
                    help="progress fraction (0-1) from which the softmax covers all ids")
    ap.add_argument("--ckpt-every-min", type=float, default=d["ckpt_every_min"])
    ap.add_argument("--log-every", type=int, default=d["log_every"])
    ap.add_argument("--seed", type=int, default=d["seed"])
    ap.add_argument("--out-dir", default=None, help="final bf16 drafter directory")
    ap.add_argument("--draft-vocab-size", type=int, default=d["draft_vocab_size"],
                    help="ids written to the drafter's draft_vocab.safetensors (0 = none)")
    ap.add_argument("--resume", action="store_true")


def _train_config(args, data_dir: str, target_dir: str, run_dir: str):
    from dflash.train.trainer import TrainConfig

    return TrainConfig(data_dir=data_dir, target_dir=target_dir, run_dir=run_dir,
                       out_dir=args.out_dir, block_size=args.block_size, gamma=args.gamma,
                       num_layers=args.num_layers, lr=args.lr, max_steps=args.max_steps,
                       time_budget_min=args.time_budget_min, seqs_per_step=args.seqs_per_step,
                       anchors_per_seq=args.anchors_per_seq, vocab_subset=not args.full_vocab,
                       full_vocab_after=args.full_vocab_after,
                       ckpt_every_min=args.ckpt_every_min, log_every=args.log_every, seed=args.seed,
                       draft_vocab_size=args.draft_vocab_size)


def _datagen(args, target_dir: str, data_dir: str) -> None:
    from dflash.config import default_target_layer_ids
    from dflash.train.data import GenConfig, generate_dataset
    from dflash.train.prompts import make_prompts

    cfg = GenConfig(target_dir=target_dir, out_dir=data_dir,
                    target_layer_ids=tuple(default_target_layer_ids(30, 5)),
                    num_prompts=args.num_prompts, batch_size=args.gen_batch,
                    max_new_tokens=args.max_new_tokens, time_budget_min=args.gen_budget_min,
                    reverse=args.reverse, start_batch=args.start_batch, seed=args.prompt_seed)
    generate_dataset(cfg, make_prompts(args.num_prompts, seed=cfg.seed,
                                       code_fraction=args.code_fraction))


def budget_until(hhmm: str, run_dir: Path, resume: bool, now: time.struct_time | None = None) -> float:
    """Training budget in minutes so that training ends at UTC ``hhmm`` (2 minutes kept for the
    final save). Resuming, the minutes already trained (``ckpt.json``) are added: the LR
    schedule runs on elapsed training time and must span the whole run, not just now..end.
    Raises ``ValueError`` for a malformed ``hhmm``."""
    try:
        hh, mm = map(int, hhmm.split(":"))
    except ValueError:
        raise ValueError(f"train_until: expected HH:MM, got {hhmm!r}") from None
    now = now or time.gmtime()
    left = (hh * 60 + mm) - (now.tm_hour * 60 + now.tm_min + now.tm_sec / 60)
    budget = max(1.0, left - 2.0)
    meta = run_dir / "ckpt.json"
    if resume and meta.is_file():
        budget += json.loads(meta.read_text())["elapsed"] / 60
    return budget


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.train")
    ap.add_argument("--threads", type=int, default=1)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("datagen", "train", "pipeline", "draft-vocab"):
        p = sub.add_parser(name)
        p.add_argument("--run-dir", default="runs/train")
        p.add_argument("--target-dir", default=None, help="default: dflash.target_setup directory")
        p.add_argument("--cache-dir", default=None)
        if name in ("datagen", "pipeline"):
            _gen_args(p)
        if name in ("train", "pipeline"):
            _train_args(p)
        if name == "draft-vocab":
            p.add_argument("--out-dir", required=True, help="drafter directory to write into")
            p.add_argument("--size", type=int, default=16384)
        if name == "pipeline":
            p.add_argument("--train-until", default=None,
                           help="UTC HH:MM; the training budget ends then (overrides --time-budget-min)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dflash.target_setup import setup_target

    target_dir = args.target_dir or str(setup_target(args.cache_dir))
    data_dir = str(Path(args.run_dir) / "data")
    if args.cmd == "draft-vocab":       # for a drafter saved without one
        from safetensors import safe_open

        from dflash.draft_vocab import build_draft_vocab, save_draft_vocab
        from dflash.train.data import shard_paths

        vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
        counts = torch.zeros(vocab, dtype=torch.int64)
        for path in shard_paths(data_dir):    # ids and mask only: the taps are most of a shard
            with safe_open(str(path), "pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab)
        ids = build_draft_vocab(counts, args.size)
        print(f"[draft-vocab] wrote {save_draft_vocab(args.out_dir, ids)} ({ids.numel()} ids)")
        return 0
    if args.cmd in ("datagen", "pipeline") and args.num_prompts > 0:   # 0: train on what exists
        _datagen(args, target_dir, data_dir)
    if args.cmd in ("train", "pipeline"):
        if getattr(args, "train_until", None):
            args.time_budget_min = budget_until(args.train_until, Path(args.run_dir), args.resume)
            print(f"[pipeline] training budget {args.time_budget_min:.1f} min", flush=True)
        from dflash.train.trainer import Trainer

        Trainer(_train_config(args, data_dir, target_dir, args.run_dir)).train(resume=args.resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
