"""The structured-output benchmark's figures from its rows (``scripts/bench_structured.py``),
and its report: what each target asks, what was measured, whether it is met.

An extraction row is one prompt through one arm: ``{"id", "arm", "tokens", "token_bytes"
(each token's bytes, hex), "finish", "ttft_s", "decode_s" (first to last token), "valid",
"correct_fields", "fields", "sd" (the response's metrics.speculative_decoding or None),
"grammar_s", "grammar_rows" (the verifier's grammar time and rows during it)}``.
"""

from __future__ import annotations

from dflash_app.bench_structured import OFF, PLAIN

MASK_TARGET = 0.10          # grammar time per step / a plain decode step
NO_GRAMMAR_TARGET = 0.99    # throughput of grammar-free requests, with the hook / without
SPEEDUP_TARGET = 2.5        # adaptive / constrained off
SOURCES = ("drafter", "suffix", "grammar")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def arm_summary(rows: list[dict], off: dict[str, list[str]] | None) -> dict:
    """One arm's figures over its rows; ``off``: the baseline's token bytes per prompt id
    (None: the arm is not compared)."""
    decode_s = sum(r["decode_s"] for r in rows)
    steps = sum((r["sd"] or {}).get("num_spec_steps", 0) for r in rows)
    accepted = sum((r["sd"] or {}).get("num_accepted_draft_tokens", 0) for r in rows)
    by_source = {s: sum((r["sd"] or {}).get("num_accepted_tokens_by_source", {}).get(s, 0) for r in rows)
                 for s in SOURCES}
    grammar_rows = sum(r["grammar_rows"] for r in rows)
    out = {"prompts": len(rows), "valid": sum(r["valid"] for r in rows),
           "finished": sum(r["finish"] == "stop" for r in rows),
           "tokens": sum(r["tokens"] for r in rows),
           "decode_tok_s": _ratio(sum(max(r["tokens"] - 1, 0) for r in rows), decode_s),
           "ttft_ms_mean": 1000 * sum(r["ttft_s"] for r in rows) / max(len(rows), 1),
           "tau": 1 + accepted / steps if steps else 1.0, "spec_steps": steps,
           "accepted_by_source": by_source,
           "correct_fields": sum(r["correct_fields"] for r in rows), "fields": sum(r["fields"] for r in rows),
           "grammar_s": sum(r["grammar_s"] for r in rows), "grammar_rows": grammar_rows,
           "grammar_ms_per_step": _ratio(1000 * sum(r["grammar_s"] for r in rows), grammar_rows),
           "grammar_share_of_decode": _ratio(sum(r["grammar_s"] for r in rows), decode_s)}
    if off is not None:
        out["identical_to_off"] = sum(r["token_bytes"] == off.get(r["id"]) for r in rows)
    return out


def extraction_summary(rows: dict[str, list[dict]]) -> dict:
    """Every arm's :func:`arm_summary` (the constrained ones compared with ``off``), the
    speedups against ``off`` and the mask cost: the grammar's time per step of each arm
    against a plain decode step (``plain-off``: no grammar, speculation off, batch 1)."""
    off = {r["id"]: r["token_bytes"] for r in rows.get(OFF, [])}
    arms = {arm: arm_summary(rs, None if arm == PLAIN else off) for arm, rs in rows.items()}
    base = arms.get(OFF, {}).get("decode_tok_s")
    for arm, a in arms.items():          # the plain arm's output is another text: no speedup
        a["speedup_vs_off"] = None if arm == PLAIN else _ratio(a["decode_tok_s"] or 0.0, base or 0.0)
    plain = arms.get(PLAIN, {}).get("decode_tok_s")
    step_ms = 1000 / plain if plain else None
    mask = {arm: _ratio(a["grammar_ms_per_step"] or 0.0, step_ms or 0.0)
            for arm, a in arms.items() if arm != PLAIN}
    return {"arms": arms, "plain_step_ms": step_ms, "mask_cost_vs_plain_step": mask}


def tool_summary(rows: list[dict]) -> dict:
    """Tool-call figures per variant (``whole``, ``stream``): rows ``{"id", "variant",
    "problems", "name", "arguments", "expected_tool", "sd"}``."""
    out: dict = {}
    for variant in ("whole", "stream"):
        rs = [r for r in rows if r["variant"] == variant]
        out[variant] = {"requests": len(rs), "ok": sum(not r["problems"] for r in rs),
                        "expected_tool": sum(r["name"] == r["expected_tool"] for r in rs),
                        "problems": {r["id"]: r["problems"] for r in rs if r["problems"]}}
    whole = {r["id"]: (r["name"], r["arguments"]) for r in rows if r["variant"] == "whole"}
    out["stream_equals_whole"] = sum(whole.get(r["id"]) == (r["name"], r["arguments"])
                                     for r in rows if r["variant"] == "stream")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**not met**")


def targets(res: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) of every issue-63 target the run measures."""
    ex, tl, hook = res["extraction"], res["tools"], res["hook"]
    arms = {k: v for k, v in ex["arms"].items() if k != PLAIN}
    out = [("outputs valid against the schema (jsonschema): 100%",
            ", ".join(f"{k} {a['valid']}/{a['prompts']}" for k, a in arms.items()),
            all(a["valid"] == a["prompts"] for a in arms.values())),
           ("greedy tokens identical to constrained off",
            ", ".join(f"{k} {a['identical_to_off']}/{a['prompts']}" for k, a in arms.items() if k != OFF),
            all(a["identical_to_off"] == a["prompts"] for a in arms.values()))]
    if "adaptive" in arms:
        s = arms["adaptive"]["speedup_vs_off"]
        out.append((f"adaptive >= {SPEEDUP_TARGET}x constrained off", _x(s),
                    None if s is None else s >= SPEEDUP_TARGET))
    for v in ("whole", "stream"):
        t = tl[v]
        out.append((f"tool calls ({v}): valid arguments and OpenAI shape, 100%", f"{t['ok']}/{t['requests']}",
                    t["ok"] == t["requests"]))
    m = ex["mask_cost_vs_plain_step"].get(OFF)
    out.append((f"grammar time per step <= {MASK_TARGET:.0%} of a plain decode step (batch 1)",
                f"{_pct(m)} ({_f(arms.get(OFF, {}).get('grammar_ms_per_step'), '.2f')} ms of "
                f"{_f(ex['plain_step_ms'], '.1f')} ms)", None if m is None else m <= MASK_TARGET))
    r = hook["throughput_ratio"]
    out.append((f"requests without a grammar: >= {NO_GRAMMAR_TARGET}x",
                f"{_f(r, '.6f')}x (the hook: {_f(hook['ns_per_row'], '.0f')} ns per row; grammar rows "
                f"during plain requests: {hook['plain_grammar_rows']})",
                None if r is None else r >= NO_GRAMMAR_TARGET and hook["plain_grammar_rows"] == 0))
    return out


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# Structured outputs: {c['extraction_prompts']} extraction prompts, {c['tool_prompts']} "
             "tool-call prompts", "",
             f"commit {c['commit']}, target {c['target']}, drafter {c['drafter']}, {c['host']['cpus']} "
             f"CPUs ({c['host']['machine']}), greedy, batch 1, max_tokens {c['max_tokens']}, arms "
             f"interleaved per prompt; one run{' (tiny random models: a smoke run, no figures)' if c['tiny'] else ''}.",
             "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {verdict(ok)} |" for t, m, ok in targets(res)]
    lines += ["", "## Extraction", "",
              "| arm | valid | finished | identical to off | tokens | decode tok/s | speedup vs off | τ | "
              "accepted: drafter / suffix / grammar | grammar ms per step | grammar share of decode | "
              "fields correct |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in res["extraction"]["arms"].items():
        src = " / ".join(str(a["accepted_by_source"][s]) for s in SOURCES)
        ident = f"{a['identical_to_off']}/{a['prompts']}" if "identical_to_off" in a else "-"
        lines.append(f"| {arm} | {a['valid']}/{a['prompts']} | {a['finished']}/{a['prompts']} | {ident} | "
                     f"{a['tokens']} | {_f(a['decode_tok_s'])} | {_x(a['speedup_vs_off'])} | {a['tau']:.2f} | "
                     f"{src} | {_f(a['grammar_ms_per_step'], '.2f')} | {_pct(a['grammar_share_of_decode'])} | "
                     f"{a['correct_fields']}/{a['fields']} |")
    lines += ["", f"`{OFF}`: the schema's grammar, speculation off (the baseline); `{PLAIN}`: no grammar, "
              "speculation off (the plain decode step; its output is free text, so validity does not apply). "
              "Grammar time: the verifier's `dflash_verifier_grammar_seconds_total` / `_grammar_rows_total` "
              "during the arm's requests (pruning drafts, masks, applying them, advancing the matcher).", "",
              "## Tool calls", "", "| variant | valid | chose the expected tool | problems |", "|---|---|---|---|"]
    for v in ("whole", "stream"):
        t = res["tools"][v]
        probs = "; ".join(f"{k}: {', '.join(p)}" for k, p in t["problems"].items()) or "none"
        lines.append(f"| {v} | {t['ok']}/{t['requests']} | {t['expected_tool']}/{t['requests']} | {probs} |")
    lines += ["", f"streamed calls equal to the whole ones (name and arguments): "
              f"{res['tools']['stream_equals_whole']}/{res['tools']['stream']['requests']}; mode "
              f"`{c['tool_mode']}`.", ""]
    return "\n".join(lines)
