"""The DFlash drafter engine: per-session context K/V and one-pass block drafting.

Pure torch; never imports generated protobuf. Per session it keeps each layer's context K/V for
positions ``[0, cached)`` (z-lab's draft cache after its crop, i.e. context only) on one row of
a batch KV pool (``dflash.core.kv_pool``), receives only the newly committed positions' taps each
step, and drafts ``[anchor, MASK x (B-1)]`` at positions ``cached .. cached + B - 1``
(z-lab/dflash ``dflash_generate`` step 2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

import kernels.skinny_linear as sl
from dflash.core.checkpoint import load_drafter, load_target_head, target_fingerprint
from dflash.core.config import DrafterConfig
from dflash.core.device import checkpoint_dtype, resolve_device, resolve_dtype
from dflash.core.draft_vocab import load_draft_vocab
from dflash.core.kv_pool import KVPool, PoolSeq
from dflash.core.modeling import DFlashAttention, DFlashDrafter, TargetHead
from dflash.core.proposer import (
    MAX_PREFIX_KEY,
    DrafterCard,
    DraftError,
    FallbackReason,
    Proposal,
    ProposalRequest,
    check_top_k,
)
from dflash.serving.threads import claim
from drafter_svc.drafts import choose_drafts, context_thread_init, to_host, top_k_in_target_ids
from drafter_svc.engine_gauges import DrafterGauges
from drafter_svc.forward import append_context, draft_blocks
from drafter_svc.prefixes import PrefixStore
from drafter_svc.warmup import warmup
from kernels.skinny_linear import AUTO, DEFAULT_MAX_ROWS, switch_linear

if TYPE_CHECKING:
    from dflash.learn.capture import Capture

log = logging.getLogger("dflash.drafter")
T = TypeVar("T")
CONTEXT_SCHED = ("idle", "normal")


@dataclasses.dataclass(eq=False)
class _SessionCtx:
    """One session's context K/V: positions ``[0, length)`` of its pool row (``seq``), written
    in place as they arrive; a crop only sets the length. Dropping the session frees the row."""

    seq: PoolSeq
    generator: torch.Generator | None = None
    last_used: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        """Cached context positions."""
        return self.seq.get_seq_length()


class DrafterEngine(DrafterGauges):
    """Holds a drafter plus the target's embedding/LM head; implements ``Proposer``.

    Args:
        drafter: the network (``dflash.core.modeling.DFlashDrafter``), eval mode, on the device it
            runs on; the head, the draft vocabulary and the context K/V pool follow it there.
            Requests' context rows arrive on the host (the wire) and are copied there once per
            call; proposals return on the host, all of a call's in one synchronisation.
        head: the target's frozen embedding and LM head.
        max_sessions: LRU bound on kept session contexts.
        draft_vocab: int64 [N] target ids the drafter may propose (``dflash.core.draft_vocab``);
            None = the full vocabulary. Its LM head is then ``N x H`` instead of ``V x H``.
        skinny_max_rows: linear layers and the LM head with 2..N rows use the transposed
            product (``kernels.skinny_linear``); 0 = plain ``F.linear``.
        packed_linear: "on": linear layers and the LM head take oneDNN products on prepacked
            weights (``kernels.packed_linear``; CPU only); "auto": measured at :meth:`warmup`;
            "off" (default) never. Raises ValueError for other values.
        panel_linear: the same for the float32 panel product on AVX-512 CPUs
            (``kernels.panel_linear``; a bfloat16 drafter never takes it).
        threads: torch threads of the engine's compute thread, which runs every draft (calls
            come from any gRPC thread); it then is the process's only multi-threaded torch
            thread (``dflash.serving.threads.claim``). 0 = leave torch's threads alone.
        context_threads: torch threads of a second thread that runs every call whose items all
            only carry context (block size 1, no draft): the verifier does not wait for those
            (its context updates on steps without speculation), so they run beside its forward
            on shared cores. One thread by default: two OpenMP threads busy-waiting at every
            barrier take both cores of a small machine from the verifier
            (``docs/bench/perf-history/README.md``, "drafter_svc/engine.py"). 0 = no second
            thread: such calls run on the compute thread. Raises ValueError below 0.
        context_sched: the context thread's Linux scheduling policy. "idle" (``SCHED_IDLE``):
            it runs only on a core nothing else wants, i.e. in the verifier's gaps (between
            steps, while it waits for a draft), so context updates do not lengthen the
            verifier's steps without speculation. "normal" = the process's policy. Where the
            policy cannot be set (not Linux) the thread keeps the process's, with a warning.
            Raises ValueError for other values.
        capture: records what each call carries for the online learner
            (``dflash.learn.capture.Capture``; it only reads requests and drafts); None = off.
        batch_invariant: layers, LM head and attention take :mod:`kernels.invariant` (drafts
            independent of the batch and of how the context arrived).
        prefix_mb: MiB of finished sessions' context K/V kept as prefixes later sessions start
            from (``drafter_svc.prefixes``); 0 = none. Raises ValueError below 0.
    """

    def __init__(self, drafter: DFlashDrafter, head: TargetHead, *, max_sessions: int = 256,
                 draft_vocab: torch.Tensor | None = None, skinny_max_rows: int = DEFAULT_MAX_ROWS,
                 packed_linear: str = "off", threads: int = 0, context_threads: int = 1,
                 context_sched: str = "idle", capture: Capture | None = None,
                 panel_linear: str = "off", batch_invariant: bool = False,
                 prefix_mb: float = 512.0):
        if prefix_mb < 0:
            raise ValueError(f"prefix_mb must be >= 0, got {prefix_mb}")
        if context_threads < 0:
            raise ValueError(f"context_threads must be >= 0, got {context_threads}")
        if context_sched not in CONTEXT_SCHED:
            raise ValueError(f"context_sched must be one of {', '.join(CONTEXT_SCHED)}, "
                             f"got {context_sched!r}")
        p = next(drafter.parameters())
        self.device = p.device
        self.drafter = drafter
        self.head = head.to(self.device)
        self.cfg = drafter.cfg
        if head.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"vocab_size: drafter has {self.cfg.vocab_size}, target head has "
                             f"{head.vocab_size} rows")
        self.packed_linear, self.panel_linear = switch_linear(
            drafter, skinny_max_rows, packed_linear, self.device, also=[head],
            panel_linear=panel_linear)
        self.skinny_max_rows = skinny_max_rows
        head.skinny_max_rows = DEFAULT_MAX_ROWS if skinny_max_rows == AUTO else skinny_max_rows
        self.batch_invariant = batch_invariant
        if batch_invariant:
            _make_invariant(drafter, head)
        self._compute_ident: int | None = None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="drafter-compute",
                                           initializer=self._compute_thread, initargs=(threads,))
        self._context = ThreadPoolExecutor(1, thread_name_prefix="drafter-context",
                                           initializer=context_thread_init,
                                           initargs=(context_threads, context_sched)) \
            if context_threads else None
        if draft_vocab is not None:
            draft_vocab = draft_vocab.to(self.device)
        self.draft_vocab = draft_vocab
        self._draft_head = (self.head.lm_head[draft_vocab].contiguous()
                            if draft_vocab is not None else None)
        # Every session's context K/V, [rows, kvh, capacity, head_dim] per layer in the drafter's
        # dtype: a batch attends over rows 0..b-1 in place instead of a padded copy per step.
        self.pool = KVPool(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads,
                           self.cfg.head_dim, dtype=p.dtype, device=p.device)
        self.max_sessions = max_sessions
        per_token = 2 * self.cfg.num_hidden_layers * self.cfg.num_key_value_heads * \
            self.cfg.head_dim * p.element_size()
        self.prefixes = PrefixStore(self.pool, int(prefix_mb * (1 << 20)), per_token)
        self.capture = capture
        self.last_draft = 0.0        # time.monotonic() of the last call's arrival (learner's idle clock)
        self._sessions: dict[str, _SessionCtx] = {}
        self._spill_checked = 0.0
        self._lock = threading.Lock()
        self.card = _card(self.cfg, p.dtype)

    @classmethod
    def from_pretrained(cls, drafter_dir: str | Path, target_dir: str | Path, *,
                        dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                        name: str | None = None,
                        version: str | None = None, draft_vocab_size: int = -1,
                        skinny_max_rows: int = DEFAULT_MAX_ROWS, packed_linear: str = "off",
                        threads: int = 0, context_threads: int = 1,
                        context_sched: str = "idle", panel_linear: str = "off",
                        batch_invariant: bool = False, prefix_mb: float = 512.0
                        ) -> "DrafterEngine":
        """Load a z-lab checkpoint and the target's embedding/LM head (safetensors only).

        ``draft_vocab_size``: -1 = the checkpoint's ``draft_vocab.safetensors`` if it has one,
        0 = the full vocabulary, N = its first N ids (``dflash.core.draft_vocab.load_draft_vocab``).
        ``device`` / ``dtype``: ``dflash.core.device.resolve_device`` / ``resolve_dtype`` (``auto``
        = the drafter checkpoint's dtype on a GPU; on a CPU bfloat16 where it has bf16
        instructions, else float32).

        Raises:
            dflash.core.device.DeviceError: naming ``--device`` / ``--dtype``.
        """
        dev = resolve_device(device)
        td = resolve_dtype(dtype, checkpoint_dtype(drafter_dir), dev, cpu_bf16=True)
        drafter = load_drafter(drafter_dir, dtype=td)
        if name or version:
            drafter.cfg = dataclasses.replace(drafter.cfg, name=name or drafter.cfg.name,
                                              version=version or drafter.cfg.version)
        head = load_target_head(target_dir, dtype=td)
        if not drafter.cfg.target_fingerprint:
            tcfg = json.loads((Path(target_dir) / "config.json").read_text())
            drafter.cfg = dataclasses.replace(drafter.cfg,
                                              target_fingerprint=target_fingerprint(tcfg, head.embed))
        vocab = load_draft_vocab(drafter_dir, drafter.cfg.vocab_size, draft_vocab_size)
        return cls(drafter.to(dev), head, draft_vocab=vocab, skinny_max_rows=skinny_max_rows,
                   packed_linear=packed_linear, threads=threads, context_threads=context_threads,
                   context_sched=context_sched, panel_linear=panel_linear,
                   batch_invariant=batch_invariant, prefix_mb=prefix_mb)

    def warmup(self) -> None:
        """One tiny draft, then the products' tuning (:func:`drafter_svc.warmup.warmup`)."""
        warmup(self)

    # ------------------------------------------------------------------ Proposer
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        """Every session of one verifier step at once: one context forward for all sessions'
        new rows, then one drafter forward over all blocks (contexts on pool rows 0..b-1 from
        column 0, blocks right-padded, a mask hiding what lies past each). A bad item fails
        alone. Runs on the engine's compute thread, or its context thread when no item has a
        block to draft (the caller waits either way, so calls keep their order)."""
        self.last_draft = time.monotonic()     # a learner in this process yields to it now
        if threading.get_ident() == self._compute_ident:   # from on_compute_thread
            return self._propose_on(requests)
        pool = self._compute
        if self._context is not None and all(r.block_size <= 1 for r in requests):
            pool = self._context
        return pool.submit(self._propose_on, requests).result()

    def _propose_on(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        out: list[Proposal | DraftError | None] = [None] * len(requests)
        with self._lock, torch.inference_mode():
            self._spill_idle({r.session_id for r in requests})
            sessions: list[tuple[int, ProposalRequest, _SessionCtx]] = []
            for i, r in enumerate(requests):
                try:
                    sessions.append((i, r, self._session_for(r)))
                except DraftError as e:
                    out[i] = e
            append_context(self.drafter, self.pool, [(r, s) for _, r, s in sessions],
                           self.head.embed.dtype, self.device)
            drafting = []
            for i, r, sess in sessions:
                if r.block_size <= 1:
                    out[i] = Proposal(tokens=torch.empty(0, dtype=torch.int64, device="cpu"))
                elif not sess.length:
                    out[i] = DraftError(FallbackReason.NO_CONTEXT, "the drafter has no context for this session")
                else:
                    drafting.append((i, r, sess))
            if drafting:
                logits = self._draft_blocks([(r, sess) for _, r, sess in drafting])
                for (i, r, sess), lg in zip(drafting, logits):
                    p, sess.generator = choose_drafts(
                        r, lg, length=sess.length, generator=sess.generator,
                        draft_vocab=self.draft_vocab, vocab_size=self.cfg.vocab_size,
                        device=self.device)
                    out[i] = p
                    if r.top_k:
                        p.top_ids, p.top_logprobs = self._top_k(lg, r.top_k)
        done = to_host(out, self.device)
        if self.capture is not None:
            self.capture.observe(requests, done)
        return done

    def on_compute_thread(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the engine's compute thread (its torch threads, its OpenMP team),
        waited for; :meth:`propose` called from ``fn`` drafts inline. For a caller that times
        another model's forwards beside drafts on one thread, as a model service runs them
        (``dflash diagnose``: one team, not two competing for the cores). Raises what ``fn``
        raises."""
        return self._compute.submit(fn, *args).result()

    def _compute_thread(self, threads: int) -> None:
        """Initializer of the compute thread: it claims ``threads`` (0: torch's as they are)."""
        self._compute_ident = threading.get_ident()
        if threads:
            claim(threads)

    def close(self) -> None:
        """Stop the compute thread once queued drafts finish (a later ``propose`` raises
        RuntimeError); session contexts are dropped."""
        self._compute.shutdown(wait=True)
        if self._context is not None:
            self._context.shutdown(wait=True)
        with self._lock:
            self._sessions.clear()
            self.prefixes.clear()
            self.pool.collect()
        if self.capture is not None:
            self.capture.close()

    def release(self, session_ids: list[str]) -> None:
        with self._lock:
            for s in session_ids:
                self._sessions.pop(s, None)
            self.pool.collect()
        if self.capture is not None:
            self.capture.end(session_ids)

    def keep_prefix(self, session_id: str, key: bytes, length: int) -> None:
        """The session ends (as :meth:`release`); its context K/V becomes the prefix ``key``
        (at most ``MAX_PREFIX_KEY`` bytes) when it holds exactly ``length`` positions (else,
        or past the bound, nothing is kept: a later item naming ``key`` is a miss)."""
        with self._lock:
            sess = self._sessions.pop(session_id, None)
            if sess is not None and len(key) <= MAX_PREFIX_KEY:
                self.prefixes.keep(key, sess.seq, length)
            self.pool.collect()
        if self.capture is not None:
            self.capture.end([session_id])

    # ------------------------------------------------------------------ internals
    def _session_for(self, r: ProposalRequest) -> _SessionCtx:
        """Validate ``r``; the session's context, cropped to ``r.context_start``."""
        cfg = self.cfg
        ctx = r.context
        check_top_k(r.top_k)
        if ctx.dim() != 2 or ctx.shape[1] != cfg.context_size:
            raise DraftError(FallbackReason.BAD_REQUEST, f"context: expected [n, {cfg.context_size}], "
                             f"got {list(ctx.shape)}")
        if not 0 <= r.anchor_token < cfg.vocab_size:
            raise DraftError(FallbackReason.BAD_REQUEST, f"anchor_token: {r.anchor_token} outside vocabulary")
        if r.block_size > cfg.max_position_embeddings:
            raise DraftError(FallbackReason.BAD_REQUEST, "block_size too large")
        if r.prefix_key and r.context_start > 0:
            return self._session_from_prefix(r)
        sess = self._sessions.get(r.session_id)
        have = sess.length if sess else 0
        if r.context_start > have:
            raise DraftError(FallbackReason.CONTEXT_GAP, f"have {have} positions, got context_start {r.context_start}")
        if sess is None or r.context_start == 0:
            sess = _SessionCtx(seq=self.pool.new_seq())
            self._sessions[r.session_id] = sess
            self._evict()
        elif r.context_start < have:
            self.pool.set_length(sess.seq, r.context_start)
        sess.last_used = time.monotonic()
        return sess

    def _session_from_prefix(self, r: ProposalRequest) -> _SessionCtx:
        """A new context for ``r``'s session: the first ``context_start`` positions of its
        cached prefix. Raises DraftError(PREFIX_MISS) when the drafter does not hold them."""
        sess = _SessionCtx(seq=self.pool.new_seq())
        if not self.prefixes.start(r.prefix_key, sess.seq, r.context_start):
            raise DraftError(FallbackReason.PREFIX_MISS,
                             f"prefix_key: no cached prefix of {r.context_start} positions")
        self._sessions[r.session_id] = sess
        self._evict()
        return sess

    def _draft_blocks(self, items: list[tuple[ProposalRequest, _SessionCtx]]) -> list[torch.Tensor]:
        """Logits [block_size - 1, N] per item, all blocks in one forward (``forward.draft_blocks``)."""
        return draft_blocks(self.drafter, self.head, self.pool, items, self._draft_head,
                            self.draft_vocab)

    def _top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``drafts.top_k_logprobs`` of one block's logits, ids in the target vocabulary."""
        return top_k_in_target_ids(logits, k, self.draft_vocab)

    #: Sessions not drafted for this long leave the pool for tensors of their own length
    #: (a kept conversation between turns), so idle ones do not hold rows sized to the longest.
    SPILL_AFTER_S = 5.0

    def _spill_idle(self, keep: set[str]) -> None:
        now = time.monotonic()
        if now - self._spill_checked < 1.0:
            return
        self._spill_checked = now
        for sid, sess in self._sessions.items():
            if sid not in keep and sess.seq.resident and now - sess.last_used > self.SPILL_AFTER_S:
                self.pool.spill(sess.seq)

    def _evict(self) -> None:
        while len(self._sessions) > self.max_sessions:
            oldest = min(self._sessions, key=lambda s: self._sessions[s].last_used)
            del self._sessions[oldest]
            if self.capture is not None:
                self.capture.end([oldest])


def _make_invariant(drafter: DFlashDrafter, head: TargetHead) -> None:
    """Every linear layer, the LM head and the attention on :mod:`kernels.invariant`."""
    sl.set_invariant(drafter, True, also=[head])
    for m in (m for m in drafter.modules() if isinstance(m, DFlashAttention)):
        m.batch_invariant = True


def _card(cfg: DrafterConfig, dtype: torch.dtype) -> DrafterCard:
    """What this engine serves, for ``Describe`` and the verifier's card check."""
    return DrafterCard(
        name=cfg.name, version=cfg.version, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, target_layer_ids=tuple(cfg.target_layer_ids),
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        dtype=str(dtype).replace("torch.", ""), target_fingerprint=cfg.target_fingerprint,
        num_hidden_layers=cfg.num_hidden_layers, rope_theta=cfg.rope_theta)
