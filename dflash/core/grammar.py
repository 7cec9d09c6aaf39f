"""Grammar-constrained decoding: what a request asks for (:class:`GrammarSpec`), its compilation
(cached and bounded, :class:`GrammarCache`), and one request's matcher (:class:`GrammarState`):
the mask of every verified position along each path of a draft tree, the pruning of drafts the
grammar refuses, and the tokens the grammar forces.

Engine: llguidance (``LLMatcher``; why: docs/structured-outputs.md). The matcher advances only on
committed tokens. A verified block ``[anchor] + tokens`` with ``parents`` (a chain or a tree) is
walked depth first on that one matcher: at block index j the matcher holds the committed tokens
plus the tokens of j's root-to-node path, its mask is row j's, and each child whose token the
mask refuses is pruned with its subtree (it could never be accepted: the masked target gives it
probability 0); ``consume_token`` + ``rollback(1)`` per edge, so the matcher ends where it began.

Masks are bool ``[V]`` over the target's vocabulary (ids the grammar's tokenizer lacks are
refused). Applied as ``logits.masked_fill(~mask, -inf)`` on the processed logits, greedy takes
the argmax of the masked logits and sampling draws from the masked, renormalised distribution
(``dflash.core.sampling.probs_from_logits``), so speculation is lossless with respect to
constrained decoding without it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash.core.sampling import InvalidParam

__all__ = ["GRAMMAR_KINDS", "MAX_GRAMMAR_CHARS", "GrammarSpec", "GrammarTokenizer", "GrammarCache",
           "GrammarState", "choice_lark"]

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 65536          # a schema, regex or grammar's text (a larger one is refused)
MAX_CHOICES = 256
MAX_FORCED = 16                    # forced tokens offered per step (a block's positions)
# The parser's bounds (llguidance ParserLimits): compilation and each mask step run out of fuel
# instead of running long, and the lexer's states (1-2 kB each) bound a matcher's memory.
LIMITS: dict[str, int | bool] = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=20_000, max_grammar_size=200_000,
              verbose_errors=False)
# Compact JSON without free whitespace: the grammar then forces every separator and key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    import llguidance  # imported on first use: only structured requests pay it
    return llguidance


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint.

    ``kind``: one of :data:`GRAMMAR_KINDS`; ``text``: the JSON schema (JSON text; ignored for
    ``json_object``), the regex, the choices (a JSON array of strings) or the Lark grammar;
    ``field``: the request field it came from, named by every error
    (``response_format.json_schema.schema``).

    Raises:
        InvalidParam: naming ``field``, for an unknown kind or a text over
            :data:`MAX_GRAMMAR_CHARS`.
    """

    kind: str
    text: str = ""
    field: str = "structured_output"

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidParam(self.field, f"kind {self.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidParam(self.field, f"{len(self.text)} characters, more than {MAX_GRAMMAR_CHARS}")


def choice_lark(choices: list[str], field: str) -> str:
    """A Lark grammar for exactly one of ``choices`` (non-empty strings, at most
    :data:`MAX_CHOICES`). Raises InvalidParam naming ``field``."""
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
        raise InvalidParam(field, f"must be a list of 1 to {MAX_CHOICES} strings")
    if any(not isinstance(c, str) or not c for c in choices):
        raise InvalidParam(field, "every choice must be a non-empty string")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _grammar_of(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec``; InvalidParam naming its field when the text is
    not what its kind needs (schema not JSON, choices not a list of strings)."""
    M = _llg().LLMatcher
    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object":
            schema: object = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.text)
            except ValueError as e:
                raise InvalidParam(spec.field, f"not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParam(spec.field, "a JSON schema must be an object or a boolean")
        try:
            return M.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidParam(spec.field, str(e)) from None
    if spec.kind == "regex":
        return M.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.text)
        except ValueError:
            choices = None
        return M.grammar_from_lark(choice_lark(choices, spec.field))
    return M.grammar_from_lark(spec.text)


class GrammarTokenizer:
    """The grammar engine's view of the target's tokenizer (llguidance ``LLTokenizer``).

    Args:
        hf_tokenizer: a transformers fast tokenizer (the target's).
        vocab_size: V of the target's logits (>= the tokenizer's size; the ids it lacks are
            always refused).
        eos_token_ids: the ids a finished grammar admits (the target's EOS ids).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import llguidance.hf
        self.vocab_size = vocab_size
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                               eos_token=sorted(eos_token_ids) or None)
        self.eos = torch.zeros(vocab_size, dtype=torch.bool)
        self.eos[torch.tensor(self.ll.eos_tokens, dtype=torch.int64)] = True

    @staticmethod
    def from_dir(path: str | Path, vocab_size: int, eos_token_ids: list[int]) -> "GrammarTokenizer":
        """From the tokenizer files in ``path`` (a model directory)."""
        from transformers import AutoTokenizer
        return GrammarTokenizer(AutoTokenizer.from_pretrained(str(path)), vocab_size, eos_token_ids)


class GrammarCache:
    """Compiled grammars, cached per spec (least recently used dropped first).

    ``max_entries`` and ``max_chars`` (summed grammar text) bound its memory; each compile and
    each mask step is bounded by the parser's fuel and sizes (``limits``, llguidance
    ``LLParserLimits`` keywords; default :data:`LIMITS`), so a hostile grammar fails, it never
    runs long. Thread-safe (the gRPC threads validate requests concurrently).
    """

    def __init__(self, tokenizer: GrammarTokenizer, max_entries: int = 256,
                 max_chars: int = 16 << 20, limits: dict[str, int | bool] | None = None):
        self.tokenizer = tokenizer
        self.limits = dict(LIMITS if limits is None else limits)
        self.max_entries, self.max_chars = max_entries, max_chars
        self._lru: collections.OrderedDict[GrammarSpec, str] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def chars(self) -> int:
        return self._chars

    def compile(self, spec: GrammarSpec) -> str:
        """The validated grammar of ``spec``.

        Raises:
            InvalidParam: naming ``spec.field``: an invalid schema, an unsupported keyword, a
                grammar over the parser's limits (too large or too slow to compile), a regex or
                grammar that matches nothing.
        """
        with self._lock:
            if spec in self._lru:
                self._lru.move_to_end(spec)
                self.hits += 1
                return self._lru[spec]
        t0 = time.perf_counter()
        grammar = _grammar_of(spec)
        llg = _llg()
        limits = llg.LLParserLimits(**self.limits)
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer.ll,
                                                                       limits=limits)
        if is_error:
            raise InvalidParam(spec.field, msgs[0].strip() if msgs else "invalid grammar")
        m = llg.LLMatcher(self.tokenizer.ll, grammar, log_level=0, limits=limits)
        m.compute_bitmask()
        if m.is_error() or (m.is_stopped() and not m.is_accepting()):
            raise InvalidParam(spec.field, "matches nothing (no output satisfies it)")
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0
            if spec not in self._lru:
                self._lru[spec] = grammar
                self._chars += len(grammar)
            while self._lru and (len(self._lru) > self.max_entries or self._chars > self.max_chars):
                _, g = self._lru.popitem(last=False)
                self._chars -= len(g)
        return grammar

    def state(self, spec: GrammarSpec) -> "GrammarState":
        """A fresh matcher for one request (compiles ``spec`` on a miss; raises as
        :meth:`compile`)."""
        return GrammarState(self.tokenizer, self.compile(spec), spec.field, self.limits)


class GrammarState:
    """One request's matcher: it holds the tokens committed so far, never a draft.

    Args:
        tokenizer: the grammar tokenizer of the target.
        grammar: a grammar from :meth:`GrammarCache.compile`.
        field: the request field the grammar came from (errors name it).
        limits: the parser's limits (:class:`GrammarCache`'s).
    """

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, field: str = "structured_output",
                 limits: dict[str, int | bool] | None = None):
        llg = _llg()
        self.tok = tokenizer
        self.field = field
        self.m = llg.LLMatcher(tokenizer.ll, grammar, log_level=0,
                               limits=llg.LLParserLimits(**(LIMITS if limits is None else limits)))
        self.vocab = tokenizer.vocab_size
        self.mask_seconds = 0.0
        self.masks = 0

    def _mask(self) -> torch.Tensor:
        """bool [V]: the tokens the matcher's current state admits (EOS alone once it is in
        error or finished: a row is never fully masked)."""
        t0 = time.perf_counter()
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:self.vocab]
        mask = torch.from_numpy(bits.astype(np.bool_))
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        if self.m.is_error() or not bool(mask.any()):
            return self.tok.eos.clone()
        return mask

    def mask(self) -> torch.Tensor:
        """bool [V]: the mask of the next token after the committed ones."""
        return self._mask()

    @property
    def accepting(self) -> bool:
        """Whether the committed tokens complete the grammar (EOS is admitted)."""
        return self.m.is_accepting()

    def commit(self, tokens: list[int]) -> None:
        """Tokens the request committed, in order (each admitted by its row's mask)."""
        for t in tokens:
            if self.m.is_stopped() or self.tok.eos[t]:
                break                      # the finished grammar admits EOS only; nothing follows
            self.m.consume_token(t)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the committed ones (llguidance's
        fast-forward tokens: the canonical tokenisation of the bytes the grammar forces)."""
        if limit <= 0 or self.m.is_stopped():
            return []
        return self.m.compute_ff_tokens()[:limit]

    def walk(self, tokens: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor]:
        """Prune a verified block and mask each kept row with its own path's state.

        Args:
            tokens: the block's n tokens after the anchor (chain drafts or tree nodes).
            parents: ``n + 1`` block indices, ``parents[0] = -1`` (a chain: ``[-1, 0, ..., n - 1]``).

        Returns:
            ``(keep, masks)``: ``keep`` the kept block indices, increasing, 0 first (a node is
            kept iff every token on its path is admitted by its parent's mask; an EOS node keeps
            no children); ``masks`` bool ``[len(keep), V]``, row i the mask after the path of
            block index ``keep[i]``. The matcher ends in its committed state.
        """
        children: list[list[int]] = [[] for _ in parents]
        for j in range(1, len(parents)):
            children[parents[j]].append(j)
        rows: dict[int, torch.Tensor] = {}

        def visit(j: int) -> None:              # the matcher holds j's path
            mask = rows[j] = self._mask()
            for c in children[j]:
                t = tokens[c - 1]
                if not 0 <= t < self.vocab or not mask[t]:
                    continue                    # refused: pruned with its subtree
                if self.tok.eos[t]:
                    rows[c] = self.tok.eos.clone()    # cut at the stop: nothing after it is read
                    continue
                self.m.consume_token(t)
                visit(c)
                self.m.rollback(1)

        visit(0)
        return self._finish(rows)

    def _finish(self, rows: dict[int, torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        keep = sorted(rows)
        return keep, torch.stack([rows[j] for j in keep])
