"""The text form of a ``dflash diagnose`` report (``dflash_app.diagnose.diagnose`` builds the dict;
``--json`` prints that dict as it is)."""

from __future__ import annotations


def _rates(xs, n: int = 6) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in (xs or [])[:n]) + (", ..." if len(xs or []) > n else "") + "]"


def _setting_line(s: dict) -> str:
    taps = s["target_layer_ids"]
    head = f"  {s['name']:38s} taps {str(taps):22s} mask {s['mask_token_id']:<6d}"
    acc = f"acc {_rates(s['position_accuracy'], 4)}"
    tau = "" if s["tau"] is None else f" tau {s['tau']:.2f}"
    ce = s["vs_saved_cross_entropy"]
    if ce is None:
        return f"{head} ce {s['cross_entropy']:.3f}{tau} {acc}"
    sub = "" if s["stride"] == 1 else f" (1 anchor in {s['stride']})"
    flag = "  <- fits better" if s["significant"] else ""
    return (f"{head} ce {ce['mean']:+.3f} ({ce['lo']:+.3f}..{ce['hi']:+.3f}){tau} {acc}"
            f"{sub}{flag}")


def _sources(by: dict | None) -> str:
    """"; accepted drafts: drafter N / suffix M" when any suffix candidate was accepted."""
    if not by or not by.get("suffix"):
        return ""
    return f"; accepted drafts: drafter {by.get('drafter', 0):.0f} / suffix {by['suffix']:.0f}"


def render(report: dict) -> str:
    lines: list[str] = []
    if report["static"]:
        lines.append("static check:")
        lines += [f"  {f['text']}" for f in report["static"]]
    p = report.get("probe")
    if p:
        doms = ", ".join(f"{d} {v['prompts']}" for d, v in p["domains"].items() if d != "all")
        lines.append(f"teacher-forced probe: {p['prompts']} prompts ({doms}), {p['anchors']} "
                     f"anchors, up to {p['max_tokens']} tokens each ("
                     + ", ".join(f"{k} {v} s" for k, v in p["seconds"].items()) + ")")
        for d, v in p["domains"].items():
            if d != "all" and len(p["domains"]) == 2:
                continue
            served = (f"; the served {v['served_dtype']} drafter: tau {v['tau_served']:.2f}"
                      if "tau_served" in v else "")
            trees = ", ".join(f"{n} nodes {x:.2f}" for n, x in (v.get("tree_tokens") or {}).items())
            lines.append(f"  {d}: tau {v['tau']:.2f} (greedy decode, block {p['block_size']}, "
                         f"{v['drafts']} blocks), per-position {_rates(v['per_position'])}{served}"
                         + (f"; tokens per tree step {trees}" if trees else ""))
        lines.append("settings (cross-entropy of the target's tokens vs saved, nats per draft "
                     "position, 95% CI; tau; accuracy of draft positions 1-3):")
        lines += [_setting_line(s) for s in p["settings"]]
        if p["vocab"]:
            v = p["vocab"]
            lines.append(f"draft vocabulary: {v['ids']} ids hold {100 * v['coverage']:.2f}% of the "
                         f"{v['tokens']} tokens the target emitted; most frequent missing "
                         f"{v['missing']}")
    if report.get("live"):
        lines.append(f"gateway probe: {report['live']['summary']}"
                     + _sources(report["live"].get("accepted_by_source")))
    dep = report.get("deployment")
    if dep:
        tau = "-" if dep["tau"] is None else f"{dep['tau']:.2f}"
        lines.append(f"deployment ({dep['source']}, {dep['drafter_version']}): lifetime tau {tau} "
                     f"over {dep['drafts']:.0f} drafts, per-position {_rates(dep['per_position'])}; "
                     f"verify {dep['verify_ms']} ms, draft {dep['draft_ms']} ms per step"
                     + _sources(dep.get("accepted_by_source")))
    c = report.get("costs")
    if c:
        v = ", ".join(f"k={k} {ms}" for k, ms in c["verify_ms"].items())
        d = ", ".join(f"k={k} {ms}" for k, ms in c["draft_ms"].items() if int(k))
        lines.append(f"step costs ({c['source']}, ms): verify {v}" + (f"; draft {d}" if d else "") +
                     f"; overhead {c['overhead_ms']}")
        st = c.get("settings")
        if st:
            side = lambda x: (f"{x['dtype']}, skinny rows {x['skinny_max_rows']}, "   # noqa: E731
                              f"packed {x['packed_linear']}, panel {x.get('panel_linear', 'off')}")
            lines.append(f"  as served: {st['threads']} thread(s); target {side(st['target'])}; "
                         f"drafter {side(st['drafter'])}; tree budgets "
                         f"{','.join(map(str, st['tree_budgets'])) or 'none'} (mode tree "
                         f"{st['tree_budget']})")
    for dom, s in (report.get("speculation") or {}).items():
        lines.append(f"speculation ({dom}): {s['sentence']}")
    lines.append(f"verdict: {report['verdict']}")
    lines += [f"  cause: {c}" for c in report["causes"]]
    lines += [f"  note: {n}" for n in report["notes"]]
    t = report.get("timing")
    if t:
        lines.append(f"({t['wall_s']} s wall, {t['cpu_s']} s CPU, {report.get('threads', 1)} "
                     "thread(s))")
    return "\n".join(lines)
