"""``dflash diagnose``: does this drafter fit this target, and does it accept?

    dflash diagnose --target DIR --drafter DIR                 static check + live probe
    dflash diagnose --target DIR --drafter DIR --offset-probe  + tau with target_layer_ids -1/0/+1
    dflash diagnose --gateway HOST:PORT [--use-drafter NAME]   live probe of a running stack

(a) static: layer ids in range, hidden size, vocabulary and embedding rows, mask token id, rope
settings, sliding-window layers, block size, weights (each finding names its field);
(b) live: tau and per-position acceptance over a few prompts, a verdict (healthy / degraded /
broken) with likely causes; (c) offsets: the same with every tap id shifted by -1, 0, +1; says
so when a shift does better (the "output of layer i" vs "hidden_states[i]" off-by-one).
Exit status: 0 healthy, 1 degraded, 2 broken or a static error.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
]
EXIT = {"healthy": 0, "degraded": 1, "broken": 2}


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="check a drafter against a target: static, live tau, "
                       "layer-offset probe", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model directory")
    p.add_argument("--drafter", help="drafter directory (z-lab format)")
    p.add_argument("--gateway", help="probe a running gateway instead of loading models")
    p.add_argument("--use-drafter", default="", help="with --gateway: name or name@version")
    p.add_argument("--prompt", action="append", help="probe prompt (repeat); default: 3 built-in")
    p.add_argument("--raw", action="store_true", help="prompts as raw text, no chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--offset-probe", action="store_true",
                   help="also measure tau with target_layer_ids shifted by -1 and +1")
    p.add_argument("--no-live", action="store_true", help="static check only")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    p.set_defaults(func=run)


def _tokenize(target: str, prompts: list[str], raw: bool) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    if raw or not tok.chat_template:
        return [list(tok.encode(p)) for p in prompts]
    return [list(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)) for p in prompts]


def diagnose(a) -> dict:
    """The whole report as a dict (what ``--json`` prints)."""
    from dflash.drafter_check import check
    from dflash.probe import InProcessProbe, gateway_probe, judge, offset_conclusion

    report: dict = {"static": [], "live": None, "verdict": None, "causes": [], "offsets": None}
    prompts = a.prompt or DEFAULT_PROMPTS
    static_issues: list[str] = []
    if a.drafter and a.target:
        findings = check(a.drafter, a.target)
        report["static"] = [vars(f) | {"text": str(f)} for f in findings]
        static_issues = [str(f) for f in findings if f.level != "ok"]
        if any(f.level == "error" for f in findings):
            report["verdict"], report["causes"] = "broken", static_issues
            return report
    if a.no_live:
        report["verdict"] = "healthy" if not static_issues else "degraded"
        report["causes"] = static_issues
        return report
    probe = None
    if a.gateway:
        live = gateway_probe(a.gateway, prompts, max_tokens=a.max_tokens, drafter=a.use_drafter,
                             raw=a.raw)
    else:
        if not (a.drafter and a.target):
            raise SystemExit("dflash diagnose: give --target and --drafter, or --gateway")
        probe = InProcessProbe(a.target, a.drafter, dtype=a.dtype)
        ids = _tokenize(a.target, prompts, a.raw)
        live = probe.run(ids, max_tokens=a.max_tokens)
    v = judge(live, static_issues)
    report.update(live=_probe_dict(live), verdict=v.verdict, causes=v.causes)
    if a.offset_probe:
        if probe is None:
            report["offsets"] = {"note": "the offset probe loads the models: use --target/--drafter"}
        else:
            rows = probe.offsets(ids, max_tokens=a.max_tokens, base=live)
            best, sentence = offset_conclusion(rows)
            report["offsets"] = {
                "rows": [{"shift": d, "target_layer_ids": list(i), "tau": r.tau if r else None,
                          "per_position": r.stats.per_position_rate if r else None}
                         for d, i, r in rows],
                "best_shift": best, "conclusion": sentence}
            if best:
                report["causes"] = [sentence] + [c for c in report["causes"] if "offset probe" not in c]
    return report


def _probe_dict(r) -> dict:
    s = r.stats
    return {"tau": s.mean_acceptance_length, "per_position": s.per_position_rate,
            "draft_acceptance_rate": s.draft_acceptance_rate, "drafts": s.drafts,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "fallback_steps": s.fallback_steps, "block_size": r.block_size, "prompts": r.prompts,
            "seconds": r.seconds, "summary": r.summary()}


def render(report: dict) -> str:
    lines = []
    if report["static"]:
        lines.append("static check:")
        lines += [f"  {f['text']}" for f in report["static"]]
    if report["live"]:
        lines.append(f"live probe: {report['live']['summary']}")
    if report["offsets"] and "rows" in report["offsets"]:
        lines.append("offset probe:")
        for row in report["offsets"]["rows"]:
            tau = "out of range" if row["tau"] is None else f"tau {row['tau']:.2f}"
            lines.append(f"  shift {row['shift']:+d} target_layer_ids {row['target_layer_ids']}: {tau}")
        lines.append(f"  {report['offsets']['conclusion']}")
    lines.append(f"verdict: {report['verdict']}")
    word = "note" if report["verdict"] == "healthy" else "likely cause"
    lines += [f"  {word}: {c}" for c in report["causes"]]
    return "\n".join(lines)


def run(a) -> int:
    report = diagnose(a)
    print(json.dumps(report, indent=2) if a.json else render(report))
    sys.stdout.flush()
    return EXIT.get(report["verdict"], 2)
