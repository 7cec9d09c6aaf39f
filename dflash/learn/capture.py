"""What the drafter sees of a conversation, rebuilt into a training sequence.

Per draft call a session sends the taps of the newly committed positions ``[s, s + n)``, their
token ids (``ProposalRequest.context_ids``; -1 for the request's prompt, whose ids never
travel) and the anchor (bonus) token at ``s + n``. Those ids are the labels; a position whose
id is withheld gets ``loss_mask`` 0. A verifier that predates ``context_ids`` sends none: the
ids at ``s + 1 .. s + n - 1`` are then taken for the drafts it accepted (an accepted draft is
the drafted token itself, greedy or sampled), the first ``n - 1`` tokens of the session's
previous chain proposal, and unknown where that cannot hold (the previous call drafted no
chain: a tree (``top_k``), a context-only update, suffix drafts; more rows than drafts; a stop
token before them). That inference is wrong when the verifier committed a step without calling
the drafter (a step with no drafts, suffix drafts) after a chain and fewer rows than the chain
had drafts arrive: the sent ids are what keeps labels right. The capture only reads requests
and proposals: it changes no draft.

A call from ``context_start`` 0 whose rows begin with the record's and whose id at the record's
anchor agrees (a resend after a failed draft) continues the record; any other restart at 0 is
a new conversation. A session ends (release, eviction, such a restart, close) or goes quiet for
``idle_s`` (the verifier keeps a conversation between turns) -> its sequence so far goes to a
writer thread and the :class:`dflash.learn.store.CaptureStore` (a later write of a session that
grew replaces its file); a session any of whose items says ``no_learn`` is dropped and never
recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import torch

from dflash.core.proposer import DraftError, Proposal, ProposalRequest
from dflash.core.sampling import GREEDY_EPS
from dflash.learn.store import CaptureStore, Served

log = logging.getLogger("dflash.learn")
#: Positions kept per conversation: a longer one keeps what it had below MAX_POSITIONS.
MAX_POSITIONS = 8192
UNKNOWN = -1


@dataclasses.dataclass(eq=False)
class _Record:
    """One session's sequence so far: taps of positions [0, len(taps)), ids of [0, len(ids))
    (one more: the last anchor), and the drafts of its last chain proposal."""

    taps: list[torch.Tensor] = dataclasses.field(default_factory=list)  # bf16 [n_i, kH] chunks
    ids: list[int] = dataclasses.field(default_factory=list)
    rows: int = 0
    drafts: list[int] | None = None
    seq: int | None = None       # its number in the store, once written
    stopped: bool = False        # recording ended (a gap, the length cap): later calls ignored
    last: float = 0.0            # time.monotonic() of its last call
    dirty: bool = False          # grown since it was last written
    steps: int = 0               # verify steps seen (draft calls after the first) ...
    tokens: int = 0              # ... and the tokens they committed
    greedy_chain: bool = True    # every call a greedy chain whose accepted drafts are known


class Capture:
    """Records sessions for the learner (see the module docstring).

    Args:
        store: where finished conversations go.
        stop_ids: the target's stop token ids: ids after one are a new turn's prompt, unknown.
        min_answer_tokens: a conversation with fewer labelled tokens is not kept.
        idle_s: a session with no call for this long is written as it stands.
        served_by: the drafter's ``name@version``: a conversation served by greedy chains only
            is stored with its steps and tokens (:class:`dflash.learn.store.Served`), which
            the gate checks a replay against. Empty: not recorded.
    """

    def __init__(self, store: CaptureStore, *, stop_ids: set[int] = frozenset(),  # type: ignore[assignment]
                 min_answer_tokens: int = 2, idle_s: float = 2.0, served_by: str = ""):
        self.store = store
        self.served_by = served_by
        self.idle_s = idle_s
        self.stop_ids = set(stop_ids)
        self.min_answer_tokens = min_answer_tokens
        self._records: dict[str, _Record] = {}
        self._excluded: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.written = 0
        self._writer = threading.Thread(target=self._write_loop, name="learn-capture", daemon=True)
        self._writer.start()

    def observe(self, requests: list[ProposalRequest], outs: list) -> None:
        """Record one draft call: ``requests`` and their results (Proposal | DraftError)."""
        with self._lock:
            for r, out in zip(requests, outs):
                if r.no_learn or r.session_id in self._excluded:
                    self._excluded.add(r.session_id)
                    self._records.pop(r.session_id, None)
                    continue
                if isinstance(out, DraftError):
                    continue
                self._step(r, out)

    def _step(self, r: ProposalRequest, out: Proposal) -> None:
        rec = self._records.get(r.session_id)
        start, context = r.context_start, r.context
        sent = [UNKNOWN if t < 0 else t for t in r.context_ids] if r.context_ids else None
        if rec is not None and start == 0 and _resent(rec, context, _id_at(r, sent, rec.rows)):
            # the verifier resent the whole context (a failed draft, an open circuit): the same
            # conversation goes on
            start, context = rec.rows, context[rec.rows:]
            sent = sent[rec.rows:] if sent is not None else None
            rec.drafts, rec.greedy_chain = None, False
        elif rec is None or start == 0:
            if rec is not None:
                self._finish(rec)
            # a session first seen past position 0 (capture switched on mid-conversation) lacks
            # its start: never recorded, until it restarts at 0
            rec = self._records[r.session_id] = _Record(stopped=start != 0)
        n = int(context.shape[0])
        if start > rec.rows or rec.rows + n + 1 > MAX_POSITIONS:
            rec.stopped = True                      # a gap, or too long: keep what it has
        if rec.stopped:
            return
        rec.last, rec.dirty = time.monotonic(), True
        if start < rec.rows:
            _crop(rec, start)
        if n:
            # a copy even when already bf16: an in-process caller may reuse the rows' buffer
            rec.taps.append(context.to("cpu", torch.bfloat16, copy=True))
            if rec.rows == 0:
                rec.ids = sent if sent is not None else [UNKNOWN] * n  # the prompt's: withheld
            else:
                guess = self._accepted(rec, n - 1)
                # one verify of the last chain: its rows are the accepted drafts (and the bonus)
                rec.greedy_chain &= (rec.drafts is not None and UNKNOWN not in guess
                                     and (sent is None or sent[1:] == guess))
                rec.ids += guess if sent is None else sent[1:]
                rec.steps, rec.tokens = rec.steps + 1, rec.tokens + n
            rec.rows += n
            rec.ids.append(r.anchor_token)
        elif not rec.ids:
            return
        else:
            rec.ids[-1] = r.anchor_token
        chain = r.block_size > 1 and r.top_k == 0 and out.tokens.numel() == r.block_size - 1
        rec.drafts = out.tokens.tolist() if chain else None
        rec.greedy_chain &= chain and r.sampling.temperature < GREEDY_EPS

    def _accepted(self, rec: _Record, k: int) -> list[int]:
        """Ids of the k positions after the last anchor: the accepted drafts, else unknown."""
        last = rec.ids[-1] if rec.ids else UNKNOWN
        if k == 0:
            return []
        if rec.drafts is None or last in self.stop_ids or last == UNKNOWN:
            return [UNKNOWN] * k
        got = rec.drafts[:k]
        for i, t in enumerate(got):
            if t in self.stop_ids:                  # a turn ended: what follows is a prompt
                return got[:i + 1] + [UNKNOWN] * (k - i - 1)
        # more rows than drafts and no stop among them: not this chain's doing, label nothing
        return got if k <= len(got) else [UNKNOWN] * k

    def end(self, session_ids: list[str]) -> None:
        """These sessions are over: write what they hold."""
        with self._lock:
            for s in session_ids:
                self._excluded.discard(s)
                rec = self._records.pop(s, None)
                if rec is not None:
                    self._finish(rec)

    def close(self, timeout: float = 30.0) -> None:
        """Write every open session, wait for the writer (up to ``timeout`` seconds)."""
        self.end(list(self._records))
        self._queue.put(None)
        self._writer.join(timeout)

    def _finish(self, rec: _Record) -> None:
        """Queue ``rec`` as it stands (called under the lock; the copy is what gets written)."""
        if not (rec.rows and rec.taps and rec.dirty):
            return
        if sum(t != UNKNOWN for t in rec.ids) < self.min_answer_tokens:
            return
        if rec.seq is None:
            rec.seq = self.store.new_seq()
        rec.dirty = False
        served = (Served(self.served_by, rec.steps, rec.tokens)
                  if self.served_by and rec.greedy_chain and rec.steps else None)
        # copies of the lists (the tensors are never written again): the writer thread
        # concatenates, so a release on the serving path costs no tensor work
        self._queue.put((rec.seq, list(rec.ids), list(rec.taps), served))

    def flush_idle(self) -> None:
        """Queue every session quiet for ``idle_s`` (the writer thread calls it)."""
        now = time.monotonic()
        with self._lock:
            for rec in self._records.values():
                if rec.dirty and now - rec.last >= self.idle_s:
                    self._finish(rec)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=max(0.05, self.idle_s / 2))
            except queue.Empty:
                self.flush_idle()
                continue
            if item is None:
                return
            seq, ids, taps, served = item
            try:
                conv = to_sequence(ids, torch.cat(taps))
                if self.store.add(conv["input_ids"], conv["loss_mask"], conv["taps"], seq,
                                  served=served) is not None:
                    self.written += 1
            except Exception:                      # noqa: BLE001 -- capture must never stop serving
                log.exception("capture: a conversation could not be written")


def _id_at(r: ProposalRequest, sent: list[int] | None, pos: int) -> int:
    """The id a call from position 0 gives position ``pos``: a sent id, the anchor, or unknown."""
    n = int(r.context.shape[0])
    if pos == n:
        return r.anchor_token
    return sent[pos] if sent is not None and pos < n else UNKNOWN


def _resent(rec: _Record, context: torch.Tensor, last: int) -> bool:
    """Whether ``context`` (a call from position 0) resends what ``rec`` holds: at least as many
    rows, its first ones bit-identical in bf16 (the verifier resends its cached tap rows), and
    ``last``, its id at the record's last position (the record's anchor), the same where both
    are known. A new conversation on the same session, or recomputed taps, starts a new record
    instead."""
    if rec.stopped or not rec.rows or context.shape[0] < rec.rows:
        return False
    if UNKNOWN not in (last, rec.ids[rec.rows]) and last != rec.ids[rec.rows]:
        return False
    held = torch.cat(rec.taps) if len(rec.taps) > 1 else rec.taps[0]
    if len(rec.taps) > 1:
        rec.taps = [held]                           # concatenated once, kept so
    return torch.equal(context[:rec.rows].to("cpu", torch.bfloat16), held)


def _crop(rec: _Record, start: int) -> None:
    """Keep positions [0, start) and the id at ``start`` (the verifier rewound)."""
    taps = torch.cat(rec.taps)[:start] if rec.taps else torch.empty(0)
    rec.taps = [taps] if start else []
    rec.rows = min(rec.rows, start)
    rec.ids = rec.ids[:rec.rows + 1] if rec.rows else []
    rec.drafts = None
    rec.greedy_chain = False        # a rewind: its steps are no longer the ones served


def to_sequence(ids: list[int], taps: torch.Tensor) -> dict[str, torch.Tensor]:
    """A training sequence from per-position ids (``UNKNOWN`` = not seen) and taps.

    ids: len n (one past the taps: the last anchor); taps: bf16 [n - 1, kH] or [n, kH].
    Returns ``{input_ids int64 [n], loss_mask uint8 [n], taps bf16 [n, kH]}``: unknown ids are
    0 with mask 0, known ids after the prompt have mask 1; the taps get a zero last row."""
    n = len(ids)
    t = torch.tensor(ids, dtype=torch.int64)
    known = t != UNKNOWN
    full = torch.zeros(n, taps.shape[1], dtype=torch.bfloat16)
    m = min(n, taps.shape[0])
    full[:m] = taps[:m]
    return {"input_ids": torch.where(known, t, 0), "loss_mask": known.to(torch.uint8), "taps": full}
