"""DFlash drafter trainer (CPU-friendly, resumable, time-budgeted).

The target's embedding and LM head are frozen (:class:`dflash.core.modeling.TargetHead`); only the
drafter trains. Each step takes ``seqs_per_step`` sequences (an epoch is a fresh permutation) and
``anchors_per_seq`` fresh random anchors per sequence (:mod:`dflash.recipe.blocks`). Loss: CE
weighted by ``exp(-(k-1)/gamma)`` normalised by the weight sum. AdamW, linear warmup then cosine
decay; with a time budget the schedule runs on elapsed training time, so a budgeted run always
finishes its decay. Checkpoints (drafter + optimizer + step + RNG) go to ``<run_dir>/ckpt.{safetensors,json}``
(:mod:`dflash.recipe.ckpt`, no pickle).

The LM head (49152 x 576) dominates the cost. ``vocab_subset`` restricts the training softmax to
the token ids that occur in the training data (an approximation: ids never seen are not pushed
down); evaluation always uses the full vocabulary.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch

from dflash.core.checkpoint import build_drafter, load_target_head, save_drafter, target_fingerprint
from dflash.core.config import DFLASH2, DrafterConfig, default_target_layer_ids
from dflash.core.dflash2 import DFlash2Drafter
from dflash.core.draft_vocab import build_draft_vocab, save_draft_vocab
from dflash.core.modeling import TargetHead
from dflash.recipe import ckpt
from dflash.recipe.blocks import BlockBatch, build_batch, sample_anchors, valid_anchors
from dflash.recipe.loss import batch_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data_dir: str                       # token store (dflash.train.tokdata), e.g. data/train
    target_dir: str
    run_dir: str
    cache_dir: str | None = None        # feature cache; default <run_dir>/featcache
    init_from: str | None = None        # warm start: a drafter directory of the same shape
    kl_weight: float = 0.0              # loss = (1-w) CE(target's token) + w CE(target's top-k dist)
    topk: int = 16                      # target distribution kept per token (feature cache)
    heldout_every: int = 20             # every n-th sequence (stable hash) is held out; 0 = none
    heldout_batch: int = 4              # held-out sequences per forward (same anchors whatever it is)
    device: str = "cpu"                 # where the drafter, the frozen head and each batch live
    sources: tuple[str, ...] | None = None   # train on these token-store sources only
    out_dir: str | None = None          # final bf16 drafter (save_drafter); None = skip
    block_size: int = 16
    gamma: float | None = None          # default 7 for B=16, 4 for B=8
    num_layers: int = 1
    intermediate_size: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    num_taps: int = 5
    mask_token_id: int = 4              # SmolLM2 "<reponame>" (see dflash.train.target_setup)
    lr: float = 8e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.04
    max_steps: int = 1000
    time_budget_min: float | None = None
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    grad_clip: float = 1.0
    vocab_subset: bool = True
    full_vocab_after: float | None = None  # progress fraction from which the softmax is full
    logit_chunk: int = 1024
    log_every: int = 10
    ckpt_every_min: float = 4.0
    reload_every_min: float = 5.0       # pick up shards written meanwhile by a datagen process
    seed: int = 0
    draft_vocab_size: int = 16384       # ids in the saved draft_vocab.safetensors; 0 = none
    name: str = "smollm2-dflash"
    version: str = "1"
    architecture: str = "dflash"        # "dflash2": DFlash2DraftModel (warm start from DFlash: identity)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_weight: float = 1.0        # DFlash2: loss = CE + w * selector CE

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else (7.0 if self.block_size >= 16 else 4.0)


def drafter_config(cfg: TrainConfig, tcfg: dict, head: TargetHead) -> DrafterConfig:
    """Drafter architecture for the target described by ``tcfg`` (its config.json dict)."""
    rope = (tcfg.get("rope_parameters") or {}).get("rope_theta", tcfg.get("rope_theta", 10000.0))
    return DrafterConfig(
        hidden_size=tcfg["hidden_size"], intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
        max_position_embeddings=tcfg.get("max_position_embeddings", 32768),
        vocab_size=tcfg["vocab_size"], block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
        target_layer_ids=tuple(default_target_layer_ids(tcfg["num_hidden_layers"], cfg.num_taps)),
        num_target_layers=tcfg["num_hidden_layers"], name=cfg.name, version=cfg.version,
        target_fingerprint=target_fingerprint(tcfg, head.embed),
        **(dict(architecture=DFLASH2, conv_kernel_size=cfg.conv_kernel_size,
                conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
                selector_top_k=cfg.selector_top_k) if cfg.architecture == "dflash2" else {}))


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tcfg = json.loads((Path(cfg.target_dir) / "config.json").read_text())
        self.device = torch.device(cfg.device)
        self.head = load_target_head(cfg.target_dir)
        self.dcfg = drafter_config(cfg, self.tcfg, self.head)     # fingerprint: from the host copy
        self.head = self.head.to(self.device)
        self.seqs: list[dict[str, torch.Tensor]] = []
        self.heldout: list[dict[str, torch.Tensor]] = []
        self.shards: list[str] = []         # shard file names in load order (seqs index order)
        self.vocab = torch.zeros(0, dtype=torch.int64, device="cpu")   # softmax ids, on the host
        self._target = None
        self.add_shards()
        if not self.seqs:
            raise RuntimeError(f"no usable training sequences in {cfg.data_dir}")
        torch.manual_seed(cfg.seed)
        self.drafter = build_drafter(self.dcfg)
        if cfg.architecture == "dflash2":
            self.drafter.candidate_selector.init_neutral(seed=cfg.seed)
            for layer in self.drafter.layers:
                layer.attention_conv.init_identity()
                layer.mlp_conv.init_identity()
        if cfg.init_from:
            self._warm_start(cfg.init_from)
        self.drafter.to(self.device)      # built and warm-started on the host: same weights anywhere
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.rng = random.Random(cfg.seed)
        self.step, self.elapsed, self.epoch, self.order = 0, 0.0, 0, []
        self._update_vocab()
        n_tok = sum(int(s["loss_mask"].sum()) for s in self.seqs)
        print(f"[train] {len(self.seqs)} sequences ({len(self.heldout)} held out), {n_tok} response "
              f"tokens; drafter {sum(p.numel() for p in self.drafter.parameters()) / 1e6:.2f}M params, "
              f"{cfg.num_layers} layer(s), B={cfg.block_size}, gamma={cfg.loss_gamma}, taps "
              f"{list(self.dcfg.target_layer_ids)}, softmax over {self.head_w.shape[0]} ids, "
              f"kl_weight {cfg.kl_weight}", flush=True)

    def _warm_start(self, path: str) -> None:
        """Start from a saved drafter's weights (same architecture; ``ValueError`` otherwise)."""
        from dflash.core.checkpoint import load_drafter

        src = load_drafter(path, dtype=torch.float32)
        if src.cfg.target_layer_ids != self.dcfg.target_layer_ids or src.cfg.block_size != self.dcfg.block_size:
            raise ValueError(f"init_from: {path} has taps {list(src.cfg.target_layer_ids)} / block "
                             f"{src.cfg.block_size}, this run {list(self.dcfg.target_layer_ids)} / "
                             f"{self.dcfg.block_size}")
        try:
            if isinstance(self.drafter, DFlash2Drafter) and not src.cfg.is_dflash2:
                self.drafter.init_from_dflash(src)     # the new modules neutral: equals src
            else:
                self.drafter.load_state_dict(src.state_dict())
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"init_from: {path} does not match this run's architecture ({e})") from None
        print(f"[train] warm start from {path} (version {src.cfg.version})", flush=True)

    # ----------------------------------------------------------------- data loading
    def _target_model(self):
        if self._target is None:
            from dflash.train.data import load_target

            print("[train] computing features of shards missing from the feature cache", flush=True)
            self._target = load_target(self.cfg.target_dir, device=self.device)[0]
        return self._target

    def add_shards(self, names: list[str] | None = None) -> int:
        """Load listed shards not loaded yet (``names`` first, in that order), computing missing
        feature-cache entries; every ``heldout_every``-th sequence goes to the held-out split.
        Returns training sequences added."""
        from dflash.train import featcache
        from dflash.train.tokdata import TokenStore

        store = TokenStore(self.cfg.data_dir, fingerprint=self.dcfg.target_fingerprint)
        srcs = set(self.cfg.sources) if self.cfg.sources else None
        entries = {e["name"]: e for e in store.shards(srcs)}
        todo = [n for n in (names or []) if n in entries and n not in self.shards]
        todo += sorted(set(entries) - set(self.shards) - set(todo))
        cache = self.cfg.cache_dir or str(self.run_dir / "featcache")
        before = len(self.seqs)
        for name in todo:
            seqs, feats = featcache.ensure_features(store, entries[name], cache, self._target_model,
                                                    self.dcfg.target_layer_ids, self.cfg.topk)
            for i, (s, f) in enumerate(zip(seqs, feats)):
                d = {"input_ids": torch.from_numpy(s.ids), "loss_mask": torch.from_numpy(s.loss_mask), **f}
                if not len(valid_anchors(d["loss_mask"])):
                    continue
                (self.heldout if is_heldout(name, i, self.cfg.heldout_every) else self.seqs).append(d)
            self.shards.append(name)
        if hasattr(self, "drafter"):
            self._update_vocab()
        return len(self.seqs) - before

    def _update_vocab(self) -> None:
        """Softmax ids for ``vocab_subset``: ids seen in the data, new ids appended at the end."""
        if not self.cfg.vocab_subset:
            self.label_map, self.head_w = None, self.head.lm_head
            return
        seen = torch.unique(torch.cat([s["input_ids"] for s in self.seqs]))
        new = seen[~torch.isin(seen, self.vocab)]
        if len(new) or not hasattr(self, "label_map"):
            self.vocab = torch.cat([self.vocab, new])          # host (checkpointed)
            vocab = self.vocab.to(self.device)
            self.label_map = torch.full((self.head.vocab_size,), -1, dtype=torch.int64, device=self.device)
            self.label_map[vocab] = torch.arange(len(vocab), device=self.device)
            self.head_w = self.head.lm_head[vocab].contiguous()

    def softmax_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LM head rows, id -> row map) of the training softmax at the current progress.

        With ``full_vocab_after`` the last part of training uses the full vocabulary, so ids
        that never occur in the data are pushed down too (they can win a full-vocabulary argmax
        at inference: ~10% of argmaxes early in a subset-only run)."""
        if self.cfg.full_vocab_after is not None and self.progress() >= self.cfg.full_vocab_after:
            return self.head.lm_head, None
        return self.head_w, self.label_map

    # ----------------------------------------------------------------- schedule
    def progress(self) -> float:
        if self.cfg.time_budget_min:
            return min(1.0, self.elapsed / (self.cfg.time_budget_min * 60))
        return min(1.0, self.step / max(1, self.cfg.max_steps))

    def lr_now(self) -> float:
        p, wu = self.progress(), self.cfg.warmup_ratio
        if p < wu:
            return self.cfg.lr * max(p / wu, 0.02)
        return self.cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (p - wu) / (1 - wu))))

    def done(self) -> bool:
        if self.cfg.time_budget_min:
            return self.elapsed >= self.cfg.time_budget_min * 60
        return self.step >= self.cfg.max_steps

    # ----------------------------------------------------------------- data
    def next_batch(self) -> BlockBatch:
        """The next step's blocks, on the trainer's device."""
        picked = []
        for _ in range(self.cfg.seqs_per_step):
            if not self.order:
                self.order = list(range(len(self.seqs)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            picked.append(self.seqs[self.order.pop()])
        anchors = [sample_anchors(s["loss_mask"], self.cfg.anchors_per_seq, self.rng) for s in picked]
        return self._batch(picked, anchors)

    def _batch(self, seqs: list[dict[str, torch.Tensor]], anchors: list[list[int]]) -> BlockBatch:
        """Blocks built on the host and moved to the trainer's device: the one place a batch moves."""
        return build_batch(seqs, anchors, block_size=self.cfg.block_size, mask_token_id=self.cfg.mask_token_id,
                           gamma=self.cfg.loss_gamma).to(self.device)

    # ----------------------------------------------------------------- held-out evaluation
    @torch.no_grad()
    def evaluate_heldout(self, anchors_per_seq: int = 8, seqs_per_batch: int | None = None) -> dict:
        """Teacher-forced acceptance on the held-out split, full vocabulary, fixed anchors
        (seeded per sequence, so two runs on the same data are compared on the same blocks),
        ``seqs_per_batch`` sequences per forward (default ``heldout_batch``; the anchors do not
        depend on it, the reported loss, a mean over batches, slightly does).

        Returns ``{"tau": 1 + mean accepted drafts per block, "acc_pos": [B-1] accuracy per
        block position, "blocks": n, "loss": weighted CE}``; ``{}`` without held-out data."""
        if not self.heldout:
            return {}
        was = self.drafter.training
        self.drafter.eval()
        B = self.cfg.block_size
        seqs_per_batch = seqs_per_batch or self.cfg.heldout_batch
        correct, valid = torch.zeros(B - 1, device="cpu"), torch.zeros(B - 1, device="cpu")
        acc_sum, blocks, loss_sum, n_batches = 0.0, 0, 0.0, 0
        for i in range(0, len(self.heldout), seqs_per_batch):
            group = self.heldout[i:i + seqs_per_batch]
            anchors = [sample_anchors(s["loss_mask"], anchors_per_seq, random.Random(1234 + i + j))
                       for j, s in enumerate(group)]
            batch = self._batch(group, anchors)
            loss, st = batch_loss(self.drafter, self.head, batch, self.head.lm_head, None, self.cfg.logit_chunk)
            correct += st["correct"].float()
            valid += st["valid"].float()
            acc_sum, blocks = acc_sum + st["accepted_sum"], blocks + st["blocks"]
            loss_sum, n_batches = loss_sum + loss.item(), n_batches + 1
        self.drafter.train(was)
        return {"tau": round(1 + acc_sum / max(1, blocks), 4), "blocks": blocks,
                "acc_pos": [round(x, 4) for x in (correct / valid.clamp_min(1)).tolist()],
                "loss": round(loss_sum / max(1, n_batches), 4)}

    def log_heldout(self) -> dict:
        """Held-out figures appended to ``heldout_log.csv`` (the tau-vs-steps curve)."""
        h = self.evaluate_heldout()
        if h:
            path = self.run_dir / "heldout_log.csv"
            new = not path.exists()
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", "elapsed_s", "tau", "acc_k1", "acc_k2", "acc_k3", "loss"])
                w.writerow([self.step, round(self.elapsed, 1), h["tau"], *h["acc_pos"][:3], h["loss"]])
        return h

    # ----------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> None:
        """Checkpoint (safetensors + JSON, :mod:`dflash.recipe.ckpt`) into ``run_dir``."""
        ckpt.save(self.run_dir, drafter=self.drafter.state_dict(), opt=self.opt.state_dict(),
                  tensors={"torch_rng": torch.get_rng_state(), "vocab": self.vocab},
                  meta={"step": self.step, "elapsed": self.elapsed, "epoch": self.epoch,
                        "order": list(self.order), "py_rng": self.rng.getstate(),
                        "config": dataclasses.asdict(self.cfg), "shards": list(self.shards)})

    def load_checkpoint(self) -> bool:
        got = ckpt.load(self.run_dir)
        if got is None:
            return False
        state, drafter, opt, extra = got
        if state.get("shards") and state["shards"] != self.shards[:len(state["shards"])]:
            self.seqs, self.shards = [], []           # reload in the checkpoint's order
            self.vocab = extra["vocab"]
            del self.label_map
            self.add_shards(state["shards"])
        self.drafter.load_state_dict(drafter)
        self.opt.load_state_dict(opt)
        self.step, self.elapsed, self.epoch = state["step"], state["elapsed"], state["epoch"]
        self.order = list(state["order"])
        self.rng.setstate(_tuplify(state["py_rng"]))
        torch.set_rng_state(extra["torch_rng"])
        print(f"[train] resumed at step {self.step} ({self.elapsed / 60:.1f} min trained)", flush=True)
        return True

    def save_final(self) -> Path | None:
        if not self.cfg.out_dir:
            return None
        save_drafter(self.drafter, self.cfg.out_dir, dtype=torch.bfloat16, cfg=self.dcfg)
        if self.cfg.draft_vocab_size:
            prior = None
            if self.cfg.init_from:     # keep the warm-start drafter's ids after the ones seen here
                from dflash.core.draft_vocab import load_draft_vocab

                prior = load_draft_vocab(self.cfg.init_from, self.head.vocab_size)
            save_draft_vocab(self.cfg.out_dir, build_draft_vocab(
                response_counts(self.seqs, self.head.vocab_size), self.cfg.draft_vocab_size, prior))
        return Path(self.cfg.out_dir)

    # ----------------------------------------------------------------- loop
    def train(self, resume: bool = False, stop_at_step: int | None = None) -> dict:
        """Train until the step/time budget is spent (or ``stop_at_step``: an interruption,
        checkpointed but without the final save), then checkpoint and save the drafter."""
        from tqdm import tqdm

        if resume:
            self.load_checkpoint()
        if self.heldout and self.step == 0:
            start = self.log_heldout()
            print(f"[train] held-out before training: {start}", flush=True)
            (self.run_dir / "heldout_start.json").write_text(json.dumps(start, indent=1) + "\n")
        log_path = self.run_dir / "train_log.csv"
        B = self.cfg.block_size
        fields = ["step", "epoch", "elapsed_s", "lr", "loss", "accept_len"] + [f"acc_k{k}" for k in range(1, B)]
        new_log = not log_path.exists() or not resume
        logf = open(log_path, "w" if new_log else "a", newline="")
        writer = csv.writer(logf)
        if new_log:
            writer.writerow(fields)
        total = self.cfg.max_steps if not self.cfg.time_budget_min else None
        bar = tqdm(total=total, initial=self.step, desc="train", unit="step", mininterval=5)
        last_ckpt, last_reload, acc = time.time(), time.time(), []
        self.drafter.train()
        while not self.done() and (stop_at_step is None or self.step < stop_at_step):
            t0 = time.time()
            for g in self.opt.param_groups:
                g["lr"] = self.lr_now()
            batch = self.next_batch()
            head_w, label_map = self.softmax_head()
            loss, stats = batch_loss(self.drafter, self.head, batch, head_w, label_map,
                                     self.cfg.logit_chunk, self.cfg.kl_weight,
                                     self.cfg.selector_weight)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.step += 1
            self.elapsed += time.time() - t0
            acc.append((loss.item(), stats))
            bar.update(1)
            if self.step % self.cfg.log_every == 0:
                ls = sum(a[0] for a in acc) / len(acc)
                al = sum(a[1]["accept_len"] for a in acc) / len(acc)
                pos = [sum(a[1]["acc_pos"][k] for a in acc) / len(acc) for k in range(B - 1)]
                writer.writerow([self.step, self.epoch, round(self.elapsed, 1), f"{self.lr_now():.3e}",
                                 f"{ls:.4f}", f"{al:.3f}"] + [f"{p:.3f}" for p in pos])
                logf.flush()
                bar.set_postfix(loss=f"{ls:.3f}", acc1=f"{pos[0]:.2f}", accept=f"{al:.2f}",
                                lr=f"{self.lr_now():.1e}", s_step=f"{self.elapsed / self.step:.2f}")
                acc = []
            if time.time() - last_reload > self.cfg.reload_every_min * 60:
                added = self.add_shards()
                if added:
                    print(f"\n[train] step {self.step}: +{added} sequences from new shards "
                          f"({len(self.seqs)} total, softmax over {self.head_w.shape[0]} ids)", flush=True)
                last_reload = time.time()
            if time.time() - last_ckpt > self.cfg.ckpt_every_min * 60:
                self.save_checkpoint()
                plot_log(log_path, self.run_dir / "train_loss.png")
                self.log_heldout()
                last_ckpt = time.time()
        bar.close()
        logf.close()
        self.save_checkpoint()
        plot_log(log_path, self.run_dir / "train_loss.png")
        if stop_at_step is not None and not self.done():
            heldout = self.log_heldout()
            print(f"[train] stopped at step {self.step}; held-out: {heldout}", flush=True)
            (self.run_dir / f"heldout_step{self.step}.json").write_text(json.dumps(heldout, indent=1) + "\n")
            return {"steps": self.step, "interrupted": True, "heldout": heldout}
        out = self.save_final()
        heldout = self.log_heldout()
        print(f"[train] held-out: {heldout}", flush=True)
        summary = {"steps": self.step, "epochs": self.epoch, "minutes": round(self.elapsed / 60, 2),
                   "sequences": len(self.seqs), "heldout": heldout, "kl_weight": self.cfg.kl_weight,
                   "response_tokens": sum(int(s["loss_mask"].sum()) for s in self.seqs),
                   "s_per_step": round(self.elapsed / max(1, self.step), 3),
                   "out_dir": str(out) if out else None}
        (self.run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"[train] done: {summary}", flush=True)
        return summary


def is_heldout(shard: str, index: int, every: int) -> bool:
    """Stable held-out membership of sequence ``index`` of ``shard`` (same on every machine)."""
    if every <= 0:
        return False
    import zlib

    return zlib.crc32(f"{shard}:{index}".encode()) % every == 0


def response_counts(seqs: list[dict[str, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs in the response tokens of ``seqs`` (int64 [vocab_size])."""
    ids = torch.cat([s["input_ids"][s["loss_mask"].bool()] for s in seqs])
    return torch.bincount(ids, minlength=vocab_size)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def plot_log(csv_path: Path, png_path: Path) -> None:
    """Loss and accepted-prefix curves from the CSV log (no-op if the log is empty)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(steps, [float(r["loss"]) for r in rows])
    ax[0].set_xlabel("step"), ax[0].set_ylabel("weighted CE"), ax[0].set_yscale("log")
    ax[1].plot(steps, [float(r["accept_len"]) for r in rows], label="accepted drafts / block")
    ax[1].plot(steps, [float(r["acc_k1"]) for r in rows], label="acc k=1")
    ax[1].set_xlabel("step"), ax[1].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
