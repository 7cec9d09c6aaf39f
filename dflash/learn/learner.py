"""The online learner: trains a copy of the serving drafter on the captured conversations.

The recipe is the trainer's (``dflash.train.trainer``): random anchors per conversation each
step, blocks ``[anchor, MASK x (B-1)]``, loss weighted ``exp(-(k-1)/gamma)``, the target's head
frozen, AdamW, warmup then cosine decay; warm start from the serving version. Checkpoints
(``dflash.recipe.ckpt``: safetensors + JSON, no pickle) go to ``<learn_dir>/run`` every
``ckpt_every`` steps, so a killed learner resumes; a checkpoint of another base version is not
resumed. Training runs in :meth:`Learner.run` one optimizer step at a time and stops between
steps as soon as ``should_stop()`` says so (a draft request arrived): serving keeps priority.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.core.checkpoint import load_drafter, load_target_head, save_drafter
from dflash.core.draft_vocab import load_draft_vocab
from dflash.learn.gate import METRICS, REPLAY_TOLERANCE, GateMetric, GateResult, gate, replay_check, score
from dflash.learn.store import CaptureStore, Split
from dflash.recipe import ckpt
from dflash.recipe.blocks import build_batch, sample_anchors, valid_anchors
from dflash.recipe.loss import batch_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnConfig:
    """The learner's recipe: the trainer's (``docs/training.md``) with a higher learning rate
    and a steeper position decay, chosen by the τ a release serves
    (docs/bench/learning-history/README.md, "A second domain", has the comparison)."""

    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    max_steps: int = 400            # the schedule's length for one candidate
    seqs_per_step: int = 4
    anchors_per_seq: int = 12
    gamma: float = 3.0              # position decay exp(-(k-1)/gamma): a served step's first drafts
    grad_clip: float = 1.0
    logit_chunk: int = 1024
    ckpt_every: int = 25            # optimizer steps between checkpoints
    eval_every: int = 50            # optimizer steps between held-out points of the curve
    margin: float = 0.02            # the least relative τ gain the gate releases (lower bound > 0 too)
    gate_metric: GateMetric = GateMetric.SERVED   # the gate's measure: the replayed chain or teacher-forced
    vocab_subset: bool = True       # softmax over the ids seen in the captured answers ...
    full_vocab_after: float = 0.8   # ... until this fraction of max_steps, then the full one
    seed: int = 0

    def __post_init__(self):
        if self.gate_metric not in METRICS:
            raise ValueError(f"gate_metric: {self.gate_metric!r} is not one of {', '.join(METRICS)}")


class Learner:
    """Args:
        learn_dir: the capture directory (``<learn_dir>/store``); ``run/``, ``status.json`` and
            ``heldout_curve.csv`` are written there.
        serving_dir: the serving version's drafter directory (z-lab layout): warm start and the
            gate's reference.
        target_dir: the target (its embedding and LM head only).
        device: where the drafters and each batch live.
    Raises ``FileNotFoundError`` for a missing drafter or target directory."""

    def __init__(self, learn_dir: str | Path, serving_dir: str | Path, target_dir: str | Path, *,
                 cfg: LearnConfig = LearnConfig(), device: str = "cpu"):
        self.dir, self.cfg = Path(learn_dir), cfg
        self.serving_dir = Path(serving_dir)
        self.device = torch.device(device)
        self.head = load_target_head(target_dir).to(self.device)
        self.serving = load_drafter(serving_dir, dtype=torch.float32).to(self.device).eval()
        self.drafter = load_drafter(serving_dir, dtype=torch.float32).to(self.device)
        self.base = self.serving.cfg.name + "@" + self.serving.cfg.version
        # the gate's served replay drafts over what serving drafts over
        self.vocab = load_draft_vocab(serving_dir, self.serving.cfg.vocab_size)
        self.store = CaptureStore(self.dir / "store", writer=False,
                                  fingerprint=self.serving.cfg.target_fingerprint)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.rng = random.Random(cfg.seed)
        self.step, self.seconds, self.loss = 0, 0.0, float("nan")
        self.curve: list[dict] = []
        self.train_convs: list[dict[str, torch.Tensor]] = []
        self._cache: dict[Split, dict] = {Split.TRAIN: {}, Split.HELDOUT: {}}   # files read, by split
        self._softmax: tuple[torch.Tensor, torch.Tensor] | None = None
        self.run_dir = self.dir / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    # ------------------------------------------------------------------ data
    def reload(self) -> int:
        """Re-read the training split (conversations written meanwhile); returns its size."""
        self.train_convs = [c for c in self.store.read(Split.TRAIN, self._cache[Split.TRAIN])
                            if len(valid_anchors(c["loss_mask"]))]
        self._softmax = None
        if self.cfg.vocab_subset and self.train_convs:
            # every id a label can be (the trainer's subset: ids seen in the data)
            vocab = torch.unique(torch.cat([c["input_ids"] for c in self.train_convs])).to(self.device)
            label_map = torch.full((self.head.vocab_size,), -1, dtype=torch.int64, device=self.device)
            label_map[vocab] = torch.arange(len(vocab), device=self.device)
            self._softmax = (self.head.lm_head[vocab].contiguous(), label_map)
        return len(self.train_convs)

    def softmax_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LM head rows, id -> row map) of this step's training softmax (the trainer's
        ``softmax_head``: the seen ids first, the full vocabulary from ``full_vocab_after``)."""
        late = self.step >= self.cfg.full_vocab_after * self.cfg.max_steps
        if self._softmax is None or late:
            return self.head.lm_head, None
        return self._softmax

    def heldout(self) -> list[dict[str, torch.Tensor]]:
        return self.store.read(Split.HELDOUT, self._cache[Split.HELDOUT])

    # ------------------------------------------------------------------ training
    def lr_now(self) -> float:
        c = self.cfg
        if self.step < c.warmup_steps:
            return c.lr * max((self.step + 1) / c.warmup_steps, 0.02)
        p = min(1.0, (self.step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps))
        return c.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))

    def train_step(self) -> float:
        """One optimizer step on ``seqs_per_step`` random captured conversations; its loss.
        Raises RuntimeError when the store has no trainable conversation."""
        if not self.train_convs and not self.reload():
            raise RuntimeError(f"learn: no trainable conversations in {self.store.path}")
        t0 = time.perf_counter()
        self.drafter.train()
        picked = [self.rng.choice(self.train_convs) for _ in range(self.cfg.seqs_per_step)]
        anchors = [sample_anchors(c["loss_mask"], self.cfg.anchors_per_seq, self.rng) for c in picked]
        cfg = self.drafter.cfg
        batch = build_batch(picked, anchors, block_size=cfg.block_size,
                            mask_token_id=cfg.mask_token_id, gamma=self.cfg.gamma).to(self.device)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_now()
        head_w, label_map = self.softmax_head()
        loss, _ = batch_loss(self.drafter, self.head, batch, head_w, label_map, self.cfg.logit_chunk)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.seconds += time.perf_counter() - t0
        self.loss = float(loss.detach())
        return self.loss

    def run(self, steps: int, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Up to ``steps`` optimizer steps (never past ``max_steps``), checking ``should_stop``
        before each; checkpoints and the held-out curve on their cadence. Returns steps done."""
        done = 0
        self.reload()
        while done < steps and self.step < self.cfg.max_steps and not should_stop():
            self.train_step()
            done += 1
            if self.step % self.cfg.ckpt_every == 0:
                self.save_checkpoint()
            if self.step % self.cfg.eval_every == 0:
                self.log_heldout()
        if done:
            self.save_checkpoint()
        return done

    # ------------------------------------------------------------------ held-out and gate
    def log_heldout(self) -> dict:
        """The candidate's held-out τ now, teacher-forced (the cheap measure: a point every
        ``eval_every`` steps), appended to the curve (``heldout_curve.csv``)."""
        sc = score(self.drafter, self.head, self.heldout(), metric=GateMetric.TEACHER_FORCED, gamma=self.cfg.gamma)
        blocks = sum(s.blocks for s in sc)
        point = {"step": self.step, "seconds": round(self.seconds, 1), "conversations": len(sc),
                 "tau": round(1 + sum(s.accepted for s in sc) / max(1, blocks), 4),
                 "loss": round(self.loss, 4) if self.loss == self.loss else None}
        self.curve.append(point)
        path = self.dir / "heldout_curve.csv"
        new = not path.exists()
        with open(path, "a") as f:
            if new:
                f.write("step,seconds,conversations,tau,loss\n")
            f.write(",".join(str(point[k]) for k in ("step", "seconds", "conversations", "tau", "loss")) + "\n")
        self.write_status()
        return point

    def evaluate(self) -> GateResult:
        """The gate on the held-out split: the candidate against the serving version, by
        ``gate_metric``; refused whatever the gain when the store does not replay what the
        serving version served there (:func:`dflash.learn.gate.replay_check`)."""
        held = self.heldout()
        kw = {"metric": self.cfg.gate_metric, "vocab": self.vocab, "gamma": self.cfg.gamma}
        serving = score(self.serving, self.head, held, **kw)
        cand = score(self.drafter, self.head, held, **kw)
        res = gate(serving, cand, margin=self.cfg.margin, metric=self.cfg.gate_metric)
        walks = serving if self.cfg.gate_metric == GateMetric.SERVED else score(
            self.serving, self.head, [c for c in held if "served" in c], vocab=self.vocab)
        check = replay_check(held, walks, self.base)
        if check is None:
            return res
        ratio, n = check
        res = dataclasses.replace(res, replay=round(ratio, 4), replay_conversations=n)
        if ratio < REPLAY_TOLERANCE:
            return dataclasses.replace(res, release=False, reason=(
                f"the store does not replay what was served: {self.base} replays "
                f"{ratio:.0%} of the τ it served on {n} held-out conversations (labels do not "
                f"follow the taps); {res.reason}"))
        return res

    def save_candidate(self, out_dir: str | Path, version: str) -> Path:
        """The candidate as a drafter directory (bf16, the serving version's draft vocabulary)."""
        out = Path(out_dir)
        cfg = dataclasses.replace(self.drafter.cfg, version=version)
        save_drafter(self.drafter, out, dtype=torch.bfloat16, cfg=cfg)
        vocab = self.serving_dir / "draft_vocab.safetensors"
        if vocab.is_file():
            (out / vocab.name).write_bytes(vocab.read_bytes())
        return out

    # ------------------------------------------------------------------ state
    def status(self) -> dict:
        return {"base": self.base, "step": self.step, "max_steps": self.cfg.max_steps,
                "train_seconds": round(self.seconds, 1), "loss": self.loss if self.loss == self.loss else None,
                "store": self.store.counts(), "heldout_curve": self.curve[-20:]}

    def write_status(self) -> None:
        tmp = self.dir / "status.json.tmp"
        tmp.write_text(json.dumps(self.status(), indent=1) + "\n")
        os.replace(tmp, self.dir / "status.json")

    def save_checkpoint(self) -> None:
        ckpt.save(self.run_dir, drafter=self.drafter.state_dict(), opt=self.opt.state_dict(),
                  tensors={"torch_rng": torch.get_rng_state()},
                  meta={"step": self.step, "seconds": self.seconds, "base": self.base,
                        "py_rng": self.rng.getstate(), "curve": self.curve,
                        "config": dataclasses.asdict(self.cfg)})
        self.write_status()

    def _resume(self) -> None:
        got = ckpt.load(self.run_dir)
        if got is None:
            return
        meta, weights, opt, extra = got
        if meta.get("base") != self.base:       # a candidate of another version: start afresh
            return
        self.drafter.load_state_dict(weights)
        self.opt.load_state_dict(opt)
        self.step, self.seconds, self.curve = meta["step"], meta["seconds"], meta.get("curve", [])
        self.rng.setstate(_tuplify(meta["py_rng"]))
        torch.set_rng_state(extra["torch_rng"])

    def reset(self) -> None:
        """Start the candidate afresh from the serving version (after a release): its
        checkpoint is dropped, its weights, optimizer, step and curve reset."""
        for name in (ckpt.TENSORS, ckpt.META):
            (self.run_dir / name).unlink(missing_ok=True)
        self.drafter.load_state_dict(self.serving.state_dict())
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=self.cfg.lr,
                                     weight_decay=self.cfg.weight_decay, betas=(0.9, 0.95))
        self.step, self.seconds, self.loss, self.curve = 0, 0.0, float("nan"), []


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
