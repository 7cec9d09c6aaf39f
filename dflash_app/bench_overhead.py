"""The figures of ``scripts/bench_prefix_overhead.py`` (the prefix cache's cost where it cannot
help, issue 61): its summaries of the unique-prompt arms and of the memory run, the memory
run's prompts, RSS bound and readings (gauges, high-water mark), and the report. The script
starts the processes."""

from __future__ import annotations

import json
import math
import random
import statistics
import urllib.request
from pathlib import Path

RATIO_TARGET = 0.98          # throughput with the cache on / off, unique prompts
MIB = 1 << 20
#: the verifier's prefix cache gauges (/metrics) -> their names in a memory sample
GAUGES = {f"dflash_verifier_prefix_cache_{k}": k for k in
          ("bytes", "pinned_bytes", "entries", "tokens", "evictions_total")}
#: item 2 of the bench (τ per turn with the cache, fixed mode): dflash bench's own workload
MULTITURN = ("dflash bench --start --workload multiturn --prompts chat --conversations 8 "
             "--turns 6 --max-tokens 192 --spec-modes fixed --out docs/bench/prefix-multiturn-fixed-<tag>")


def throughput_summary(results: dict) -> dict:
    """Per level (:func:`measure_throughput`): per arm the tokens/s of each round and their
    median, τ over the rounds, cached prompt tokens, failed requests; on / off of the medians;
    greedy outputs equal between the arms (rows of the same round and prompt, both finished)."""
    out: dict = {}
    for level, arms in results.items():
        cell: dict = {}
        for arm, rounds in arms.items():
            rates = [sum(x["tokens"] for x in rd["rows"]) / rd["wall_s"] for rd in rounds]
            rows = [x for rd in rounds for x in rd["rows"]]
            drafts = sum(x["drafts"] for x in rows)
            cell[arm] = {"tok_s": rates, "tok_s_median": statistics.median(rates),
                         "tau": 1 + sum(x["accepted"] for x in rows) / drafts if drafts else None,
                         "cached_tokens": sum(x["cached"] for x in rows),
                         "failed": sum(bool(x["error"]) for x in rows),
                         "errors": [x["error"] for x in rows if x["error"]][:5]}
        pairs = [(x, y) for ra, rb in zip(arms["on"], arms["off"]) for x, y in zip(ra["rows"], rb["rows"])]
        off = cell["off"]["tok_s_median"]
        cell.update(ratio=cell["on"]["tok_s_median"] / off if off else None,
                    identical=sum(x["ids"] == y["ids"] and not x["error"] and not y["error"]
                                  for x, y in pairs), compared=len(pairs))
        out[level] = cell
    return out




def memory_prompts(n: int, *, vocab: int, lo: int, hi: int, tenants: int, reuse: float,
                   seed: int) -> list[tuple[int, list[int]]]:
    """``n`` (tenant index, token ids) pairs: ids uniform in ``[0, vocab)``, lengths uniform in
    ``[lo, hi]``; a ``reuse`` share starts with a piece (1 token up to all) of one of its
    tenant's last 8 prompts. Deterministic in ``seed``."""
    rng = random.Random(seed)
    recent: dict[int, list[list[int]]] = {}
    out = []
    for i in range(n):
        t, length = i % tenants, rng.randint(lo, hi)
        past = recent.setdefault(t, [])
        keep = []
        if past and rng.random() < reuse:
            src = rng.choice(past)
            keep = src[:rng.randint(1, min(len(src), length))]
        ids = keep + [rng.randrange(vocab) for _ in range(length - len(keep))]
        past.append(ids)
        del past[:-8]
        out.append((t, ids))
    return out


def kv_bytes_per_token(target: str, dtype: str) -> int:
    """K/V bytes of one position of the batch pool: 2 x layers x KV heads x head dim x the
    dtype's size, from the target's config.json. Raises KeyError naming a missing field."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * size


def memory_bound(*, start_rss: int, kv_per_token: int, clients: int, positions: int,
                 cache_mb: float, slack_mb: float) -> dict:
    """The verifier's RSS bound, bytes, by part: RSS at start (weights, runtime) + the batch KV
    pool's largest size for ``clients`` sequences of ``positions`` (``dflash.core.kv_pool``
    grows rows by half and capacity by 25% or ``ROOM``, and holds the old buffers during a
    growth: twice that) + the cache's bound + slack (activations, taps, allocator)."""
    from dflash.core.kv_pool import ROOM

    rows = clients + clients // 2 + 1
    capacity = ROOM * math.ceil(1.25 * (positions + ROOM) / ROOM)
    parts = {"start_rss": start_rss, "kv_pool": 2 * rows * capacity * kv_per_token,
             "prefix_cache": int(cache_mb * MIB), "slack": int(slack_mb * MIB)}
    return {**parts, "total": sum(parts.values()), "pool_rows": rows, "pool_capacity": capacity}


def scrape(addr: str) -> dict[str, float]:
    """The verifier's prefix cache gauges (:data:`GAUGES`) from its /metrics at ``addr``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    return {GAUGES[s.name]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name in GAUGES}


def peak_rss(pid: int, reset: bool = False) -> int | None:
    """The process's RSS high-water mark (Linux ``VmHWM``), bytes; ``reset``: start it again
    from now (``clear_refs`` 5) and return None. None where /proc does not have them."""
    try:
        if reset:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            return None
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def memory_summary(raw: dict, cache_mb: float) -> dict:
    """``raw`` (the script's memory run: ``samples`` of ``rss``, the cache gauges ``bytes``,
    ``pinned_bytes``, ``entries``, ``tokens``, ``evictions_total``; ``peak_rss`` or None;
    ``bound``; ``failed``) with the highest figures and the three checks."""
    s = raw["samples"]
    rss = max(x["rss"] for x in s)
    cache = max(x["bytes"] for x in s)
    unpinned = max(x["bytes"] - x["pinned_bytes"] for x in s)
    bound = raw["bound"]["total"]
    last = s[-1]
    return {**raw, "max_rss": rss, "max_cache_bytes": cache, "max_unpinned_cache_bytes": unpinned,
            "rss_growth": last["rss"] - s[0]["rss"], "evictions": last["evictions_total"],
            "bytes_per_cached_position": last["bytes"] / last["tokens"] if last["tokens"] else None,
            "checks": {"rss_under_bound": rss <= bound and (raw["peak_rss"] or 0) <= bound,
                       "cache_under_bound": unpinned <= cache_mb * MIB,
                       "none_refused": raw["failed"] == 0}}


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:,.1f} MiB"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _targets(res: dict) -> list[str]:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for level, x in res.get("throughput", {}).items():
        r = x["ratio"]
        lines.append(f"| unique prompts, {level} clients: tokens/s cache on / off >= {RATIO_TARGET} | "
                     f"{'-' if r is None else f'{r:.3f}'} | {verdict(r is not None and r >= RATIO_TARGET)} |")
        lines.append(f"| unique prompts, {level} clients: greedy identical | {x['identical']}/"
                     f"{x['compared']} | {verdict(x['identical'] == x['compared'])} |")
    m = res.get("memory")
    if m:
        c = m["checks"]
        lines += [f"| memory: verifier RSS <= {_mib(m['bound']['total'])} | max {_mib(m['max_rss'])}"
                  f" (high-water {_mib(m['peak_rss'])}) | {verdict(c['rss_under_bound'])} |",
                  f"| memory: cache bytes <= --prefix-cache-mb ({m['prefix_cache_mb']:g} MiB) | max "
                  f"{_mib(m['max_unpinned_cache_bytes'])} | {verdict(c['cache_under_bound'])} |",
                  f"| memory: 0 refused | {m['failed']} of {m['requests']} | {verdict(c['none_refused'])} |"]
    return lines


def _throughput(res: dict) -> list[str]:
    c = res["config"]
    lines = ["", f"## Unique prompts: {c['limit']} x {c['max_tokens']} tokens ({c['prompts']}), "
             f"{c['rounds']} rounds", "",
             f"Two replicas on one stack, each (verifier and drafter) with --threads "
             f"{c['threads_per_replica']} of the {c['cores']} cores, both arms alike; replica "
             f"{'1' if c.get('swap_replicas') else '0'} cache on, replica "
             f"{'0' if c.get('swap_replicas') else '1'} `--prefix-cache off`, each behind its own gateway; the arms "
             "alternate, never at once; " + ("one tenant per arm and round." if c["shared_tenant"]
                                             else "every request its own tenant (no hit)."), "",
             "| clients | on tok/s (median; rounds) | off tok/s (median; rounds) | on / off | "
             "identical | τ on | τ off | cached tokens on | failed on / off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for level, x in res["throughput"].items():
        on, off = x["on"], x["off"]
        cells = [f"{a['tok_s_median']:.2f} ({', '.join(f'{v:.2f}' for v in a['tok_s'])})" for a in (on, off)]
        taus = ["-" if a["tau"] is None else f"{a['tau']:.3f}" for a in (on, off)]
        ratio = "-" if x["ratio"] is None else f"{x['ratio']:.3f}"
        lines.append(f"| {level} | {cells[0]} | {cells[1]} | {ratio} | {x['identical']}/{x['compared']} | "
                     f"{taus[0]} | {taus[1]} | {on['cached_tokens']} | {on['failed']} / {off['failed']} |")
    return lines


def _memory(res: dict) -> list[str]:
    m, b = res["memory"], res["memory"]["bound"]
    per = m["bytes_per_cached_position"]
    return ["", f"## Memory: {m['requests']} requests of random token ids", "",
            f"lengths {m['min_len']}-{m['max_len']}, {m['tenants']} tenants, {m['reuse']:.0%} "
            f"starting with a piece of an earlier prompt, {m['clients']} clients, max_tokens 1, "
            f"`--prefix-cache-mb {m['prefix_cache_mb']:g}`; sampled every {m['sample_every']} requests.", "",
            "| bound part | bytes |", "|---|---|",
            f"| RSS at start (weights, runtime) | {_mib(b['start_rss'])} |",
            f"| batch KV pool ({b['pool_rows']} rows x {b['pool_capacity']} positions, x2 while it "
            f"grows) | {_mib(b['kv_pool'])} |",
            f"| prefix cache bound | {_mib(b['prefix_cache'])} |", f"| slack | {_mib(b['slack'])} |",
            f"| **total** | **{_mib(b['total'])}** |", "",
            f"RSS: first sample {_mib(m['samples'][0]['rss'])}, last {_mib(m['samples'][-1]['rss'])}, "
            f"max {_mib(m['max_rss'])}, high-water {_mib(m['peak_rss'])}. Cache: max "
            f"{_mib(m['max_cache_bytes'])} ({_mib(m['max_unpinned_cache_bytes'])} unpinned), "
            f"{m['evictions']:.0f} evictions, {per and f'{per:,.0f}'} bytes per cached position. "
            f"Hits: {m['hit_requests']} requests, {m['hit_tokens']} tokens. Failed {m['failed']}"
            + (f" ({'; '.join(m['errors'])})" if m["errors"] else "") + "."]


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# Prefix cache overhead ({'tiny models' if c['tiny'] else c['target']})", "",
             f"commit {c['commit']}, {c['cores']} cores ({c['machine']}), speculation {c['mode']}, "
             "greedy", "", *_targets(res)]
    if "throughput" in res:
        lines += _throughput(res)
    if "memory" in res:
        lines += _memory(res)
    lines += ["", "## τ per turn with the cache, fixed mode", "",
              "Run separately (bench_prefix's multiturn arms off / cache / session):", "",
              f"    {MULTITURN}", ""]
    return "\n".join(lines)
