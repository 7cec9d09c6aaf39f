"""CLI: ``python -m dflash.train {datagen,train,pipeline} ...``.

``datagen`` fills the committed token store (``data/train``, :mod:`dflash.train.datagen`);
``train`` trains on it, recomputing missing features into the local cache; ``pipeline`` does
both. One process uses every thread (``--threads``, default 2): run one job at a time, since two
processes sharing the cores slowed each other's OpenMP regions several-fold.

``--device`` (default ``cpu``; ``cuda`` on a GPU: ``scripts/accel_train.sh``) places the target,
the drafter and every batch. On CUDA, float32 matrix products use TF32: the taps it computes are
stored in bf16, whose rounding is coarser than TF32's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from dflash.core.device import device_flag, resolve_device


def _mix(text: str) -> dict[str, int]:
    """``magpie=8,code=6`` -> {source: batches}; argparse type (names the flag on bad input)."""
    from dflash.train.datagen import SOURCES

    out = {}
    for part in filter(None, text.split(",")):
        name, _, n = part.partition("=")
        if name not in SOURCES or not n.isdigit():
            raise argparse.ArgumentTypeError(f"--mix: expected source=batches with source in "
                                             f"{', '.join(SOURCES)}, got {part!r}")
        out[name] = int(n)
    if not out:
        raise argparse.ArgumentTypeError("--mix: empty")
    return out


def _gen_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mix", type=_mix, default="magpie=8,passage=2,code=6,template=2",
                    help="batches to have per prompt source (code, template, passage, magpie, chat2)")
    ap.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="target dtype while answering: float32 = as served on a CPU (writes the "
                    "feature cache too); bfloat16 = faster on CPUs with AMX, ids only")
    ap.add_argument("--batch-size", type=int, default=128, help="prompts answered per batch")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt draw (another "
                    "seed gives other prompts and other shard names)")
    ap.add_argument("--gen-budget-min", type=float, default=None,
                    help="stop after the batch that crosses this many minutes")


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
    ap.add_argument("--init-from", default=None, help="warm start from this drafter directory")
    ap.add_argument("--version", default=d["version"], help="dflash_serve.version of the saved drafter")
    ap.add_argument("--kl-weight", type=float, default=d["kl_weight"],
                    help="weight of the target-distribution term (self-logit distillation), 0..1")
    ap.add_argument("--heldout-every", type=int, default=d["heldout_every"])
    ap.add_argument("--heldout-batch", type=int, default=d["heldout_batch"],
                    help="held-out sequences per forward (more on a GPU; the blocks are the same)")
    ap.add_argument("--sources", default=None, help="comma-separated token-store sources to train on")
    ap.add_argument("--stop-at-step", type=int, default=None,
                    help="checkpoint and stop at this step (the schedule is unchanged; --resume "
                         "continues): to compare recipes on the held-out split part-way")
    ap.add_argument("--architecture", choices=("dflash", "dflash2"), default=d["architecture"],
                    help="dflash2: DFlash2DraftModel (conv + candidate selector); with --init-from "
                         "a DFlash drafter it starts equal to it")
    ap.add_argument("--selector-top-k", type=int, default=d["selector_top_k"])
    ap.add_argument("--selector-rank", type=int, default=d["selector_rank"])
    ap.add_argument("--selector-weight", type=float, default=d["selector_weight"])


def _train_config(args, data_dir: str, target_dir: str, run_dir: str):
    from dflash.train.trainer import TrainConfig

    return TrainConfig(data_dir=data_dir, target_dir=target_dir, run_dir=run_dir,
                       out_dir=args.out_dir, block_size=args.block_size, gamma=args.gamma,
                       num_layers=args.num_layers, lr=args.lr, max_steps=args.max_steps,
                       time_budget_min=args.time_budget_min, seqs_per_step=args.seqs_per_step,
                       anchors_per_seq=args.anchors_per_seq, vocab_subset=not args.full_vocab,
                       full_vocab_after=args.full_vocab_after,
                       ckpt_every_min=args.ckpt_every_min, log_every=args.log_every, seed=args.seed,
                       draft_vocab_size=args.draft_vocab_size, cache_dir=args.feature_cache,
                       init_from=args.init_from, version=args.version, kl_weight=args.kl_weight, topk=args.topk,
                       heldout_every=args.heldout_every, heldout_batch=args.heldout_batch,
                       device=str(args.device), architecture=args.architecture,
                       selector_top_k=args.selector_top_k, selector_rank=args.selector_rank,
                       selector_weight=args.selector_weight,
                       sources=tuple(args.sources.split(",")) if args.sources else None)


def _datagen(args, target_dir: str) -> None:
    from dflash.core.config import default_target_layer_ids
    from dflash.train.datagen import GenConfig, generate

    layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
    cfg = GenConfig(data_dir=args.data_dir, cache_dir=args.feature_cache, target_dir=target_dir,
                    layer_ids=tuple(default_target_layer_ids(layers, 5)), mix=args.mix,
                    batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, topk=args.topk,
                    seed=args.prompt_seed, budget_min=args.gen_budget_min, dtype=args.gen_dtype,
                    device=str(args.device))
    print(f"[datagen] totals {generate(cfg)}", flush=True)


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
    ap.add_argument("--threads", type=int, default=2)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("datagen", "train", "pipeline", "draft-vocab"):
        p = sub.add_parser(name)
        p.add_argument("--run-dir", default="runs/train")
        p.add_argument("--data-dir", default="data/train", help="token store (committed)")
        p.add_argument("--feature-cache", default="runs/featcache",
                       help="local cache of taps and target distributions, rebuilt when missing")
        p.add_argument("--topk", type=int, default=16, help="target distribution kept per token")
        p.add_argument("--target-dir", default=None, help="default: dflash.train.target_setup directory")
        p.add_argument("--cache-dir", default=None, help="where dflash.train.target_setup builds the target")
        p.add_argument("--device", type=device_flag, default="cpu",
                       help="where the target, the drafter and each batch live: cpu (default), "
                            "cuda, cuda:N")
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
    args.device = resolve_device(args.device)       # a GPU that is not there: refused here
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    from dflash.train.target_setup import setup_target

    target_dir = args.target_dir or str(setup_target(args.cache_dir))
    if args.cmd == "draft-vocab":       # for a drafter saved without one
        from dflash.core.draft_vocab import build_draft_vocab, save_draft_vocab
        from dflash.train.tokdata import TokenStore

        vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
        counts = torch.zeros(vocab, dtype=torch.int64)
        store = TokenStore(args.data_dir)
        for entry in store.shards():
            for s in store.read(entry):
                counts += torch.bincount(torch.from_numpy(s.ids[s.loss_mask.astype(bool)]), minlength=vocab)
        ids = build_draft_vocab(counts, args.size)
        print(f"[draft-vocab] wrote {save_draft_vocab(args.out_dir, ids)} ({ids.numel()} ids)")
        return 0
    if args.cmd in ("datagen", "pipeline"):
        _datagen(args, target_dir)
    if args.cmd in ("train", "pipeline"):
        if getattr(args, "train_until", None):
            args.time_budget_min = budget_until(args.train_until, Path(args.run_dir), args.resume)
            print(f"[pipeline] training budget {args.time_budget_min:.1f} min", flush=True)
        from dflash.train.trainer import Trainer

        Trainer(_train_config(args, args.data_dir, target_dir, args.run_dir)).train(
            resume=args.resume, stop_at_step=args.stop_at_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
