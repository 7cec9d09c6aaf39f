"""Mask cost per token of llguidance, xgrammar and outlines-core on one tokenizer (single thread).

Usage: python scripts/grammar_engines_bench.py [TOKENIZER_DIR]  (default: SmolLM2-135M-Instruct's).
Walks each engine's matcher along one fixed valid JSON answer to a small schema, timing the
mask computation at every position; prints compile seconds and the median / p90 mask time.
The figures that chose the engine are in docs/structured-outputs.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "active": {"type": "boolean"}}, "required": ["name", "age", "city", "tags", "active"],
    "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London",
                     "tags": ["mathematician", "writer"], "active": False})


def _stats(name: str, compile_s: float, times: list[float]) -> None:
    times = sorted(times)
    print(f"{name:14s} compile {compile_s * 1e3:8.1f} ms  mask median {statistics.median(times) * 1e6:8.1f} us"
          f"  p90 {times[int(0.9 * len(times))] * 1e6:8.1f} us  ({len(times)} tokens)")


def bench_llguidance(tok_dir: str, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(hf)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llguidance.LLMatcher(lt, grammar)
    c = time.perf_counter() - t0
    times = []
    for t in ids:
        s = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - s)
        assert m.consume_token(t), t
    _stats("llguidance", c, times)


def bench_xgrammar(tok_dir: str, ids: list[int]) -> None:
    import transformers
    import xgrammar as xgr
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf)
    comp = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    m = xgr.GrammarMatcher(comp)
    c = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t), t
    _stats("xgrammar", c, times)


def bench_outlines(tok_dir: str, ids: list[int]) -> None:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = outlines_core.Vocabulary.from_pretrained(tok_dir)
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    guide = outlines_core.Guide(index)
    c = time.perf_counter() - t0
    times = []
    for t in ids:
        s = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - s)
        guide.advance(t)
    _stats("outlines-core", c, times)


def main() -> None:
    tok_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.cache/dflash-serve/smollm2-135m-instruct")
    import transformers
    ids = transformers.AutoTokenizer.from_pretrained(tok_dir).encode(ANSWER, add_special_tokens=False)
    for fn in (bench_llguidance, bench_xgrammar, bench_outlines):
        try:
            fn(tok_dir, ids)
        except Exception as e:  # noqa: BLE001 - one engine's failure is a result to print
            print(f"{fn.__name__}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
