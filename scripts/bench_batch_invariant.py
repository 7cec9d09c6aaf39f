"""What batch-invariant mode costs the target's forwards: default kernels (tuned at start, as the
verifier does) against ``batch_invariant=True``, interleaved, on the real SmolLM2 target.

Shapes: a decode (1 token) and a verify of 16 after ``--context`` cached positions, at batch 1
and batch 8 (eight sessions of different lengths), and a prefill chunk of ``--prefill`` tokens.
Each shape is timed ``--reps`` times per mode, the modes alternating call by call, and the
medians are printed side by side with their ratio (invariant / default). Also checks, per
dtype, that the invariant target's verify-16 logits equal 16 decodes bit for bit.

    .venv/bin/python scripts/bench_batch_invariant.py --dtypes float32,bfloat16 --out docs/bench/batch-invariant-xeon
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def shapes(model, context: int, prefill: int):
    """{name: callable} of the timed forwards on ``model`` (each leaves its caches as found)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (context + 64,), generator=g).tolist()
    one = model.new_cache()
    model.forward(ids[:context], one, None, logits_to_keep=1)
    batch = []
    for i in range(8):
        c = model.new_cache()
        model.forward(ids[:context - 8 * i], c, None, logits_to_keep=1)
        batch.append(c)
    block = ids[context:context + 16]

    def step(caches, q):
        lens = [c.get_seq_length() for c in caches]
        if len(caches) == 1:
            model.forward(block[:q], caches[0], None)
        else:
            model.forward_batch([block[:q]] * len(caches), caches, [()] * len(caches))
        for c, n in zip(caches, lens):
            model.crop(c, n)

    def pre():
        c = model.new_cache()
        model.forward(ids[:prefill], c, None, logits_to_keep=1)

    return {"decode b1": lambda: step([one], 1), "verify16 b1": lambda: step([one], 16),
            "decode b8": lambda: step(batch, 1), "verify16 b8": lambda: step(batch, 16),
            f"prefill {prefill}": pre}


def invariant_check(model, context: int) -> bool:
    """The model's verify of 16 after ``context`` positions equals 16 one-token decodes."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.vocab_size, (context + 16,), generator=g).tolist()
    a, b = model.new_cache(), model.new_cache()
    model.forward(ids[:context], a, None, logits_to_keep=1)
    model.forward(ids[:context], b, None, logits_to_keep=1)
    block, _ = model.forward(ids[context:], a, None)
    singles = torch.stack([model.forward([t], b, None)[0][-1] for t in ids[context:]])
    return bool(torch.equal(block, singles))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target dir (default: the SmolLM2 target)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", type=Path, default=None, help="folder for results.json + README.md")
    a = p.parse_args()
    from dflash.train.target_setup import setup_target
    from verifier_svc.target import TargetModel

    target = a.target or str(setup_target())
    rows, checks = [], {}
    for dt in a.dtypes.split(","):
        models = {"default": TargetModel(target, dtype=dt, skinny_max_rows=-1, packed_linear="auto",
                                         panel_linear="auto"),
                  "invariant": TargetModel(target, dtype=dt, batch_invariant=True)}
        models["default"].tune_skinny()
        checks[dt] = {m: invariant_check(x, a.context) for m, x in models.items()}
        runs = {m: shapes(x, a.context, a.prefill) for m, x in models.items()}
        for name in runs["default"]:
            times: dict[str, list[float]] = {"default": [], "invariant": []}
            for r in range(a.reps + 1):
                for m in (("default", "invariant") if r % 2 else ("invariant", "default")):
                    t0 = time.perf_counter()
                    runs[m][name]()
                    if r:                               # the first round warms both
                        times[m].append(time.perf_counter() - t0)
            d, i = (statistics.median(times[m]) * 1e3 for m in ("default", "invariant"))
            rows.append({"dtype": dt, "shape": name, "default_ms": round(d, 2),
                         "invariant_ms": round(i, 2), "ratio": round(i / d, 3)})
            print(f"{dt:9s} {name:14s} default {d:8.2f} ms  invariant {i:8.2f} ms  x{i / d:.3f}",
                  flush=True)
        print(f"{dt}: verify16 == 16 decodes bit for bit: {checks[dt]}", flush=True)
    meta = {"cpu": _cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "context": a.context, "prefill": a.prefill, "reps": a.reps}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                        "bit_identical": checks}, indent=1))
        lines = [f"# Batch-invariant mode: cost of the target's forwards ({meta['cpu']})", "",
                 f"`python scripts/bench_batch_invariant.py --dtypes {a.dtypes} --context "
                 f"{a.context} --prefill {a.prefill} --reps {a.reps}`; medians, modes interleaved; "
                 f"{meta['threads']} threads, torch {meta['torch']}.", "",
                 "| dtype | shape | default ms | invariant ms | invariant / default |",
                 "|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['shape']} | {r['default_ms']} | {r['invariant_ms']} | "
                  f"{r['ratio']} |" for r in rows]
        lines += ["", "verify of 16 == 16 one-token decodes, bit for bit: " + ", ".join(
            f"{dt}: default {c['default']}, invariant {c['invariant']}" for dt, c in checks.items())]
        (a.out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
