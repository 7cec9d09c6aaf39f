"""Token shards (``dflash-tokens/1``): the reading side, shared by the trainer and the verifier's
suffix corpus (``verifier_svc/suffix_corpus.py``). The format, and the writer, are in
:mod:`dflash.train.tokdata`.

Read with ``numpy.load(allow_pickle=False)``: a shard is arrays only, nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "dflash-tokens/1"
MANIFEST = "manifest.json"


class DataError(ValueError):
    """A shard or manifest that cannot be used (truncated, foreign, or inconsistent)."""


@dataclass
class TokenSeq:
    """One training sequence: ids ``[n]`` (prompt + response) and loss mask ``[n]`` (0/1)."""

    ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def response_tokens(self) -> int:
        return int(self.loss_mask.sum())


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_shard(path: Path, *, fingerprint: str | None = None, sha256: str | None = None
               ) -> tuple[dict, list[TokenSeq]]:
    """``(header, sequences)`` of one shard.

    Raises ``DataError`` naming the shard when it is truncated or corrupt (sha256 differs from
    the manifest's, or the archive does not parse), foreign (another format or target
    fingerprint), or inconsistent (offsets do not cover the ids)."""
    if sha256 is not None and file_sha256(path) != sha256:
        raise DataError(f"{path.name}: sha256 differs from the manifest (truncated or modified)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("ids", "loss_mask", "offsets", "header")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path.name}: not a readable token shard ({e})") from None
    try:
        header = json.loads(arrays["header"].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{path.name}: header is not JSON") from None
    if header.get("format") != FORMAT:
        raise DataError(f"{path.name}: format {header.get('format')!r}, expected {FORMAT!r}")
    if fingerprint is not None and header.get("target_fingerprint") != fingerprint:
        raise DataError(f"{path.name}: target_fingerprint {header.get('target_fingerprint')!r} "
                        f"is not this target's {fingerprint!r} (data of another target)")
    ids, mask, off = arrays["ids"].astype(np.int64), arrays["loss_mask"], arrays["offsets"]
    if (len(ids) != len(mask) or len(off) < 2 or off[0] != 0 or off[-1] != len(ids)
            or np.any(np.diff(off) <= 0) or len(off) - 1 != header.get("sequences")):
        raise DataError(f"{path.name}: offsets do not match the ids (corrupt shard)")
    return header, [TokenSeq(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
