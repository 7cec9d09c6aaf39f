"""The verifier engine: sessions, prefill, the speculative decode loop, commit.

Pure torch/Python (no protobuf). The loop follows z-lab/dflash ``dflash_generate`` (Sec. 1.7 of
shared/reference/dflash.md) with the verification math of ``kernels`` (greedy longest-prefix
acceptance; Leviathan rejection sampling when temperature > 0) and exact stopping:

1. prefill the prompt (reusing the session's cached prefix), sample the first token (the anchor);
2. each step: send the drafter the taps of positions committed since its last step plus the
   anchor; get ``K`` drafts; verify ``[anchor, d_1..d_K]`` in one target forward;
3. commit the accepted drafts plus one bonus/recovered token, cut at EOS / stop ids /
   ``max_tokens``; crop the target KV cache to the committed length; keep their taps.

With speculation off, or when the drafter fails, the same loop runs with ``K = 0`` (plain
autoregressive decoding): the baseline every benchmark compares against, and the fallback that
keeps a drafter failure from ever failing a request.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

import kernels
from dflash.proposer import DraftError, DrafterCard, Proposal, Proposer, ProposalRequest
from dflash.sampling import InvalidParam, Sampling, probs_from_logits, sample_from
from dflash.stats import AcceptanceCounter
from verifier_svc.target import TargetModel

log = logging.getLogger("dflash.verifier")
MAX_BLOCK_SIZE = 64


class PreconditionError(RuntimeError):
    """The request or drafter does not fit this target; maps to FAILED_PRECONDITION."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def check_drafter_card(card: DrafterCard, target: TargetModel) -> list[str]:
    """Refuse a drafter that does not fit ``target``; return warnings for soft mismatches.

    Raises PreconditionError naming the field (hidden_size, vocab_size, target_layer_ids,
    block_size, mask_token_id).
    """
    if card.hidden_size != target.hidden_size:
        raise PreconditionError("hidden_size", f"drafter has {card.hidden_size}, target has "
                                f"{target.hidden_size}")
    if card.vocab_size != target.vocab_size:
        raise PreconditionError("vocab_size", f"drafter has {card.vocab_size}, target has "
                                f"{target.vocab_size}")
    if not card.target_layer_ids:
        raise PreconditionError("target_layer_ids", "empty")
    for i in card.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise PreconditionError("target_layer_ids", f"layer id {i} out of range for a "
                                    f"{target.num_layers}-layer target (valid 0..{target.num_layers - 1})")
    if not 1 <= card.block_size <= MAX_BLOCK_SIZE:
        raise PreconditionError("block_size", f"{card.block_size} not in [1, {MAX_BLOCK_SIZE}]")
    if not 0 <= card.mask_token_id < target.vocab_size:
        raise PreconditionError("mask_token_id", f"{card.mask_token_id} outside the vocabulary")
    warnings = []
    if card.target_fingerprint and card.target_fingerprint != target.fingerprint:
        warnings.append(f"target_fingerprint: drafter was built for {card.target_fingerprint}, "
                        f"this target is {target.fingerprint}")
    if card.rope_theta and target.rope_theta and card.rope_theta != target.rope_theta:
        warnings.append(f"rope_theta: drafter {card.rope_theta}, target {target.rope_theta}")
    return warnings


@dataclasses.dataclass(kw_only=True)
class Request:
    """One generation request, validated. ``proposer`` None = speculation off."""

    request_id: str
    session_id: str = ""
    prompt: list[int]
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    proposer: Proposer | None = None
    block_size: int = 0                 # 0 = the drafter's block size


@dataclasses.dataclass(kw_only=True)
class StepEvent:
    """What one step committed. ``finish`` is set on the last event."""

    tokens: list[int]
    accepted: int = 0
    drafted: int = 0
    finish: str | None = None          # "length" | "stop" | "cancelled"
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback: str | None = None        # reason this step ran without speculation
    stats: AcceptanceCounter | None = None   # the request's counts so far (same object each step)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0      # prompt tokens reused from the session's KV cache


@dataclasses.dataclass
class Session:
    """State kept between steps and turns, keyed by session id."""

    id: str
    cache: object
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + emitted
    taps: list[torch.Tensor] = dataclasses.field(default_factory=list)  # rows for cached positions
    tap_ids: tuple[int, ...] = ()
    drafter: Proposer | None = None
    drafter_len: int = 0               # context positions the drafter holds
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def tap_rows(self, start: int) -> torch.Tensor:
        rows = torch.cat(self.taps, dim=0) if self.taps else torch.empty(0)
        if len(self.taps) > 1:
            self.taps = [rows]
        return rows[start:]


class VerifierEngine:
    """Owns the target, the sessions and the decode loop.

    Args:
        target: the loaded target model.
        session_ttl_s: idle sessions are dropped after this many seconds.
        max_sessions: bound on kept sessions (least recently used dropped first).
    """

    def __init__(self, target: TargetModel, *, session_ttl_s: float = 600.0, max_sessions: int = 256):
        self.target = target
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.totals = AcceptanceCounter()
        self.step_listeners: list[Callable[[Request, StepEvent], None]] = []

    # ------------------------------------------------------------------ sessions
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Target KV positions held by all sessions (a metrics gauge)."""
        with self._lock:
            return sum(s.cached for s in self._sessions.values())

    def _session(self, sid: str) -> Session:
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                s = Session(id=sid, cache=self.target.new_cache())
                self._sessions[sid] = s
                self._evict_locked()
            s.last_used = time.monotonic()
            return s

    def close_session(self, sid: str) -> bool:
        """Drop a session on the verifier and its drafter. Returns whether it existed."""
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            return False
        self._release_drafter(s)
        return True

    def expire_sessions(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_used > self.session_ttl_s and not s.busy.locked()]
        return sum(self.close_session(sid) for sid in old)

    def _evict_locked(self) -> None:
        while len(self._sessions) > self.max_sessions:
            idle = [s for s in self._sessions.values() if not s.busy.locked()]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used)
            self._sessions.pop(victim.id)
            self._release_drafter(victim)

    @staticmethod
    def _release_drafter(s: Session) -> None:
        if s.drafter is not None:
            try:
                s.drafter.release([s.id])
            except Exception:  # a drafter failure never fails the verifier
                log.warning("drafter release failed for session %s", s.id, exc_info=True)
            s.drafter, s.drafter_len = None, 0

    # ------------------------------------------------------------------ validation
    def validate(self, req: Request) -> None:
        """Raise InvalidParam naming the field for a request that cannot run."""
        if not req.prompt:
            raise InvalidParam("prompt", "must not be empty")
        if req.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be >= 1, got {req.max_tokens}")
        v = self.target.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < v), None)
        if bad is not None:
            raise InvalidParam("prompt_token_ids", f"token id {bad} outside the vocabulary [0, {v})")
        window = self.target.max_positions
        if len(req.prompt) >= window:
            raise InvalidParam("prompt", f"{len(req.prompt)} tokens do not fit the context window "
                               f"of {window} tokens")
        if len(req.prompt) + req.max_tokens > window:
            raise InvalidParam("max_tokens", f"prompt ({len(req.prompt)}) + max_tokens "
                               f"({req.max_tokens}) exceeds the context window of {window} tokens")
        if req.block_size < 0 or req.block_size > MAX_BLOCK_SIZE:
            raise InvalidParam("block_size", f"must be in [0, {MAX_BLOCK_SIZE}]")

    # ------------------------------------------------------------------ the loop
    def generate(self, req: Request, cancelled: Callable[[], bool] = lambda: False
                 ) -> Iterator[StepEvent]:
        """Run one request; yields one StepEvent per step, the last with ``finish`` set.

        ``req.session_id`` empty = a one-shot session freed at the end. A cancelled request
        frees its session on the verifier and the drafter.
        """
        self.validate(req)
        sid = req.session_id or f"req-{req.request_id}"
        session = self._session(sid)
        if not session.busy.acquire(blocking=False):
            raise PreconditionError("session_id", f"session {sid!r} is already generating")
        finished = False
        try:
            yield from self._run(session, req, cancelled)
            finished = True
        finally:
            session.busy.release()
            session.last_used = time.monotonic()
            if not req.session_id or not finished:
                self.close_session(sid)

    def _run(self, s: Session, req: Request, cancelled) -> Iterator[StepEvent]:
        t = self.target
        proposer = req.proposer
        tap_ids = tuple(proposer.card.target_layer_ids) if proposer else ()
        if s.drafter is not None and s.drafter is not proposer:
            self._release_drafter(s)
        if tap_ids != s.tap_ids:
            s.taps, s.tap_ids, s.drafter_len = [], tap_ids, 0
            reuse = 0  # taps of the cached prefix are for other layers: recompute them
        else:
            reuse = _common_prefix(s.tokens, req.prompt)
        reuse = min(reuse, s.cached, len(req.prompt) - 1)
        gen = req.sampling.generator()
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(t.eos_token_ids))
        stats = AcceptanceCounter()

        # -- prefill
        t0 = time.perf_counter()
        with t.lock:
            t.crop(s.cache, reuse)
            logits, taps = t.forward(req.prompt[reuse:], s.cache, tap_ids)
        if tap_ids:
            s.taps = [s.tap_rows(0)[:reuse], taps]
        s.drafter_len = min(s.drafter_len, reuse)
        s.tokens = list(req.prompt)
        first = self._sample(logits[-1:], req.sampling, gen)
        s.tokens.append(first)
        emitted = 1
        finish = "stop" if first in stops else ("length" if req.max_tokens == 1 else None)
        yield StepEvent(tokens=[first], finish=finish, verify_seconds=time.perf_counter() - t0,
                        stats=stats, prompt_tokens=len(req.prompt), cached_prompt_tokens=reuse)
        if finish:
            return

        block_limit = 1
        if proposer is not None:
            block_limit = min(req.block_size or proposer.card.block_size, proposer.card.block_size)
            s.drafter = proposer
        while True:
            if cancelled():
                yield StepEvent(tokens=[], finish="cancelled", stats=stats)
                return
            remaining = req.max_tokens - emitted
            k = max(0, min(block_limit - 1, remaining - 1))
            anchor = s.tokens[-1]
            n = s.cached
            drafts, probs, fallback, draft_s = self._draft(s, req, anchor, n, k, stats)
            k = len(drafts)
            block = [anchor] + drafts
            tv = time.perf_counter()
            with t.lock:
                logits, taps = t.forward(block, s.cache, tap_ids)
                accepted, out = self._verify(block, logits, probs, req.sampling, gen)
                new = out[:accepted + 1]
                finish = None
                for j, tok in enumerate(new):
                    if tok in stops:
                        new, finish = new[:j + 1], "stop"
                        break
                if emitted + len(new) >= req.max_tokens:
                    new, finish = new[:req.max_tokens - emitted], finish or "length"
                t.crop(s.cache, n + len(new))
            verify_s = time.perf_counter() - tv
            if tap_ids:
                s.taps.append(taps[:len(new)])
            s.tokens.extend(new)
            emitted += len(new)
            acc_emitted = min(accepted, len(new))
            stats.record(k, acc_emitted)
            stats.verify_seconds += verify_s
            ev = StepEvent(tokens=new, accepted=acc_emitted, drafted=k, finish=finish,
                           draft_seconds=draft_s, verify_seconds=verify_s, fallback=fallback,
                           stats=stats)
            if fallback:
                stats.fallback_steps += 1
            self.totals.record(k, acc_emitted)
            for listener in self.step_listeners:
                listener(req, ev)
            yield ev
            if finish:
                return

    def _draft(self, s: Session, req: Request, anchor: int, n: int, k: int,
               stats: AcceptanceCounter) -> tuple[list[int], torch.Tensor | None, str | None, float]:
        """Ask the proposer for ``k`` drafts. Any failure -> no drafts plus a fallback reason."""
        proposer = req.proposer
        if proposer is None or k == 0:
            return [], None, None, 0.0
        start = s.drafter_len
        pr = ProposalRequest(session_id=s.id, context_start=start, context=s.tap_rows(start),
                             anchor_token=anchor, block_size=k + 1, sampling=req.sampling)
        td = time.perf_counter()
        try:
            res = proposer.propose([pr])[0]
        except Exception as e:  # the drafter must never fail the request
            res = DraftError("exception", repr(e))
        draft_s = time.perf_counter() - td
        stats.draft_seconds += draft_s
        reason = self._malformed(res, k)
        if reason:
            s.drafter_len = 0  # resend the whole context once a drafter is healthy again
            log.info("session %s: drafter fallback (%s)", s.id, reason)
            return [], None, reason, draft_s
        s.drafter_len = n
        return res.tokens.tolist(), res.probs, None, draft_s

    def _malformed(self, res: Proposal | DraftError, k: int) -> str | None:
        if isinstance(res, DraftError):
            return res.reason
        v = self.target.vocab_size
        toks = res.tokens
        if toks.dim() != 1 or toks.numel() != k:
            return "malformed_block"
        if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= v):
            return "out_of_vocab"
        if res.probs is not None:
            p = res.probs
            if p.shape != (k, v) or not torch.isfinite(p).all() or (p < 0).any():
                return "malformed_probs"
        return None

    def _verify(self, block: list[int], logits: torch.Tensor, draft_probs: torch.Tensor | None,
                sampling: Sampling, gen: torch.Generator) -> tuple[int, list[int]]:
        """Acceptance for one sequence via the ``kernels`` entry points."""
        k = len(block) - 1
        drafts = torch.tensor([block[1:]], dtype=torch.int64)
        if sampling.greedy:
            acc, out = kernels.greedy_accept(drafts, logits[None])
        else:
            p = probs_from_logits(logits, sampling)[None]                    # [1, K+1, V]
            q = draft_probs[None].float() if draft_probs is not None else \
                torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
            u = torch.rand((1, k), generator=gen)
            e = torch.empty_like(p).exponential_(generator=gen)
            acc, out = kernels.rejection_sample(drafts, q, p, u, e)
        a = int(acc[0])
        return a, out[0, :a + 1].tolist()

    def _sample(self, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        return int(sample_from(probs_from_logits(logits[-1], sampling), gen))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
