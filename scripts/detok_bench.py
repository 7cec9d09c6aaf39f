"""Per-token cost of the gateway's detokenizer at 100, 1000 and 4000 output tokens.

``old``: the detokenizer before the window (every token re-decodes all ids and searches the
whole text); ``new``: ``gateway.detok.IncrementalDetokenizer`` (a window of a few ids per token).
Both stream the same ids one token at a time with two stop strings that never match (the
holdback and search run, as in a request with stops). A figure for docs, not a timed test:

    .venv/bin/python scripts/detok_bench.py [--tokenizer DIR] [--lengths 100,1000,4000]

The default tokenizer is SmolLM2-135M-Instruct's when ``dflash setup-target`` has fetched it,
else the tiny byte-level one (one token per UTF-8 byte) written to a temporary directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.detok import REPLACEMENT, Delta, IncrementalDetokenizer  # noqa: E402

TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number (😀 世界, ©).\"\"\"\n"
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n")
STOPS = ["<|never|>", "\nclass Unused"]


class FullDecodeDetokenizer:
    """The previous algorithm, kept here as the baseline: decode every id at every token."""

    def __init__(self, tokenizer, stop=()):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> Delta:
        out = []
        for t in token_ids:
            self.ids.append(t)
            full = self.tok.decode(self.ids, skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
            start = max(0, len(self.emitted) - max(len(s) for s in self.stop))
            if any(full.find(s, start) >= 0 for s in self.stop):
                self.stopped = True
                break
            safe = full.rstrip(REPLACEMENT)
            safe = safe[:len(safe) - self._stop_prefix_len(safe)]
            if len(safe) > len(self.emitted) and safe.startswith(self.emitted):
                out.append(safe[len(self.emitted):])
                self.emitted = safe
        return Delta("".join(out), [])

    def _stop_prefix_len(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def per_token_us(make, ids: list[int], repeats: int) -> float:
    """Best of ``repeats`` runs: microseconds per pushed token."""
    best = float("inf")
    for _ in range(repeats):
        d = make()
        t0 = time.perf_counter()
        for t in ids:
            d.push([t])
        best = min(best, time.perf_counter() - t0)
    return best / len(ids) * 1e6


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path is None:
        from dflash.train.target_setup import default_cache_dir

        smollm = default_cache_dir() / "smollm2-135m-instruct"
        if (smollm / "tokenizer.json").exists():
            path = str(smollm)
        else:
            from dflash_app.testing import write_byte_tokenizer

            path = tempfile.mkdtemp(prefix="detok-bench-")
            write_byte_tokenizer(Path(path))
    return path, AutoTokenizer.from_pretrained(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="tokenizer directory (default: SmolLM2's, else the tiny one)")
    p.add_argument("--lengths", default="100,1000,4000", help="output lengths in tokens")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    path, tok = load_tokenizer(a.tokenizer)
    lengths = [int(x) for x in a.lengths.split(",")]
    ids = tok.encode(TEXT * (max(lengths) // 10 + 1), add_special_tokens=False)
    print(f"tokenizer {path}; one token per push, stop strings {STOPS!r}")
    print(f"{'tokens':>7} {'old us/token':>13} {'new us/token':>13} {'old/new':>8}")
    for n in lengths:
        cut = ids[:n]
        repeats = a.repeats if n <= 1000 else 1
        old = per_token_us(lambda: FullDecodeDetokenizer(tok, STOPS), cut, repeats)
        new = per_token_us(lambda: IncrementalDetokenizer(tok, STOPS), cut, a.repeats)
        # Both produce the same text (the bench would be meaningless otherwise).
        o, w = FullDecodeDetokenizer(tok, STOPS), IncrementalDetokenizer(tok, STOPS)
        for t in cut:
            o.push([t])
            w.push([t])
        assert w.emitted == o.emitted, "old and new detokenizers disagree"
        print(f"{n:>7} {old:>13.1f} {new:>13.1f} {old / new:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
