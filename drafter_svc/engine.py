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
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from dflash.core.checkpoint import load_drafter, load_target_head, target_fingerprint
from dflash.core.device import checkpoint_dtype, resolve_device, resolve_dtype, to_device
from dflash.core.draft_vocab import load_draft_vocab
from dflash.core.kv_pool import KVPool, PoolSeq
from dflash.core.modeling import DFlashDrafter, TargetHead
from dflash.core.proposer import DrafterCard, DraftError, Proposal, ProposalRequest, check_top_k
from dflash.core.sampling import coupled_choice, position_noise, probs_from_logits, sample_from
from dflash.serving.threads import claim
from kernels.skinny_linear import (
    AUTO,
    DEFAULT_MAX_ROWS,
    packed_state,
    packed_summary,
    switch_linear,
    tune_max_rows,
    tune_packed,
    tuning_summary,
)

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


class DrafterEngine:
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
        threads: torch threads of the engine's compute thread, which runs every draft (calls
            come from any gRPC thread); it then is the process's only multi-threaded torch
            thread (``dflash.serving.threads.claim``). 0 = leave torch's threads alone.
        context_threads: torch threads of a second thread that runs every call whose items all
            only carry context (block size 1, no draft): the verifier does not wait for those
            (its context updates on steps without speculation), so they run beside its forward
            on shared cores. One thread by default: two OpenMP threads busy-waiting at every
            barrier take both cores of a small machine from the verifier
            (``docs/perf-history.md``, "drafter_svc/engine.py"). 0 = no second thread: such
            calls run on the compute thread. Raises ValueError below 0.
        context_sched: the context thread's Linux scheduling policy. "idle" (``SCHED_IDLE``):
            it runs only on a core nothing else wants, i.e. in the verifier's gaps (between
            steps, while it waits for a draft), so context updates do not lengthen the
            verifier's steps without speculation. "normal" = the process's policy. Where the
            policy cannot be set (not Linux) the thread keeps the process's, with a warning.
            Raises ValueError for other values.
    """

    def __init__(self, drafter: DFlashDrafter, head: TargetHead, *, max_sessions: int = 256,
                 draft_vocab: torch.Tensor | None = None, skinny_max_rows: int = DEFAULT_MAX_ROWS,
                 packed_linear: str = "off", threads: int = 0, context_threads: int = 1,
                 context_sched: str = "idle"):
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
        self.packed_linear = switch_linear(drafter, skinny_max_rows, packed_linear, self.device,
                                           also=[head])
        self.skinny_max_rows = skinny_max_rows
        head.skinny_max_rows = DEFAULT_MAX_ROWS if skinny_max_rows == AUTO else skinny_max_rows
        self._compute_ident: int | None = None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="drafter-compute",
                                           initializer=self._compute_thread, initargs=(threads,))
        self._context = ThreadPoolExecutor(1, thread_name_prefix="drafter-context",
                                           initializer=_context_thread,
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
        self._sessions: dict[str, _SessionCtx] = {}
        self._spill_checked = 0.0
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
                        dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                        name: str | None = None,
                        version: str | None = None, draft_vocab_size: int = -1,
                        skinny_max_rows: int = DEFAULT_MAX_ROWS, packed_linear: str = "off",
                        threads: int = 0, context_threads: int = 1,
                        context_sched: str = "idle") -> "DrafterEngine":
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
                   context_sched=context_sched)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Context positions held for all sessions (a metrics gauge)."""
        return sum(s.length for s in list(self._sessions.values()))

    def warmup(self) -> None:
        """One tiny draft so first requests don't pay lazy initialisation; then, with
        ``skinny_max_rows`` :data:`kernels.skinny_linear.AUTO`, the row limit is tuned on the
        compute thread (one session, 64 context rows, blocks of 2 / 4 / 8 / 16 drafted with
        and without the transposed product; ``kernels.skinny_linear.tune_max_rows``); with
        ``packed_linear`` "auto", a one-row context update and blocks of 4 / 16 with and without
        the prepacked product (``kernels.skinny_linear.tune_packed``)."""
        from dflash.core.sampling import Sampling

        def req(block: int, rows: int = 2) -> ProposalRequest:
            return ProposalRequest(session_id="__warmup__", context_start=0,
                                   context=torch.zeros(rows, self.cfg.context_size,
                                                       device="cpu"),
                                   anchor_token=0, block_size=block, sampling=Sampling())

        self.propose([req(self.cfg.block_size)])
        if self.skinny_max_rows == AUTO and self.device.type == "cpu":   # CPU-only product
            rows = tuple(n for n in (2, 4, 8, 16) if n <= self.cfg.block_size) or (2,)

            def tune():
                return tune_max_rows(self.drafter, lambda n: self._propose_on([req(n, 64)]),
                                     rows=rows, also=[self.head])

            self.skinny_max_rows, timings = self._compute.submit(tune).result()
            log.info("%s", tuning_summary(self.skinny_max_rows, timings))
        if self.packed_linear == "auto":
            blocks = tuple(sorted({min(n, self.cfg.block_size) for n in (1, 4, 16)}))

            def tune_p():
                # block 1 = a context update: of one row, the products' one-row case
                return tune_packed(self.drafter,
                                   lambda n: self._propose_on([req(n, 1 if n == 1 else 64)]),
                                   rows=blocks, also=[self.head])

            packed, ptimes = self._compute.submit(tune_p).result()
            self.packed_linear = packed_state(packed)
            log.info("%s", packed_summary(packed, ptimes))
        self.release(["__warmup__"])

    # ------------------------------------------------------------------ Proposer
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal | DraftError]:
        """Every session of one verifier step at once: one context forward for all sessions'
        new rows, then one drafter forward over all blocks (contexts on pool rows 0..b-1 from
        column 0, blocks right-padded, a mask hiding what lies past each). A bad item fails
        alone. Runs on the engine's compute thread, or its context thread when no item has a
        block to draft (the caller waits either way, so calls keep their order)."""
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
            self._append_context(sessions)
            drafting = []
            for i, r, sess in sessions:
                if r.block_size <= 1:
                    out[i] = Proposal(tokens=torch.empty(0, dtype=torch.int64, device="cpu"))
                elif not sess.length:
                    out[i] = DraftError("no_context", "the drafter has no context for this session")
                else:
                    drafting.append((i, r, sess))
            if drafting:
                logits = self._draft_blocks([(r, sess) for _, r, sess in drafting])
                for (i, r, sess), lg in zip(drafting, logits):
                    p = out[i] = self._sample(r, sess, lg)
                    if r.top_k:
                        p.top_ids, p.top_logprobs = self._top_k(lg, r.top_k)
        return _to_host(out, self.device)

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
            self.pool.collect()

    def release(self, session_ids: list[str]) -> None:
        with self._lock:
            for s in session_ids:
                self._sessions.pop(s, None)
            self.pool.collect()

    # ------------------------------------------------------------------ internals
    def _session_for(self, r: ProposalRequest) -> _SessionCtx:
        """Validate ``r``; the session's context, cropped to ``r.context_start``."""
        cfg = self.cfg
        ctx = r.context
        check_top_k(r.top_k)
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
            sess = _SessionCtx(seq=self.pool.new_seq())
            self._sessions[r.session_id] = sess
            self._evict()
        elif r.context_start < have:
            self.pool.set_length(sess.seq, r.context_start)
        sess.last_used = time.monotonic()
        return sess

    def _append_context(self, sessions) -> None:
        """New context rows of every session through ``fc``/``k_proj``/``v_proj`` in one call
        (per-position work: the rows of all sessions form one sequence with their own positions),
        each session's slice then written into its pool row at its length."""
        parts = [(r, sess) for _, r, sess in sessions if r.context.shape[0]]
        if not parts:
            return
        dtype, dev = self.head.embed.dtype, self.device
        feats = to_device(torch.cat([r.context for r, _ in parts]), dev).to(dtype)[None]
        pos = torch.cat([torch.arange(s.length, s.length + r.context.shape[0], device="cpu")
                         for r, s in parts])[None]
        new_kv = self.drafter.context_kv(feats, to_device(pos, dev))   # per layer [1, kvh, sum n, d]
        pool = self.pool
        for _, sess in parts:
            pool.ensure_resident(sess.seq)
        pool.reserve(max(s.length + r.context.shape[0] for r, s in parts))
        start = 0
        for r, sess in parts:
            n = r.context.shape[0]
            for layer, (k, v) in enumerate(new_kv):
                pool.write(layer, sess.seq.row, sess.length,
                           k[:, :, start:start + n], v[:, :, start:start + n])
            pool.advance([sess.seq], [n])
            start += n

    def _draft_blocks(self, items: list[tuple[ProposalRequest, _SessionCtx]]) -> list[torch.Tensor]:
        """Logits [block_size - 1, V] per item (V = draft vocabulary size when there is one),
        all blocks in one drafter forward.

        The items' sessions go onto pool rows ``0..b-1`` (``KVPool.arrange``: only sessions
        not there yet move) and the drafter reads ``K[:b, :, :n_max]`` in place;
        row i's context fills columns ``[0, length_i)`` and the mask hides the rest of them
        (stale or zero, always finite) and the padding of shorter blocks."""
        cfg = self.cfg
        pool = self.pool
        b = len(items)
        order = list(range(b))
        if b > 1:                                # row r holds items[order[r]]
            slots = pool.arrange([s.seq for _, s in items])
            order = sorted(range(b), key=slots.__getitem__)
            items = [items[i] for i in order]
        n_max = max(s.length for _, s in items)
        q = max(r.block_size for r, _ in items)
        dev, host = self.device, "cpu"           # built on the host, copied once (to_device)
        block = torch.full((b, q), cfg.mask_token_id, dtype=torch.int64, device=host)
        positions = torch.empty((b, q), dtype=torch.int64, device=host)
        for i, (r, s) in enumerate(items):
            block[i, 0] = r.anchor_token
            positions[i] = torch.arange(s.length, s.length + q, device=host)
        if b == 1:                               # the row's own context: attend everywhere
            kv = pool.views(pool.ensure_resident(items[0][1].seq), 1, n_max)
            mask = ctx_pos = None
        else:
            kv = pool.views(0, b, n_max)
            keys = torch.arange(n_max + q, device=host)
            lens = torch.tensor([s.length for _, s in items], device=host)[:, None]       # [b, 1]
            blocks = torch.tensor([r.block_size for r, _ in items], device=host)[:, None]  # [b, 1]
            ok = torch.where(keys < n_max, keys < lens, keys - n_max < blocks)    # [b, n+q]
            mask = to_device(ok, dev)[:, None, None, :].expand(b, 1, q, n_max + q)
            # column = position (sliding layers)
            ctx_pos = torch.arange(n_max, device=dev).expand(b, n_max)
        hidden = self.drafter(self.head.embed_tokens(to_device(block, dev)),
                              to_device(positions, dev), kv, mask, context_positions=ctx_pos)
        # One LM-head product for every block's rows: a product per block would stream the
        # whole head (N x H) once per block, for a few rows each.
        sizes = [r.block_size - 1 for r, _ in items]
        rows = torch.cat([hidden[i, 1:1 + n] for i, n in enumerate(sizes)])
        by_row = self.head.logits(rows, self._draft_head).split(sizes)
        out: list[torch.Tensor] = [by_row[0]] * b
        for row, i in enumerate(order):
            out[i] = by_row[row]
        return out

    def _sample(self, r: ProposalRequest, sess: _SessionCtx, logits: torch.Tensor) -> Proposal:
        """Drafts (and q for unseeded sampled drafts) in target ids: with a draft vocabulary,
        logits are over its ids and q is scattered into a full-vocabulary [k, V] tensor, zero
        elsewhere. Seeded drafts are ``argmax(q_t / position_noise(seed, t))`` for the sequence
        indices t after the anchor (``dflash.core.sampling.position_noise``), sent without q."""
        ids = self.draft_vocab
        if r.sampling.greedy:
            tok = logits.argmax(-1)
            return Proposal(tokens=ids[tok] if ids is not None else tok)
        probs = probs_from_logits(logits, r.sampling)
        if r.sampling.seed is not None:
            # the verifier's own noise for these sequence indices (the anchor sits at
            # sess.length): coupled, a draft is accepted iff the target's race picks it too
            first = sess.length + 1
            noise = position_noise(r.sampling.seed, range(first, first + probs.shape[0]),
                                   self.cfg.vocab_size, self.device)
            tok = coupled_choice(probs, noise if ids is None else noise[:, ids])
            # no q: coupled verification never reads it (and it is [k, V] floats on the wire)
            return Proposal(tokens=ids[tok] if ids is not None else tok)
        if sess.generator is None:
            sess.generator = r.sampling.generator(self.device)
        tok = sample_from(probs, sess.generator)
        if ids is None:
            return Proposal(tokens=tok, probs=probs)
        full = probs.new_zeros((probs.shape[0], self.cfg.vocab_size))
        full[:, ids] = probs
        return Proposal(tokens=ids[tok], probs=full)

    def _top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`top_k_logprobs` of this block's draft logits, ids in the target vocabulary."""
        idx, vals = top_k_logprobs(logits, k)
        if self.draft_vocab is not None:
            idx = self.draft_vocab[idx]
        return idx, vals

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


def top_k_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top ``k`` per draft position, what DDTree builds its tree from
    (Ringel & Romano, arXiv 2604.12989; liranringel/ddtree ``build_ddtree_tree``: float32
    log-softmax of the draft logits, top-k per depth).

    Args:
        logits: float32 [K, N] of this block's drafts (N = draft vocabulary size when there
            is one, else V), the very logits the drafts came from (no second forward).
        k: 1 <= k <= MAX_TOP_K; more than N gives N columns.
    Returns:
        (ids int64 [K, c]: columns of ``logits``, i.e. draft-vocabulary rows when there is
        one; logprobs float32 [K, c], descending per row), c = min(k, N): log-softmax at
        temperature 1 whatever the request's sampling. Column 0 is ``argmax(logits)`` (its
        first index among ties), the greedy draft.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    n = lp.shape[-1]
    c = min(k, n)
    vals, idx = lp.topk(min(max(k, 2), n), dim=-1)   # >= 2 columns: a tie for the top shows
    # topk does not promise argmax's first-index rule on ties (common in bf16 logits), yet
    # column 0 must be the greedy chain's draft: put argmax first, and the column it held
    # (if among the top) where it was. Its log-prob is the row's max (rounding is monotone),
    # so the row stays sorted; a row without a tie is unchanged (its top is the argmax).
    # Whole-tensor ops: no host round trip per row.
    first = logits.argmax(-1)                                      # [K]
    hit = idx == first[:, None]                                    # [K, c']
    at = hit.to(torch.int64).argmax(-1)                            # first's column, or 0
    rows = torch.arange(idx.shape[0], device=idx.device)
    idx[rows, at] = torch.where(hit.any(-1), idx[:, 0], idx[rows, at])
    idx[:, 0] = first
    vals, idx = vals[:, :c], idx[:, :c]
    return idx, vals


def _context_thread(threads: int, sched: str) -> None:
    """Initializer of the context thread: ``threads`` torch threads for this thread only (the
    process default for threads started later is left as it was), and ``SCHED_IDLE`` when
    ``sched`` is "idle" (Linux ``sched_setscheduler`` on the calling thread; an unprivileged
    thread may lower its own policy)."""
    claim(threads, others=torch.get_num_threads())
    if sched == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            log.warning("context thread keeps the process's scheduling policy: %s", e)


def _to_host(out: list, device: torch.device) -> list:
    """Every proposal's tensors on the host, with one wait for the device: each copy is queued
    into pinned memory without blocking (``non_blocking`` from CUDA allocates the host side
    pinned), then the stream is synchronised once (a ``.tolist()`` or a pageable copy per
    tensor would wait for the device each time)."""
    if device.type != "cuda":
        return out
    for p in out:
        if isinstance(p, Proposal):
            for name in ("tokens", "probs", "top_ids", "top_logprobs"):
                t = getattr(p, name)
                if t is not None and t.device.type == "cuda":
                    setattr(p, name, t.to("cpu", non_blocking=True))
    torch.cuda.current_stream(device).synchronize()
    return out
