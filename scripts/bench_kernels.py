"""Triton verification kernels vs their torch references on one CUDA GPU; prints a markdown table.

    python scripts/bench_kernels.py                      # batch 1 8 32 128, vocab 49152 151936, block 16
    python scripts/bench_kernels.py --batch 1 8 --vocab 151936 --iters 50
    python scripts/bench_kernels.py --smoke              # CPU, TRITON_INTERPRET=1, tiny shapes:
                                                         # checks this script, not the speed

Every row is checked for bit-equality with the reference before it is timed (column ``exact``).
Times are medians over ``--iters`` runs after warm-up, measured with CUDA events. Greedy takes
bf16 logits ``[batch, block, vocab]``; rejection sampling float32 ``q`` ``[batch, block - 1,
vocab]``, ``p`` and ``E`` ``[batch, block, vocab]``; packing takes ``batch`` sequences of 1..block
committed rows of ``--hidden`` bf16 features.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout uninstalled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--block", type=int, default=16, help="block size B (K = B - 1 drafts)")
    ap.add_argument("--hidden", type=int, default=5 * 2048,
                    help="feature width for packing (tapped layers x target hidden)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", nargs="+", default=["greedy", "rejection", "pack"],
                    choices=["greedy", "rejection", "pack"])
    ap.add_argument("--smoke", action="store_true",
                    help="run on the CPU under the Triton interpreter with tiny shapes")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.vocab, args.block, args.hidden = [1, 2], [1000], 4, 64
        args.iters, args.warmup = 1, 0
    return args


def median_ms(fn: Callable[[], object], *, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_inputs(op: str, batch: int, vocab: int, block: int, hidden: int, device: str,
                gen: torch.Generator) -> tuple:
    k = block - 1
    if op == "greedy":
        logits = torch.randn(batch, k + 1, vocab, device=device, generator=gen).bfloat16()
        drafts = logits.argmax(-1)[:, :k].contiguous()
        drafts[:, k // 2:] = 0  # accept about half the block
        return drafts, logits
    if op == "rejection":
        q = torch.softmax(torch.randn(batch, k, vocab, device=device, generator=gen), -1)
        p = torch.softmax(torch.randn(batch, k + 1, vocab, device=device, generator=gen), -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
        u = torch.rand(batch, k, device=device, generator=gen)
        e = torch.empty(batch, k + 1, vocab, device=device).exponential_(generator=gen)
        return drafts, q, p, u, e
    hidden_states = torch.randn(batch, block, hidden, device=device, generator=gen).bfloat16()
    lengths = torch.randint(1, block + 1, (batch,), generator=gen, device=device).tolist()
    return ([hidden_states[i, :n] for i, n in enumerate(lengths)],)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
        device = "cpu"
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA device is available; this benchmark needs a GPU "
              "(use --smoke to check the script on the CPU under the Triton interpreter).",
              file=sys.stderr)
        return 2
    else:
        device = "cuda"
    try:
        from kernels import reference, triton_greedy, triton_pack, triton_rejection
    except ImportError as exc:
        print(f"bench_kernels: triton is not importable ({exc}); "
              "install it with: pip install -e '.[kernels]'", file=sys.stderr)
        return 2
    pairs = {
        "greedy": (reference.greedy_accept, triton_greedy.greedy_accept),
        "rejection": (reference.rejection_sample, triton_rejection.rejection_sample),
        "pack": (reference.pack_features, triton_pack.pack_features),
    }
    gen = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter smoke run)"
    print(f"# Verification kernels, {name}, block {args.block}, torch {torch.__version__}\n")
    print("| op | batch | vocab | reference (us) | triton (us) | speedup | exact |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for op in args.ops:
        ref_fn, tri_fn = pairs[op]
        for vocab in (args.vocab if op != "pack" else [None]):
            for batch in args.batch:
                inputs = make_inputs(op, batch, vocab or 0, args.block, args.hidden, device, gen)
                exact = all(torch.equal(a, b) for a, b in zip(ref_fn(*inputs), tri_fn(*inputs)))
                t_ref, t_tri = (median_ms(lambda fn=fn, inputs=inputs: fn(*inputs), iters=args.iters,
                                          warmup=args.warmup, cuda=device == "cuda")
                                for fn in (ref_fn, tri_fn))
                label = vocab if vocab is not None else f"C={args.hidden}"
                print(f"| {op} | {batch} | {label} | {t_ref * 1e3:.1f} | {t_tri * 1e3:.1f} "
                      f"| {t_ref / t_tri:.2f}x | {'yes' if exact else 'NO'} |", flush=True)
                del inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
