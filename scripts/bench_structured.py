#!/usr/bin/env python3
"""Structured outputs and tool calls under speculation: issue 63's targets, measured in one run
over the OpenAI HTTP API with the real ``openai`` client (docs/structured-outputs.md,
"Benchmark").

One stack (``dflash_app.launcher.LocalStack``: the target, its drafter, the gateway's HTTP API;
the verifier with ``--suffix-answer-tokens 0``, so no arm copies another arm's answer to the
same prompt, and its /metrics read for the grammar's time). Then:

1. **extraction** (``data/bench/extraction.jsonl``): every prompt, greedy, streamed, through
   every arm before the next prompt (the order rotated per prompt): ``off`` (the schema as
   ``response_format``, speculation off: constrained decoding without speculation, the
   baseline), each ``--modes`` mode with the schema, and ``plain-off`` (no grammar, speculation
   off, ``--plain-tokens``: the plain decode step). Per arm: outputs valid against the schema
   (``jsonschema``), greedy tokens identical to ``off`` (each token's bytes, from
   ``logprobs``: every arm asks for them), decode tokens/s (first to last token) and the
   speedup against ``off``, τ and the accepted tokens per source (drafter / suffix / grammar,
   from ``metrics.speculative_decoding``), fields equal to the passage's answer, and the
   verifier's grammar seconds per step (``dflash_verifier_grammar_seconds_total`` /
   ``_grammar_rows_total`` read around each request) against a plain decode step.
2. **tool calls** (``data/bench/tools.jsonl``): every prompt whole and streamed in
   ``--tool-mode``: finish_reason ``tool_calls``, one call with a ``call_`` id, the named
   function when one is named, arguments that parse as JSON valid against its parameters.
3. **the grammar hook of a grammar-free row**: ``verifier_svc.grammar_rows.constrain`` on a
   row without a grammar, timed in this process (``--hook-calls`` calls), against the plain
   decode step: the bound on how much a grammar-capable verifier slows requests without one
   (the verifier has no switch to turn grammars off, and the hook is the only grammar code a
   grammar-free row runs besides two ``is None`` checks); the plain arm's grammar rows must be 0.

Output: ``structured.json`` and ``structured.md`` in ``--out``; progress on stderr.

    python scripts/bench_structured.py --out docs/bench/structured-<tag>    # SmolLM2
    python scripts/bench_structured.py --tiny --out /tmp/structured         # smoke run, no figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_app import bench_structured as bs, bench_structured_report as report  # noqa: E402
from dflash_app.launcher import DrafterSpec, LocalStack, StackConfig, free_run  # noqa: E402

GRAMMAR_S, GRAMMAR_ROWS = "dflash_verifier_grammar_seconds_total", "dflash_verifier_grammar_rows_total"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start(a, run_dir: Path) -> tuple[LocalStack, str]:
    """The stack; returns it and the verifier's /metrics (host:port). Raises LaunchError."""
    base = free_run(6)
    gw, admin, http, ver, dr, metrics = range(base, base + 6)
    cfg = StackConfig(target=a.target, drafters=[DrafterSpec(path=a.drafter, port=dr)], gateway_port=gw,
                      admin_port=admin, http_port=http, verifier_port=ver, run_dir=str(run_dir / "stack"),
                      metrics_ports={"verifier": metrics}, verifier_args=["--suffix-answer-tokens", "0"],
                      health_timeout_s=900)
    stack = LocalStack(cfg)
    log(f"starting drafter, verifier, gateway (logs in {cfg.run_dir}) ...")
    return stack.start(), f"127.0.0.1:{metrics}"


def grammar_counts(metrics: str) -> tuple[float, float]:
    """The verifier's grammar seconds and rows so far, from its /metrics at ``metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return got.get(GRAMMAR_S, 0.0), got.get(GRAMMAR_ROWS, 0.0)


def _arm_body(arm: str, schema: dict | None) -> dict:
    """The request's grammar and speculation for an arm (the baseline: no drafter, mode off,
    so not even forced tokens are verified as drafts)."""
    body: dict = {"extra_body": {"speculation": False, "speculation_mode": "off"} if arm in (bs.OFF, bs.PLAIN)
                  else {"speculation_mode": arm}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "extraction", "schema": schema, "strict": True}}
    return body


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, body: dict) -> dict:
    """One greedy streamed chat request; its text, token bytes, finish, timing and statistics."""
    t0 = time.perf_counter()
    first = last = None
    text, toks, finish, sd, usage = [], [], None, None, None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, logprobs=True, **body):
        now = time.perf_counter()
        for ch in chunk.choices:
            lps = ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
            if lps:
                first, last = first or now, now
                toks += [bytes(lp.bytes or []).hex() for lp in lps]
            text.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
            sd = ((chunk.model_extra or {}).get("metrics") or {}).get("speculative_decoding")
    return {"text": "".join(text), "token_bytes": toks, "finish": finish, "sd": sd,
            "tokens": usage.completion_tokens if usage else len(toks),
            "ttft_s": (first or t0) - t0, "decode_s": (last or t0) - (first or t0)}


def extraction_row(client, model: str, metrics: str, item: dict, arm: str, a) -> dict:
    schema = None if arm == bs.PLAIN else (bs.bounded(item["schema"]) if a.tiny else item["schema"])
    g0 = grammar_counts(metrics)
    out = stream_chat(client, model, bs.extraction_messages(item),
                      a.plain_tokens if arm == bs.PLAIN else a.max_tokens, _arm_body(arm, schema))
    g1 = grammar_counts(metrics)
    plain = arm == bs.PLAIN
    return {"id": item["id"], "arm": arm, **out, "grammar_s": g1[0] - g0[0], "grammar_rows": int(g1[1] - g0[1]),
            "valid": not plain and bs.valid(out["text"], item["schema"]),
            "correct_fields": 0 if plain else bs.correct_fields(out["text"], item["answer"]),
            "fields": 0 if plain else len(item["answer"])}


def run_extraction(client, model: str, metrics: str, items: list[dict], a) -> dict[str, list[dict]]:
    """Every prompt through every arm, interleaved, the order rotated per prompt."""
    arms = [bs.OFF, *a.modes, bs.PLAIN]
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    for i, item in enumerate(items):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            r = extraction_row(client, model, metrics, item, arm, a)
            rows[arm].append(r)
            log(f"extraction {i + 1}/{len(items)} {item['id']} {arm}: {r['tokens']} tokens, "
                f"{'valid' if r['valid'] else 'free text' if arm == bs.PLAIN else 'INVALID'}, {r['finish']}")
    return rows


@dataclasses.dataclass
class Answer:
    """One response to a tools prompt: its calls (``[{"id", "type", "name", "arguments"}]``),
    finish reason, text and statistics."""

    calls: list[dict]
    finish: str | None
    content: str | None
    sd: dict | None


def _tools(item: dict, a) -> list[dict]:
    """The request's tools (--tiny: their parameters bounded, as the extraction schemas)."""
    if not a.tiny:
        return item["tools"]
    return [{**t, "function": {**t["function"], "parameters": bs.bounded(t["function"].get("parameters", {}))}}
            for t in item["tools"]]


def _tool_whole(client, model: str, item: dict, a) -> Answer:
    r = client.chat.completions.create(model=model, messages=item["messages"], tools=_tools(item, a),
                                       tool_choice=item["tool_choice"], temperature=0, max_tokens=a.tool_tokens,
                                       extra_body={"speculation_mode": a.tool_mode})
    c = r.choices[0]
    calls = [{"id": t.id, "type": t.type, "name": t.function.name, "arguments": t.function.arguments}
             for t in c.message.tool_calls or []]
    return Answer(calls, c.finish_reason, c.message.content,
                  ((r.model_extra or {}).get("metrics") or {}).get("speculative_decoding"))


def _tool_stream(client, model: str, item: dict, a) -> Answer:
    calls: dict[int, dict] = {}
    finish = sd = None
    content = ""
    for chunk in client.chat.completions.create(
            model=model, messages=item["messages"], tools=_tools(item, a), tool_choice=item["tool_choice"],
            temperature=0, max_tokens=a.tool_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"speculation_mode": a.tool_mode}):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "type": None, "name": None, "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["type"] = tc.type or c["type"]
                if tc.function:
                    c["name"] = tc.function.name or c["name"]
                    c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
        if chunk.usage is not None:
            sd = ((chunk.model_extra or {}).get("metrics") or {}).get("speculative_decoding")
    return Answer([calls[k] for k in sorted(calls)], finish, content, sd)


def run_tools(client, model: str, items: list[dict], a) -> list[dict]:
    rows = []
    for i, item in enumerate(items):
        for variant, call in (("whole", _tool_whole), ("stream", _tool_stream)):
            ans = call(client, model, item, a)
            problems = bs.tool_problems(item, ans.calls, ans.finish, ans.content)
            c = ans.calls[0] if len(ans.calls) == 1 else {}
            rows.append({"id": item["id"], "variant": variant, "problems": problems, "name": c.get("name"),
                         "arguments": c.get("arguments"), "expected_tool": item["expected_tool"],
                         "sd": ans.sd})
            log(f"tools {i + 1}/{len(items)} {item['id']} {variant}: {'ok' if not problems else problems}")
    return rows


def hook_cost(calls: int, plain_step_ms: float | None, plain_rows: int) -> dict:
    """The grammar hook of a row without a grammar, timed here (module docstring, 3.)."""
    from verifier_svc.decode_state import DecodeState, StepRow
    from verifier_svc.grammar_rows import constrain

    row = StepRow(DecodeState(req=None, session=None), 0, None, None)   # only .state.grammar is read
    best = float("inf")
    for _ in range(5):                # the fastest of 5: the hook's cost, not this machine's noise
        t0 = time.perf_counter()
        for _ in range(calls):
            constrain(row)
        best = min(best, (time.perf_counter() - t0) / calls)
    ns = best * 1e9
    ratio = plain_step_ms / (plain_step_ms + ns * 1e-6) if plain_step_ms else None
    return {"ns_per_row": ns, "calls": calls, "plain_step_ms": plain_step_ms, "throughput_ratio": ratio,
            "plain_grammar_rows": plain_rows}


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _modes(text: str) -> list[str]:
    from dflash.core.speculation import MODES

    items = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in items if m not in MODES or m == bs.OFF]
    if not items or bad or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"expected distinct speculation modes other than off "
                                         f"({', '.join(m for m in MODES if m != bs.OFF)}), got {text!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for structured.json / structured.md")
    p.add_argument("--target", help="target model dir (default: SmolLM2-135M-Instruct, set up on demand)")
    p.add_argument("--drafter", help="drafter dir (default: models/smollm2-dflash-b16)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight models, every string of a schema "
                   "at most 4 characters (bench_structured.bounded): a smoke run, no figures")
    p.add_argument("--extraction", default=str(bs.EXTRACTION), help="the extraction set (JSONL)")
    p.add_argument("--tools", default=str(bs.TOOLS), help="the tool-call set (JSONL)")
    p.add_argument("--limit", type=_positive, help="first N extraction prompts (default all)")
    p.add_argument("--tool-limit", type=_positive, help="first N tool prompts (default all)")
    p.add_argument("--modes", type=_modes, default=_modes("adaptive,hybrid,fixed"),
                   help="speculation modes run with the grammar beside constrained off (comma-separated)")
    p.add_argument("--tool-mode", default="adaptive", help="the tool calls' speculation mode")
    p.add_argument("--max-tokens", type=_positive, help="tokens per constrained request (192; --tiny 400)")
    p.add_argument("--tool-tokens", type=_positive, help="tokens per tool-call request (160; --tiny 200)")
    p.add_argument("--plain-tokens", type=_positive, default=64, help="tokens per plain-off request")
    p.add_argument("--hook-calls", type=_positive, default=200_000, help="calls timed of the grammar hook")
    p.add_argument("--run-dir", help="service logs (default: a temp dir)")
    a = p.parse_args(argv)
    a.max_tokens = a.max_tokens or (400 if a.tiny else 192)
    a.tool_tokens = a.tool_tokens or (200 if a.tiny else 160)
    return a


def measure(a, ex: list[dict], tl: list[dict], run_dir: Path) -> dict:
    import openai

    stack, metrics = start(a, run_dir)
    try:
        client = openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        rows = run_extraction(client, model, metrics, ex, a)
        tools = run_tools(client, model, tl, a)
        client.close()
    finally:
        stack.stop()
    extraction = report.extraction_summary(rows)
    plain_rows = sum(r["grammar_rows"] for r in rows[bs.PLAIN])
    return {"extraction": extraction, "tools": report.tool_summary(tools),
            "hook": hook_cost(a.hook_calls, extraction["plain_step_ms"], plain_rows),
            "rows": {"extraction": rows, "tools": tools}}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from dflash_app.stack import DEFAULT_DRAFTER, tiny_models

    if a.tiny and not a.target:
        a.target, a.drafter = tiny_models()
    if not a.target:
        from dflash.train.target_setup import setup_target
        a.target = str(setup_target())
    a.target, a.drafter = (str(Path(x).resolve()) for x in (a.target, a.drafter or DEFAULT_DRAFTER))
    ex, tl = bs.load_sets(a.extraction, a.tools)
    ex, tl = ex[:a.limit], tl[:a.tool_limit]
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="bench-structured-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res = measure(a, ex, tl, run_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    res["config"] = {"target": a.target, "drafter": a.drafter, "tiny": a.tiny, "modes": a.modes,
                     "tool_mode": a.tool_mode, "max_tokens": a.max_tokens, "tool_tokens": a.tool_tokens,
                     "plain_tokens": a.plain_tokens,
                     "extraction_prompts": len(ex), "tool_prompts": len(tl), "commit": commit,
                     "run_dir": str(run_dir), "wall_s": round(time.monotonic() - t0, 1),
                     "host": {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(res, indent=1) + "\n")
    md = report.markdown(res)
    (out / "structured.md").write_text(md)
    print(md)
    log(f"wrote {out}/structured.json, structured.md in {res['config']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
