"""Training data as token ids, kept in the repository: shards plus a manifest.

What survives a machine is what the target *said*, not what it computed: features (taps, the
target's top-k distribution) are a deterministic function of the ids and the target, and are
recomputed by one forward into a local cache (:mod:`dflash.train.featcache`).

Shard ``<dir>/shard_<source>_<index>.npz`` (``numpy.savez_compressed``; read with
``allow_pickle=False``), T = tokens of the shard, S = sequences:
  ``ids``        uint16 [T] (int32 when the vocabulary exceeds 65535) prompt + response ids
  ``loss_mask``  uint8 [T]  1 on response tokens (including the final ``<|im_end|>``)
  ``offsets``    int64 [S+1] sequence s is ``[offsets[s], offsets[s+1])``
  ``header``     uint8 [n]  UTF-8 JSON: format, target fingerprint, source, seed, counts
``<dir>/manifest.json`` lists every shard with its sha256 and counts, the target fingerprint,
the generation settings and the prompt mix; a shard is written first, the manifest after, both
atomically, so an interrupted writer leaves at most an unlisted shard (rewritten on resume).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from dflash.core.token_shards import FORMAT, MANIFEST, DataError, TokenSeq, file_sha256, read_shard

__all__ = ["FORMAT", "MANIFEST", "DataError", "TokenSeq", "TokenStore", "read_shard", "write_shard"]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_shard(path: Path, seqs: list[TokenSeq], header: dict, vocab_size: int) -> dict:
    """Write one shard atomically; returns its manifest entry (name, sha256, counts).

    ``header`` must hold ``target_fingerprint`` and ``source``. Raises ``DataError`` for an
    empty shard or an id outside ``[0, vocab_size)``."""
    if not seqs:
        raise DataError(f"{path.name}: no sequences")
    ids = np.concatenate([s.ids for s in seqs]).astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise DataError(f"{path.name}: token id outside [0, {vocab_size})")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    lens = np.array([0] + [len(s.ids) for s in seqs], dtype=np.int64)
    head = dict(header, format=FORMAT, sequences=len(seqs), tokens=int(ids.size),
                response_tokens=int(sum(s.response_tokens for s in seqs)))
    buf = io.BytesIO()
    np.savez_compressed(buf, ids=ids.astype(dtype),
                        loss_mask=np.concatenate([s.loss_mask for s in seqs]).astype(np.uint8),
                        offsets=np.cumsum(lens), header=np.frombuffer(json.dumps(head).encode(), np.uint8))
    _atomic_write(path, buf.getvalue())
    return {"name": path.name, "sha256": file_sha256(path), "source": head["source"],
            "sequences": head["sequences"], "tokens": head["tokens"],
            "response_tokens": head["response_tokens"]}


class TokenStore:
    """A data folder of token shards and its manifest (``<dir>/manifest.json``).

    The manifest holds ``format``, ``target_fingerprint``, ``generation`` (dtype, greedy,
    ``max_new_tokens``, batch size), ``sources`` (per prompt source: description, seed, count)
    and ``shards`` (list of :func:`write_shard` entries with ``batch`` indices).
    """

    def __init__(self, root: str | Path, fingerprint: str | None = None):
        self.root = Path(root)
        self.path = self.root / MANIFEST
        if self.path.is_file():
            self.manifest = json.loads(self.path.read_text())
            if self.manifest.get("format") != FORMAT:
                raise DataError(f"{self.path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
            got = self.manifest.get("target_fingerprint")
            if fingerprint is not None and got != fingerprint:
                raise DataError(f"{self.path}: target_fingerprint {got!r} is not this target's "
                                f"{fingerprint!r} (data of another target)")
        else:
            self.manifest = {"format": FORMAT, "target_fingerprint": fingerprint,
                             "generation": {}, "sources": {}, "shards": []}

    @property
    def fingerprint(self) -> str | None:
        return self.manifest.get("target_fingerprint")

    def names(self) -> set[str]:
        return {s["name"] for s in self.manifest["shards"]}

    def add(self, name: str, seqs: list[TokenSeq], *, source: str, vocab_size: int, **extra) -> dict:
        """Write shard ``name`` and list it in the manifest (saved at once)."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = write_shard(self.root / name, seqs, dict(extra, source=source,
                            target_fingerprint=self.fingerprint), vocab_size)
        entry.update(extra)
        self.manifest["shards"] = [s for s in self.manifest["shards"] if s["name"] != name] + [entry]
        self.save()
        return entry

    def save(self) -> None:
        totals: dict[str, dict[str, int]] = {}
        for s in self.manifest["shards"]:
            t = totals.setdefault(s["source"], {"sequences": 0, "response_tokens": 0})
            t["sequences"] += s["sequences"]
            t["response_tokens"] += s["response_tokens"]
        self.manifest["totals"] = totals
        _atomic_write(self.path, (json.dumps(self.manifest, indent=1) + "\n").encode())

    def shards(self, sources: set[str] | None = None) -> list[dict]:
        return [s for s in self.manifest["shards"] if sources is None or s["source"] in sources]

    def read(self, entry: dict) -> list[TokenSeq]:
        """The sequences of one listed shard, checked against the manifest (``DataError``)."""
        path = self.root / entry["name"]
        if not path.is_file():
            raise DataError(f"{entry['name']}: listed in {self.path} but missing")
        return read_shard(path, fingerprint=self.fingerprint, sha256=entry["sha256"])[1]
