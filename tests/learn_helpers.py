"""Constructed capture stores for the online-learning tests (not a test module).

Conversations: a random prompt, then an answer cycling through five letters from a random
start ("cdeab..."), learnable from the anchor alone; taps are the tiny target's own. A
poisoned store shuffles each answer's ids (same tokens, no pattern left).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from dflash.learn.store import HELDOUT_EVERY, CaptureStore

LETTERS = [97, 98, 99, 100, 101]


def conversations(n: int, seed: int, answer_len: int = 28) -> list[tuple[list[int], int]]:
    """``n`` (prompt + answer ids, prompt length) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(30, 90) for _ in range(rng.randrange(4, 9))]
        start = rng.randrange(5)
        answer = [LETTERS[(start + j) % 5] for j in range(answer_len)]
        out.append((prompt + answer, len(prompt)))
    return out


def fill_store(path: Path, target_dir: Path, layer_ids, n: int, *, seed: int = 0,
               poisoned: bool = False, fingerprint: str = "", served_by: Path | None = None) -> CaptureStore:
    """A store of ``n`` conversations (every 20th held out) with the target's taps.
    ``served_by`` (a drafter directory): each conversation carries the record a capture
    would have written had that drafter served it (its chain walk over the clean answer),
    then is poisoned if asked: a store corrupted after it was served."""
    from dflash.train.data import load_target
    from dflash.train.featcache import as_numpy_seq, compute_features

    model = load_target(str(target_dir))[0]
    convs = conversations(n, seed)
    seqs = [as_numpy_seq(ids, p) for ids, p in convs]
    feats = compute_features(model, seqs, list(layer_ids), 4)
    store = CaptureStore(path, max_bytes=1 << 30, fingerprint=fingerprint)
    rng = random.Random(seed + 1)
    if served_by is not None:
        from dflash.core.checkpoint import load_drafter, load_target_head
        from dflash.learn.store import Served
        from dflash.learn.walk import chain_walk

        drafter, head = load_drafter(served_by, dtype=torch.float32), load_target_head(target_dir)
        label = f"{drafter.cfg.name}@{drafter.cfg.version}"
    for (ids, p), f in zip(convs, feats):
        ids = list(ids)
        served = None
        if served_by is not None:
            clean = {"input_ids": torch.tensor(ids), "taps": f["taps"],
                     "loss_mask": (torch.arange(len(ids)) >= p).to(torch.uint8)}
            (w,) = chain_walk(drafter, head, [clean])
            served = Served(label, w.steps, w.tokens)
        if poisoned:
            answer = ids[p:]
            rng.shuffle(answer)
            ids[p:] = answer
        t = torch.tensor(ids)
        mask = (torch.arange(len(ids)) >= p).to(torch.uint8)
        store.add(t, mask, f["taps"], served=served)
    return store


def heldout_count(n: int) -> int:
    return len(range(0, n, HELDOUT_EVERY))
