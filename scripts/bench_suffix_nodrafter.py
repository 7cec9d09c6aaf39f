#!/usr/bin/env python3
"""Mode ``suffix`` with the drafter stopped (figures: docs/bench/suffix-history/README.md): the
stack started as ``dflash up`` starts it, its drafter process killed, then ``dflash bench
--spec-modes suffix`` (suffix and speculation off interleaved per prompt) on each prompt set
against the running gateway, whose verifier still has the dead drafter's address. Results in
``docs/bench/suffix-nodrafter-<set>-<tag>/``; a set already there is skipped.

    python scripts/bench_suffix_nodrafter.py [--tag amd] [--limit 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash.train.target_setup import setup_target
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig

ROOT = Path(__file__).resolve().parents[1]
SETS = ("humaneval", "chat", "data/bench/edit.jsonl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="amd")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--suffix-corpus", default="", help="the verifier's --suffix-corpus (e.g. data/train)")
    a = p.parse_args()
    cfg = StackConfig(target=str(setup_target()), gateway_port=52050, verifier_port=52051,
                      drafters=[DrafterSpec(path=str(ROOT / "models/smollm2-dflash-b16"), port=52061)],
                      run_dir=tempfile.mkdtemp(prefix="nodrafter-"),
                      # each prompt runs in both modes: no answer of one may be the other's candidate
                      verifier_args=["--suffix-answer-tokens", "0"]
                      + (["--suffix-corpus", a.suffix_corpus] if a.suffix_corpus else []))
    with LocalStack(cfg) as stack:
        drafter = stack.procs["drafter0"]
        drafter.kill()
        drafter.wait()
        print(f"drafter stopped (exit {drafter.returncode}); verifier and gateway up", flush=True)
        for s in SETS:
            out = ROOT / f"docs/bench/suffix-nodrafter-{Path(s).stem}-{a.tag}"
            if (out / "bench.json").exists():
                print(f"skip {out}")
                continue
            out.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "dflash_app.cli", "bench", "--gateway",
                            stack.gateway_addr, "--prompts", s, "--limit", str(a.limit),
                            "--max-tokens", "128", "--spec-modes", "suffix", "--out", str(out)],
                           check=True, cwd=ROOT)
            print((out / "bench.md").read_text().split("\n\n")[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
