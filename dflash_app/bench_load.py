"""``dflash bench --concurrency 1,2,4,...``: many users at once, speculation off / fixed / adaptive.

For each concurrency ``c`` and each mode, ``c`` closed-loop clients (each sends its next request
when the previous one finished) run ``max(ceil(requests / c), requests_per_client)`` HumanEval
prompts each through the gateway, greedy (every level sees at least ``requests`` requests, and
``c`` at least). With one
request per client a level is a single wave: prompts arrive together, queue for prefill, and the
batch drains as requests finish, so ramp and tail weigh on it; several per client keep ``c``
requests in flight (vLLM's ``benchmark_serving`` likewise sends many more prompts than its
``--max-concurrency``). Figures per (mode, c):

* aggregate tokens/s = completion tokens of all requests / wall time of the level;
* per-request tokens/s = mean over requests of completion tokens / end-to-end latency;
* tau = 1 + accepted / drafts over all requests (bonus included; ``dflash.core.stats``);
* TTFT p50 / p99 (client side, first text);
* inter-token latency p50 / p99: the gap between consecutive streamed deltas divided by the
  tokens the later delta completes, once per token (the gateway histogram's definition);
* greedy identical to off: requests whose tokens equal off's in the same request slot (same
  prompt) at the same concurrency and round, and for each that differs the logit gap at its
  first difference (:mod:`dflash_app.bench_lossless`).

Output: ``load.json``, ``load.md`` (one table, modes side by side) and ``load.png``
(aggregate throughput vs concurrency, one line per mode).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from dflash.core.speculation import (
    MODES,  # noqa: F401  (the sweep's modes; tests read them here)
    SpecMode,
)
from dflash.core.stats import AcceptanceCounter


def _one(client, messages, *, max_tokens: int, mode: str, drafter: str) -> dict:
    from dflash.client import build_request
    from dflash.core.convert import stats_from_proto
    from dflash_app.bench import split_mode

    name, budget = split_mode(mode)
    req = build_request(messages=messages, max_tokens=max_tokens,
                        speculation=mode != SpecMode.OFF, drafter=drafter,
                        speculation_mode="" if mode == SpecMode.OFF else name, tree_budget=budget)
    c = client.complete(req, timeout=3600)
    st = stats_from_proto(c.acceptance)
    n = c.usage.completion_tokens
    # tokens completed by each delta: ids are assigned to the delta that completed their text
    itl = []
    prev = c.ttft_s
    for t, k in zip(c.token_times[1:], _delta_tokens(c)):
        gap = t - prev
        prev = t
        if k:
            itl += [gap / k] * k
    return {"tokens": n, "token_ids": list(c.token_ids), "ttft_s": c.ttft_s,
            "latency_s": c.latency_s, "itl_s": itl, "drafts": st.drafts, "draft_tokens": st.draft_tokens, "accepted": st.accepted_tokens,
            "accepted_per_position": st.accepted_per_position}


def _delta_tokens(c) -> list[int]:
    """Tokens per streamed delta after the first (evenly spread when not recorded)."""
    per = getattr(c, "delta_tokens", None)
    if per:
        return per[1:]
    n_deltas = max(len(c.token_times) - 1, 0)
    if not n_deltas:
        return []
    rest = max(c.usage.completion_tokens - 1, 0)
    base, extra = divmod(rest, n_deltas)
    return [base + (1 if i < extra else 0) for i in range(n_deltas)]


def run_level(addr: str, prompts, *, concurrency: int, requests_per_client: int, max_tokens: int,
              mode: str, drafter: str = "") -> dict:
    from dflash.client import GatewayClient

    rows: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(concurrency)

    def client_loop(ci: int):
        client = GatewayClient(addr)
        start.wait()
        for r in range(requests_per_client):
            slot = ci * requests_per_client + r
            row = _one(client, prompts[slot % len(prompts)][1], max_tokens=max_tokens, mode=mode,
                       drafter=drafter)
            with lock:
                rows.append({**row, "task_id": str(slot)})
        client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # every request's tokens, by slot: the same slot gets the same prompt in every mode
    outputs = {r["task_id"]: r["token_ids"] for r in rows}
    return {**summarize(rows, wall, mode=mode, concurrency=concurrency), "outputs": outputs}


def summarize(rows: list[dict], wall_s: float, *, mode: str, concurrency: int) -> dict:
    st = AcceptanceCounter()
    for r in rows:
        st.merge(AcceptanceCounter(drafts=r["drafts"], draft_tokens=r["draft_tokens"],
                                   accepted_tokens=r["accepted"],
                                   accepted_per_position=list(r["accepted_per_position"])))
    toks = sum(r["tokens"] for r in rows)
    ttft = np.array([r["ttft_s"] for r in rows]) * 1000
    itl = np.array([x for r in rows for x in r["itl_s"]] or [0.0]) * 1000
    return {"mode": mode, "concurrency": concurrency, "requests": len(rows), "tokens": toks,
            "wall_s": wall_s, "agg_tok_s": toks / wall_s,
            "req_tok_s": float(np.mean([r["tokens"] / r["latency_s"] for r in rows])),
            "tau": st.mean_acceptance_length, "per_position": st.per_position_rate,
            "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "itl_ms_p50": float(np.percentile(itl, 50)), "itl_ms_p99": float(np.percentile(itl, 99))}


def identical_to_off(levels: list[dict], probe, *, near_tie: float) -> None:
    """Set ``identical_to_off`` on every non-off cell of ``levels`` that has an off cell at
    the same concurrency and repeat: its outputs against off's, slot by slot
    (:func:`dflash_app.bench_lossless.compare`; ``probe`` gives off's logprobs at batch 1, so a
    gap is measured only where the batch-1 probe reproduces the batched off output)."""
    from dflash_app.bench_lossless import compare

    offs = {(x["concurrency"], x.get("repeat", 0)): x for x in levels if x["mode"] == SpecMode.OFF}
    for x in levels:
        off = offs.get((x["concurrency"], x.get("repeat", 0)))
        if x["mode"] == SpecMode.OFF or off is None:
            continue
        rows = {m: [{"task_id": t, "token_ids": ids} for t, ids in y["outputs"].items()]
                for m, y in ((SpecMode.OFF, off), ("spec", x))}
        x["identical_to_off"] = compare(rows, SpecMode.OFF, probe, near_tie=near_tie)["spec"]


def _cells(levels: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """(mode, concurrency) -> its runs (one per ``--repeats``)."""
    by: dict[tuple[str, int], list[dict]] = {}
    for x in levels:
        by.setdefault((x["mode"], x["concurrency"]), []).append(x)
    return by


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([x[key] for x in runs]))


def _spread(runs: list[dict]) -> float:
    """Half the range of aggregate tokens/s across runs, relative to their mean (0 for one run)."""
    v = [x["agg_tok_s"] for x in runs]
    return (max(v) - min(v)) / 2 / float(np.mean(v))


def _paired(runs: list[dict], others: list[dict]) -> list[float]:
    """Adaptive over the other mode within each round (``repeat``) that ran both: a paired
    comparison, free of the drift between rounds that the per-mode spread includes (the modes
    of one round run back to back, minutes apart at most)."""
    other = {x.get("repeat", 0): x["agg_tok_s"] for x in others}
    return [x["agg_tok_s"] / other[x.get("repeat", 0)] for x in runs
            if other.get(x.get("repeat", 0))]


def _modes(levels: list[dict]) -> list[str]:
    """The modes of ``levels`` in order of first appearance (``tree:8`` beside ``tree``)."""
    return list(dict.fromkeys(x["mode"] for x in levels))


def markdown(levels: list[dict]) -> str:
    """One table, modes side by side per concurrency; figures are means over the repeats, and
    aggregate tokens/s shows its range when a cell ran more than once. Then, per concurrency,
    adaptive's aggregate tokens/s over the better of the other modes, with the run-to-run
    spread of both (the noise the comparison has to clear) and, with repeats, the ratio within
    each round (:func:`_paired`)."""
    by = _cells(levels)
    modes = _modes(levels)
    conc = sorted({x["concurrency"] for x in levels})
    lines = ["| concurrency | mode | aggregate tok/s | per-request tok/s | tau | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | greedy identical to off |", "|---|---|---|---|---|---|---|---|"]
    for c in conc:
        for m in modes:
            runs = by.get((m, c))
            if not runs:
                continue
            agg = f"{_mean(runs, 'agg_tok_s'):.1f}"
            if len(runs) > 1:
                v = [x["agg_tok_s"] for x in runs]
                agg += f" ({min(v):.1f}–{max(v):.1f})"
            same = [x["identical_to_off"] for x in runs if "identical_to_off" in x]
            ident = (f"{sum(d['identical'] for d in same)}/{sum(d['total'] for d in same)}"
                     if same else "-")
            lines.append(f"| {c} | {m} | {agg} | {_mean(runs, 'req_tok_s'):.1f} | {_mean(runs, 'tau'):.2f} | "
                         f"{_mean(runs, 'ttft_ms_p50'):.0f} / {_mean(runs, 'ttft_ms_p99'):.0f} | "
                         f"{_mean(runs, 'itl_ms_p50'):.1f} / {_mean(runs, 'itl_ms_p99'):.1f} | {ident} |")
    best = []
    for c in conc:
        agg = {m: _mean(by[(m, c)], "agg_tok_s") for m in modes if (m, c) in by}
        if SpecMode.ADAPTIVE in agg and len(agg) > 1:
            other = max((m for m in agg if m != SpecMode.ADAPTIVE), key=agg.get)
            line = (f"c={c}: adaptive {agg[SpecMode.ADAPTIVE] / agg[other]:.2f}x the better of the others ({other})"
                    + (f", {agg[SpecMode.ADAPTIVE] / agg[SpecMode.OFF]:.2f}x off" if agg.get(SpecMode.OFF) and other != SpecMode.OFF else ""))
            if len(by[(SpecMode.ADAPTIVE, c)]) > 1:
                line += (f", run-to-run spread ±{100 * _spread(by[(SpecMode.ADAPTIVE, c)]):.0f}% / "
                         f"±{100 * _spread(by[(other, c)]):.0f}%")
                paired = _paired(by[(SpecMode.ADAPTIVE, c)], by[(other, c)])
                if len(paired) > 1:
                    line += ", per round " + " / ".join(f"{r:.2f}x" for r in paired)
            best.append(line)
    if best:
        lines.append("\n" + "; ".join(best))
    from dflash_app.bench_regret import race_line

    for x in levels:
        line = race_line(x.get("race"), x["tokens"]) if x["mode"] == SpecMode.ADAPTIVE else ""
        if line:
            lines.append(f"\nc={x['concurrency']} round {x.get('repeat', 0)}: {line}")
    diffs = {f"c={x['concurrency']} {x['mode']} round {x.get('repeat', 0)}": x["identical_to_off"]
             for x in levels if x.get("identical_to_off", {}).get("differences")}
    if diffs:
        from dflash_app.bench_lossless import difference_lines, summary_line

        lines.append("\ngreedy outputs that differ from off at the same concurrency (request slot, "
                     "logit gap in off's batch-1 distribution): " + summary_line(diffs))
        lines += difference_lines(diffs)
    return "\n".join(lines) + "\n"


def plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    by = _cells(levels)
    for m in _modes(levels):
        conc = sorted(c for mm, c in by if mm == m)
        if conc:
            runs = [[x["agg_tok_s"] for x in by[(m, c)]] for c in conc]
            mean = np.array([np.mean(v) for v in runs])
            err = np.array([[mu - min(v) for v, mu in zip(runs, mean)], [max(v) - mu for v, mu in zip(runs, mean)]])
            ax.errorbar(conc, mean, yerr=err, marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(title="speculation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_load(a, prompts, out: Path) -> int:
    """The ``--concurrency`` sweep (called by ``dflash_app.bench.cmd_bench``)."""
    levels = run_levels(a, prompts, out)
    md = markdown(levels)
    (out / "load.md").write_text(md)
    plot(levels, out / "load.png")
    print(md)
    print(f"wrote {out}/load.json, load.md, load.png")
    return 0


def run_levels(a, prompts, out: Path) -> list[dict]:
    """Every (concurrency, mode) cell of ``a`` on ``prompts``, compared with off, written to
    ``out/load.json`` as they finish (also ``load.md`` and ``load.png`` at the end); an
    adaptive cell carries what the verifier's mode race did in it (``race``:
    :func:`dflash_app.bench_regret.race_delta`) when ``a.verifier_metrics`` names its
    ``/metrics``."""
    from dflash_app.bench_regret import race_delta, scrape_race

    # the flags arrive checked and normalised by their argparse types (dflash_app.bench.add_parser)
    conc = [int(x) for x in a.concurrency.split(",")]
    modes = a.spec_modes.split(",")
    drafter = (a.use_drafter or [""])[0]
    repeats, min_per_client = a.repeats, a.requests_per_client
    metrics = getattr(a, "verifier_metrics", "")
    config = {"concurrency": conc, "modes": modes, "max_tokens": a.max_tokens,
              "requests": a.requests, "requests_per_client": min_per_client,
              "repeats": repeats, "gateway": a.gateway}
    levels: list[dict] = []
    # each concurrency level runs its modes back to back, ``repeats`` rounds of them (the order
    # rotated per round), so that the modes of one level are compared under the same conditions
    # and their spread is known
    for c in conc:
        for rep in range(repeats):
            for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                # warm-up: one request so first-use costs (drafter stream, caches) stay out
                if not levels:
                    run_level(a.gateway, prompts, concurrency=1, requests_per_client=1,
                              max_tokens=8, mode=m, drafter=drafter)
                per_client = max(-(-a.requests // c), min_per_client)
                before = scrape_race(metrics) if metrics and m == SpecMode.ADAPTIVE else None
                x = run_level(a.gateway, prompts, concurrency=c, requests_per_client=per_client,
                              max_tokens=a.max_tokens, mode=m, drafter=drafter)
                if metrics and m == SpecMode.ADAPTIVE:
                    x["race"] = race_delta(before, scrape_race(metrics))
                x["repeat"] = rep
                levels.append(x)
                _report(x, out, config, levels)
    if SpecMode.OFF in modes:
        from dflash.client import GatewayClient
        from dflash_app.bench import off_probe

        slots = {t for x in levels for t in x["outputs"]}
        client = GatewayClient(a.gateway)
        try:
            identical_to_off(levels, off_probe(client, {t: prompts[int(t) % len(prompts)][1] for t in slots}),
                             near_tie=a.near_tie_gap)
        finally:
            client.close()
        (out / "load.json").write_text(json.dumps({"config": config, "levels": levels}, indent=1))
    (out / "load.md").write_text(markdown(levels))
    plot(levels, out / "load.png")
    return levels


def _report(x: dict, out: Path, config: dict, levels) -> None:
    """One cell's line on stderr; load.json rewritten with every cell so far."""
    m, c = x["mode"], x["concurrency"]
    print(f"c={c:>3} {m:>8}: {x['agg_tok_s']:7.1f} tok/s aggregate, "
          f"{x['req_tok_s']:6.1f} per request, tau {x['tau']:.2f}, "
          f"TTFT p50 {x['ttft_ms_p50']:.0f} ms, ITL p50 {x['itl_ms_p50']:.1f} ms",
          file=sys.stderr, flush=True)
    (out / "load.json").write_text(json.dumps({"config": config, "levels": levels}, indent=1))
