"""The capture store: served conversations in the training format, bounded, crash-safe.

One file per conversation, ``<dir>/conv_<seq:08d>.safetensors`` (seq = capture order), tensors:
  ``input_ids``  int64 [n]         token ids by position; 0 where the drafter never saw the id
                                   (prompt positions: only their taps travel on the wire)
  ``loss_mask``  uint8 [n]         1 where the id is a token the target committed in an answer
  ``taps``       bfloat16 [n, kH]  the target's tap features at each position (last row zeros:
                                   the last token's taps never reach the drafter)
metadata: ``split`` ("train" | "heldout"), ``target_fingerprint``, ``target_layer_ids`` (JSON),
and for a conversation served by greedy chains only ``served_by`` / ``served_steps`` /
``served_tokens`` (:class:`Served`; ``read`` gives it as ``served``). The dicts
:meth:`CaptureStore.read` returns are what ``dflash.recipe.blocks.build_batch`` takes.

Every ``HELDOUT_EVERY``-th conversation (seq % 20 == 0) is held out: never trained on, it is the
release gate's slice. Files are written to ``.tmp`` names (mode 0600), fsynced and renamed, so a
writer killed at any instant leaves complete files plus at most a ``.tmp`` the reader ignores
(and the next writer removes); the directory is 0700. The store keeps ``max_bytes`` at most:
the oldest conversations are dropped first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from enum import StrEnum
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

HELDOUT_EVERY = 20
_NAME = re.compile(r"^conv_(\d{8})\.safetensors$")


class Split(StrEnum):
    """Which part of the captured conversations one belongs to (its file's ``split``)."""

    TRAIN = "train"
    HELDOUT = "heldout"


SPLITS = tuple(Split)


def split_of(seq: int) -> Split:
    """The split of conversation ``seq``: every ``HELDOUT_EVERY``-th is held out."""
    return Split.HELDOUT if seq % HELDOUT_EVERY == 0 else Split.TRAIN


@dataclasses.dataclass(frozen=True)
class Served:
    """How a conversation was served, recorded by the capture when every step was a greedy
    chain: drafter ``by`` (``name@version``) took ``steps`` verify steps after the first draft
    call, committing ``tokens`` tokens. A replay of that drafter on the stored conversation
    (``dflash.learn.walk``) should find the same τ; the gate checks it."""

    by: str
    steps: int
    tokens: int


class CaptureStore:
    """A bounded directory of captured conversations (see the module docstring).

    Args:
        path: the store's directory, created 0700 (an existing one is tightened to 0700).
        max_bytes: byte budget of all conversation files; must be > 0 (ValueError naming
            ``max_bytes`` otherwise). A single conversation larger than it is not kept.
        fingerprint: the target's fingerprint recorded in every file; :meth:`read` skips files
            of another target.
        layer_ids: the tap layer ids recorded in every file.
        writer: this instance writes (creates the directory, removes a killed writer's
            ``.tmp``); False for a reader beside a live writer (the learner, ``dflash learn``).
    """

    def __init__(self, path: str | Path, *, max_bytes: int = 1 << 62, fingerprint: str = "",
                 layer_ids: tuple[int, ...] = (), writer: bool = True):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
        self.path = Path(path)
        if not writer:
            self.max_bytes, self.fingerprint, self.layer_ids = max_bytes, fingerprint, tuple(layer_ids)
            self._lock, self._next = threading.Lock(), -1
            return
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.layer_ids = tuple(layer_ids)
        self._lock = threading.Lock()
        for tmp in self.path.glob("*.tmp"):      # a killed writer's leftovers
            tmp.unlink(missing_ok=True)
        seqs = [s for s, _ in self.files()]
        self._next = (max(seqs) + 1) if seqs else 0

    def files(self) -> list[tuple[int, Path]]:
        """(seq, path) of every complete conversation file, oldest first."""
        out: list[tuple[int, Path]] = []
        if not self.path.is_dir():
            return out
        for p in self.path.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for _, p in self.files())

    def new_seq(self) -> int:
        """A fresh conversation number (capture order)."""
        with self._lock:
            self._next += 1
            return self._next - 1

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, taps: torch.Tensor,
            seq: int | None = None, served: Served | None = None) -> Path | None:
        """Write one conversation (int64 [n], uint8 [n], bfloat16 [n, kH]) as number ``seq``
        (None = a new one; an existing one is replaced: a conversation that grew); returns its
        path, or None when it alone exceeds the budget. Drops the oldest files over the budget.
        ``served``: how it was served, when every step was a greedy chain (metadata
        ``served_by``, ``served_steps``, ``served_tokens``; :meth:`read` gives it back).

        Raises ValueError when the three lengths differ."""
        n = input_ids.shape[0]
        if loss_mask.shape[0] != n or taps.shape[0] != n:
            raise ValueError(f"conversation: input_ids {n}, loss_mask {loss_mask.shape[0]}, "
                             f"taps {taps.shape[0]} rows")
        if seq is None:
            seq = self.new_seq()
        with self._lock:
            meta = {"split": split_of(seq).value,
                    "target_fingerprint": self.fingerprint,
                    "target_layer_ids": json.dumps(list(self.layer_ids))}
            if served is not None:
                meta.update(served_by=served.by, served_steps=str(served.steps),
                            served_tokens=str(served.tokens))
            data = save({"input_ids": input_ids.to(torch.int64).contiguous(),
                         "loss_mask": loss_mask.to(torch.uint8).contiguous(),
                         "taps": taps.to(torch.bfloat16).contiguous()}, metadata=meta)
            if len(data) > self.max_bytes:
                return None
            path = self.path / f"conv_{seq:08d}.safetensors"
            _write_atomic(path, data)
            self._trim()
            return path

    def _trim(self) -> None:
        files = [(p, p.stat().st_size) for _, p in self.files()]
        total = sum(s for _, s in files)
        for p, size in files:
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def read(self, split: Split, cache: dict | None = None) -> list[dict[str, torch.Tensor]]:
        """Conversations of ``split``, oldest first, as
        ``{input_ids, loss_mask, taps, seq}`` dicts; files that do not parse or belong to
        another target are skipped. ``cache`` (a dict the caller keeps between calls): only
        files new or changed since the last call are read. Raises ValueError naming ``split``
        for another value."""
        if split not in SPLITS:
            raise ValueError(f"split: 'train' or 'heldout', got {split!r}")
        cache = {} if cache is None else cache
        out, seen = [], set()
        for seq, p in self.files():
            if split_of(seq) != split:
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # dropped by the writer's budget meanwhile
                continue
            key = (str(p), st.st_mtime_ns, st.st_size)
            seen.add(seq)
            if seq not in cache or cache[seq][0] != key:
                cache[seq] = (key, self._load(seq, p))
            if cache[seq][1] is not None:
                out.append(cache[seq][1])
        for gone in set(cache) - seen:
            del cache[gone]
        return out

    def _load(self, seq: int, path: Path) -> dict[str, torch.Tensor] | None:
        meta = _metadata(path)
        if meta is None or (self.fingerprint and meta.get("target_fingerprint") != self.fingerprint):
            return None
        try:
            d = load_file(str(path))
        except Exception:             # noqa: BLE001 -- removed or torn under us: skip it
            return None
        d["seq"] = torch.tensor(seq)
        if "served_by" in meta:
            try:
                d["served"] = Served(meta["served_by"], int(meta["served_steps"]), int(meta["served_tokens"]))
            except (KeyError, ValueError):
                pass
        return d

    def counts(self) -> dict[str, int]:
        """Conversations per split and the bytes kept (for ``dflash learn status``)."""
        files = self.files()
        held = sum(seq % HELDOUT_EVERY == 0 for seq, _ in files)
        size = 0
        for _, p in files:
            try:
                size += p.stat().st_size
            except FileNotFoundError:
                pass
        return {Split.TRAIN.value: len(files) - held, Split.HELDOUT.value: held, "bytes": size}


def _metadata(path: Path) -> dict | None:
    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception:                 # noqa: BLE001 -- not a complete safetensors file
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` via ``path.tmp`` (0600, fsynced, renamed, directory fsynced)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
