"""``dflash bench --ep-sizes 1,2``: the same MoE target at several expert-parallel sizes, one run.

For each EP size it starts a stack (``dflash_app.launcher``, verifier ``--ep-size N``), runs the
prompts with speculation on and off (greedy), and stops it. Reported side by side: τ, decode
tokens/s, TPOT, verify time per target step, and the EP overhead per step (verify ms/step at EP=N
minus EP=1, speculation off: one target forward per step). Greedy outputs must be identical across
EP sizes and modes (the count is printed).

It also prints the expert all-to-all volume per step a token-dispatching EP moves on GPUs:
``tokens x hidden x dtype bytes x 2`` (dispatch + combine) per MoE layer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

# (name, hidden, MoE layers, dtype bytes) for the all-to-all table.
A2A_MODELS = [("SmolLM2-135M exact MoE (fp32)", 576, 30, 4),
              ("SmolLM2-135M exact MoE (bf16)", 576, 30, 2),
              ("Qwen3-30B-A3B (bf16)", 2048, 48, 2)]


def a2a_bytes_per_step(tokens: int, hidden: int, moe_layers: int, dtype_bytes: int) -> int:
    """Bytes one rank's tokens travel per target step: dispatch + combine in every MoE layer."""
    return tokens * hidden * dtype_bytes * 2 * moe_layers


def a2a_table(block_size: int = 16) -> str:
    lines = [f"| model | hidden | MoE layers | bytes/step, 1 token | bytes/step, block of {block_size} |",
             "|---|---|---|---|---|"]
    for name, h, n, b in A2A_MODELS:
        one, blk = a2a_bytes_per_step(1, h, n, b), a2a_bytes_per_step(block_size, h, n, b)
        lines.append(f"| {name} | {h} | {n} | {one / 1024:.0f} KiB | {blk / 2**20:.2f} MiB |")
    return "\n".join(lines) + "\n"


def _per_step_ms(rows: list[dict], spec: bool) -> float:
    steps = sum(r["drafts"] for r in rows) if spec else sum(max(r["tokens"] - 1, 0) for r in rows)
    return 1000 * sum(r.get("verify_s", 0.0) for r in rows) / max(steps, 1)


def cmd_ep(a, prompts, out: Path) -> int:
    from tqdm import tqdm

    from dflash_app.bench import aggregate, run_gateway
    from dflash_app.launcher import LocalStack
    from dflash_app.stack import stack_config

    sizes = [int(x) for x in a.ep_sizes.split(",") if x.strip()]
    rows: dict[str, list[dict]] = {}
    with tqdm(total=2 * len(sizes) * len(prompts), desc="bench ep", file=__import__("sys").stderr) as bar:
        for ep in sizes:
            args = copy.copy(a)
            args.ep_size = ep
            cfg = stack_config(args)
            cfg.run_dir = str(Path(a.run_dir) / f"ep{ep}")
            with LocalStack(cfg) as stack:
                for mode, spec in (("spec", True), ("off", False)):
                    bar.set_postfix_str(f"{mode} ep{ep}")
                    rows[f"{mode}@ep{ep}"] = run_gateway(stack.gateway_addr, prompts,
                                                         max_tokens=a.max_tokens, speculation=spec,
                                                         progress=bar)
    agg = {m: aggregate(r) for m, r in rows.items()}
    for m, r in rows.items():
        agg[m]["verify_ms_per_step"] = _per_step_ms(r, m.startswith("spec"))
    ref = {r["task_id"]: r["token_ids"] for r in rows[f"off@ep{sizes[0]}"]}
    same = {m: sum(r["token_ids"] == ref[r["task_id"]] for r in rs) for m, rs in rows.items()}
    results = {"config": {"prompts": len(prompts), "max_tokens": a.max_tokens, "ep_sizes": sizes},
               "aggregate": agg, "identical_to_first": same, "rows": rows}
    (out / "ep.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "ep.md").write_text(md)
    print(md)
    print(f"wrote {out}/ep.json, ep.md")
    return 0


def markdown(results: dict) -> str:
    agg, sizes = results["aggregate"], results["config"]["ep_sizes"]
    lines = ["| EP | mode | tau | decode tok/s | TPOT ms | verify ms/step | speedup vs off | "
             "greedy identical to first |", "|---|---|---|---|---|---|---|---|"]
    n = results["config"]["prompts"]
    for ep in sizes:
        off = agg[f"off@ep{ep}"]
        for mode in ("spec", "off"):
            x = agg[f"{mode}@ep{ep}"]
            lines.append(f"| {ep} | {mode} | {x['tau']:.2f} | {x['decode_tok_s']:.1f} | "
                         f"{x['tpot_ms']:.1f} | {x['verify_ms_per_step']:.1f} | "
                         f"{off['tpot_ms'] / x['tpot_ms']:.2f}x | "
                         f"{results['identical_to_first'][f'{mode}@ep{ep}']}/{n} |")
    base = agg[f"off@ep{sizes[0]}"]["verify_ms_per_step"]
    for ep in sizes[1:]:
        lines.append(f"\nEP overhead per target step (speculation off), EP={ep} vs EP={sizes[0]}: "
                     f"{agg[f'off@ep{ep}']['verify_ms_per_step'] - base:+.1f} ms "
                     f"({agg[f'off@ep{ep}']['verify_ms_per_step']:.1f} vs {base:.1f} ms)")
    lines.append("\nExpert all-to-all per step on GPUs (tokens x hidden x dtype bytes x 2 per MoE layer):\n")
    lines.append(a2a_table())
    return "\n".join(lines) + "\n"
