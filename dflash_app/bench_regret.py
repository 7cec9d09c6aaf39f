"""Adaptive against the best fixed mode of the same run (its regret), what the verifier's mode
race spent exploring (``verifier_svc/mode_race.py``), and ``dflash bench --sweep``: the
concurrency sweep on several prompt sets with one plot (docs/batching.md, "The mode race").

* regret: ``1 - adaptive / best`` where ``best`` is the highest decode tokens/s (aggregate
  tokens/s in the sweep) among the run's other modes, ``off`` included;
* exploration: the race's counters on the verifier's ``/metrics``
  (``dflash_spec_policy_race_*``), read before and after the cells that ran adaptive: the share
  of its steps and of its seconds that explored, and the tokens that cost against each batch
  bucket's best arm on the same text (negative: exploring paid).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from dflash.core.speculation import SpecMode

#: ``--sweep``'s prompt sets (the edit set: ``scripts/make_edit_prompts.py``) and modes.
SWEEP_SETS = ("chat", "humaneval", "data/bench/edit.jsonl")
SWEEP_CONCURRENCY = "1,4,8,16,32"
SWEEP_MODES = "off,fixed,tree,hybrid,suffix,adaptive"
_RACE = {"dflash_spec_policy_race_explored_steps": "explored_steps",
         "dflash_spec_policy_race_explored_seconds": "explored_seconds",
         "dflash_spec_policy_race_seconds": "seconds",
         "dflash_spec_policy_race_explore_cost_tokens": "explore_cost_tokens"}


def regret(tok_s: dict[str, float], adaptive: str) -> tuple[str, float, float] | None:
    """``(best other mode, its tokens/s, adaptive / best)`` of one run's modes -> tokens/s; None
    without ``adaptive`` or another mode."""
    if adaptive not in tok_s:
        return None
    others = {m: v for m, v in tok_s.items() if m != adaptive}
    if not others:
        return None
    best = max(others, key=lambda m: others[m])
    return best, others[best], tok_s[adaptive] / others[best] if others[best] else float("nan")


def regret_line(tok_s: dict[str, float], adaptive: str) -> str:
    r = regret(tok_s, adaptive)
    if r is None:
        return ""
    best, v, ratio = r
    return (f"{adaptive}: {ratio:.3f}x the best fixed mode of this run ({best}, {v:.1f} tok/s), "
            f"regret {100 * (1 - ratio):+.1f}%")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_race(url: str) -> dict | None:
    """The race's counters from a verifier's ``/metrics`` at ``url`` (``host:port`` or a URL);
    None when it cannot be read or has no race."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith("http"):
        url = f"http://{url}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    out: dict = {"steps": {}, "leaders": {}, "estimates": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "dflash_spec_policy_race_steps_total":
                out["steps"][s.labels["arm"]] = s.value
            elif s.name.removesuffix("_total") in _RACE:
                out[_RACE[s.name.removesuffix("_total")]] = s.value
            elif s.name == "dflash_spec_policy_race_leader":
                out["leaders"][s.labels["batch_bucket"]] = s.labels["arm"]
            elif s.name == "dflash_spec_policy_race_tokens_per_second":
                out["estimates"].setdefault(s.labels["batch_bucket"], {})[s.labels["arm"]] = s.value
    return out if "seconds" in out else None


def race_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the race did between two scrapes (leaders and estimates: ``after``'s)."""
    if after is None:
        return None
    b = before or {"steps": {}}
    d = {k: after.get(k, 0.0) - b.get(k, 0.0) for k in _RACE.values()}
    d["steps"] = {a: n - b["steps"].get(a, 0.0) for a, n in after["steps"].items()
                  if n - b["steps"].get(a, 0.0) > 0}
    d["leaders"], d["estimates"] = after["leaders"], after["estimates"]
    return d


def race_line(d: dict | None, tokens: float) -> str:
    """One line: exploration's share of the race's steps and seconds, its cost in tokens (and
    as a share of ``tokens``, what adaptive committed), the arms played, each bucket's leader."""
    if not d:
        return ""
    steps = sum(d["steps"].values())
    if not steps:
        return ""
    played = ", ".join(f"{a} {int(n)}" for a, n in sorted(d["steps"].items(), key=lambda x: -x[1]))
    leaders = ", ".join(f"{b}: {a}" for b, a in sorted(d["leaders"].items(), key=lambda x: int(x[0])))
    cost = d["explore_cost_tokens"]
    share = f" ({100 * cost / tokens:+.1f}% of adaptive's tokens)" if tokens else ""
    return (f"mode race: exploration {100 * d['explored_steps'] / steps:.1f}% of adaptive's steps, "
            f"{100 * d['explored_seconds'] / max(d['seconds'], 1e-9):.1f}% of its seconds, cost "
            f"{cost:.0f} tokens{share}; arms played: {played}; leader per batch bucket: "
            f"{leaders or 'none yet'}")


# ---------------------------------------------------------------------- the sweep
def set_name(prompts: str) -> str:
    return Path(prompts).stem if prompts.endswith(".jsonl") else prompts


def resolve_set(name: str) -> str:
    """A set name, or a JSONL path relative to the working directory or the repository."""
    if not name.endswith(".jsonl") or Path(name).is_file():
        return name
    root = Path(__file__).resolve().parents[1] / name
    return str(root) if root.is_file() else name


def cmd_sweep(a, out: Path) -> int:
    """``--sweep``: :func:`dflash_app.bench_load.run_levels` on each of ``--sweep-sets`` (one
    stack, each set's cells in ``out/<set>/``), then ``sweep.md`` (regret per set and
    concurrency) and ``sweep.png``."""
    from dflash_app.bench_load import run_levels
    from dflash_app.bench_prompts import prompt_set

    results: dict[str, list[dict]] = {}
    for name in a.sweep_sets.split(","):
        try:
            prompts = prompt_set(resolve_set(name), a.limit)
        except ValueError as e:
            raise SystemExit(f"--sweep-sets: {e}") from None
        sub = out / set_name(name)
        sub.mkdir(parents=True, exist_ok=True)
        print(f"sweep: {set_name(name)} ({len(prompts)} prompts)", file=sys.stderr, flush=True)
        results[set_name(name)] = run_levels(a, prompts, sub)
        _write(results, out)
    md = sweep_markdown(results)
    print(md)
    print(f"wrote {out}/sweep.json, sweep.md, sweep.png")
    return 0


def _write(results: dict[str, list[dict]], out: Path) -> None:
    slim = {s: [{k: v for k, v in x.items() if k != "outputs"} for x in lv] for s, lv in results.items()}
    (out / "sweep.json").write_text(json.dumps(slim, indent=1))
    (out / "sweep.md").write_text(sweep_markdown(results))
    sweep_plot(results, out / "sweep.png")


def sweep_markdown(results: dict[str, list[dict]]) -> str:
    """Per set and concurrency: each mode's aggregate tokens/s (means over repeats), adaptive
    against off and against the best fixed mode, and the race's exploration share."""
    lines = ["| set | concurrency | best fixed mode | its tok/s | adaptive tok/s | adaptive / off | "
             "adaptive / best fixed | exploration (steps) | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s, levels in results.items():
        by: dict[tuple[str, int], list[dict]] = {}
        for x in levels:
            by.setdefault((x["mode"], x["concurrency"]), []).append(x)
        for c in sorted({x["concurrency"] for x in levels}):
            tok = {m: sum(x["agg_tok_s"] for x in runs) / len(runs) for (m, cc), runs in by.items() if cc == c}
            r = regret(tok, SpecMode.ADAPTIVE)
            if r is None:
                continue
            best, v, ratio = r
            off = f"{tok[SpecMode.ADAPTIVE] / tok[SpecMode.OFF]:.2f}x" if tok.get(SpecMode.OFF) else "-"
            races = [x["race"] for x in by.get((SpecMode.ADAPTIVE, c), []) if x.get("race")]
            steps = sum(sum(d["steps"].values()) for d in races)
            expl = f"{100 * sum(d['explored_steps'] for d in races) / steps:.0f}%" if steps else "-"
            same = [x["identical_to_off"] for (m, cc), runs in by.items() if cc == c
                    for x in runs if "identical_to_off" in x]
            ident = f"{sum(d['identical'] for d in same)}/{sum(d['total'] for d in same)}" if same else "-"
            lines.append(f"| {s} | {c} | {best} | {v:.1f} | {tok[SpecMode.ADAPTIVE]:.1f} | {off} | "
                         f"{ratio:.3f}x | {expl} | {ident} |")
    return "\n".join(lines) + "\n"


def sweep_plot(results: dict[str, list[dict]], path: Path) -> None:
    """One panel per set: aggregate tokens/s of each mode against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(results), 1)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, (s, levels) in zip(axes[0], results.items()):
        modes = list(dict.fromkeys(x["mode"] for x in levels))
        for m in modes:
            pts: dict[int, list[float]] = {}
            for x in levels:
                if x["mode"] == m:
                    pts.setdefault(x["concurrency"], []).append(x["agg_tok_s"])
            conc = sorted(pts)
            ax.plot(conc, [sum(pts[c]) / len(pts[c]) for c in conc], marker="o", label=m,
                    linewidth=2.5 if m == SpecMode.ADAPTIVE else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(s)
        ax.grid(alpha=0.3)
        ax.legend(title="mode", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
