"""The DFlash drafter engine: per-session context K/V and one-pass block drafting.

Pure torch; never imports generated protobuf. Per session it keeps each layer's context K/V for
positions ``[0, cached)`` (z-lab's draft cache after its crop, i.e. context only), receives only
the newly committed positions' taps each step, and drafts ``[anchor, MASK x (B-1)]`` at
positions ``cached .. cached + B - 1`` (z-lab/dflash ``dflash_generate`` step 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path

import torch

from dflash.checkpoint import load_drafter, load_target_head, target_fingerprint, torch_dtype
from dflash.modeling import DFlashDrafter, LayerKV, TargetHead
from dflash.proposer import DraftError, DrafterCard, Proposal, ProposalRequest
from dflash.sampling import probs_from_logits, sample_from


@dataclasses.dataclass
class _SessionCtx:
    kv: list[LayerKV]                 # per layer ([1, kvh, n, d], [1, kvh, n, d])
    length: int                       # cached context positions
    generator: torch.Generator | None = None
    last_used: float = dataclasses.field(default_factory=time.monotonic)


class DrafterEngine:
    """Holds a drafter plus the target's embedding/LM head; implements ``Proposer``.

    Args:
        drafter: the network (``dflash.modeling.DFlashDrafter``), eval mode.
        head: the target's frozen embedding and LM head.
        max_sessions: LRU bound on kept session contexts.
    """

    def __init__(self, drafter: DFlashDrafter, head: TargetHead, *, max_sessions: int = 256):
        self.drafter = drafter
        self.head = head
        self.cfg = drafter.cfg
        if head.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"vocab_size: drafter has {self.cfg.vocab_size}, target head has "
                             f"{head.vocab_size} rows")
        self.max_sessions = max_sessions
        self._sessions: dict[str, _SessionCtx] = {}
        self._lock = threading.Lock()
        fp = self.cfg.target_fingerprint
        self.card = DrafterCard(
            name=self.cfg.name, version=self.cfg.version, block_size=self.cfg.block_size,
            mask_token_id=self.cfg.mask_token_id, target_layer_ids=tuple(self.cfg.target_layer_ids),
            hidden_size=self.cfg.hidden_size, vocab_size=self.cfg.vocab_size,
            dtype=str(next(drafter.parameters()).dtype).replace("torch.", ""),
            target_fingerprint=fp, num_hidden_layers=self.cfg.num_hidden_layers,
            rope_theta=self.cfg.rope_theta)

    @classmethod
    def from_pretrained(cls, drafter_dir: str | Path, target_dir: str | Path, *,
                        dtype: str = "float32", name: str | None = None,
                        version: str | None = None) -> "DrafterEngine":
        """Load a z-lab checkpoint and the target's embedding/LM head (safetensors only)."""
        td = torch_dtype(dtype)
        drafter = load_drafter(drafter_dir, dtype=td)
        if name or version:
            drafter.cfg = dataclasses.replace(drafter.cfg, name=name or drafter.cfg.name,
                                              version=version or drafter.cfg.version)
        head = load_target_head(target_dir, dtype=td)
        if not drafter.cfg.target_fingerprint:
            tcfg = json.loads((Path(target_dir) / "config.json").read_text())
            drafter.cfg = dataclasses.replace(drafter.cfg,
                                              target_fingerprint=target_fingerprint(tcfg, head.embed))
        return cls(drafter, head)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Context positions held for all sessions (a metrics gauge)."""
        return sum(s.length for s in list(self._sessions.values()))

    def warmup(self) -> None:
        """One tiny draft so first requests don't pay lazy initialisation."""
        from dflash.sampling import Sampling

        req = ProposalRequest(session_id="__warmup__", context_start=0,
                              context=torch.zeros(2, self.cfg.context_size),
                              anchor_token=0, block_size=self.cfg.block_size, sampling=Sampling())
        self.propose([req])
        self.release(["__warmup__"])

    # ------------------------------------------------------------------ Proposer
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        out: list[Proposal | DraftError] = []
        with self._lock, torch.inference_mode():
            for r in requests:
                try:
                    out.append(self._one(r))
                except DraftError as e:
                    out.append(e)
        return out

    def release(self, session_ids: list[str]) -> None:
        with self._lock:
            for s in session_ids:
                self._sessions.pop(s, None)

    # ------------------------------------------------------------------ internals
    def _one(self, r: ProposalRequest) -> Proposal:
        cfg = self.cfg
        ctx = r.context
        if ctx.dim() != 2 or ctx.shape[1] != cfg.context_size:
            raise DraftError("bad_request", f"context: expected [n, {cfg.context_size}], "
                             f"got {list(ctx.shape)}")
        if not 0 <= r.anchor_token < cfg.vocab_size:
            raise DraftError("bad_request", f"anchor_token: {r.anchor_token} outside vocabulary")
        if r.block_size > cfg.max_position_embeddings:
            raise DraftError("bad_request", "block_size too large")
        sess = self._sessions.get(r.session_id)
        have = sess.length if sess else 0
        if r.context_start > have:
            raise DraftError("context_gap", f"have {have} positions, got context_start {r.context_start}")
        if sess is None or r.context_start == 0:
            sess = _SessionCtx(kv=[], length=0)
            self._sessions[r.session_id] = sess
            self._evict()
        elif r.context_start < have:
            sess.kv = [(k[:, :, :r.context_start], v[:, :, :r.context_start]) for k, v in sess.kv]
            sess.length = r.context_start
        sess.last_used = time.monotonic()
        dtype = self.head.embed.dtype
        n = ctx.shape[0]
        if n:
            pos = torch.arange(sess.length, sess.length + n)[None]
            new_kv = self.drafter.context_kv(ctx.to(dtype)[None], pos)
            sess.kv = new_kv if not sess.kv else [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(sess.kv, new_kv)]
            sess.length += n
        if r.block_size <= 1:
            return Proposal(tokens=torch.empty(0, dtype=torch.int64))
        if not sess.kv:
            raise DraftError("no_context", "the drafter has no context for this session")
        bs = r.block_size
        block = torch.full((1, bs), cfg.mask_token_id, dtype=torch.int64)
        block[0, 0] = r.anchor_token
        positions = torch.arange(sess.length, sess.length + bs)[None]
        hidden = self.drafter(self.head.embed_tokens(block), positions, sess.kv)
        logits = self.head.logits(hidden[0, 1:])                      # [bs-1, V]
        if r.sampling.greedy:
            return Proposal(tokens=logits.argmax(-1))
        if r.sampling.seed is not None:
            gen = _draft_generator(r.sampling.seed, sess.length)
        else:
            if sess.generator is None:
                sess.generator = r.sampling.generator()
            gen = sess.generator
        probs = probs_from_logits(logits, r.sampling)
        return Proposal(tokens=sample_from(probs, gen), probs=probs)

    def _evict(self) -> None:
        while len(self._sessions) > self.max_sessions:
            oldest = min(self._sessions, key=lambda s: self._sessions[s].last_used)
            del self._sessions[oldest]


def _draft_generator(seed: int, anchor_position: int) -> torch.Generator:
    """The drafts' random stream for a seeded request: keyed by (seed, anchor position).

    Never ``Sampling.generator()``, which the verifier uses: seeded alike, the drafts reused the
    very noise the verifier samples with, so they did not follow q (a seeded request repeated its
    first token about half the time: sampling was not lossless). Keyed by position rather than
    kept per session, so the same seed reproduces the same drafts on any turn of a session.
    """
    h = hashlib.blake2b(f"dflash-draft/{seed}/{anchor_position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") >> 1)
