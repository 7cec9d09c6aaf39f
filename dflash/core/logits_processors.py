"""The target's logits processors (penalties, logit bias) and per-token log-probabilities.

Semantics (OpenAI / vLLM ``SamplingParams``; the repetition penalty as transformers'
``RepetitionPenaltyLogitsProcessor``, Keskar et al. 2019, CTRL), for a row whose context holds
the prompt and the tokens generated so far:

* ``repetition_penalty`` r over the prompt *and* the generated tokens: a seen token's logit
  becomes ``logit / r`` if it is > 0, else ``logit * r``;
* ``frequency_penalty`` f and ``presence_penalty`` e over the generated (output) tokens only:
  ``logit -= f * count(token) + e * (count(token) > 0)``;
* ``logit_bias``: the bias is added to its token's logit.

Order: repetition -> frequency/presence -> logit bias (this module, on raw logits), then
temperature -> top-k -> top-p -> min-p (:func:`dflash.core.sampling.probs_from_logits`). This is the
order of transformers' ``generate()`` (``RepetitionPenaltyLogitsProcessor`` ...
``SequenceBiasLogitsProcessor``, then the temperature, top-k, top-p and min-p warpers). vLLM v1's
``Sampler`` differs in two places: it adds the logit bias *before* the penalties, and applies
min-p before top-k/top-p; the two orders agree unless a repetition penalty and a positive-logit
bias meet on one token, or top-p and min-p are both set.

Speculation (why greedy output with speculation equals greedy output without it): every verified
row is processed with the penalty state *it* would have if it were decoded alone. Row ``j`` of a
chain ``[anchor, d_1..d_k]`` predicts the token after ``d_j``, so its counts are the generated
tokens so far plus ``d_1..d_j`` (the drafts before it, which are in its context if they are
accepted; if one is rejected, row j's result is never used). A tree node's counts are the
generated tokens plus the tokens of its root-to-node path. Rows are computed together: every
row with the committed state (two vectorised passes over ``[n + 1, V]``), then the few entries
whose count differs (each row's path tokens) recomputed from the raw logits with their own count
(one gather, one scatter). The drafter's q stays unprocessed: rejection sampling is lossless for
any q (Leviathan et al. 2023).

Log-probabilities (:func:`token_logprobs`) are taken from the target's *raw* logits, before
these processors and before temperature (vLLM's default ``logprobs_mode = "raw_logprobs"``),
at the verified row that emitted each token.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.core.sampling import Sampling

__all__ = ["LogitsProcessor", "TokenLogprob", "chain_parents", "token_logprobs"]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and the ``top_logprobs`` most likely
    tokens at that position (most likely first, ``len(top_ids) == len(top_logprobs)``)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def chain_parents(k: int) -> list[int]:
    """The parents of the chain ``[anchor, d_1..d_k]`` as a tree: ``[-1, 0, 1, ..., k - 1]``."""
    return list(range(-1, k))


class LogitsProcessor:
    """One request's penalty state and its processing of the target's logits.

    Args:
        sampling: the request's parameters (``sampling.penalised`` should be true; otherwise
            every call returns a copy of the logits, at a cost).
        prompt: the prompt's token ids (the repetition penalty's part of the context).
        vocab_size: V of the target's logits.

    State, on the logits' device from the first call: ``counts`` float32 [V], how often each
    token was generated (committed) so far; ``seen`` bool [V], the prompt's tokens; ``bias``
    float32 [V]; and, kept up to date at each commit, ``cols`` int64 [C], the only columns any
    processor changes (prompt or generated tokens under a repetition penalty, generated tokens
    under frequency/presence, biased tokens), with their ``hit`` bool [C] (the repetition
    penalty applies) and ``offset`` float32 [C] (``f * count + e * (count > 0) - bias``,
    subtracted). A step then costs one copy of the block's logits plus work on C columns.
    """

    def __init__(self, sampling: Sampling, prompt: list[int], vocab_size: int):
        self.s = sampling
        self.vocab = vocab_size
        self.rep = sampling.repetition_penalty != 1.0
        self.shift = bool(sampling.frequency_penalty or sampling.presence_penalty
                          or sampling.logit_bias)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)        # [V]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)             # [V]
        if self.rep and prompt:
            self.seen[torch.tensor(prompt, dtype=torch.int64)] = True
        self.bias = torch.zeros(vocab_size, dtype=torch.float32)          # [V]
        if sampling.logit_bias:
            ids, vals = zip(*sampling.logit_bias, strict=True)
            self.bias[torch.tensor(ids, dtype=torch.int64)] = torch.tensor(vals)
        self._refresh()

    def _offset(self, counts: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """What is subtracted from a logit with these ``counts`` and ``bias`` (any shape):
        one formula for the whole row and for the block's corrected entries, so that both
        round alike."""
        s = self.s
        return (counts * s.frequency_penalty + (counts > 0).float() * s.presence_penalty) - bias

    def _refresh(self) -> None:
        seen = self.seen | (self.counts > 0)
        changed = (seen if self.rep else self.counts > 0) | (self.bias != 0)
        self.cols = changed.nonzero()[:, 0]                               # [C]
        self.hit = seen[self.cols]                                        # [C]
        self.offset = self._offset(self.counts[self.cols], self.bias[self.cols])   # [C]

    def _to(self, device: torch.device) -> None:
        if self.counts.device != device:
            self.counts, self.seen = self.counts.to(device), self.seen.to(device)
            self.bias = self.bias.to(device)
            self._refresh()

    def commit(self, tokens: list[int]) -> None:
        """Tokens the request emitted (committed) this step, in order."""
        if tokens:
            idx = torch.tensor(tokens, dtype=torch.int64, device=self.counts.device)
            self.counts.index_put_((idx,), torch.ones(len(tokens), device=idx.device),
                                   accumulate=True)
            self._refresh()

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        r = self.s.repetition_penalty
        return torch.where(x > 0, x / r, x * r)

    def apply(self, logits: torch.Tensor, tokens: list[int] | None = None,
              parents: list[int] | None = None) -> torch.Tensor:
        """Process a verified block's logits with each row's own penalty state.

        Args:
            logits: float ``[n + 1, V]``; row j scores the token after block index j of
                ``[anchor] + tokens`` (the anchor is already committed, so in ``counts``).
            tokens: the block's n token ids after the anchor (drafts or tree nodes); None or
                empty for a single row (plain decode, the first token after prefill).
            parents: ``n + 1`` block indices, ``parents[0] = -1`` (a tree,
                ``verifier_svc.tree.DraftTree.parents``); None = the chain.

        Returns:
            New float32 ``[n + 1, V]`` logits (``logits`` itself is not changed): row j
            processed with counts = ``counts`` + the tokens of block indices 1..j on its path.
            Every row is first processed with the committed state (only its ``cols`` change);
            then the entries of the tokens on each row's path, the only ones whose state
            differs, are recomputed from the raw logits with their own counts.

        Raises:
            ValueError: when ``logits`` is not ``[len(tokens) + 1, V]`` or ``parents`` has the
                wrong length.
        """
        n = 0 if tokens is None else len(tokens)
        if logits.dim() != 2 or logits.shape[0] != n + 1 or logits.shape[1] != self.vocab:
            raise ValueError(f"logits: expected [{n + 1}, {self.vocab}], got {tuple(logits.shape)}")
        if parents is not None and len(parents) != n + 1:
            raise ValueError(f"parents: expected {n + 1} entries, got {len(parents)}")
        self._to(logits.device)
        raw = logits.float()
        x = raw.clone()
        if len(self.cols):
            v = raw[:, self.cols]                                          # [n+1, C]
            if self.rep:
                v = torch.where(self.hit, self._repeat(v), v)
            x[:, self.cols] = v - self.offset if self.shift else v
        if n:
            rows, toks, extra = _path_entries(list(tokens), parents or chain_parents(n))
            dev = logits.device
            rows, toks = rows.to(dev), toks.to(dev)
            v = raw[rows, toks]                                            # [P]
            if self.rep:           # a token on the path is in the context: always penalised
                v = self._repeat(v)
            if self.shift:
                v = v - self._offset(self.counts[toks] + extra.to(dev), self.bias[toks])
            x[rows, toks] = v
        return x


def _path_entries(tokens: list[int], parents: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (row, token) entries whose state differs from the committed one: for each block
    row, each distinct token on its root-to-row path (the row itself included, the root
    excluded), with how often it occurs there. int64 rows, int64 tokens, float32 counts, [P]."""
    rows: list[int] = []
    toks: list[int] = []
    extra: list[float] = []
    paths: list[dict[int, int]] = [{}]          # per row: token -> occurrences on its path
    for j in range(1, len(parents)):
        path = dict(paths[parents[j]])
        path[tokens[j - 1]] = path.get(tokens[j - 1], 0) + 1
        paths.append(path)
        for t, c in path.items():
            rows.append(j)
            toks.append(t)
            extra.append(float(c))
    return (torch.tensor(rows, dtype=torch.int64), torch.tensor(toks, dtype=torch.int64),
            torch.tensor(extra, dtype=torch.float32))


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int
                   ) -> list[TokenLogprob]:
    """Log-probabilities of emitted tokens from the target's raw logits.

    Args:
        logits: float ``[R, V]``, the raw (unprocessed) logits of a verified block.
        rows: for each emitted token, the row of ``logits`` that emitted it (chains:
            ``0..m-1``; trees: the root then the accepted path's block indices).
        tokens: the emitted token ids, ``len(tokens) == len(rows)``.
        top: how many alternatives to return per token, most likely first (at most V).

    Returns:
        One :class:`TokenLogprob` per token: ``log_softmax`` (float32) of its row at the token,
        and the row's ``top`` largest log-probabilities and their ids. Only the given rows are
        normalised.
    """
    if len(rows) != len(tokens):
        raise ValueError(f"rows: {len(rows)} entries, but tokens has {len(tokens)}")
    if not rows:
        return []
    dev = logits.device
    lp = logits[torch.tensor(rows, dtype=torch.int64, device=dev)].float().log_softmax(-1)
    tok = lp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=dev)[:, None])[:, 0]
    if top:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    else:
        vals = ids = [[] for _ in rows]
    return [TokenLogprob(token_id=t, logprob=v, top_ids=i, top_logprobs=tv)
            for t, v, i, tv in zip(tokens, tok.tolist(), ids, vals, strict=True)]
