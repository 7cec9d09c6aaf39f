"""``dflash diagnose``: is this drafter wired right for this target, and does speculation pay?

    dflash diagnose --target DIR --drafter DIR [--prompts humaneval,chat] [--json]
    dflash diagnose --gateway HOST:PORT --metrics HOST:PORT [--use-drafter NAME@VERSION]

(a) static: the config against the target (layer ids, sizes, mask token, rope, sliding-window
layers, draft vocabulary, fingerprint, the verifier's own card check), each finding naming its
field; (b) teacher-forced probe: the target's greedy continuation of each prompt, every response
position an anchor, the drafter scored under its saved config and under each setting a
mis-wired checkpoint would need (target_layer_ids shifted -2..+2, controls, other mask tokens,
the target's rope, sliding layers), with a paired test per setting naming the fix and the exact
config.json edit; (c) costs: verify and draft seconds per block length of the target and
drafter as the services would serve them (their threads, dtypes, skinny and packed products;
or, with --gateway --metrics, the deployment's own policy cells and acceptance), and every
servable mode priced at the measured acceptance, chains and trees, suffix and hybrid trees
(suffix candidates replayed over the continuations, dflash_app/diagnose_suffix.py), with
the adaptive policy's own choice: "speculation at block 16 is 1.2x plain decoding here; trees 15 nodes 1.6x; adaptive
chooses a tree of 15 nodes; expected 1.6x", per prompt domain. docs/diagnose.md explains every
finding.

Verdicts and exit status: 0 healthy (wired right; speculation pays here, or breaks even within
the stated spread); 1 mis-wired (a setting fits significantly better: the fix is named); 2
broken (a static error, or a drafter that drafts nothing and no setting mends it); 3 degraded
(wired right, but the best servable mode is below plain decoding by more than the spread, or,
with no costs, acceptance is low).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from dflash_app.diagnose_gateway import DEPLOYMENT, gateway_figures
from dflash_app.probe import BROKEN_P1, BROKEN_TAU, DEGRADED_P1, DEGRADED_TAU

EXIT = {"healthy": 0, "mis-wired": 1, "broken": 2, "degraded": 3}
DEFAULT_SETS = "humaneval,chat"


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="is a drafter wired right for a target, and does "
                       "speculation pay", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model directory")
    p.add_argument("--drafter", help="drafter directory (z-lab format)")
    p.add_argument("--gateway", help="a running gateway: its live tau on the probe prompts")
    p.add_argument("--metrics", action="append", default=[],
                   help="with --gateway: the verifier's Prometheus /metrics (HOST:PORT or URL): "
                        "its acceptance counters and the policy's cost cells")
    p.add_argument("--use-drafter", default="", help="with --gateway: name or name@version")
    p.add_argument("--prompts", default=None,
                   help=f"comma-separated prompt sets: humaneval, chat, JSONL files (default "
                        f"{DEFAULT_SETS}); each is a domain of its own in the report")
    p.add_argument("--prompt", action="append", help="a probe prompt (repeat); replaces --prompts "
                   "unless that is given too")
    p.add_argument("--raw", action="store_true", help="--prompt as raw text, no chat template")
    p.add_argument("--num-prompts", type=int, default=10,
                   help="prompts drawn from the sets in all, split evenly (default 10)")
    p.add_argument("--seed", type=int, default=0, help="which prompts are drawn (default 0)")
    p.add_argument("--first", action="store_true",
                   help="the first --num-prompts of the sets (split evenly) instead of a --seed "
                        "draw: the prompts `dflash bench --limit N` runs")
    p.add_argument("--max-tokens", type=int, default=96, help="continuation length per prompt")
    p.add_argument("--offset-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="try the alternative settings (shifts, controls, mask tokens, rope, "
                        "sliding layers); --no-offset-probe measures the saved config only")
    p.add_argument("--no-cost", action="store_true", help="skip measuring step costs")
    p.add_argument("--no-live", action="store_true", help="static check only")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of the forwards whose costs are measured; 0 (default) = "
                        "the services' own (DFLASH_TORCH_THREADS, else torch's default). The "
                        "teacher-forced probe runs on one thread either way")
    p.add_argument("--dtype", default=None,
                   help="dtype of the served target and drafter whose costs are measured; "
                        "default the services' own (DFLASH_DTYPE, else auto). The probe's "
                        "drafter scores in float32 either way")
    p.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------- prompts
def draw_prompts(a) -> list[tuple[str, object]]:
    """``(domain, prompt)`` pairs: ``--prompt`` texts (domain "prompt") and ``--num-prompts``
    drawn with ``--seed`` from the ``--prompts`` sets (chat message lists)."""
    from dflash_app.bench_prompts import prompt_set

    out: list[tuple[str, object]] = [("prompt", p) for p in (a.prompt or [])]
    names = a.prompts or ("" if a.prompt else DEFAULT_SETS)
    names = [n for n in names.split(",") if n]
    if a.num_prompts < len(names):
        raise SystemExit(f"dflash diagnose: error: --num-prompts: {a.num_prompts} is fewer than "
                         f"the {len(names)} prompt sets")
    rng = random.Random(a.seed)
    for i, name in enumerate(names):
        try:
            items = prompt_set(name)
        except ValueError as e:
            raise SystemExit(f"dflash diagnose: error: {e}") from None
        want = min(a.num_prompts // len(names) + (i < a.num_prompts % len(names)), len(items))
        domain = name if name in ("humaneval", "chat") else name.rsplit("/", 1)[-1]
        picked = items[:want] if a.first else rng.sample(items, want)
        out += [(domain, m) for _, m in picked]
    return out


def _encode(tok, prompt, raw: bool) -> list[int]:
    from dflash.train.eval_sets import encode_messages

    if isinstance(prompt, list):
        return encode_messages(tok, prompt)
    if raw or not tok.chat_template:
        return list(tok.encode(prompt))
    return encode_messages(tok, [{"role": "user", "content": prompt}])


# ---------------------------------------------------------------------- the report
def diagnose(a) -> dict:
    """The whole report as a dict (what ``--json`` prints)."""
    from dflash_app.drafter_check import check

    t0, c0 = time.perf_counter(), time.process_time()
    report: dict = {"static": [], "probe": None, "costs": None, "speculation": None, "live": None,
                    "deployment": None, "fixes": [], "verdict": None, "causes": [], "notes": []}
    if not (a.gateway or (a.drafter and a.target)):
        raise SystemExit("dflash diagnose: error: give --target and --drafter, or --gateway")
    if a.metrics and not a.gateway:
        raise SystemExit("dflash diagnose: error: --metrics: reads a deployment; give --gateway too")
    warnings: list[str] = []
    if a.drafter and a.target:
        findings = check(a.drafter, a.target)
        report["static_s"] = round(time.perf_counter() - t0, 1)
        report["static"] = [vars(f) | {"text": str(f)} for f in findings]
        warnings = [str(f) for f in findings if f.level == "warning"]
        errors = [str(f) for f in findings if f.level == "error"]
        if errors:
            report.update(verdict="broken", causes=errors, notes=warnings)
            return _timed(report, t0, c0)
    if a.no_live:
        report.update(verdict="degraded" if warnings else "healthy", causes=warnings)
        return _timed(report, t0, c0)
    prompts = draw_prompts(a)
    costs = blocks = None
    trees: dict[str, dict[int, float]] = {}
    replays: dict = {}                  # domain -> diagnose_suffix.SuffixReplay
    if a.gateway:
        costs, blocks, trees = gateway_figures(a, prompts, report)
    budgets = _tree_budgets()
    if a.drafter and a.target:
        local, local_trees, costs, budgets, replays = _in_process(a, prompts, report, costs, budgets)
        blocks = local | {k: v for k, v in (blocks or {}).items() if k != "all"}
        trees = local_trees | {k: v for k, v in trees.items() if k != "all"}
    _speculation(report, costs, blocks, trees, budgets, replays)
    _verdict(report, warnings)
    return _timed(report, t0, c0)


def _tree_budgets() -> tuple[tuple[int, ...], int]:
    """The verifier's default ``--tree-budgets`` and ``--tree-budget`` (its parser and env)."""
    from verifier_svc import server

    va = server.parse_args(["--target", "-"])
    return server.parse_budgets(va.tree_budgets), int(va.tree_budget)


def _timed(report: dict, t0: float, c0: float) -> dict:
    report["timing"] = {"wall_s": round(time.perf_counter() - t0, 1),
                        "cpu_s": round(time.process_time() - c0, 1)}
    return report


def _in_process(a, prompts, report, costs, budgets):
    """The teacher-forced probe, every setting, the vocabulary coverage, tree acceptance, and
    the step costs of the served pair (``dflash_app.served``), loaded first: it picks the
    threads before any torch work. Returns (chain blocks, tokens per tree step, costs, the
    verifier's tree budgets), by domain."""
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer

    from dflash.core.token_shards import DataError
    from dflash_app.diagnose_modes import LABEL
    from dflash_app.diagnose_suffix import SuffixSettings, replays as suffix_replays
    from dflash_app.diagnose_tf import Head, counter, score, walk
    from dflash_app.diagnose_trees import drafter_tops, tree_steps, tree_summary
    from dflash_app.diagnose_wiring import (
        best_fixes,
        controls_sentence,
        equivalents,
        fix_sentence,
        mask_candidates,
        run_settings,
        settings,
        vocab_coverage,
    )
    from dflash_app.probe import InProcessProbe
    from dflash_app.served import load_served

    t = time.perf_counter()
    served = None
    if costs is None and not a.no_cost:
        served = load_served(a.target, a.drafter, threads=a.threads, dtype=a.dtype)
        budgets = (served.tree_budgets, served.tree_budget)
        report["threads"] = served.threads
    else:
        torch.set_num_threads(1)        # the probe: one thread (shared cores spin otherwise)
    serve_s = time.perf_counter() - t
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.target)
    try:
        probe = InProcessProbe(a.target, a.drafter, target=served.target if served else None)
    except BaseException:
        if served:
            served.close()
        raise
    load_s = time.perf_counter() - t
    try:
        t = time.perf_counter()
        ids = [_encode(tok, p, a.raw) for _, p in prompts]
        seqs = probe.collect(ids, [d for d, _ in prompts], max_new_tokens=a.max_tokens)
        gen_s = time.perf_counter() - t
        if not seqs:
            raise SystemExit("dflash diagnose: error: no prompt got a continuation of 2 tokens or "
                             "more to draft against (raise --max-tokens, or other prompts)")
        cfg = probe.drafter.cfg
        raw_t = json.loads((Path(a.target) / "config.json").read_text())
        tcfg = raw_t.get("text_config", raw_t)
        masks = mask_candidates(tok, probe.head.embed, cfg.mask_token_id) if a.offset_probe else []
        sets = settings(cfg, a.drafter, tcfg, masks)
        if not a.offset_probe:
            sets = sets[:1]
        head = Head.of(probe.head.lm_head, probe.engine.draft_vocab)
        t = time.perf_counter()
        outcomes = run_settings(probe.drafter, probe.head, head, seqs, sets, seed=a.seed)
        score_s = time.perf_counter() - t
        saved = outcomes[0]
        blocks = walk(saved.scores, seqs)
        domains = {}
        for dom, rows in blocks.items():
            c = counter(rows)
            domains[dom] = {"tau": round(c.mean_acceptance_length, 3), "drafts": c.drafts,
                            "per_position": [round(r, 4) for r in c.per_position_rate],
                            "prompts": sum(s.domain == dom for s in seqs) if dom != "all" else len(seqs)}
        # what is priced is the served drafter's own acceptance: in its dtype, when that is
        # not the probe's float32 (the wiring statistics keep full precision)
        net, net_head, rows_head, scores = probe.drafter, probe.head, head, saved.scores
        t = time.perf_counter()
        if served is not None and served.drafter.card.dtype != probe.engine.card.dtype:
            net, net_head = served.drafter.drafter, served.drafter.head
            rows_head = Head.of(net_head.lm_head, served.drafter.draft_vocab)
            scores = score(net, net_head, rows_head, seqs, layer_ids=probe.layer_ids,
                           mask_token_id=cfg.mask_token_id)
            blocks = walk(scores, seqs)
            for dom, rows in blocks.items():
                domains[dom]["tau_served"] = round(counter(rows).mean_acceptance_length, 3)
                domains[dom]["served_dtype"] = served.drafter.card.dtype
        if len(blocks) == 2:                    # one domain: it is "all"
            blocks = {"all": blocks["all"]}
        sizes = sorted(set(budgets[0]) | {budgets[1]})
        tops = drafter_tops(net, net_head, rows_head, seqs, sizes, layer_ids=probe.layer_ids,
                            mask_token_id=cfg.mask_token_id) if sizes else None
        steps = tree_steps(net, net_head, rows_head, seqs, sizes, layer_ids=probe.layer_ids,
                           mask_token_id=cfg.mask_token_id, tops=tops)
        # suffix candidates replayed over the continuations (diagnose_suffix), per domain
        suffix_settings = SuffixSettings.served(probe.target.fingerprint)
        try:                                    # the corpus as the verifier would load it
            _ = suffix_settings.corpus_index
        except DataError as e:
            raise SystemExit(f"dflash diagnose: error: {e}") from None
        replays = suffix_replays(seqs, scores, tops, block_size=cfg.block_size,
                                 max_tokens=a.max_tokens, label=LABEL, settings=suffix_settings)
        trees = {dom: tree_summary(v) for dom, v in steps.items() if dom in blocks}
        for dom, tv in trees.items():
            domains[dom]["tree_tokens"] = {n: round(x, 3) for n, x in tv.items()}
        tree_s = time.perf_counter() - t
        reads, ctl = controls_sentence(outcomes) if a.offset_probe else (True, "")
        B = cfg.block_size
        report["probe"] = {
            "prompts": len(seqs), "anchors": int(saved.scores.prompt.numel()),
            "block_size": B, "max_tokens": a.max_tokens, "domains": domains,
            "settings": [o.as_dict() for o in outcomes], "controls": ctl, "reads_taps": reads,
            "vocab": vocab_coverage(seqs, probe.engine.draft_vocab, cfg.vocab_size, tok),
            "seconds": {"load served": round(serve_s, 1), "load": round(load_s, 1),
                        "generate": round(gen_s, 1), "score": round(score_s, 1),
                        "trees": round(tree_s, 1)}}
        fixes = best_fixes(outcomes)
        report["fixes"] = [{"setting": o.setting.name, "edit": o.setting.edit,
                            "sentence": fix_sentence(o, saved, B, equivalents(o, outcomes))}
                           for o in fixes]
        if fixes:   # what the best fix would give (its own walk; the costs are the same)
            blocks["with the fix"] = walk(fixes[0].scores, seqs)["all"]
        if served is not None:
            from dflash_app.diagnose_cost import measure_costs

            t = time.perf_counter()
            costs = served.run(lambda: measure_costs(served.target, served.drafter,
                                                     max(ids, key=len), B, threads=served.threads))
            costs.settings = served.choices()
            report["probe"]["seconds"]["costs"] = round(time.perf_counter() - t, 1)
        return blocks, trees, costs, budgets, replays
    finally:
        probe.close()
        if served is not None:
            served.close()


def _speculation(report: dict, costs, blocks, trees, budgets, replays) -> None:
    """Every servable mode priced per domain (``dflash_app.diagnose_cost.payoff``), suffix
    modes over that domain's replay (``dflash_app.diagnose_suffix``) where there is one."""
    from dflash_app.diagnose_cost import payoff

    if costs is None:
        return
    report["costs"] = costs.as_dict()
    if not blocks:
        return
    B = (report["probe"] or {}).get("block_size") or (report["live"] or {}).get("block_size") or \
        1 + max(d for rows in blocks.values() for d, _ in rows)
    pays = {}
    for dom, rows in blocks.items():
        # the deployment's trees are the budgets its own policy measured
        arms = tuple(sorted(trees.get(dom) or {})) if dom == DEPLOYMENT else budgets[0]
        if rows:
            pays[dom] = payoff(costs, rows, B, trees=trees.get(dom), tree_budgets=arms,
                               tree_budget=budgets[1], replay=replays.get(dom))
    report["speculation"] = {dom: p.as_dict() for dom, p in pays.items() if p is not None}


def _verdict(report: dict, warnings: list[str]) -> None:
    probe, live, spec = report["probe"], report["live"], report["speculation"] or {}
    figures = probe["domains"]["all"] if probe else live
    tau = figures["tau"] if figures else 1.0
    p1 = (figures["per_position"] or [0.0])[0] if figures else 0.0
    priced = DEPLOYMENT if DEPLOYMENT in spec else "all"
    pay = spec.get(priced)
    report["verdict_from"] = priced if pay is not None else None
    notes = list(warnings) + report["notes"]
    if probe and probe["controls"]:
        notes.append(probe["controls"])
    vocab = probe and probe["vocab"]
    if vocab and vocab["coverage"] < 0.98:
        notes.append(f"draft vocabulary: its {vocab['ids']} ids hold {100 * vocab['coverage']:.1f}% "
                     f"of the target's tokens here (missing most: {vocab['missing']}); "
                     "serve with --draft-vocab-size 0 or rebuild draft_vocab.safetensors")
    steps = live and live["drafts"] + live["fallback_steps"]
    if report["fixes"]:
        verdict, causes = "mis-wired", [f["sentence"] for f in report["fixes"]]
    elif not probe and steps and live["fallback_steps"] > steps / 2:
        verdict, causes = "broken", [f"the drafter failed {live['fallback_steps']} of {steps} steps "
                                     "(unreachable, timeouts or errors): see its log and "
                                     "dflash_spec_decode_fallback_steps"]
    elif tau < BROKEN_TAU or p1 < BROKEN_P1:
        verdict = "broken"
        causes = [f"the drafter drafts almost nothing: tau {tau:.2f}, first-position acceptance "
                  f"{p1:.3f}"]
        if probe and not probe["reads_taps"]:
            causes.append(probe["controls"])
        causes += ["untrained or random weights, or trained for another target or tokenizer "
                   "(dflash_serve.target_fingerprint)", "no setting tried mends it (shifts, mask "
                   "tokens, rope, sliding layers): see the settings table"]
    elif pay is not None and pay["does_not_pay"]:
        best = (f"the best servable mode, {pay['best_mode']}, is {pay['best_speedup']:.2f}x plain "
                f"decoding, below 1.0x by more than the spread (+-{pay['spread']:.2f})"
                if pay["best_mode"] else "no speculative mode could be priced")
        verdict, causes = "degraded", [f"speculation does not pay here at tau {tau:.2f}: {best}; "
                                       f"{pay['sentence']}"]
    elif pay is None and (tau < DEGRADED_TAU or p1 < DEGRADED_P1):
        verdict, causes = "degraded", [f"low acceptance: tau {tau:.2f}, first-position "
                                       f"acceptance {p1:.3f} (prompts far from the drafter's "
                                       "training data, or a weak drafter)"]
    else:
        verdict, causes = "healthy", []
        if pay is not None and not pay["pays"]:
            notes.append(f"speculation breaks even here, within the spread: {pay['sentence']}")
    report.update(verdict=verdict, causes=causes, notes=[n for n in notes if n not in causes])


def run(a) -> int:
    if "torch" not in sys.modules:        # as the services' entry points, before libgomp loads
        from dflash.serving.omp import default_spin_count

        default_spin_count()
    import torch

    from dflash_app.diagnose_report import render

    if a.threads < 0:
        raise SystemExit(f"dflash diagnose: error: --threads: must be >= 0, got {a.threads}")
    if a.max_tokens < 2:
        raise SystemExit(f"dflash diagnose: error: --max-tokens: must be >= 2, got {a.max_tokens}")
    report = diagnose(a)
    report.setdefault("threads", torch.get_num_threads())
    print(json.dumps(report, indent=2) if a.json else render(report))
    sys.stdout.flush()
    return EXIT.get(report["verdict"], 2)
