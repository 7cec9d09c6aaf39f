"""What a tree verify costs on the real target: the curve tree verification (DDTree) rests on.

    python scripts/tree_verify_cost.py [--context 300] [--nodes 4,8,16,32] [--reps 15]
                                       [--skinny-max-rows -1] [--packed-linear auto]
                                       [--panel-linear auto]
                                       [--threads 0] [--json out.json]
                                       [--batch 1]

One session with ``--context`` cached positions (batch 1), then, interleaved round by round so
drift and other load on the machine fall on every shape alike:

* ``decode``: a 1-token forward (speculation off);
* ``chain N``: a chain block of N + 1 tokens (anchor + N drafts);
* ``tree N``: a tree of N nodes + the anchor (``TargetModel.forward`` with ``parents``), shaped
  by ``verifier_svc.tree.build_tree`` from synthetic drafter top-k log-probs (rank r at each
  position with probability ~0.45 * 0.5^r: most mass on siblings at the first depths, as the
  issue's simulation found; the shape changes only the mask, not the work);
* ``keep N``: the ``TargetModel.keep`` after that tree, of its deepest path (the compaction).

Each forward is followed by a crop back to ``--context`` (not timed). Printed: a table of the
median ms, each median over decode's and, per size, the median of the per-round ratio tree /
chain (paired, so drift between rounds cancels); ``--json`` also writes every sample. The target is
``dflash_app.target_setup``'s SmolLM2 unless ``--target`` names another directory.
"""

from __future__ import annotations

from dflash.serving.omp import default_spin_count

default_spin_count()   # as the verifier does, before torch loads libgomp

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def synthetic_tree(n: int, depth: int = 15, k: int = 8):
    """A DDTree of ``n`` nodes (``build_tree``) over ``depth`` positions of top-``k`` log-probs
    ``log(0.45 * 0.5^r)`` (rank r), the same at every position; token ids are placeholders."""
    from verifier_svc.tree import build_tree

    row = [math.log(0.45 * 0.5 ** r) for r in range(k)]
    lp = torch.tensor([row] * depth, dtype=torch.float32)
    ids = torch.arange(depth * k, dtype=torch.int64).reshape(depth, k) + 1000
    return build_tree(ids, lp, n)


def deepest_path(parents: list[int], depths: list[int]) -> list[int]:
    """Block indices root -> the deepest node (the offsets a keep of that path gets)."""
    j = max(range(len(depths)), key=lambda i: (depths[i], -i))
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def main() -> None:
    from kernels.skinny_linear import AUTO
    from verifier_svc.target import TargetModel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="", help="model directory (default: the SmolLM2 target)")
    p.add_argument("--context", type=int, default=300, help="cached positions before each verify")
    p.add_argument("--nodes", default="4,8,16,32", help="tree sizes (nodes, anchor not counted)")
    p.add_argument("--reps", type=int, default=15, help="timed rounds (one untimed warm-up first)")
    p.add_argument("--skinny-max-rows", type=int, default=AUTO,
                   help="as the verifier's flag; -1 (default) = tune at start, as it does")
    p.add_argument("--packed-linear", default="auto", choices=("auto", "on", "off"),
                   help="as the verifier's flag; auto (default) = tune at start, as it does")
    p.add_argument("--panel-linear", default="auto", choices=("auto", "on", "off"),
                   help="as the verifier's flag; auto (default) = tune at start, as it does")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--batch", type=int, default=1,
                   help="sessions per forward (TargetModel.forward_batch; contexts staggered by "
                        "up to 7 positions): every session's block a chain, or every one a tree")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.target:
        path = a.target
    else:
        from dflash.train.target_setup import setup_target

        path = setup_target()
    t = TargetModel(path, skinny_max_rows=a.skinny_max_rows, packed_linear=a.packed_linear,
                    panel_linear=a.panel_linear)
    rows = t.tune_skinny()
    g = torch.Generator().manual_seed(0)
    vocab = min(t.vocab_size, 20000)
    caches, lens = [], []
    for i in range(max(a.batch, 1)):
        c = t.new_cache()
        n_ctx = a.context + (i % 8 if a.batch > 1 else 0)
        t.forward(torch.randint(100, vocab, (n_ctx,), generator=g).tolist(), c, None,
                  logits_to_keep=1)
        caches.append(c)
        lens.append(n_ctx)
    cache = caches[0]
    sizes = [int(x) for x in a.nodes.split(",")]
    trees = {n: synthetic_tree(n) for n in sizes}

    def tokens(q: int) -> list[int]:
        return torch.randint(100, vocab, (q,), generator=g).tolist()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    if a.batch > 1:
        return batched(a, t, caches, lens, sizes, trees, tokens, timed, path, rows)
    samples: dict[str, list[float]] = {"decode": []}
    for n in sizes:
        samples[f"chain {n}"], samples[f"tree {n}"], samples[f"keep {n}"] = [], [], []
    for rnd in range(a.reps + 1):
        got = {"decode": timed(lambda: t.forward(tokens(1), cache, None))}
        t.crop(cache, a.context)
        for n in sizes:
            blk = tokens(n + 1)
            got[f"chain {n}"] = timed(lambda blk=blk: t.forward(blk, cache, None))
            t.crop(cache, a.context)
            tree = trees[n]
            got[f"tree {n}"] = timed(lambda blk=blk, tree=tree: t.forward(blk, cache, None, parents=[tree.parents]))
            acc = deepest_path(tree.parents, tree.depths)
            got[f"keep {n}"] = timed(lambda acc=acc: t.keep(cache, a.context, acc))
            t.crop(cache, a.context)
        if rnd:                                   # round 0 warms up
            for k, v in got.items():
                samples[k].append(v)
    med, paired = summarize(samples, sizes)
    print(f"target {path}: {a.context} cached positions, batch 1, torch threads "
          f"{torch.get_num_threads()}, skinny rows {rows}, packed {t.packed_linear}, "
          f"panel {t.panel_linear}, "
          f"median of {a.reps} interleaved rounds")
    print(f"{'shape':<10} {'tokens':>6} {'depth':>5} {'ms':>8} {'x decode':>9} {'tree/chain':>10}")
    print(f"{'decode':<10} {1:>6} {'':>5} {med['decode']:>8.1f} {1.0:>9.2f}")
    for n in sizes:
        depth = trees[n].max_depth
        for kind, q, d in (("chain", n + 1, n), ("tree", n + 1, depth)):
            m = med[f"{kind} {n}"]
            ratio = f" {paired[n]:>10.3f}" if kind == "tree" else ""
            print(f"{kind + ' ' + str(n):<10} {q:>6} {d:>5} {m:>8.1f} {m / med['decode']:>9.2f}"
                  + ratio)
        print(f"{'keep ' + str(n):<10} {len(deepest_path(trees[n].parents, trees[n].depths)):>6} "
              f"{'':>5} {med[f'keep {n}']:>8.2f}")
    write_json(a, t, path, rows, samples, med, paired,
               tree_depths={n: trees[n].max_depth for n in sizes})


def summarize(samples: dict[str, list[float]], sizes: list[int]
              ) -> tuple[dict[str, float], dict[int, float]]:
    """Median ms per shape, and per size the median of the per-round ratio tree / chain (paired
    within each round, so drift between rounds cancels)."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    paired = {n: statistics.median([x / y for x, y in zip(samples[f"tree {n}"],
                                                           samples[f"chain {n}"])])
              for n in sizes}
    return med, paired


def write_json(a, t, path, rows, samples, med, paired, **extra) -> None:
    """With ``--json``: the run's settings, medians, paired ratios and every sample."""
    if not a.json:
        return
    with open(a.json, "w") as f:
        json.dump({"target": str(path), "context": a.context, "reps": a.reps,
                   "threads": torch.get_num_threads(), "skinny_max_rows": rows,
                   "packed_linear": t.packed_linear,
                   "panel_linear": t.panel_linear, **extra, "median_ms": med,
                   "tree_over_chain_paired": paired, "samples_ms": samples}, f, indent=1)


def batched(a, t, caches, lens, sizes, trees, tokens, timed, path, rows) -> None:
    """``--batch`` > 1: per round, one decode step of every session, then per size one batched
    forward with every session's block a chain and one with every block a tree (the same row
    count); each followed by crops back to the sessions' contexts (not timed)."""
    b = len(caches)

    def crop_all() -> None:
        for c, n in zip(caches, lens):
            t.crop(c, n)

    samples: dict[str, list[float]] = {"decode": []}
    for n in sizes:
        samples[f"chain {n}"], samples[f"tree {n}"] = [], []
    for rnd in range(a.reps + 1):
        got = {"decode": timed(lambda: t.forward_batch([tokens(1) for _ in caches], caches,
                                                       [()] * b))}
        crop_all()
        for n in sizes:
            blks = [tokens(n + 1) for _ in caches]
            got[f"chain {n}"] = timed(lambda blks=blks: t.forward_batch(blks, caches, [()] * b))
            crop_all()
            par = [trees[n].parents] * b
            got[f"tree {n}"] = timed(lambda blks=blks, par=par: t.forward_batch(
                blks, caches, [()] * b, parents=par))
            crop_all()
        if rnd:
            for k, v in got.items():
                samples[k].append(v)
    med, paired = summarize(samples, sizes)
    print(f"target {path}: batch {b}, {a.context}-{a.context + 7} cached positions, torch "
          f"threads {torch.get_num_threads()}, skinny rows {rows}, packed {t.packed_linear}, "
          f"panel {t.panel_linear}, "
          f"median of {a.reps} rounds")
    print(f"{'shape':<10} {'rows':>6} {'ms':>8} {'x decode':>9} {'tree/chain':>10}")
    print(f"{'decode':<10} {b:>6} {med['decode']:>8.1f} {1.0:>9.2f}")
    for n in sizes:
        for kind in ("chain", "tree"):
            m = med[f"{kind} {n}"]
            ratio = f" {paired[n]:>10.3f}" if kind == "tree" else ""
            print(f"{kind + ' ' + str(n):<10} {b * (n + 1):>6} {m:>8.1f} "
                  f"{m / med['decode']:>9.2f}" + ratio)
    write_json(a, t, path, rows, samples, med, paired, batch=b)


if __name__ == "__main__":
    main()
