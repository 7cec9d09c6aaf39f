"""The proposer protocol: what the verifier's decode loop needs from a drafter.

``propose(requests) -> results`` carries, per session, the context features of newly committed
positions plus the anchor token, and returns a draft block. Implementations: the in-process
DFlash drafter engine (``drafter_svc.engine.DrafterEngine``), the gRPC client of a remote
drafter (``verifier_svc.drafter_client.RemoteProposer``), and test doubles (oracle,
adversarial). Domain types only; no protobuf here.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from dflash.sampling import Sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterCard:
    """What a drafter is and which target it fits (mirrors ``dflash.v1.DrafterCard``)."""

    name: str
    version: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    dtype: str
    target_fingerprint: str = ""
    num_hidden_layers: int = 0
    rope_theta: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


@dataclasses.dataclass(kw_only=True)
class ProposalRequest:
    """One session's input for one step."""

    session_id: str
    context_start: int          # absolute position of context row 0
    context: torch.Tensor       # [n, len(target_layer_ids) * H] taps of committed positions
    anchor_token: int           # the bonus token, at position context_start + n
    block_size: int             # anchor + (block_size - 1) drafts; <= 1: context update only
    sampling: Sampling
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # W3C, this request's step span


@dataclasses.dataclass(kw_only=True)
class Proposal:
    """A draft block: ``tokens`` int64 [K]; ``probs`` float32 [K, V] when sampling, else None."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class DraftError(RuntimeError):
    """A drafter failed for one session or one step. ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


class Proposer(Protocol):
    """A source of draft blocks."""

    card: DrafterCard

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        """One result per request, in order; a failure for one session is a ``DraftError``."""
        ...

    def release(self, session_ids: list[str]) -> None:
        """Forget these sessions' context."""
        ...
