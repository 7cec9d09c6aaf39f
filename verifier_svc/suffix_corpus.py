"""The suffix corpus: an operator's token shards (the target's own earlier answers) as a read-only
suffix index every tenant's lookups read after their own session and answers.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) keeps a global suffix tree over previous
outputs: what a target said before, it says again ("Here are some ...", a library's idioms). A
fresh verifier has no history; ``--suffix-corpus DIR`` gives it one, from a folder in the
training data's format (``dflash-tokens/1``, :mod:`dflash.core.token_shards`: the
``data/train`` a drafter was trained from, or answers an operator exported). Only answer tokens
(``loss_mask`` 1) are kept, each answer followed by :data:`~dflash.core.suffix.SEPARATOR`, so
no continuation runs from one into the next; prompts are not kept.

The corpus is the operator's, not a tenant's: every tenant reads it, and nothing a tenant sends
is ever added to it (a tenant's answers stay in its own :class:`~verifier_svc.suffix_drafts.
AnswerStore` entries). Do not point it at data one tenant must not see.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash.core.suffix import SEPARATOR, SuffixIndex
from dflash.core.token_shards import FORMAT, MANIFEST, DataError, read_shard

__all__ = ["load_corpus"]


def load_corpus(root: str | Path, *, max_tokens: int, fingerprint: str | None) -> SuffixIndex:
    """The answers of the shards listed in ``root/manifest.json``, in manifest order, as one
    index of at most ``max_tokens`` tokens (separators included; later answers are left out).

    Args:
        root: a ``dflash-tokens/1`` folder (``python -m dflash.train gen`` writes one).
        max_tokens: the bound (about 240 bytes of index a token, docs/suffix.md).
        fingerprint: the served target's (``TargetModel.fingerprint``); None skips the check.

    Raises:
        DataError: naming ``--suffix-corpus`` and the file, when the folder has no manifest, is
            another format or another target's (its ids would be another tokenizer's), or a
            shard is missing, modified or corrupt.
    """
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"--suffix-corpus: {path}: not a readable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"--suffix-corpus: {path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if fingerprint is not None and manifest.get("target_fingerprint") != fingerprint:
        raise DataError(f"--suffix-corpus: {path}: target_fingerprint "
                        f"{manifest.get('target_fingerprint')!r} is not the served target's "
                        f"{fingerprint!r} (another target's token ids)")
    tokens: list[int] = []
    for entry in manifest.get("shards", []):
        if len(tokens) >= max_tokens:
            break
        shard = Path(root) / entry["name"]
        if not shard.is_file():
            raise DataError(f"--suffix-corpus: {shard}: listed in the manifest but missing")
        try:
            _, seqs = read_shard(shard, fingerprint=fingerprint, sha256=entry.get("sha256"))
        except DataError as e:
            raise DataError(f"--suffix-corpus: {Path(root)}/{e}") from None
        for s in seqs:
            answer = s.ids[np.asarray(s.loss_mask) > 0].tolist()
            if len(answer) > 1:
                tokens += answer
                tokens.append(SEPARATOR)
    return SuffixIndex(tokens[:max_tokens])
