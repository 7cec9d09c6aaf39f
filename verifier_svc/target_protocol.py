"""What the engine needs of a target: the ``Target`` protocol, every capability declared (the
engine never probes for one)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from dflash.core.cards import TargetCard
from verifier_svc.sessions import CacheHandle


class Target(TargetCard, Protocol):
    """What the engine needs of a target (``verifier_svc.target.TargetModel``, the expert-
    parallel ``verifier_svc.ep.DistributedTarget``, test doubles); its card fields are checked
    against each drafter's (``dflash.core.cards``)."""

    vocab_size: int
    max_positions: int
    eos_token_ids: frozenset[int]
    failure: str | None                 # why the target can no longer run (expert parallel)
    path: Path                          # the checkpoint directory (Describe)
    dtype: torch.dtype
    device: torch.device                # where its logits are (sampling noise is drawn there)
    lock: AbstractContextManager        # serialises forwards and cache changes
    supports_trees: bool                # forward_batch takes ``parents``; ``keep`` compacts
    supports_fork: bool                 # ``fork`` copies a prompt prefix (shared prefill)

    def new_cache(self) -> CacheHandle: ...

    def forward(self, tokens: list[int], cache: CacheHandle, layer_ids: tuple[int, ...] | None,
                logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def forward_batch(self, blocks: list[list[int]], caches: list[CacheHandle],
                      layer_ids: list[tuple[int, ...]], parents: list[list[int] | None] | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]: ...

    def keep(self, cache: CacheHandle, start: int, offsets: list[int]) -> None: ...

    def crop(self, cache: CacheHandle, length: int) -> None: ...

    def fork(self, src: CacheHandle, dst: CacheHandle, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` positions (only with ``supports_fork``)."""

    def own(self, cache: CacheHandle) -> None: ...
